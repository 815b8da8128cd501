"""The audit's statistics: does a stream of replies follow the law a sampler claims?
(docs/design/diagnostics.md, 'Auditing an engine').

Each reply brings, at each of its n emitted positions, the claimed law [n, V] (the reference target's
logits, processed by the request's temperature / top-k / top-p / min-p) and the emitted tokens [n]; a
reply that ended at a stop token has it last. Five statistics, each a martingale under the claim, so each
is valid whatever the replies' lengths and however the engine stops (Brockwell 2007; the martingale
central limit theorem):

* `ks`: randomised PIT, Kolmogorov-Smirnov against U(0, 1) (`diagnostics.law_check`);
* `surprise`: sum of -log law(x) - H(law), over its standard deviation (z < 0: a sharpened law);
* `top`: how often the law's most likely token was emitted, against the sum of its probabilities;
* `tail`: how often a token of probability < 0.01 was emitted, against the law's mass on such tokens;
* `stop`: how often a reply ended at a stop token, against the law's stop probability at each position
  (`diagnostics.law_check.stop_residual`, summed over replies).

The effects are stated in words a user reads (e.g. "the top token is emitted 6.1% more often than the
law says, [5.3, 6.9]"). The p-values are Holm-adjusted over the five; the verdict fails when any is below
alpha. Power: at the same positions, tokens drawn from the claimed law at 0.95 T and 1.05 T (a sampler 5%
too cold or hot) go through the same statistics, so "no difference" comes with the bias it would catch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from verispec.diagnostics.law_check import LawCheck, token_statistics
from verispec.evaluation.stats import holm

TAIL = 0.01  # a "tail token": probability under the claimed law below this
STATISTICS = ("ks", "surprise", "top", "tail", "stop")


def _two_sided(z: float) -> float:
    return math.erfc(abs(z) / math.sqrt(2)) if math.isfinite(z) else math.nan


@dataclass
class Counted:
    """A count against its expectation under the claim: observed - expected is a martingale with the
    summed Bernoulli variances (`variance`)."""

    observed: float = 0.0
    expected: float = 0.0
    variance: float = 0.0

    def add(self, hits: Tensor, probabilities: Tensor) -> None:
        """hits [n] (0/1), probabilities [n] (each hit's probability under the claim)."""
        self.observed += float(hits.sum())
        self.expected += float(probabilities.sum())
        self.variance += float((probabilities * (1 - probabilities)).sum())

    def z(self) -> float:
        return (self.observed - self.expected) / math.sqrt(self.variance) if self.variance > 0 else 0.0

    def relative(self) -> tuple[float, float, float]:
        """(observed / expected - 1, its 95% interval): the effect as a share of what the law says."""
        if self.expected <= 0:
            return math.nan, math.nan, math.nan
        half = 1.959964 * math.sqrt(self.variance) / self.expected
        effect = self.observed / self.expected - 1
        return effect, effect - half, effect + half


@dataclass
class Audit:
    """Accumulates replies (`add`); `result()` gives each statistic with its p, the Holm-adjusted p's
    and the verdict at `alpha`."""

    alpha: float = 0.01
    law: LawCheck = field(default_factory=LawCheck)
    top: Counted = field(default_factory=Counted)
    tail: Counted = field(default_factory=Counted)
    stop: Counted = field(default_factory=Counted)
    replies: int = 0
    stopped: int = 0

    def add(self, law: Tensor, tokens: Tensor, stop_ids: list[int], generator: torch.Generator) -> None:
        """law [n, V] (the claimed law at each emitted position, rows summing to 1), tokens [n] (the reply;
        a stop token, if it stopped, last)."""
        if law.ndim != 2 or tokens.shape != law.shape[:1] or len(tokens) == 0:
            raise ValueError(f"need law [n, V] and tokens [n] with n >= 1, got {tuple(law.shape)} and "
                             f"{tuple(tokens.shape)}")
        law = law.to(torch.float64)
        tokens = tokens.long()
        self.law.add(*token_statistics(law.clamp_min(0).log(), tokens, generator))
        chosen = law.gather(-1, tokens[:, None])[:, 0]  # [n]
        best, argmax = law.max(-1)  # [n], [n]
        self.top.add((tokens == argmax).double(), best)
        tail_mass = torch.where(law < TAIL, law, torch.zeros_like(law)).sum(-1)  # [n]
        self.tail.add(((chosen < TAIL) & (chosen > 0)).double(), tail_mass)
        if stop_ids:
            stops = torch.as_tensor(stop_ids, dtype=torch.long)
            stop_mass = law[:, stops].sum(-1).clamp(0, 1)  # [n]
            self.stop.add(torch.isin(tokens, stops).double(), stop_mass)
            self.stopped += int(torch.isin(tokens[-1:], stops).sum())
        self.replies += 1

    def tokens(self) -> int:
        return len(self.law.pits)

    def result(self) -> dict:
        """{"statistics": {name: {"z" or "d", "p", effect...}}, "holm": {name: p}, "conforms": bool, ...}."""
        law = self.law.result()
        stats = {"ks": {"d": law["ks_d"], "p": law["ks_p"]},
                 "surprise": {"z": law["surprise_z"], "p": law["surprise_p"]}}
        for name, counted in (("top", self.top), ("tail", self.tail), ("stop", self.stop)):
            z = counted.z()
            effect, low, high = counted.relative()
            stats[name] = {"z": z, "p": _two_sided(z) if counted.variance > 0 else 1.0,
                           "observed": counted.observed, "expected": counted.expected,
                           "effect": effect, "low": low, "high": high}
        names = [n for n in STATISTICS if math.isfinite(stats[n]["p"])]
        adjusted = holm([stats[n]["p"] for n in names])
        holm_p = dict(zip(names, adjusted))
        return {"replies": self.replies, "tokens": law["tokens"], "off_support": law["off_support"],
                "stopped": self.stopped, "statistics": stats, "holm": holm_p, "alpha": self.alpha,
                "conforms": all(p >= self.alpha for p in holm_p.values()) and law["off_support"] == 0}


def effects_in_words(result: dict) -> list[str]:
    """The effects a user reads, one line each: top token, tail tokens, stops, sharpness."""
    s = result["statistics"]
    lines = []
    for name, what in (("top", "the law's most likely token is emitted"),
                       ("tail", f"tail tokens (probability < {TAIL:g}) are emitted"),
                       ("stop", "replies end at a stop token")):
        e = s[name]
        if not math.isfinite(e["effect"]) or e["expected"] < 5:  # too few expected to read as a share
            continue
        word = "more" if e["effect"] >= 0 else "less"
        lines.append(f"{what} {abs(e['effect']) * 100:.1f}% {word} often than the law says "
                     f"[{e['low'] * 100:+.1f}%, {e['high'] * 100:+.1f}%] (z {e['z']:+.2f})")
    z = s["surprise"]["z"]
    lines.append(f"surprise z {z:+.2f}: " + ("the tokens read sharper than the law (as at a lower "
                                             "temperature)" if z < 0 else "the tokens read flatter than the "
                                             "law (as at a higher temperature)"))
    if result["off_support"]:
        lines.append(f"{result['off_support']} token(s) the law gives probability 0 (outside its support)")
    return lines


def log_likelihood(law: Tensor, tokens: Tensor, floor: float = 1e-12) -> float:
    """Sum over positions of log law(x), a token outside the support counted at `floor` (the best-fit
    search between candidate laws: a truncation that excludes an emitted token is heavily penalised)."""
    chosen = law.to(torch.float64).gather(-1, tokens.long()[:, None])[:, 0]  # [n]
    return float(chosen.clamp_min(floor).log().sum())
