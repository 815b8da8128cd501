"""The `verispec` command line."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys
import threading
from pathlib import Path

from verispec import defaults, threads
from verispec.api import as_dtype, check_device, generate, parse_draft_shape, resolve_target
from verispec.audit import AuditConfig, load_prompts, render, render_html, run_audit
from verispec.evaluation import sandbox
from verispec.evaluation.ray_executor import RayExecutorError
from verispec.evaluation.report import sweep_progress, write_report
from verispec.evaluation.store import SweepLockedError
from verispec.evaluation.suites import load_suite
from verispec.evaluation.sweep import run_sweep
from verispec.evaluation.units import SweepSpec
from verispec.jsonsafe import json_safe
from verispec.logprobs import MODES
from verispec.ray_cluster import RayOptions
from verispec.models import MODELS, default_draft
from verispec.models.fit import check_fits, fast_path
from verispec.rules import names, parse, rule_class
from verispec.rules.base import refuse_diagnostics_without_law
from verispec.rules.engines import engine_names, from_engine
from verispec.sampling import SamplingConfig
from verispec.tables import markdown_table, text_table


def k_arg(text: str) -> int | str:
    """--k: a whole number of draft tokens, or 'auto'."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number or auto, got {text!r}") from None


def catalogue_rows() -> list[dict[str, str]]:
    return [rule_class(n).describe() for n in names()]


def cmd_rules(args: argparse.Namespace) -> int:
    if args.from_engine is not None:
        preset = from_engine(args.from_engine, args.engine_flags)
        if args.json:
            print(json.dumps(preset.to_json()))
            return 0
        print(f"{preset.engine} with {preset.flags or 'its defaults'}:")
        print(f"  rule: {preset.rule.spec} ({'lossless' if preset.lossless else 'lossy'}; "
              f"{preset.rule.summary})")
        if preset.k is not None:
            print(f"  draft tokens per block: {preset.k}")
        if preset.sampling:
            print("  sampler settings it applies unless a request overrides them: "
                  + ", ".join(f"{key} {value:g}" for key, value in preset.sampling.items()))
        for note in preset.notes:
            print(f"  note: {note}")
        flags = f" --engine-flags {shlex.quote(args.engine_flags)}" if args.engine_flags else ""
        if preset.rule.block_level and not preset.rule.lossless:
            print(f"  its shift on your pair: verispec serve --target T --draft D --rule "
                  f"'{preset.rule.spec}' --no-diagnostics, then verispec audit --endpoint URL --target T")
        else:
            print(f"  its exact shift on your pair and prompts: verispec run --from-engine {preset.engine}"
                  f"{flags} --target T --draft D --prompt ...")
        return 0
    if args.engine_flags is not None:
        raise ValueError("--engine-flags needs --from-engine ENGINE")
    rows = catalogue_rows()
    cols = list(rows[0]) if args.markdown else ["rule", "family", "lossless", "parameters", "source"]
    table = markdown_table if args.markdown else text_table
    print(table(cols, [[r[c] for c in cols] for r in rows]))
    return 0


def add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--threads", type=str, default=None,
                        help=f"torch threads (default: ${threads.ENV}, else the CPUs this process may use, "
                             "at most the physical cores); a warning says when the machine's load makes "
                             "that slower than one thread")
    parser.add_argument("--target", default=defaults.TARGET,
                        help="named model (default, smollm2-135m) or local path")
    parser.add_argument("--draft", default=defaults.AUTO_DRAFT,
                        help="draft model name/path, self:layers=N, ngram:n=N, none (plain decoding), or "
                             "auto (default: the target's default draft: default-draft for the default "
                             "target, self:layers=8 for smollm2-135m, ngram:n=3 for any other model)")
    parser.add_argument("--device", default="cpu",
                        help="where the models run (cpu, cuda); rule maths run on the CPU")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                        help="the target's compute dtype (default: float32, except the Qwen names, which "
                             "load their fast int4 models unless a dtype is given; a named -int4 or "
                             "-gguf model fixes its own and takes only float32, meaning 'the model's own')")
    parser.add_argument("--draft-dtype", default=None, choices=["float32", "bfloat16", "float16"],
                        help="a separate draft model's compute dtype (default float32, or a Qwen name's "
                             "int4 model as for --dtype; as --dtype for a named -int4 or -gguf draft: the "
                             "rows' draft_dtype float32 then means the model's own: int4 weights with bf16 "
                             "compute, or llama.cpp's quantized weights)")


def resolve_model_args(args: argparse.Namespace, check_memory: bool) -> None:
    """--target/--draft with no dtype: the Qwen names go to their fast int4 models (a note on stderr);
    then, for commands that load the models here (`check_memory`), a pair that cannot fit in the memory
    available now is refused before loading (verispec.models.fit)."""
    args.target, args.dtype, note = fast_path(args.target, args.dtype)
    if note:
        print(f"verispec: {note}", file=sys.stderr)
    draft = default_draft(args.target) if args.draft == defaults.AUTO_DRAFT else args.draft
    fast_draft, args.draft_dtype, note = fast_path(draft, args.draft_dtype)
    if fast_draft != draft:
        args.draft = fast_draft
        print(f"verispec: draft {note}", file=sys.stderr)
    if check_memory:
        loads = [(args.target, args.dtype)]
        if isinstance(draft, str) and draft in MODELS:
            loads.append((fast_draft, args.draft_dtype))
        check_fits(loads)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--from-engine", default=None, choices=engine_names(),
                        help="an engine's speculative settings as verispec's rule "
                             "(docs/design/diagnostics.md, 'Engine presets')")
    parser.add_argument("--engine-flags", default=None, metavar="FLAGS",
                        help="the engine's flags as it spells them, e.g. '--speculative-accept-threshold-"
                             "single 0.5' or 'rejection_sample_method=fly,num_speculative_tokens=8' or JSON")


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--min-p", type=float, default=None)
    parser.add_argument("--eta", type=float, default=None)


def apply_engine_preset(args: argparse.Namespace) -> None:
    """`run --from-engine E --engine-flags F`: the preset's rule, and its k and sampler settings where the
    command line does not set them; `--rule` and `--from-engine` together are refused."""
    if args.from_engine is None:
        if args.engine_flags is not None:
            raise ValueError("--engine-flags needs --from-engine ENGINE")
        args.rule = args.rule or defaults.RULE
        return
    if args.rule is not None:
        raise ValueError("give --rule or --from-engine, not both (the preset is the rule)")
    preset = from_engine(args.from_engine, args.engine_flags)
    args.rule = preset.rule.spec
    if args.k is None and preset.k is not None:
        args.k = preset.k
    for key, value in preset.sampling.items():
        if key == "temperature":  # --temperature has a default: the flags' own temperature wins over it
            if any(name in preset.flags for name in ("temp", "temperature")):
                args.temperature = value
            continue
        if getattr(args, key) is None:
            setattr(args, key, value)


def cmd_run(args: argparse.Namespace) -> int:
    check_device(args.device)  # before loading anything: `cuda` on a CPU-only torch is refused clearly
    apply_engine_preset(args)
    if args.diagnostics and args.tree is None and args.drafts is None:
        refuse_diagnostics_without_law(parse(args.rule))  # a bad spec is refused here too, before loading
    # fails first, clearly, on a bad model
    target = resolve_target(args.target, args.device, as_dtype(args.dtype))
    several = len(args.prompt) > 1
    results = generate(
        args.prompt if several else args.prompt[0], target=target, draft=args.draft, rule=args.rule, k=args.k,
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        min_p=args.min_p, eta=args.eta, seed=args.seed, chat=args.chat, device=args.device, dtype=args.dtype,
        draft_dtype=args.draft_dtype, batch_size=args.batch_size, tree=args.tree, drafts=args.drafts,
        diagnostics=args.diagnostics,
    )
    for result in results if several else [results]:  # several prompts: one JSON object per line
        if args.json:
            print(json.dumps(json_safe(result.to_json())))
            continue
        s = result.stats
        print(result.text)
        shift = (f"mean TV to target {s['mean_tv']:.4f} | log-ratio vs target {s.get('log_ratio', 0):.3f}"
                 if "mean_tv" in s else "diagnostics off")
        print(
            f"\n[{s['rule']}] {s['tokens']} tokens | acceptance {s['acceptance_rate']:.3f} | "
            f"block efficiency {s['block_efficiency']:.2f} tokens/target call | "
            f"{s['tokens_per_second']:.1f} tokens/s | {shift}",
            file=sys.stderr if args.quiet_stats else sys.stdout,
        )
    return 0


DEMO_RULES = ("speccascade:min_p=0.1", "typical:eps=0.09,alpha=0.3", "lenience:l=0.5", "cos:w=0.5",
              "budget:tv=0.05,ratio=2")


def print_report(results: str, html: str | None = None, markdown: bool = False,
                 columns: list[str] | None = None, looks_taken: int = 1, problems: int | None = None,
                 brief: bool = False) -> int:
    """Print a sweep's report table and write its HTML report (the path is printed); `brief`: the
    demo's story and compact table instead of every table."""

    table, html_path = write_report(results, html, markdown, columns, looks_taken, problems, brief=brief)
    print(table)
    print(f"\nHTML report: {html_path.resolve()}")
    return 0


class Terminated(Exception):
    """SIGTERM during `bench` (a sweep started in the background ignores SIGINT, so `kill PID` is how
    it is stopped): unwinds like Ctrl-C, so the lock is released and every finished row stays."""


def _terminate(signum, frame) -> None:
    raise Terminated()


def shape_spec(text: str) -> str:
    """A bench --tree value as a draft shape spec: tree:widths=4,2,2,1 / tree:nodes=16,depth=5,topk=4 /
    drafts:n=3 as given, and the run command's short forms widths=4,2,2,1 / nodes=... / n=3 completed."""
    return parse_draft_shape(text).spec


def cmd_bench(args: argparse.Namespace) -> int:
    spec = SweepSpec(suite=args.suite, target=args.target, draft=args.draft, rules=tuple(args.rules),
                     temperatures=tuple(args.temperatures), ks=tuple(args.k), seeds=tuple(args.seeds),
                     limit=args.limit, max_new_tokens=args.max_new_tokens, device=args.device,
                     dtype=args.dtype, draft_dtype=args.draft_dtype, compare=tuple(args.compare or ()),
                     sequential=args.sequential, trees=tuple(shape_spec(t) for t in args.tree or ()))
    if args.unsafe_no_sandbox:  # an environment variable, so that worker processes inherit the choice
        os.environ[sandbox.UNSAFE_ENV] = "1"
    ray_options = None
    ray_flags = {"--ray-address": args.ray_address, "--workers": args.workers, "--ray-cpus": args.ray_cpus,
                 "--max-restarts": args.max_restarts}
    if args.executor == "ray":
        ray_options = RayOptions(address=args.ray_address, workers=args.workers,
                                 worker_cpus=1.0 if args.ray_cpus is None else args.ray_cpus,
                                 max_restarts=args.max_restarts or 0)
    elif any(v is not None for v in ray_flags.values()):
        given = ", ".join(flag for flag, v in ray_flags.items() if v is not None)
        raise ValueError(f"{given}: only with --executor ray")
    if args.executor == "ray" and not args.no_progress:
        print("bench: starting the Ray workers (each loads the model pair) ...", file=sys.stderr)
    main_thread = threading.current_thread() is threading.main_thread()  # signal handlers live there
    previous = signal.signal(signal.SIGTERM, _terminate) if main_thread else None  # `kill PID` = Ctrl-C
    try:
        path = run_sweep(spec, args.out, resume=args.resume, progress=not args.no_progress,
                         batch_size=args.batch_size, executor=args.executor, ray_options=ray_options,
                         reuse_from=args.reuse_from, reuse_plain=args.reuse_plain, chunk=args.chunk)
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
    print(f"results: {path.resolve()}", file=sys.stderr)
    return 0 if args.no_report else print_report(args.out)


def cmd_report(args: argparse.Namespace) -> int:
    if args.progress:
        print(sweep_progress(args.dir, args.problems))
        return 0
    columns = None if args.columns is None else [c.strip() for c in args.columns.split(",")]
    return print_report(args.dir, args.html, args.markdown, columns, args.looks_taken, args.problems)


def cmd_demo(args: argparse.Namespace) -> int:
    spec = SweepSpec(suite="shakespeare", target="default", draft="default-draft", rules=DEMO_RULES,
                     temperatures=(1.0,), ks=(4,), seeds=(0, 1), limit=args.prompts, max_new_tokens=48)
    print(f"verispec demo: {len(spec.configs())} configs x {args.prompts} prompts x 2 seeds on the "
          f"default pair (resumes if {args.out} already holds this sweep)", file=sys.stderr)
    run_sweep(spec, args.out, resume=True, progress=not args.no_progress, batch_size=8)
    return print_report(args.out, brief=not args.full)


def cmd_audit(args: argparse.Namespace) -> int:
    if (args.endpoint is None) == (args.engine == "endpoint"):
        raise ValueError("--endpoint URL audits a server; --engine transformers-assisted runs in this "
                         "process and takes no --endpoint")
    if (args.prompts is None) == (args.suite is None):
        raise ValueError("give the prompts: --prompts FILE or --suite NAME (one of them)")
    chat = args.chat
    if args.prompts is not None:
        prompts = load_prompts(args.prompts)
    else:
        suite = load_suite(args.suite)
        prompts = [item.prompt for item in suite.items]
        chat = suite.chat if chat is None else chat
    try:
        extra = json.loads(args.extra_body) if args.extra_body else {}
    except ValueError as err:
        raise ValueError(f"--extra-body must be a JSON object: {err}") from None
    if not isinstance(extra, dict):
        raise ValueError("--extra-body must be a JSON object, e.g. '{\"return_token_ids\": true}'")
    settings = tuple(SamplingConfig(t, args.top_k, args.top_p, args.min_p) for t in args.temperature)
    config = AuditConfig(endpoint=args.endpoint, target=args.target, prompts=prompts, samples=args.samples,
                         settings=settings, max_tokens=args.max_tokens, seed=args.seed, alpha=args.alpha,
                         control=args.control, model=args.model, extra=extra, chat=chat, engine=args.engine,
                         assistant_layers=args.assistant_layers, neutral=not args.engine_defaults,
                         dtype=as_dtype(args.dtype), timeout=args.timeout, draft=args.draft)
    if args.candidate_rules is not None:
        if args.draft is None:
            raise ValueError("--candidate-rules needs --draft (a rule's law needs the draft's)")
        config.candidate_rules = tuple(args.candidate_rules)
    report = run_audit(config, progress=not args.no_progress)
    print(json.dumps(json_safe(report), indent=1) if args.json else render(report))
    if args.html:
        Path(args.html).write_text(render_html(report), encoding="utf-8")
        print(f"HTML report: {Path(args.html).resolve()}", file=sys.stderr)
    return 0 if report["conforms"] else 1


def cmd_serve(args: argparse.Namespace) -> int:
    from verispec.serving.config import ServeConfig, check_port

    # every setting is checked before anything loads or listens (ValueError: a clear message, exit 2)
    check_port(args.port)
    config = ServeConfig(
        target=args.target, draft=args.draft, rule=args.rule, k=args.k,
        allow_rules=tuple(args.allow_rules) if args.allow_rules else None,
        max_tv_per_token=args.max_tv_per_token, max_tv_per_response=args.max_tv_per_response,
        allow_greedy_sampling=args.allow_greedy_sampling, max_n=args.max_n,
        max_queue=args.max_queue, max_batch=32 if args.max_batch is None else args.max_batch,
        max_batch_auto=args.max_batch is None, max_tokens_limit=args.max_tokens_limit,
        metrics_names=args.metrics_names, logprobs_mode=args.logprobs_mode,
        prefill_chunk=args.prefill_chunk, max_prompt_tokens=args.max_prompt_tokens,
        default_max_tokens=args.default_max_tokens, diagnostics=args.diagnostics, device=args.device,
        dtype=args.dtype, draft_dtype=args.draft_dtype, served_model_name=args.served_model_name,
        shutdown_grace=args.shutdown_grace, tree=args.tree, max_tree_nodes=args.max_tree_nodes,
        max_body_bytes=args.max_body_bytes, body_timeout=args.body_timeout,
        api_key=args.api_key if args.api_key is not None else os.environ.get("VERISPEC_API_KEY") or None,
        allowed_origins=tuple(args.allowed_origins or ()),
    )
    if not args.ray:
        for flag, value in (("--replicas", args.replicas), ("--ray-address", args.ray_address),
                            ("--ray-cpus", args.ray_cpus), ("--ray-deploy-timeout", args.ray_deploy_timeout)):
            if value is not None:
                raise ValueError(f"{flag} applies to Ray Serve only: add --ray")
        check_device(args.device)
        from verispec.serving.app import serve  # the serve extra (fastapi, uvicorn)

        serve(config, host=args.host, port=args.port, log_level=args.log_level)
        return 0
    from verispec.serving.ray import RayServeError, serve_on_ray  # the ray extra

    timeout = 600.0 if args.ray_deploy_timeout is None else args.ray_deploy_timeout
    options = RayOptions(workers=1 if args.replicas is None else args.replicas, address=args.ray_address,
                         worker_cpus=1.0 if args.ray_cpus is None else args.ray_cpus, ready_timeout_s=timeout)
    try:
        serve_on_ray(config, options, host=args.host, port=args.port, log_level=args.log_level)
    except RayServeError as err:  # Ray missing, no cluster, too few CPUs, a replica that cannot start
        print(f"verispec: error: {err}", file=sys.stderr)
        return 1
    return 0


class DeprecatedFlag(argparse.Action):
    """An old spelling of a flag: still works, with a warning naming the new one."""

    def __init__(self, option_strings, dest, new: str, **kwargs):
        super().__init__(option_strings, dest, **kwargs)
        self.new = new

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"verispec: warning: {option_string} is deprecated; use {self.new} (the same flag for bench "
              "and serve)", file=sys.stderr)
        setattr(namespace, self.dest, values)


def add_ray_args(parser, command: str) -> None:
    """The Ray flags `bench --executor ray` and `serve --ray` share (`verispec.ray_cluster.RayOptions`)."""
    parser.add_argument("--ray-address", default=None,
                        help="the Ray cluster: auto (the one `ray start --head` runs on this machine), "
                             "HOST:PORT, or ray://HOST:10001 (Ray Client); default: $RAY_ADDRESS, else a new "
                             "local Ray instance sized to this machine")
    parser.add_argument("--ray-cpus", type=float, default=None,
                        help=f"CPUs Ray reserves for each {'worker' if command == 'bench' else 'replica'}, "
                             "and its torch threads (default 1)")
    old = {"bench": [("--address", "ray_address", str, "--ray-address"),
                     ("--worker-cpus", "ray_cpus", float, "--ray-cpus")],
           "serve": [("--num-cpus-per-replica", "ray_cpus", float, "--ray-cpus")]}[command]
    for flag, dest, kind, new in old:
        parser.add_argument(flag, dest=dest, type=kind, action=DeprecatedFlag, new=new, default=None,
                            help=f"deprecated: {new}")


class _Parser(argparse.ArgumentParser):
    """argparse with verispec's one error format: `verispec: error: ...` on stderr, exit status 2."""

    def error(self, message: str):
        print(f"verispec: error: {self.prog}: {message} (see `{self.prog} --help`)", file=sys.stderr)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="verispec", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    rules = sub.add_parser("rules", help="print the catalogue of verification rules")
    rules.add_argument("--markdown", action="store_true", help="print the README's markdown table")
    add_engine_args(rules)
    rules.add_argument("--json", action="store_true", help="--from-engine: print the preset as JSON")
    rules.set_defaults(func=cmd_rules)

    run = sub.add_parser("run", help="generate with speculative decoding and print the text and stats")
    add_model_args(run)
    run.add_argument("--rule", default=None,
                     help=f"rule spec, e.g. lenience:l=0.5 (see `verispec rules`; default {defaults.RULE})")
    add_engine_args(run)
    run.add_argument("--prompt", required=True, action="append",
                     help="the prompt; repeat it for several prompts, decoded together "
                          "(prompt i uses seed + i)")
    run.add_argument("--batch-size", type=int, default=defaults.BATCH_SIZE,
                     help="rows decoded together with several prompts")
    run.add_argument("--max-new-tokens", type=int, default=defaults.MAX_NEW_TOKENS)
    run.add_argument("--k", type=k_arg, default=None,
                     help=f"draft tokens per block (default {defaults.K}), or auto: chosen per block from "
                          "measured costs (verispec.speculation); not with a --tree that fixes its depth")
    shapes = run.add_mutually_exclusive_group()
    shapes.add_argument("--tree", default=None, metavar="WIDTHS",
                        help="draft a token tree per block: static top-k, e.g. --tree widths=4,2,2,1, or "
                             "EAGLE-2's dynamic tree, e.g. --tree nodes=16,depth=5,topk=4 (--rule is then "
                             "a tree rule: lossless, greedy, lenience:l=, ..., traversal)")
    shapes.add_argument("--drafts", default=None, metavar="SPEC",
                        help="draft n sampled chains of k tokens per block, e.g. "
                             "--drafts n=3[,replacement=0]")
    add_sampling_args(run)
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                     help="wrap the prompt in the tokenizer's chat template (default: when it has one)")
    run.add_argument("--diagnostics", action=argparse.BooleanOptionalAction, default=True,
                     help="exact per-token shift statistics (on by default; a lossy block rule, fly, has "
                          "no per-position law and needs --no-diagnostics)")
    run.add_argument("--json", action="store_true", help="print one JSON object (ids, text, stats)")
    run.add_argument("--quiet-stats", action="store_true", help="print the stats line to stderr")
    run.set_defaults(func=cmd_run)

    bench = sub.add_parser("bench", help="sweep rules x temperatures x k x seeds over a suite, then report")
    add_model_args(bench)
    bench.add_argument("--suite", default="shakespeare",
                       help="shakespeare, capitals, arithmetic, humaneval, humaneval-sanitized, mtbench, "
                            "graded, graded-steps, graded-steps-heldout, gsm8k:PATH, math:PATH, mbpp:PATH, "
                            "mbpp-sanitized:PATH")
    bench.add_argument("--rules", nargs="+", default=["lossless"],
                       help="rule specs; plain, lossless and honest truncation baselines are always added")
    bench.add_argument("--temperatures", nargs="+", type=float, default=[1.0])
    bench.add_argument("--k", nargs="+", type=int, default=[4])
    bench.add_argument("--tree", nargs="+", default=None, metavar="SHAPE",
                       help="tree / multi-draft shapes as an axis, e.g. tree:widths=4,2,2,1 "
                            "tree:nodes=16,depth=5,topk=4 drafts:n=3: each runs lossless and the --rules "
                            "that are tree rules (traversal too)")
    bench.add_argument("--seeds", nargs="+", type=int, default=[0])
    bench.add_argument("--limit", type=int, default=None, help="use the first N prompts of the suite")
    bench.add_argument("--max-new-tokens", type=int, default=None, help="default: the suite's own")
    bench.add_argument("--out", required=True,
                       help="output directory (results.jsonl, sweep.json, report.html)")
    bench.add_argument("--resume", action="store_true", help="continue an interrupted sweep in --out")
    bench.add_argument("--batch-size", type=int, default=8,
                       help="(prompt, seed) rows decoded together per configuration (default 8); changes "
                            "timings, not results: speedups compare SD and plain at the same batch size")
    bench.add_argument("--chunk", type=int, default=None, metavar="N",
                       help="(prompt, seed) rows per work unit, decoded --batch-size at a time by "
                            "continuous batching: a finished row's slot goes to the next row, so the batch "
                            "stays full when replies end at different lengths (default: the batch size, a "
                            "static batch); every configuration still runs on a unit's rows back to back. "
                            "Timings, not results")
    bench.add_argument("--reuse-from", nargs="+", default=None, metavar="DIR",
                       help="copy the rows other sweeps already decoded for the same units (same models, "
                            "dtypes, device, prompts, seeds and configurations) instead of decoding them "
                            "again; plain decoding is re-run (unless --reuse-plain), so speedups stay "
                            "measured in this run")
    bench.add_argument("--reuse-plain", action="store_true",
                       help="with --reuse-from: copy plain decoding's rows too (a rule added for its "
                            "quality alone; the rows decoded here then have no speedup)")
    bench.add_argument("--compare", nargs="+", default=None, metavar="A:B",
                       help="planned comparisons, declared up front and stored in sweep.json (a resume "
                            "repeats them): A - B on the score (A, B rule specs, plain, or config ids such "
                            "as 'lossless k=4 T=1'; 'A vs B' where colons are ambiguous); the report tests "
                            "them clustered by problem, Holm-corrected over this family")
    bench.add_argument("--sequential", default=None, metavar="KIND:LOOKS",
                       help="a group-sequential design for interim looks at the planned comparisons: "
                            "pocock:K or obf:K (O'Brien-Fleming), K planned looks")
    bench.add_argument("--unsafe-no-sandbox", action="store_true",
                       help="run an execution-scored suite's generated programs without the bubblewrap "
                            "sandbox (resource limits only: they can read and write what this user can); "
                            "without this flag a code suite is refused where bubblewrap cannot start")
    bench.add_argument("--no-progress", action="store_true")
    bench.add_argument("--no-report", action="store_true")
    bench.add_argument("--executor", choices=["local", "ray"], default="local",
                       help="local: decode in this process (default); ray: Ray actors, each holding the "
                            "model pair, decode the units and this process writes the rows (needs "
                            "pip install \"verispec[ray]\"); same rows either way, and --resume works "
                            "across executors")
    bench.add_argument("--workers", type=int, default=None,
                       help="with --executor ray: workers (actors) to start; default: as many as the "
                            "cluster's free CPUs fit (free GPUs too with --device cuda)")
    add_ray_args(bench.add_argument_group("with --executor ray"), "bench")
    bench.add_argument("--max-restarts", type=int, default=None,
                       help="with --executor ray: times Ray may restart a dead worker (default 0); its units "
                            "are redone by the other workers either way")
    bench.set_defaults(func=cmd_bench)

    report = sub.add_parser("report", help="terminal table and self-contained HTML report of a sweep")
    report.add_argument("dir", help="a sweep's output directory (or its results.jsonl)")
    report.add_argument("--html", default=None, help="where to write the HTML (default: DIR/report.html)")
    report.add_argument("--markdown", action="store_true",
                        help="print the table as GitHub markdown (for a README or a paper's notes)")
    report.add_argument("--columns", default=None, metavar="NAMES",
                        help="print only these columns, by header name, comma-separated "
                             "(e.g. 'config,n,speedup,TV,score'); the HTML keeps every column")
    report.add_argument("--progress", action="store_true",
                        help="only how far the sweep is: rows per configuration and the problems each "
                             "declared comparison has paired, against its sequential looks; no outcome "
                             "(so checking a sweep in progress spends no look)")
    report.add_argument("--looks-taken", type=int, default=1, metavar="N",
                        help="how many times this fixed-design sweep's comparisons have been read, this "
                             "reading included: thresholds are divided by N and Holm p multiplied by N "
                             "(Bonferroni over looks taken without a declared --sequential design)")
    report.add_argument("--problems", type=int, default=None, metavar="N",
                        help="read only the suite's first N problems (the rows beyond are left out): a "
                             "sequential look taken at its planned number of problems after the sweep "
                             "went past it")
    report.set_defaults(func=cmd_report)

    demo = sub.add_parser("demo",
                          help="a small sweep on the default pair, then the report (a few minutes on CPU)")
    demo.add_argument("--out", default="verispec-demo")
    demo.add_argument("--prompts", type=int, default=8)
    demo.add_argument("--no-progress", action="store_true")
    demo.add_argument("--full", action="store_true",
                      help="print every table, not the story and the compact table")
    demo.set_defaults(func=cmd_demo)
    srv = sub.add_parser("serve", help="OpenAI-compatible server; every response carries its "
                                       "verification report")
    add_model_args(srv)
    srv.add_argument("--rule", default="lossless",
                     help="the server's default rule (a request may name its own)")
    srv.add_argument("--k", type=k_arg, default=4,
                     help="default draft tokens per block, or auto: each row's k per block (0 = plain) from "
                          "the pair's pass costs measured at start and the row's acceptance so far, at the "
                          "current batch size (a request's own verification.k pins its k)")
    srv.add_argument("--tree", default=None, metavar="SHAPE",
                     help="the default draft shape, e.g. tree:widths=4,2,2,1 or drafts:n=3 (--rule is then a "
                          "tree rule); a request may name its own in verification.tree, or 'none' for chains")
    srv.add_argument("--max-tree-nodes", type=int, default=64,
                     help="the most drafted nodes a tree block may have (default 64)")
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--allow-rules", nargs="+", default=None, metavar="RULE",
                     help="rule names, families (lossless, truncation, collaborative, bounded, baseline) "
                          "or specs a request may use; others get 400 (default: all)")
    srv.add_argument("--max-tv-per-token", type=float, default=None,
                     help="refuse rules that cannot certify this per-token TV to the target (lossless and "
                          "budget:tv<=X can)")
    srv.add_argument("--max-tv-per-response", type=float, default=None,
                     help="refuse requests whose certified TV of the whole response (per-token bound x "
                          "max_tokens, capped at 1) exceeds this")
    srv.add_argument("--allow-greedy-sampling", action="store_true",
                     help="allow rule 'greedy' at temperature > 0 (it returns argmax text, ignoring the "
                          "temperature; refused by default)")
    srv.add_argument("--max-n", type=int, default=8, help="largest n (choices per request)")
    srv.add_argument("--shutdown-grace", type=float, default=10.0,
                     help="seconds decoding requests get to finish after SIGTERM; then they (and every "
                          "waiting request, at once) are answered 503 shutting_down")
    srv.add_argument("--max-queue", type=int, default=64,
                     help="requests waiting beyond the free batch rows; more get 503")
    srv.add_argument("--max-batch", type=int, default=None,
                     help="rows decoding at once (default 32, or fewer where the backend's batched sessions "
                          "hold fewer: the llama.cpp backend's 8)")
    srv.add_argument("--max-tokens-limit", type=int, default=1024,
                     help="largest max_tokens a request may ask")
    srv.add_argument("--metrics-names", choices=["verispec", "vllm"], default="verispec",
                     help="/metrics names: verispec:... (default) or vLLM's vllm:..., so dashboards written "
                          "for vLLM's spec-decode metrics read this server")
    srv.add_argument("--prefill-chunk", type=int, default=256,
                     help="a prompt longer than this is fed this many tokens per engine step, between the "
                          "other requests' blocks (so it cannot hold them up, and a client that leaves stops "
                          "it at the next chunk); 0: in one pass (default 256)")
    srv.add_argument("--max-prompt-tokens", type=int, default=None,
                     help="longest prompt accepted, in tokens (default: the model's context)")
    srv.add_argument("--logprobs-mode", default="raw_logprobs",
                     choices=list(MODES),
                     help="what OpenAI's logprobs fields show, as vLLM's option: the raw model's log-probs "
                          "(default), the processed target's (the sampling settings applied: the law "
                          "lossless decoding draws from), or the logits before / after processing; "
                          "verispec's behaviour_logprobs and processed_logprobs are always there too")
    srv.add_argument("--default-max-tokens", type=int, default=None,
                     help="max_tokens of a request that gives none (default, as vLLM: the context left "
                          "after the prompt, at most --max-tokens-limit)")
    srv.add_argument("--max-body-bytes", type=int, default=8 * 2**20,
                     help="largest request body; a larger one gets 413 before it is read (default 8 MiB)")
    srv.add_argument("--api-key", default=None,
                     help="require 'Authorization: Bearer KEY' on every request but /health "
                          "(default: $VERISPEC_API_KEY; unset: no key)")
    srv.add_argument("--allowed-origins", nargs="+", default=None, metavar="ORIGIN",
                     help="CORS: browser origins allowed to call the API, e.g. https://app.example "
                          "('*': any)")
    srv.add_argument("--body-timeout", type=float, default=30.0,
                     help="seconds a client has to send its request body; then 408 (default 30)")
    srv.add_argument("--diagnostics", action=argparse.BooleanOptionalAction, default=True,
                     help="exact per-token diagnostics (the fidelity half of the report; on by default)")
    srv.add_argument("--served-model-name", default=None, help="the model id clients use (default: --target)")
    srv.add_argument("--log-level", default="info")
    on_ray = srv.add_argument_group("Ray Serve (pip install \"verispec[ray]\")")
    on_ray.add_argument("--ray", action="store_true",
                     help="serve as a Ray Serve deployment: --replicas copies of the server, each with its "
                          "own models and engine, behind Ray Serve's HTTP proxy on --host/--port")
    on_ray.add_argument("--replicas", type=int, default=None, help="replicas (default 1)")
    add_ray_args(on_ray, "serve")
    on_ray.add_argument("--ray-deploy-timeout", type=float, default=None,
                     help="seconds for every replica to load the models and start (default 600)")
    srv.set_defaults(func=cmd_serve)
    add_audit_parser(sub)
    return parser


def add_audit_parser(sub) -> None:
    audit = sub.add_parser("audit", help="test whether a serving endpoint samples the law it claims "
                                         "(exit 0: conforms, 1: does not, 2: could not run)")
    audit.add_argument("--endpoint", default=None,
                       help="an OpenAI-compatible server, e.g. http://127.0.0.1:8000")
    audit.add_argument("--engine", default="endpoint", choices=["endpoint", "transformers-assisted"],
                       help="endpoint (default): the server at --endpoint; transformers-assisted: "
                            "transformers' generate(assistant_model=...) in this process, on --target's "
                            "own weights")
    audit.add_argument("--assistant-layers", type=int, default=8,
                       help="transformers-assisted: the assistant is --target cut to its first N layers")
    audit.add_argument("--engine-defaults", action="store_true",
                       help="transformers-assisted: keep the model's generation_config sampler defaults "
                            "(transformers' top_k=50 among them) instead of neutralising them")
    audit.add_argument("--target", required=True, help="the reference: the model the endpoint serves "
                                                        "(a named model, HF directory or GGUF)")
    audit.add_argument("--model", default=None,
                       help="the model id to request (default: the endpoint's first)")
    given = audit.add_mutually_exclusive_group()
    given.add_argument("--prompts", default=None, metavar="FILE",
                       help="prompts: JSONL with a \"prompt\" field, or one prompt a line")
    given.add_argument("--suite", default=None, help="a suite's prompts (verispec suites)")
    audit.add_argument("--samples", type=int, default=200, help="replies per sampling setting (default 200)")
    audit.add_argument("--temperature", type=float, nargs="+", default=[1.0])
    audit.add_argument("--top-k", type=int, default=None)
    audit.add_argument("--top-p", type=float, default=None)
    audit.add_argument("--min-p", type=float, default=None)
    audit.add_argument("--max-tokens", type=int, default=64)
    audit.add_argument("--seed", type=int, default=0, help="the first reply's seed (then +1 a reply)")
    audit.add_argument("--alpha", type=float, default=0.01, help="the test's level (Holm over 5 statistics)")
    audit.add_argument("--html", default=None, metavar="PATH",
                       help="also write the report as one HTML page (the sweep report's style)")
    audit.add_argument("--draft", default=None,
                       help="the engine's draft model: lossy rules' exact laws join the best-fit candidates")
    audit.add_argument("--candidate-rules", nargs="+", default=None, metavar="RULE",
                       help="with --draft: the rules to rank (default: a min-p gate, typical, lenience, CoS, "
                            "SGLang's and TensorRT-LLM's thresholds at their README settings)")
    audit.add_argument("--control", default=None, metavar="URL",
                       help="the same engine with speculation off: audited alike, to tell numerics from "
                            "speculation")
    audit.add_argument("--extra-body", default=None, metavar="JSON",
                       help="more request fields, e.g. '{\"return_token_ids\": true}' for vLLM")
    audit.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                       help="wrap prompts in the reference tokenizer's chat template (default: as the suite)")
    audit.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    audit.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    audit.add_argument("--json", action="store_true", help="print the report as JSON")
    audit.add_argument("--no-progress", action="store_true")
    audit.set_defaults(func=cmd_audit)


def _message(err: BaseException) -> str:
    if isinstance(err, OSError) and err.strerror and err.filename and str(err.filename) not in err.strerror:
        return f"{err.strerror}: {err.filename}"  # e.g. "Permission denied: runs/x/results.jsonl"
    return str(err)


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exit:  # --help (0) or a usage error (2, already printed)
        return exit.code if isinstance(exit.code, int) else 2
    try:
        if hasattr(args, "threads"):
            count = threads.configure_threads(args.threads)
            warning = threads.check_threads(count)
            if warning:
                print(f"verispec: warning: {warning}", file=sys.stderr)
        if hasattr(args, "draft_dtype"):  # the commands with model arguments: run, bench, serve
            resolve_model_args(args, check_memory=args.func is not cmd_bench)
        code = args.func(args)
        sys.stdout.flush()  # a block-buffered pipe's last write happens here, inside the handlers
        return code
    except (KeyboardInterrupt, Terminated) as stop:  # Ctrl-C / kill: no traceback; finished rows are on disk
        hint = " (every finished row is saved: the same command with --resume continues)" if (
            getattr(args, "func", None) is cmd_bench) else ""
        how = "terminated" if isinstance(stop, Terminated) else "interrupted"
        print(f"verispec: {how}{hint}", file=sys.stderr)
        return 143 if isinstance(stop, Terminated) else 130  # 128 + SIGTERM / SIGINT
    except BrokenPipeError:  # `verispec report DIR | head`: the reader left; no error message, as `cat`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        return 141  # 128 + SIGPIPE, the shell's status for a process killed by a broken pipe
    except (ValueError, OverflowError, OSError, MemoryError, SweepLockedError, RayExecutorError,
            sandbox.SandboxUnavailable) as err:
        # bad input or an unusable file/directory/device: a clear message, no traceback, nothing on stdout
        print(f"verispec: error: {_message(err)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
