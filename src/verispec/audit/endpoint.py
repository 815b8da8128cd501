"""Replies from an OpenAI-compatible completions endpoint (verispec serve, vLLM, SGLang, llama.cpp's server,
llama-cpp-python's server): one request per reply, the prompt sent as token ids (so the engine and the
reference see the same prompt), plain standard-library HTTP (no client dependency).

The reply's token ids come from the response where it returns them (`choices[0].token_ids`: verispec
serve, vLLM with `return_token_ids`, llama.cpp's `tokens`), else from tokenizing the text with the
reference's tokenizer, kept only when decoding them gives the text back (a reply whose tokens cannot be
told from its text is refused and counted, never guessed).
"""

from __future__ import annotations

import copy
import json
import math
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Callable

import torch

from verispec.sampling import SamplingConfig


class EndpointError(RuntimeError):
    """The endpoint cannot be used: unreachable, an HTTP error, or an answer that is not a completion.
    `status` and `param`: the HTTP status and the OpenAI error's `param`, where the answer gave them."""

    def __init__(self, message: str, status: int | None = None, param: str | None = None):
        super().__init__(message)
        self.status, self.param = status, param


def request_fields(sampling: SamplingConfig) -> dict:
    """The sampling fields of a completion request (and so the law it claims): the temperature, and
    top_k / top_p / min_p where set (eta has no OpenAI field: `AuditConfig.validate` refuses it)."""
    out: dict = {"temperature": sampling.temperature}
    for name in ("top_k", "top_p", "min_p"):
        if getattr(sampling, name) is not None:
            out[name] = getattr(sampling, name)
    return out


def setting_name(sampling: SamplingConfig) -> str:
    """e.g. "T=0.7 top_k=40"."""
    return " ".join(f"{k}={v:g}" if k != "temperature" else f"T={v:g}"
                    for k, v in request_fields(sampling).items())


@dataclass
class Reply:
    token_ids: list[int]  # the emitted tokens, a stop token last if the reply ended at one
    finish: str  # "stop", "length" or the endpoint's word
    text: str = ""
    logprobs: list[float] | None = None  # the endpoint's own log-probabilities of the emitted tokens
    ids_from: str = "endpoint"  # "endpoint" or "text" (tokenized here, round-trip checked)


@dataclass
class Endpoint:
    """An OpenAI-compatible completions endpoint (`url`: its base, e.g. http://127.0.0.1:8000 or .../v1)."""

    url: str
    model: str | None = None
    timeout: float = 300.0
    extra: dict = field(default_factory=dict)  # more request fields (e.g. {"return_token_ids": true})
    logprobs_refused: bool = False  # the endpoint answered 400 on `logprobs`: requests go without them

    def __post_init__(self) -> None:
        base = self.url.rstrip("/")
        if not base.startswith(("http://", "https://")):
            raise ValueError(f"--endpoint must be an http(s) URL, got {self.url!r}")
        self.base = base[:-3] if base.endswith("/v1") else base

    def _call(self, path: str, body: dict | None = None, timeout: float | None = None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        request = urllib.request.Request(self.base + path, data=data, headers=headers,
                                         method="GET" if body is None else "POST")
        try:
            with urllib.request.urlopen(request, timeout=timeout or self.timeout) as response:
                raw = response.read()
        except urllib.error.HTTPError as err:
            detail = err.read()[:500].decode("utf-8", "replace")
            try:
                param = json.loads(detail)["error"].get("param")
            except (ValueError, KeyError, TypeError, AttributeError):
                param = None
            raise EndpointError(f"{self.base}{path} answered HTTP {err.code}: {detail}", err.code,
                                param if isinstance(param, str) else None) from None
        except (urllib.error.URLError, OSError, TimeoutError) as err:
            reason = getattr(err, "reason", err)
            raise EndpointError(f"cannot reach {self.base}{path}: {reason}") from None
        try:
            out = json.loads(raw)
        except ValueError:
            raise EndpointError(f"{self.base}{path} did not answer JSON: {raw[:200]!r}") from None
        if not isinstance(out, dict):
            raise EndpointError(f"{self.base}{path} answered {type(out).__name__}, not a JSON object")
        return out

    def served_model(self) -> str:
        """The model id the endpoint serves (`/v1/models`), checked reachable before any sampling."""
        listing = self._call("/v1/models", timeout=min(self.timeout, 30.0))
        data = listing.get("data")
        if not isinstance(data, list) or not data or not isinstance(data[0], dict) or "id" not in data[0]:
            raise EndpointError(f"{self.base}/v1/models lists no model: {str(listing)[:200]}")
        ids = [d.get("id") for d in data]
        if self.model is not None and self.model not in ids:
            raise EndpointError(f"{self.base} serves {ids}, not {self.model!r}")
        return self.model or ids[0]

    def complete(self, prompt_ids: list[int], max_tokens: int, sampling: SamplingConfig, seed: int,
                 decode: Callable[[list[int]], str], encode: Callable[[str], list[int]],
                 stop_ids: list[int]) -> Reply | None:
        """One reply (None when its token ids cannot be recovered from its text)."""
        body = {"model": self.model, "prompt": prompt_ids, "max_tokens": max_tokens, "seed": seed,
                "logprobs": 1, "n": 1, **request_fields(sampling), **self.extra}
        if self.logprobs_refused:
            body.pop("logprobs")
        try:
            out = self._call("/v1/completions", body)
        except EndpointError as err:
            if err.status != 400 or err.param != "logprobs" or self.logprobs_refused:
                raise
            self.logprobs_refused = True  # e.g. verispec serve --no-diagnostics: audit without them
            body.pop("logprobs")
            out = self._call("/v1/completions", body)
        try:
            choice = out["choices"][0]
            text, finish = choice.get("text", ""), choice.get("finish_reason") or "length"
        except (KeyError, IndexError, TypeError, AttributeError):
            raise EndpointError(f"not a completion: {str(out)[:300]}") from None
        ids = _returned_ids(choice, out)
        source = "endpoint"
        if ids is None:
            ids, source = encode(text) if text else [], "text"
            if decode(ids) != text:
                return None  # ambiguous: its tokens cannot be told from its text
        if finish == "stop" and stop_ids and (not ids or ids[-1] not in stop_ids):
            ids = ids + [stop_ids[0]]  # ended at a stop token the response leaves out of its tokens
        return Reply(ids, finish, text, _returned_logprobs(choice), source)


def _is_id(t) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


def _returned_ids(choice: dict, out: dict) -> list[int] | None:
    """The reply's token ids where the response carries them: `token_ids` (verispec serve, vLLM with
    return_token_ids), `tokens`, or llama.cpp's log-probability entries (`logprobs.content[].id`)."""
    for holder in (choice, out):
        for key in ("token_ids", "tokens"):
            ids = holder.get(key)
            if isinstance(ids, list) and all(_is_id(t) for t in ids):
                return list(ids)
    content = choice.get("logprobs", {}).get("content") if isinstance(choice.get("logprobs"), dict) else None
    if isinstance(content, list) and all(isinstance(e, dict) and _is_id(e.get("id")) for e in content):
        return [e["id"] for e in content]
    return None


def _returned_logprobs(choice: dict) -> list[float] | None:
    logprobs = choice.get("logprobs")
    values = logprobs.get("token_logprobs") if isinstance(logprobs, dict) else None
    content = logprobs.get("content") if isinstance(logprobs, dict) else None
    if values is None and isinstance(content, list) and all(isinstance(e, dict) for e in content):
        values = [e.get("logprob") for e in content]  # llama.cpp's (and chat's) shape
    if not isinstance(values, list):
        return None
    out = []
    for v in values:
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out.append(float(v))
        elif v == "-inf":
            out.append(-math.inf)
        else:
            return None
    return out


class AssistedGeneration:
    """An in-process engine: transformers' `generate(..., assistant_model=...)` (assisted generation, which
    verifies an assistant's drafts by speculative sampling when sampling), on a model verispec loads by
    name or path (`hf` = the reference's own transformers model). The assistant is the same model cut to
    its first `assistant_layers` layers (the model's own weights, as verispec's `self:layers=N` drafter).
    `neutral`: pass top_k=0 / top_p=1 / min_p=None unless the setting names them, so the claim is the
    plain tempered law; False leaves the model's generation_config defaults (transformers' top_k=50
    among them), which an audit then reads as a law other than the claim."""

    def __init__(self, hf, assistant_layers: int = 8, neutral: bool = True, name: str = "assisted"):
        if (isinstance(assistant_layers, bool) or not isinstance(assistant_layers, int)
                or assistant_layers < 1):
            raise ValueError(f"--assistant-layers must be an integer >= 1, got {assistant_layers!r}")
        layers = hf.config.num_hidden_layers
        if assistant_layers >= layers:
            raise ValueError(f"--assistant-layers {assistant_layers}: the model has {layers} layers; an "
                             "assistant must be smaller")
        self.hf, self.neutral, self.model = hf, neutral, name
        assistant = copy.deepcopy(hf)
        inner = assistant.model if hasattr(assistant, "model") else assistant
        inner.layers = inner.layers[:assistant_layers]
        assistant.config.num_hidden_layers = assistant_layers
        self.assistant = assistant.eval()

    def served_model(self) -> str:
        return self.model

    def complete(self, prompt_ids: list[int], max_tokens: int, sampling: SamplingConfig, seed: int,
                 decode: Callable[[list[int]], str], encode: Callable[[str], list[int]],
                 stop_ids: list[int]) -> Reply:
        options: dict = {"temperature": sampling.temperature}
        if self.neutral or sampling.top_k is not None:
            options["top_k"] = sampling.top_k or 0
        if self.neutral or sampling.top_p is not None:
            options["top_p"] = sampling.top_p if sampling.top_p is not None else 1.0
        if sampling.min_p is not None:
            options["min_p"] = sampling.min_p
        torch.manual_seed(seed)
        with torch.no_grad():
            out = self.hf.generate(torch.tensor([prompt_ids]), do_sample=True, max_new_tokens=max_tokens,
                                   assistant_model=self.assistant, eos_token_id=list(stop_ids) or None,
                                   pad_token_id=stop_ids[0] if stop_ids else None, **options)
        ids = [int(t) for t in out[0, len(prompt_ids):]]
        if stop_ids:
            cut = next((i for i, t in enumerate(ids) if t in stop_ids), None)
            ids = ids if cut is None else ids[: cut + 1]
        finish = "stop" if ids and ids[-1] in stop_ids else "length"
        return Reply(ids, finish, decode(ids), None, "endpoint")
