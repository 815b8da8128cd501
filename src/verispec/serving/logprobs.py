"""OpenAI's `logprobs` shapes for `verispec serve` (completions and chat), from the per-token record of
`verispec.logprobs.token_logprobs`, plus verispec's behaviour log-probabilities, roles and sums
(docs/design/diagnostics.md, 'Log-probabilities and importance weights')."""

from __future__ import annotations

from verispec.logprobs import totals

MAX_TOP_LOGPROBS = 20
FLOOR = -9999.0  # vLLM's number for a log-probability of -inf: the fields stay numbers for typed clients


def numbers_only(obj):
    """-inf log-probabilities (a token the processed law rules out) as FLOOR, recursively, as vLLM writes
    them; every other value as it is."""
    if isinstance(obj, float) and obj == float("-inf"):
        return FLOOR
    if isinstance(obj, dict):
        return {k: numbers_only(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [numbers_only(v) for v in obj]
    return obj


def completion_logprobs(entries: list[dict], decode, offset: int = 0, sums: bool = True) -> dict:
    """The legacy completions shape (tokens, token_logprobs, top_logprobs, text_offset) plus verispec's
    processed_logprobs, behaviour_logprobs, top_behaviour_logprobs (the most likely tokens under each
    token's behaviour law, `verispec.logprobs.behaviour_rows`), raw_logprobs, token_roles and (`sums`)
    the sequence totals. With `echo` the prompt's entries (`verispec.logprobs.prompt_logprobs`, role
    "prompt", behaviour_logprob null) come first; the first token's token_logprobs and top_logprobs are
    null (OpenAI's). `offset`: the text_offset of the first entry (a streamed chunk's place in the
    text)."""
    offsets, at = [], offset
    for e in entries:
        offsets.append(at)
        at += len(e["token"])
    tops = [None if e["top"] is None else {decode([t]): lp for t, lp in e["top"]} for e in entries] \
        if entries and "top" in entries[-1] else None  # an echoed prompt's first token has none (null)
    behaviour_tops = [None if e.get("top_behaviour") is None else
                      {decode([t]): lp for t, lp in e["top_behaviour"]} for e in entries] if tops else None
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": tops, "text_offset": offsets, "top_behaviour_logprobs": behaviour_tops,
            "processed_logprobs": [e["processed_logprob"] for e in entries],
            "behaviour_logprobs": [e["behaviour_logprob"] for e in entries],
            "raw_logprobs": [e["raw_logprob"] for e in entries], "token_roles": [e["role"] for e in entries],
            **(totals(entries) if sums else {})}


def chat_logprobs(entries: list[dict], decode, sums: bool = True) -> dict:
    """The chat shape (content: one object per token, with its top_logprobs) plus verispec's fields
    (processed_logprob, behaviour_logprob, raw_logprob, token_role; top_behaviour_logprobs: the top
    tokens under the token's behaviour law) and (`sums`) the sequence totals."""
    def item(token: str, logprob: float) -> dict:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8", "replace"))}

    content = [{**item(e["token"], e["logprob"]), "processed_logprob": e["processed_logprob"],
                "behaviour_logprob": e["behaviour_logprob"], "raw_logprob": e["raw_logprob"],
                "token_role": e["role"],
                "top_logprobs": [item(decode([t]), lp) for t, lp in e.get("top", [])],
                "top_behaviour_logprobs": [item(decode([t]), lp) for t, lp in e.get("top_behaviour", [])]}
               for e in entries]
    return {"content": content, **(totals(entries) if sums else {})}
