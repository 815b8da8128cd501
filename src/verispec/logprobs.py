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

`prompt_logprobs` scores a prompt's own tokens (OpenAI's `echo` with `logprobs`, what lm-eval's
`loglikelihood` reads): one target pass over the prompt, the raw model's log-probabilities (a prompt
token was not sampled, so no sampling setting applies to it, and it has no behaviour law).
"""

from __future__ import annotations

import math

import torch

from verispec.decode import Generation
from verispec.probability import renormalised_f64

DRAFTED = ("accepted", "recovered")  # the roles of a token emitted at a draft position


def token_logprobs(gen: Generation, returned: int, top: int = 0, decode=None) -> list[dict]:
    """One entry per returned token (the first `returned` of `gen.token_ids`): token_id, token (its
    text, with `decode`), logprob, behaviour_logprob, raw_logprob, role, and with `top` > 0
    `top` = [(token_id, logprob), ...], the most likely tokens under the processed target, and
    `top_behaviour` = the same under the token's behaviour law (`behaviour_rows`) (both need
    `gen.probs`: decode with keep_probs). ValueError without the per-token record (diagnostics off)."""
    steps = gen.steps
    if steps is None:
        raise ValueError("no per-token record: decoded with diagnostics off")
    rows = torch.cat(gen.probs["target"])[:returned].double() if top else None  # [returned, V]
    if rows is not None:
        rows = rows / rows.sum(-1, keepdim=True)  # [returned, V]; float32 rows sum to 1 within ~1e-6
        values, ids = rows.topk(min(top, rows.shape[-1]), dim=-1)  # [returned, top] each
        law_values, law_ids = behaviour_rows(gen, returned).topk(min(top, rows.shape[-1]), dim=-1)
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
            entry["top_behaviour"] = [(int(t), math.log(v) if v > 0 else -math.inf)
                                      for v, t in zip(law_values[i].tolist(), law_ids[i].tolist())]
        out.append(entry)
    return out


def behaviour_rows(gen: Generation, returned: int) -> torch.Tensor:
    """The full behaviour law of each of the first `returned` tokens, [returned, V] float64: the law the
    rule drew the token from given the decoder's state (docs/design.md, 'Rule anatomy'):
    `rule.emitted_law(p, q)` at a draft position (role accepted or recovered), `rule.bonus_law(p)` at a
    bonus position, p itself for a lossless rule or plain decoding. The same laws as
    `verispec.diagnostics.shift.position_stats`, whose value at the token is `steps["log_law"]`.
    Needs `gen.probs` (keep_probs) and `gen.steps` (diagnostics)."""
    if gen.probs is None or gen.steps is None:
        raise ValueError("the behaviour law needs the decoder's rows and per-token record: decode with "
                         "keep_probs and diagnostics on")
    q_blocks = []
    for p_block, q_block in zip(gen.probs["target"], gen.probs["draft"]):  # per block: [n, V], [m, V]
        q_block = q_block[: p_block.shape[0]]  # [min(m, n), V]: the drafted positions kept
        pad = p_block.new_zeros((p_block.shape[0] - q_block.shape[0], p_block.shape[1]))  # [n - m, V]
        q_blocks.append(torch.cat([q_block, pad]))  # [n, V]
    p = renormalised_f64(torch.cat(gen.probs["target"])[:returned])  # [returned, V]
    rule = gen.rule
    if rule is None or rule.lossless:
        return p
    q = torch.cat(q_blocks)[:returned]  # [returned, V]; zero rows at bonus positions
    drafted = torch.tensor([r in DRAFTED for r in gen.steps["role"][:returned]], dtype=torch.bool)
    law = torch.empty_like(p)  # [returned, V]
    if drafted.any():
        law[drafted] = rule.emitted_law(p[drafted], renormalised_f64(q[drafted]))
    if not drafted.all():
        law[~drafted] = rule.bonus_law(p[~drafted])
    return law


def prompt_logprobs(model, prompt_ids: list[int], top: int = 0, decode=None) -> list[dict]:
    """One entry per prompt token, in `token_logprobs`'s shape, from one pass of `model` over the
    prompt: `logprob` = `raw_logprob` = log softmax of the raw model's logits at the previous position
    (None for the first token: nothing predicts it, OpenAI's null), `behaviour_logprob` None (the token
    was not sampled), `role` "prompt", and with `top` > 0 `top` = the `top` most likely tokens under
    the same law (None for the first token). The token's log-probability and the top values are read
    from the same float64 row, so a token that is the argmax equals the top value exactly (lm-eval's
    `is_greedy` compares them with ==)."""
    ids = torch.tensor([list(prompt_ids)], dtype=torch.long)  # [1, L]
    with torch.no_grad():
        logits = model.session().logits_for(ids, ids.shape[1])[0]  # [L, V]: row i predicts token i + 1
    rows = torch.log_softmax(logits[:-1].double(), dim=-1)  # [L - 1, V]: row i - 1 scores token i
    if top:
        values, tops = rows.topk(min(top, rows.shape[-1]), dim=-1)  # [L - 1, top] each
    out = []
    for i, token in enumerate(prompt_ids):
        logprob = None if i == 0 else float(rows[i - 1, token])
        entry = {"token_id": token, "logprob": logprob, "behaviour_logprob": None, "raw_logprob": logprob,
                 "role": "prompt"}
        if decode is not None:
            entry["token"] = decode([token])
        if top:
            entry["top"] = None if i == 0 else list(zip(tops[i - 1].tolist(), values[i - 1].tolist()))
        out.append(entry)
    return out


def totals(entries: list[dict]) -> dict:
    """The sequence sums: target and behaviour log-probabilities of the returned tokens, and the log
    importance weight of the response against the target (their difference). Prompt entries (echo)
    are left out: they were not sampled."""
    entries = [e for e in entries if e["role"] != "prompt"]
    target = math.fsum(e["logprob"] for e in entries)
    behaviour = math.fsum(e["behaviour_logprob"] for e in entries)
    return {"sum_logprob": target, "sum_behaviour_logprob": behaviour,
            "log_importance_weight": target - behaviour if math.isfinite(target - behaviour) else None}


