"""The one obvious entry point: `verispec.generate(prompt, target=..., draft=..., rule=...)`.

Models are loaded once per (name, device, dtype) and reused across calls.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from verispec import defaults
from verispec.decode import DecodeConfig, Generation, decode_prompts, position_costs
from verispec.models import ModelDrafter, check_compatible, default_draft, load_drafter, load_model
from verispec.logprobs import token_logprobs, totals
from verispec.rules import Rule, parse
from verispec.rules.base import refuse_diagnostics_without_law
from verispec.sampling import SamplingConfig
from verispec.speculation import AdaptivePolicy, Costs, measure_costs
from verispec.tree_decode import TreeVerification, tree_verification_rule
from verispec.trees import DraftShape, parse_shape


@dataclass(frozen=True)
class GenerateResult:
    text: str
    token_ids: list[int]
    prompt_ids: list[int]
    stats: dict
    generation: Generation

    def to_json(self) -> dict:
        out = {"text": self.text, "token_ids": self.token_ids, "prompt_ids": self.prompt_ids,
               "stats": self.stats}
        if self.generation.steps is not None:  # per token: target and behaviour log-probs, role; sums
            entries = token_logprobs(self.generation, len(self.token_ids))
            out["logprobs"] = {"tokens": entries, **totals(entries)}
        return out


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def as_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def resolve_target(target, device: str = "cpu", dtype: torch.dtype = torch.float32):
    return load_model(target, device, dtype) if isinstance(target, str) else target


def resolve_drafter(draft, target, device: str = "cpu", dtype: torch.dtype = torch.float32):
    """None / "none" -> no drafter (plain decoding); "auto" -> the target's default drafter
    (`verispec.models.default_draft`, the same the CLI uses); a spec string; a model; or a drafter object."""

    if draft is None or draft == defaults.NO_DRAFT:
        return None
    if draft == defaults.AUTO_DRAFT:
        draft = default_draft(target)
    if isinstance(draft, str):
        return load_drafter(draft, target, device, dtype)
    if hasattr(draft, "propose_batch"):
        return draft
    check_compatible(target, draft)
    return ModelDrafter(draft)


MAX_SEED = 2**63 - 1
# measured pass costs per (target, draft model, batch sizes) in this process; each entry holds the two
# models too, so the ids in its key cannot be reused by other objects while it lives
_COSTS: dict[tuple, tuple[Costs, object, object]] = {}


def pair_costs(target, drafter, prompt_ids: list[int], sizes: tuple[int, ...],
               sampling: SamplingConfig, diagnostics: bool = True) -> Costs:
    """The pair's pass costs on this machine (`verispec.speculation.measure_costs`) and a block's other
    work per position (`decode.position_costs`, with or without diagnostics), measured on the first call
    for these models, batch sizes and diagnostics and reused by later calls in this process (with a large
    model a measurement takes seconds: dozens of passes)."""
    model = getattr(drafter, "model", drafter)
    key = (id(target), id(model), sizes, diagnostics)
    if key not in _COSTS:
        costs = measure_costs(target, drafter, prompt_ids, AUTO_K_MAX, sizes, sampling=sampling)
        costs = position_costs(costs, target, drafter, prompt_ids, diagnostics=diagnostics)
        _COSTS[key] = (costs, target, model)
    return _COSTS[key][0]


AUTO_K = "auto"  # k chosen per block and row from measured costs (verispec.speculation)
AUTO_K_MAX = defaults.AUTO_K_MAX  # the widest block k="auto" considers


def _is_int(value) -> bool:
    """A Python, numpy or 0-d torch integer; never a bool (True is not a token id or a count)."""
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return True
    if isinstance(value, torch.Tensor):
        return (value.ndim == 0 and not value.is_floating_point() and not value.is_complex()
                and value.dtype != torch.bool)
    return isinstance(value, np.integer)


def _is_number(value) -> bool:
    """A Python/numpy int or float (never a bool)."""
    if isinstance(value, bool):
        return False
    if isinstance(value, (int, float)) or _is_int(value):
        return True
    return isinstance(value, np.floating)


def _check_prompt(prompt) -> str | list[int]:
    """A prompt is a non-empty `str` or a non-empty sequence of integer token ids (Python, numpy or
    torch integers, or a 1-D integer tensor/array); bools, floats, bytes and strings are refused.
    Returns the text or the ids as a list of Python ints (range against the vocabulary is checked
    by the decode loop)."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("empty prompt: give some text")
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as err:  # a lone surrogate: no tokenizer can encode it
            raise ValueError(
                f"prompt is not valid Unicode text: {err.reason} at position {err.start}") from None
        return prompt
    if isinstance(prompt, (bytes, bytearray, memoryview)):
        raise TypeError("prompt must be a str or a sequence of integer token ids, got bytes: "
                        "decode it to str first")
    if isinstance(prompt, torch.Tensor) or type(prompt).__module__ == "numpy":
        if prompt.ndim != 1:
            raise ValueError(f"prompt token ids must be 1-D, got shape {tuple(prompt.shape)}")
        prompt = list(prompt)
    if not isinstance(prompt, (list, tuple)):
        raise TypeError(f"prompt must be a str or a sequence of integer token ids, "
                        f"got {type(prompt).__name__}")
    if not prompt:
        raise ValueError("empty prompt: give at least one token id")
    for i, token in enumerate(prompt):
        if not _is_int(token):
            raise TypeError(f"prompt token ids must be integers (not bool, float or str); "
                            f"item {i} is {token!r} ({type(token).__name__})")
    ids = [int(t) for t in prompt]
    if min(ids) < 0:
        raise ValueError(f"prompt token ids must be >= 0, got {min(ids)}")
    return ids


def check_device(device) -> str:
    """A device string torch accepts and that this machine has (`cuda` on a CPU-only torch is refused)."""
    if isinstance(device, torch.device):
        device = str(device)
    if not isinstance(device, str):
        raise TypeError(f"device must be a str such as 'cpu' or 'cuda', got {type(device).__name__}")
    try:
        parsed = torch.device(device)
    except (RuntimeError, ValueError) as err:
        raise ValueError(f"device {device!r} is not a torch device: {err}") from None
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            built = ("this torch build has no CUDA support" if torch.version.cuda is None
                     else "no CUDA device is visible")
            raise ValueError(f"device {device!r} is not available: {built}; use --device cpu")
        if parsed.index is not None and parsed.index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r} is not available: "
                             f"{torch.cuda.device_count()} CUDA device(s)")
    elif parsed.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"device {device!r} is not available on this machine; use --device cpu")
    elif parsed.type not in ("cpu", "cuda", "mps"):
        raise ValueError(f"device {device!r} is not supported; use cpu or cuda")
    return device


def _check_generate_args(target, draft, rule, k, max_new_tokens, sampling: dict, seeds: list, chat,
                         diagnostics, device, dtype, draft_dtype,
                         shape: DraftShape | None = None) -> Rule | TreeVerification:
    """Every argument of `generate` except the prompt, checked once, before any model loads; `seeds`
    holds one seed per prompt. Returns the rule, parsed (with a tree shape: the tree rule, paired)."""
    if shape is not None:
        if draft is None or draft == "none":
            raise ValueError(f"a tree draft ({shape.spec}) needs a draft model; draft=None decodes the "
                             "target plainly")
        tree_rule = tree_verification_rule(rule, shape)
        _check_generate_args(target, draft, "lossless", k, max_new_tokens, sampling, seeds, chat,
                             diagnostics, device, dtype, draft_dtype)
        return tree_rule
    if not (isinstance(rule, (str, Rule))):
        raise TypeError(f"rule must be a rule spec str (e.g. 'lossless') or a Rule, "
                        f"got {type(rule).__name__}")
    if not (isinstance(target, str) or (hasattr(target, "session") and hasattr(target, "vocab_size"))):
        raise TypeError(f"target must be a model name/path str or a model object, "
                        f"got {type(target).__name__}")
    if not (draft is None or isinstance(draft, str) or hasattr(draft, "propose_batch")
            or (hasattr(draft, "session") and hasattr(draft, "vocab_size"))):
        raise TypeError(f"draft must be None, a spec str, a model or a drafter, got {type(draft).__name__}")
    parsed = parse(rule) if isinstance(rule, str) else rule
    if (draft is None or draft == "none") and not parsed.lossless:
        # plain decoding samples the target itself: a lossy rule would be silently ignored
        raise ValueError(f"rule {parsed.spec!r} needs a draft; draft=None decodes the target plainly "
                         "(give a draft, or a lossless rule)")
    checked = [("max_new_tokens", max_new_tokens)]
    if k != AUTO_K:
        checked.insert(0, ("k (draft tokens per block)", k))
    for name, value in checked:
        if not _is_int(value):
            also = " or 'auto'" if name.startswith("k ") else ""
            raise TypeError(f"{name} must be an integer{also}, got {value!r} ({type(value).__name__})")
        if int(value) < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {int(value)}")
    for name, value in sampling.items():
        if value is not None and not _is_number(value):
            raise TypeError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    if sampling["temperature"] is None:
        raise TypeError("temperature must be a number >= 0 (0 = greedy), got None")
    for seed in seeds:
        if not _is_int(seed):
            raise TypeError(f"seed must be an integer, got {seed!r} ({type(seed).__name__})")
        if not 0 <= int(seed) <= MAX_SEED:
            raise ValueError(f"seed must be in [0, 2**63-1], got {int(seed)}")
    if chat is not None and not isinstance(chat, bool):
        raise TypeError(f"chat must be None, True or False, got {chat!r}")
    if not isinstance(diagnostics, bool):
        raise TypeError(f"diagnostics must be True or False, got {diagnostics!r}")
    if diagnostics:
        refuse_diagnostics_without_law(parsed)
    for name, value in (("dtype", dtype), ("draft_dtype", draft_dtype)):
        if not isinstance(value, (str, torch.dtype)):
            raise TypeError(f"{name} must be a str ({', '.join(DTYPES)}) or a torch.dtype, "
                            f"got {type(value).__name__}")
        as_dtype(value)
    check_device(device)
    return parsed


def draft_shape(tree: str | None = None, drafts: str | None = None) -> DraftShape | None:
    """The draft shape of `generate(tree=..., drafts=...)` (docs/design/trees.md, 'Trees'): tree="4,2,2,1",
    "widths=4,2,2,1" or "tree:widths=4,2,2,1"; EAGLE-2's dynamic tree "nodes=16,depth=5,topk=4" or
    "tree:nodes=16,depth=5,topk=4"; drafts="n=3[,replacement=0][,depth=D]" or "drafts:n=3"."""
    if tree is not None and drafts is not None:
        raise ValueError("give a tree (tree=...) or several drafts (drafts=...), not both")
    for name, value in (("tree", tree), ("drafts", drafts)):
        if value is not None and not isinstance(value, str):
            raise TypeError(f"{name} must be a str (e.g. tree='widths=4,2,2,1', drafts='n=3'), "
                            f"got {type(value).__name__}")
    if tree is not None:
        text = tree.strip()
        named = text.startswith(("widths", "nodes", "depth", "topk"))
        text = text if text.startswith("tree:") else "tree:" + (text if named else "widths=" + text)
        return parse_shape(text)
    if drafts is not None:
        text = drafts.strip()
        return parse_shape(text if text.startswith("drafts:") else "drafts:" + text)
    return None


def parse_draft_shape(text: str) -> DraftShape:
    """A draft shape from any of its spellings, as `bench --tree`, `serve --tree` and a served request's
    `verification.tree` take it: `tree:widths=4,2,2,1` / `drafts:n=3` as given, and the run command's
    short forms `widths=4,2,2,1`, `4,2,2,1`, `nodes=16,depth=5,topk=4` and `n=3` completed. ValueError
    for a malformed shape."""
    if not isinstance(text, str):
        raise TypeError(f"a draft shape must be a str (e.g. 'tree:widths=4,2,2,1' or 'drafts:n=3'), "
                        f"got {type(text).__name__}")
    short = text.strip()
    return draft_shape(drafts=short) if short.startswith(("n=", "drafts:")) else draft_shape(tree=short)


def encode_prompt(model, prompt: str | list[int], chat: bool | None = None) -> list[int]:
    """Text -> token ids; instruct models (a tokenizer with a chat template) get it unless chat=False."""
    if not isinstance(prompt, str):
        return [int(t) for t in prompt]
    if not prompt:
        raise ValueError("empty prompt: give some text")
    tok = getattr(model, "tokenizer", None)
    if chat is None:
        chat = bool(getattr(tok, "chat_template", None))
    if chat and not callable(getattr(tok, "apply_chat_template", None)):
        raise ValueError(f"chat=True but model '{getattr(model, 'name', model)}' has no tokenizer "
                         "with a chat template")
    if chat:
        out = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
        ids = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
        return [int(t) for t in ids]
    return model.encode(prompt)


def _content_text(content):
    """A message's content as text: a string as is; OpenAI's list of parts ([{"type": "text", "text":
    ...}, ...]) joined, a part of any other type (an image, audio) refused; anything else unchanged (the
    caller refuses it)."""
    if not isinstance(content, list):
        return content
    texts = []
    for part in content:
        if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ValueError(f"message content parts must be text parts ({{'type': 'text', 'text': ...}}); "
                             f"got {kind!r}: this server takes text only")
        texts.append(part["text"])
    return "".join(texts)


def encode_messages(model, messages: list[dict]) -> list[int]:
    """Chat messages ([{"role", "content"}, ...]) -> token ids: the tokenizer's chat template (with the
    generation prompt) when it has one; otherwise the contents joined by newlines, ending with one, as
    plain text (roles dropped: the default pair is a plain Shakespeare model with no chat format)."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} objects")
    messages = [dict(m, content=_content_text(m.get("content"))) if isinstance(m, dict) else m
                for m in messages]
    for m in messages:
        if not (isinstance(m, dict) and isinstance(m.get("content"), str) and isinstance(m.get("role"), str)):
            raise ValueError("each message must be an object with string 'role' and 'content'")
    tok = model.tokenizer
    if getattr(tok, "chat_template", None):
        out = tok.apply_chat_template([{"role": m["role"], "content": m["content"]} for m in messages],
                                      add_generation_prompt=True)
        ids = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
        return [int(t) for t in ids]
    return encode_prompt(model, "".join(m["content"] + "\n" for m in messages), chat=False)


def response_text(model, gen: Generation) -> str:
    """The text of a generation: its tokens decoded, less the end-of-sequence token it stopped at
    (a control token, e.g. `<|im_end|>`, not text: OpenAI and vLLM leave it out; `token_ids` keep it)."""
    ids = list(gen.token_ids)
    return model.decode(ids[:-1] if gen.finish == "eos" else ids)


def _several_prompts(prompt) -> bool:
    """A list/tuple of prompts (each a str or a sequence of ids), as opposed to one prompt of ids."""
    return (isinstance(prompt, (list, tuple)) and len(prompt) > 0
            and all(isinstance(p, (str, list, tuple)) or (isinstance(p, torch.Tensor) and p.ndim == 1)
                    or (type(p).__module__ == "numpy" and getattr(p, "ndim", 0) == 1) for p in prompt))


def _check_seeds(seed, count: int) -> list:
    """One seed per prompt: an int s gives s, s+1, ..., or a sequence of `count` ints. Each seed is
    then checked like a single one (`_check_generate_args`)."""
    if isinstance(seed, (list, tuple)):
        if len(seed) != count:
            raise ValueError(f"seed: give one int or one seed per prompt ({count}), got {len(seed)} seeds")
        return list(seed)
    if count > 1 and _is_int(seed):
        return [int(seed) + i for i in range(count)]
    return [seed] * count


def generate(
    prompt,
    target=defaults.TARGET,
    draft=defaults.AUTO_DRAFT,
    rule: str | Rule = defaults.RULE,
    *,
    k: int | str | None = None,
    max_new_tokens: int = defaults.MAX_NEW_TOKENS,
    temperature: float = defaults.TEMPERATURE,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    eta: float | None = None,
    seed: int | list[int] = 0,
    chat: bool | None = None,
    diagnostics: bool = True,
    device: str = "cpu",
    dtype: str | torch.dtype = "float32",
    draft_dtype: str | torch.dtype = "float32",
    batch_size: int = defaults.BATCH_SIZE,
    tree: str | None = None,
    drafts: str | None = None,
) -> GenerateResult | list[GenerateResult]:
    """Generate a continuation of `prompt` with speculative decoding (or plain decoding if draft=None).

    `prompt` is one prompt (a str or a sequence of token ids) -> one `GenerateResult`, or a list of
    prompts -> a list of results, decoded `batch_size` rows at a time (continuous batching). Row i
    uses seed `seed + i` (or `seed[i]` when a list is given) and its own generator, so it equals
    `generate(prompt[i], seed=seed + i)` alone wherever the numerics allow it (batched matmuls round
    differently: docs/design/rules.md, 'Token roles').

    draft="auto" picks the target's default drafter, exactly as `verispec run` does without --draft.

    k: draft tokens per block (default 4); not with a tree shape that fixes its own depth.
    k="auto" measures the pair's pass costs on this machine first (`verispec.speculation.measure_costs`),
    then chooses each row's k per block (0..8) from its acceptance so far and turns speculation off for a
    block where plain decoding is faster at the batch's size; rules and laws are unchanged, each result's
    `stats["verification"]["speculation"]` holds the costs and choices. Measured costs vary from run to
    run, so k="auto" results are not token-reproducible from the seed alone (their law is the rule's).

    tree="4,2,2,1" (or "widths=4,2,2,1") drafts a top-k token tree per block, tree="nodes=16,depth=5,
    topk=4" EAGLE-2's dynamic tree, drafts="n=3" three sampled chains of k tokens (docs/design/trees.md,
    'Trees'); `rule` is then a tree rule (lossless, greedy, lenience:l=, ..., or traversal), and lossy
    ones need a deterministic (top-k or dynamic) tree.

    dtype is the target's compute dtype, draft_dtype a separate draft model's (a self-draft shares the
    target's weights and dtype). fp32 by default: the tiny default draft is slower in bf16 on CPU.

    Every argument is checked before any model loads (TypeError / ValueError naming it); the prompt
    plus max_new_tokens must fit the target's context (checked before decoding)."""
    several = _several_prompts(prompt)
    prompts = [_check_prompt(p) for p in (prompt if several else [prompt])]
    seeds = _check_seeds(seed, len(prompts))
    shape = draft_shape(tree, drafts)
    if shape is not None and k == AUTO_K:
        raise ValueError("k='auto' chooses the length of chain drafts; a tree's shape is fixed by "
                         "tree= / drafts=")
    if shape is not None and k is not None and shape.depth is not None:
        raise ValueError(f"k sets the length of chain drafts (and of drafts=n=... chains without a depth); "
                         f"the draft shape '{shape.spec}' has its own depth ({shape.depth}): leave k out")
    k = defaults.K if k is None else k
    rule = _check_generate_args(target, draft, rule, k, max_new_tokens,
                                {"temperature": temperature, "top_k": top_k, "top_p": top_p, "min_p": min_p,
                                 "eta": eta},
                                seeds, chat, diagnostics, device, dtype, draft_dtype, shape)
    seeds = [int(s) for s in seeds]
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    adaptive = k == AUTO_K
    k, max_new_tokens = (AUTO_K_MAX if adaptive else int(k)), int(max_new_tokens)
    sampling = SamplingConfig(temperature=float(temperature), top_k=top_k, top_p=top_p, min_p=min_p, eta=eta)
    target_model = resolve_target(target, device, as_dtype(dtype))
    drafter = resolve_drafter(draft, target_model, device, as_dtype(draft_dtype))
    prompt_ids = [encode_prompt(target_model, p, chat) for p in prompts]
    policy = None
    if adaptive and drafter is not None:
        sizes = tuple(sorted({1, min(batch_size, len(prompt_ids))}))
        costs = pair_costs(target_model, drafter, prompt_ids[0], sizes, sampling, diagnostics)
        policy = AdaptivePolicy(costs, AUTO_K_MAX, margin=defaults.AUTO_MARGIN)
    config = DecodeConfig(k=k, max_new_tokens=max_new_tokens, sampling=sampling, diagnostics=diagnostics,
                          policy=policy, tree=shape)
    generators = [torch.Generator().manual_seed(s) for s in seeds]
    gens = decode_prompts(target_model, prompt_ids, generators, config, drafter,
                          None if drafter is None else rule, batch_size=batch_size)
    results = [
        GenerateResult(text=response_text(target_model, gen), token_ids=list(gen.token_ids),
                       prompt_ids=ids, stats=gen.stats(max_new_tokens=max_new_tokens,
                                                       k=None if drafter is None or shape else k),
                       generation=gen)
        for ids, gen in zip(prompt_ids, gens)
    ]
    return results if several else results[0]
