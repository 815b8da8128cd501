"""`verispec audit`: sample replies from a serving endpoint and test that they follow the law it claims
(docs/design/diagnostics.md, 'Auditing an engine').

For each sampling setting (temperature, top-k, top-p, min-p) the endpoint is asked for `samples` replies
(prompts in turn, seeds `seed`, `seed + 1`, ...); each reply's prompt + tokens go through the reference
target in one fresh, cache-free pass, and the claimed law at every emitted position (the reference's
logits processed by the request's settings) goes to `audit.stats.Audit` with the emitted tokens. A
power check draws, at the same positions, from the law at 0.95 T and 1.05 T. When the claim fails, the
candidate law that fits the tokens best is named (the target at other temperatures, with llama.cpp's
default truncations and each one alone, and, given the engine's draft model, lossy rules' exact laws).
A control endpoint (the same engine with speculation off) goes through the same audit, so a failure
from numerics is told from one speculation adds.

Exit status: 0 every audited setting conforms, 1 one does not, 2 the audit could not run.
"""

from __future__ import annotations

import html
import json
import math
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from verispec.api import encode_prompt, resolve_target
from verispec.audit.endpoint import AssistedGeneration, Endpoint, EndpointError, setting_name
from verispec.audit.stats import Audit, effects_in_words, log_likelihood
from verispec.decode import stop_ids
from verispec.rules import parse as parse_rule
from verispec.evaluation.report import CSS, html_table
from verispec.evaluation.store import read_regular_file
from verispec.sampling import SamplingConfig, process

POWER = (0.95, 1.05)  # the power check's samplers: the claimed law at these multiples of T
# tokens the recorded audits needed to catch a 5% temperature error (llama.cpp's server on the Qwen 0.5B,
# benchmarks/RESULTS.md: caught at 3,618 tokens at T = 1, about 4,329 needed at T = 0.7)
TOKENS_FOR_POWER = 4000
# candidate laws for the best fit, as (name, temperature multiple, top_k, top_p, min_p); llama.cpp's
# server truncates by top-k 40, top-p 0.95 and min-p 0.05 unless told otherwise
CANDIDATES = ([(f"T x {m:g}", m, None, None, None) for m in (0.7, 0.8, 0.9, 0.95, 1.0, 1.05, 1.1, 1.25, 1.5)]
              + [("top-k 40", 1.0, 40, None, None), ("top-p 0.95", 1.0, None, 0.95, None),
                 ("min-p 0.05", 1.0, None, None, 0.05),
                 ("llama.cpp defaults (top-k 40, top-p 0.95, min-p 0.05)", 1.0, 40, 0.95, 0.05),
                 ("top-k 50 (transformers' default)", 1.0, 50, None, None)])


# lossy rules as candidates when the engine's draft model is given (--draft): each rule's exact law at
# every emitted position, as if the position were drafted (a bonus position's law is the target's, and
# which positions were bonus is not visible from outside, so this ranks, it does not test)
RULE_CANDIDATES = ("speccascade:min_p=0.1", "typical:eps=0.09,alpha=0.3", "lenience:l=0.5", "cos:w=0.5",
                   "cos:w=0.9", "sglang:single=0.5,acc=0.5", "relaxed:n=10,delta=0.6")

ENGINES = ("endpoint", "transformers-assisted")


class AuditError(ValueError):
    """The audit cannot run (bad settings, an unusable endpoint, a tokenizer mismatch): exit status 2."""


@dataclass
class AuditConfig:
    endpoint: str
    target: str
    prompts: list[str]
    samples: int = 200
    settings: tuple[SamplingConfig, ...] = (SamplingConfig(),)
    max_tokens: int = 64
    seed: int = 0
    alpha: float = 0.01
    control: str | None = None
    # "endpoint" (an OpenAI-compatible server at `endpoint`) or "transformers-assisted" (in-process
    # `generate(assistant_model=...)` on the reference's own weights; `assistant_layers`, `neutral`)
    engine: str = "endpoint"
    assistant_layers: int = 8
    neutral: bool = True
    model: str | None = None
    extra: dict = field(default_factory=dict)
    chat: bool | None = None
    dtype: torch.dtype = torch.float32
    timeout: float = 300.0
    draft: str | None = None  # the engine's draft model: lossy rules join the best-fit candidates
    candidate_rules: tuple[str, ...] = RULE_CANDIDATES
    rules: list = field(default_factory=list, init=False, repr=False)  # candidate_rules parsed by validate

    def validate(self) -> None:
        if not self.prompts:
            raise AuditError("no prompts: give --prompts FILE or --suite NAME")
        if isinstance(self.samples, bool) or not isinstance(self.samples, int) or self.samples < 1:
            raise AuditError(f"--samples must be an integer >= 1, got {self.samples!r}")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise AuditError(f"--max-tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not 0 < self.alpha < 1:
            raise AuditError(f"--alpha must be in (0, 1), got {self.alpha!r}")
        for s in self.settings:
            if not (math.isfinite(s.temperature) and s.temperature > 0):
                raise AuditError(f"--temperature must be > 0 (a greedy engine has no law to test), got "
                                 f"{s.temperature!r}")
            if s.eta is not None:
                raise AuditError("eta sampling has no field in an OpenAI completion request: audit it as the "
                                 "law an endpoint's own settings give")
        self.rules = []
        for spec in self.candidate_rules if self.draft is not None else ():
            try:
                rule = parse_rule(spec)
            except ValueError as err:
                raise AuditError(f"--candidate-rules: {err}") from None
            if rule.block_level and not rule.lossless:
                raise AuditError(f"--candidate-rules: '{rule.spec}' has no per-position law to rank by "
                                 "(a lossy block rule); audit it against verispec serve instead")
            self.rules.append(rule)


def _law(logits: torch.Tensor, s: SamplingConfig, scale: float = 1.0) -> torch.Tensor:
    """logits [n, V] -> the law [n, V] of sampling `s` at `scale` times its temperature, float64."""
    return process(logits, replace(s, temperature=s.temperature * scale), dtype=torch.float64)


class Reference:
    """The reference target: prompts as token ids, and the logits at a reply's emitted positions."""

    def __init__(self, target: str, dtype: torch.dtype, chat: bool | None, draft: str | None = None):
        self.model = resolve_target(target, "cpu", dtype)
        self.draft = None if draft is None else resolve_target(draft, "cpu", dtype)
        if self.draft is not None and self.draft.vocab_size != self.model.vocab_size:
            raise AuditError(f"--draft {draft!r} has a vocabulary of {self.draft.vocab_size}, the target's "
                             f"is {self.model.vocab_size}: a draft must share the target's tokens")
        self.chat = chat
        self.stops = sorted(stop_ids(self.model))
        context = getattr(self.model, "max_context", None)
        self.context = context if isinstance(context, int) else None

    def encode(self, prompt: str) -> list[int]:
        return encode_prompt(self.model, prompt, self.chat)

    def logits(self, prompt_ids: list[int], reply: list[int], model=None) -> torch.Tensor:
        """logits [n, V] (float32) predicting each of the reply's n tokens, in one cache-free pass (of the
        target, or of `model`: the draft)."""
        ids = torch.tensor([prompt_ids + reply[:-1]])  # [1, L + n - 1]: position t predicts token t + 1
        return (model or self.model).session().logits_for(ids, len(reply))[0].float()  # [n, V]


def audit_endpoint(endpoint: Endpoint, reference: Reference, config: AuditConfig, sampling: SamplingConfig,
                   prompt_ids: list[list[int]], progress: bool = False) -> dict:
    """One sampling setting on one endpoint: the audit's result (`Audit.result`), its effects in words,
    the power rows, the best-fitting candidate law and the endpoint's log-probabilities against the
    reference's."""
    generator = torch.Generator().manual_seed(config.seed + 20261207)  # the PIT's v_t and the power draws
    audit = Audit(alpha=config.alpha)
    power = {scale: Audit(alpha=config.alpha) for scale in POWER}
    fit = {name: 0.0 for name, *_ in CANDIDATES} | {_rule_name(rule): 0.0 for rule in config.rules}
    refused, empty, from_text = 0, 0, 0
    logprob_gaps: list[float] = []
    raw_gaps: list[float] = []
    started = time.monotonic()
    for i in range(config.samples):
        prompt = prompt_ids[i % len(prompt_ids)]
        reply = endpoint.complete(prompt, config.max_tokens, sampling, config.seed + i,
                                  reference.model.decode, reference.model.encode, reference.stops)
        if reply is None:
            refused += 1
            continue
        if not reply.token_ids:
            empty += 1
            continue
        from_text += reply.ids_from == "text"
        vocab = reference.model.vocab_size
        if max(reply.token_ids) >= vocab:  # before the reference pass, which would index past its table
            raise AuditError(f"the endpoint returned token id {max(reply.token_ids)}, outside the "
                             f"reference's vocabulary of {vocab}: is --target the endpoint's model?")
        logits = reference.logits(prompt, reply.token_ids)  # [n, V]
        tokens = torch.tensor(reply.token_ids)  # [n]
        law = _law(logits, sampling)  # [n, V]
        audit.add(law, tokens, reference.stops, generator)
        for scale, checked in power.items():
            drawn = torch.multinomial(_law(logits, sampling, scale), 1, generator=generator)[:, 0]  # [n]
            checked.add(law, drawn, reference.stops, generator)
        for name, scale, top_k, top_p, min_p in CANDIDATES:
            candidate = SamplingConfig(sampling.temperature * scale, top_k, top_p, min_p)
            fit[name] += log_likelihood(_law(logits, candidate), tokens)
        if config.rules:
            draft_law = _law(reference.logits(prompt, reply.token_ids, reference.draft), sampling)  # [n, V]
            for rule in config.rules:
                fit[_rule_name(rule)] += log_likelihood(rule.emitted_law(law, draft_law), tokens)
        if reply.logprobs is not None and len(reply.logprobs) >= len(reply.token_ids) - 1:
            n = min(len(reply.logprobs), len(reply.token_ids))
            mine = law.gather(-1, tokens[:n, None])[:, 0].clamp_min(1e-300).log()  # [n]
            raw = logits.double().log_softmax(-1).gather(-1, tokens[:n, None])[:, 0]  # [n]
            theirs = torch.tensor(reply.logprobs[:n], dtype=torch.float64)
            finite = torch.isfinite(theirs)
            logprob_gaps += (theirs - mine)[finite].abs().tolist()
            raw_gaps += (theirs - raw)[finite].abs().tolist()
        if progress and (i + 1) % 50 == 0:
            print(f"audit {setting_name(sampling)}: {i + 1}/{config.samples} replies, "
                  f"{time.monotonic() - started:.0f} s", file=sys.stderr)
    if audit.replies == 0:
        raise AuditError(f"no reply could be checked ({refused} ambiguous, {empty} empty): nothing to test")
    result = audit.result()
    tokens_seen = result["tokens"]
    power_rows = {f"T x {scale:g}": power[scale].result() for scale in POWER}
    caught = {name: not r["conforms"] for name, r in power_rows.items()}
    out = {"setting": setting_name(sampling), "result": result, "effects": effects_in_words(result),
           "power": {name: {"detected": caught[name], "holm": r["holm"]} for name, r in power_rows.items()},
           "refused_ambiguous": refused, "empty": empty, "ids_from_text": from_text}
    if not all(caught.values()):
        # z grows as the square root of the tokens: the count at which the weaker power row would pass
        # the threshold of the most sensitive statistic
        z_needed = _z_for(config.alpha / len(result["holm"]))
        z_seen = min(max(abs(r["statistics"]["surprise"]["z"]), abs(r["statistics"]["top"]["z"]))
                     for r in power_rows.values())
        needed = math.ceil(tokens_seen * (z_needed / max(z_seen, 1e-6)) ** 2)
        out["too_few_tokens"] = (f"a 5% temperature error would not be caught with {tokens_seen} tokens; "
                                 f"about {needed} are needed (raise --samples or --max-tokens)")
    per_token = {name: value / tokens_seen for name, value in fit.items()}
    ranked = sorted(per_token, key=per_token.get, reverse=True)
    best, second = ranked[0], ranked[1]
    out["best_fit"] = {"law": best, "gain_nats_per_token": per_token[best] - per_token["T x 1"],
                       "runner_up": second, "lead_nats_per_token": per_token[best] - per_token[second],
                       "candidates": per_token}
    if logprob_gaps:
        gaps = torch.tensor(logprob_gaps)
        raw = torch.tensor(raw_gaps)
        out["endpoint_logprobs"] = {"positions": len(logprob_gaps),
                                    "median_gap_to_claimed_law": float(gaps.median()),
                                    "p99_gap_to_claimed_law": float(gaps.quantile(0.99)),
                                    "median_gap_to_raw_model": float(raw.median())}
    return out


def _rule_name(rule) -> str:
    return f"rule {rule.spec} with the draft"


def _z_for(p: float) -> float:
    """The z whose two-sided p is `p` (bisection on erfc)."""
    lo, hi = 0.0, 40.0
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if math.erfc(mid / math.sqrt(2)) > p else (lo, mid)
    return hi


def preflight(endpoint: Endpoint, reference: Reference, config: AuditConfig, prompt_ids: list[list[int]]
              ) -> list[str]:
    """Checks before any sampling: the endpoint answers and serves a model, the prompts fit the reference's
    context, and the endpoint follows the seed (two requests with one seed give one reply; a note when not:
    the law test does not need it). Raises AuditError when the audit cannot run."""
    try:
        endpoint.model = endpoint.served_model()
    except EndpointError as err:
        raise AuditError(str(err)) from None
    context = reference.context
    longest = max(len(p) for p in prompt_ids)
    if context is not None and longest + config.max_tokens > context:
        raise AuditError(f"a prompt of {longest} tokens + --max-tokens {config.max_tokens} exceeds the "
                         f"reference's context of {context}")
    notes = []
    most = config.samples * config.max_tokens
    if most < TOKENS_FOR_POWER:
        notes.append(f"at most {most} tokens per setting (--samples x --max-tokens): the audits recorded in "
                     f"benchmarks/RESULTS.md needed about {TOKENS_FOR_POWER} to catch a sampler 5% off its "
                     "temperature; the report says how many this one needs if its power falls short")
    sampling = config.settings[0]
    try:
        first = endpoint.complete(prompt_ids[0], min(config.max_tokens, 16), sampling, config.seed,
                                  reference.model.decode, reference.model.encode, reference.stops)
        again = endpoint.complete(prompt_ids[0], min(config.max_tokens, 16), sampling, config.seed,
                                  reference.model.decode, reference.model.encode, reference.stops)
    except EndpointError as err:
        raise AuditError(str(err)) from None
    if first is not None and first.token_ids and max(first.token_ids) >= reference.model.vocab_size:
        raise AuditError("the endpoint's token ids fall outside the reference's vocabulary: --target must be "
                         "the model the endpoint serves (the same tokenizer)")
    if first is not None and first.ids_from == "text":
        # the endpoint returns text only: its tokens come from the reference's tokenizer; a mismatch in
        # the prompt's tokenization would show as a failed round trip on most replies
        notes.append("the endpoint returns no token ids: replies are tokenized here, round-trip checked")
    if first is not None and again is not None and first.token_ids != again.token_ids:
        notes.append("the endpoint ignores the seed (one seed gave two replies): replies are still i.i.d. "
                     "draws, so the test holds, but a failing reply cannot be reproduced by its seed")
    if isinstance(endpoint, Endpoint):
        _check_follows_temperature(endpoint, reference, prompt_ids[:4])
    if getattr(endpoint, "logprobs_refused", False):
        notes.append("the endpoint refuses log-probabilities: requests go without them (its own "
                     "log-probabilities are not compared)")
    return notes


GREEDY_MARGIN = 3.0  # nats between the reference's two most likely tokens: no rounding swaps them


def _check_follows_temperature(endpoint: Endpoint, reference: Reference, prompts: list[list[int]],
                               length: int = 16) -> None:
    """AuditError when the endpoint ignores the sampling settings it is sent: asked for temperature 0
    (greedy), its reply must follow the reference's greedy continuation at every position where the
    reference's most likely token leads the next by more than GREEDY_MARGIN nats (quantisation and
    kernel rounding do not move logits that far); the walk stops at the first position where they part
    within the margin (a near tie, which rounding may break either way)."""
    for prompt in prompts:
        try:
            reply = endpoint.complete(prompt, length, SamplingConfig(temperature=0.0), 0,
                                      reference.model.decode, reference.model.encode, reference.stops)
        except EndpointError as err:
            raise AuditError(f"the endpoint refused a temperature-0 request: {err}") from None
        if reply is None or not reply.token_ids:
            continue
        ids = reply.token_ids
        logits = reference.logits(prompt, ids)  # [n, V]: the reference at each of the reply's positions
        for t, token in enumerate(ids):
            top = logits[t].topk(2)
            margin = float(top.values[0] - top.values[1])
            if token == int(top.indices[0]):
                continue
            if margin > GREEDY_MARGIN:
                raise AuditError(
                    f"the endpoint does not follow the sampling settings it is sent: at temperature 0 it "
                    f"gave token {token} at position {t} where the reference's most likely token "
                    f"{int(top.indices[0])} leads by {margin:.1f} nats (is it sampling regardless, or "
                    "serving another model?)")
            break  # a near tie: past it the two continuations may differ legitimately


def run_audit(config: AuditConfig, progress: bool = False) -> dict:
    """The whole audit (every setting, the endpoint and the control) as a JSON-able report; `conforms`
    is False when any setting of the endpoint fails."""
    config.validate()
    if config.engine not in ENGINES:
        raise AuditError(f"--engine must be one of {', '.join(ENGINES)}, got {config.engine!r}")
    try:
        endpoint = (Endpoint(config.endpoint, config.model, config.timeout, dict(config.extra))
                    if config.engine == "endpoint" else None)
        control = (Endpoint(config.control, config.model, config.timeout, dict(config.extra))
                   if config.control else None)
    except ValueError as err:
        raise AuditError(str(err)) from None
    reference = Reference(config.target, config.dtype, config.chat, config.draft)
    if endpoint is None:
        hf = getattr(reference.model, "model", None)
        if hf is None or not hasattr(hf, "generate"):
            raise AuditError(f"--engine transformers-assisted needs a transformers model as --target, got "
                             f"{config.target!r}")
        try:
            endpoint = AssistedGeneration(hf, config.assistant_layers, config.neutral,
                                          f"transformers assisted generation ({config.target}, assistant: "
                                          f"its first {config.assistant_layers} layers)")
        except ValueError as err:
            raise AuditError(str(err)) from None
    prompt_ids = [reference.encode(p) for p in config.prompts]
    notes = preflight(endpoint, reference, config, prompt_ids)
    if control is not None:
        notes += [f"control: {n}" for n in preflight(control, reference, config, prompt_ids)]
    report = {"endpoint": config.endpoint if config.engine == "endpoint" else endpoint.model,
              "model": endpoint.model, "target": config.target,
              "samples": config.samples, "max_tokens": config.max_tokens, "alpha": config.alpha,
              "notes": notes, "settings": []}
    for sampling in config.settings:
        try:
            entry = {"endpoint": audit_endpoint(endpoint, reference, config, sampling, prompt_ids, progress)}
            if control is not None:
                entry["control"] = audit_endpoint(control, reference, config, sampling, prompt_ids, progress)
        except EndpointError as err:
            raise AuditError(str(err)) from None
        entry["reading"] = _reading(entry)
        report["settings"].append(entry)
    report["conforms"] = all(e["endpoint"]["result"]["conforms"] for e in report["settings"])
    return report


def _reading(entry: dict) -> str:
    """Which of the endpoint and its control fails, in words."""
    mine = entry["endpoint"]["result"]["conforms"]
    if "control" not in entry:
        return "conforms" if mine else "does not conform"
    theirs = entry["control"]["result"]["conforms"]
    return {(True, True): "both conform",
            (False, True): "the endpoint fails and its control conforms: speculation (or what differs from "
                           "the control) changes the law",
            (False, False): "both fail: the difference is not speculation's (numerics, quantisation, sampler "
                            "defaults)",
            (True, False): "the control fails and the endpoint conforms"}[(mine, theirs)]


def render(report: dict) -> str:
    """The report as terminal text: per setting, the verdict, the p-values, the effects, the power."""
    model = "" if report["model"] == report["endpoint"] else f" (model {report['model']})"
    lines = [f"verispec audit of {report['endpoint']}{model} against {report['target']}: "
             f"{report['samples']} replies per setting, at most {report['max_tokens']} tokens, alpha "
             f"{report['alpha']:g} (Holm over 5 statistics)"]
    lines += [f"note: {n}" for n in report["notes"]]
    for entry in report["settings"]:
        for who in ("endpoint", "control"):
            if who not in entry:
                continue
            e = entry[who]
            r = e["result"]
            verdict = "CONFORMS" if r["conforms"] else "DOES NOT CONFORM"
            lines.append("")
            lines.append(f"[{who}] {e['setting']}: {verdict} ({r['replies']} replies, {r['tokens']} tokens, "
                         f"{r['stopped']} ended at a stop token)")
            header = f"  {'statistic':10} {'value':>9} {'p':>10} {'Holm p':>10}"
            lines.append(header)
            for name, s in r["statistics"].items():
                value = s.get("z", s.get("d"))
                label = "D" if "d" in s else "z"
                holm_p = r["holm"].get(name, math.nan)
                lines.append(f"  {name:10} {label} {value:+7.3f} {s['p']:10.3g} {holm_p:10.3g}")
            lines += [f"  - {w}" for w in e["effects"]]
            caught = ", ".join(f"{k}: {'caught' if v['detected'] else 'NOT caught'}"
                               for k, v in e["power"].items())
            lines.append(f"  power (the claimed law at 5% off its temperature, same positions): {caught}")
            if "too_few_tokens" in e:
                lines.append(f"  - {e['too_few_tokens']}")
            if not r["conforms"]:
                b = e["best_fit"]
                lines.append(f"  best-fitting law: {b['law']} ({b['gain_nats_per_token']:+.4f} nats/token "
                             f"over the claimed law; {b['lead_nats_per_token']:.4f} ahead of "
                             f"{b['runner_up']})")
            if "endpoint_logprobs" in e:
                g = e["endpoint_logprobs"]
                lines.append(f"  the endpoint's log-probs vs the claimed law: median |gap| "
                             f"{g['median_gap_to_claimed_law']:.2g}, p99 {g['p99_gap_to_claimed_law']:.2g} "
                             f"nats; vs the raw model {g['median_gap_to_raw_model']:.2g}")
            for word, n in (("ambiguous (refused)", e["refused_ambiguous"]), ("empty", e["empty"])):
                if n:
                    lines.append(f"  - {n} repl(ies) {word}")
        if "control" in entry:
            lines.append(f"  reading: {entry['reading']}")
    lines.append("")
    lines.append("verdict: " + ("every setting conforms" if report["conforms"] else "DOES NOT CONFORM"))
    return "\n".join(lines)


def render_html(report: dict) -> str:
    """The report as one self-contained HTML page in the sweep report's style (`evaluation.report.CSS`):
    per setting and endpoint, the verdict, the statistics, the effects in words, the power, the best fit."""
    esc = html.escape
    title = f"verispec audit of {report['endpoint']}"
    verdict = "every setting conforms" if report["conforms"] else "DOES NOT CONFORM"
    parts = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{esc(title)}</title>",
             f"<style>{CSS}</style></head><body><h1>{esc(title)}</h1>",
             f"<p><b>verdict: {esc(verdict)}</b> (against {esc(str(report['target']))}, "
             f"{report['samples']} replies per setting, at most {report['max_tokens']} tokens, alpha "
             f"{report['alpha']:g}, Holm over 5 statistics)</p>"]
    if report["notes"]:
        parts.append("<ul>" + "".join(f"<li>{esc(n)}</li>" for n in report["notes"]) + "</ul>")
    for entry in report["settings"]:
        for who in ("endpoint", "control"):
            if who not in entry:
                continue
            e, r = entry[who], entry[who]["result"]
            state = "conforms" if r["conforms"] else "does not conform"
            parts.append(f"<h2>{esc(who)}: {esc(e['setting'])}, {state}</h2><p class='note'>"
                         f"{r['replies']} replies, {r['tokens']} tokens, {r['stopped']} ended at a stop "
                         "token</p>")
            rows = [[name, f"{s.get('z', s.get('d')):+.3f}", f"{s['p']:.3g}",
                     f"{r['holm'].get(name, math.nan):.3g}"] for name, s in r["statistics"].items()]
            parts.append(html_table(["statistic", "value (z, or KS D)", "p", "Holm p"], rows,
                                    ["worse" if r["holm"].get(name, 1) < report["alpha"] else ""
                                     for name in r["statistics"]]))
            items = list(e["effects"])
            items.append("power (the claimed law at 5% off its temperature, same positions): " + ", ".join(
                f"{k}: {'caught' if v['detected'] else 'NOT caught'}" for k, v in e["power"].items()))
            if "too_few_tokens" in e:
                items.append(e["too_few_tokens"])
            if not r["conforms"]:
                b = e["best_fit"]
                items.append(f"best-fitting law: {b['law']} ({b['gain_nats_per_token']:+.4f} nats a token "
                             f"over the claimed law; {b['lead_nats_per_token']:.4f} ahead of "
                             f"{b['runner_up']})")
            parts.append("<ul>" + "".join(f"<li>{esc(i)}</li>" for i in items) + "</ul>")
        if "control" in entry:
            parts.append(f"<p><b>reading:</b> {esc(entry['reading'])}</p>")
    parts.append("</body></html>")
    return "".join(parts)


def load_prompts(path: str) -> list[str]:
    """Prompts from a file: JSONL with a "prompt" field per line, or plain text, one prompt a line."""
    raw = read_regular_file(Path(path), 64 * 2**20, "prompts file").decode("utf-8")
    prompts = []
    for number, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            try:
                row = json.loads(line)
            except (ValueError, RecursionError):
                raise AuditError(f"{path}, line {number}: not valid JSON") from None
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"]:
                raise AuditError(f"{path}, line {number}: a JSON line needs a non-empty \"prompt\" string")
            prompts.append(row["prompt"])
        else:
            prompts.append(line)
    if not prompts:
        raise AuditError(f"{path} holds no prompt")
    return prompts


__all__ = ["AuditConfig", "AuditError", "run_audit", "render", "render_html", "load_prompts"]
