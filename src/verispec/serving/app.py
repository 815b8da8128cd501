"""`verispec serve`: an OpenAI-compatible server whose every response carries its verification report.

Endpoints: `/v1/completions`, `/v1/chat/completions`, `/v1/models`, `/health`, `/metrics` (Prometheus).
Every response (the last chunk when streaming) carries `verification`: the object
`verispec.decode.verification_report` builds for the generation (the same as
`verispec.generate(...).stats["verification"]` and `verispec run --json`), plus `seed` (to reproduce it).

This module is the HTTP side: request parsing (every malformed body gets a 4xx in OpenAI's error
shape), the FastAPI app and its middleware, and `serve` (uvicorn, with a shutdown that drains the
engine: `verispec.serving.engine`). `verispec serve --ray` (`verispec.serving.ray`) runs this same app
in each replica of a Ray Serve deployment.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import replace

import uvicorn  # the `serve` extra: pip install "verispec[serve]"
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, Gauge
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware

from verispec import defaults
from verispec.version import __version__ as VERSION
from verispec.api import (as_dtype, check_device, encode_messages, encode_prompt, parse_draft_shape,
                          resolve_drafter, resolve_target)
from verispec.decode import DecodeConfig, Generation, check_tree_room
from verispec.jsonsafe import json_safe
from verispec.rules import Rule, parse
from verispec.sampling import SamplingConfig
from verispec.serving.config import (MAX_SEED, APIError, ServeConfig, certifiable_tv, check_policy,
                                     check_port, check_tree_nodes)
from verispec.tree_decode import (TreeVerification, refuse_tree_rule, shape_depth, tree_verification,
                                  tree_verification_rule)
from verispec.trees import DraftShape
from verispec.serving.engine import Engine, Job, Params, QueueFull
from verispec.logprobs import token_logprobs, totals
from verispec.serving.logprobs import MAX_TOP_LOGPROBS, chat_logprobs, completion_logprobs, numbers_only
from verispec.serving.metrics import Metrics
from verispec.serving.schema import SCHEMAS

log = logging.getLogger(__name__)
MAX_STOPS = 64  # stop strings a request may give (OpenAI's API allows 4; vLLM sets no limit)

FINGERPRINT = f"verispec-{VERSION}"  # the backend's configuration, OpenAI's meaning (the seed is in `seed`)
MAX_BODY_DEPTH = 32  # nesting levels a request body may have (a chat request needs 4)


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


def check_body(body) -> None:
    """APIError (400) for a body nested deeper than MAX_BODY_DEPTH or holding a string that is not
    Unicode text (a lone surrogate such as "\\ud800": valid JSON, but no tokenizer can encode it).
    Iterative: a hostile body cannot exhaust the stack here."""
    stack = [(body, "", 1)]
    while stack:
        value, where, depth = stack.pop()
        if isinstance(value, str):
            check_text(value, where)
        elif isinstance(value, (dict, list)):
            if depth > MAX_BODY_DEPTH:
                raise APIError(400, f"the request body is nested more than {MAX_BODY_DEPTH} levels deep "
                                    f"(at '{where}')", _param(where))
            if isinstance(value, dict):
                for key, item in value.items():
                    if not isinstance(key, str) or not key.isascii():
                        check_text(key, f"{where}.<field name>" if where else "<field name>")
                    stack.append((item, f"{where}.{key}" if where else key, depth + 1))
            else:
                stack.extend((item, f"{where}[{i}]", depth + 1) for i, item in enumerate(value))


def _param(where: str) -> str | None:
    """The top-level field of a path such as `messages[0].content` (None for the body itself)."""
    return where.split(".")[0].split("[")[0].replace("<field name>", "") or None


def check_text(text: str, where: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise APIError(400, f"'{where}' is not valid Unicode text: {err.reason} at character {err.start} "
                            "(a lone UTF-16 surrogate such as \\ud800?)", _param(where)) from None


def _token_list(value) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


MAX_PROMPTS = 64  # prompts one completion request may carry


def several_prompts(prompt) -> list | None:
    """A completion request's prompts when it gives more than one: a list of strings or a list of token-id
    lists (lm-evaluation-harness batches so); None for a single prompt (a string, token ids, or a list
    of one). APIError (400) past MAX_PROMPTS."""
    if not isinstance(prompt, list) or len(prompt) < 2:
        return None
    if not (all(isinstance(p, str) for p in prompt)
            or all(isinstance(p, list) and p and _token_list(p) for p in prompt)):
        return None  # token ids of one prompt, or a mixture `encode` refuses with its message
    if len(prompt) > MAX_PROMPTS:
        raise APIError(400, f"at most {MAX_PROMPTS} prompts per request, got {len(prompt)}", "prompt")
    return prompt


def merge_completions(parts: list[dict]) -> dict:
    """One response for the prompts of one request: the choices in prompt order, indexed 0.. across them
    (each with its seed, token ids and verification report), the usage summed."""
    choices = []
    for part in parts:
        for choice in part["choices"]:
            own = {k: part[k] for k in ("seed", "token_ids", "verification") if k in part and k not in choice}
            choices.append({**choice, **own, "index": len(choices)})
    usage = {k: sum(p["usage"][k] for p in parts) for k in ("prompt_tokens", "completion_tokens",
                                                            "total_tokens")}
    first = parts[0]
    out = {"id": first["id"], "object": first["object"], "created": first["created"],
           "model": first["model"], "choices": choices, "usage": usage, "system_fingerprint": FINGERPRINT}
    warnings = [w for p in parts for w in p.get("warnings", [])]
    return {**out, "warnings": warnings} if warnings else out


# Request fields the server honours or checks (OpenAI's, plus vLLM's top_k / min_p / ignore_eos and
# verispec's verification); any other field is refused, never ignored. `user` and `stream_options`
# change no output; the rest must be off (best_of 1, no suffix, penalties 0, no logit_bias; echo only on
# completions).
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



NO_TREE = "none"  # verification.tree: chain drafts, on a server whose default (--tree) is a tree


def pair_rule(spec: str, shape: DraftShape | None) -> Rule | TreeVerification:
    """A rule spec for a draft shape: a chain rule for chain drafts (shape None; `traversal` is refused),
    else the tree rule paired with the shape (`tree_verification_rule`). ValueError / KeyError if bad."""
    if shape is None:
        refuse_tree_rule(spec)
        return parse(spec)
    return tree_verification_rule(spec, shape)



def body_k(body: dict):
    """The request's verification.k as sent (None when absent)."""
    ver = body.get("verification")
    return ver.get("k") if isinstance(ver, dict) else None

class Server:
    """The models, the engine, the metrics and the request handling of one `verispec serve`."""

    def __init__(self, config: ServeConfig, target=None, drafter=None):
        self.config = config
        if target is None:
            check_device(config.device)  # before loading anything: `cuda` on a CPU-only torch is refused
        plain = drafter is None if target is not None else config.draft in (None, defaults.NO_DRAFT)
        if plain and config.tree is not None:
            raise ValueError(f"--tree {config.tree} needs a draft model; this server decodes plainly")
        self.default_shape = None if plain else config.draft_shape  # None: chain drafts
        # a bad --rule fails before the models load
        self.default_rule = None if plain else pair_rule(config.rule, self.default_shape)
        try:
            check_policy(self.default_rule, config)
        except APIError as err:
            raise ValueError(f"the default rule is refused by the server's own guardrails: "
                             f"{err.message}") from None
        self.target = target if target is not None else resolve_target(config.target, config.device,
                                                                        as_dtype(config.dtype))
        if target is None:
            drafter = resolve_drafter(config.draft, self.target, config.device, as_dtype(config.draft_dtype))
        self.drafter = drafter
        self.plain = drafter is None
        if self.plain:
            self.default_rule = None
        elif self.default_shape is not None:  # what needs the models: the vocabulary, the context
            try:
                tree_verification(self.default_rule, self.default_shape, self.drafter, self.target.vocab_size)
                check_tree_room(self.target, 1, DecodeConfig(k=config.k_default, tree=self.default_shape))
            except ValueError as err:
                raise ValueError(f"--tree {self.default_shape.spec}: {err}") from None
        for role, model in (("target", self.target), ("draft", getattr(self.drafter, "model", None))):
            rows = getattr(model, "max_rows", None)  # the llama.cpp backend's batched KV sessions
            if isinstance(rows, int) and config.max_batch > rows and config.max_batch_auto:
                log.warning("--max-batch: %d, the rows the %s model's batched sessions hold", rows, role)
                self.config = config = replace(config, max_batch=rows)
            elif isinstance(rows, int) and config.max_batch > rows:
                raise ValueError(f"--max-batch {config.max_batch} is more rows than the {role} model's "
                                 f"batched sessions hold ({rows}, the llama.cpp backend's); give --max-batch "
                                 f"{rows} or fewer")
        self.model_name = config.served_model_name or getattr(self.target, "name", None) or config.target
        self.context = getattr(getattr(getattr(self.target, "model", None), "config", None),
                               "max_position_embeddings", None)
        self.max_prompt_chars = _max_prompt_chars(self.target, self.context)
        self.metrics = Metrics(config.k_default, self.model_name, config.metrics_names)
        self.engine = Engine(self.target, self.drafter, config, self.metrics)

    # -- parsing ------------------------------------------------------------------------------------
    def parse_tree(self, ver: dict) -> DraftShape | None:
        """The request's draft shape: `verification.tree` (tree:widths=..., drafts:n=..., or "none" for
        chain drafts), else the server's --tree (None: chain drafts)."""
        tree = ver.get("tree")
        if tree is None:
            return self.default_shape
        if not isinstance(tree, str):
            raise APIError(400, "'verification.tree' must be a draft shape string such as "
                                f"'tree:widths=4,2,2,1' or 'drafts:n=3' (or '{NO_TREE}': chain drafts), "
                                f"got {tree!r}", "verification.tree", "invalid_tree")
        if tree.strip() == NO_TREE:
            return None
        try:
            return parse_draft_shape(tree)
        except ValueError as err:
            raise APIError(400, f"bad draft shape '{tree[:200]}': {err}", "verification.tree",
                           "invalid_tree") from None

    def parse_rule(self, body: dict) -> tuple[Rule | TreeVerification | None, int, DraftShape | None]:
        """The request's rule (None: plain decoding), k and draft shape (None: chain drafts), checked
        without the prompt (the tree's room in the context is `parse_request`'s). With --k auto, a request
        without verification.k (or with "auto") adapts its k (`Params.adaptive`); its own k pins it."""
        ver = body.get("verification")
        if ver is None:
            ver = {}
        if not isinstance(ver, dict):
            raise APIError(400, "'verification' must be an object like {\"rule\": \"lossless\", \"k\": 4}",
                           "verification")
        unknown = set(ver) - {"rule", "k", "tree"}
        if unknown:
            raise APIError(400, f"unknown 'verification' fields: {', '.join(sorted(unknown))} "
                                "(known: rule, k, tree)", "verification")
        if ver.get("k") == "auto" and not self.config.adaptive:
            raise APIError(400, "'verification.k': auto needs a server started with --k auto (it measures "
                                "the pair's pass costs at start)", "verification.k")
        k = (self.config.k_default if ver.get("k") in (None, "auto") else
             _number(ver, "k", int, 1, self.config.max_k))
        shape = self.parse_tree(ver)
        spec = ver.get("rule")
        if spec is not None and not isinstance(spec, str):
            raise APIError(400, f"'verification.rule' must be a rule spec string, got {spec!r}",
                           "verification.rule", "invalid_rule")
        if self.plain:
            if shape is not None:
                raise APIError(400, f"this server runs plain decoding (--draft none): no draft tree applies, "
                                    f"got '{shape.spec}'", "verification.tree", "invalid_tree")
            if spec is None or spec in ("lossless", "plain"):
                return None, k, None
            raise APIError(400, "this server runs plain decoding (--draft none): no verification rule "
                                f"applies, got '{spec}'", "verification.rule", "rule_not_allowed")
        if shape is not None and ver.get("k") is not None and shape.depth is not None:
            raise APIError(400, f"'verification.k' sets the length of chain drafts (and of drafts:n=... "
                                f"chains without a depth); the draft shape '{shape.spec}' has its own depth "
                                f"({shape_depth(shape, k)}): leave k out", "verification.k", "invalid_tree")
        if spec is None and shape == self.default_shape:
            rule = self.default_rule
        else:
            rule = self.request_rule(spec, shape, ver.get("tree") is None)
        check_policy(rule, self.config)
        return rule, k, shape

    def check_tree(self, rule: TreeVerification, shape: DraftShape, k: int, sampling: SamplingConfig,
                   prompt_len: int, logprobs: int | None) -> None:
        """APIError (400) for a tree request the decoder would refuse (`tree_verification`: a model
        drafter, widths within the vocabulary; `DecodeConfig`: distinct drafts at temperature 0;
        `check_tree_room`: the depth within the context left after the prompt), one over
        --max-tree-nodes, and top log-probabilities under a lossy tree rule."""
        try:
            tree_verification(rule, shape, self.drafter, self.target.vocab_size)
            config = DecodeConfig(k=k, sampling=sampling, tree=shape)
        except ValueError as err:
            raise APIError(400, str(err), "verification.tree", "invalid_tree") from None
        try:
            check_tree_room(self.target, prompt_len, config)
        except ValueError as err:
            raise APIError(400, str(err), "verification.tree", "context_length_exceeded") from None
        try:
            check_tree_nodes(shape, k, self.config.max_tree_nodes, "the draft shape")
        except ValueError as err:
            raise APIError(400, str(err), "verification.tree", "invalid_tree") from None
        if logprobs and not rule.lossless:
            raise APIError(400, f"top log-probabilities under the behaviour law of the lossy tree rule "
                                f"'{rule.spec}' are not recorded (its per-token laws are kept only at the "
                                "drawn tokens, docs/design.md 'Tree decoding'); ask for 0 top alternatives "
                                "(each token's behaviour_logprob is exact) or use a lossless rule",
                           "logprobs", "unsupported")

    def request_rule(self, spec: str | None, shape: DraftShape | None,
                     default_shape: bool = False) -> Rule | TreeVerification:
        """`verification.rule` (None: the server's --rule) for the request's draft shape (`default_shape`:
        the server's --tree, which the client did not name); APIError (400)."""
        default = spec is None
        spec = self.config.rule if default else spec
        try:
            return pair_rule(spec, shape)
        except (ValueError, KeyError, RecursionError) as err:  # RecursionError: a spec nested too deeply
            why = err if not isinstance(err, RecursionError) else "nested too deeply"
            drafts = f"the draft shape '{shape.spec}'" if shape is not None else "chain drafts"
            if shape is not None and default_shape:
                drafts += f" (this server's --tree; send \"tree\": \"{NO_TREE}\" for chain drafts)"
            if default:
                message = (f"this server's default rule '{spec}' (--rule) does not apply to {drafts}: {why}; "
                           "name a rule in 'verification.rule'")
            else:
                where = f" for {drafts}" if shape is not None else ""
                message = f"bad rule spec '{spec[:200]}'{where}: {why}"
            raise APIError(400, message, "verification.rule", "invalid_rule") from None

    def encode(self, body: dict, chat: bool) -> list[int]:
        """The prompt's token ids ('messages' for chat, else 'prompt'); APIError (400) if unusable, and
        before tokenizing when its text is too long to fit the context whatever its tokens
        (`_max_prompt_chars`)."""
        if self.max_prompt_chars is not None:
            text = _text_length(body.get("messages") if chat else body.get("prompt"))
            if text > self.max_prompt_chars:
                raise APIError(400, f"the prompt's {text} characters cannot fit this model's context of "
                                    f"{self.context} tokens (no token is longer than "
                                    f"{self.max_prompt_chars // self.context} characters)",
                               "messages" if chat else "prompt", "context_length_exceeded")
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
                    raise APIError(400, "'prompt' must be a string, a list of token ids, or a list of "
                                        "several prompts all of one kind (strings or token-id lists)",
                                   "prompt")
                if not isinstance(prompt, (str, list)):
                    raise APIError(400, "'prompt' must be a string or a list of token ids", "prompt")
                prompt_ids = encode_prompt(self.target, prompt, chat=False)
        except (ValueError, TypeError, OverflowError) as err:  # e.g. a token id too large for the tokenizer
            raise APIError(400, str(err), "messages" if chat else "prompt") from None
        if not prompt_ids:
            raise APIError(400, "empty prompt", "messages" if chat else "prompt")
        return prompt_ids

    def parse_request(self, body, chat: bool) -> Params:
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        check_body(body)
        model = body.get("model", self.model_name)
        if model not in (self.model_name, self.config.target):
            raise APIError(404, f"the model '{model}' does not exist; this server serves '{self.model_name}'",
                           "model", "model_not_found", kind="not_found_error")
        n = _number(body, "n", int, 1, default=1)
        if n > self.config.max_n:
            raise APIError(400, f"n={n!r} is more choices than this server returns per request (--max-n "
                                f"{self.config.max_n}); send several requests", "n", "unsupported")
        if n > self.config.max_batch + self.config.max_queue:
            raise APIError(400, f"n={n!r} can never be admitted: this server holds "
                                f"{self.config.max_batch + self.config.max_queue} requests", "n",
                           "unsupported")
        echo = body.get("echo", False)
        if echo is None:
            echo = False
        if not isinstance(echo, bool):
            raise APIError(400, f"'echo' must be true or false, got {echo!r}", "echo")
        if echo and chat:
            raise APIError(400, "'echo' is a completions field (/v1/completions): chat has no echo", "echo",
                           "unsupported")
        for key, off in (("best_of", (None, 1)), ("suffix", (None, "")),
                         ("presence_penalty", (None, 0)), ("frequency_penalty", (None, 0)),
                         ("logit_bias", (None, {}))):
            if not _is_off(body.get(key), off):
                raise APIError(400, f"'{key}' is not supported by verispec serve", key, "unsupported")
        if not isinstance(body.get("user", ""), str):
            raise APIError(400, "'user' must be a string", "user")
        options = body.get("stream_options")
        if options is not None and not (isinstance(options, dict) and set(options) <= {"include_usage"}
                                        and isinstance(options.get("include_usage", False), bool)):
            raise APIError(400, "'stream_options' may only hold 'include_usage': true or false",
                           "stream_options")
        include_usage = bool((options or {}).get("include_usage", False))
        logprobs = self.parse_logprobs(body, chat)
        prompt_ids = self.encode(body, chat)
        # after the prompt: a chat request with a 'prompt' is told 'messages' is missing
        unknown = sorted(set(body) - (CHAT_FIELDS if chat else COMPLETION_FIELDS))
        if unknown:  # never silently ignored: a misplaced "rule" would decode with the default rule
            raise APIError(400, f"unsupported field(s) {', '.join(map(repr, unknown))}: verispec serve "
                                "refuses fields it does not honour (the verification rule goes in "
                                "'verification': {\"rule\": ..., \"k\": ...})", unknown[0], "unsupported")
        vocab = self.target.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise APIError(400, f"prompt token ids must be in [0, {vocab})", "prompt")
        limit = self.config.max_prompt_tokens
        if limit is not None and len(prompt_ids) > limit:
            raise APIError(400, f"the prompt has {len(prompt_ids)} tokens, more than this server's "
                                f"--max-prompt-tokens {limit}", "messages" if chat else "prompt",
                           "context_length_exceeded")
        # lengths
        key = "max_tokens"
        if chat and body.get("max_completion_tokens") is not None:
            key = "max_completion_tokens"
        default = self.config.default_max_tokens
        if default is None:  # vLLM's: the context left after the prompt, within --max-tokens-limit
            left = self.config.max_tokens_limit if self.context is None else self.context - len(prompt_ids)
            default = max(1, min(self.config.max_tokens_limit, left))
        max_tokens = _number(body, key, int, 0, self.config.max_tokens_limit, default=default)
        if max_tokens == 0 and not echo:
            raise APIError(400, f"'{key}' must be >= 1 (0 only with 'echo': true, to score the prompt), "
                                "got 0", key)
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
        if (not isinstance(stop, list) or len(stop) > MAX_STOPS
                or not all(isinstance(s, str) and s for s in stop)):
            raise APIError(400, f"'stop' must be a non-empty string or a list of up to {MAX_STOPS} of them",
                           "stop")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise APIError(400, "'stream' must be true or false", "stream")
        ignore_eos = body.get("ignore_eos", False)
        if not isinstance(ignore_eos, bool):
            raise APIError(400, "'ignore_eos' must be true or false", "ignore_eos")
        rule, k, shape = self.parse_rule(body)
        if shape is not None:
            self.check_tree(rule, shape, k, sampling, len(prompt_ids), logprobs)
        greedy_refused = not self.config.allow_greedy_sampling and temperature > 0
        if rule is not None and rule.name == "greedy" and greedy_refused:
            raise APIError(400, f"rule 'greedy' returns the target's argmax whatever the temperature, so it "
                                f"would ignore temperature={temperature:g}: send temperature 0 for greedy "
                                "decoding (or the operator allows it with --allow-greedy-sampling)",
                           "verification.rule", "rule_not_allowed")
        warnings = self.check_response_tv(rule, max_tokens)
        adaptive = (self.config.adaptive and shape is None and rule is not None
                    and body_k(body) in (None, "auto"))
        return Params(prompt_ids=prompt_ids, rule=rule, k=k, max_tokens=max_tokens, sampling=sampling,
                      adaptive=adaptive,
                      tree=shape, seed=seed, stop=stop, stream=stream, model=self.model_name,
                      ignore_eos=ignore_eos, logprobs=logprobs, include_usage=include_usage,
                      warnings=warnings, n=n, echo=echo)

    def parse_logprobs(self, body: dict, chat: bool) -> int | None:
        """None (no log-probabilities), or how many top alternatives each token carries. Completions:
        `logprobs` = that count; chat: `logprobs` true, with `top_logprobs` = that count."""
        if chat:
            on = body.get("logprobs")
            if on is not None and not isinstance(on, bool):
                raise APIError(400, f"'logprobs' must be true or false, got {on!r}", "logprobs")
            top = _number(body, "top_logprobs", int, 0, MAX_TOP_LOGPROBS)
            if top is not None and not on:
                raise APIError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs")
            count = (top or 0) if on else None
        else:
            if body.get("top_logprobs") is not None:
                raise APIError(400, "completions take 'logprobs': N (the top alternatives per token); "
                                    "'top_logprobs' is the chat field", "top_logprobs", "unsupported")
            count = _number(body, "logprobs", int, 0, MAX_TOP_LOGPROBS)
        if count is not None and not self.config.diagnostics:
            raise APIError(400, "log-probabilities need the per-token record this server turns off "
                                "(--no-diagnostics)", "logprobs", "unsupported")
        return count

    def check_response_tv(self, rule: Rule | None, max_tokens: int) -> list[str]:
        """The response-level TV guardrail (--max-tv-per-response: 400 when the certified TV of the whole
        response, min(1, max_tokens x per-token bound), exceeds it) and a warning when the certificate
        of a budget rule certifies nothing (its bound reaches 1)."""
        per_token = certifiable_tv(rule)
        bound = None if per_token is None else min(1.0, max_tokens * per_token)
        cap = self.config.max_tv_per_response
        if cap is not None and (bound is None or bound > cap):
            what = "has no TV certificate" if bound is None else (
                f"certifies only TV <= {bound:g} over max_tokens={max_tokens} ({max_tokens} x {per_token:g})")
            raise APIError(400, f"rule '{rule.spec}' {what}; this server's --max-tv-per-response is {cap:g}: "
                                f"use a budget rule with tv <= {cap / max_tokens:.3g}, fewer max_tokens, or "
                                "'lossless'", "verification.rule", "rule_not_certifiable")
        if bound is not None and per_token > 0 and bound >= 1:
            return [f"the certificate of '{rule.spec}' over max_tokens={max_tokens} is min(1, {max_tokens} x "
                    f"{per_token:g}) = 1: it certifies nothing; lower tv or max_tokens for a useful bound"]
        return []


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


def _max_prompt_chars(target, context: int | None) -> int | None:
    """The most characters a prompt that fits `context` tokens can have: context x the longest token of
    the vocabulary (its string in the tokenizer's vocabulary, which a token's decoded text never exceeds:
    byte-level and SentencePiece pieces map one symbol to at least one character). None when unknown."""
    vocab = getattr(getattr(target, "tokenizer", None), "get_vocab", None)
    if context is None or not callable(vocab):
        return None
    try:
        longest = max((len(piece) for piece in vocab()), default=0)
    except (TypeError, ValueError):
        return None
    return context * longest if longest > 0 else None


def _text_length(value) -> int:
    """Characters of a prompt string or of chat messages' string contents (other shapes: 0, left to
    the parser's own errors)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, list):
        return sum(len(m["content"]) for m in value
                   if isinstance(m, dict) and isinstance(m.get("content"), str))
    return 0


OPEN_PATHS = ("/health", "/live")  # answered without the API key (a load balancer's probes)


class Gateway:
    """ASGI middleware for a server behind a gateway: the API key (`Authorization: Bearer KEY`, 401 in
    OpenAI's shape otherwise; /health stays open) and a request id, taken from the client's
    `X-Request-Id` or made here, echoed on every response."""

    def __init__(self, app, api_key: str | None):
        self.app, self.api_key = app, api_key

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        given = headers.get(b"x-request-id", b"")[:128]
        usable = given and given.isascii() and given.decode().isprintable()
        request_id = given if usable else secrets.token_hex(8).encode()

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                extra = (b"x-request-id", request_id)
                message = {**message, "headers": [*message.get("headers", []), extra]}
            await send(message)

        guarded = scope.get("path") not in OPEN_PATHS and scope.get("method") != "OPTIONS"
        if (self.api_key is not None and guarded
                and not secrets.compare_digest(headers.get(b"authorization", b""),
                                               f"Bearer {self.api_key}".encode())):
            return await _send_error(send_with_id, 401, "a valid API key is required: send 'Authorization: "
                                     "Bearer KEY' (the server's --api-key)", "invalid_api_key")
        await self.app(scope, receive, send_with_id)


class BodyLimit:
    """ASGI middleware: a request body over `max_bytes` is answered 413 (at once when its Content-Length
    says so, else as soon as the bytes received pass it), and a body not received within `timeout`
    seconds is answered 408, so a client that never finishes its body does not hold its connection."""

    def __init__(self, app, max_bytes: int, timeout: float):
        self.app, self.max_bytes, self.timeout = app, max_bytes, timeout

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            status, message = ((413, f"the request body is {int(length)} bytes, over the server's limit of "
                                     f"{self.max_bytes} (--max-body-bytes)") if length.isdigit()
                               else (400, "the Content-Length header is not a number"))
            return await _send_error(send, status, message)
        loop = asyncio.get_running_loop()
        deadline, received, complete = loop.time() + self.timeout, 0, False

        async def limited():
            nonlocal received, complete
            if complete:  # after the body: disconnect notices, unbounded in time
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), timeout=max(deadline - loop.time(), 0.001))
            except asyncio.TimeoutError:
                raise APIError(408, f"the request body did not arrive within {self.timeout:g} s "
                                    "(--body-timeout)", code="request_timeout") from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise APIError(413, f"the request body is over the server's limit of {self.max_bytes} "
                                        "bytes (--max-body-bytes)", code="request_too_large")
                complete = not message.get("more_body", False)
            return message

        await self.app(scope, limited, send)


async def _send_error(send, status: int, message: str, code: str | None = None) -> None:
    """An error in OpenAI's shape, sent by ASGI middleware (before the app runs); the connection closes."""
    code = code or ("request_too_large" if status == 413 else None)
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": code}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()), (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


def create_app(config: ServeConfig | None = None, target=None, drafter=None, server: Server | None = None,
               replica: str | None = None):
    """The ASGI app (FastAPI). Models load here (once); the engine thread runs while the app is up.
    `replica` (a Ray Serve replica's id, `verispec.serving.ray`): every response carries it in the
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
            tokenizing.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="verispec serve", version=VERSION, lifespan=lifespan)

    def openapi() -> dict:
        """FastAPI's schema plus the verification report's and the log-probabilities' (serving/schema.py)."""
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            schema.setdefault("components", {}).setdefault("schemas", {}).update(SCHEMAS)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
    with_report = {200: {"description": "OpenAI's response, plus verispec's fields (VerispecResponseFields)",
                         "content": {"application/json": {"schema": {
                             "$ref": "#/components/schemas/VerispecResponseFields"}}}}}
    app.state.server = server
    app.add_middleware(BodyLimit, max_bytes=server.config.max_body_bytes, timeout=server.config.body_timeout)
    if server.config.allowed_origins:  # a browser's preflight (OPTIONS) and its CORS headers
        app.add_middleware(CORSMiddleware, allow_origins=list(server.config.allowed_origins),
                           allow_methods=["GET", "POST", "OPTIONS"], allow_headers=["*"],
                           expose_headers=["x-request-id", REPLICA_HEADER])
    app.add_middleware(Gateway, api_key=server.config.api_key)  # outermost: before any body is read
    # JSON parsing and tokenizing off the event loop (one thread: the tokenizer is not shared between
    # threads), so a large prompt does not hold up /health or the streams of other requests
    tokenizing = ThreadPoolExecutor(1, thread_name_prefix="verispec-tokenize")

    async def off_loop(fn, *args):
        return await asyncio.get_running_loop().run_in_executor(tokenizing, fn, *args)

    if replica is not None:
        Gauge(f"{server.metrics.prefix}:replica_info", "The replica that served this exposition (always 1)",
              ["replica"],
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

    @app.exception_handler(Exception)
    async def _unexpected(request, err: Exception):  # a bug: still OpenAI's shape, never plain text
        log.error("unexpected error on %s: %r", request.url.path, err, exc_info=err)
        return error(APIError(500, f"internal error: {type(err).__name__}: {err}", kind="server_error"))

    @app.get("/health")
    async def health():
        """200 once the engine has warmed up and while its thread runs; 503 `warming_up` before (the
        readiness a load balancer waits for), and once the engine has died (a probe by status code sees
        it). `/live` is the liveness probe: 200 while the thread runs, warm or not."""
        status = "ok" if engine.alive else ("engine_failed" if engine.error is not None else "engine_stopped")
        if engine.alive and not engine.ready:
            status = "warming_up"
        state = {"status": status, "running": engine.running, "waiting": engine.waiting,
                 "model": server.model_name}
        if engine.error is not None:
            state["error"] = repr(engine.error)
        if replica is not None:
            state["replica"] = replica
        return JSONResponse(state, status_code=200 if status == "ok" else 503)

    @app.get("/live")
    async def live():
        """Liveness: 200 while the engine thread runs (warming up or serving), 503 once it has died."""
        return JSONResponse({"alive": engine.alive}, status_code=200 if engine.alive else 503)

    @app.get("/version")
    async def version():
        return {"version": VERSION}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        """vLLM's /tokenize: {"prompt": text} (or chat "messages") -> {"tokens", "count", "max_model_len"}."""
        body = await json_body(request)
        chat = "messages" in body
        unknown = sorted(set(body) - {"model", "prompt", "messages", "add_special_tokens"})
        if unknown:
            raise APIError(400, f"unsupported field(s) {', '.join(map(repr, unknown))}", unknown[0],
                           "unsupported")
        if not isinstance(body.get("add_special_tokens", True), bool):
            raise APIError(400, "'add_special_tokens' must be true or false", "add_special_tokens")
        if chat and "prompt" in body:
            raise APIError(400, "send 'prompt' or 'messages', not both", "prompt")
        if not chat and not isinstance(body.get("prompt"), str):
            raise APIError(400, "'prompt' must be a string (or send 'messages')", "prompt")
        ids = await off_loop(server.encode, body, chat)
        # serialised off the loop too: a long prompt's ids are a large JSON array
        content = await off_loop(lambda: json.dumps({"tokens": ids, "count": len(ids),
                                                     "max_model_len": server.context}).encode())
        return Response(content, media_type="application/json")

    @app.post("/detokenize")
    async def detokenize(request: Request):
        """vLLM's /detokenize: {"tokens": [ids]} -> {"prompt": text}."""
        body = await json_body(request)
        unknown = sorted(set(body) - {"model", "tokens"})
        if unknown:
            raise APIError(400, f"unsupported field(s) {', '.join(map(repr, unknown))}", unknown[0],
                           "unsupported")
        ids = body.get("tokens")
        vocab = server.target.vocab_size
        if not _token_list(ids) or any(not 0 <= t < vocab for t in ids):
            raise APIError(400, f"'tokens' must be a list of token ids in [0, {vocab})", "tokens")
        return {"prompt": server.target.decode(ids)}

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        """vLLM's /tokenizer_info: the tokenizer's class, special tokens, chat template and context length
        (what lm-evaluation-harness's remote tokenizer reads; with /tokenize and /detokenize it then needs
        no tokenizer files of its own)."""
        tok = getattr(server.target, "tokenizer", None)
        if tok is None:
            raise APIError(404, "this model has no tokenizer to describe", kind="not_found_error")

        def special(name: str) -> str | None:
            value = getattr(tok, name, None)
            return value if isinstance(value, str) else None

        template = getattr(tok, "chat_template", None)
        return {"tokenizer_class": type(tok).__name__, "eos_token": special("eos_token"),
                "bos_token": special("bos_token"), "pad_token": special("pad_token"),
                "unk_token": special("unk_token"),
                "chat_template": template if isinstance(template, str) else None,
                "model_max_length": server.context, "vocab_size": server.target.vocab_size}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": server.model_name, "object": "model", "created": 0,
                                            "owned_by": "verispec", "max_model_len": server.context}]}

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    async def json_body(request: Request) -> dict:
        raw = await request.body()
        try:
            body = await off_loop(json.loads, raw) if len(raw) > 2**16 else json.loads(raw)
        except (ValueError, UnicodeDecodeError) as err:
            raise APIError(400, f"the request body is not valid JSON: {err}") from None
        except RecursionError:  # the JSON parser recurses per nesting level
            raise APIError(400, f"the request body is nested too deeply (at most {MAX_BODY_DEPTH} "
                                "levels)") from None
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        check_body(body)
        model = body.get("model", server.model_name)
        if model not in (server.model_name, server.config.target):
            raise APIError(404, f"the model '{model}' does not exist; this server serves "
                                f"'{server.model_name}'", "model", "model_not_found", kind="not_found_error")
        return body

    async def handle(request: Request, chat: bool, body: dict | None = None):
        if body is None:
            body = await json_body(request)
        params = await off_loop(server.parse_request, body, chat)
        loop, events = asyncio.get_running_loop(), asyncio.Queue()
        jobs = [Job(id=engine.new_id(), params=replace(params, seed=(params.seed + i) % (MAX_SEED + 1)),
                    loop=loop, events=events, index=i) for i in range(params.n)]
        try:
            engine.submit(jobs)
        except QueueFull:
            raise APIError(503, f"the server is at capacity ({server.config.max_batch} decoding + "
                                f"{server.config.max_queue} queued requests); retry later", code="queue_full",
                           kind="server_error", headers={"Retry-After": "1"}) from None
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{jobs[0].id}-{secrets.token_hex(4)}"
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"
        chunk_obj = "chat.completion.chunk" if chat else "text_completion"
        returned_tokens = [0] * params.n  # per choice, once done

        def cancel_all() -> None:
            for job in jobs:
                engine.cancel(job)  # a client gone frees its rows at the next block

        def usage(prompt_tokens: int) -> dict:
            done = sum(returned_tokens)
            return {"prompt_tokens": prompt_tokens, "completion_tokens": done,
                    "total_tokens": prompt_tokens + done}

        def choice_fields(i: int, gen: Generation, report: dict, returned: int) -> dict:
            """A choice's own seed, token ids and verification report."""
            return {"seed": jobs[i].params.seed, "token_ids": list(gen.token_ids[:returned]),
                    "verification": json_safe(report)}

        def top_fields(fields: dict) -> dict:
            out = {"system_fingerprint": FINGERPRINT}
            if params.n == 1:  # one choice: its fields at the top level too (as before n > 1 existed)
                out.update(fields)
            return {**out, "warnings": params.warnings} if params.warnings else out

        prompt_text = server.target.decode(params.prompt_ids) if params.echo else ""

        mode, temperature = server.config.logprobs_mode, params.sampling.temperature
        offsets = [0] * params.n  # streaming: the text_offset of choice i's next entry

        def shaped(i: int, entries: list[dict], sums: dict | None) -> dict:
            decode = server.target.decode
            out = (chat_logprobs(entries, decode, sums=False) if chat else
                   completion_logprobs(entries, decode, offsets[i], sums=False))
            offsets[i] += sum(len(e["token"]) for e in entries)
            return json_safe(numbers_only({**out, **(sums or {})}))

        def logprobs(i: int, gen: Generation, returned: int) -> dict | None:
            """Choice i's (the rest of them, streaming): with echo, the prompt's entries first (scored by
            the engine), then the generated tokens'; the sums are of all its tokens."""
            if params.logprobs is None:
                return None
            job, decode = jobs[i], server.target.decode
            start = min(job.tokens_streamed, returned)
            entries = ([] if job.prompt_streamed else list(job.prompt_entries or [])) + (
                token_logprobs(gen, returned, params.logprobs, decode, mode, temperature, start=start)
                if returned > start else [])
            every = entries if start == 0 else token_logprobs(gen, returned)  # the record alone
            return shaped(i, entries, totals(every))

        def chunk(choices: list, **extra) -> str:
            body = {"id": rid, "object": chunk_obj, "created": created, "model": params.model,
                    "choices": choices, **extra}
            if params.include_usage and "usage" not in body:
                body["usage"] = None  # OpenAI: every chunk has the field; only the last one fills it
            return f"data: {json.dumps(body)}\n\n"

        if params.stream:
            async def stream():
                try:
                    if chat:  # OpenAI's chat stream: the role once per choice, in a first chunk of its own
                        yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                                      "logprobs": None, "finish_reason": None} for i in range(params.n)])
                    finished, prompt_tokens = 0, len(params.prompt_ids)
                    if params.echo:  # the prompt first, in a chunk of its own per choice
                        for i in range(params.n):
                            yield chunk([{"index": i, "text": prompt_text, "logprobs": None,
                                          "finish_reason": None}])
                    while finished < params.n:
                        i, event = await events.get()
                        if event[0] == "delta":
                            lp = None if event[2] is None else shaped(i, event[2], None)  # its tokens'
                            yield chunk([{"index": i, "delta": {"content": event[1]}, "logprobs": lp,
                                          "finish_reason": None} if chat else
                                         {"index": i, "text": event[1], "logprobs": lp,
                                          "finish_reason": None}])
                        elif event[0] == "done":
                            _, gen, _text, finish, report, returned = event
                            returned_tokens[i], finished = returned, finished + 1
                            lp = logprobs(i, gen, returned)  # the tokens no chunk carried, and the sums
                            fields = choice_fields(i, gen, report, returned)
                            last = ({"index": i, "delta": {}, "logprobs": lp, "finish_reason": finish} if chat
                                    else {"index": i, "text": "", "logprobs": lp, "finish_reason": finish})
                            yield chunk([last if params.n == 1 else {**last, **fields}], **top_fields(fields))
                        else:
                            yield f"data: {json.dumps(event[1].body())}\n\n"
                            return
                    if params.include_usage:  # its own last chunk, with no choices (OpenAI)
                        yield chunk([], usage=usage(prompt_tokens))
                    yield "data: [DONE]\n\n"
                finally:
                    cancel_all()

            return StreamingResponse(stream(), media_type="text/event-stream")

        results: dict[int, tuple] = {}
        try:
            while len(results) < params.n:
                try:
                    i, event = await asyncio.wait_for(events.get(), 0.5)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        cancel_all()
                        return Response(status_code=499)
                    continue
                if event[0] == "error":
                    cancel_all()
                    raise event[1]
                if event[0] == "done":
                    results[i] = event
        except asyncio.CancelledError:
            cancel_all()
            raise
        choices, fields = [], {}
        for i in range(params.n):
            _, gen, text, finish, report, returned = results[i]
            returned_tokens[i] = returned
            fields = choice_fields(i, gen, report, returned)
            lp = logprobs(i, gen, returned)
            choice = ({"index": i, "message": {"role": "assistant", "content": text},
                       "finish_reason": finish, "logprobs": lp} if chat else
                      {"index": i, "text": prompt_text + text, "logprobs": lp, "finish_reason": finish})
            choices.append(choice if params.n == 1 else {**choice, **fields})
        return {"id": rid, "object": obj, "created": created, "model": params.model, "choices": choices,
                "usage": usage(len(params.prompt_ids)), **top_fields(fields)}

    @app.post("/v1/completions", responses=with_report)
    async def completions(request: Request):
        body = await json_body(request)
        prompts = several_prompts(body.get("prompt"))
        if prompts is None:
            return await handle(request, False, body)
        if body.get("stream"):
            raise APIError(400, "'stream' with several prompts is not supported: stream one request per "
                                "prompt", "stream")
        # one request per prompt, decoded concurrently (the engine batches them); the choices in
        # prompt order, n per prompt, as OpenAI's and vLLM's servers return them
        tasks = [asyncio.create_task(handle(request, False, {**body, "prompt": p})) for p in prompts]
        try:
            parts = await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            raise
        for part in parts:
            if isinstance(part, Response):  # the client went away
                return part
        return merge_completions(parts)

    @app.post("/v1/chat/completions", responses=with_report)
    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    return app


class DrainingServer(uvicorn.Server):
    """uvicorn, whose shutdown (SIGINT/SIGTERM, or `should_exit`) first drains the engine: waiting
    requests are answered 503 `shutting_down` at once, decoding rows get `config.shutdown_grace` seconds,
    then end with 503 (a stream: a final error chunk), so every connection closes within the grace
    period and uvicorn never cancels a request task (no CancelledError tracebacks)."""

    def __init__(self, config: uvicorn.Config, engine: Engine, grace: float):
        super().__init__(config)
        self.engine, self.grace = engine, grace

    async def shutdown(self, sockets=None) -> None:
        self.engine.drain(self.grace)
        await super().shutdown(sockets)


def uvicorn_server(app, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> DrainingServer:
    """The uvicorn server of `create_app`'s app: graceful shutdown bounded by the drain's grace period."""
    server: Server = app.state.server
    grace = server.config.shutdown_grace
    config = uvicorn.Config(app, host=host, port=check_port(port), log_level=log_level,
                            timeout_graceful_shutdown=grace + 5)  # the drain ends every request by then
    return DrainingServer(config, server.engine, grace)


def serve(config: ServeConfig, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> None:
    """Load the models, then run the app under uvicorn until interrupted (a draining shutdown)."""
    check_port(port)  # before the models load
    uvicorn_server(create_app(config), host, port, log_level).run()
