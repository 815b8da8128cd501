"""Verification rules: the catalogue of docs/design.md (section 'The catalogue'), each with its exact
output law. Adding a rule: docs/adding-a-rule.md.

    >>> from verispec.rules import parse, names
    >>> rule = parse("lenience:l=0.5")
    >>> law = rule.emitted(target_probs, draft_probs)      # exact law of the emitted token
    >>> result = rule.verify(p_block, q_block, draft_tokens, generator)
"""

from __future__ import annotations

# Import order is catalogue order (names() lists rules as registered).
from verispec.rules import lossless, greedy, hsd  # noqa: F401  (lossless; hsd is block-level)
from verispec.rules import speccascade, typical, topk, topp, relaxed  # noqa: F401  (truncation)
from verispec.rules import honest  # noqa: F401  (honest truncation baselines)
from verispec.rules import lenience, cos, fuzzy, sglang, fly  # noqa: F401  (collaborative; fly is block-level)
from verispec.rules import budget  # noqa: F401  (bounded by construction)
from verispec.rules.base import BlockLaw, Param, Rule, VerifyResult
from verispec.rules.honest import honest_baseline
from verispec.rules.registry import names, parse, rule_class

__all__ = ["BlockLaw", "Param", "Rule", "VerifyResult", "honest_baseline", "names", "parse", "rule_class"]
