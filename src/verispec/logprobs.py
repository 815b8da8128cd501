"""Per-token log-probabilities of a generation, with the law each token was actually drawn from
(docs/design/diagnostics.md, 'Log-probabilities and importance weights'): `verispec run --json`,
`GenerateResult.to_json` and `verispec serve`'s `logprobs` (verispec.serving.logprobs formats them as
OpenAI's).

For every token `x_t`: `processed_logprob` = log p_t(x_t) under the processed target (the sampling
settings applied: the law lossless decoding draws from), `behaviour_logprob` = log law_t(x_t), the exact
law the rule drew it from given the decoder's state (its committed tokens and their roles:
`emitted(p_t, q_t)` at a draft position, the bonus law at a bonus position, p_t in plain decoding),
`raw_logprob` under the raw model, and the token's `role` (accepted, recovered, bonus, plain). The
sums give the importance weight of the tokens against the target: exp(sum processed_logprob - sum
behaviour_logprob) = exp(-log_ratio).

`logprob` (and `top`) is what OpenAI's fields show, chosen by the mode (vLLM's `logprobs_mode`, whose
default is the raw model's): `raw_logprobs` (log softmax of the model's logits), `processed_logprobs`
(the processed target), `raw_logits` (the logits themselves) or `processed_logits` (the logits divided
by the temperature, -inf outside the processed law's support; at temperature 0 the logits, -inf but at
the argmax).

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


MODES = ("raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits")


def _window(blocks: list[torch.Tensor], start: int, end: int) -> torch.Tensor:
    """Rows start..end of per-block row tensors taken as one sequence, copying only the blocks that hold
    them (a streamed chunk reads its own tokens' rows, not every row so far)."""
    out, at = [], 0
    for block in blocks:  # [n_b, V]
        low, high = max(start - at, 0), min(end - at, block.shape[0])
        if low < high:
            out.append(block[low:high])
        at += block.shape[0]
        if at >= end:
            break
    return torch.cat(out) if out else blocks[0][:0]  # [end - start, V]


def _mode_rows(gen: Generation, start: int, end: int, mode: str, temperature: float) -> torch.Tensor:
    """[end - start, V] float64: the values `mode` shows for every token of returned positions start..end."""
    if mode == "processed_logprobs":
        rows = _window(gen.probs["target"], start, end).double()  # [n, V]
        return (rows / rows.sum(-1, keepdim=True)).log()  # float32 rows sum to 1 within ~1e-6
    logits = _window(gen.probs["raw"], start, end).double()  # [n, V]
    if mode == "raw_logprobs":
        return logits.log_softmax(-1)
    if mode == "raw_logits":
        return logits
    support = _window(gen.probs["target"], start, end) > 0  # [n, V]
    scaled = logits / temperature if temperature > 0 else logits
    return scaled.masked_fill(~support, -math.inf)


def _token_value(gen: Generation, i: int, mode: str, temperature: float) -> float:
    """The value `mode` shows for returned token i, from the per-token record alone (no V-sized rows):
    the logits modes read `gen.token_logits` (decode with keep_token_logits)."""
    steps = gen.steps
    if mode == "processed_logprobs":
        return float(steps["log_target"][i])
    if mode == "raw_logprobs":
        return float(steps["log_target_raw"][i])
    if gen.token_logits is None:
        raise ValueError(f"{mode} needs the tokens' logits: decode with keep_token_logits (or keep_probs)")
    logit = float(gen.token_logits[i])
    if mode == "raw_logits":
        return logit
    if steps["log_target"][i] == -math.inf:  # outside the processed law's support
        return -math.inf
    return logit / temperature if temperature > 0 else logit


def token_logprobs(gen: Generation, returned: int, top: int = 0, decode=None,
                   mode: str = "processed_logprobs", temperature: float = 1.0, start: int = 0) -> list[dict]:
    """One entry per returned token (tokens `start` to `returned` of `gen.token_ids`): token_id, token
    (its text, with `decode`), logprob (the value `mode` shows, see MODES), processed_logprob,
    behaviour_logprob, raw_logprob, role, and with `top` > 0 `top` = [(token_id, value), ...], the
    tokens with the largest values under the mode (the token's logprob read from the same float64 row,
    so a token that is the top one equals its value exactly), and `top_behaviour` = the most likely
    tokens under the token's behaviour law (`behaviour_rows`). `top` needs `gen.probs` (decode with
    keep_probs); the logits modes `gen.token_logits` (keep_token_logits) or those rows; `temperature` is
    the request's (processed_logits). Only the window's rows are read. ValueError without the per-token
    record (diagnostics off) or for an unknown mode."""
    if mode not in MODES:
        raise ValueError(f"logprobs mode must be one of {', '.join(MODES)}, got {mode!r}")
    steps = gen.steps
    if steps is None:
        raise ValueError("no per-token record: decoded with diagnostics off")
    logits_mode = mode in ("raw_logits", "processed_logits")
    rows = (_mode_rows(gen, start, returned, mode, temperature)  # [n, V]
            if top or (logits_mode and gen.token_logits is None and gen.probs is not None) else None)
    if top:
        values, ids = rows.topk(min(top, rows.shape[-1]), dim=-1)  # [n, top] each
        law_values, law_ids = behaviour_rows(gen, returned, start).topk(min(top, rows.shape[-1]), dim=-1)
    out = []
    for i in range(start, returned):
        token, j = gen.token_ids[i], i - start
        entry = {"token_id": token,
                 "logprob": float(rows[j, token]) if rows is not None else _token_value(gen, i, mode,
                                                                                        temperature),
                 "processed_logprob": float(steps["log_target"][i]),
                 "behaviour_logprob": float(steps["log_law"][i]),
                 "raw_logprob": float(steps["log_target_raw"][i]), "role": steps["role"][i]}
        if decode is not None:
            entry["token"] = decode([token])
        if top:
            entry["top"] = [(int(t), v) for v, t in zip(values[j].tolist(), ids[j].tolist())]
            entry["top_behaviour"] = [(int(t), math.log(v) if v > 0 else -math.inf)
                                      for v, t in zip(law_values[j].tolist(), law_ids[j].tolist())]
        out.append(entry)
    return out


def behaviour_rows(gen: Generation, returned: int, start: int = 0) -> torch.Tensor:
    """The full behaviour law of returned tokens start..returned, [returned - start, V] float64: the law
    the rule drew the token from given the decoder's state (docs/design/rules.md, 'Rule anatomy'):
    `rule.emitted_law(p, q)` at a draft position (role accepted or recovered), `rule.bonus_law(p)` at a
    bonus position, p itself for a lossless rule or plain decoding. The same laws as
    `verispec.diagnostics.shift.position_stats`, whose value at the token is `steps["log_law"]`.
    Needs `gen.probs` (keep_probs) and `gen.steps` (diagnostics)."""
    if gen.probs is None or gen.steps is None:
        raise ValueError("the behaviour law needs the decoder's rows and per-token record: decode with "
                         "keep_probs and diagnostics on")
    p = renormalised_f64(_window(gen.probs["target"], start, returned))  # [n, V]
    rule = gen.rule
    if rule is None or rule.lossless:
        return p
    q_parts, at = [], 0
    for p_block, q_block in zip(gen.probs["target"], gen.probs["draft"]):  # per block: [n_b, V], [m, V]
        n_b = p_block.shape[0]
        low, high = max(start - at, 0), min(returned - at, n_b)
        if low < high:  # a block the window reaches: its drafted rows, zeros at its bonus position
            q_block = q_block[:n_b]  # [min(m, n_b), V]: the drafted positions kept
            pad = p_block.new_zeros((n_b - q_block.shape[0], p_block.shape[1]))  # [n_b - m, V]
            q_parts.append(torch.cat([q_block, pad])[low:high])  # [high - low, V]
        at += n_b
        if at >= returned:
            break
    q = torch.cat(q_parts) if q_parts else p.new_zeros((0, p.shape[1]))  # [n, V]
    drafted = torch.tensor([r in DRAFTED for r in gen.steps["role"][start:returned]], dtype=torch.bool)
    law = torch.empty_like(p)  # [n, V]
    if drafted.any():
        law[drafted] = rule.emitted_law(p[drafted], renormalised_f64(q[drafted]))
    if not drafted.all():
        law[~drafted] = rule.bonus_law(p[~drafted])
    return law


def prompt_logprobs(model, prompt_ids: list[int], top: int = 0, decode=None,
                    mode: str = "raw_logprobs") -> list[dict]:
    """One entry per prompt token, in `token_logprobs`'s shape, from one pass of `model` over the
    prompt: `raw_logprob` = log softmax of the raw model's logits at the previous position (None for
    the first token: nothing predicts it, OpenAI's null); `logprob` the same, or the logit itself in
    the logits modes (a prompt token was not sampled, so no sampling setting applies to it: processed =
    raw); `processed_logprob` and `behaviour_logprob` None; `role` "prompt"; with `top` > 0 `top` = the
    `top` largest values of the same row (None for the first token). The token's value and the top
    values are read from the same float64 row, so a token that is the argmax equals the top value
    exactly (lm-eval's `is_greedy` compares them with ==)."""
    if mode not in MODES:
        raise ValueError(f"logprobs mode must be one of {', '.join(MODES)}, got {mode!r}")
    ids = torch.tensor([list(prompt_ids)], dtype=torch.long)  # [1, L]
    with torch.no_grad():
        logits = model.session().logits_for(ids, ids.shape[1])[0]  # [L, V]: row i predicts token i + 1
    raw = torch.log_softmax(logits[:-1].double(), dim=-1)  # [L - 1, V]: row i - 1 scores token i
    rows = logits[:-1].double() if mode.endswith("logits") else raw  # [L - 1, V]
    if top:
        values, tops = rows.topk(min(top, rows.shape[-1]), dim=-1)  # [L - 1, top] each
    out = []
    for i, token in enumerate(prompt_ids):
        entry = {"token_id": token, "logprob": None if i == 0 else float(rows[i - 1, token]),
                 "processed_logprob": None, "behaviour_logprob": None,
                 "raw_logprob": None if i == 0 else float(raw[i - 1, token]), "role": "prompt"}
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
    target = math.fsum(e["processed_logprob"] for e in entries)
    behaviour = math.fsum(e["behaviour_logprob"] for e in entries)
    return {"sum_logprob": target, "sum_behaviour_logprob": behaviour,
            "log_importance_weight": target - behaviour if math.isfinite(target - behaviour) else None}


