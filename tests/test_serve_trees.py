"""`verispec serve` with token trees and multi-drafts (issue 24): a request names its draft shape in
`verification.tree` (`tree:widths=...`, `drafts:n=...`, or "none" for chain drafts), the server's
`--tree` is the default. A served tree request equals `verispec.generate(tree=..., drafts=...)` for the
same prompt, shape, rule and seed (tokens exactly, the verification report to float32 rounding);
concurrent requests with different shapes, and rows sharing one tree group, equal the same requests
decoded alone; a tree row streams; bad shapes and pairings get a 400 naming the problem before the
engine sees the request, and `serve --tree` refuses them at start. A real uvicorn server on 127.0.0.1
(tests/test_serve.py's `Running`); loopback only; every wait is bounded."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from test_serve import PROMPT, Running, same_report  # noqa: E402

import verispec  # noqa: E402
from verispec.cli import main  # noqa: E402
from verispec.decode import DecodeConfig  # noqa: E402
from verispec.jsonsafe import json_safe  # noqa: E402
from verispec.sampling import SamplingConfig  # noqa: E402
from verispec.serving.app import Server  # noqa: E402
from verispec.serving.config import ServeConfig  # noqa: E402

DEFAULT_TREE = "tree:widths=2,1"  # the module server's --tree


@pytest.fixture(scope="module")
def srv():
    running = Running(ServeConfig(target="default", draft="default-draft", tree=DEFAULT_TREE,
                                  max_batch=16,
                                  max_queue=16, default_max_tokens=64))
    yield running
    running.close()
    assert running.app.state.server.engine.running == 0


def local(prompt=PROMPT, *, seed: int, max_tokens: int, rule: str = "lossless", **kwargs):
    """`verispec.generate` alone (completions: no chat template), and its verification report."""
    out = verispec.generate(prompt, target="default", draft="default-draft", rule=rule, seed=seed,
                            max_new_tokens=max_tokens, chat=False, **kwargs)
    return out, json_safe(out.stats["verification"])


def served(srv, prompt=PROMPT, *, seed: int, max_tokens: int, verification: dict | None = None, **body):
    extra = {} if verification is None else {"extra_body": {"verification": verification}}
    return srv.client.completions.create(model="default", prompt=prompt, max_tokens=max_tokens, seed=seed,
                                         **extra, **body)


def same_as_local(r, out, report) -> None:
    assert r.model_extra["token_ids"] == out.token_ids
    assert r.choices[0].text == out.text
    same_report(r.model_extra["verification"], report)


# -- refused at start, before anything loads (no model) ----------------------------------------------


@pytest.mark.parametrize("argv, message", [
    (["--tree", "widths=2,0"], "--tree: tree widths must be one or more integers >= 1"),
    (["--tree", "tree:depth=3"], "--tree: draft shape 'tree' needs parameter(s) nodes, topk"),
    (["--tree", "drafts:n=0"], "--tree: draft shape 'drafts': n=0 is out of range"),
    (["--tree", "2", "--rule", "hsd"], "--rule 'hsd' with --tree tree:widths=2: unknown tree rule 'hsd'"),
    (["--tree", "n=2", "--rule", "lenience:l=0.5"], "is lossy on sampled drafts"),
    (["--rule", "traversal"], "'traversal' is a tree rule: give a tree draft"),
    (["--tree", "8,8"], "drafts 72 nodes per block, more than this server's --max-tree-nodes 64"),
    (["--tree", "nodes=8,depth=6,topk=12"], "creates 732 candidates per block while drafting, more than 8 x"),
    (["--tree", "n=3", "--k", "8", "--max-tree-nodes", "20"], "drafts 24 nodes per block"),
    (["--tree", "2", "--draft", "none"], "--tree tree:widths=2 needs a draft model"),
])
def test_serve_tree_settings_are_refused_before_starting(argv, message, capsys):
    assert main(["serve", *argv]) == 2  # exit 2 at once: nothing loaded, nothing listening
    err = capsys.readouterr().err
    assert err.startswith("verispec: error: ") and message in err and "Traceback" not in err


def test_serve_tree_setting_is_kept_as_its_spec():
    assert ServeConfig(tree="3,2,1").tree == "tree:widths=3,2,1"
    assert ServeConfig(tree="n=2", rule="traversal").tree == "drafts:n=2,replacement=1"
    assert ServeConfig().tree is None and ServeConfig().draft_shape is None


def test_distinct_drafts_at_temperature_0_are_refused_before_decoding():
    """At temperature 0 the processed draft is one-hot: n > 1 distinct first tokens cannot be drawn (the
    block would fail mid-decoding; the server would answer 500 for the whole group)."""
    greedy = SamplingConfig(temperature=0)
    with pytest.raises(ValueError, match="at temperature 0 the processed draft is one-hot"):
        DecodeConfig(tree="drafts:n=2,replacement=0", sampling=greedy)
    for ok in ("drafts:n=2", "drafts:n=1,replacement=0"):
        assert DecodeConfig(tree=ok, sampling=greedy).tree.n in (1, 2)
    assert DecodeConfig(tree="drafts:n=2,replacement=0").tree.replacement == 0  # sampled: runtime support


# -- a real server ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_greedy_tree_request_equals_generate_and_counts_nodes(srv):
    """T = 0: the served tree row is generate's, and (greedy verification of a top-k tree emits the
    target's argmax) the served chain row's too. drafted_tokens counts tree nodes: 3 + 6 + 6 = 15 per
    full block of tree:widths=3,2,1; acceptance_per_position runs over the tree's 3 depths."""
    r = served(srv, seed=5, max_tokens=16, temperature=0, verification={"tree": "tree:widths=3,2,1"})
    out, report = local(seed=5, max_tokens=16, temperature=0, tree="3,2,1")
    same_as_local(r, out, report)
    ver = r.model_extra["verification"]
    assert ver["tree"] == "tree:widths=3,2,1" and ver["rule"] == "lossless" and ver["lossless"]
    blocks = out.generation.blocks
    assert blocks[0].proposed == 15 and all(b.proposed <= 15 for b in blocks)
    assert ver["drafted_tokens"] == sum(b.proposed for b in blocks) and ver["drafted_tokens"] > ver["tokens"]
    assert ver["target_calls"] == len(blocks)
    assert [p["position"] for p in ver["acceptance_per_position"]] == [1, 2, 3]
    assert sum(p["accepted"] for p in ver["acceptance_per_position"]) == ver["accepted_tokens"]
    chain = served(srv, seed=5, max_tokens=16, temperature=0, verification={"tree": "none"})
    assert chain.model_extra["token_ids"] == out.token_ids
    assert chain.model_extra["verification"]["tree"] is None


@pytest.mark.slow
@pytest.mark.parametrize("verification, shape, spec", [
    ({"tree": "tree:widths=3,2,1"}, dict(tree="3,2,1"), "tree:widths=3,2,1"),
    ({"tree": "drafts:n=2", "rule": "traversal", "k": 3}, dict(drafts="n=2", k=3, rule="traversal"),
     "drafts:n=2,replacement=1"),
    ({"tree": "tree:widths=2,2", "rule": "lenience:l=0.5"}, dict(tree="2,2", rule="lenience:l=0.5"),
     "tree:widths=2,2"),
    ({"tree": "nodes=5,depth=3,topk=2", "rule": "speccascade:min_p=0.1"},
     dict(tree="nodes=5,depth=3,topk=2", rule="speccascade:min_p=0.1"), "tree:nodes=5,depth=3,topk=2"),
    (None, dict(tree="2,1"), DEFAULT_TREE),  # the server's --tree
    ({"tree": "none"}, dict(k=4), None),  # chain drafts on a server whose default is a tree
])
def test_sampled_request_equals_generate_with_the_same_seed(srv, verification, shape, spec):
    r = served(srv, seed=11, max_tokens=20, verification=verification)
    out, report = local(seed=11, max_tokens=20, **shape)
    same_as_local(r, out, report)
    ver = r.model_extra["verification"]
    assert ver["tree"] == spec and ver["drafted_tokens"] == sum(b.proposed for b in out.generation.blocks)


@pytest.mark.slow
def test_concurrent_trees_and_a_chain_each_equal_alone(srv):
    """Different shapes decode in different groups, stepped in turn; rows of one shape share its tree
    passes (the two widths=3,2,1 rows below, prompts of different lengths). Tokens are compared exactly:
    one tree pass for several rows rounds differently from one row's (~1e-6, tests/test_lean_tree.py),
    which moves a sampled token only if its uniform falls that close to a CDF boundary; it did not for
    these fixed seeds (as in tests/test_decode_trees.py). Reports: to float32 rounding (same_report)."""
    jobs = [
        (PROMPT, 1, {"tree": "tree:widths=3,2,1"}, dict(tree="3,2,1")),
        ("ROMEO.\n", 2, {"tree": "tree:widths=3,2,1"}, dict(tree="3,2,1")),
        (PROMPT, 3, {"tree": "drafts:n=2,depth=3", "rule": "traversal"}, dict(drafts="n=2,depth=3",
                                                                              rule="traversal")),
        (PROMPT, 4, {"tree": "none"}, dict(k=4)),
        ("ROMEO.\n", 5, {"tree": "tree:widths=2,2", "rule": "budget:tv=0.05"},
         dict(tree="2,2", rule="budget:tv=0.05")),
    ]
    with ThreadPoolExecutor(len(jobs)) as pool:
        responses = list(pool.map(lambda job: served(srv, job[0], seed=job[1], max_tokens=24,
                                                     verification=job[2]), jobs, timeout=300))
    for (prompt, seed, _, shape), r in zip(jobs, responses):
        out, report = local(prompt, seed=seed, max_tokens=24, **shape)
        same_as_local(r, out, report)
    metrics = httpx.get(srv.url + "/metrics", timeout=30).text
    assert 'rule="lossless tree:widths=3,2,1"' in metrics  # tree acceptance apart from the chain's


@pytest.mark.slow
def test_a_tree_row_streams(srv):
    body = dict(seed=7, max_tokens=20, verification={"tree": "tree:widths=3,1", "rule": "traversal"})
    whole = served(srv, **body)
    chunks = list(served(srv, stream=True, **body))
    assert len(chunks) > 2 and "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].model_extra["verification"] == whole.model_extra["verification"]
    assert chunks[-1].model_extra["verification"]["tree"] == "tree:widths=3,1"
    assert all("verification" not in c.model_extra for c in chunks[:-1])


@pytest.mark.slow
def test_tree_rows_carry_their_exact_per_token_record(srv):
    """logprobs of a tree row are the decode loop's record, as for chains: the behaviour log-probs (the
    exact per-step law of the tree rule) sum to the report's log_ratio against the target's."""
    verification = {"tree": "tree:widths=2,2", "rule": "lenience:l=0.5"}
    body = {"prompt": PROMPT, "max_tokens": 16, "seed": 9, "logprobs": 0, "verification": verification}
    r = httpx.post(srv.url + "/v1/completions", json=body, timeout=60).json()
    out, _ = local(seed=9, max_tokens=16, tree="2,2", rule="lenience:l=0.5")
    steps, lp = out.generation.steps, r["choices"][0]["logprobs"]
    assert r["token_ids"] == out.token_ids and lp["token_roles"] == steps["role"]
    assert lp["behaviour_logprobs"] == pytest.approx(steps["log_law"], rel=1e-4, abs=1e-4)
    assert lp["log_importance_weight"] == pytest.approx(-r["verification"]["log_ratio"], abs=1e-9)
    lossless = {**body, "logprobs": 2, "verification": {"tree": "tree:widths=2,2"}}
    lp = httpx.post(srv.url + "/v1/completions", json=lossless, timeout=60).json()["choices"][0]["logprobs"]
    assert lp["behaviour_logprobs"] == lp["processed_logprobs"] and len(lp["top_behaviour_logprobs"][0]) == 2


BAD = [  # (verification, other fields, status-400 param, words of the message)
    ({"tree": "tree:widths=3,x"}, {}, "verification.tree", "tree widths must be integers >= 1"),
    ({"tree": "tree:height=3"}, {}, "verification.tree", "draft shape 'tree' takes widths="),
    ({"tree": "tree:nodes=9,depth=2,topk=2"}, {}, "verification.tree", "exceeds the 6 candidates"),
    ({"tree": "tree:nodes=3,depth=2,topk=5000"}, {}, "verification.tree", "exceeds the vocabulary (4096"),
    ({"tree": "tree:nodes=65,depth=5,topk=4"}, {}, "verification.tree", "65 nodes per block"),
    ({"tree": "tree:nodes=8,depth=6,topk=12"}, {}, "verification.tree", "creates 732 candidates per block"),
    ({"tree": "tree:widths=2,0"}, {}, "verification.tree", "widths must be one or more integers >= 1"),
    ({"tree": "drafts:n=0"}, {}, "verification.tree", "n=0 is out of range"),
    ({"tree": 3}, {}, "verification.tree", "must be a draft shape string"),
    ({"tree": "tree:widths=5000"}, {}, "verification.tree", "exceeds the vocabulary (4096 tokens)"),
    ({"tree": "drafts:n=1,depth=3000"}, {}, "verification.tree", "tree depth 3000 exceeds the"),
    ({"tree": "none", "rule": "traversal"}, {}, "verification.rule", "'traversal' is a tree rule"),
    ({"tree": "tree:widths=2", "rule": "hsd"}, {}, "verification.rule", "unknown tree rule 'hsd'"),
    ({"tree": "drafts:n=2", "rule": "lenience:l=0.5"}, {}, "verification.rule", "lossy on sampled drafts"),
    ({"tree": "tree:widths=2,1", "k": 3}, {}, "verification.k", "has its own depth (2): leave k out"),
    ({"tree": "drafts:n=2,depth=2", "k": 3}, {}, "verification.k", "has its own depth (2)"),
    ({"tree": "tree:widths=2", "k": "auto"}, {}, "verification.k", "needs a server started with --k auto"),
    ({"tree": "tree:widths=8,8"}, {}, "verification.tree", "72 nodes per block"),
    ({"tree": "drafts:n=2,replacement=0"}, {"temperature": 0}, "verification.tree",
     "at temperature 0 the processed draft is one-hot"),
    ({"tree": "drafts:n=5", "k": 16}, {}, "verification.tree", "80 nodes per block"),
    ({"tree": "tree:widths=2", "rule": "lenience:l=0.5"}, {"logprobs": 1}, "logprobs", "lossy tree rule"),
    ({"tree": "tree:widths=2", "rule": "greedy"}, {"temperature": 0.7}, "verification.rule",
     "rule 'greedy' returns the target's argmax"),
    ({"trees": "tree:widths=2"}, {}, "verification", "known: rule, k, tree"),
    ({"rule": "hsd"}, {}, "verification.rule", "(this server's --tree; send \"tree\": \"none\" for chain"),
]


@pytest.mark.slow
def test_bad_tree_requests_get_a_400_before_the_engine_sees_them(srv, monkeypatch):
    engine = srv.app.state.server.engine
    submitted = []
    real = engine.submit
    monkeypatch.setattr(engine, "submit", lambda jobs: (submitted.append(jobs), real(jobs)))
    with httpx.Client(timeout=30) as client:
        for verification, fields, param, words in BAD:
            body = {"prompt": PROMPT, "max_tokens": 4, "verification": verification, **fields}
            resp = client.post(srv.url + "/v1/completions", json=body)
            assert resp.status_code == 400, (verification, resp.text)
            err = resp.json()["error"]
            assert err["param"] == param and words in err["message"], (verification, err)
    assert submitted == []  # refused while parsing: nothing queued, nothing decoded
    ok = served(srv, seed=1, max_tokens=4, verification={"tree": "tree:widths=2"})
    assert ok.usage.completion_tokens == 4 and len(submitted) == 1 and srv.health()["status"] == "ok"


@pytest.mark.slow
def test_serve_tree_needing_the_models_is_refused_at_start(srv):
    """A width above the vocabulary, a depth over the context: checked once the models load."""
    server = srv.app.state.server
    models = dict(target=server.target, drafter=server.drafter)
    with pytest.raises(ValueError, match=r"--tree tree:widths=5000: tree width 5000 exceeds the vocabulary"):
        Server(ServeConfig(tree="5000", max_tree_nodes=10**4), **models)
    with pytest.raises(ValueError, match="tree depth 3000 exceeds the 2047 positions left in the context"):
        Server(ServeConfig(tree="n=1,depth=3000", max_tree_nodes=10**4), **models)
