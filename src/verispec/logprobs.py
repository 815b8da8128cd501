"""Per-token log-probabilities of a generation, with the law each token was actually drawn from
(docs/design.md, 'Log-probabilities and importance weights'): `verispec run --json`, `GenerateResult.
to_json` and `verispec serve`'s `logprobs` (verispec.serving.logprobs formats them as OpenAI's).

For every token `x_t`: `logprob` = log p_t(x_t) under the processed target (the sampling settings
applied: the law lossless decoding draws from), `behaviour_logprob` = log law_t(x_t), the exact law
the rule drew it from given the decoder's state (its committed tokens and their roles:
`emitted(p_t, q_t)` at a draft position, the bonus law at a bonus position, p_t in plain decoding),
`raw_logprob` under the raw model, and the token's `role` (accepted, recovered, bonus, plain). The
sums give the importance weight of the tokens against the target: exp(sum logprob - sum
behaviour_logprob) = exp(-log_ratio).
"""

from __future__ import annotations

import math

import torch

from verispec.decode import Generation


def token_logprobs(gen: Generation, returned: int, top: int = 0, decode=None) -> list[dict]:
    """One entry per returned token (the first `returned` of `gen.token_ids`): token_id, token (its
    text, with `decode`), logprob, behaviour_logprob, raw_logprob, role, and with `top` > 0
    `top` = [(token_id, logprob), ...], the most likely tokens under the processed target (needs
    `gen.probs`: decode with keep_probs). ValueError without the per-token record (diagnostics off)."""
    steps = gen.steps
    if steps is None:
        raise ValueError("no per-token record: decoded with diagnostics off")
    rows = torch.cat(gen.probs["target"])[:returned].double() if top else None  # [returned, V]
    if rows is not None:
        rows = rows / rows.sum(-1, keepdim=True)  # [returned, V]; float32 rows sum to 1 within ~1e-6
        values, ids = rows.topk(min(top, rows.shape[-1]), dim=-1)  # [returned, top] each
    out = []
    for i in range(returned):
        token = gen.token_ids[i]
        entry = {"token_id": token, "logprob": float(steps["log_target"][i]),
                 "behaviour_logprob": float(steps["log_law"][i]),
                 "raw_logprob": float(steps["log_target_raw"][i]), "role": steps["role"][i]}
        if decode is not None:
            entry["token"] = decode([token])
        if rows is not None:
            entry["top"] = [(int(t), math.log(v) if v > 0 else -math.inf)
                            for v, t in zip(values[i].tolist(), ids[i].tolist())]
        out.append(entry)
    return out


def totals(entries: list[dict]) -> dict:
    """The sequence sums: target and behaviour log-probabilities of the returned tokens, and the log
    importance weight of the response against the target (their difference)."""
    target = math.fsum(e["logprob"] for e in entries)
    behaviour = math.fsum(e["behaviour_logprob"] for e in entries)
    return {"sum_logprob": target, "sum_behaviour_logprob": behaviour,
            "log_importance_weight": target - behaviour if math.isfinite(target - behaviour) else None}


