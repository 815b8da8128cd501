"""Engine presets: a serving engine's documented speculative settings as verispec's rule spec, so the
exact shift of a flag can be measured on your own pair and prompts before it is deployed
(docs/design/diagnostics.md, section 'Engine presets').

    >>> from verispec.rules.engines import from_engine
    >>> preset = from_engine("sglang", "--speculative-accept-threshold-single 0.5 "
    ...                      "--speculative-accept-threshold-acc 0.3")
    >>> preset.rule.spec
    'sglang:single=0.5,acc=0.3'

Flags are given as the engine spells them: `--key value`, `--key=value`, `key=value` (comma or space
separated) or a JSON object; dashes and underscores are the same. A key the preset does not know is
refused with the keys it knows: a silently ignored flag would make the prediction wrong.
"""

from __future__ import annotations

import json
import math
import shlex
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from verispec.rules.base import Rule
from verispec.rules.registry import parse
from verispec.spec import Registry


@dataclass(frozen=True)
class EnginePreset:
    """What an engine does with the given flags, in verispec's terms.

    rule: the verification rule it runs; k: draft tokens per block where the flags fix it; sampling:
    sampler settings the engine applies unless a request overrides them (llama.cpp's server truncates
    the target by default); notes: what the mapping assumes or leaves out, for the user to read."""

    engine: str
    flags: dict[str, str]
    rule: Rule
    k: int | None = None
    sampling: dict[str, float | int] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    lossless_in_law: bool | None = None  # None: the rule's own flag (sglang 1.0/1.0 is lossless in law)

    @property
    def lossless(self) -> bool:
        return bool(self.rule.lossless) if self.lossless_in_law is None else self.lossless_in_law

    def to_json(self) -> dict:
        return {"engine": self.engine, "flags": self.flags, "rule": self.rule.spec,
                "lossless": self.lossless, "k": self.k, "sampling": self.sampling, "notes": list(self.notes)}


@dataclass(frozen=True)
class Engine:
    name: str
    keys: dict[str, str]  # known key -> what it is
    build: Callable[[dict[str, str]], EnginePreset]
    source: str


ENGINES: Registry[Engine] = Registry("engine")


def parse_flags(flags: str | Mapping[str, object] | None) -> dict[str, str]:
    """{normalised key: value text}: keys lower-case with '_' for '-', leading dashes dropped; a bare
    `--flag` is 'true'. ValueError on text that is not flags."""
    if flags is None:
        return {}
    if isinstance(flags, Mapping):
        items = [(str(k), v) for k, v in flags.items()]
    elif not isinstance(flags, str):
        raise ValueError(f"engine flags must be a string or a mapping, got {type(flags).__name__}")
    elif flags.strip().startswith("{"):
        try:
            loaded = json.loads(flags)
        except json.JSONDecodeError as err:
            raise ValueError(f"engine flags look like JSON but do not parse: {err}") from None
        if not isinstance(loaded, dict):
            raise ValueError("engine flags in JSON must be an object of key: value")
        items = list(loaded.items())
    else:
        try:
            words = shlex.split(flags.replace(",", " "))
        except ValueError as err:
            raise ValueError(f"engine flags do not parse: {err}") from None
        items, i = [], 0
        while i < len(words):
            word = words[i]
            if "=" in word:
                key, value = word.split("=", 1)
                items.append((key, value))
            elif word.startswith("-") and not _is_number(word):
                nxt = words[i + 1] if i + 1 < len(words) else None
                has_value = (nxt is not None and "=" not in nxt
                             and (not nxt.startswith("-") or _is_number(nxt)))
                items.append((word, words[i + 1] if has_value else "true"))
                i += has_value
            else:
                raise ValueError(f"engine flags: {word!r} is neither --key [value] nor key=value")
            i += 1
    out: dict[str, str] = {}
    for key, value in items:
        name = key.strip().lstrip("-").replace("-", "_").lower()
        if not name:
            raise ValueError(f"engine flags: empty key in {key!r}")
        out[name] = json.dumps(value) if isinstance(value, (dict, list)) else str(value).strip().lower()
    return out


def _is_number(word: str) -> bool:
    try:
        float(word)
    except ValueError:
        return False
    return True


def from_engine(engine: str, flags: str | Mapping[str, object] | None = None) -> EnginePreset:
    """The preset of `engine` (vllm, sglang, tensorrt-llm, max, llama.cpp) with `flags`. ValueError on an
    unknown engine, an unknown key (the known ones listed) or a value out of the engine's range."""
    entry = ENGINES.get(engine.strip().lower() if isinstance(engine, str) else engine)
    given = parse_flags(flags)
    unknown = sorted(set(given) - set(entry.keys))
    if unknown:
        raise ValueError(f"{entry.name}: unknown flag(s) {', '.join(unknown)}; this preset knows "
                         f"{', '.join(sorted(entry.keys))} ({entry.source})")
    return entry.build(given)


def engine_names() -> list[str]:
    return ENGINES.names()


# -- value readers ---------------------------------------------------------------------------------


def _bool(flags: dict[str, str], key: str, default: bool) -> bool:
    value = flags.get(key)
    if value is None:
        return default
    if value in ("true", "1", "yes", "on"):
        return True
    if value in ("false", "0", "no", "off"):
        return False
    raise ValueError(f"{key} must be true or false, got {value!r}")


def _number(flags: dict[str, str], key: str, default, kind=float):
    value = flags.get(key)
    if value is None:
        return default
    try:
        number = kind(value)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise ValueError(f"{key} must be {what}, got {value!r}") from None
    if kind is float and not math.isfinite(number):
        raise ValueError(f"{key} must be finite, got {value!r}")
    return number


def _choice(flags: dict[str, str], key: str, default: str, allowed: tuple[str, ...]) -> str:
    value = flags.get(key, default)
    if value not in allowed:
        raise ValueError(f"{key} must be one of {', '.join(allowed)}, got {value!r}")
    return value


def _rule(spec: str, engine: str) -> Rule:
    try:
        return parse(spec)
    except ValueError as err:
        raise ValueError(f"{engine}: the flags give {spec!r}, which is out of range: {err}") from None


def _relaxed(flags: dict[str, str], engine: str, topk: int, delta: float) -> Rule:
    """Relaxed acceptance (`relaxed_topk`, `relaxed_delta`; the engine's defaults) as `relaxed:n=,delta=`."""
    topk, delta = _number(flags, "relaxed_topk", topk, int), _number(flags, "relaxed_delta", delta)
    return _rule(f"relaxed:n={topk},delta={delta:g}", engine)


# -- vLLM ------------------------------------------------------------------------------------------


def _vllm(flags: dict[str, str]) -> EnginePreset:
    k = _number(flags, "num_speculative_tokens", None, int)
    method = _choice(flags, "rejection_sample_method", "standard", ("standard", "strict", "fly", "synthetic"))
    legacy = _choice(flags, "spec_decoding_acceptance_method", "rejection_sampler",
                     ("rejection_sampler", "typical_acceptance_sampler"))
    notes = []
    if flags.get("draft_sample_method") == "greedy":
        notes.append("greedy draft sampling: q is one-hot at the draft's argmax (the law is still the "
                     "rule's; acceptance is lower at high temperature)")
    if method == "synthetic":
        raise ValueError("vllm: rejection_sample_method=synthetic forces benchmark acceptance rates; its "
                         "output is not a verification rule's (do not serve it)")
    if legacy == "typical_acceptance_sampler":
        eps = _number(flags, "typical_acceptance_sampler_posterior_threshold", 0.09)
        alpha = _number(flags, "typical_acceptance_sampler_posterior_alpha", math.sqrt(eps))
        notes.append("vLLM's typical acceptance sampler (V0) recovers a rejected position with the "
                     "target's argmax: resample=greedy")
        rule = _rule(f"typical:eps={eps:g},alpha={alpha:g},resample=greedy", "vllm")
    elif method == "fly":
        if k is None and "fly_window_size" not in flags:
            raise ValueError("vllm: FLy's default window is min(6, num_speculative_tokens - 1): give "
                             "num_speculative_tokens (or fly_window_size)")
        if k is not None and k < 2:
            raise ValueError("vllm: FLy needs num_speculative_tokens >= 2")
        window = _number(flags, "fly_window_size", None if k is None else min(6, k - 1), int)
        if k is not None and not 1 <= window < k:
            raise ValueError(f"vllm: fly_window_size must be in [1, num_speculative_tokens) = [1, {k}), "
                             f"got {window}")
        threshold = _number(flags, "fly_entropy_threshold", 0.3)
        top_k = _number(flags, "fly_entropy_top_k", 3, int)
        rule = _rule(f"fly:window={window},threshold={threshold:g},top_k={top_k}", "vllm")
        notes.append("FLy is block-level: its exact law is a block law (docs/design/rules.md, 'fly'); "
                     "measure its shift with `verispec serve --rule ... --no-diagnostics` and "
                     "`verispec audit`; at temperature 0 vLLM gates on the raw logits' entropy, which this "
                     "rule does not model")
    else:
        rule = _rule("lossless", "vllm")
    return EnginePreset("vllm", flags, rule, k, notes=tuple(notes))


ENGINES.add("vllm", Engine("vllm", {
    "num_speculative_tokens": "draft tokens per block",
    "rejection_sample_method": "standard (lossless), fly, synthetic (benchmark only)",
    "fly_window_size": "FLy window W (default min(6, K - 1))",
    "fly_entropy_threshold": "FLy entropy gate in nats (default 0.3)",
    "fly_entropy_top_k": "entries in FLy's entropy (default 3)",
    "draft_sample_method": "greedy or probabilistic drafts",
    "spec_decoding_acceptance_method": "V0: rejection_sampler or typical_acceptance_sampler",
    "typical_acceptance_sampler_posterior_threshold": "V0 typical eps (default 0.09)",
    "typical_acceptance_sampler_posterior_alpha": "V0 typical alpha (default sqrt(eps))",
    "method": "the proposer (draft_model, eagle, mtp, ...): does not change the rule",
    "model": "the draft model: does not change the rule",
}, _vllm, "vLLM speculative_config; docs features/speculative_decoding, fly"))


# -- SGLang ----------------------------------------------------------------------------------------


def _sglang(flags: dict[str, str]) -> EnginePreset:
    single = _number(flags, "speculative_accept_threshold_single", 1.0)
    acc = _number(flags, "speculative_accept_threshold_acc", 1.0)
    rejection = _bool(flags, "speculative_use_rejection_sampling", False)
    k = _number(flags, "speculative_num_steps", None, int)
    topk = _number(flags, "speculative_eagle_topk", 1, int)
    device = _choice(flags, "device", "cuda", ("cuda", "cpu", "xpu", "hip", "npu"))
    notes = []
    if topk > 1:
        notes.append(f"speculative_eagle_topk={topk} drafts a tree; the rule below is its chain form "
                     "(the acceptance of one child)")
    if device in ("cpu", "xpu") or (device == "hip" and not rejection):
        notes.append(f"on {device} SGLang commits the target's argmax even for sampled requests "
                     "(eagle_utils._verify_uses_greedy): the output is greedy whatever the temperature")
        return EnginePreset("sglang", flags, _rule("greedy", "sglang"), k, notes=tuple(notes))
    if rejection:
        if single != 1.0 or acc != 1.0:
            raise ValueError("sglang: --speculative-use-rejection-sampling needs both acceptance thresholds "
                             "at 1.0")
        rule = _rule("lossless", "sglang")
    else:
        rule = _rule(f"sglang:single={single:g},acc={acc:g}", "sglang")
        if single == 1.0 and acc == 1.0:
            notes.append("thresholds 1.0 and 1.0 (the defaults): target-only acceptance with probability "
                         "p(x), resampling p without x: lossless in law")
            return EnginePreset("sglang", flags, rule, k, notes=tuple(notes), lossless_in_law=True)
    return EnginePreset("sglang", flags, rule, k, notes=tuple(notes))


ENGINES.add("sglang", Engine("sglang", {
    "speculative_accept_threshold_single": "accept if p(x) >= this (default 1.0)",
    "speculative_accept_threshold_acc": "accept with probability min(1, p(x)/this) (default 1.0)",
    "speculative_use_rejection_sampling": "p/q rejection sampling with draft probabilities",
    "speculative_num_steps": "draft tokens per block",
    "speculative_eagle_topk": "tree width (1: a chain)",
    "speculative_num_draft_tokens": "tree nodes: does not change the rule",
    "speculative_algorithm": "EAGLE, EAGLE3, NEXTN, ...: does not change the rule",
    "device": "cuda (default), cpu, xpu, hip, npu: some backends verify greedily",
}, _sglang, "SGLang server arguments; sgl-kernel tree_speculative_sampling_target_only"))


# -- TensorRT-LLM ----------------------------------------------------------------------------------


def _tensorrt(flags: dict[str, str]) -> EnginePreset:
    relaxed = _bool(flags, "use_relaxed_acceptance_for_thinking", False)
    k = _number(flags, "max_draft_len", _number(flags, "num_nextn_predict_layers", None, int), int)
    notes = []
    if relaxed:
        rule = _relaxed(flags, "tensorrt-llm", 1, 0.0)
        notes.append("relaxed acceptance applies between the thinking-phase tokens "
                     "(begin_thinking_phase_token .. end_thinking_phase_token); the answer after them is "
                     "verified exactly")
    else:
        rule = _rule("lossless", "tensorrt-llm")
        why = ("p/q rejection sampling" if _bool(flags, "use_rejection_sampling", False)
               else "exact-match verification (the target samples its token, drafts equal to it are kept)")
        notes.append(f"{why}: lossless in law")
    return EnginePreset("tensorrt-llm", flags, rule, k, notes=tuple(notes))


ENGINES.add("tensorrt-llm", Engine("tensorrt-llm", {
    "use_relaxed_acceptance_for_thinking": "MTP relaxed acceptance (thinking phase)",
    "relaxed_topk": "accept drafts in the target's top-n (default 1)",
    "relaxed_delta": "and with p(x) >= max p - delta (default 0)",
    "use_rejection_sampling": "p/q rejection sampling (prototype)",
    "max_draft_len": "draft tokens per block",
    "num_nextn_predict_layers": "MTP draft tokens per block",
    "begin_thinking_phase_token": "where relaxed acceptance starts: does not change the rule",
    "end_thinking_phase_token": "where it ends: does not change the rule",
}, _tensorrt, "TensorRT-LLM MTPDecodingConfig / llm_args"))


# -- Modular MAX -----------------------------------------------------------------------------------


def _max(flags: dict[str, str]) -> EnginePreset:
    strategy = _choice(flags, "rejection_sampling_strategy", "typical-acceptance",
                       ("greedy", "residual", "typical-acceptance", "logit-comparison"))
    k = _number(flags, "num_speculative_tokens", None, int)
    notes = []
    if "rejection_sampling_strategy" not in flags:
        notes.append("no strategy given: MAX's default for EAGLE and MTP, typical-acceptance (lossy)")
    if _bool(flags, "use_relaxed_acceptance_for_thinking", False):
        rule = _relaxed(flags, "max", 10, 0.6)
        notes.append("relaxed acceptance for thinking (MAX's relaxed_topk 10, relaxed_delta 0.6 unless "
                     "given)")
    elif strategy == "residual":
        rule = _rule("lossless", "max")
    elif strategy == "greedy":
        rule = _rule("greedy", "max")
    elif strategy == "typical-acceptance":
        if "posterior_threshold" not in flags:
            raise ValueError("max: typical-acceptance needs its threshold: give posterior_threshold "
                             "(and posterior_alpha, default its square root); MAX's own defaults are not "
                             "in the documentation this preset was written from")
        eps = _number(flags, "posterior_threshold", None)
        alpha = _number(flags, "posterior_alpha", math.sqrt(eps) if eps and eps > 0 else 0.0)
        rule = _rule(f"typical:eps={eps:g},alpha={alpha:g}", "max")
    else:
        raise ValueError("max: logit-comparison (accept when the draft's logit exceeds the target's by at "
                         "most eps) compares logits, not laws; it is not in verispec's catalogue")
    return EnginePreset("max", flags, rule, k, notes=tuple(notes))


ENGINES.add("max", Engine("max", {
    "rejection_sampling_strategy": "greedy, residual (lossless), typical-acceptance (default), "
                                   "logit-comparison",
    "posterior_threshold": "typical acceptance eps",
    "posterior_alpha": "typical acceptance alpha (default sqrt(eps))",
    "use_relaxed_acceptance_for_thinking": "relaxed acceptance (thinking)",
    "relaxed_topk": "default 10",
    "relaxed_delta": "default 0.6",
    "num_speculative_tokens": "draft tokens per block",
    "draft_proposal": "argmax or sampled drafts: does not change the rule",
}, _max, "Modular MAX max.pipelines speculative config (RejectionSamplingStrategy)"))


# -- llama.cpp -------------------------------------------------------------------------------------

LLAMA_CPP_SAMPLER = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}


def _llama_cpp(flags: dict[str, str]) -> EnginePreset:
    k = _number(flags, "spec_draft_n_max", _number(flags, "draft_max", _number(flags, "draft", 16, int), int),
                int)
    sampling = {
        "temperature": _number(flags, "temp",
                               _number(flags, "temperature", LLAMA_CPP_SAMPLER["temperature"])),
        "top_k": _number(flags, "top_k", LLAMA_CPP_SAMPLER["top_k"], int),
        "top_p": _number(flags, "top_p", LLAMA_CPP_SAMPLER["top_p"]),
        "min_p": _number(flags, "min_p", LLAMA_CPP_SAMPLER["min_p"]),
    }
    notes = ["sample-and-compare (common_sampler_sample_and_accept_n): the target samples with its own "
             "sampler chain at each draft position and keeps drafts equal to its sample: lossless for "
             "that chain's law, which with the defaults is the target truncated by top-k 40, top-p 0.95 "
             "and min-p 0.05 (a request may override them)"]
    if any(key in flags for key in ("spec_draft_p_min", "draft_p_min")):
        notes.append("the draft's p-min stops drafting early: it changes k per block, not the law")
    rule = _rule("greedy" if sampling["temperature"] == 0 else "lossless", "llama.cpp")
    return EnginePreset("llama.cpp", flags, rule, k, sampling=sampling, notes=tuple(notes))


ENGINES.add("llama.cpp", Engine("llama.cpp", {
    "spec_draft_n_max": "draft tokens per block (--spec-draft-n-max; older --draft-max, default 16)",
    "draft_max": "older name of spec_draft_n_max", "draft": "older name of spec_draft_n_max",
    "spec_draft_p_min": "stop drafting below this draft probability", "draft_p_min": "older name",
    "spec_type": "draft-simple, eagle3, mtp, ...: does not change the rule",
    "temp": "temperature (default 0.8)", "temperature": "temperature",
    "top_k": "default 40", "top_p": "default 0.95", "min_p": "default 0.05",
    "md": "the draft model: does not change the rule", "model_draft": "the draft model",
}, _llama_cpp, "llama.cpp server arguments; common/sampling.cpp"))
