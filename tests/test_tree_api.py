"""Tree drafts through the API, the CLI's shape spellings and the sweep grid (no model loads here)."""

from __future__ import annotations

import hashlib
import json

import pytest

from verispec.api import draft_shape, generate
from verispec.cli import shape_spec
from verispec.evaluation.suites import Item
from verispec.evaluation.store import SCHEMA_VERSION
from verispec.evaluation.sweep import PLAIN, RunConfig, SweepSpec, unit_key
from verispec.models import TabularModel
from verispec.trees import DynamicTree, MultiDraft, TreeWidths


def test_shape_spellings():
    assert draft_shape(tree="4,2,2,1") == TreeWidths((4, 2, 2, 1))
    assert draft_shape(tree="widths=4,2") == draft_shape(tree="tree:widths=4,2") == TreeWidths((4, 2))
    assert draft_shape(drafts="n=3") == draft_shape(drafts="drafts:n=3") == MultiDraft(3)
    assert draft_shape(tree="nodes=16,depth=5,topk=4") == draft_shape(tree="tree:nodes=16,depth=5,topk=4") \
        == DynamicTree(16, 5, 4)
    assert shape_spec("topk=2,nodes=3,depth=2") == "tree:nodes=3,depth=2,topk=2"
    assert draft_shape() is None
    assert shape_spec("widths=3,1") == "tree:widths=3,1"
    assert shape_spec("n=2,depth=3") == "drafts:n=2,replacement=1,depth=3"
    with pytest.raises(ValueError, match="not both"):
        draft_shape(tree="2", drafts="n=2")
    with pytest.raises(TypeError, match="tree must be a str"):
        draft_shape(tree=[2, 1])


@pytest.mark.parametrize("kwargs,message", [
    (dict(tree="2,0"), "widths must be one or more integers >= 1"),
    (dict(tree="2", rule="hsd"), "unknown tree rule 'hsd'"),
    (dict(tree="2", draft=None), "needs a draft model"),
    (dict(drafts="n=2", rule="lenience:l=0.5"), "lossy on sampled drafts"),
    (dict(drafts="n=2", k=0), "k .* must be an integer >= 1"),
    (dict(tree="2", k=3), "has its own depth .* leave k out"),
])
def test_generate_refuses_bad_tree_input_before_any_model_loads(kwargs, message):
    """The target names no model: a refusal here happened before any load was tried."""
    args = dict(target="no-such-model", draft="no-such-draft", rule="lossless")
    with pytest.raises(ValueError, match=message):
        generate([1, 2], **{**args, **kwargs})


def test_generate_with_a_tree_on_toy_models():
    target = TabularModel.random(3, order=2, seed=1, name="toy-target")
    draft = TabularModel.random(3, order=1, seed=2, name="toy-draft")
    target.decode = lambda ids: " ".join(map(str, ids))  # the response text of a table model
    args = dict(target=target, draft=draft, rule="traversal", tree="2,1", max_new_tokens=10, seed=4)
    out = generate([1, 2], **args)
    v = out.stats["verification"]
    assert v["tree"] == "tree:widths=2,1" and v["rule"] == "traversal" and v["lossless"]
    assert len(out.token_ids) == 10 and v["drafted_tokens"] == sum(b.proposed for b in out.generation.blocks)
    again = generate([1, 2], **args)
    assert again.token_ids == out.token_ids
    chain = generate([1, 2], target=target, draft=draft, max_new_tokens=10, seed=4)
    assert chain.stats["verification"]["tree"] is None
    multi = generate([1, 2], target=target, draft=draft, drafts="n=2", k=2, max_new_tokens=6, seed=1)
    assert multi.stats["verification"]["tree"] == "drafts:n=2,replacement=1"
    assert all(b.proposed <= 4 for b in multi.generation.blocks)


def test_sweep_grid_with_trees():
    spec = SweepSpec(rules=("lenience:l=0.5", "traversal", "hsd"), ks=(3, 5),
                     trees=("tree:widths=2,1", "drafts:n=2"))
    trees = [(c.rule, c.tree, c.k) for c in spec.configs() if c.tree]
    multi = "drafts:n=2,replacement=1"
    assert trees == [("lossless", "tree:widths=2,1", 2), ("lenience:l=0.5", "tree:widths=2,1", 2),
                     ("traversal", "tree:widths=2,1", 2), ("lossless", multi, 3), ("traversal", multi, 3),
                     ("lossless", multi, 5), ("traversal", multi, 5)]
    chains = [c for c in spec.configs() if not c.tree]
    assert {c.rule for c in chains} == {PLAIN, "lossless", "lenience:l=0.5", "hsd"}
    with pytest.raises(ValueError, match="traversal' verifies trees"):
        SweepSpec(rules=("traversal",)).configs()
    with pytest.raises(ValueError, match="widths"):
        SweepSpec(trees=("tree:widths=0",)).configs()
    dynamic = SweepSpec(rules=("lenience:l=0.5",), ks=(3, 5), trees=("tree:nodes=4,depth=3,topk=2",))
    dynamic = dynamic.configs()
    assert [(c.rule, c.k) for c in dynamic if c.tree] == [("lossless", 3), ("lenience:l=0.5", 3)]  # own depth


def test_unit_keys_include_the_tree_and_keep_chain_keys():
    spec, item = SweepSpec(), Item(id="p0", prompt="x")
    chain = RunConfig("lossless", 2, 1.0)
    before = json.dumps([SCHEMA_VERSION, spec.suite, spec.target, spec.draft, item.id, 0, chain.id,
                         spec.max_new_tokens, spec.dtype, spec.draft_dtype, spec.device, spec.backend])
    assert unit_key(spec, item, 0, chain) == hashlib.sha1(before.encode()).hexdigest()[:16]  # unchanged
    a = unit_key(spec, item, 0, RunConfig("lossless", 2, 1.0, "tree:widths=2,1"))
    b = unit_key(spec, item, 0, RunConfig("lossless", 2, 1.0, "tree:widths=1,1"))
    assert len({a, b, unit_key(spec, item, 0, chain)}) == 3
    assert RunConfig("lossless", 2, 1.0, "tree:widths=2,1").id == "lossless tree:widths=2,1 k=2 T=1"
