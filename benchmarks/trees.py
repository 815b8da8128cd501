"""Chains vs trees at an equal number of drafted tokens, measured side by side in one run.

    python benchmarks/trees.py [--nodes 6] [--reps 3] [--prompts 4] [--max-new-tokens 48]
                               [--temperature 1] [--json PATH] [--only LABEL_PART ...]
                               [--target NAME --draft SPEC --dtype bfloat16 --suite humaneval]

On the default pair, or `--target`/`--draft` in `--dtype` with prompts from `--suite` (chat-encoded as
the suite says, as the core sweep encodes them) (batch 1, one torch thread; at --temperature 0 the
lossless configurations only),
every configuration drafts `--nodes` tokens per block (a chain of k = nodes, top-k trees, EAGLE-2
dynamic trees and multi-drafts of that many nodes; `--only` keeps the configurations whose label
contains one of the given parts, plain always) and decodes the same prompts with the same seeds; the
configurations are interleaved per prompt (rotated order each repetition), so machine load hits them
alike. Per configuration and repetition: tokens per target call, drafted tokens per call, tokens/s (wall
clock of the whole decode, drafting and verification included) and, for the lossy rules (two rules on a
top-k and a dynamic tree beside their chain versions), the exact per-token TV and overshoot (max law/p)
and the sequence log-ratio (mean over rows of the sum of log law - log p, the path-level KL estimate;
docs/design/diagnostics.md, 'Diagnostics').
Printed: medians over repetitions with [min, max]. At --temperature 0 every configuration is greedy
decoding, so its tokens are compared with plain greedy decoding's on the same backend and dtype; for a
row that differs, the first differing position and the target's top-2 logit margin there are printed
(recomputed: the prefix in one pass, then the last token in a one-token step, as plain decoding's), since
in bf16 a multi-token verification pass and a one-token step round differently and can flip a near-tie.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from common import PROMPTS, environment, fmt_spread, print_table, spread, write_json
from verispec.api import as_dtype, encode_prompt
from verispec.decode import DecodeConfig, decode_prompts
from verispec.evaluation.suites import load_suite
from verispec.models import default_draft, load_drafter, load_model
from verispec.sampling import SamplingConfig
from verispec.tree_decode import shape_nodes
from verispec.trees import parse_shape


def configs(nodes: int, temperature: float,
            only: list[str] | None = None) -> list[tuple[str, str, str | None, int]]:
    """(label, rule, shape, k): plain, then lossless chain / top-k trees / EAGLE-2 dynamic trees /
    multi-drafts / Traversal of `nodes` drafted tokens, then two lossy rules on a chain, a top-k tree and
    a dynamic tree; with `only`, the labels containing one of its parts (plain always)."""
    trees = {6: ["tree:widths=3,1", "tree:widths=2,2", "tree:widths=2,1,1"],
             4: ["tree:widths=2,1", "tree:widths=1,1,1,1"]}.get(nodes, [])
    if not trees:
        raise SystemExit("--nodes must be 4 or 6")
    dynamic = {6: ["tree:nodes=6,depth=6,topk=2", "tree:nodes=6,depth=3,topk=2"],
               4: ["tree:nodes=4,depth=4,topk=2", "tree:nodes=4,depth=2,topk=2"]}[nodes]
    drafts = {6: ["drafts:n=2,depth=3", "drafts:n=3,depth=2"], 4: ["drafts:n=2,depth=2"]}[nodes]
    for shape in trees + dynamic + drafts:
        assert shape_nodes(parse_shape(shape), nodes) == nodes
    out = [("plain", "plain", None, 1), (f"lossless chain k={nodes}", "lossless", None, nodes)]
    out += [(f"lossless {s}", "lossless", s, nodes) for s in trees + dynamic]
    out += [(f"traversal {trees[0]}", "traversal", trees[0], nodes)]
    out += [(f"lossless {s}", "lossless", s, nodes) for s in drafts]
    for rule in ("lenience:l=0.5", "speccascade:min_p=0.3") if temperature > 0 else ():  # T=0: all lossless
        out += [(f"{rule} chain k={nodes}", rule, None, nodes), (f"{rule} {trees[0]}", rule, trees[0], nodes),
                (f"{rule} {dynamic[0]}", rule, dynamic[0], nodes)]
    if only:
        out = [c for c in out if c[0] == "plain" or any(part in c[0] for part in only)]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=6)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--json", default=None)
    parser.add_argument("--target", default="default")
    parser.add_argument("--draft", default=None, help="drafter spec (default: the target's default draft)")
    parser.add_argument("--dtype", default="float32", help="both models' dtype (float32, bfloat16)")
    parser.add_argument("--only", nargs="+", default=None, metavar="PART",
                        help="keep the configurations whose label contains one of these (plain always)")
    parser.add_argument("--suite", default=None, help="prompts from this suite (e.g. humaneval) instead of "
                                                      "the built-in Shakespeare openings")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dtype = as_dtype(args.dtype)
    target = load_model(args.target, dtype=dtype)
    drafter = load_drafter(args.draft or default_draft(target), target, dtype=dtype)
    if args.suite:
        suite = load_suite(args.suite).limit(args.prompts)
        prompts = [encode_prompt(target, item.prompt, suite.chat) for item in suite.items]
    else:
        prompts = [target.encode(p) for p in PROMPTS[: args.prompts]]
    greedy = args.temperature == 0
    tokens: dict[tuple[str, int], set[tuple[int, ...]]] = {}  # (label, prompt) -> token ids over reps
    grid = configs(args.nodes, args.temperature, args.only)
    sampling = SamplingConfig(temperature=args.temperature)
    per = {label: [] for label, *_ in grid}  # label -> per repetition: aggregate dict
    warm = DecodeConfig(max_new_tokens=4, tree="tree:widths=2,1")
    decode_prompts(target, prompts[:1], [torch.Generator()], warm, drafter, "lossless")  # warm-up
    memory = resident_gib()
    print(f"{target.name} + {drafter.name} ({args.dtype}) warmed up: resident {memory['VmRSS']:.1f} GiB "
          f"({memory['RssAnon']:.1f} GiB private, {memory['RssFile']:.1f} GiB mapped files)",
          flush=True)
    for rep in range(args.reps):
        acc = {label: {"tokens": 0, "calls": 0, "drafted": 0, "seconds": 0.0, "tv": [], "over": [], "lr": []}
               for label, *_ in grid}
        for i, prompt in enumerate(prompts):
            order = grid[(rep + i) % len(grid):] + grid[: (rep + i) % len(grid)]  # rotate: interleaved
            for label, rule, shape, k in order:
                config = DecodeConfig(k=k, max_new_tokens=args.max_new_tokens, stop_at_eos=False, tree=shape,
                                      sampling=sampling)
                gen = torch.Generator().manual_seed(1000 * rep + i)
                start = time.perf_counter()
                if rule == "plain":
                    [out] = decode_prompts(target, [prompt], [gen], config)
                else:
                    [out] = decode_prompts(target, [prompt], [gen], config, drafter, rule)
                a = acc[label]
                a["seconds"] += time.perf_counter() - start
                tokens.setdefault((label, i), set()).add(out.token_ids)
                a["tokens"] += out.num_tokens
                a["calls"] += out.target_calls
                a["drafted"] += sum(b.proposed for b in out.blocks)
                a["tv"] += out.steps["tv"]
                a["over"].append(max(out.steps["max_ratio"]))
                a["lr"].append(out.log_ratio)
            print(f"repetition {rep + 1}, prompt {i + 1}/{len(prompts)} done", flush=True)
        for label, a in acc.items():
            per[label].append({
                "tokens_per_call": a["tokens"] / a["calls"], "drafted_per_call": a["drafted"] / a["calls"],
                "tokens_per_second": a["tokens"] / a["seconds"], "mean_tv": statistics.mean(a["tv"]),
                "max_overshoot": max(a["over"]), "seq_log_ratio": statistics.mean(a["lr"]),
            })
        print(f"repetition {rep + 1}/{args.reps} done", flush=True)
    env = environment()
    print(f"\n{env['cpu']} ({env['cpu_flags']}), torch {env['torch']}, {env['torch_threads']} thread(s); "
          f"{len(prompts)} prompts x {args.max_new_tokens} tokens, T={args.temperature:g}, batch 1, "
          f"{args.reps} repetitions (median [min, max])")
    head = ["config", "tok/call", "drafted/call", "tokens/s", "TV", "max overshoot", "seq log-ratio"]
    rows, summary = [], {}
    for label, *_ in grid:
        reps = per[label]
        s = {key: spread([r[key] for r in reps]) for key in reps[0]}
        summary[label] = s
        rows.append([label, fmt_spread(s["tokens_per_call"]), f"{s['drafted_per_call']['median']:.2f}",
                     fmt_spread(s["tokens_per_second"], 1), f"{s['mean_tv']['median']:.4f}",
                     f"{s['max_overshoot']['median']:.2f}", fmt_spread(s["seq_log_ratio"], 3)])
    print_table(head, rows)
    identity = greedy_identity(target, prompts, grid, tokens) if greedy else None
    if args.json:
        write_json(args.json, {"environment": env, "args": vars(args), "summary": summary, "per_rep": per,
                               "greedy_identity": identity, "resident_gib": memory})


def resident_gib() -> dict[str, float]:
    """This process's resident memory, GiB: VmRSS = RssAnon (private) + RssFile (mapped files: the
    safetensors weights transformers maps, evictable page cache) + RssShmem (Linux /proc/self/status)."""
    out = {"VmRSS": float("nan"), "RssAnon": float("nan"), "RssFile": float("nan")}
    for line in open("/proc/self/status"):
        key = line.split(":")[0]
        if key in out:
            out[key] = int(line.split()[1]) / 2**20
    return out


def top2_margin(target, prefix: list[int]) -> tuple[float, list[int]]:
    """The target's top-2 logit margin and tokens for the token after `prefix`: the prefix but its last
    token in one pass, then that token in a one-token step (as plain decoding computes it)."""
    session = target.session()
    ids = torch.tensor([prefix])  # [1, L]
    session.logits_for(ids[:, :-1], 1)
    top = session.logits_for(ids, 1)[0, -1].float().topk(2)  # [2]
    return float(top.values[0] - top.values[1]), top.indices.tolist()


def greedy_identity(target, prompts, grid, tokens) -> dict:
    """Per configuration at temperature 0: whether its tokens equal plain greedy decoding's on every prompt
    (and every repetition), and for a prompt where they differ, the first differing position with the
    target's top-2 logit margin there."""
    out = {}
    print("\ngreedy identity (T=0) against plain greedy decoding, same backend and dtype:")
    for label, *_ in grid[1:]:
        rows = []
        for i, prompt in enumerate(prompts):
            if len(tokens[("plain", i)]) != 1:
                raise SystemExit(f"plain greedy decoding of prompt {i} changed between repetitions")
            [plain] = tokens[("plain", i)]
            for ids in sorted(tokens[(label, i)]):
                if ids == plain:
                    continue
                j = next((j for j, (a, b) in enumerate(zip(ids, plain)) if a != b), min(len(ids), len(plain)))
                margin, top = top2_margin(target, list(prompt) + list(plain[:j]))
                rows.append({"prompt": i, "position": j, "plain_token": plain[j], "config_token": ids[j],
                             "top2": top, "top2_logit_margin": margin})
        out[label] = {"identical": not rows, "prompts": len(prompts), "differences": rows}
        diffs = "; ".join(f"prompt {r['prompt']} token {r['position']}: {r['config_token']} for "
                          f"{r['plain_token']}, top-2 margin {r['top2_logit_margin']:.4f}" for r in rows)
        print(f"  {label}: " + ("identical on every prompt" if not rows else f"differs: {diffs}"))
    return out


if __name__ == "__main__":
    main()
