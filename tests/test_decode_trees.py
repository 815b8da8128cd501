"""Tree and multi-draft blocks in the decode engine (`DecodeConfig.tree`, verispec.tree_decode).

- toy pair (TabularModel, V = 3, tests/test_decode_toy.py): the generated stream of lossless tree
  decoding (top-k trees, i.i.d. and distinct multi-drafts, Traversal) follows the target's sequence law,
  and a lossy tree rule follows its own exact law (each block's `block_law` composed over the block
  structure, enumerated here) and not the target's (power), by chi-square with fixed seeds;
- rows in a batch equal the same rows alone (same generators), exactly on the toy pair and on the
  default pair (one tree-attention pass for all rows vs one per row: float rounding only, which did not
  move a sampled token here);
- greedy tree verification equals plain greedy decoding token for token on the default pair;
- bad input is refused before any forward pass.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from stats import chisquare_pvalue
from streams import joint_law
from verispec.decode import BatchDecoder, DecodeConfig, autoregressive_decode, decode_prompts
from verispec.models import ModelDrafter, NGramDrafter, TabularModel
from verispec.rules import parse
from verispec.sampling import SamplingConfig
from verispec.speculation import AdaptivePolicy, Costs
from verispec.tree_decode import TreeScorer, draft_tree, draft_trees
from test_decode_toy import V, law_fn, one_thread, toy_pair  # noqa: F401 (one_thread: autouse)
from verispec.trees import (DynamicTree, TreeWidths, block_law, dynamic_tree, grow, growth, parse_tree_rule,
                            topk_tree)

RUNS = 2000  # the toy pair, its exact laws and the one-thread fixture are test_decode_toy's


def topk_stream_law(spec: str, target, draft, prompt: list[int], shape: tuple[int, ...] | DynamicTree,
                    length: int) -> dict:
    """Exact law of the first `length` tokens of deterministic tree decoding: per block, the tree the
    draft's top-k (widths) or EAGLE-2 expansion (a `DynamicTree`) gives after the prefix (cut to
    `remaining - 1` levels, as the engine does), the rule's exact `block_law` on it, composed over blocks
    (float64 throughout)."""
    shape = shape if isinstance(shape, DynamicTree) else TreeWidths(shape)
    rule = parse_tree_rule(spec)
    p_fn, q_fn = law_fn(target, prompt), law_fn(draft, prompt)
    out: dict[tuple[int, ...], float] = {}

    def walk(prefix: tuple[int, ...], weight: float) -> None:
        remaining = length - len(prefix)
        if remaining <= 0:
            out[prefix[:length]] = out.get(prefix[:length], 0.0) + weight
            return
        if remaining > 1:
            tree = grow(growth(shape, remaining - 1),
                        lambda paths: torch.tensor(np.stack([q_fn(prefix + p) for p in paths])))
            target_probs = torch.tensor(np.stack([p_fn(prefix + tree.path(n)) for n in range(tree.size + 1)]))
            law = block_law(rule, tree, target_probs)
        else:  # no room to draft: one token from the target (every rule's bonus law but greedy's)
            p = p_fn(prefix)
            law = {(t,): float(p[t]) for t in range(V)} if spec != "greedy" else {(int(p.argmax()),): 1.0}
        for block, pr in law.items():
            if pr > 0:
                walk(prefix + block, weight * pr)

    walk((), 1.0)
    return out


def as_vector(law: dict, length: int) -> np.ndarray:
    vec = np.zeros(V**length)
    for seq, pr in law.items():
        vec[int(np.ravel_multi_index(seq, (V,) * length))] += pr
    return vec


def same_steps(a: dict, b: dict) -> bool:
    """Every diagnostic field equal, NaN matching NaN."""
    return a.keys() == b.keys() and all(
        len(a[k]) == len(b[k]) and all(x == y or (isinstance(x, float) and math.isnan(x) and math.isnan(y))
                                       for x, y in zip(a[k], b[k])) for k in a)


def sample_counts(target, draft, spec: str, shape: str, prompt: list[int], length: int,
                  seed: int) -> np.ndarray:
    config = DecodeConfig(k=length - 1, max_new_tokens=length, diagnostics=False, tree=shape)
    decoder = BatchDecoder(target, ModelDrafter(draft), spec, config)
    gen = torch.Generator().manual_seed(seed)
    counts = np.zeros(V**length)
    for _ in range(RUNS):
        row = decoder.add(prompt, gen)
        done = {}
        while row not in done:
            done.update(decoder.step())
        ids = done[row].token_ids
        assert len(ids) == length
        counts[int(np.ravel_multi_index(ids, (V,) * length))] += 1
    return counts


LOSSLESS = [("lossless", "tree:widths=2,1"), ("traversal", "tree:widths=2,2"), ("lossless", "drafts:n=2"),
            ("traversal", "drafts:n=2,replacement=0"), ("lossless", "tree:nodes=3,depth=2,topk=2")]
ALPHA = 1e-4 / (2 * (len(LOSSLESS) + 2))


@pytest.mark.slow
@pytest.mark.parametrize("spec,shape", LOSSLESS)
def test_lossless_tree_decoding_follows_the_target_law(spec, shape):
    target, draft = toy_pair()
    prompt, length = [1], 3
    counts = sample_counts(target, draft, spec, shape, prompt, length, seed=11)
    truth = as_vector(joint_law(law_fn(target, prompt), V, length), length)
    assert chisquare_pvalue(counts, truth) > ALPHA


@pytest.mark.slow
@pytest.mark.parametrize("spec,shape", [("lenience:l=0.3", (2, 1)), ("speccascade:min_p=0.5", (2, 1)),
                                        ("lenience:l=0.3", DynamicTree(3, 2, 2))])
def test_lossy_tree_rule_follows_its_exact_law_not_the_target(spec, shape):
    """The power check: a lossy tree rule's stream is told apart from the target's law."""
    target, draft = toy_pair()
    prompt, length = [1], 3
    law = as_vector(topk_stream_law(spec, target, draft, prompt, shape, length), length)
    truth = as_vector(joint_law(law_fn(target, prompt), V, length), length)
    assert abs(law.sum() - 1) < 1e-12
    shift = np.abs(law - truth).sum() / 2
    assert shift > 0.05, shift  # the case does exercise power
    text = shape.spec if isinstance(shape, DynamicTree) else TreeWidths(shape).spec
    counts = sample_counts(target, draft, spec, text, prompt, length, seed=12)
    assert chisquare_pvalue(counts, law) > ALPHA
    assert chisquare_pvalue(counts, truth) < ALPHA


def test_exact_stream_law_of_lossless_is_the_target():
    """The enumerator above against itself: lossless (and lenience at l = 1) on top-k trees compose to
    the target's law exactly."""
    target, draft = toy_pair()
    truth = as_vector(joint_law(law_fn(target, [2]), V, 3), 3)
    for spec in ("lossless", "lenience:l=1"):
        for shape in ((2, 1), DynamicTree(3, 2, 2)):
            law = as_vector(topk_stream_law(spec, target, draft, [2], shape, 3), 3)
            np.testing.assert_allclose(law, truth, rtol=0, atol=1e-12)


def test_engine_tree_is_the_topk_tree_of_the_draft():
    """The engine's drafting builds `topk_tree` of the draft's own distribution after the context,
    whatever the sampling settings: per row (`draft_tree`) and for all rows together (`draft_trees`)."""
    target, draft = toy_pair()
    scorer = TreeScorer(draft)
    context = torch.tensor([1, 2, 0])
    tree = draft_tree(scorer, 0, context, TreeWidths((2, 2)), 2, SamplingConfig(), None, V)
    q_fn = law_fn(draft, context.tolist())
    want = topk_tree((2, 2), lambda paths: torch.tensor(np.stack([q_fn(p) for p in paths])).float())
    assert torch.equal(tree.tokens, want.tokens) and torch.equal(tree.parents, want.parents)
    torch.testing.assert_close(tree.draft_probs, want.draft_probs, rtol=0, atol=1e-6)
    greedy = draft_tree(scorer, 0, context, TreeWidths((2, 2)), 2, SamplingConfig(temperature=0), None, V)
    assert torch.equal(greedy.tokens, want.tokens)  # ranked by the draft's own law, not the one-hot one
    others = [torch.tensor([0, 0]), torch.tensor([2, 1, 1, 0])]  # batched: rows of other depths
    trees, passes = draft_trees(TreeScorer(draft), [0, 1, 2], [context, *others], TreeWidths((2, 2)),
                                [2, 1, 0], SamplingConfig(temperature=0), [None] * 3, V)
    assert passes == [2, 1, 0] and [t.depth for t in trees] == [2, 1, 0]
    for got, ctx, depth in zip(trees, [context, *others], [2, 1, 0]):
        alone = draft_tree(TreeScorer(draft), 0, ctx, TreeWidths((2, 2)), depth, SamplingConfig(), None, V)
        assert torch.equal(got.tokens, alone.tokens) and torch.equal(got.parents, alone.parents)
        torch.testing.assert_close(got.draft_probs, alone.draft_probs, rtol=0, atol=1e-6)
    cut = draft_tree(scorer, 0, context, TreeWidths((2, 2)), 1, SamplingConfig(), None, V)
    assert cut.depth == 1 and cut.size == 2
    assert draft_tree(scorer, 0, context, TreeWidths((2, 2)), 0, SamplingConfig(), None, V).size == 0


def test_engine_dynamic_tree_is_eagle2s_tree_of_the_draft():
    """EAGLE-2 trees in the engine: `dynamic_tree` of the draft's own law after the context, alone and
    for rows together (each draft pass scoring only the nodes to expand and their ancestors), cut to the
    depth left."""
    target, draft = toy_pair()
    shape = DynamicTree(5, 3, 2)
    contexts = [torch.tensor([1, 2, 0]), torch.tensor([0, 0]), torch.tensor([2, 1, 1, 0])]
    trees, passes = draft_trees(TreeScorer(draft), [0, 1, 2], contexts, shape, [3, 2, 0],
                                SamplingConfig(temperature=0.5), [None] * 3, V)
    assert passes == [3, 2, 0]
    for got, ctx, depth in zip(trees, contexts, [3, 2, 0]):
        q_fn = law_fn(draft, ctx.tolist())
        draft_fn = lambda paths: torch.tensor(np.stack([q_fn(p) for p in paths])).float()  # noqa: E731
        want = grow(growth(shape, depth), draft_fn, vocab=V)
        assert torch.equal(got.tokens, want.tokens) and torch.equal(got.parents, want.parents)
        torch.testing.assert_close(got.draft_probs, want.draft_probs, rtol=0, atol=1e-6)
        alone = draft_tree(TreeScorer(draft), 0, ctx, shape, depth, SamplingConfig(), None, V)
        assert torch.equal(got.tokens, alone.tokens) and torch.equal(got.parents, alone.parents)
    assert trees[0].size == 5 and trees[1].size == 5 and trees[2].size == 0
    q_fn = law_fn(draft, [1, 2, 0])
    full = dynamic_tree(shape, lambda paths: torch.tensor(np.stack([q_fn(p) for p in paths])))
    assert torch.equal(trees[0].tokens, full.tokens)


@pytest.mark.parametrize("spec,shape", [
    ("lossless", "tree:widths=2,1"), ("lenience:l=0.5", "tree:widths=3,1"),
    ("traversal", "drafts:n=2,depth=2"), ("budget:tv=0.1", "tree:widths=2"),
    ("speccascade:min_p=0.3", "tree:nodes=4,depth=3,topk=2")])
def test_toy_rows_in_a_batch_equal_rows_alone(spec, shape):
    target, draft = toy_pair()
    prompts = [[1], [0, 2, 1], [2, 2]]
    config = DecodeConfig(k=3, max_new_tokens=9, tree=shape)
    batched = decode_prompts(target, prompts, [torch.Generator().manual_seed(i) for i in range(3)], config,
                             ModelDrafter(draft), spec)
    for i, prompt in enumerate(prompts):
        [alone] = decode_prompts(target, [prompt], [torch.Generator().manual_seed(i)], config,
                                 ModelDrafter(draft), spec)
        assert batched[i].token_ids == alone.token_ids
        assert batched[i].blocks == alone.blocks
        assert same_steps(batched[i].steps, alone.steps)
        assert len(alone.steps["tv"]) == alone.num_tokens == 9
        assert sum(b.emitted for b in alone.blocks) == 9


def test_toy_diagnostics_and_report():
    target, draft = toy_pair()
    gen = torch.Generator().manual_seed(3)
    config = DecodeConfig(max_new_tokens=12, tree="tree:widths=2,1", stop_at_eos=False)
    [lossless] = decode_prompts(target, [[1]], [gen], config, ModelDrafter(draft), "lossless")
    [lossy] = decode_prompts(target, [[1]], [gen], config, ModelDrafter(draft), "lenience:l=0.3")
    report = lossless.stats()["verification"]
    assert report["tree"] == "tree:widths=2,1" and report["lossless"] and report["rule"] == "lossless"
    assert report["mean_tv"] == 0 and report["max_overshoot"] == 1 and report["log_ratio"] == 0
    assert [p["position"] for p in report["acceptance_per_position"]] == [1, 2]  # per depth
    assert all(b.proposed <= 4 and b.depth <= 2 for b in lossless.blocks)
    bad = lossy.stats()["verification"]
    assert not bad["lossless"] and bad["mean_tv"] > 0 and bad["max_overshoot"] > 1
    roles = lossy.steps["role"]
    assert set(roles) <= {"accepted", "recovered", "bonus"}
    assert roles.count("accepted") == sum(b.accepted for b in lossy.blocks)
    assert math.isfinite(lossy.log_ratio) and lossy.log_ratio != 0


def test_toy_greedy_tree_equals_plain_greedy():
    target, draft = toy_pair()
    for prompt in ([1], [0, 2], [2, 1, 1]):
        plain = autoregressive_decode(target, prompt, DecodeConfig(max_new_tokens=10,
                                                                   sampling=SamplingConfig(temperature=0)))
        for shape in ("tree:widths=2,1", "tree:widths=1,1,1", "tree:nodes=5,depth=3,topk=2"):
            config = DecodeConfig(max_new_tokens=10, tree=shape)
            [tree] = decode_prompts(target, [prompt], [torch.Generator().manual_seed(0)], config,
                                    ModelDrafter(draft), "greedy")
            assert tree.token_ids == plain.token_ids


def test_bad_input_is_refused_before_any_forward_pass():
    target, draft = toy_pair()
    drafter = ModelDrafter(draft)
    cases = [
        (dict(tree="tree:widths=4,1"), "lossless", drafter, "tree width 4 exceeds the vocabulary"),
        (dict(tree="tree:widths=2"), parse("lossless"), drafter, "is a chain rule"),
        (dict(tree="tree:widths=2"), "lossless", NGramDrafter(2, V), "needs a model drafter"),
        (dict(tree="tree:widths=2"), "lossless", None, "needs a model drafter"),
        (dict(tree="drafts:n=2"), "lenience:l=0.5", drafter, "lossy on sampled drafts"),
        (dict(tree="tree:widths=2"), "nosuch", drafter, "unknown tree rule"),
        (dict(), "traversal", drafter, "is a tree rule"),
        (dict(), parse_tree_rule("lossless"), drafter, "is a tree rule"),
    ]
    for kwargs, rule, d, message in cases:
        with pytest.raises(ValueError, match=message):
            BatchDecoder(target, d, rule, DecodeConfig(**kwargs))
    for shape, message in (("tree:widths=2,0", "widths must be one or more integers >= 1"),
                           ("tree:widths=", "integers >= 1"), ("drafts:n=0", "out of range")):
        with pytest.raises(ValueError, match=message):
            DecodeConfig(tree=shape)
    costs = Costs(target={1: (1.0, 1.0)}, draft={1: 0.1})
    with pytest.raises(ValueError, match="does not apply to tree drafts"):
        DecodeConfig(tree="tree:widths=2", policy=AdaptivePolicy(costs, k_max=1))
    assert target.calls == 0 and draft.calls == 0
    short = TabularModel.random(V, order=2, seed=3, max_context=20)
    config = DecodeConfig(max_new_tokens=2, tree="tree:widths=1,1,1,1")
    decoder = BatchDecoder(short, drafter, "lossless", config)
    with pytest.raises(ValueError, match="tree depth 4 exceeds the 3 positions left in the context"):
        decoder.add([0] * 17, torch.Generator())
    assert decoder.active == [] and short.calls == 0
    with pytest.raises(ValueError, match="prompt 1: tree depth 4 exceeds"):
        decode_prompts(short, [[1], [0] * 17], [None, None], config, drafter, "lossless")
    assert short.calls == 0 and draft.calls == 0


# ---------------------------------------------------------------------------------------------
# the default pair (lean backend: one tree-attention pass per block for all rows)


@pytest.fixture(scope="module")
def pair():
    from verispec.models import load_drafter, load_model

    target = load_model("default")
    return target, load_drafter("default-draft", target)


@pytest.fixture(scope="module")
def suite_prompts(pair):
    from verispec.evaluation.suites import load_suite

    target, _ = pair
    return [target.encode(item.prompt) for item in load_suite("shakespeare").items[:4]]


def test_default_pair_greedy_tree_equals_plain_greedy(pair, suite_prompts):
    """Tree rule `greedy` at temperature 1 (real trees of the draft's top-k) against plain greedy
    decoding of the target; both take argmax of float32 logits, so ties within rounding could flip a
    token: the prompts here have none (any difference would show as a failed equality)."""
    target, drafter = pair
    greedy = DecodeConfig(max_new_tokens=16, sampling=SamplingConfig(temperature=0), stop_at_eos=False)
    plain = decode_prompts(target, suite_prompts[:2], [None, None], greedy)
    config = DecodeConfig(max_new_tokens=16, stop_at_eos=False, tree="tree:widths=3,2,1")
    tree = decode_prompts(target, suite_prompts[:2], [torch.Generator().manual_seed(i) for i in range(2)],
                          config, drafter, "greedy")
    for a, b in zip(tree, plain):
        assert a.token_ids == b.token_ids
        assert a.target_calls < b.target_calls  # the tree accepted something


@pytest.mark.slow
def test_default_pair_greedy_tree_rules_equal_plain_greedy(pair, suite_prompts):
    """At temperature 0 every lossless pairing (top-k trees, multi-drafts, Traversal) is greedy decoding."""
    target, drafter = pair
    greedy = DecodeConfig(max_new_tokens=40, sampling=SamplingConfig(temperature=0), stop_at_eos=False)
    plain = decode_prompts(target, suite_prompts, [None] * 4, greedy)
    for shape, spec in (("tree:widths=4,2,2,1", "lossless"), ("tree:widths=2,2", "traversal"),
                        ("drafts:n=2,depth=3", "lossless"), ("tree:nodes=8,depth=4,topk=3", "lossless")):
        config = DecodeConfig(max_new_tokens=40, sampling=SamplingConfig(temperature=0), stop_at_eos=False,
                              tree=shape)
        outs = decode_prompts(target, suite_prompts, [torch.Generator().manual_seed(i) for i in range(4)],
                              config, drafter, spec)
        assert [o.token_ids for o in outs] == [p.token_ids for p in plain], (shape, spec)


@pytest.mark.slow
@pytest.mark.parametrize("spec,shape", [("lossless", "tree:widths=3,2,1"),
                                        ("lenience:l=0.5", "tree:widths=2,2"),
                                        ("typical:eps=0.2", "tree:nodes=6,depth=3,topk=2")])
def test_default_pair_rows_in_a_batch_equal_rows_alone(pair, suite_prompts, spec, shape):
    """Sampled at temperature 1: the same tokens and block structure alone and in a batch of rows with
    different prompt lengths (their tree passes differ by float rounding only, tests/test_lean_tree.py)."""
    target, drafter = pair
    config = DecodeConfig(max_new_tokens=20, stop_at_eos=False, tree=shape)
    prompts = suite_prompts[:3]
    gens = [torch.Generator().manual_seed(10 + i) for i in range(3)]
    batched = decode_prompts(target, prompts, gens, config, drafter, spec)
    for i, prompt in enumerate(prompts):
        gen = torch.Generator().manual_seed(10 + i)
        [alone] = decode_prompts(target, [prompt], [gen], config, drafter, spec)
        assert batched[i].token_ids == alone.token_ids
        assert batched[i].blocks == alone.blocks
        np.testing.assert_allclose(batched[i].steps["log_law"], alone.steps["log_law"], rtol=0, atol=1e-4)


def test_toy_stop_token_and_length_limit_in_tree_blocks():
    target, draft = toy_pair()
    target.eos_token_id = 2
    gen = torch.Generator().manual_seed(0)
    config = DecodeConfig(k=3, max_new_tokens=6, tree="tree:widths=2,2")
    for _ in range(30):
        [out] = decode_prompts(target, [[1]], [gen], config, ModelDrafter(draft), "lossless")
        ids = list(out.token_ids)
        assert len(ids) <= 6
        if 2 in ids:
            assert ids.index(2) == len(ids) - 1 and out.finish == "eos"
        else:
            assert len(ids) == 6 and out.finish == "length"
        assert sum(b.emitted for b in out.blocks) == len(ids) == len(out.steps["tv"])
