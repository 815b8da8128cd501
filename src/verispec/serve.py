"""`verispec serve`: an OpenAI-compatible server whose every response carries its verification report.

Endpoints: `/v1/completions`, `/v1/chat/completions`, `/v1/models`, `/health`, `/metrics` (Prometheus).
Every response (the last chunk when streaming) carries `verification`: the object
`verispec.decode.verification_report` builds for the generation (the same as
`verispec.generate(...).stats["verification"]` and `verispec run --json`), plus `seed` (to reproduce it).

Engine (`Engine`): one thread owns the models and drives `BatchDecoder`s. A `BatchDecoder` has one rule
and one sampling setting, so requests are grouped by (rule, sampling settings): one decoder per group,
k per row; the engine steps the non-empty groups in turn (one block each), so requests join and leave
between blocks. Each request draws from its own `torch.Generator` seeded by its `seed`, so its output
is what it would be alone (the batch-independence contract of `BatchDecoder`, up to float rounding
of batched forward passes). Requests wait in a bounded queue (`max_queue`: 503 with Retry-After when
full); at most `max_batch` rows decode at once. A client that disconnects frees its row at the next
block; at shutdown the engine finishes what uvicorn's graceful shutdown lets finish, then cancels the rest.

`verispec serve --ray` (`verispec.serve_ray`) runs this same app in each replica of a Ray Serve deployment.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import json
import logging
import math
import secrets
import threading
import time
from collections import deque
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import torch
from fastapi import FastAPI, Request  # the `serve` extra: pip install "verispec[serve]"
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from verispec.decode import BatchDecoder, DecodeConfig, Generation
from verispec.rules import Rule, parse
from verispec.sampling import SamplingConfig

log = logging.getLogger(__name__)

MAX_SEED = 2**63 - 1


@dataclass(frozen=True)
class ServeConfig:
    """Server settings (the `verispec serve` flags)."""

    target: str = "default"
    draft: str | None = None  # None: the target's default drafter; "none": plain decoding
    rule: str = "lossless"  # the server's default rule
    k: int = 4  # the default draft tokens per block
    allow_rules: tuple[str, ...] | None = None  # rule names, families or full specs; None: all
    max_tv_per_token: float | None = None  # refuse rules that cannot certify this per-token TV
    max_queue: int = 64  # requests waiting to join the batch
    max_batch: int = 32  # rows decoding at once, over all groups
    max_tokens_limit: int = 1024  # largest max_tokens accepted
    default_max_tokens: int = 64
    max_k: int = 16
    diagnostics: bool = True
    device: str = "cpu"
    dtype: str = "float32"
    draft_dtype: str = "float32"
    served_model_name: str | None = None  # default: the target's name


class APIError(Exception):
    """An error returned to the client in OpenAI's shape."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


# -- operator guardrails ---------------------------------------------------------------------------


def certifiable_tv(rule: Rule | None) -> float | None:
    """The per-token TV to the target a rule certifies whatever the prefix: 0 for lossless rules and
    plain decoding, `tv` for `budget`, None (no bound) for the others."""
    if rule is None or rule.lossless is True:
        return 0.0
    if rule.name == "budget":
        return float(rule.tv)
    return None


def check_policy(rule: Rule | None, config: ServeConfig) -> None:
    """Raise APIError (400) if the operator's guardrails refuse `rule` (None: plain decoding)."""
    if rule is None:
        return
    if config.allow_rules is not None:
        allowed = set(config.allow_rules)
        if not ({rule.name, rule.family, rule.spec} & allowed):
            raise APIError(400, f"rule '{rule.spec}' is not allowed on this server; allowed rules "
                                f"(names, families or specs): {', '.join(config.allow_rules)}",
                           "verification.rule", "rule_not_allowed")
    cap = config.max_tv_per_token
    if cap is not None:
        tv = certifiable_tv(rule)
        if tv is None or tv > cap:
            raise APIError(400, f"rule '{rule.spec}' cannot certify a per-token TV to the target <= {cap:g} "
                                f"(this server's --max-tv-per-token); use e.g. 'budget:tv={cap:g},ratio=2' "
                                "or 'lossless'", "verification.rule", "rule_not_certifiable")


# -- request parsing -------------------------------------------------------------------------------


@dataclass
class Params:
    """A validated request."""

    prompt_ids: list[int]
    rule: Rule | None
    k: int
    max_tokens: int
    sampling: SamplingConfig
    seed: int
    stop: list[str]
    stream: bool
    model: str
    ignore_eos: bool = False  # vLLM's extra field: run to max_tokens


def _number(body: dict, key: str, kind=float, lo: float | None = None, hi: float | None = None,
            lo_open: bool = False, default=None):
    value = body.get(key, default)
    if value is None:
        return default
    ok_type = isinstance(value, int) if kind is int else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok_type:
        what = "an integer" if kind is int else "a number"
        raise APIError(400, f"'{key}' must be {what}, got {value!r}", key)
    if not math.isfinite(value):
        raise APIError(400, f"'{key}' must be finite, got {value!r}", key)
    if lo is not None and (value <= lo if lo_open else value < lo):
        raise APIError(400, f"'{key}' must be {'>' if lo_open else '>='} {lo}, got {value!r}", key)
    if hi is not None and value > hi:
        raise APIError(400, f"'{key}' must be <= {hi}, got {value!r}", key)
    return kind(value)


def _token_list(value) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


class Server:
    """The models, the engine, the metrics and the request handling of one `verispec serve`."""

    def __init__(self, config: ServeConfig, target=None, drafter=None):
        from verispec.api import as_dtype, resolve_drafter, resolve_target
        from verispec.models import default_draft

        self.config = config
        self.target = target if target is not None else resolve_target(config.target, config.device,
                                                                        as_dtype(config.dtype))
        if target is None:
            draft = config.draft if config.draft is not None else default_draft(config.target)
            drafter = resolve_drafter(draft, self.target, config.device, as_dtype(config.draft_dtype))
        self.drafter = drafter
        self.plain = drafter is None
        self.model_name = config.served_model_name or getattr(self.target, "name", None) or config.target
        self.context = getattr(getattr(getattr(self.target, "model", None), "config", None),
                               "max_position_embeddings", None)
        if not isinstance(config.k, int) or not 1 <= config.k <= config.max_k:
            raise ValueError(f"k must be an integer in [1, {config.max_k}], got {config.k!r}")
        self.default_rule = None if self.plain else parse(config.rule)
        try:
            check_policy(self.default_rule, config)
        except APIError as err:
            raise ValueError(f"the default rule is refused by the server's own guardrails: "
                             f"{err.message}") from None
        self.metrics = Metrics(config.k)
        self.engine = Engine(self)

    # -- parsing ------------------------------------------------------------------------------------
    def parse_rule(self, body: dict) -> tuple[Rule | None, int]:
        ver = body.get("verification")
        if ver is None:
            ver = {}
        if not isinstance(ver, dict):
            raise APIError(400, "'verification' must be an object like {\"rule\": \"lossless\", \"k\": 4}",
                           "verification")
        unknown = set(ver) - {"rule", "k"}
        if unknown:
            raise APIError(400, f"unknown 'verification' fields: {', '.join(sorted(unknown))} "
                                "(known: rule, k)", "verification")
        k = _number(ver, "k", int, 1, self.config.max_k, default=self.config.k)
        spec = ver.get("rule")
        if spec is None:
            return self.default_rule, k
        if not isinstance(spec, str):
            raise APIError(400, f"'verification.rule' must be a rule spec string, got {spec!r}",
                           "verification.rule", "invalid_rule")
        if self.plain:
            if spec in ("lossless", "plain"):
                return None, k
            raise APIError(400, "this server runs plain decoding (--draft none): no verification rule "
                                f"applies, got '{spec}'", "verification.rule", "rule_not_allowed")
        try:
            rule = parse(spec)
        except (ValueError, KeyError) as err:
            raise APIError(400, f"bad rule spec '{spec}': {err}", "verification.rule",
                           "invalid_rule") from None
        check_policy(rule, self.config)
        return rule, k

    def parse_request(self, body, chat: bool) -> Params:
        from verispec.api import encode_messages, encode_prompt

        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        model = body.get("model", self.model_name)
        if model not in (self.model_name, self.config.target):
            raise APIError(404, f"the model '{model}' does not exist; this server serves '{self.model_name}'",
                           "model", "model_not_found", kind="not_found_error")
        n = body.get("n", 1)
        if n is not None and n != 1:
            raise APIError(400, f"n={n!r} is not supported: verispec serve returns one choice per request "
                                "(send n requests, each with its own seed)", "n", "unsupported")
        for key, off in (("best_of", (None, 1)), ("echo", (None, False)), ("logprobs", (None, False)),
                         ("top_logprobs", (None, 0)), ("suffix", (None, "")),
                         ("presence_penalty", (None, 0)), ("frequency_penalty", (None, 0)),
                         ("logit_bias", (None, {}))):
            if not _is_off(body.get(key), off):
                raise APIError(400, f"'{key}' is not supported by verispec serve", key, "unsupported")
        if not isinstance(body.get("user", ""), str):
            raise APIError(400, "'user' must be a string", "user")
        options = body.get("stream_options")
        if options is not None and not (isinstance(options, dict) and set(options) <= {"include_usage"}):
            raise APIError(400, "'stream_options' may only hold 'include_usage' (the last chunk always "
                                "carries the usage)", "stream_options")
        # the prompt
        try:
            if chat:
                if "messages" not in body:
                    raise APIError(400, "missing 'messages'", "messages")
                prompt_ids = encode_messages(self.target, body["messages"])
            else:
                prompt = body.get("prompt")
                if isinstance(prompt, list) and len(prompt) == 1 and (isinstance(prompt[0], str) or
                                                                      _token_list(prompt[0])):
                    prompt = prompt[0]
                if prompt is None:
                    raise APIError(400, "missing 'prompt'", "prompt")
                if isinstance(prompt, list) and prompt and not _token_list(prompt):
                    raise APIError(400, "one prompt per request: 'prompt' must be a string or a list of "
                                        "token ids (send several requests for several prompts)", "prompt")
                if not isinstance(prompt, (str, list)):
                    raise APIError(400, "'prompt' must be a string or a list of token ids", "prompt")
                prompt_ids = encode_prompt(self.target, prompt, chat=False)
        except ValueError as err:
            raise APIError(400, str(err), "messages" if chat else "prompt") from None
        if not prompt_ids:
            raise APIError(400, "empty prompt", "messages" if chat else "prompt")
        # after the prompt: a chat request with a 'prompt' is told 'messages' is missing
        unknown = sorted(set(body) - (CHAT_FIELDS if chat else COMPLETION_FIELDS))
        if unknown:  # never silently ignored: a misplaced "rule" would decode with the default rule
            raise APIError(400, f"unsupported field(s) {', '.join(map(repr, unknown))}: verispec serve "
                                "refuses fields it does not honour (the verification rule goes in "
                                "'verification': {\"rule\": ..., \"k\": ...})", unknown[0], "unsupported")
        vocab = self.target.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise APIError(400, f"prompt token ids must be in [0, {vocab})", "prompt")
        # lengths
        key = "max_tokens"
        if chat and body.get("max_completion_tokens") is not None:
            key = "max_completion_tokens"
        max_tokens = _number(body, key, int, 1, self.config.max_tokens_limit,
                             default=self.config.default_max_tokens)
        if self.context is not None and len(prompt_ids) + max_tokens > self.context:
            raise APIError(400, f"this model's maximum context length is {self.context} tokens; the prompt "
                                f"has {len(prompt_ids)} and max_tokens is {max_tokens}", key,
                           "context_length_exceeded")
        # sampling
        temperature = _number(body, "temperature", float, 0.0, default=1.0)
        top_p = _number(body, "top_p", float, 0.0, 1.0, lo_open=True)
        top_k = _number(body, "top_k", int, 1)
        min_p = _number(body, "min_p", float, 0.0, 1.0, lo_open=True)
        if top_k is not None and top_k >= vocab:
            top_k = None  # keeps every token: the same law
        if top_p == 1.0:
            top_p = None
        try:
            sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
        except ValueError as err:
            raise APIError(400, str(err)) from None
        seed = body.get("seed")
        if seed is None:
            seed = secrets.randbelow(MAX_SEED)
        elif isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
            raise APIError(400, f"'seed' must be an integer in [0, 2**63 - 1], got {seed!r}", "seed")
        stop = body.get("stop")
        if stop is None:
            stop = []
        elif isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
            raise APIError(400, "'stop' must be a non-empty string or a list of up to 4 of them", "stop")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise APIError(400, "'stream' must be true or false", "stream")
        ignore_eos = body.get("ignore_eos", False)
        if not isinstance(ignore_eos, bool):
            raise APIError(400, "'ignore_eos' must be true or false", "ignore_eos")
        rule, k = self.parse_rule(body)
        return Params(prompt_ids=prompt_ids, rule=rule, k=k, max_tokens=max_tokens, sampling=sampling,
                      seed=seed, stop=stop, stream=stream, model=self.model_name, ignore_eos=ignore_eos)


# Request fields the server honours or checks (OpenAI's, plus vLLM's top_k / min_p / ignore_eos and
# verispec's verification); any other field is refused, never ignored. `user` and `stream_options`
# change no output; the rest must be off (best_of 1, echo false, no logprobs, penalties 0, ...).
COMMON_FIELDS = frozenset({
    "model", "n", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stream",
    "stream_options", "ignore_eos", "verification", "user", "best_of", "echo", "logprobs", "top_logprobs",
    "presence_penalty", "frequency_penalty", "logit_bias"})
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "suffix"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens"}


def _is_off(value, off: tuple) -> bool:
    """`value` is one of the `off` values, a bool only equal to a bool (0 is not False, True is not 1)."""
    return any(value is None if o is None else
               (isinstance(value, bool) == isinstance(o, bool) and value == o) for o in off)


# -- the engine ------------------------------------------------------------------------------------


class QueueFull(Exception):
    pass


@dataclass
class Job:
    """One request in the engine."""

    id: int
    params: Params
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    created: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    sent: str = ""  # text already streamed
    done: bool = False
    group: tuple | None = None
    row: int | None = None


class Engine:
    """One thread that owns the models: admits queued requests between blocks, steps every non-empty
    (rule, sampling) group's `BatchDecoder` in turn, streams new text, delivers finished generations."""

    def __init__(self, server: Server):
        self.server = server
        self.config = server.config
        self._cond = threading.Condition()
        self._pending: deque[Job] = deque()
        self._cancel: set[int] = set()
        self._groups: dict[tuple, BatchDecoder] = {}
        self._jobs: dict[tuple[tuple, int], Job] = {}
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._ids = itertools.count()
        self.running = 0
        self.error: BaseException | None = None

    @property
    def waiting(self) -> int:
        return len(self._pending)

    def new_id(self) -> int:
        return next(self._ids)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="verispec-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel what is still queued or decoding (each gets a final event), then end the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    def submit(self, job: Job) -> None:
        with self._cond:
            if self._stopping:
                raise APIError(503, "the server is shutting down", code="shutting_down", kind="server_error")
            if len(self._pending) >= self.config.max_queue:
                raise QueueFull()
            self._pending.append(job)
            self.server.metrics.waiting.set(len(self._pending))
            self._cond.notify_all()

    def cancel(self, job: Job) -> None:
        with self._cond:
            if not job.done:
                self._cancel.add(job.id)
                self._cond.notify_all()

    # -- engine thread ------------------------------------------------------------------------------
    def _emit(self, job: Job, event: tuple) -> None:
        if event[0] in ("done", "error"):
            job.done = True
        try:
            job.loop.call_soon_threadsafe(job.events.put_nowait, event)
        except RuntimeError:  # the request's event loop is closed
            pass

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._stopping and not self._pending and not self._jobs and not self._cancel:
                        self._cond.wait(0.5)
                    if self._stopping:
                        break
                    cancels, self._cancel = self._cancel, set()
                    admit = []
                    for job in list(self._pending):
                        if job.id in cancels:
                            self._pending.remove(job)
                            job.done = True
                    while self._pending and self.running + len(admit) < self.config.max_batch:
                        admit.append(self._pending.popleft())
                    self.server.metrics.waiting.set(len(self._pending))
                for (key, row), job in list(self._jobs.items()):
                    if job.id in cancels:
                        self._end(key, row, self._groups[key].cancel(row), "cancelled")
                for job in admit:
                    self._admit(job)
                self.server.metrics.running.set(self.running)
                for key in list(self._groups):
                    self._step(key)
                self.server.metrics.running.set(self.running)
        except BaseException as err:  # noqa: BLE001  the engine must never die silently
            self.error = err
        finally:
            self._shutdown()

    def _shutdown(self) -> None:
        with self._cond:
            self._stopping = True
            pending, self._pending = list(self._pending), deque()
        for job in pending:
            self._emit(job, ("error", APIError(503, "the server shut down before this request started",
                                               code="shutting_down", kind="server_error")))
        for (key, row), job in list(self._jobs.items()):
            try:
                self._end(key, row, self._groups[key].cancel(row), "cancelled")
            except Exception:  # noqa: BLE001
                self._emit(job, ("error", APIError(500, "the engine stopped", kind="server_error")))
        self.running = 0
        self.server.metrics.running.set(0)
        self.server.metrics.waiting.set(0)

    def _admit(self, job: Job) -> None:
        p = job.params
        key = (p.rule.spec if p.rule is not None else "plain", p.sampling)
        try:
            dec = self._groups.get(key)
            if dec is None:
                drafter = None if self.server.plain else copy.copy(self.server.drafter)  # own batch state
                dec = BatchDecoder(self.server.target, drafter, p.rule or "lossless",
                                   DecodeConfig(k=self.config.k, sampling=p.sampling))
                self._groups[key] = dec
            config = DecodeConfig(k=p.k, max_new_tokens=p.max_tokens, sampling=p.sampling,
                                  stop_at_eos=not p.ignore_eos, diagnostics=self.config.diagnostics)
            row = dec.add(p.prompt_ids, torch.Generator().manual_seed(p.seed), config)
        except ValueError as err:
            self._emit(job, ("error", APIError(400, str(err))))
            return
        job.group, job.row = key, row
        self._jobs[(key, row)] = job
        self.running += 1

    def _step(self, key: tuple) -> None:
        dec = self._groups[key]
        try:
            finished = dec.step()
        except Exception as err:  # noqa: BLE001  a failed block fails its group's requests, not the server
            for (k2, row), job in list(self._jobs.items()):
                if k2 == key:
                    del self._jobs[(k2, row)]
                    self.running -= 1
                    self._emit(job, ("error", APIError(500, f"decoding failed: {err}", kind="server_error")))
            del self._groups[key]
            return
        now = time.perf_counter()
        for row, gen in finished:
            self._end(key, row, gen, gen.finish)
        for row in dec.active:
            job = self._jobs[(key, row)]
            try:
                self._progress(key, dec, row, job, now)
            except Exception as err:  # noqa: BLE001  fails this request alone
                if (key, row) in self._jobs:
                    self._fail(key, row, err)
                if row in dec.active:
                    dec.cancel(row)
        if not dec.active:
            del self._groups[key]

    def _progress(self, key: tuple, dec: BatchDecoder, row: int, job: Job, now: float) -> None:
        """After a block: time to first token, then (streaming or stop strings) new text and stops."""
        if job.first_token is None or job.params.stream or job.params.stop:
            ids = dec.tokens(row)
            if ids and job.first_token is None:
                job.first_token = now
                self.server.metrics.ttft.observe(now - job.created)
            if job.params.stream or job.params.stop:
                text = self.server.target.decode(ids)
                if _find_stop(text, job.params.stop) is not None:
                    self._end(key, row, dec.cancel(row), "stop")
                elif job.params.stream:
                    self._stream(job, text, final=False)

    def _fail(self, key: tuple, row: int, err: Exception) -> None:
        """A row's request fails (500) and leaves the engine; the other rows and requests go on."""
        job = self._jobs.pop((key, row))
        self.running -= 1
        log.error("request %s failed: %r", job.id, err)
        self._emit(job, ("error", APIError(500, f"the response could not be built: {err}",
                                           kind="server_error")))

    def _stream(self, job: Job, text: str, final: bool) -> None:
        if not final:
            hold = max((len(s) for s in job.params.stop), default=1) - 1  # a stop string may still complete
            text = text[: len(text) - hold] if hold else text
            text = text.rstrip("\ufffd")  # an incomplete UTF-8 character
        if text.startswith(job.sent) and len(text) > len(job.sent):
            self._emit(job, ("delta", text[len(job.sent):]))
            job.sent = text

    def _end(self, key: tuple, row: int, gen: Generation, how: str) -> None:
        """A row left its decoder: deliver its response (or drop it if the client left)."""
        job = self._jobs[(key, row)]
        try:
            event = self._deliver(job, gen, how)
        except Exception as err:  # noqa: BLE001  a response that cannot be built fails alone
            self._fail(key, row, err)
            return
        del self._jobs[(key, row)]
        self.running -= 1
        self._emit(job, event)

    def _deliver(self, job: Job, gen: Generation, how: str) -> tuple:
        """A finished row's response event; streams its last text and records its metrics."""
        from verispec.api import response_text

        if job.first_token is None and gen.token_ids:
            job.first_token = time.perf_counter()
            self.server.metrics.ttft.observe(job.first_token - job.created)
        returned = gen.num_tokens  # the tokens of the response (usage, token_ids): all, or up to a stop
        text = response_text(self.server.target, gen)  # the end-of-sequence token is no text
        stop_at = _find_stop(text, job.params.stop)
        if stop_at is not None:
            text, how = text[:stop_at], "stop"
            returned = _tokens_through_stop(self.server.target.decode, list(gen.token_ids), job.params.stop)
        finish = {"eos": "stop", "stop": "stop", "length": "length"}.get(how, how)
        stats = gen.stats(max_new_tokens=job.params.max_tokens, k=None if self.server.plain else job.params.k)
        report = stats["verification"]  # every token decoded, those past a stop string included
        if how == "stop":
            report["finish"] = "stop"  # not "cancelled": the decoder's row was ended by the stop string
        if job.params.stream and how != "cancelled":
            self._stream(job, text, final=True)
        self.server.metrics.record(job, gen, report, finish, returned)
        return ("done", gen, text, finish, report, returned)


def _find_stop(text: str, stops: list[str]) -> int | None:
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


def _tokens_through_stop(decode, ids: list[int], stops: list[str]) -> int:
    """The fewest leading tokens of `ids` whose text holds a stop string (OpenAI and vLLM return the
    tokens up to the one that completes it); a block may have decoded up to k tokens past it."""
    n = len(ids)
    while n > 1 and _find_stop(decode(ids[: n - 1]), stops) is not None:
        n -= 1
    return n


# -- metrics ---------------------------------------------------------------------------------------


class Metrics:
    """Prometheus metrics in the app's own registry: vLLM's speculative-decoding counters under a
    `verispec:` prefix (prometheus_client appends `_total` to counters, as for vLLM's), latencies,
    queue depth, running batch size, and per-rule fidelity histograms of the responses."""

    def __init__(self, k: int):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = r = CollectorRegistry()
        self.num_drafts = Counter("verispec:spec_decode_num_drafts", "Blocks with at least one draft token",
                                  registry=r)
        self.num_draft_tokens = Counter("verispec:spec_decode_num_draft_tokens", "Draft tokens proposed",
                                        registry=r)
        self.num_accepted = Counter("verispec:spec_decode_num_accepted_tokens", "Draft tokens accepted",
                                    registry=r)
        self.accepted_per_pos = Counter("verispec:spec_decode_num_accepted_tokens_per_pos",
                                        "Draft tokens accepted at each draft position (0-based, as vLLM)",
                                        ["position"], registry=r)
        self.generation_tokens = Counter("verispec:generation_tokens", "Generated tokens", registry=r)
        self.prompt_tokens = Counter("verispec:prompt_tokens", "Prompt tokens", registry=r)
        self.requests = Counter("verispec:request_success", "Finished requests", ["finished_reason"],
                                registry=r)
        latency = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
        self.latency = Histogram("verispec:e2e_request_latency_seconds", "Request latency (queue included)",
                                 buckets=latency, registry=r)
        self.ttft = Histogram("verispec:time_to_first_token_seconds", "Time to first token (queue included)",
                              buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30), registry=r)
        self.waiting = Gauge("verispec:num_requests_waiting", "Requests in the queue", registry=r)
        self.running = Gauge("verispec:num_requests_running", "Rows decoding (running batch size)",
                             registry=r)
        small = (0.0, 1e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0)
        self.mean_tv = Histogram("verispec:response_mean_tv", "Per-response mean per-token TV to the target",
                                 ["rule"], buckets=small, registry=r)
        self.mean_kl = Histogram("verispec:response_mean_kl", "Per-response mean per-token KL to the target",
                                 ["rule"], buckets=small + (3.0, 10.0), registry=r)
        self.log_ratio = Histogram("verispec:response_log_ratio_per_token",
                                   "Per-response exact sequence log-likelihood ratio vs the target, "
                                   "per token",
                                   ["rule"], buckets=(-1, -0.1, -0.01, 0.0, 0.01, 0.1, 1, 10), registry=r)

    def record(self, job: Job, gen: Generation, report: dict, finish: str, returned: int) -> None:
        """One finished request; `returned`: its response's tokens (fewer than decoded after a stop
        string; the speculative counters count every decoded one)."""
        self.num_drafts.inc(sum(1 for b in gen.blocks if b.proposed > 0))
        self.num_draft_tokens.inc(report["drafted_tokens"])
        self.num_accepted.inc(report["accepted_tokens"])
        for pos in report["acceptance_per_position"]:
            self.accepted_per_pos.labels(position=str(pos["position"] - 1)).inc(pos["accepted"])
        self.generation_tokens.inc(returned)
        self.prompt_tokens.inc(len(gen.prompt_ids))
        self.requests.labels(finished_reason=finish).inc()
        self.latency.observe(time.perf_counter() - job.created)
        rule = report["rule"]
        for hist, value in ((self.mean_tv, report["mean_tv"]), (self.mean_kl, report["mean_kl"]),
                            (self.log_ratio, report["log_ratio_per_token"])):
            if value is not None and math.isfinite(value):
                hist.labels(rule=rule).observe(value)

    def exposition(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


# -- the app ---------------------------------------------------------------------------------------


def _json_safe(obj):
    from verispec.cli import json_safe

    return json_safe(obj)


REPLICA_HEADER = "x-verispec-replica"


class ReplicaHeader:
    """ASGI middleware: every HTTP response (streams included) names the replica that served it, in the
    `x-verispec-replica` header (`verispec serve --ray`: each replica has its own engine and metrics)."""

    def __init__(self, app, replica: str):
        self.app = app
        self.header = (REPLICA_HEADER.encode(), replica.encode())

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_named(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        await self.app(scope, receive, send_named)


def create_app(config: ServeConfig | None = None, target=None, drafter=None, server: Server | None = None,
               replica: str | None = None):
    """The ASGI app (FastAPI). Models load here (once); the engine thread runs while the app is up.
    `replica` (a Ray Serve replica's id, `verispec.serve_ray`): every response carries it in the
    `x-verispec-replica` header, `/health` in `replica`, and `/metrics` in `verispec:replica_info`."""
    server = server or Server(config or ServeConfig(), target, drafter)
    engine = server.engine

    @asynccontextmanager
    async def lifespan(app):
        engine.start()
        try:
            yield
        finally:
            await asyncio.get_running_loop().run_in_executor(None, engine.stop)

    app = FastAPI(title="verispec serve", lifespan=lifespan)
    app.state.server = server
    if replica is not None:
        from prometheus_client import Gauge

        Gauge("verispec:replica_info", "The replica that served this exposition (always 1)", ["replica"],
              registry=server.metrics.registry).labels(replica=replica).set(1)
        app.add_middleware(ReplicaHeader, replica=replica)

    def error(err: APIError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(APIError)
    async def _api_error(request, err: APIError):
        return error(err)

    @app.exception_handler(HTTPException)
    async def _http_error(request, err: HTTPException):
        kind = "not_found_error" if err.status_code == 404 else "invalid_request_error"
        return error(APIError(err.status_code, str(err.detail), kind=kind))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, err):
        return error(APIError(400, str(err)))

    @app.get("/health")
    async def health():
        state = {"status": "ok" if engine.error is None else "engine_failed", "running": engine.running,
                 "waiting": engine.waiting, "model": server.model_name}
        return state if replica is None else {**state, "replica": replica}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": server.model_name, "object": "model", "created": 0,
                                            "owned_by": "verispec"}]}

    @app.get("/metrics")
    async def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(server.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    async def handle(request: Request, chat: bool):
        try:
            body = json.loads(await request.body())
        except (ValueError, UnicodeDecodeError) as err:
            raise APIError(400, f"the request body is not valid JSON: {err}") from None
        params = server.parse_request(body, chat)
        loop = asyncio.get_running_loop()
        job = Job(id=engine.new_id(), params=params, loop=loop, events=asyncio.Queue())
        try:
            engine.submit(job)
        except QueueFull:
            raise APIError(503, f"the server is at capacity ({server.config.max_queue} requests queued); "
                                "retry later", code="queue_full", kind="server_error",
                           headers={"Retry-After": "1"}) from None
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{job.id}-{secrets.token_hex(4)}"
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"
        chunk_obj = "chat.completion.chunk" if chat else "text_completion"

        def final_fields(gen: Generation, report: dict, returned: int) -> dict:
            n_prompt = len(gen.prompt_ids)
            return {"usage": {"prompt_tokens": n_prompt, "completion_tokens": returned,
                              "total_tokens": n_prompt + returned},
                    "system_fingerprint": f"verispec-seed-{params.seed}", "seed": params.seed,
                    "token_ids": list(gen.token_ids[:returned]), "verification": _json_safe(report)}

        if params.stream:
            async def events():
                try:
                    while True:
                        event = await job.events.get()
                        if event[0] == "delta":
                            choice = ({"index": 0, "delta": {"role": "assistant", "content": event[1]},
                                       "finish_reason": None} if chat else
                                      {"index": 0, "text": event[1], "logprobs": None, "finish_reason": None})
                            chunk = {"id": rid, "object": chunk_obj, "created": created,
                                     "model": params.model, "choices": [choice]}
                            yield f"data: {json.dumps(chunk)}\n\n"
                        elif event[0] == "done":
                            _, gen, _text, finish, report, returned = event
                            choice = ({"index": 0, "delta": {}, "finish_reason": finish} if chat else
                                      {"index": 0, "text": "", "logprobs": None, "finish_reason": finish})
                            chunk = {"id": rid, "object": chunk_obj, "created": created,
                                     "model": params.model, "choices": [choice],
                                     **final_fields(gen, report, returned)}
                            yield f"data: {json.dumps(chunk)}\n\n"
                            yield "data: [DONE]\n\n"
                            return
                        else:
                            yield f"data: {json.dumps(event[1].body())}\n\n"
                            return
                finally:
                    engine.cancel(job)  # a client gone mid-stream frees its row at the next block

            return StreamingResponse(events(), media_type="text/event-stream")

        try:
            while True:
                try:
                    event = await asyncio.wait_for(job.events.get(), 0.5)
                    break
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        engine.cancel(job)
                        return Response(status_code=499)
        except asyncio.CancelledError:
            engine.cancel(job)
            raise
        if event[0] == "error":
            raise event[1]
        _, gen, text, finish, report, returned = event
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish,
                   "logprobs": None} if chat else
                  {"index": 0, "text": text, "logprobs": None, "finish_reason": finish})
        return {"id": rid, "object": obj, "created": created, "model": params.model, "choices": [choice],
                **final_fields(gen, report, returned)}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    return app


def serve(config: ServeConfig, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> None:
    """Load the models, then run the app under uvicorn until interrupted (graceful shutdown)."""
    import uvicorn

    app = create_app(config)
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=30)
