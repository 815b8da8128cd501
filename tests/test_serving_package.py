"""`verispec.serving`: the package's import order, settings refused at start with a clear message
(before any model loads or any port is bound), and the one set of Ray flags for bench and serve."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from verispec.cli import build_parser, main
from verispec.ray_cluster import RayOptions
from verispec.serving.config import ServeConfig, check_port

SRC = Path(__file__).resolve().parents[1] / "src" / "verispec"
# bottom to top (docs/design.md, 'Layering')
ORDER = ["config", "schema", "logprobs", "metrics", "engine", "app", "ray"]
OPTIONAL = ("fastapi", "starlette", "uvicorn", "prometheus_client", "ray")  # the serve and ray extras


def imports(path: Path) -> list[tuple[str, bool]]:
    """(module, at top level) for every import in a file."""
    tree = ast.parse(path.read_text())
    top = {id(n) for n in tree.body}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.append((node.module, id(node) in top))
        elif isinstance(node, ast.Import):
            out.extend((a.name, id(node) in top) for a in node.names)
    return out


def test_serving_modules_import_only_downward_and_only_optional_dependencies_in_functions():
    for i, name in enumerate(ORDER):
        found = imports(SRC / "serving" / f"{name}.py")
        above = {m for m, _ in found if m.startswith("verispec.serving.") and
                 (m.split(".")[2] not in ORDER or ORDER.index(m.split(".")[2]) >= i)}
        assert not above, f"serving/{name}.py imports {above} (not below it)"
        inner = [m for m, top in found if not top and not m.startswith(OPTIONAL)]
        assert not inner, f"serving/{name}.py imports {inner} inside a function"
        assert "verispec.cli" not in {m for m, _ in found}
    assert not [m for m, _ in imports(SRC / "jsonsafe.py") if m.startswith("verispec")]
    for path in SRC.rglob("*.py"):  # only the CLI (and the package itself) sits above the server
        if path.parent.name != "serving" and path.name != "cli.py":
            assert not [m for m, _ in imports(path) if m.startswith("verispec.serving")], path


@pytest.mark.parametrize("settings, message", [
    (dict(max_batch=0), "--max-batch must be an integer >= 1, got 0"),
    (dict(max_queue=-1), "--max-queue must be an integer >= 0"),
    (dict(max_tokens_limit=0), "--max-tokens-limit must be an integer >= 1"),
    (dict(default_max_tokens=100000), r"--default-max-tokens must be an integer in \[1, --max-tokens-limit"),
    (dict(default_max_tokens=0), "--default-max-tokens"),
    (dict(k=0), r"--k must be an integer in \[1, 16\]"),
    (dict(k=True), "--k must be"),
    (dict(max_tv_per_token=1.5), r"--max-tv-per-token must be a total variation in \[0, 1\]"),
    (dict(max_tv_per_response=-0.1), "--max-tv-per-response"),
    (dict(shutdown_grace=float("nan")), "--shutdown-grace"),
    (dict(max_n=0), "--max-n must be"),
    (dict(allow_rules=()), "--allow-rules needs at least one"),
])
def test_bad_settings_are_refused_naming_the_flag(settings, message):
    with pytest.raises(ValueError, match=message):
        ServeConfig(**settings)


def test_ports_outside_1_65535_are_refused():
    assert check_port(8000) == 8000
    for port in (99999, 0, -1, 65536, True, "80"):
        with pytest.raises(ValueError, match=r"--port must be an integer in \[1, 65535\]"):
            check_port(port)


@pytest.mark.parametrize("argv, message", [
    (["--port", "99999"], "--port must be an integer in [1, 65535], got 99999"),
    (["--max-batch", "0"], "--max-batch must be an integer >= 1, got 0"),
    (["--max-tokens-limit", "0"], "--max-tokens-limit must be an integer >= 1, got 0"),
    (["--default-max-tokens", "100000"], "--default-max-tokens must be an integer in [1, --max-tokens-limit"),
    (["--rule", "nosuchrule"], "nosuchrule"),
    (["--ray-cpus", "2"], "--ray-cpus applies to Ray Serve only: add --ray"),
])
def test_verispec_serve_refuses_bad_settings_before_starting(argv, message, capsys):
    assert main(["serve", *argv]) == 2  # exit 2 at once: nothing loaded, nothing listening
    err = capsys.readouterr().err
    assert err.startswith("verispec: error: ") and message in err and "Traceback" not in err


def test_verispec_serve_refuses_cuda_on_a_cpu_build(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert main(["serve", "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert "device 'cuda' is not available" in err and "--device cpu" in err


def test_one_set_of_ray_flags_and_the_old_spellings_still_work(capsys):
    parser = build_parser()
    bench = ["bench", "--out", "x", "--executor", "ray"]
    new = parser.parse_args([*bench, "--ray-address", "auto", "--ray-cpus", "2"])
    assert (new.ray_address, new.ray_cpus) == ("auto", 2.0) and capsys.readouterr().err == ""
    old = parser.parse_args([*bench, "--address", "auto", "--worker-cpus", "2"])
    assert (old.ray_address, old.ray_cpus) == ("auto", 2.0)
    err = capsys.readouterr().err
    assert "--address is deprecated; use --ray-address" in err and "--worker-cpus is deprecated" in err
    serve = parser.parse_args(["serve", "--ray", "--num-cpus-per-replica", "3"])
    assert serve.ray_cpus == 3.0 and "--num-cpus-per-replica is deprecated; use --ray-cpus" in (
        capsys.readouterr().err)
    assert parser.parse_args(["serve", "--ray", "--ray-address", "auto"]).ray_address == "auto"
    with pytest.raises(ValueError, match="--ray-cpus must be a number > 0"):
        RayOptions(worker_cpus=0).validate()
    with pytest.raises(ValueError, match="--workers/--replicas must be an integer >= 1"):
        RayOptions(workers=0).validate()


@pytest.mark.slow  # loads the default pair: ~10 s on a loaded machine
def test_run_json_carries_per_token_logprobs_and_their_sums(capsys):
    """`verispec run --json` (GenerateResult.to_json): per token the target's and the behaviour
    log-probability and the role, and the sums whose difference is the report's log_ratio."""
    import json

    argv = ["run", "--prompt", "KING.\n", "--rule", "budget:tv=0.05", "--max-new-tokens", "8", "--seed", "2",
            "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    lp = out["logprobs"]
    assert [t["token_id"] for t in lp["tokens"]] == out["token_ids"]
    assert {t["role"] for t in lp["tokens"]} <= {"accepted", "recovered", "bonus"}
    assert lp["sum_behaviour_logprob"] - lp["sum_logprob"] == pytest.approx(
        out["stats"]["verification"]["log_ratio"], abs=1e-9)
    assert lp["log_importance_weight"] == pytest.approx(lp["sum_logprob"] - lp["sum_behaviour_logprob"])
