"""The models on a CUDA device (`--device cuda`, `generate(device="cuda")`): the same engine, rules and
laws as on the CPU (the rule maths run on the CPU, on float32 logits copied back; docs/design/rules.md, 'Token
roles'). Skipped where torch sees no CUDA device, as in CI; on a GPU machine run
`pytest tests/test_cuda.py -n 0 -s` (the `-s` shows the measured differences). What it pins down:

- fp32 logits of the default pair on the GPU equal the CPU's to float rounding (TF32 stays off), so a
  seeded sampled decode gives the CPU's tokens: the randomness is drawn on the CPU from the row's seed;
- greedy speculative decoding (chains and trees) emits plain greedy decoding's tokens on the GPU, and a
  row of a batch the tokens it gives alone, except at a near-tie of the target's top two logits (named);
- the first token of lossless speculative decoding follows the target's law (chi-square, with the
  draft's law as the deliberately wrong one it must reject);
- in bf16 the same holds except where bf16's rounding can flip a near-tie (the tolerance is stated);
- a sweep (`verispec bench --device cuda`) records the device in its rows and gives the CPU's tokens.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from scipy import stats

import verispec
from verispec.cli import main
from verispec.evaluation.store import read_rows
from verispec.models import load_model

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CI has none)")]

PROMPTS = ["ROMEO: But soft, what light through yonder window breaks?", "KING.\nWhat says the queen?",
           "To be, or not to be", "Enter HAMLET"]
GAP_TOL = {"float32": 1e-3, "bfloat16": 0.25}  # a top-2 logit gap within which rounding may flip greedy


@pytest.fixture(scope="module")
def models():
    return {device: load_model("default", device) for device in ("cpu", "cuda")}


def last_logits(model, ids: list[int]) -> torch.Tensor:
    """The target's logits after `ids` by one full forward pass through transformers (no cache)."""
    with torch.no_grad():
        out = model.model(input_ids=torch.tensor([ids], device=model.device))
    return out.logits[0, -1].float().cpu()


def first_difference(a: list[int], b: list[int]) -> int | None:
    j = next((n for n, (x, y) in enumerate(zip(a, b)) if x != y), None)
    return j if j is not None or len(a) == len(b) else min(len(a), len(b))


def assert_same_or_near_tie(model, results, references, tol: float, what: str) -> list[tuple[int, int]]:
    """Each result has its reference's tokens, or first differs where the target's top-2 gap is <= tol."""
    notes = []
    for i, (got, want) in enumerate(zip(results, references)):
        j = first_difference(got.token_ids, want.token_ids)
        if j is None:
            continue
        top = last_logits(model, list(got.prompt_ids) + list(got.token_ids[:j])).topk(2).values
        gap = float(top[0] - top[1])
        print(f"{what}, row {i}: first difference at token {j}, target top-2 logit gap {gap:.3g}")
        assert gap <= tol, (what, i, j, gap)
        notes.append((i, j))
    print(f"{what}: {len(results) - len(notes)} of {len(results)} rows equal")
    return notes


def test_logits_on_the_gpu_equal_the_cpus(models):
    ids = models["cpu"].encode(PROMPTS[0])
    worst = {}
    for backend in ("hf", "lean"):  # transformers' forward, and verispec's lean forward with its cache
        logits = {}
        for device, model in models.items():
            if backend == "hf":
                logits[device] = last_logits(model, ids)
            else:
                session = model.session()
                logits[device] = session.logits_for(torch.tensor([ids]), 1)[0, -1].float().cpu()  # [B, n, V]
        worst[backend] = float((logits["cpu"] - logits["cuda"]).abs().max())
    print(f"max |logit cpu - cuda|, fp32: {worst}")
    assert max(worst.values()) < 1e-3, worst


@pytest.mark.parametrize("rule", ["lossless", "speccascade:min_p=0.1", "lenience:l=0.5"])
def test_sampled_tokens_on_the_gpu_equal_the_cpus(models, rule):
    """The rows' uniforms come from CPU generators seeded per row, so only logits could differ."""
    outs = {device: verispec.generate(PROMPTS, target=models[device], draft="default-draft", rule=rule,
                                      max_new_tokens=48, temperature=1.0, seed=11, device=device,
                                      batch_size=4)
            for device in ("cpu", "cuda")}
    same = [a.token_ids == b.token_ids for a, b in zip(outs["cpu"], outs["cuda"])]
    print(f"{rule}: {sum(same)} of {len(same)} rows equal on cpu and cuda")
    assert all(same)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_speculation_is_plain_greedy_on_the_gpu(dtype):
    target = load_model("default", "cuda", getattr(torch, dtype))
    plain = [verispec.generate(p, target=target, draft=None, max_new_tokens=48, temperature=0, device="cuda",
                               dtype=dtype) for p in PROMPTS]
    ties = set()  # (row, position) of each near-tie that changed a row: the same one recurs across drafts
    for k in (1, 3, 5):
        chains = verispec.generate(PROMPTS, target=target, draft="default-draft", k=k, max_new_tokens=48,
                                   temperature=0, device="cuda", dtype=dtype, draft_dtype=dtype, batch_size=4)
        ties |= set(assert_same_or_near_tie(target, chains, plain, GAP_TOL[dtype], f"{dtype} chain k={k}"))
    trees = verispec.generate(PROMPTS, target=target, draft="default-draft", rule="greedy", tree="3,2,1",
                              max_new_tokens=48, temperature=0, device="cuda", dtype=dtype, draft_dtype=dtype,
                              batch_size=4)
    ties |= set(assert_same_or_near_tie(target, trees, plain, GAP_TOL[dtype], f"{dtype} tree 3,2,1"))
    assert len(ties) <= 2, ties  # near-ties are rare: more of them would be a real difference


@pytest.mark.parametrize("rule", ["lossless", "speccascade:min_p=0.1"])
def test_rows_of_a_batch_on_the_gpu_equal_each_row_alone(models, rule):
    target = models["cuda"]
    batched = verispec.generate(PROMPTS, target=target, draft="default-draft", rule=rule, max_new_tokens=48,
                                temperature=1.0, seed=[3, 4, 5, 6], device="cuda", batch_size=4)
    alone = [verispec.generate(p, target=target, draft="default-draft", rule=rule, max_new_tokens=48,
                               temperature=1.0, seed=s, device="cuda") for p, s in zip(PROMPTS, [3, 4, 5, 6])]
    same = [a.token_ids == b.token_ids for a, b in zip(batched, alone)]
    print(f"{rule}: {sum(same)} of {len(same)} rows equal batched and alone on cuda")
    assert all(same)


def test_first_token_of_lossless_speculation_follows_the_target_on_the_gpu(models):
    """4,000 rows of one prompt, two tokens each, so that the first block drafts one token (k = 1: the
    last token of a row is never drafted) and the first token is an accepted draft or a recovered one:
    its counts fit the target's law and reject the draft's."""
    target = models["cuda"]
    ids = target.encode(PROMPTS[2])
    n = 4000
    outs = verispec.generate([ids] * n, target=target, draft="default-draft", max_new_tokens=2,
                             temperature=1.0, seed=list(range(n)), device="cuda", batch_size=500)
    roles = {o.generation.steps["role"][0] for o in outs}
    assert roles == {"accepted", "recovered"}, roles  # every first token went through the rule
    counts = np.bincount([o.token_ids[0] for o in outs], minlength=target.vocab_size)
    draft = load_model("default-draft", "cuda")
    laws = {"target": torch.softmax(last_logits(target, ids).double(), -1).numpy(),
            "draft (wrong)": torch.softmax(last_logits(draft, ids).double(), -1).numpy()}
    p_values = {}
    for name, law in laws.items():
        big = law * n >= 5  # pool the cells expected below 5 into one
        observed = np.append(counts[big], counts[~big].sum())
        expected = np.append(law[big], law[~big].sum()) * n
        p_values[name] = float(stats.chisquare(observed, expected).pvalue)
    print(f"chi-square p of the first token's counts: {p_values}")
    assert p_values["target"] > 1e-3 and p_values["draft (wrong)"] < 1e-6, p_values


def test_a_sweep_on_the_gpu_records_the_device_and_gives_the_cpus_tokens(tmp_path, capsys):
    rows = {}
    for device in ("cpu", "cuda"):
        out = tmp_path / device
        code = main(["bench", "--device", device, "--target", "default", "--suite", "capitals",
                     "--limit", "3", "--rules", "speccascade:min_p=0.1", "--seeds", "0", "--k", "4",
                     "--batch-size", "4", "--no-progress", "--no-report", "--out", str(out)])
        assert code == 0, capsys.readouterr().err
        rows[device] = {(r["config"], r["prompt_id"], r["seed"]): r for r in read_rows(out / "results.jsonl")}
        spec = json.loads((out / "sweep.json").read_text())
        assert spec.get("device", spec.get("spec", {}).get("device")) == device, spec
    assert rows["cpu"].keys() == rows["cuda"].keys() and len(rows["cpu"]) == 12  # 3 prompts x 4 configs
    same = sum(rows["cpu"][u]["token_ids"] == rows["cuda"][u]["token_ids"] for u in rows["cpu"])
    print(f"sweep rows equal on cpu and cuda: {same} of {len(rows['cpu'])}")
    assert same == len(rows["cpu"])
