"""When speculation pays: measured pass costs, the expected length of a block, and the choice of k.

Leviathan et al. 2023, sec. 3.4: with a per-position acceptance probability `a` and `k` drafts, a block
emits `E(a, k) = (1 - a^(k+1)) / (1 - a)` tokens in expectation (accepted drafts plus the recovered or
bonus token), and costs `k` draft steps plus one target pass over `k + 1` tokens. Plain decoding emits
one token per one-token target pass. So with measured seconds `D` (one draft step) and `T(m)` (a target
pass over m tokens per row), the seconds per token of a row are

    k = 0:  T(1) + o                      (no drafts: one pass, one token)
    k > 0:  (k * D + T(k + 1) + (2k + 1) o) / E(a, k)

and the best k minimises it (Leviathan et al.'s eq. 3 uses T(k + 1) = T(1), a target pass whose cost
does not grow with its width; on a CPU it does, which is why the passes are measured, not assumed).
`o` is the work a block does per position and row besides the passes (processing a V-sized row of
logits, drawing, the rule's law and the diagnostics): k + 1 target positions and k draft positions a
block. It is measured on real blocks (`decode.position_costs`); left out (0), a pair whose passes are
cheap beside that work looks faster drafting than it is.

In a batch, the rows share passes: a block of B rows costs `max_i k_i` draft steps and one target pass of
width `max_i k_i + 1` at batch size B, and emits `sum_i E(a_i, k_i)` tokens; plain decoding emits B
tokens per one-token pass at batch size B. When the block's tokens per second fall below plain
decoding's, speculation does not pay at that batch size (vLLM turns speculation off above a fixed batch
size, `speculative_disable_by_batch_size`; here the measured costs decide).

A row's acceptance is estimated from its own blocks: each block makes `n` successful acceptance tests
and, when it stops before its last draft, one failed test, so `a = (accepted + 1) / (tests + 2)` (a
uniform prior). A row with few tests explores: it drafts, at the k that pays best at acceptance 1, while
the posterior Beta(accepted + 1, rejected + 1) still gives at least a 5% chance that its acceptance
reaches the break-even one (the lowest at which some k beats plain decoding). This changes only how many
tokens are drafted, never how they are verified: each
token's law given the decoder's state is the rule's, and the decode loop records it as usual.

Exploring costs the most on short requests: a 32-token request that drafts 7 tokens a block until it has
made 8 tests spends a third of its tokens there. A long-lived decoder (the server's) can start each new
row from the acceptance of the rows decoded before it (`AdaptivePolicy.pool_tests`): their accepted and
total tests, scaled to weigh as at most that many tests, are the new row's prior counts, so once the
server has seen the pair at work a new row explores only if the pooled evidence leaves speculation a
chance to pay, and its own tests then take over. Off by default: a row's k then depends on that row alone.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from functools import cached_property

import torch

from verispec.models.base import batch_session
from verispec.sampling import SamplingConfig


@dataclass(frozen=True)
class Costs:
    """Measured seconds per batch size B: `target[B][m - 1]` a target pass over m tokens per row
    (m = 1 .. k_max + 1), `draft[B]` one draft step (one token per row: pass, processing, sampling),
    `position[B]` the other work of a block per position and row (None or a missing size: 0)."""

    target: dict[int, tuple[float, ...]]
    draft: dict[int, float]
    position: dict[int, float] | None = None

    def __post_init__(self) -> None:
        if not self.target or set(self.target) != set(self.draft):
            raise ValueError("costs need the same batch sizes for the target and the draft, at least one")
        for b, o in (self.position or {}).items():
            if b not in self.target or not (math.isfinite(o) and o >= 0):
                raise ValueError(f"the per-position cost at batch size {b} must be finite seconds >= 0 at a "
                                 f"measured batch size, got {o}")
        for b, row in self.target.items():
            if not row or not all(math.isfinite(t) and t > 0 for t in row) or not self.draft[b] >= 0:
                raise ValueError(f"costs at batch size {b} must be positive and finite seconds, got "
                                 f"target {row}, draft {self.draft[b]}")

    @property
    def k_max(self) -> int:
        return min(len(row) for row in self.target.values()) - 1

    def at(self, batch: int) -> int:
        """The measured batch size used for `batch` rows: the largest measured one not above it (else
        the smallest)."""
        sizes = sorted(self.target)
        below = [b for b in sizes if b <= batch]
        return below[-1] if below else sizes[0]

    def other(self, batch: int) -> float:
        """Seconds of a block's other work per position and row at the measured size used for `batch`."""
        return (self.position or {}).get(self.at(batch), 0.0)

    def summary(self) -> dict:
        """c (draft step / one-token target step), v(k) (a (k+1)-token pass / a one-token step) and o (the
        other work per position and row / a one-token step) per measured batch size: the ratios of
        Leviathan et al.'s cost model, with o added."""
        return {str(b): {"c": self.draft[b] / row[0], "v": [t / row[0] for t in row],
                         "o": (self.position or {}).get(b, 0.0) / row[0], "target_step_seconds": row[0]}
                for b, row in sorted(self.target.items())}


def expected_tokens(acceptance: float, k: int) -> float:
    """E(a, k) = (1 - a^(k+1)) / (1 - a): tokens a block of k drafts emits in expectation (k + 1 at a = 1)."""
    if k == 0:
        return 1.0
    if acceptance >= 1.0:
        return float(k + 1)
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


def row_seconds_per_token(costs: Costs, acceptance: float, k: int, batch: int = 1) -> float:
    """Seconds per emitted token of one row with k drafts per block, at batch size `batch`."""
    b = costs.at(batch)
    return ((k * costs.draft[b] + costs.target[b][k] + (2 * k + 1) * costs.other(b))
            / expected_tokens(acceptance, k))


@dataclass(frozen=True)
class AdaptivePolicy:
    """Choose each row's k per block from its acceptance so far (costs at batch size 1, so a row's
    choice does not depend on its neighbours), and, with `by_batch`, turn speculation off for a whole
    block when plain decoding would emit more tokens per second at the batch's size."""

    costs: Costs
    k_max: int
    by_batch: bool = True
    # a row explores (drafts) until it has made this many acceptance tests, where speculation could pay at
    # all (at acceptance 1): a row that never drafts never learns its acceptance, and the prior alone (1/2)
    # could keep it at k = 0 for good. It stops exploring early once its tests make paying implausible
    # (posterior probability below `explore_chance` that its acceptance reaches the break-even one).
    explore: int = 8
    explore_chance: float = 0.05
    # a new row's prior: the rows before it on this decoder, weighed as at most this many tests (0: none)
    pool_tests: int = 0
    # drafting must beat plain decoding's seconds per token by this fraction, on the model's numbers: a
    # hedge against the model's error (`defaults.AUTO_MARGIN` in `generate` and the server; 0 here)
    margin: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.k_max, int) or not 1 <= self.k_max <= self.costs.k_max:
            raise ValueError(f"k_max must be between 1 and the measured {self.costs.k_max}, got {self.k_max}")
        if not isinstance(self.pool_tests, int) or self.pool_tests < 0:
            raise ValueError(f"pool_tests must be an integer >= 0, got {self.pool_tests!r}")
        if not (isinstance(self.margin, (int, float)) and 0 <= self.margin < 10):
            raise ValueError(f"margin must be a fraction >= 0, got {self.margin!r}")

    def _seconds(self, acceptance: float, k: int) -> float:
        """Seconds per token at batch size 1, drafting handicapped by the margin."""
        return row_seconds_per_token(self.costs, acceptance, k) * (1.0 + self.margin if k else 1.0)

    def new_row(self, pool: RowAcceptance | None = None) -> RowAcceptance:
        """A new row's acceptance record: with `pool_tests` and a pool of earlier rows' tests, their counts
        scaled to weigh `pool_tests` tests at most (rounded), as its prior; else the uniform prior alone."""
        if not self.pool_tests or pool is None or pool.tests == 0:
            return RowAcceptance()
        scale = min(1.0, self.pool_tests / pool.tests)
        return RowAcceptance(prior_accepted=round(pool.accepted * scale),
                             prior_tests=round(pool.tests * scale))

    def choose_k(self, acceptance: float, tests: int | None = None, accepted: int | None = None) -> int:
        """The k in 0..k_max with the fewest seconds per token at batch size 1 (ties: the smaller k). While
        the row explores (fewer than `explore` tests, `accepted` of them passed, and a posterior chance of
        at least `explore_chance` that speculation pays), at least `explore_k`: the k that pays best if
        every draft is accepted, the only case exploring is for (a k = 1 block can cost more than the two
        tokens it can emit, and tests one token a block)."""
        best = min(range(self.k_max + 1), key=lambda k: (self._seconds(acceptance, k), k))
        if tests is None or tests >= self.explore or not self.can_pay:
            return best
        if accepted is not None and self.chance_to_pay(accepted, tests) < self.explore_chance:
            return best
        return max(best, self.explore_k)

    # the three below depend on the costs alone: computed once per policy (choose_k runs per row and block)
    @cached_property
    def explore_k(self) -> int:
        """The k > 0 with the fewest seconds per token at acceptance 1 (ties: the smaller k)."""
        return min(range(1, self.k_max + 1), key=lambda k: (row_seconds_per_token(self.costs, 1.0, k), k))

    def beats_plain(self, acceptance: float) -> bool:
        """Whether some k > 0 emits a token in fewer seconds than plain decoding at batch size 1."""
        plain = self._seconds(acceptance, 0)
        return any(self._seconds(acceptance, k) < plain for k in range(1, self.k_max + 1))

    @cached_property
    def can_pay(self) -> bool:
        """Whether speculation beats plain decoding at batch size 1 when every draft is accepted; if not,
        no acceptance makes it pay on these costs and nothing is worth exploring."""
        return self.beats_plain(1.0)

    @cached_property
    def break_even(self) -> float:
        """The lowest acceptance at which some k > 0 beats plain decoding at batch size 1 (bisection; 1.0
        when none does)."""
        if not self.can_pay:
            return 1.0
        low, high = 0.0, 1.0
        for _ in range(40):
            mid = (low + high) / 2
            low, high = (low, mid) if self.beats_plain(mid) else (mid, high)
        return high

    def chance_to_pay(self, accepted: int, tests: int) -> float:
        """P(acceptance > break_even) under the row's posterior Beta(accepted + 1, tests - accepted + 1)
        (the uniform prior of `RowAcceptance.estimate`): for integer parameters, the probability that a
        Binomial(tests + 1, break_even) count is at most `accepted`."""
        n, x = tests + 1, self.break_even
        return sum(math.comb(n, j) * x**j * (1 - x) ** (n - j) for j in range(accepted + 1))

    def pays(self, acceptances: list[float], ks: list[int]) -> bool:
        """Whether a block with these rows' k beats plain decoding's tokens per second at this batch size
        (one row: its own choice at batch-1 costs already weighed that, exploring included)."""
        batch, width = len(ks), max(ks, default=0)
        if width == 0:
            return False
        if batch == 1:
            return True
        b = self.costs.at(batch)
        other = self.costs.other(b)
        block = width * self.costs.draft[b] + self.costs.target[b][width] + other * sum(2 * k + 1 for k in ks)
        tokens = sum(expected_tokens(a, k) for a, k in zip(acceptances, ks))
        return tokens / block > (1.0 + self.margin) * batch / (self.costs.target[b][0] + other * batch)


@dataclass
class RowAcceptance:
    """A row's acceptance tests so far (see the module docstring)."""

    accepted: int = 0
    tests: int = 0
    choices: list[int] = field(default_factory=list)  # the k of each block
    off: int = 0  # blocks where speculation was turned off for the batch
    prior_accepted: int = 0  # counts carried from earlier rows (`AdaptivePolicy.new_row`)
    prior_tests: int = 0

    @property
    def estimate(self) -> float:
        return (self.accepted + self.prior_accepted + 1) / (self.tests + self.prior_tests + 2)

    @property
    def evidence(self) -> tuple[int, int]:
        """(tests, accepted) the row's choices rest on: its own and its prior's."""
        return self.tests + self.prior_tests, self.accepted + self.prior_accepted

    def update(self, proposed: int, accepted: int) -> None:
        self.accepted += accepted
        self.tests += accepted + (1 if accepted < proposed else 0)


def measure_costs(target, drafter, prompt_ids: list[int], k_max: int, batch_sizes: tuple[int, ...] = (1,),
                  repeats: int = 3, sampling: SamplingConfig | None = None) -> Costs:
    """Time the passes of a block on this machine, now: per batch size B, a target pass over m = 1 ..
    k_max + 1 new tokens per row and one draft step, each the median of `repeats` runs after a warm-up,
    on B copies of `prompt_ids` (the prompt itself is fed once, untimed). Pass costs are made
    non-decreasing in the width (a dip below a narrower pass's time is measurement noise)."""
    if not prompt_ids:
        raise ValueError("measure_costs needs a non-empty prompt")
    if not isinstance(k_max, int) or k_max < 1:
        raise ValueError(f"k_max must be an integer >= 1, got {k_max!r}")
    sampling = sampling or SamplingConfig()
    prompt = torch.as_tensor(prompt_ids, dtype=torch.long)  # [L]
    extra = prompt[-1:].repeat(k_max)  # [k_max]: any tokens do; the cost does not depend on their ids
    target_costs, draft_costs = {}, {}
    for b in batch_sizes:
        rows = list(range(b))
        session = batch_session(target)
        session.logits_for(rows, [prompt] * b, [1] * b)  # prefill, untimed
        widths = []
        for m in range(1, k_max + 2):
            seqs = [torch.cat([prompt, extra[: m - 1]])] * b  # the last prompt token + m - 1 more: m fed
            widths.append(_median(lambda: session.logits_for(rows, seqs, [m] * b), repeats))
        # a wider pass never costs less than a narrower one: a measured dip is noise, not a kernel
        widths = [max(widths[: i + 1]) for i in range(len(widths))]
        for row in rows:
            session.release(row)
        drafter.start_batch()
        generators = [torch.Generator().manual_seed(i) for i in rows]
        contexts, ones = [prompt] * b, [1] * b
        drafter.propose_batch(rows, contexts, ones, sampling, generators)  # prefill
        step = _median(lambda: drafter.propose_batch(rows, contexts, ones, sampling, generators), repeats)
        for row in rows:
            drafter.release(row)
        target_costs[b], draft_costs[b] = tuple(widths), step
    return Costs(target_costs, draft_costs)


def _median(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]
