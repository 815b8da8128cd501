"""Sweeps on Ray: rows per minute of the local executor against Ray with 1 and 2 workers, one sweep.

    python benchmarks/ray_sweep.py          # default pair, 8 prompts x 2 seeds x 5 configs, 32 tokens
    python benchmarks/ray_sweep.py --workers 1 2 4 --limit 16 --rounds 3

Every run is the same sweep (`run_sweep`: shakespeare, rules speccascade:min_p=0.1 and lenience:l=0.5
plus the baselines, batch size --batch-size) into a fresh directory: `local N thr` in this process
with N torch threads, for each N in --threads (default 1 and 2), then `ray xW` for each W in
--workers (a fresh local Ray instance per run, sized to this machine as `verispec bench --executor
ray` starts it; each worker 1 CPU and 1 torch thread). Rounds repeat the whole set, interleaved.
Per run:

- wall: the whole `run_sweep` call (Ray: starting Ray and the workers, which load the pair, included);
- startup: wall time until the first row was written;
- rows/min (wall) = rows / wall; rows/min (steady) = rows after the first / (last row - first row);
- busy s/row: the summed wall time of the work units over the rows: what one row costs one worker
  (or the local process), the per-row cost a sizing estimate extrapolates from;
- worker RSS: resident memory of each Ray worker after the sweep (the pair loaded, prompts decoded).

Ratios are per round against the first local run. Every Ray run must write exactly the units of the
first local run (1 thread, as a worker) with the same tokens, or the script stops with an error.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from common import environment, print_table, write_json

from verispec.evaluation.ray_executor import RayOptions
from verispec.evaluation.store import read_rows
from verispec.evaluation.sweep import run_sweep
from verispec.evaluation.units import SweepSpec


def one_run(spec: SweepSpec, out: Path, batch_size: int, workers: int | None) -> dict:
    marks: list[float] = []
    rss: list[int] = []

    def on_row(row: dict, handles: tuple) -> None:
        marks.append(time.perf_counter())
        if handles and len(marks) == total:  # the last row: ask each worker its memory (load is a no-op now)
            import ray

            rss.extend(info["rss_bytes"] for info in ray.get([h.load.remote() for h in handles]))

    total = len(spec.configs()) * spec.limit * len(spec.seeds)
    began = time.perf_counter()
    if workers is None:
        run_sweep(spec, out, progress=False, batch_size=batch_size, on_row=on_row)
    else:
        run_sweep(spec, out, progress=False, batch_size=batch_size, on_row=on_row, executor="ray",
                  ray_options=RayOptions(workers=workers))
    wall = time.perf_counter() - began
    rows = read_rows(out / "results.jsonl")
    assert len(rows) == total == len(marks), (len(rows), total, len(marks))
    busy = sum({(r["config"], r["batch_seconds"]): r["batch_seconds"] for r in rows}.values())
    first = marks[0] - began
    steady = (len(marks) - 1) / (marks[-1] - marks[0]) * 60 if len(marks) > 1 else float("nan")
    return {"wall_s": wall, "startup_s": first, "rows": total, "rows_per_min_wall": total / wall * 60,
            "rows_per_min_steady": steady, "busy_s_per_row": busy / total,
            "worker_rss_mb": [b / 2**20 for b in rss], "tokens": {r["unit"]: r["token_ids"] for r in rows}}


def worker_memory(spec: SweepSpec) -> dict:
    """RSS of one worker before (Python, torch, Ray's worker runtime) and after it loads the pair
    (transformers imported too), on a fresh local Ray instance."""
    import ray

    from verispec.evaluation.ray_executor import SweepWorker, connect
    from verispec.evaluation.suites import load_suite

    suite = load_suite(spec.suite).limit(spec.limit)
    connect(ray, None)
    try:
        worker = ray.remote(SweepWorker).options(num_cpus=1).remote(spec, suite, spec.max_new_tokens, 1)
        before = ray.get(worker.ping.remote())["rss_bytes"]
        after = ray.get(worker.load.remote())["rss_bytes"]
    finally:
        ray.shutdown()
    return {"before_load_mb": before / 2**20, "after_load_mb": after / 2**20}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--limit", type=int, default=8, help="prompts of the shakespeare suite")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2],
                    help="torch threads of the local executor: one local run each (ratios: vs the first)")
    ap.add_argument("--json", default="benchmarks/results/ray_sweep.json")
    args = ap.parse_args()
    spec = SweepSpec(rules=("speccascade:min_p=0.1", "lenience:l=0.5"), limit=args.limit,
                     seeds=tuple(args.seeds), max_new_tokens=args.max_new_tokens)
    methods = ([(f"local {t} thr", ("local", t)) for t in args.threads]
               + [(f"ray x{n}", ("ray", n)) for n in args.workers])
    base = methods[0][0]
    print(f"{environment()}\n{len(spec.configs())} configs x {args.limit} prompts x {len(args.seeds)} seeds, "
          f"{args.max_new_tokens} new tokens, batch size {args.batch_size}; local: {args.threads} torch "
          f"thread(s); Ray workers: 1 CPU, 1 thread each; {args.rounds} round(s)")
    runs: dict[str, list[dict]] = {name: [] for name, _ in methods}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for name, (kind, n) in methods:
                out = Path(tmp) / f"{round_}-{name.replace(' ', '')}"
                if kind == "local":
                    torch.set_num_threads(n)
                run = one_run(spec, out, args.batch_size, n if kind == "ray" else None)
                if kind == "ray" and run["tokens"] != runs[base][-1]["tokens"]:
                    raise SystemExit(f"{name} wrote other units or tokens than {base}")
                runs[name].append(run)
                print(f"round {round_}: {name}: {run['wall_s']:.1f} s", flush=True)
    med = lambda name, key: statistics.median(r[key] for r in runs[name])  # noqa: E731
    ratio = lambda name, key: statistics.median(  # noqa: E731
        r[key] / b[key] for r, b in zip(runs[name], runs[base]))
    rows = []
    for name, _ in methods:
        rss = [mb for r in runs[name] for mb in r["worker_rss_mb"]]
        rows.append([name, f"{med(name, 'wall_s'):.1f}", f"{med(name, 'startup_s'):.1f}",
                     f"{med(name, 'rows_per_min_wall'):.0f}", f"{ratio(name, 'rows_per_min_wall'):.2f}",
                     f"{med(name, 'rows_per_min_steady'):.0f}", f"{ratio(name, 'rows_per_min_steady'):.2f}",
                     f"{med(name, 'busy_s_per_row'):.3f}", f"{statistics.median(rss):.0f}" if rss else "-"])
    print_table(["executor", "wall s", "startup s", "rows/min (wall)", f"vs {base}", "rows/min (steady)",
                 f"vs {base}", "busy s/row", "worker RSS MB"], rows)
    memory = worker_memory(spec)
    print(f"one Ray worker's RSS: {memory['before_load_mb']:.0f} MB before loading the pair (Python, torch, "
          f"Ray's worker runtime), {memory['after_load_mb']:.0f} MB after (transformers imported, pair "
          "loaded, prompts encoded, one warm-up decode)")
    for run_list in runs.values():
        for run in run_list:
            del run["tokens"]
    write_json(args.json, {"environment": environment(), "args": vars(args), "runs": runs,
                           "worker_memory": memory})
    print(json.dumps({name: {"rows_per_min_wall": med(name, "rows_per_min_wall")} for name, _ in methods}))


if __name__ == "__main__":
    main()
