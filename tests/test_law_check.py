"""The token-level law check (`verispec.diagnostics.law_check`): exact samples pass, a sharpened or
flattened sampler fails, the KS p-value agrees with scipy's, and the stop residual has mean 0 under the
law."""

from __future__ import annotations

import math

import pytest
import torch
from scipy import stats

from verispec.diagnostics.law_check import LawCheck, ks_uniform, stop_residual, token_statistics


def _laws(n: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    logits = 3.0 * torch.randn(n, vocab, generator=g, dtype=torch.float64)  # [n, V]: peaked, like a model
    logits[:, : vocab // 4] = -torch.inf  # zeros in the law
    return logits.log_softmax(-1)


def _check(log_law: torch.Tensor, sample_temperature: float, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    drawn = torch.multinomial((log_law / sample_temperature).softmax(-1), 1, generator=g)[:, 0]  # [n]
    check = LawCheck()
    for rows in zip(log_law.split(100), drawn.split(100)):  # 100-token "rows"
        check.add(*token_statistics(*rows, g))
    return check.result()


def test_exact_samples_pass_and_a_tempered_sampler_fails() -> None:
    log_law = _laws(6000, 64, 0)
    exact = _check(log_law, 1.0, 1)
    assert exact["tokens"] == 6000 and exact["rows"] == 60
    assert exact["ks_p"] > 0.01 and abs(exact["surprise_z"]) < 3
    # power: T = 0.9 and T = 1.1 samplers, a 10% temperature error, are caught by the surprise z
    sharp, flat = _check(log_law, 0.9, 1), _check(log_law, 1.1, 1)
    assert sharp["surprise_z"] < -5 and sharp["surprise_p"] < 1e-6
    assert flat["surprise_z"] > 5 and flat["surprise_p"] < 1e-6


def test_a_shifted_sampler_fails_the_pit() -> None:
    """Tokens from a law that moves mass between tokens without changing its entropy much: the PIT sees
    it (a permutation of two adjacent tokens' probabilities keeps the entropy exactly)."""
    log_law = _laws(6000, 64, 2)
    law = log_law.exp()
    swapped = law.clone()
    top = law.argmax(-1)  # [n]
    nxt = (top + 1).clamp_max(63)
    swapped[torch.arange(6000), top], swapped[torch.arange(6000), nxt] = law[torch.arange(6000), nxt], \
        law[torch.arange(6000), top]
    g = torch.Generator().manual_seed(3)
    drawn = torch.multinomial(swapped, 1, generator=g)[:, 0]  # [n]
    check = LawCheck()
    check.add(*token_statistics(log_law, drawn, g))
    assert check.result()["ks_p"] < 1e-6


@pytest.mark.parametrize("n", [20, 300, 5000])
def test_ks_p_matches_scipy(n: int) -> None:
    g = torch.Generator().manual_seed(n)
    for power in (1.0, 1.15):  # uniform, and a skewed sample with a small p at the larger n
        values = (torch.rand(n, generator=g, dtype=torch.float64) ** power).tolist()
        d, p = ks_uniform(values)
        ref = stats.kstest(values, "uniform")  # exact p where scipy computes it (n <= 10000)
        assert d == pytest.approx(ref.statistic, abs=1e-12)
        assert p == pytest.approx(ref.pvalue, abs=0.02, rel=0.15 if ref.pvalue < 0.05 else 0)


def test_pit_is_uniform_given_the_token() -> None:
    """The randomised PIT of token x lies in [F(x - 1), F(x)]."""
    log_law = torch.tensor([[0.5, 0.25, 0.25]]).log().repeat(3, 1)  # [3, 3]
    tokens = torch.tensor([0, 1, 2])
    pit, surprise, variance = token_statistics(log_law, tokens, torch.Generator().manual_seed(0))
    assert 0 <= pit[0] <= 0.5 and 0.5 <= pit[1] <= 0.75 and 0.75 <= pit[2] <= 1
    ln2 = math.log(2)
    entropy = 1.5 * ln2
    assert surprise.tolist() == pytest.approx([ln2 - entropy, 2 * ln2 - entropy, 2 * ln2 - entropy])
    # E[(log law)^2] - H^2 = (0.5 + 0.5 * 4) ln2^2 - 2.25 ln2^2
    assert variance.tolist() == pytest.approx([0.25 * ln2**2] * 3)


def test_a_token_the_law_forbids_is_counted_apart() -> None:
    log_law = torch.tensor([[1.0, 0.0], [0.5, 0.5]]).log()
    pit, surprise, variance = token_statistics(log_law, torch.tensor([1, 1]), torch.Generator())
    assert pit[0].isnan() and surprise[0].isnan() and variance[0].isnan() and 0.5 <= pit[1] <= 1
    check = LawCheck()
    check.add(pit, surprise, variance)
    assert check.off_support == 1 and len(check.pits) == 1 and check.first_pits == []


def _replies(broken: float, seed: int, count: int = 3000, cap: int = 20) -> list[float]:
    """Stop residuals of `count` replies from a Markov chain over 8 tokens (0 and 1 stop) capped at
    `cap` tokens. `broken` is the chance that a drawn stop token is thrown away and another drawn from
    the non-stop tokens (a sampler that ends replies too late); 0 samples the claimed law exactly."""
    g = torch.Generator().manual_seed(seed)
    logits = 2.0 * torch.randn(8, 8, generator=g, dtype=torch.float64)  # [prev, next]
    logits[:, :2] -= 1.5  # stop tokens less likely: replies of about 5-15 tokens, some at the cap
    log_law = logits.log_softmax(-1)  # [8, 8]
    out = []
    for _ in range(count):
        prev, tokens = 2, []
        while len(tokens) < cap:
            token = int(torch.multinomial(log_law[prev].exp(), 1, generator=g))
            if token < 2 and float(torch.rand((), generator=g, dtype=torch.float64)) < broken:
                token = 2 + int(torch.multinomial(log_law[prev, 2:].exp(), 1, generator=g))
            tokens.append(token)
            if token < 2:
                break
            prev = token
        previous = torch.tensor([2, *tokens[:-1]])  # [n]: the token each position's law depends on
        out.append(stop_residual(log_law[previous], torch.tensor(tokens), [0, 1]))
    return out


def test_stop_residual_has_mean_zero_under_the_law_and_catches_late_stops() -> None:
    """Optional stopping: the residual of replies sampled from the claimed law (stopped by a stop
    token or by the cap) has mean 0; a sampler that throws away 30% of its stop tokens reads below 0
    (power: it reads about -0.22 a reply with a standard error near 0.014 at 3,000 replies, t near -15;
    the exact sampler's t is -1.0 at this seed)."""
    def t_stat(values: list[float]) -> float:
        x = torch.tensor(values, dtype=torch.float64)
        return float(x.mean() / (x.std() / math.sqrt(len(x))))

    exact = _replies(0.0, 5)
    assert any(r > 0 for r in exact) and any(r < 0 for r in exact)
    assert abs(t_stat(exact)) < 3.5, t_stat(exact)
    late = _replies(0.3, 5)
    assert t_stat(late) < -8 and sum(late) / len(late) < -0.1, (t_stat(late), sum(late) / len(late))


def test_stop_residual_by_hand_and_bad_input() -> None:
    log_law = torch.tensor([[0.1, 0.2, 0.7], [0.5, 0.25, 0.25]]).log()  # [2, 3]: token 0 stops
    assert stop_residual(log_law, torch.tensor([2, 0]), [0]) == pytest.approx(1 - 0.6)
    assert stop_residual(log_law, torch.tensor([2, 1]), [0, 1]) == pytest.approx(1 - 0.3 - 0.75)
    with pytest.raises(ValueError, match="no stop ids"):
        stop_residual(log_law, torch.tensor([2, 0]), [])
    with pytest.raises(ValueError, match=r"log_law \[n, V\]"):
        stop_residual(log_law, torch.tensor([2]), [0])
