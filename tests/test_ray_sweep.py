"""`verispec bench --executor ray`: the same rows as the local executor, lost workers and a killed driver
recovered with every unit exactly once, and clear errors instead of hangs.

One local Ray instance (2 CPUs, a small object store) serves the whole module; skipped without Ray."""

from __future__ import annotations

import collections
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ray = pytest.importorskip("ray")

from verispec.cli import main  # noqa: E402
from verispec.evaluation.ray_executor import RayExecutorError, RayOptions  # noqa: E402
from verispec.evaluation.store import read_rows  # noqa: E402
from verispec.evaluation.sweep import run_sweep  # noqa: E402
from verispec.evaluation.units import SweepSpec  # noqa: E402

SRC = Path(__file__).resolve().parents[1] / "src"
RULES = ("speccascade:min_p=0.1", "lenience:l=0.5")
SPEC = SweepSpec(rules=RULES, limit=4, seeds=(0, 1), max_new_tokens=16)
BATCH = 2  # rows per unit: 4 prompts x 2 seeds = 4 chunks, x 5 configs = 20 units of 2 rows
TOTAL = 4 * 2 * 5  # plain, lossless, speccascade, honest:speccascade, lenience
TIMING = {"seconds", "tokens_per_second", "target_seconds", "draft_seconds", "diagnostics_seconds",
          "batch_size", "chunk_size", "batch_seconds", "run"}  # "run": the sweep process that decoded it


def cli_args(out: Path, *extra: str) -> list[str]:
    return ["bench", "--rules", *RULES, "--limit", "4", "--seeds", "0", "1", "--max-new-tokens", "16",
            "--batch-size", str(BATCH), "--out", str(out), "--no-progress", "--no-report", *extra]


def subprocess_env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}


def comparable(rows: list[dict]) -> dict:
    """unit -> the row less its timings, as canonical JSON (so NaN equals NaN)."""
    return {r["unit"]: json.dumps({k: v for k, v in r.items() if k not in TIMING}, sort_keys=True)
            for r in rows}


def tokens(rows: dict) -> dict:
    return {unit: json.loads(row)["token_ids"] for unit, row in rows.items()}


def rows_per_unit(path: Path) -> collections.Counter:
    return collections.Counter(r["unit"] for r in read_rows(path))


@pytest.fixture(scope="module")
def cluster():
    """A local Ray instance for the module; its GCS address lets a subprocess driver join it."""
    ray.init(address="local", num_cpus=2, object_store_memory=150 * 1024**2, include_dashboard=False,
             logging_level=logging.WARNING, log_to_driver=False)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


@pytest.fixture(scope="module")
def reference_dir(tmp_path_factory) -> Path:
    """The local executor's sweep (the reference every Ray run must reproduce, timings aside), with the
    torch thread count of a worker (1): float rounding depends on it (1e-5 relative on this pair), the
    tokens do not."""
    out = tmp_path_factory.mktemp("local")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run_sweep(SPEC, out, progress=False, batch_size=BATCH)
    finally:
        torch.set_num_threads(threads)
    return out


@pytest.fixture(scope="module")
def reference(reference_dir) -> dict:
    rows = read_rows(reference_dir / "results.jsonl")
    assert len(rows) == TOTAL
    return comparable(rows)


@pytest.mark.slow
def test_ray_rows_equal_the_local_executors(cluster, reference, tmp_path):
    """2 workers: the same units and, per unit, the same tokens, text and metrics as the local executor;
    the row written by the driver alone, once."""
    path = run_sweep(SPEC, tmp_path, progress=False, batch_size=BATCH, executor="ray",
                     ray_options=RayOptions(workers=2))
    rows = read_rows(path)
    assert set(rows_per_unit(path).values()) == {1}
    got = comparable(rows)
    assert got.keys() == reference.keys()
    assert tokens(got) == tokens(reference)
    for unit, row in reference.items():  # every field but the timings: the executor changes nothing else
        assert got[unit] == row, unit
    assert json.loads((tmp_path / "sweep.json").read_text())["backend"] == rows[0]["backend"]
    assert len({r["run"] for r in rows}) == 1  # the driver marks every worker's rows with its run id


@pytest.mark.slow
def test_ray_workers_decode_chunks_by_continuous_batching(cluster, reference, tmp_path):
    """--chunk on Ray: units of 4 rows, each decoded 2 at a time (a finished row's slot goes to the next);
    every unit once, the same tokens as the local static batches (the float metrics may differ by the
    rounding of other batch compositions: tests/test_bench.py bounds them), rows marked batch 2, chunk 4."""
    path = run_sweep(SPEC, tmp_path, progress=False, batch_size=BATCH, executor="ray",
                     ray_options=RayOptions(workers=1), chunk=2 * BATCH)
    rows = read_rows(path)
    assert set(rows_per_unit(path).values()) == {1}
    assert tokens(comparable(rows)) == tokens(reference)
    assert {(r["batch_size"], r["chunk_size"]) for r in rows} == {(BATCH, 2 * BATCH)}


@pytest.mark.slow
def test_ray_resumes_a_local_sweep(cluster, reference_dir, reference, tmp_path):
    """The first half of a local sweep's rows, then `--resume` on Ray: the sweep completes with every
    unit once and every row as the local executor wrote it (the executor is not a sweep setting)."""
    for name in ("sweep.json", "steps.bin"):  # steps.bin: the rows' stored steps
        shutil.copy(reference_dir / name, tmp_path / name)
    lines = (reference_dir / "results.jsonl").read_text().splitlines(keepends=True)
    (tmp_path / "results.jsonl").write_text("".join(lines[: TOTAL // 2]))
    path = run_sweep(SPEC, tmp_path, resume=True, progress=False, batch_size=BATCH, executor="ray",
                     ray_options=RayOptions(workers=1))
    assert set(rows_per_unit(path).values()) == {1}
    assert comparable(read_rows(path)) == reference


@pytest.mark.slow
@pytest.mark.parametrize("max_restarts", [0, 1])
def test_a_worker_killed_mid_sweep_loses_no_unit(cluster, reference, tmp_path, caplog, max_restarts):
    """One of two workers killed once the first rows land: its in-flight units are redone, and every
    unit is written exactly once, with the local executor's tokens. Without restarts (ray.kill for
    good) the other worker finishes the sweep; with max_restarts=1 (a crash: Ray may restart it) the
    restarted worker rejoins."""
    killed: list[int] = []

    def kill_one(row: dict, workers: tuple) -> None:
        if not killed:
            killed.append(len(read_rows(tmp_path / "results.jsonl")))
            ray.kill(workers[0], no_restart=max_restarts == 0)

    with caplog.at_level(logging.WARNING, logger="verispec.evaluation.ray_executor"):
        path = run_sweep(SPEC, tmp_path, progress=False, batch_size=BATCH, executor="ray",
                         ray_options=RayOptions(workers=2, max_restarts=max_restarts), on_row=kill_one)
    assert killed and killed[0] < TOTAL
    if max_restarts == 0:
        assert "was lost" in caplog.text
    else:  # its in-flight unit failed ("was restarted"), and the worker stayed in the pool
        assert "was lost" not in caplog.text
    counts = rows_per_unit(path)
    assert set(counts.values()) == {1} and counts.keys() == reference.keys()
    assert tokens(comparable(read_rows(path))) == tokens(reference)


@pytest.mark.slow
def test_driver_killed_then_resumed_writes_every_unit_once(cluster, reference, tmp_path):
    """`verispec bench --executor ray` SIGKILLed (its whole process group) once rows are landing; its
    actors die with it. Resuming it with the local executor finishes the sweep: every unit exactly
    once, tokens equal to the local executor's (the other way: test_ray_resumes_a_local_sweep)."""
    out = tmp_path / "killed"
    command = cli_args(out, "--executor", "ray", "--ray-address", cluster, "--workers", "2")
    proc = subprocess.Popen([sys.executable, "-m", "verispec", *command],
                            env=subprocess_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None and len(read_rows(out / "results.jsonl")) < 3:
        time.sleep(0.02)
    assert proc.poll() is None, proc.stderr.read().decode()
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    proc.stderr.close()
    written = len(read_rows(out / "results.jsonl"))
    assert 3 <= written < TOTAL
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the workers and the reference
    try:  # the local executor resumes a Ray sweep (the executor is not a sweep setting)
        path = run_sweep(SPEC, out, resume=True, progress=False, batch_size=BATCH)
    finally:
        torch.set_num_threads(threads)
    counts = rows_per_unit(path)
    assert set(counts.values()) == {1} and counts.keys() == reference.keys()
    assert tokens(comparable(read_rows(path))) == tokens(reference)


def test_more_workers_than_cpus_is_refused_with_what_is_available(cluster, tmp_path):
    with pytest.raises(ValueError, match=r"3 worker\(s\) of 1 CPU each: the cluster has .* of 2 CPUs"):
        run_sweep(SPEC, tmp_path, progress=False, executor="ray", ray_options=RayOptions(workers=3))
    assert not (tmp_path / "sweep.json").exists() and not (tmp_path / "results.jsonl").exists()


def test_workers_that_are_never_placed_time_out(cluster, tmp_path, monkeypatch):
    """Placement that never happens is an error, not a hang: the resource check is bypassed here so
    that a third 1-CPU worker waits for a CPU the 2-CPU cluster never frees."""
    from verispec.evaluation import ray_executor

    monkeypatch.setattr(ray_executor, "plan_workers", lambda *args: 3)
    began = time.time()
    with pytest.raises(TimeoutError, match=r"of 3 Ray workers were not running after 3 s .*fewer --workers"):
        run_sweep(SPEC, tmp_path, progress=False, executor="ray",
                  ray_options=RayOptions(workers=3, ready_timeout_s=3))
    assert time.time() - began < 30
    assert not (tmp_path / "sweep.json").exists()


def test_a_worker_that_cannot_load_its_model_reports_its_own_error(cluster, tmp_path):
    """The driver loads no weights: a target missing on the workers fails there, with their message."""
    missing = tmp_path / "no-such-model"
    spec = SweepSpec(target=str(missing), draft="ngram:n=3", limit=1, max_new_tokens=4)
    with pytest.raises(RayExecutorError, match=r"could not load the model pair .*model not found: "
                                               rf"'{missing}' is neither a named model"):
        run_sweep(spec, tmp_path / "out", progress=False, executor="ray", ray_options=RayOptions(workers=1))
    assert not (tmp_path / "out" / "sweep.json").exists()


@pytest.mark.parametrize("address", ["127.0.0.1:1", "ray://127.0.0.1:1"])
def test_no_cluster_at_the_address_fails_fast_naming_it(address, tmp_path):
    began = time.time()
    done = subprocess.run([sys.executable, "-m", "verispec", *cli_args(tmp_path, "--executor", "ray",
                                                                       "--address", address)],
                          env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert f"no Ray cluster at --ray-address {address}" in done.stderr and "ray start --head" in done.stderr
    assert "--address is deprecated; use --ray-address" in done.stderr  # the old spelling still works
    assert "Traceback" not in done.stderr
    assert time.time() - began < 60  # ray.init alone would retry for 30 s (ray://) or for minutes


def test_without_ray_the_error_names_the_extra(tmp_path):
    code = ("import sys; sys.modules['ray'] = None; from verispec.cli import main; "
            f"sys.exit(main({cli_args(tmp_path, '--executor', 'ray')!r}))")
    done = subprocess.run([sys.executable, "-c", code], env=subprocess_env(), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2, done.stderr
    assert 'needs Ray, which is not installed' in done.stderr and 'pip install "verispec[ray]"' in done.stderr
    assert not (tmp_path / "sweep.json").exists()


def test_ray_flags_without_the_ray_executor_are_refused(tmp_path, capsys):
    assert main(cli_args(tmp_path, "--workers", "2")) == 2
    assert "--workers: only with --executor ray" in capsys.readouterr().err
    assert not (tmp_path / "sweep.json").exists()
