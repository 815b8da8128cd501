"""Fuzzing (issues 9 and 26): generated inputs to `verispec.generate`, `Rule.verify` / `emitted`, the spec
parsers (deep `honest:` nesting, digit separators), data files (duplicate ids, bad lines, edits between
runs) and the CLI either fail with a clear ValueError / TypeError (exit status 2 and `verispec: error:`
for the CLI) or give a result whose laws are distributions and whose tokens are in range: never another
exception, a NaN in a law, or a hang. Derandomised (tests/conftest.py), deadlines off. The last test
checks that at least 10,000 inputs ran and prints the count to stderr."""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import sys
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import verispec
from verispec.cli import main
from verispec.evaluation.suites import file_fingerprint, fingerprint_changes, load_suite
from verispec.models import ModelDrafter, TabularModel, load_drafter, load_model
from verispec.rules import Rule, names, parse

COUNT: Counter = Counter()


# 10,000+ generated inputs take ~25 s: part of the full run (CI), not of the fast `-m "not slow"` loop
pytestmark = pytest.mark.slow

SCALE = float(os.environ.get("VERISPEC_FUZZ_SCALE", "1"))  # e.g. 0.1 for a quick local run


def fuzz(examples: int) -> settings:
    return settings(max_examples=max(1, int(examples * SCALE)), deadline=None, derandomize=True,
                    suppress_health_check=list(HealthCheck))

SPECS = ["lossless", "greedy", "hsd", "speccascade:min_p=0.1", "speccascade:min_p=0.3,resample=greedy",
         "typical:eps=0.09,alpha=0.3", "topk:k=2", "topp:p=0.8,resample=truncated", "relaxed:n=2,delta=0.2",
         "honest:speccascade:min_p=0.1", "honest:topk:k=2", "lenience:l=0.5", "cos:w=0.5",
         "fuzzy:threshold=0.2", "fuzzy:threshold=0.2,div=tv", "sglang:single=0.5,acc=0.5", "budget:tv=0.05",
         "budget:tv=0.2,ratio=inf"]
BAD_SPECS = ["", "nope", "lenience", "lenience:l=7", "lenience:l=nan", "topk:k=0", "honest",
             "honest:lenience:l=0.5",
             "budget:tv=-1", "typical:eps=1", ":", "lossless:x=1", "cos:w=0.5,w=0.2"]


def _law_ok(law: torch.Tensor) -> None:
    law = law.double()
    assert torch.isfinite(law).all() and (law >= 0).all(), "a law with NaN, inf or negative entries"
    assert torch.allclose(law.sum(-1), torch.ones_like(law.sum(-1)),
                          atol=1e-4), "a law that does not sum to 1"


# -- Rule.verify / Rule.emitted ---------------------------------------------------------------------

KINDS = ["valid", "valid", "valid", "sparse", "nan", "inf", "negative", "unnormalised", "zeros"]


def _probs(gen: torch.Generator, shape: tuple[int, ...], kind: str, dtype: torch.dtype) -> torch.Tensor:
    x = torch.rand(shape, generator=gen, dtype=torch.float64) ** 3
    if kind == "sparse" and x.numel():
        x = x * (torch.rand(shape, generator=gen, dtype=torch.float64) < 0.5)
        x[..., 0] += 1e-3  # keep every row non-empty
    x = x / x.sum(-1, keepdim=True).clamp_min(1e-300)
    if x.numel():
        flat = x.view(-1)
        if kind == "nan":
            flat[0] = math.nan
        elif kind == "inf":
            flat[-1] = math.inf
        elif kind == "negative":
            flat[0] = -0.25
        elif kind == "unnormalised":
            x = x * 3
        elif kind == "zeros":
            x = torch.zeros_like(x)
    return x.to(dtype)


@fuzz(3000)
@given(spec=st.sampled_from(SPECS), b=st.integers(0, 3), k=st.integers(0, 3), v=st.integers(0, 6),
       kind_p=st.sampled_from(KINDS), kind_q=st.sampled_from(KINDS),
       dtype=st.sampled_from([torch.float32, torch.float64, torch.float64, torch.float16, torch.int64]),
       tokens=st.sampled_from(["drawn", "drawn", "drawn", "minus1", "big", "float", "shape", "zero_q"]),
       shapes=st.sampled_from(["ok", "ok", "ok", "q_short", "p_2d", "batch"]), seed=st.integers(0, 2**31))
def test_fuzz_rule_verify_and_emitted(spec, b, k, v, kind_p, kind_q, dtype, tokens, shapes, seed):
    COUNT["rules"] += 1
    rule = parse(spec)
    gen = torch.Generator().manual_seed(seed)
    p = _probs(gen, (b, k + 1, v), kind_p, dtype)
    q = _probs(gen, (b, k, v), kind_q, dtype)
    drawable = q.numel() and q.is_floating_point() and torch.isfinite(q).all() and (q >= 0).all()
    if drawable and (q.sum(-1) > 0).all():
        x = torch.multinomial(q.double().reshape(-1, v), 1, generator=gen).reshape(b, k)
    else:
        x = torch.zeros((b, k), dtype=torch.long)
    if tokens == "minus1" and x.numel():
        x[..., -1] = -1
    elif tokens == "big":
        x = x + v
    elif tokens == "float":
        x = x.double()
    elif tokens == "shape":
        x = x[..., None]
    elif tokens == "zero_q" and x.numel() and q.numel() and q.is_floating_point():
        q = q.clone()
        q.view(-1)[0] = 0
        x.view(-1)[0] = 0
    if shapes == "q_short":
        q = q[:, :-1]
    elif shapes == "p_2d":
        p = p[0] if b else p.reshape(-1)
    elif shapes == "batch":
        q = torch.cat([q, q]) if q.ndim == 3 else q
    try:
        result = rule.verify(p, q, x, torch.Generator().manual_seed(seed))
    except (ValueError, TypeError):
        pass
    else:
        n = result.num_accepted
        assert result.tokens.shape == (b, k + 1) and ((n >= 0) & (n <= k)).all()
        for i in range(b):
            kept = result.tokens[i, : int(n[i]) + 1]
            assert ((kept >= 0) & (kept < v)).all(), "a token out of range"
            assert (result.tokens[i, int(n[i]) + 1:] == -1).all()
    if rule.block_level:
        return
    try:
        law = rule.emitted(p[..., :k, :] if p.ndim == 3 else p, q)
    except (ValueError, TypeError):
        return
    _law_ok(law)


# -- spec parsers ---------------------------------------------------------------------------------------

KEYS = sorted({"l", "w", "k", "p", "n", "delta", "eps", "alpha", "min_p", "threshold", "div", "single",
               "acc", "tv",
               "ratio", "resample", "x", ""})
VALUES = ["0", "1", "0.5", "-1", "2", "1e-9", "1e999", "inf", "-inf", "nan", "", "3.0", "2.5", "target",
          "greedy",
          "js", "tv", "kl", "0x10", "1_0", " 1 ", "truncated", "=", ","]


@st.composite
def spec_strings(draw):
    if draw(st.integers(0, 4)) == 0:
        return draw(st.text(max_size=20))
    name = draw(st.sampled_from(names() + ["", "Lossless", "honest:topk", "bogus"]))
    pairs = draw(st.lists(st.tuples(st.sampled_from(KEYS), st.sampled_from(VALUES)), max_size=3))
    args = ",".join(f"{key}={value}" for key, value in pairs)
    sep = draw(st.sampled_from([":", ":", " : ", "::", ""]))
    return f"{name}{sep}{args}" if args or draw(st.booleans()) else name


@fuzz(3000)
@given(spec=st.one_of(spec_strings(), st.none(), st.integers(), st.floats()))
def test_fuzz_rule_parser(spec):
    COUNT["parse"] += 1
    try:
        rule = parse(spec)
    except ValueError:
        return
    assert isinstance(rule, Rule)
    assert parse(rule.spec) == rule  # the canonical spec round-trips


@pytest.fixture(scope="module")
def default_target():
    return load_model("default")


@fuzz(600)
@given(spec=st.one_of(
    st.builds(lambda kind, value: f"{kind}:{value}", st.sampled_from(["self", "ngram", "self ", "ngram"]),
              st.one_of(st.builds(lambda key, v: f"{key}={v}", st.sampled_from(["layers", "n", "k", ""]),
                                  st.sampled_from(["0", "1", "2", "7", "8", "100", "-1", "1.5", "nan", "inf",
                                                   ""])),
                        st.text(max_size=6))),
    st.sampled_from(["self", "ngram", "", " ", "none", "/nonexistent/model", "default-draft"]),
    st.none(), st.integers()))
def test_fuzz_drafter_spec(default_target, spec):
    COUNT["drafter"] += 1
    try:
        drafter = load_drafter(spec, default_target)
    except ValueError:
        return
    except FileNotFoundError as err:
        assert "model not found" in str(err) or "no model in" in str(err)
        return
    assert drafter.vocab_size == default_target.vocab_size


@pytest.fixture(scope="module")
def suite_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("suites")
    (d / "garbage.jsonl").write_bytes(b"\xff\xfe not json\n")
    (d / "wrong_keys.jsonl").write_text('{"q": 1}\n')
    (d / "not_objects.jsonl").write_text("[1, 2]\n")
    (d / "empty.jsonl").write_text("")
    (d / "good.jsonl").write_text('{"question": "1+1?", "answer": "2", "problem": "p", "solution": "s", '
                                  '"text": "t", "test_list": ["assert True"]}\n')
    return d


@fuzz(600)
@given(name=st.sampled_from(["shakespeare", "capitals", "arithmetic", "gsm8k", "math", "mbpp", "nope", "",
                             "GSM8K"]),
       arg=st.sampled_from([None, "", "garbage.jsonl", "wrong_keys.jsonl", "not_objects.jsonl", "empty.jsonl",
                            "good.jsonl", "missing.jsonl", "."]),
       junk=st.one_of(st.none(), st.text(max_size=8)))
def test_fuzz_suite_spec(suite_files, name, arg, junk):
    COUNT["suite"] += 1
    spec = junk if junk is not None and not junk.startswith(("humaneval", " humaneval")) else (
        name if arg is None else f"{name}:{suite_files / arg if arg else ''}")
    if isinstance(spec, str) and spec.strip().partition(":")[0].strip() == "humaneval":
        return
    try:
        suite = load_suite(spec)
    except (ValueError, FileNotFoundError):
        return
    assert all(isinstance(item.prompt, str) for item in suite.items)


# -- data files: duplicate ids, bad lines, edits between runs (issue 26) ----------------------------

DATA_LINE = st.one_of(
    st.builds(lambda i, q: {"id": i, "question": q, "answer": "#### 1"},
              st.sampled_from(["a", "b", "c", "0", "1", 2]), st.text(min_size=1, max_size=6)),
    st.builds(lambda q: {"question": q, "answer": "1"}, st.text(min_size=1, max_size=6)),  # id: its index
    st.sampled_from(["", "   ", "{not json", "[1, 2]", "null", '"text"', "{", "{\"id\": \"x\"}"]),
)


@fuzz(500)
@given(lines=st.lists(DATA_LINE, min_size=1, max_size=6))
def test_fuzz_data_file(suite_files, lines):
    """A gsm8k file of generated lines loads with one item per object line and unique ids, or is refused
    naming the file and line (bad JSON, not an object), the duplicate id and its lines, or the missing
    field; never another exception."""
    COUNT["data_file"] += 1
    path = suite_files / f"fuzz-{COUNT['data_file']}.jsonl"
    path.write_text("".join((json.dumps(x) if isinstance(x, dict) else x) + "\n" for x in lines))
    try:
        suite = load_suite(f"gsm8k:{path}")
    except ValueError as err:
        assert str(path) in str(err), err
        message = str(err)
        assert ("line" in message or "used by more than one row" in message
                or "is not a gsm8k JSONL file" in message), message
        return
    objects = [x for x in lines if isinstance(x, dict)]
    assert len(suite.items) == len(objects)
    assert len({item.id for item in suite.items}) == len(suite.items)


@fuzz(300)
@given(old=st.dictionaries(st.sampled_from("abcdefg"), st.sampled_from(["1+1?", "2+2?", "3+3?"]), min_size=1),
       new=st.dictionaries(st.sampled_from("abcdefg"), st.sampled_from(["1+1?", "2+2?", "3+3?"]), min_size=1))
def test_fuzz_data_file_edits(suite_files, old, new):
    """Between two runs a data file gains, loses and edits questions: the fingerprints differ exactly when
    the bytes do, and the words name exactly the ids added, removed and edited."""
    COUNT["data_edit"] += 1
    paths = []
    for tag, items in (("old", old), ("new", new)):
        path = suite_files / f"edit-{COUNT['data_edit']}-{tag}.jsonl"
        path.write_text("".join(json.dumps({"id": i, "question": q, "answer": "2"}) + "\n"
                                for i, q in items.items()))
        paths.append(path)
    before, after = (file_fingerprint(f"gsm8k:{p}") for p in paths)
    assert (before["sha256"] == after["sha256"]) == (paths[0].read_bytes() == paths[1].read_bytes())
    words = fingerprint_changes(before, after)
    added, removed = new.keys() - old.keys(), old.keys() - new.keys()
    edited = {i for i in old.keys() & new.keys() if old[i] != new[i]}
    for word, ids in (("added", added), ("removed", removed), ("edited", edited)):
        assert (f"id(s) {word}" in words) == bool(ids), words
        if ids and len(ids) <= 5:
            assert f"{len(ids)} id(s) {word}" in words and all(repr(i) in words for i in ids), words


# -- spec nesting and number literals (issue 26) ----------------------------------------------------

@fuzz(600)
@given(depth=st.integers(0, 3000),
       inner=st.sampled_from(["speccascade:min_p=0.1", "topk:k=2", "lossless", ""]),
       value=st.sampled_from(["0.5", "0_5", "1_0", "5e-1", "5_e-1", ".5", "0.5_", "_0.5", "1__0", "١",
                              "0.٥"]),
       key=st.sampled_from(["lenience:l", "topk:k", "cos:w", "speccascade:min_p"]))
def test_fuzz_spec_nesting_and_numbers(depth, inner, value, key):
    COUNT["spec_deep"] += 1
    spec = "honest:" * depth + inner
    try:
        rule = parse(spec)
    except ValueError:
        pass  # never RecursionError
    else:
        assert depth <= 1 and parse(rule.spec) == rule
    try:
        rule = parse(f"{key}={value}")
    except ValueError as err:
        if "_" in value or not value.isascii():
            assert "not a plain decimal number" in str(err), err
        return
    assert "_" not in value and value.isascii()


# -- verispec.generate on a toy pair ---------------------------------------------------------------


class ToyLM(TabularModel):
    """A tabular model with a character tokenizer, so `generate` can take text."""

    tokenizer = None

    def encode(self, text: str) -> list[int]:
        return [ord(c) % self.vocab_size for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(97 + i) for i in ids)


V = 7
TOY_TARGET = ToyLM(TabularModel.random(V, order=2, seed=1).table, name="toy", eos_token_id=6, max_context=40)
TOY_DRAFT = ToyLM(TabularModel.random(V, order=1, seed=2).table, name="toy-draft")
NUMBER = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-3, 10),
                   st.sampled_from([0, 1e-39, 1e-300, 1e300, 0.5, 1.0, "1", None, True]))
PROMPTS = st.one_of(
    st.text(max_size=12), st.lists(st.integers(-2, V + 1), max_size=8), st.lists(st.integers(0, V - 1),
                                                                                 max_size=50),
    st.lists(st.floats(), max_size=3), st.lists(st.booleans(), max_size=3), st.binary(max_size=4),
    st.lists(st.text(max_size=2), max_size=3), st.integers(), st.none(), st.tuples(st.integers(0, V - 1)),
    st.lists(st.lists(st.integers(0, 3), max_size=2), max_size=2),
)


@fuzz(2500)
@given(prompt=PROMPTS, rule=st.one_of(st.sampled_from(SPECS + BAD_SPECS), st.none(), st.integers()),
       draft=st.sampled_from(["model", "drafter", None, "none", "auto", "ngram:n=2", "ngram:n=0", 5]),
       k=st.one_of(st.integers(-1, 6), st.sampled_from([2.0, True, None, "3"])),
       max_new_tokens=st.one_of(st.integers(-1, 8), st.sampled_from([10**12, 2.5, None])),
       temperature=NUMBER, top_k=st.one_of(st.none(), NUMBER), top_p=st.one_of(st.none(), NUMBER),
       min_p=st.one_of(st.none(), NUMBER), eta=st.one_of(st.none(), NUMBER),
       seed=st.one_of(st.integers(-2, 2**64 + 2), st.sampled_from([1.5, None, "0"])),
       chat=st.sampled_from([None, False, True, "yes"]))
def test_fuzz_generate(prompt, rule, draft, k, max_new_tokens, temperature, top_k, top_p, min_p, eta, seed,
                       chat):
    COUNT["generate"] += 1
    if isinstance(draft, str):
        draft = {"model": TOY_DRAFT, "drafter": ModelDrafter(TOY_DRAFT)}.get(draft, draft)
    try:
        out = verispec.generate(prompt, target=TOY_TARGET, draft=draft, rule=rule, k=k,
                                max_new_tokens=max_new_tokens,
                                temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, eta=eta,
                                seed=seed, chat=chat)
    except (ValueError, TypeError):
        return
    for one in out if isinstance(out, list) else [out]:  # a list of prompts gives a list of results
        assert 1 <= len(one.token_ids) <= max_new_tokens
        assert all(0 <= t < V for t in one.token_ids)
        steps = one.generation.steps
        assert all(0 <= x <= 1 + 1e-9 for x in steps["tv"]) and not any(math.isnan(x) for x in steps["kl"])
        assert not any(math.isnan(x) for x in steps["log_law"])


@pytest.mark.slow
@fuzz(150)
@given(prompt=st.one_of(st.text(max_size=12), st.lists(st.integers(-1, 600), max_size=6)),
       rule=st.sampled_from(SPECS), k=st.integers(1, 5), temperature=NUMBER, seed=st.integers(0, 2**63 - 1))
def test_fuzz_generate_default_pair(default_target, prompt, rule, k, temperature, seed):
    COUNT["generate_default"] += 1
    drafter = load_drafter("default-draft", default_target)
    try:
        out = verispec.generate(prompt, target=default_target, draft=drafter, rule=rule, k=k,
                                max_new_tokens=3,
                                temperature=temperature, seed=seed)
    except (ValueError, TypeError):
        return
    for one in out if isinstance(out, list) else [out]:
        assert all(0 <= t < default_target.vocab_size for t in one.token_ids) and len(one.token_ids) <= 3


# -- the CLI, in process -------------------------------------------------------------------------------

OPTIONS = {
    "--rule": SPECS[:6] + BAD_SPECS[:6], "--prompt": ["To be", "", "KING." * 700, "\x00\udcff"],
    "--max-new-tokens": ["2", "0", "-1", "abc", "1000000000000"], "--k": ["1", "3", "0", "-2", "x", "1e9"],
    "--temperature": ["0", "1", "1e-39", "-1", "nan", "inf", "1e400", "x"], "--top-k": ["0", "2", "x", "-5"],
    "--top-p": ["0", "0.5", "2", "nan"], "--min-p": ["0.1", "-1", "nan"], "--eta": ["0.1", "1", "x"],
    "--seed": ["0", "-1", str(2**70), str(2**63 - 1), "x"], "--device": ["cpu", "cuda", "meta", "xyz", ""],
    "--dtype": ["float32", "int8"], "--draft": ["default-draft", "ngram:n=2", "self:layers=2", "none",
                                                "ngram:n=0",
                                                 "/nonexistent/draft"],
    "--target": ["default", "/nonexistent/model"],
}
FLAGS = ["--json", "--quiet-stats", "--chat", "--no-chat", "--bogus"]


@st.composite
def run_argv(draw):
    argv = [draw(st.sampled_from(["run", "run", "run", "rules", "nope", "--help", "report"]))]
    if argv[0] == "run":
        argv += ["--max-new-tokens",
                 "2"]  # keep generations short; a drawn --max-new-tokens below overrides it
    for _ in range(draw(st.integers(0, 6))):
        if draw(st.integers(0, 5)) == 0:
            argv.append(draw(st.sampled_from(FLAGS)))
        else:
            key = draw(st.sampled_from(sorted(OPTIONS)))
            argv += [key, draw(st.sampled_from(OPTIONS[key]))]
    if argv[0] == "run" and draw(st.integers(0, 5)):
        argv += ["--prompt", "To be"] if "--prompt" not in argv else []
    return argv


@fuzz(900)
@given(argv=run_argv())
def test_fuzz_cli(default_target, argv):
    COUNT["cli"] += 1
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    if code == 0:
        if argv[0] == "run" and "--json" in argv and "--help" not in argv:
            ids = json.loads(out.getvalue())["token_ids"]
            assert all(0 <= t < default_target.vocab_size for t in ids)
        return
    assert code == 2, (argv, code, err.getvalue())
    assert err.getvalue().startswith("verispec: error:"), (argv, err.getvalue())
    assert "Traceback" not in err.getvalue()


@pytest.mark.slow
@fuzz(60)
@given(k=st.sampled_from(["0", "2", "x"]), temps=st.sampled_from(["1", "-1", "nan", "0"]),
       limit=st.sampled_from(["1", "0", "-1"]), seeds=st.sampled_from(["0", str(2**70), "-1"]),
       rules=st.sampled_from(["lossless", "topk:k=2", "lenience:l=7", "nope"]), resume=st.booleans(),
       suite=st.sampled_from(["shakespeare", "nope", "gsm8k:/nonexistent"]))
def test_fuzz_cli_bench(tmp_path_factory, k, temps, limit, seeds, rules, resume, suite):
    COUNT["cli_bench"] += 1
    out_dir = tmp_path_factory.mktemp("bench")
    argv = ["bench", "--suite", suite, "--rules", rules, "--k", k, "--temperatures", temps, "--seeds", seeds,
            "--limit", limit, "--max-new-tokens", "2", "--no-progress", "--out", str(out_dir / "o")]
    argv += ["--resume"] if resume else []
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = main(argv)
    assert code in (0, 2), err.getvalue()
    if code == 2:
        assert err.getvalue().startswith("verispec: error:") and not (out_dir / "o" / "sweep.json").exists()


def test_zz_fuzz_input_count():
    """Runs last in this module: at least 10,000 generated inputs went through the fuzz tests above."""
    total = sum(COUNT.values())
    print(f"\nverispec fuzz: {total} generated inputs ({dict(COUNT)})", file=sys.__stderr__)
    assert total >= 10_000 * min(1.0, SCALE), dict(COUNT)
