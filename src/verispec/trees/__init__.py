"""Token trees and multi-draft verification: pure maths, the layer of `verispec.rules`
(docs/design.md, sections 'Trees' and 'Layering').

    >>> from verispec.trees import parse_shape, topk_tree, parse_tree_rule, verify_tree, block_law
    >>> tree = topk_tree(parse_shape("tree:widths=2,1"), draft_fn)   # draft_fn(paths) -> [n, V]
    >>> law = block_law(parse_tree_rule("lossless"), tree, target_probs)  # exact law of one block
"""

from __future__ import annotations

from verispec.trees.rules import (FrontierLaw, TreeRule, TreeVerifyResult, block_law, parse_tree_rule,
                                  step_laws, tree_rule_names, verify_tree)
from verispec.trees.structure import (DraftShape, DynamicTree, MultiDraft, TokenTree, TreeGrowth, TreeWidths,
                                      chain_tree, check_depth, dynamic_tree, grow, growth, parse_shape,
                                      sample_chains, topk_tree)
from verispec.trees.traversal import traversal_block_law, traversal_verify

__all__ = ["DraftShape", "DynamicTree", "FrontierLaw", "MultiDraft", "TokenTree", "TreeGrowth", "TreeRule",
           "TreeVerifyResult", "TreeWidths", "block_law", "chain_tree", "check_depth", "dynamic_tree", "grow",
           "growth", "parse_shape", "parse_tree_rule",
           "sample_chains", "step_laws", "topk_tree", "traversal_block_law", "traversal_verify",
           "tree_rule_names", "verify_tree"]
