"""No silent wrong results (issue 9): every careless or hostile input either fails with a clear error
(exit status 2 and `verispec: error: ...` for the CLI) or gives a correct result."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import verispec
from verispec.cli import main
from verispec.decode import DecodeConfig, autoregressive_decode, speculative_decode
from verispec.evaluation.report import write_report
from verispec.evaluation.store import SCHEMA_VERSION, ResultsFile, read_rows
from verispec.evaluation.suites import Item
from verispec.evaluation.units import RunConfig, SweepSpec, unit_key
from verispec.models import ModelDrafter, TabularModel, load_drafter, load_model
from verispec.probability import sample_from
from verispec.sampling import SamplingConfig, process

SMALL = ["--suite", "shakespeare", "--rules", "lossless", "--seeds", "0", "--limit", "1", "--max-new-tokens",
         "4",
         "--no-progress", "--no-report"]


@pytest.fixture(scope="module")
def pair():
    target = load_model("default")
    return target, load_drafter("default-draft", target)


@pytest.fixture(scope="module")
def sweep_dir(tmp_path_factory):
    """A finished tiny sweep (plain + lossless, one prompt, one seed, 4 tokens): 2 rows."""
    out = tmp_path_factory.mktemp("sweep") / "s"
    assert main(["bench", *SMALL, "--out", str(out)]) == 0
    assert len(read_rows(out / "results.jsonl")) == 2
    return out


def copy_of(sweep_dir: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "copy"
    shutil.copytree(sweep_dir, dst)
    return dst


def cli_error(capsys, argv: list[str]) -> str:
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("verispec: error:"), err
    assert "Traceback" not in err
    return err


# -- 1. two writers into one --out ----------------------------------------------------------------


def test_second_writer_is_refused_with_the_holders_pid(tmp_path, capsys):
    out = tmp_path / "x"
    out.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys, time\n"
        f"fd = os.open({str(out / '.lock')!r}, os.O_RDWR | os.O_CREAT)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX)\n"
        "os.write(fd, str(os.getpid()).encode())\n"
        "print('locked', flush=True)\n"
        "time.sleep(60)\n")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        err = cli_error(capsys, ["bench", *SMALL, "--out", str(out)])
        assert f"pid {holder.pid}" in err
        assert not (out / "results.jsonl").exists() and not (out / "sweep.json").exists()
    finally:
        holder.kill()
        holder.wait()


def test_report_counts_a_duplicated_unit_once_and_says_so(sweep_dir, tmp_path):
    d = copy_of(sweep_dir, tmp_path)
    lines = (d / "results.jsonl").read_text().splitlines(keepends=True)
    (d / "results.jsonl").write_text("".join(lines + lines))  # every unit written twice (two writers)
    table, html = write_report(d)
    assert "duplicate" in table and "2 duplicate" in table
    assert "rows: 2" in html.read_text()


# -- 2. context limits -------------------------------------------------------------------------------


@pytest.mark.slow  # decodes a 2048-token context on both backends
@pytest.mark.parametrize("backend", ["lean", "hf"])
def test_prompt_longer_than_the_context_is_refused_on_both_backends(pair, backend):
    from verispec.models.hf import HFModel

    target, drafter = pair
    model = HFModel(target.model, target.tokenizer, "default", backend=backend)
    assert model.max_context == 2048
    long_prompt = [5] * 2040
    config = DecodeConfig(k=4, max_new_tokens=16)
    with pytest.raises(ValueError, match=r"2040 tokens.*16.*2048"):
        autoregressive_decode(model, long_prompt, config)
    with pytest.raises(ValueError, match="2048"):
        speculative_decode(model, drafter, long_prompt, "lossless", config)
    # exactly at the limit is fine
    autoregressive_decode(model, [5] * 2046, DecodeConfig(max_new_tokens=2, diagnostics=False))


def test_huge_max_new_tokens_is_refused_up_front(pair, capsys):
    target, drafter = pair
    start = time.perf_counter()
    with pytest.raises(ValueError, match="context"):
        verispec.generate("To be", target=target, draft=drafter, max_new_tokens=10**12)
    assert time.perf_counter() - start < 5
    cli_error(capsys, ["run", "--prompt", "To be", "--max-new-tokens", "1000000000000"])


def test_toy_models_are_unlimited_unless_given_a_context():
    toy = TabularModel.random(6, seed=1)
    autoregressive_decode(toy, [1] * 50, DecodeConfig(max_new_tokens=3))
    limited = TabularModel.random(6, seed=1, max_context=10)
    with pytest.raises(ValueError, match="context of 10"):
        autoregressive_decode(limited, [1] * 8, DecodeConfig(max_new_tokens=3))
    with pytest.raises(ValueError, match="draft"):
        speculative_decode(toy, ModelDrafter(limited), [1] * 8, "lossless", DecodeConfig(max_new_tokens=3))


# -- 3. numerics -------------------------------------------------------------------------------------


def test_overflowing_temperature_decodes_as_greedy(pair):
    logits = torch.randn(4, 50) * 10
    p = process(logits, SamplingConfig(temperature=1e-39))
    assert torch.isfinite(p).all() and torch.equal(p.argmax(-1), logits.argmax(-1))
    assert torch.equal(p, process(logits, SamplingConfig(temperature=0)))
    target, drafter = pair
    tiny = verispec.generate("To be", target=target, draft=drafter, temperature=1e-39, max_new_tokens=12,
                             seed=3)
    greedy = verispec.generate("To be", target=target, draft=drafter, temperature=0, max_new_tokens=12,
                               seed=3)
    assert tiny.token_ids == greedy.token_ids
    assert len(set(tiny.token_ids)) > 1  # not "every token is the last id"


@pytest.mark.parametrize("row", [[float("nan"), 1.0], [float("inf"), 1.0], [-0.5, 1.5], [0.0, 0.0]])
def test_sample_from_refuses_a_non_distribution(row):
    with pytest.raises(ValueError, match="not a distribution"):
        sample_from(torch.tensor([row]), torch.rand(1, dtype=torch.float64))


# -- 4. sweep state ----------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [["--k", "0"], ["--temperatures", "-1"], ["--temperatures", "nan"],
                                 ["--limit", "-1"],
                                 ["--seeds", str(2**70)], ["--max-new-tokens", "0"], ["--suite", "nope"],
                                 ["--rules", "lenience:l=7"]])
def test_bad_sweep_settings_fail_before_anything_is_written(tmp_path, capsys, bad):
    out = tmp_path / "x"
    cli_error(capsys, ["bench", *SMALL, *bad, "--out", str(out)])
    assert not (out / "sweep.json").exists() and not (out / "results.jsonl").exists()


def test_resume_without_sweep_json_refuses(sweep_dir, tmp_path, capsys):
    d = copy_of(sweep_dir, tmp_path)
    (d / "sweep.json").unlink()
    before = (d / "results.jsonl").read_bytes()
    err = cli_error(capsys, ["bench", *SMALL, "--k", "2", "--resume", "--out", str(d)])
    assert "sweep.json" in err
    assert (d / "results.jsonl").read_bytes() == before


def test_unit_key_and_sweep_json_cover_dtype_device_and_backend(sweep_dir, tmp_path, capsys):
    item = Item("p0", "To be")
    base = SweepSpec()
    keys = {unit_key(s, item, 0, RunConfig("lossless", 4, 1.0)) for s in (
        base, SweepSpec(dtype="bfloat16"), SweepSpec(draft_dtype="bfloat16"), SweepSpec(device="cuda"),
        SweepSpec(backend="hf"))}
    assert len(keys) == 5
    settings = json.loads((sweep_dir / "sweep.json").read_text())
    assert (settings["dtype"], settings["backend"], settings["schema"]) == ("float32", "lean", SCHEMA_VERSION)
    row = read_rows(sweep_dir / "results.jsonl")[0]
    assert (row["dtype"], row["device"], row["backend"]) == ("float32", "cpu", "lean")
    d = copy_of(sweep_dir, tmp_path)
    err = cli_error(capsys, ["bench", *SMALL, "--dtype", "bfloat16", "--resume", "--out", str(d)])
    assert "different sweep" in err


def test_a_resume_may_add_seeds_but_not_drop_them(sweep_dir, tmp_path, capsys):
    d = copy_of(sweep_dir, tmp_path)
    before = read_rows(d / "results.jsonl")
    small = [a for a in SMALL if a not in ("--seeds", "0")]
    assert main(["bench", *small, "--seeds", "0", "1", "--resume", "--out", str(d)]) == 0
    after = read_rows(d / "results.jsonl")
    assert after[:2] == before and sorted(r["seed"] for r in after) == [0, 0, 1, 1]
    assert json.loads((d / "sweep.json").read_text())["seeds"] == [0, 1]
    capsys.readouterr()  # the first run's output
    err = cli_error(capsys, ["bench", *small, "--seeds", "1", "--resume", "--out", str(d)])
    assert "may add seeds, not drop them" in err
    assert read_rows(d / "results.jsonl") == after


def test_corrupted_lines_are_skipped_with_file_and_line(sweep_dir, tmp_path, caplog):
    from verispec.evaluation.store import scan_rows

    d = copy_of(sweep_dir, tmp_path)
    path = d / "results.jsonl"
    good = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(good[0] + b'{"broken": \xff\xfe}\n' + b"not json\n" + good[1])
    with caplog.at_level("WARNING"):
        scan = scan_rows(path)
    assert len(scan.rows) == 2 and scan.skipped_lines == [2, 3]
    assert f"{path}:2" in caplog.text and "UTF-8" in caplog.text
    with ResultsFile(path) as store:  # resume-side: opens, keeps the good rows
        assert len(store.done) == 2
    table, _ = write_report(d)
    assert "skipped 2 unreadable line(s)" in table and "2, 3" in table


def test_a_partial_last_line_is_still_cut_quietly(sweep_dir, tmp_path, caplog):
    d = copy_of(sweep_dir, tmp_path)
    path = d / "results.jsonl"
    with open(path, "ab") as f:
        f.write(b'{"schema": 2, "unit": "x", "te')
    with caplog.at_level("WARNING"):
        assert len(read_rows(path)) == 2
    assert "skipped" not in caplog.text
    with ResultsFile(path):
        pass
    assert path.read_bytes().endswith(b"}\n")


@pytest.mark.parametrize("schema", [1, SCHEMA_VERSION + 1])
def test_rows_of_another_schema_are_refused_with_both_versions(sweep_dir, tmp_path, schema, capsys):
    d = copy_of(sweep_dir, tmp_path)
    rows = read_rows(d / "results.jsonl")
    rows[1]["schema"] = schema
    (d / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for argv in (["report", str(d)], ["bench", *SMALL, "--resume", "--out", str(d)]):
        err = cli_error(capsys, argv)
        assert f"schema {schema}" in err and f"schema {SCHEMA_VERSION}" in err


# -- 5. the Python API's inputs ----------------------------------------------------------------------


@pytest.mark.parametrize("prompt", [[411.7, 306.2], b"To be", [True, False], "", [], 12, None,
                                    [[1, 2.5]], ["ok", b"x"], torch.tensor([1.5, 2.0]), [-3, 4],
                                    "bad \udcff text"])
def test_generate_refuses_bad_prompts(pair, prompt):
    target, drafter = pair
    with pytest.raises((TypeError, ValueError), match="prompt"):
        verispec.generate(prompt, target=target, draft=drafter, max_new_tokens=2)


def test_a_list_of_prompts_is_several_prompts_not_coerced_ids(pair):
    """A list of str (or of id lists) is several prompts (a list out), never digit strings read as ids."""
    target, drafter = pair
    out = verispec.generate(["1", "2"], target=target, draft=drafter, max_new_tokens=2)
    assert isinstance(out, list) and [r.prompt_ids for r in out] == [target.encode("1"), target.encode("2")]
    nested = verispec.generate([[1, 2]], target=target, draft=drafter, max_new_tokens=2)
    assert isinstance(nested, list) and nested[0].prompt_ids == [1, 2]


def test_generate_accepts_integer_sequences(pair):
    import numpy as np

    target, drafter = pair
    ids = [17, 35, 60]
    outs = [verispec.generate(p, target=target, draft=drafter, max_new_tokens=3, seed=1).token_ids
            for p in (ids, tuple(ids), np.array(ids), torch.tensor(ids), [np.int64(i) for i in ids])]
    assert all(o == outs[0] for o in outs)


@pytest.mark.parametrize("kwargs, name", [
    ({"rule": None}, "rule"), ({"target": None}, "target"), ({"k": 0}, "k"), ({"k": 2.5}, "k"), ({"k": True},
                                                                                                 "k"),
    ({"max_new_tokens": 0}, "max_new_tokens"), ({"temperature": "1"}, "temperature"),
    ({"temperature": None}, "temperature"), ({"seed": 2**70}, "seed"), ({"seed": -1}, "seed"),
    ({"seed": 1.0}, "seed"), ({"device": "cuda:99"}, "device"), ({"device": "nonsense"}, "device"),
    ({"dtype": "float8"}, "dtype"), ({"chat": "yes"}, "chat"), ({"draft": 3}, "draft"),
    ({"draft": None, "rule": "cos:w=0.9"}, "needs a draft"), ({"draft": "none", "rule": "lenience:l=0.5"},
                                                               "needs a draft"),
])
def test_generate_checks_every_argument_before_loading_a_model(kwargs, name):
    kwargs = {"target": "no-such-model-anywhere", **kwargs}  # loading it would raise FileNotFoundError
    with pytest.raises((TypeError, ValueError), match=name):
        verispec.generate("To be", **kwargs)


# -- also: CLI and report edges ----------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch without a usable CUDA device")
def test_cuda_device_on_a_cpu_only_torch(capsys):
    err = cli_error(capsys, ["run", "--prompt", "To be", "--device", "cuda"])
    assert "cuda" in err and "not available" in err


def test_unwritable_out(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    cli_error(capsys, ["bench", *SMALL, "--out", str(blocker / "sub")])


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
def test_read_only_out(tmp_path, capsys):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        err = cli_error(capsys, ["bench", *SMALL, "--out", str(ro / "sub")])
        assert "ro" in err
    finally:
        ro.chmod(0o755)


def test_folder_without_a_model(tmp_path, capsys):
    err = cli_error(capsys, ["run", "--prompt", "x", "--target", str(tmp_path)])
    assert "no model in" in err and "sentencepiece" not in err


def test_seed_out_of_range_cli(capsys):
    err = cli_error(capsys, ["run", "--prompt", "To be", "--seed", str(2**70)])
    assert "seed" in err


def test_usage_errors_use_the_same_format(capsys):
    err = cli_error(capsys, ["run", "--prompt", "x", "--k", "two"])
    assert "--k" in err


def test_report_of_a_one_row_sweep(sweep_dir, tmp_path):
    d = copy_of(sweep_dir, tmp_path)
    lines = (d / "results.jsonl").read_text().splitlines(keepends=True)
    for keep in (lines[:1], lines[1:]):  # plain only; lossless only
        (d / "results.jsonl").write_text("".join(keep))
        table, html = write_report(d)
        assert "data:image/png;base64," in html.read_text()


def test_report_names_rows_with_missing_keys(sweep_dir, tmp_path, capsys):
    d = copy_of(sweep_dir, tmp_path)
    rows = read_rows(d / "results.jsonl")
    del rows[1]["tokens"], rows[1]["config"]
    rows.append({**rows[0], "seconds": "slow", "unit": "other"})
    (d / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    table, _ = write_report(d)
    assert "missing config, tokens" in table and "line(s) 2" in table
    assert "not numbers: seconds" in table and "line(s) 3" in table
    rows = [{"schema": SCHEMA_VERSION, "unit": "a"}]
    (d / "results.jsonl").write_text(json.dumps(rows[0]) + "\n")
    err = cli_error(capsys, ["report", str(d)])
    assert "no usable results" in err and "missing" in err


def test_report_of_an_unreadable_file(tmp_path, capsys):
    err = cli_error(capsys, ["report", str(tmp_path / "missing")])
    assert "missing" in err
    (tmp_path / "results.jsonl").mkdir(parents=True)
    err = cli_error(capsys, ["report", str(tmp_path / "results.jsonl")])
    assert "results.jsonl" in err


def test_a_model_that_cannot_fit_is_refused_before_loading(monkeypatch, capsys):
    """Not enough memory: a MemoryError saying how much is needed and suggesting bf16 (CLI: exit 2),
    before transformers allocates anything; VERISPEC_SKIP_MEMORY_CHECK=1 loads anyway."""
    from verispec.models import hf

    directory = Path(verispec.__file__).parent / "assets" / "default_pair" / "target"
    params = hf.weight_count(directory)
    assert params == load_model("default").num_parameters  # read from the safetensors headers alone
    monkeypatch.setattr(hf, "available_memory", lambda: 10 * 2**20)  # 10 MiB free
    with pytest.raises(MemoryError, match=r"needs about 0\.2 GB .* 0\.0 GB is available; --dtype bfloat16"):
        hf.load_hf(directory, name="tiny", dtype=torch.float32)
    with pytest.raises(MemoryError, match=r"in bfloat16 needs about 0\.1 GB .*free memory"):
        hf.load_hf(directory, name="tiny", dtype=torch.bfloat16)
    message = cli_error(capsys, ["run", "--target", str(directory), "--draft", "ngram:n=2",
                                 "--prompt", "KING.", "--max-new-tokens", "2"])
    assert "needs about" in message and "bfloat16" in message
    monkeypatch.setenv("VERISPEC_SKIP_MEMORY_CHECK", "1")
    assert hf.load_hf(directory, name="tiny").num_parameters == params
