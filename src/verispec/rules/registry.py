"""The rule registry and spec-string parsing: `NAME[:key=value,...]` (the grammar of `verispec.spec`)."""

from __future__ import annotations

from dataclasses import MISSING, fields

from verispec.rules.base import Rule
from verispec.spec import Registry, parse_params, split

RULES: Registry[type[Rule]] = Registry("rule")


def register(cls: type[Rule]) -> type[Rule]:
    """Class decorator: make a rule addressable by its `name`."""
    return RULES.add(cls.name, cls)


def names() -> list[str]:
    """Names of every registered rule, in catalogue order."""
    return RULES.names()


def rule_class(name: str) -> type[Rule]:
    return RULES.get(name)


def parse(spec: str) -> Rule:
    """Build a rule from its spec string, e.g. `lenience:l=0.5` or `typical:eps=0.09,alpha=0.3`.

    Raises ValueError naming the rule, the key and the allowed range on any bad input.
    """
    name, args = split(spec, "rule", "lenience:l=0.5")
    cls = rule_class(name)
    if cls.name == "honest":  # wraps a whole rule spec: honest:<truncation rule spec>
        if not args:
            raise ValueError("rule 'honest' needs a truncation rule to wrap, "
                             "e.g. honest:speccascade:min_p=0.1")
        if split(args, "rule", "speccascade:min_p=0.1")[0] == "honest":  # before recursing: no depth limit
            raise ValueError("rule 'honest' wraps a truncation rule, not another honest rule "
                             f"(got {spec.strip()[:60]!r}...); e.g. honest:speccascade:min_p=0.1")
        return cls(inner=parse(args))
    required = tuple(f.name for f in fields(cls) if f.default is MISSING)
    return cls(**parse_params("rule", cls.name, args, cls.params, required))
