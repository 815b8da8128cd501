"""Per-token log-probabilities of a response (`logprobs` / `top_logprobs`), with the law each token
was actually drawn from (docs/design.md, 'Log-probabilities and importance weights').

For every returned token `x_t`: `logprob` = log p_t(x_t) under the processed target (the sampling
settings applied: the law lossless decoding draws from), `behaviour_logprob` = log law_t(x_t), the
exact law the rule drew it from given the decoder's state (its committed tokens and their roles:
`emitted(p_t, q_t)` at a draft position, the bonus law at a bonus position, p_t in plain decoding),
`raw_logprob` under the raw model, and the token's `role` (accepted, recovered, bonus, plain). The
sums give the importance weight of the response against the target: exp(sum logprob - sum
behaviour_logprob) = exp(-log_ratio).
"""

from __future__ import annotations

import math

import torch

from verispec.decode import Generation

MAX_TOP_LOGPROBS = 20


def token_logprobs(gen: Generation, returned: int, top: int, decode) -> list[dict]:
    """One entry per returned token (the first `returned` of `gen.token_ids`): token_id, token (its
    text), logprob, behaviour_logprob, raw_logprob, role, and `top` = [(token_id, logprob), ...], the
    `top` most likely tokens under the processed target (needs `gen.probs`: decode with keep_probs)."""
    steps = gen.steps
    if steps is None:
        raise ValueError("this response has no per-token record (the server runs with --no-diagnostics)")
    rows = torch.cat(gen.probs["target"])[:returned].double() if top else None  # [returned, V]
    if rows is not None:
        rows = rows / rows.sum(-1, keepdim=True)  # [returned, V]; float32 rows sum to 1 within ~1e-6
        values, ids = rows.topk(min(top, rows.shape[-1]), dim=-1)  # [returned, top] each
    out = []
    for i in range(returned):
        token = gen.token_ids[i]
        entry = {"token_id": token, "token": decode([token]), "logprob": float(steps["log_target"][i]),
                 "behaviour_logprob": float(steps["log_law"][i]),
                 "raw_logprob": float(steps["log_target_raw"][i]), "role": steps["role"][i]}
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


def completion_logprobs(entries: list[dict], decode) -> dict:
    """The legacy completions shape (tokens, token_logprobs, top_logprobs, text_offset) plus verispec's
    behaviour_logprobs, raw_logprobs, token_roles and the sequence totals."""
    offsets, at = [], 0
    for e in entries:
        offsets.append(at)
        at += len(e["token"])
    tops = [{decode([t]): lp for t, lp in e["top"]} for e in entries] if entries and "top" in entries[0] \
        else None
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": tops, "text_offset": offsets,
            "behaviour_logprobs": [e["behaviour_logprob"] for e in entries],
            "raw_logprobs": [e["raw_logprob"] for e in entries], "token_roles": [e["role"] for e in entries],
            **totals(entries)}


def chat_logprobs(entries: list[dict], decode) -> dict:
    """The chat shape (content: one object per token, with its top_logprobs) plus verispec's fields."""
    def item(token: str, logprob: float) -> dict:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8", "replace"))}

    content = [{**item(e["token"], e["logprob"]), "behaviour_logprob": e["behaviour_logprob"],
                "raw_logprob": e["raw_logprob"], "token_role": e["role"],
                "top_logprobs": [item(decode([t]), lp) for t, lp in e.get("top", [])]} for e in entries]
    return {"content": content, **totals(entries)}
