"""The continuous-batching engine of `verispec serve` (docs/serving.md, 'Serving').

One thread owns the models and drives `BatchDecoder`s. A chain decoder's rows each keep their own
rule and sampling settings (temperature, top-k, top-p, min-p), so every chain request shares one
decoder and one forward pass a block; a tree decoder (`DecodeConfig.tree`) has one rule, one shape and
one setting, so tree requests are grouped by them; k is per row. The engine steps the non-empty groups
in turn (one block each), so requests join and leave between blocks.
Each request draws from its own `torch.Generator` seeded by its `seed`, so its output is what it would
be alone (the batch-independence contract of `BatchDecoder`, up to float rounding of batched forward
passes).

Admission: at most `max_batch` rows decode at once and `max_queue` more requests wait; a request is
admitted when decoding rows plus waiting requests are fewer than `max_batch + max_queue` (free rows
count as places: an idle server takes `max_batch + max_queue` simultaneous requests), else 503
`queue_full`. A client that disconnects frees its row at the next block.

Shutdown (`drain`, on SIGTERM): no new request is admitted, waiting requests are answered at once with
503 `shutting_down`, decoding rows get `grace` seconds to finish, then end with 503 `shutting_down` (a
stream: a final error chunk). A dead engine thread (`alive` false) answers everything it held with an
error, and `/health` reports 503.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from verispec import api, defaults
from verispec.decode import BatchDecoder, DecodeConfig, Generation, decode_prompts, position_costs
from verispec.logprobs import prompt_logprobs, token_logprobs
from verispec.rules import Rule
from verispec.sampling import SamplingConfig
from verispec.serving.config import APIError, ServeConfig, shutting_down
from verispec.serving.metrics import Metrics
from verispec.speculation import AdaptivePolicy, measure_costs
from verispec.tree_decode import TreeVerification
from verispec.trees import DraftShape

log = logging.getLogger(__name__)


# --k auto: the batch sizes whose pass costs are measured at start (a larger batch uses the largest
# measured one not above it, `speculation.Costs.at`)
ADAPTIVE_BATCH_SIZES = (1, 2, 4, 8, 16)

@dataclass
class Params:
    """A validated request."""

    prompt_ids: list[int]
    rule: Rule | TreeVerification | None  # a tree rule paired with `tree` for tree drafts
    k: int
    max_tokens: int
    sampling: SamplingConfig
    seed: int
    stop: list[str]
    stream: bool
    model: str
    ignore_eos: bool = False  # vLLM's extra field: run to max_tokens
    n: int = 1  # choices: choice i decodes with seed + i
    logprobs: int | None = None  # None: none; else per-token log-probabilities with this many top tokens
    include_usage: bool = False  # stream_options.include_usage: a last chunk with the usage
    echo: bool = False  # completions: the prompt comes first in the text (and, with logprobs, its entries)
    warnings: list[str] = field(default_factory=list)  # returned with the response
    tree: DraftShape | None = None  # the draft shape (tree:widths=..., drafts:n=...); None: chain drafts
    adaptive: bool = False  # --k auto and no k of its own: k chosen per block from the measured costs


class QueueFull(Exception):
    pass


@dataclass
class Job:
    """One choice of one request in the engine (its `params.seed` is the choice's own)."""

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
    index: int = 0  # the choice this job decodes (a request with n choices has n jobs on one queue)
    prompt_entries: list[dict] | None = None  # echo with logprobs: the prompt's (prompt_logprobs)
    tokens_streamed: int = 0  # streaming with logprobs: the tokens whose entries went out in a chunk
    prompt_streamed: bool = False  # ... and whether the prompt's entries did (the first such chunk)


class Engine:
    """One thread that owns the models: admits queued requests between blocks, steps every non-empty
    group's `BatchDecoder` in turn (all chain rows, or a tree group), streams new text, delivers finished
    generations."""

    def __init__(self, target, drafter, config: ServeConfig, metrics: Metrics):
        self.target, self.drafter, self.config, self.metrics = target, drafter, config, metrics
        self.plain = drafter is None
        self._cond = threading.Condition()
        self._pending: deque[Job] = deque()
        self._cancel: set[int] = set()
        self._groups: dict[tuple, BatchDecoder] = {}
        self._jobs: dict[tuple[tuple, int], Job] = {}
        self._stopping = False
        self._drain_deadline: float | None = None  # set by drain(): rows still decoding end then
        self._thread: threading.Thread | None = None
        self._ids = itertools.count()
        self.running = 0  # rows decoding, and those taken from the queue to join (updated under the lock)
        self.error: BaseException | None = None
        self.ready = False  # the warm-up has run (`_warm_up`): /health answers 200 from then on
        self.policy: AdaptivePolicy | None = None  # --k auto: from the costs measured at warm-up
        # --k auto: the requests' acceptance by rule and settings, a new request's prior
        self.acceptance: dict = {}

    @property
    def waiting(self) -> int:
        return len(self._pending)

    @property
    def alive(self) -> bool:
        """The engine thread runs and has not failed (False before `start`)."""
        return self._thread is not None and self._thread.is_alive() and self.error is None

    def new_id(self) -> int:
        return next(self._ids)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="verispec-engine", daemon=True)
        self._thread.start()

    def drain(self, grace: float) -> None:
        """Shutdown begins: refuse new requests, answer waiting ones 503 `shutting_down` now, and end
        rows still decoding after `grace` seconds (503 `shutting_down`; a stream gets a final error chunk)."""
        with self._cond:
            if self._drain_deadline is None:
                self._drain_deadline = time.monotonic() + grace
            self._cond.notify_all()

    def stop(self, timeout: float = 30.0) -> None:
        """End the thread; whatever it still holds is answered 503 `shutting_down`."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    def submit(self, jobs: list[Job]) -> None:
        """Queue a request's jobs (one per choice), all or none: QueueFull when the free rows and queue
        places cannot take them all; APIError 503 when the engine failed or is shutting down."""
        with self._cond:
            if self._thread is not None and not self.alive:
                raise APIError(503, f"the decoding engine has failed ({self.error!r}); this server must be "
                                    "restarted", code="engine_failed", kind="server_error")
            if self._stopping or self._drain_deadline is not None:
                raise shutting_down("it accepts no new requests")
            if self.running + len(self._pending) + len(jobs) > self.config.max_batch + self.config.max_queue:
                raise QueueFull()
            self._pending.extend(jobs)
            self.metrics.waiting.set(len(self._pending))
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
            job.loop.call_soon_threadsafe(job.events.put_nowait, (job.index, event))
        except RuntimeError:  # the request's event loop is closed
            pass

    def _warm_up(self) -> None:
        """Decode a few tokens plainly and, with a drafter, speculatively (lossless, chain drafts), before
        the first request: the lazy set-up (weight packing, first kernel calls, session buffers) is paid
        here, not by a client, and `/health` says 503 `warming_up` until it is done. Requests that arrive
        meanwhile wait in the queue."""
        started = time.perf_counter()
        encode = getattr(self.target, "encode", None)
        prompt = (encode("Hello") if callable(encode) else None) or [0]
        config = DecodeConfig(k=min(self.config.k_default, 2), max_new_tokens=4, stop_at_eos=False,
                              diagnostics=self.config.diagnostics)
        decode_prompts(self.target, [prompt], [torch.Generator().manual_seed(0)], config)
        if self.drafter is not None:
            decode_prompts(self.target, [prompt], [torch.Generator().manual_seed(0)], config,
                           drafter=self.drafter, rule="lossless")
        if self.config.adaptive:  # the pair's pass costs at the batch sizes the server runs
            sizes = tuple(b for b in ADAPTIVE_BATCH_SIZES if b <= self.config.max_batch)
            costs = measure_costs(self.target, self.drafter, prompt, self.config.k_default, sizes)
            costs = position_costs(costs, self.target, self.drafter, prompt,
                                   diagnostics=self.config.diagnostics)
            # a request starts from the acceptance of the requests before it (weighed as one exploration's
            # tests), so short requests do not each pay for exploring
            self.policy = AdaptivePolicy(costs, self.config.k_default, pool_tests=AdaptivePolicy.explore,
                                         margin=defaults.AUTO_MARGIN)
            log.info("--k auto: pass costs measured at batch sizes %s: %s", sizes, costs.summary())
        self.ready = True
        log.info("warm-up done in %.1f s", time.perf_counter() - started)

    def _run(self) -> None:
        try:
            self._warm_up()
            while True:
                with self._cond:
                    while not (self._stopping or self._pending or self._jobs or self._cancel):
                        self._cond.wait(0.5)
                    if self._stopping:
                        break
                    cancels, self._cancel = self._cancel, set()
                    for job in [j for j in self._pending if j.id in cancels]:
                        self._pending.remove(job)
                        job.done = True
                    refused, admit = [], []
                    if self._drain_deadline is not None:
                        refused, self._pending = list(self._pending), deque()
                    while self._pending and self.running < self.config.max_batch:
                        admit.append(self._pending.popleft())
                        self.running += 1  # under the lock: `submit` never counts a row twice or not at all
                    self.metrics.waiting.set(len(self._pending))
                    cut = self._drain_deadline is not None and time.monotonic() >= self._drain_deadline
                for job in refused:
                    self._emit(job, ("error", shutting_down("this request had not started")))
                for (key, row), job in list(self._jobs.items()):
                    if job.id in cancels:
                        self._end(key, row, self._groups[key].cancel(row), "cancelled")
                    elif cut:
                        self._groups[key].cancel(row)
                        self._drop(key, row, shutting_down("this request was still decoding when the "
                                                           "shutdown grace period ended"))
                for job in admit:
                    self._admit(job)
                self.metrics.running.set(self.running)
                for key in list(self._groups):
                    if self._groups[key].active:
                        self._step(key)  # a block that fails removes its group
                    dec = self._groups.get(key)
                    if dec is not None and not dec.active:
                        del self._groups[key]
                self.metrics.running.set(self.running)
        except BaseException as err:  # noqa: BLE001  the engine must never die silently
            self.error = err
            log.exception("the decoding engine failed")
        finally:
            self._shutdown()

    def _shutdown(self) -> None:
        """The thread ends: every request it still holds gets an error event (no client waits forever)."""
        with self._cond:
            self._stopping = True
            pending, self._pending = list(self._pending), deque()
        failed = self.error is not None

        def why(started: str) -> APIError:
            if failed:
                return APIError(500, f"the decoding engine failed: {self.error!r}", code="engine_failed",
                                kind="server_error")
            return shutting_down(started)

        for job in pending:
            self._emit(job, ("error", why("this request had not started")))
        for key, row in list(self._jobs):
            self._drop(key, row, why("this request was still decoding"))
        self._groups.clear()
        self.running = 0
        self.metrics.running.set(0)
        self.metrics.waiting.set(0)

    def _admit(self, job: Job) -> None:
        p = job.params
        # chain rows of any rule and sampling settings share one decoder (each row is verified by its own
        # rule and processed with its own settings); a tree decoder keeps one rule and one setting
        chain = p.rule is not None and p.tree is None
        key = (("chain", None, None) if chain else
               (p.rule.spec if p.rule is not None else "plain", p.tree, p.sampling if p.tree else None))
        if p.echo and (p.logprobs is not None or p.max_tokens == 0):
            try:  # a failure here fails this request alone (500), never the engine
                if p.logprobs is not None:  # one target pass over the prompt, on this thread
                    job.prompt_entries = prompt_logprobs(self.target, p.prompt_ids, p.logprobs,
                                                         self.target.decode, self.config.logprobs_mode)
                event = self._deliver(job, self._nothing(job), "length") if p.max_tokens == 0 else None
            except Exception as err:  # noqa: BLE001
                log.error("request %s failed: %r", job.id, err)
                self.running -= 1
                self._emit(job, ("error", APIError(500, f"the prompt could not be scored: {err}",
                                                   kind="server_error")))
                return
            if event is not None:  # max_tokens 0: the prompt scored, nothing decoded
                self.running -= 1
                self._emit(job, event)
                return
        try:
            dec = self._groups.get(key)
            if dec is None:
                drafter = None if self.plain else copy.copy(self.drafter)  # its own batch state
                policy = self.policy if p.tree is None and not self.plain else None
                dec = BatchDecoder(self.target, drafter, p.rule or "lossless",
                                   DecodeConfig(k=self.config.k_default, sampling=p.sampling, tree=p.tree,
                                                policy=policy), pools=self.acceptance)
                self._groups[key] = dec
            config = DecodeConfig(k=p.k, max_new_tokens=p.max_tokens, sampling=p.sampling,
                                  stop_at_eos=not p.ignore_eos, diagnostics=self.config.diagnostics,
                                  keep_probs=bool(p.logprobs),  # the V-sized rows, for top_logprobs
                                  keep_token_logits=(p.logprobs is not None  # the logits modes' values
                                                     and self.config.logprobs_mode.endswith("logits")),
                                  tree=p.tree, policy=self.policy if p.adaptive else None,
                                  prefill_chunk=self.config.prefill_chunk or None, prefill_paced=True)
            row = dec.add(p.prompt_ids, torch.Generator().manual_seed(p.seed), config,
                          rule=p.rule if chain else None)
        except ValueError as err:
            self.running -= 1
            self._emit(job, ("error", APIError(400, str(err))))
            return
        job.group, job.row = key, row
        self._jobs[(key, row)] = job

    def _nothing(self, job: Job) -> Generation:
        """The empty generation of a max_tokens=0 request: no block, no decoder call, no per-token
        record (its report's per-token means are null)."""
        p = job.params
        return Generation(prompt_ids=tuple(p.prompt_ids), token_ids=(), blocks=(), steps=None, target_calls=0,
                          draft_calls=0, seconds=0.0, finish="length", rule=p.rule)

    def _step(self, key: tuple) -> None:
        dec = self._groups[key]
        try:
            finished = dec.step()
        except Exception as err:  # noqa: BLE001  a failed block fails its group's requests, not the server
            log.error("a decoding block failed: %r", err)
            for k2, row in list(self._jobs):
                if k2 == key:
                    self._drop(k2, row, APIError(500, f"decoding failed: {err}", kind="server_error"))
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

    def _progress(self, key: tuple, dec: BatchDecoder, row: int, job: Job, now: float) -> None:
        """After a block: time to first token, then (streaming or stop strings) new text and stops."""
        if job.first_token is None or job.params.stream or job.params.stop:
            ids = dec.tokens(row)
            if ids and job.first_token is None:
                job.first_token = now
                self.metrics.first_token(now - job.created)
            if job.params.stream or job.params.stop:
                text = self.target.decode(ids)
                if find_stop(text, job.params.stop) is not None:
                    self._end(key, row, dec.cancel(row), "stop")
                elif job.params.stream:
                    self._stream(job, text, final=False, dec=dec, row=row)

    def _drop(self, key: tuple, row: int, err: APIError) -> None:
        """A row's request ends with `err` (its row, if still in a decoder, is the caller's to cancel)."""
        job = self._jobs.pop((key, row))
        self.running -= 1
        self._emit(job, ("error", err))

    def _fail(self, key: tuple, row: int, err: Exception) -> None:
        """A row's request fails (500) and leaves the engine; the other rows and requests go on."""
        log.error("request %s failed: %r", self._jobs[(key, row)].id, err)
        self._drop(key, row, APIError(500, f"the response could not be built: {err}", kind="server_error"))

    def _stream(self, job: Job, text: str, final: bool, dec: BatchDecoder | None = None,
                row: int | None = None) -> None:
        """Stream the text not yet sent (with `dec`, `row` and logprobs: the entries of the tokens it
        completes, OpenAI's per-chunk logprobs; the last chunk carries the rest)."""
        if not final:
            hold = max((len(s) for s in job.params.stop), default=1) - 1  # a stop string may still complete
            text = text[: len(text) - hold] if hold else text
            text = text.rstrip("\ufffd")  # an incomplete UTF-8 character
        if text.startswith(job.sent) and len(text) > len(job.sent):
            entries = self._streamed_entries(job, dec, row, text) if dec is not None else None
            self._emit(job, ("delta", text[len(job.sent):], entries))
            job.sent = text

    def _streamed_entries(self, job: Job, dec: BatchDecoder, row: int, text: str) -> list[dict] | None:
        """The log-prob entries of a streamed chunk: the tokens whose text `text` now holds whole (with
        echo, the prompt's entries first, in the first chunk)."""
        p = job.params
        if p.logprobs is None:
            return None
        ids, decode = dec.tokens(row), self.target.decode
        n = tokens_within(text, ids, job.tokens_streamed, decode)
        entries = [] if job.prompt_streamed else list(job.prompt_entries or [])
        job.prompt_streamed = True
        if n > job.tokens_streamed:
            entries += token_logprobs(dec.so_far(row), n, p.logprobs, decode, self.config.logprobs_mode,
                                      p.sampling.temperature, start=job.tokens_streamed)
            job.tokens_streamed = n
        return entries

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
        if job.first_token is None and gen.token_ids:
            job.first_token = time.perf_counter()
            self.metrics.first_token(job.first_token - job.created)
        returned = gen.num_tokens  # the tokens of the response (usage, token_ids): all, or up to a stop
        text = api.response_text(self.target, gen)  # the end-of-sequence token is no text
        stop_at = find_stop(text, job.params.stop)
        if stop_at is not None:
            text, how = text[:stop_at], "stop"
            returned = tokens_through_stop(self.target.decode, list(gen.token_ids), job.params.stop)
        finish = {"eos": "stop", "stop": "stop", "length": "length"}.get(how, how)
        # a tree's acceptance_per_position runs to its depth (as `verispec.generate`'s), a chain's to k
        k = None if self.plain or job.params.tree is not None else job.params.k
        stats = gen.stats(max_new_tokens=job.params.max_tokens, k=k)
        report = stats["verification"]  # every token decoded, those past a stop string included
        if how == "stop":
            report["finish"] = "stop"  # not "cancelled": the decoder's row was ended by the stop string
        if job.params.stream and how != "cancelled":
            self._stream(job, text, final=True)
        self.metrics.record(job.created, gen, report, finish, returned)
        return ("done", gen, text, finish, report, returned)


def tokens_within(text: str, ids: list[int], start: int, decode) -> int:
    """The most leading tokens of `ids` (at least `start`) whose text `text` holds whole: a token that
    ends a character split across tokens counts once the character is complete (the prefix before it
    decodes to U+FFFD, which is never the text streamed)."""
    n = m = start
    while m < len(ids):
        m += 1
        piece = decode(ids[:m])
        if piece.endswith("\ufffd"):  # an incomplete character: the next token may complete it
            continue
        if not text.startswith(piece):
            break
        n = m
    return n


def find_stop(text: str, stops: list[str]) -> int | None:
    """Where the first stop string starts in `text`, or None."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


def tokens_through_stop(decode, ids: list[int], stops: list[str]) -> int:
    """The fewest leading tokens of `ids` whose text holds a stop string (OpenAI and vLLM return the
    tokens up to the one that completes it); a block may have decoded up to k tokens past it."""
    n = len(ids)
    while n > 1 and find_stop(decode(ids[: n - 1]), stops) is not None:
        n -= 1
    return n
