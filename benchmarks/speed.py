"""Batch-1 decoding speed of one model pair: verispec's engine (speculative, with and without its exact
diagnostics, and plain) against transformers' `generate` with and without assisted generation, measured
side by side in one process, with the cost model (t, c, v) that explains the ratios.

    python benchmarks/speed.py                      # default pair, 128 new tokens, 6 prompts x 5 rounds
    python benchmarks/speed.py --quick              # a 1-minute smoke run

Per round and prompt, every method runs once, interleaved (so machine noise hits all alike); each
ratio is computed per (round, prompt) and reported as median [min, max]. Methods:
  plain        verispec plain target decoding (same backend as its speculative loop)
  hf-plain     transformers `generate` without an assistant
  sd           verispec lossless speculative decoding (k = --k), diagnostics off
  sd+diag      the same with per-step exact diagnostics on (diagnostics overhead)
  hsd          verispec `hsd` block verification
  hf-assisted  transformers `generate(assistant_model=draft)`, num_assistant_tokens=k, schedule constant
The cost model from the same runs (the decode loop times its own model calls): t = target step (plain
decoding's target time per call), c = drafting time per draft token / t (draft forward, processing
and sampling), v = target verification pass / t, and the speedup they predict,
(1 - a^(k+1)) / ((1 - a)(k c + v)), with a solved from the measured tokens per block; the gap to the
realised speedup is the loop's own work (rule maths, bookkeeping). The diagnostics overhead from the
time the loop spends on diagnostics, as a share of the rest of the decode time. And lossless SD for
every k in --ks.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from common import PROMPTS, environment, fmt_spread, print_table, spread, write_json

from verispec.api import as_dtype, encode_prompt
from verispec.evaluation.suites import load_suite
from verispec.decode import DecodeConfig, autoregressive_decode, speculative_decode
from verispec.models import load_drafter, load_model
from verispec.sampling import SamplingConfig


def hf_generate(model, prompt: list[int], n: int, temperature: float, assistant=None, k: int = 4,
                prompt_lookup: int | None = None, seed: int = 0):
    torch.manual_seed(seed)
    ids = torch.tensor([prompt])
    kwargs = dict(max_new_tokens=n, min_new_tokens=n, pad_token_id=model.generation_config.eos_token_id)
    if temperature > 0:
        kwargs.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
    else:
        kwargs.update(do_sample=False)
    if assistant is not None:
        assistant.generation_config.num_assistant_tokens = k
        assistant.generation_config.num_assistant_tokens_schedule = "constant"
        assistant.generation_config.assistant_confidence_threshold = 0.0
        kwargs.update(assistant_model=assistant, num_assistant_tokens=k,
                      num_assistant_tokens_schedule="constant")
    if prompt_lookup is not None:
        kwargs.update(prompt_lookup_num_tokens=prompt_lookup)
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
        seconds = time.perf_counter() - t0
    return (out.shape[1] - ids.shape[1]) / seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="default")
    ap.add_argument("--draft", default="default-draft")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6, 8])
    ap.add_argument("--temperatures", type=float, nargs="+", default=[1.0, 0.0])
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers baselines")
    ap.add_argument("--dtype", default="float32", help="the target's compute dtype (the draft stays float32)")
    ap.add_argument("--quick", action="store_true", help="2 rounds, 2 prompts, 64 tokens")
    ap.add_argument("--suite", default=None,
                    help="take the prompts from this suite (e.g. humaneval, chat-encoded as the suite says) "
                         "instead of the built-in Shakespeare openings")
    ap.add_argument("--no-hsd", action="store_true", help="skip the hsd rule (saves time on big models)")
    ap.add_argument("--json", default="benchmarks/results/speed.json")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.prompts, args.tokens, args.ks = 2, 2, 64, [2, 4]
    target = load_model(args.target, dtype=as_dtype(args.dtype))
    drafter = load_drafter(args.draft, target)
    if args.suite:
        suite = load_suite(args.suite).limit(args.prompts)
        prompts = [encode_prompt(target, item.prompt, suite.chat) for item in suite.items]
    else:
        prompts = [target.encode(p) for p in PROMPTS[: args.prompts]]
    k = args.k
    print(f"{environment()}\ntarget {target.name} ({target.num_parameters / 1e6:.2f}M, {args.dtype}, "
          f"backend {target.backend}), "
          f"draft {drafter.name}; batch 1, {args.tokens} new tokens, k = {k}")


    def ours(rule: str | None, temperature: float, kk: int, seed: int, diagnostics: bool = False):
        cfg = DecodeConfig(k=kk, max_new_tokens=args.tokens, sampling=SamplingConfig(temperature=temperature),
                           stop_at_eos=False, diagnostics=diagnostics)
        gen = torch.Generator().manual_seed(seed)
        if rule is None:
            return autoregressive_decode(target, prompt, cfg, gen)
        return speculative_decode(target, drafter, prompt, rule, cfg, gen)

    prompt = prompts[0]
    ours(None, 1.0, k, 0)  # warm up both models and the kernels
    ours("lossless", 1.0, k, 0)
    results: dict = {"environment": environment(), "args": vars(args), "by_temperature": {}}
    for temperature in args.temperatures:
        tps: dict[str, list[float]] = {}
        ratios: dict[str, list[float]] = {}
        tokens_per_call: dict[str, list[float]] = {}
        gens: dict[str, list] = {}
        for rnd in range(args.rounds):
            for pi, prompt in enumerate(prompts):
                seed = 1000 * rnd + pi
                row = {}
                methods = {
                    "plain": lambda: ours(None, temperature, k, seed),
                    "sd": lambda: ours("lossless", temperature, k, seed),
                    "sd+diag": lambda: ours("lossless", temperature, k, seed, diagnostics=True),
                }
                if not args.no_hsd:
                    methods["hsd"] = lambda: ours("hsd", temperature, k, seed)
                for kk in args.ks:
                    methods[f"sd k={kk}"] = lambda kk=kk: ours("lossless", temperature, kk, seed)
                for name, fn in methods.items():
                    gen = fn()
                    gens.setdefault(name, []).append(gen)
                    row[name] = gen.tokens_per_second
                    tokens_per_call.setdefault(name, []).append(gen.block_efficiency)
                if not args.no_hf:
                    row["hf-plain"] = hf_generate(target.model, prompt, args.tokens, temperature, seed=seed)
                    row["hf-assisted"] = hf_generate(target.model, prompt, args.tokens, temperature,
                                                     assistant=drafter.model.model, k=k, seed=seed)
                for name, value in row.items():
                    tps.setdefault(name, []).append(value)
                pairs = [("sd", "plain"), ("sd", "hf-assisted"), ("sd", "hf-plain"), ("plain", "hf-plain"),
                         ("hf-assisted", "hf-plain"), ("sd+diag", "sd"), ("hsd", "sd")]
                pairs += [(f"sd k={kk}", "plain") for kk in args.ks]
                for a, b in pairs:
                    if a in row and b in row:
                        ratios.setdefault(f"{a} / {b}", []).append(row[a] / row[b])
        res = {"tokens_per_second": {n: spread(v) for n, v in tps.items()},
               "ratios": {n: spread(v) for n, v in ratios.items()},
               "tokens_per_target_call": {n: spread(v) for n, v in tokens_per_call.items()}}
        # cost model: per-call costs measured inside the runs, and the speedup they predict
        plain = gens["plain"]
        t_step = sum(g.target_seconds for g in plain) / sum(g.target_calls for g in plain)
        predicted = {}
        for kk in args.ks:
            name = f"sd k={kk}"
            runs = gens[name]
            tau = sum(g.num_tokens for g in runs) / sum(g.target_calls for g in runs)
            c = (sum(g.draft_seconds for g in runs)
                 / max(1, sum(sum(b.proposed for b in g.blocks) for g in runs)) / t_step)
            v = sum(g.target_seconds for g in runs) / sum(g.target_calls for g in runs) / t_step
            pred = tau / (kk * c + v)
            real = statistics.median(ratios[f"{name} / plain"])
            loop = 1 - sum(g.target_seconds + g.draft_seconds for g in runs) / sum(g.seconds for g in runs)
            predicted[kk] = {"tokens_per_block": tau, "a": solve_a(tau, kk), "c": c, "v": v,
                             "predicted": pred, "realised": real, "realised_over_predicted": real / pred,
                             "loop_share": loop}
        diag = gens["sd+diag"]
        res["diagnostics_overhead"] = sum(g.diagnostics_seconds for g in diag) / sum(
            g.seconds - g.diagnostics_seconds for g in diag)
        res["target_step_ms"] = t_step * 1e3
        res["predicted"] = predicted
        results["by_temperature"][str(temperature)] = res
        print(f"\n== temperature {temperature:g} ==")
        print_table(["method", "tokens/s median [min, max]", "tokens / target call"],
                    [[n, fmt_spread(s, 1),
                      f"{statistics.median(tokens_per_call[n]):.2f}" if n in tokens_per_call else "-"]
                     for n, s in res["tokens_per_second"].items()])
        print()
        print_table(["ratio", "median [min, max]"], [[n, fmt_spread(s)] for n, s in res["ratios"].items()])
        print()
        print(f"target step t = {t_step * 1e3:.2f} ms (plain decoding); diagnostics cost "
              f"{100 * res['diagnostics_overhead']:.1f}% of the rest of the decode time (target: <= 5%)")
        print_table(["k", "tokens/block", "a", "c", "v", "predicted", "realised", "realised/predicted",
                     "loop share"],
                    [[str(kk), f"{d['tokens_per_block']:.2f}", f"{d['a']:.3f}", f"{d['c']:.3f}",
                      f"{d['v']:.2f}", f"{d['predicted']:.2f}", f"{d['realised']:.2f}",
                      f"{d['realised_over_predicted']:.2f}",
                      f"{100 * d['loop_share']:.0f}%"] for kk, d in predicted.items()])
    write_json(args.json, results)
    print(f"\nraw figures: {args.json}")


def solve_a(tokens_per_block: float, k: int) -> float:
    """The per-token acceptance a with (1 - a^(k+1)) / (1 - a) = tokens_per_block (bisection)."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        value = (1 - mid ** (k + 1)) / (1 - mid) if mid < 1 else k + 1
        lo, hi = (mid, hi) if value < tokens_per_block else (lo, mid)
    return (lo + hi) / 2


if __name__ == "__main__":
    main()
