"""JSON Schemas of what `verispec serve` adds to OpenAI's responses, for `/openapi.json`: the
verification report (`verispec.decode.verification_report`) and the per-token log-probabilities.
tests/test_serve.py checks that the report's schema lists exactly the fields a response carries."""

from __future__ import annotations

NUMBER_OR_NULL = {"type": ["number", "null"]}


def _num(description: str, nullable: bool = True) -> dict:
    return {**(NUMBER_OR_NULL if nullable else {"type": "number"}), "description": description}


def _int(description: str) -> dict:
    return {"type": "integer", "description": description}


POSITION = {
    "type": "object",
    "description": "Draft position j of the blocks (1-based)",
    "properties": {
        "position": _int("j, 1..k"),
        "drafts": _int("blocks that proposed at least one draft token"),
        "reached": _int("blocks that proposed at least j draft tokens"),
        "accepted": _int("blocks whose draft token at j was accepted"),
        "rate": _num("accepted / drafts: vLLM's per-position acceptance rate (null without drafts)"),
        "rate_given_reached": _num("accepted / reached: acceptance at j among blocks that drafted that far "
                                   "(null if never reached)"),
    },
}

CERTIFICATE = {
    "type": ["object", "null"],
    "description": "For a budget rule: TV(response law, target's response law) <= tv_bound "
                   "(docs/design/rules.md, 'Certificate'); null for other rules",
    "properties": {
        "tv_per_token": _num("the rule's per-token TV budget", nullable=False),
        "ratio": _num("the rule's overshoot cap c (law <= c * target)", nullable=False),
        "n": {"type": ["integer", "null"], "description": "the length the bound is over"},
        "n_is": {"type": "string", "description": "what n is: 'max_tokens' (the request's maximum length; "
                                                  "responses are padded to it)"},
        "tv_bound": _num("min(1, n * tv_per_token); 1 certifies nothing"),
        "kl_per_token_bound": _num("log(1 + ratio * tv_per_token) (null for ratio inf)"),
        "warning": {"type": ["string", "null"], "description": "set when n * tv_per_token >= 1: the bound "
                                                               "certifies nothing"},
    },
}

SPECULATION = {
    "type": ["object", "null"],
    "description": "With adaptive speculation (k='auto', verispec.speculation): the measured costs and "
                   "what they decided; null otherwise",
    "properties": {
        "policy": {"type": "string", "description": "'adaptive'"},
        "k_max": _int("the widest block considered"),
        "by_batch": {"type": "boolean", "description": "speculation turned off where it cannot pay at the "
                                                       "batch's size"},
        "costs": {"type": "object", "description": "per measured batch size: c (draft step / target "
                                                   "step), v (a (k+1)-token pass / target step, k = 0..), "
                                                   "o (a block's other work per position and row / target "
                                                   "step), target_step_seconds"},
        "k_per_block": {"type": "array", "items": {"type": "integer"}, "description": "k of each block"},
        "blocks_off": _int("blocks decoded without drafts because speculation could not pay"),
        "acceptance_estimate": _num("the row's acceptance estimate at its end (its prior included)"),
        "prior_tests": _int("acceptance tests carried from the requests before it as its prior (the server "
                            "pools them; 0: the uniform prior alone)"),
    },
}

VERIFICATION_REPORT = {
    "type": "object",
    "title": "VerificationReport",
    "description": "What the verification rule did to this response's law (verispec.decode."
                   "verification_report; the same object as verispec.generate(...).stats['verification'])",
    "properties": {
        "rule": {"type": "string", "description": "the rule's canonical spec ('plain' without a drafter)"},
        "lossless": {"type": "boolean", "description": "the rule's output law is the target's"},
        "tokens": _int("tokens decoded (those past a stop string included)"),
        "finish": {"type": "string", "description": "eos, length, stop or cancelled"},
        "drafted_tokens": _int("draft tokens proposed"),
        "accepted_tokens": _int("draft tokens accepted"),
        "acceptance_rate": _num("accepted / drafted"),
        "tokens_per_target_call": _num("tokens per target forward pass (block efficiency)"),
        "target_calls": _int("target forward passes this response took part in"),
        "mean_tv": _num("mean over tokens of the exact TV between the token's law and the target's"),
        "mean_kl": _num("mean over tokens of the exact KL(law || target), nats"),
        "max_overshoot": _num("max over tokens of max law / target"),
        "log_ratio": _num("sum over tokens of log law - log target: the exact path-level log-likelihood "
                          "ratio (docs/design/rules.md, 'Rule anatomy'); exp(-log_ratio) is the importance "
                          "weight against the target"),
        "log_ratio_per_token": _num("log_ratio / tokens"),
        "certificate": CERTIFICATE,
        "acceptance_per_position": {"type": "array", "items": POSITION},
        "speculation": SPECULATION,
        "tree": {"type": ["string", "null"], "description": "the draft shape of a tree-mode generation "
                                                           "(tree:widths=..., drafts:n=...), else null; "
                                                           "then drafted_tokens counts tree nodes and "
                                                           "acceptance_per_position is per depth"},
    },
}

COMPLETION_LOGPROBS_EXTRA = {
    "processed_logprobs": {"type": "array", "items": NUMBER_OR_NULL,
                           "description": "per token: log p_t(x_t) under the processed target (the request's "
                                          "sampling settings applied: the law lossless decoding draws "
                                          "from), whatever --logprobs-mode shows in token_logprobs; null "
                                          "for an echoed prompt token"},
    "behaviour_logprobs": {"type": "array", "items": NUMBER_OR_NULL,
                           "description": "per token: log law_t(x_t), the law the rule drew it from; null "
                                          "for an echoed prompt token (not sampled: no behaviour law)"},
    "top_behaviour_logprobs": {"type": ["array", "null"], "items": {"type": ["object", "null"]},
                               "description": "per token (with logprobs >= 1): the most likely tokens "
                                              "under its behaviour law (emitted(p, q) at a draft position, "
                                              "the bonus law at a bonus position: docs/design.md, 'Rule "
                                              "anatomy'); null for an echoed prompt token"},
    "raw_logprobs": {"type": "array", "items": NUMBER_OR_NULL,
                     "description": "the raw model's (null for the first token of an echoed prompt)"},
    "token_roles": {"type": "array", "items": {"type": "string"},
                    "description": "accepted, recovered, bonus or plain; prompt for an echoed prompt's "
                                   "tokens (echo: they come first, the first one's token_logprobs "
                                   "null as OpenAI's)"},
    "sum_logprob": {"type": "number", "description": "sum of processed_logprobs over the generated tokens "
                                                     "(an echoed prompt's are left out); streaming: in the "
                                                     "last chunk, over every token"},
    "sum_behaviour_logprob": {"type": "number", "description": "the same sum of behaviour_logprobs"},
    "log_importance_weight": {"type": ["number", "null"],
                              "description": "sum_logprob - sum_behaviour_logprob "
                                             "(docs/design/diagnostics.md, "
                                             "'Log-probabilities and importance weights')"},
}

SCHEMAS = {
    "VerificationReport": VERIFICATION_REPORT,
    "VerispecLogprobs": {"type": "object", "title": "VerispecLogprobs",
                         "description": "OpenAI's logprobs fields (token_logprobs and top_logprobs: the "
                                        "raw model's log-probs by default, as vLLM's; --logprobs-mode) "
                                        "plus these (completions; chat puts processed_logprob, "
                                        "behaviour_logprob, raw_logprob and token_role on each content item)",
                         "properties": COMPLETION_LOGPROBS_EXTRA},
    "VerispecResponseFields": {
        "type": "object", "title": "VerispecResponseFields",
        "description": "What verispec adds to an OpenAI completion (top level with n = 1; on each choice "
                       "with n > 1; on the final chunk of a stream)",
        "properties": {"verification": {"$ref": "#/components/schemas/VerificationReport"},
                       "seed": _int("the seed the choice decoded with"),
                       "token_ids": {"type": "array", "items": {"type": "integer"}},
                       "warnings": {"type": "array", "items": {"type": "string"}}},
    },
}
