"""Whether emitted tokens follow a claimed law, tested on the tokens alone (docs/design/diagnostics.md,
'Checking a sampler on real models').

A sampler that claims x_t ~ law_t given x_<t (lossless speculative decoding claims law_t = the processed
target, Leviathan et al. 2023, Theorem 1) can be checked on its output with two statistics per token:

* randomised probability integral transform: u_t = F_t(x_t - 1) + v_t * law_t(x_t), F_t the cumulative law
  in token-id order and v_t ~ U(0, 1) independent. Under the claim each u_t is U(0, 1) given everything
  before it, so u_1, u_2, ... are i.i.d. U(0, 1) whatever the stopping rule (Brockwell 2007, "Universal
  residuals"); a Kolmogorov-Smirnov test against U(0, 1) applies;
* surprise: s_t = -log law_t(x_t) - H(law_t) has mean zero given the past and variance
  Var_t = E[(log law_t)^2] - H^2; z = sum s_t / sqrt(sum Var_t) is standard normal in large samples (the
  martingale central limit theorem). A sampler that sharpens the law (as at T < 1) gives z < 0, one that
  flattens it z > 0.

A third statistic checks when replies end: the stop residual of a reply, the stop tokens it emitted
minus the sum over its positions of law_t(stop) (`stop_residual`). Under the claim each position adds a
term of mean zero given the past, so the residual is a martingale stopped at the reply's end (a stop or
the length cap), and by optional stopping its mean over replies is 0: a sampler that ends replies too
late reads below 0, one that ends them too early above.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor


def token_statistics(log_law: Tensor, tokens: Tensor, generator: torch.Generator
                     ) -> tuple[Tensor, Tensor, Tensor]:
    """log_law [n, V] (log-probabilities, each row a law), tokens [n] -> (pit [n], surprise [n],
    surprise variance [n]), float64; v_t drawn from `generator`. A token the law gives probability 0
    (outside its support: a truncated law whose boundary moved with rounding, or a false claim) gets
    NaN in all three; `LawCheck` counts those apart."""
    if log_law.ndim != 2 or tokens.shape != log_law.shape[:1]:
        raise ValueError(f"need log_law [n, V] and tokens [n], got {tuple(log_law.shape)} and "
                         f"{tuple(tokens.shape)}")
    log_law = log_law.to(torch.float64)
    law = log_law.exp()  # [n, V]
    picked = tokens.long()[:, None]  # [n, 1]
    chosen = law.gather(-1, picked)[:, 0]  # [n]
    below = law.cumsum(-1).gather(-1, picked)[:, 0] - chosen  # [n]: F(x - 1)
    pit = (below + torch.rand(len(tokens), generator=generator, dtype=torch.float64) * chosen).clamp(0.0, 1.0)
    safe = torch.where(law > 0, log_law, torch.zeros_like(log_law))  # [n, V]: 0 * log 0 = 0
    entropy = -(law * safe).sum(-1)  # [n]
    variance = ((law * safe.square()).sum(-1) - entropy.square()).clamp_min(0.0)  # [n]
    surprise = -log_law.gather(-1, picked)[:, 0] - entropy  # [n]
    off = chosen <= 0  # [n]
    nan = torch.full_like(pit, math.nan)
    return torch.where(off, nan, pit), torch.where(off, nan, surprise), torch.where(off, nan, variance)


@dataclass
class LawCheck:
    """Accumulates rows' `token_statistics` (one `add` per row); `result()` gives the two tests."""

    pits: list[float] = field(default_factory=list)
    first_pits: list[float] = field(default_factory=list)
    surprise: float = 0.0
    variance: float = 0.0
    rows: int = 0
    off_support: int = 0  # tokens the claimed law gives probability 0 (left out of both tests)

    def add(self, pit: Tensor, surprise: Tensor, variance: Tensor) -> None:
        on = ~pit.isnan()  # [n]
        self.off_support += int((~on).sum())
        self.pits += pit[on].tolist()
        if bool(on[0]):
            self.first_pits.append(float(pit[0]))
        self.surprise += float(surprise[on].sum())
        self.variance += float(variance[on].sum())
        self.rows += 1

    def result(self) -> dict:
        """KS statistic and p of all PITs and of each row's first token, and the surprise z with its
        two-sided p."""
        if not self.pits:
            raise ValueError("no tokens checked")
        d, p = ks_uniform(self.pits)
        z = self.surprise / math.sqrt(self.variance) if self.variance > 0 else 0.0
        return {"rows": self.rows, "tokens": len(self.pits), "off_support": self.off_support, "ks_d": d,
                "ks_p": p, "first_ks_p": ks_uniform(self.first_pits)[1], "surprise_z": z,
                "surprise_p": math.erfc(abs(z) / math.sqrt(2))}


def stop_residual(log_law: Tensor, tokens: Tensor, stop_ids: list[int] | Tensor) -> float:
    """log_law [n, V] (the claimed law at each of a reply's n positions), tokens [n] (the reply, its stop
    token last if it stopped) -> the stop tokens among `tokens` minus the sum over positions of the
    claimed probability of a stop token (module docstring; mean 0 over replies under the claim)."""
    if log_law.ndim != 2 or tokens.shape != log_law.shape[:1]:
        raise ValueError(f"need log_law [n, V] and tokens [n], got {tuple(log_law.shape)} and "
                         f"{tuple(tokens.shape)}")
    stops = torch.as_tensor(stop_ids, dtype=torch.long)  # [S]
    if stops.numel() == 0:
        raise ValueError("no stop ids: a reply can only end at the length cap, so there is no residual")
    stop_mass = float(log_law.to(torch.float64)[:, stops].exp().sum())  # sum_t law_t(any stop token)
    return float(torch.isin(tokens.long(), stops).sum()) - stop_mass


def ks_uniform(values: list[float]) -> tuple[float, float]:
    """One-sample Kolmogorov-Smirnov test against U(0, 1): (D, asymptotic p), the p from Kolmogorov's
    limit law at Stephens' (1970) corrected statistic (sqrt(n) + 0.12 + 0.11 / sqrt(n)) * D: within 0.02 of
    the exact p from n = 20 on, and within 15% of it below 0.05 (the tests compare it with scipy's)."""
    n = len(values)
    if n == 0:
        raise ValueError("KS test of no values")
    u = torch.tensor(sorted(values), dtype=torch.float64)  # [n]
    ranks = torch.arange(1, n + 1, dtype=torch.float64)  # [n]
    d = float(torch.maximum(ranks / n - u, u - (ranks - 1) / n).max())
    lam = (math.sqrt(n) + 0.12 + 0.11 / math.sqrt(n)) * d
    if lam < 0.2:
        return d, 1.0
    p = 2 * sum((-1) ** (k - 1) * math.exp(-2 * k * k * lam * lam) for k in range(1, 101))
    return d, min(1.0, max(0.0, p))
