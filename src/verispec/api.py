"""The one obvious entry point: `verispec.generate(prompt, target=..., draft=..., rule=...)`.

Models are loaded once per (name, device, dtype) and reused across calls.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from verispec.decode import DecodeConfig, Generation, autoregressive_decode, speculative_decode
from verispec.rules import Rule, parse
from verispec.sampling import SamplingConfig


@dataclass(frozen=True)
class GenerateResult:
    text: str
    token_ids: list[int]
    prompt_ids: list[int]
    stats: dict
    generation: Generation

    def to_json(self) -> dict:
        return {"text": self.text, "token_ids": self.token_ids, "prompt_ids": self.prompt_ids, "stats": self.stats}


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def as_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def resolve_target(target, device: str = "cpu", dtype: torch.dtype = torch.float32):
    from verispec.models import load_model

    return load_model(target, device, dtype) if isinstance(target, str) else target


def resolve_drafter(draft, target, device: str = "cpu", dtype: torch.dtype = torch.float32):
    """None / "none" -> no drafter (plain decoding); "auto" -> the target's default drafter
    (`verispec.models.default_draft`, the same the CLI uses); a spec string; a model; or a drafter object."""
    from verispec.models import ModelDrafter, check_compatible, default_draft, load_drafter

    if draft is None or draft == "none":
        return None
    if draft == "auto":
        draft = default_draft(target)
    if isinstance(draft, str):
        return load_drafter(draft, target, device, dtype)
    if hasattr(draft, "propose"):
        return draft
    check_compatible(target, draft)
    return ModelDrafter(draft)


def encode_prompt(model, prompt: str | list[int], chat: bool | None = None) -> list[int]:
    """Text -> token ids; instruct models (a tokenizer with a chat template) get it unless chat=False."""
    if not isinstance(prompt, str):
        return [int(t) for t in prompt]
    if not prompt:
        raise ValueError("empty prompt: give some text")
    tok = model.tokenizer
    if chat is None:
        chat = bool(getattr(tok, "chat_template", None))
    if chat:
        out = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
        ids = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
        return [int(t) for t in ids]
    return model.encode(prompt)


def encode_messages(model, messages: list[dict]) -> list[int]:
    """Chat messages ([{"role", "content"}, ...]) -> token ids: the tokenizer's chat template (with the
    generation prompt) when it has one; otherwise the contents joined by newlines, ending with one, as
    plain text (roles dropped: the default pair is a plain Shakespeare model with no chat format)."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} objects")
    for m in messages:
        if not (isinstance(m, dict) and isinstance(m.get("content"), str) and isinstance(m.get("role"), str)):
            raise ValueError("each message must be an object with string 'role' and 'content'")
    tok = model.tokenizer
    if getattr(tok, "chat_template", None):
        out = tok.apply_chat_template([{"role": m["role"], "content": m["content"]} for m in messages],
                                      add_generation_prompt=True)
        ids = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
        return [int(t) for t in ids]
    return encode_prompt(model, "".join(m["content"] + "\n" for m in messages), chat=False)


def generate(
    prompt: str | list[int],
    target="default",
    draft="auto",
    rule: str | Rule = "lossless",
    *,
    k: int = 4,
    max_new_tokens: int = 64,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    eta: float | None = None,
    seed: int = 0,
    chat: bool | None = None,
    diagnostics: bool = True,
    device: str = "cpu",
    dtype: str | torch.dtype = "float32",
    draft_dtype: str | torch.dtype = "float32",
) -> GenerateResult:
    """Generate a continuation of `prompt` with speculative decoding (or plain decoding if draft=None).

    draft="auto" picks the target's default drafter, exactly as `verispec run` does without --draft.

    dtype is the target's compute dtype, draft_dtype a separate draft model's (a self-draft shares the
    target's weights and dtype). fp32 by default: the tiny default draft is slower in bf16 on CPU."""
    rule = parse(rule) if isinstance(rule, str) else rule
    sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, eta=eta)
    config = DecodeConfig(k=k, max_new_tokens=max_new_tokens, sampling=sampling, diagnostics=diagnostics)
    target_model = resolve_target(target, device, as_dtype(dtype))
    drafter = resolve_drafter(draft, target_model, device, as_dtype(draft_dtype))
    prompt_ids = encode_prompt(target_model, prompt, chat)
    generator = torch.Generator().manual_seed(seed)
    if drafter is None:
        gen = autoregressive_decode(target_model, prompt_ids, config, generator)
    else:
        gen = speculative_decode(target_model, drafter, prompt_ids, rule, config, generator)
    text = target_model.decode(list(gen.token_ids))
    return GenerateResult(text=text, token_ids=list(gen.token_ids), prompt_ids=prompt_ids,
                          stats=gen.stats(max_new_tokens=max_new_tokens, k=None if drafter is None else k),
                          generation=gen)
