"""The server's settings (`verispec serve` flags), validated at start, and the operator's guardrails.

Nothing here needs the `serve` extra: the CLI and Ray's driver validate settings before anything loads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from verispec import defaults
from verispec.api import parse_draft_shape
from verispec.logprobs import MODES
from verispec.rules import Rule
from verispec.tree_decode import shape_nodes, tree_verification_rule
from verispec.trees import DraftShape, DynamicTree

MAX_SEED = 2**63 - 1

# ServeConfig field -> the `verispec serve` flag that sets it (named in every error)
FLAGS = {"k": "--k", "max_k": "max_k", "max_queue": "--max-queue", "max_batch": "--max-batch",
         "max_tokens_limit": "--max-tokens-limit", "default_max_tokens": "--default-max-tokens",
         "max_tv_per_token": "--max-tv-per-token", "max_tv_per_response": "--max-tv-per-response",
         "shutdown_grace": "--shutdown-grace", "max_n": "--max-n", "max_tree_nodes": "--max-tree-nodes",
         "max_body_bytes": "--max-body-bytes", "body_timeout": "--body-timeout",
         "prefill_chunk": "--prefill-chunk"}


def _int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class ServeConfig:
    """Server settings (the `verispec serve` flags). Invalid settings raise ValueError naming the flag,
    so a server never starts in a state where every request would hang or be refused."""

    target: str = defaults.TARGET
    draft: str | None = defaults.AUTO_DRAFT  # "auto": the target's default drafter; "none" or None: plain
    rule: str = defaults.RULE  # the server's default rule
    # the default draft tokens per block, or "auto": per block and row from the pair's pass costs, measured
    # at start (`verispec.speculation`; a request's own verification.k pins its k)
    k: int | str = defaults.K
    allow_rules: tuple[str, ...] | None = None  # rule names, families or full specs; None: all
    max_tv_per_token: float | None = None  # refuse rules that cannot certify this per-token TV
    max_tv_per_response: float | None = None  # refuse requests whose certified response TV exceeds this
    allow_greedy_sampling: bool = False  # allow rule "greedy" at temperature > 0 (it ignores the temperature)
    max_queue: int = 64  # requests waiting beyond the free batch rows
    max_batch: int = 32  # rows decoding at once, over all groups
    max_batch_auto: bool = False  # --max-batch not given: max_batch lowered to what the backend holds
    max_tokens_limit: int = 1024  # largest max_tokens accepted
    # a request without max_tokens: vLLM's default, the context left after the prompt (at most
    # max_tokens_limit); an int: that many
    default_max_tokens: int | None = None
    max_k: int = 16
    max_n: int = 8  # largest `n` (choices per request) accepted
    diagnostics: bool = True
    device: str = "cpu"
    dtype: str = "float32"
    draft_dtype: str = "float32"
    served_model_name: str | None = None  # default: the target's name
    shutdown_grace: float = 10.0  # seconds decoding rows get to finish after SIGTERM; then 503 shutting_down
    # the default draft shape (`--tree`: tree:widths=4,2,2,1 or drafts:n=3, any spelling `bench --tree`
    # takes; kept as its canonical spec); None: chain drafts of k tokens. `rule` is then a tree rule.
    tree: str | None = None
    max_tree_nodes: int = 64  # the most drafted nodes a tree block may have (a request's or --tree's)
    max_body_bytes: int = 8 * 2**20  # a larger request body is answered 413 before it is read or parsed
    body_timeout: float = 30.0  # seconds a client has to send its whole body; then 408
    api_key: str | None = None  # requests must send "Authorization: Bearer KEY" (all but /health); None: open
    allowed_origins: tuple[str, ...] = ()  # CORS: browser origins allowed to call the API ("*": any)
    metrics_names: str = "verispec"  # /metrics namespace: "verispec", or "vllm" for vLLM's metric names
    # what OpenAI's logprobs fields show (vLLM's logprobs_mode, `verispec.logprobs.MODES`): the raw model's
    # log-probabilities by default; behaviour_logprobs and the sums stay in verispec's own fields
    logprobs_mode: str = "raw_logprobs"
    # a prompt longer than this is fed to the caches this many tokens per engine step, beside the other
    # rows' blocks (`DecodeConfig.prefill_chunk`): it cannot hold them up, and a client that leaves stops
    # it at the next chunk; 0: in one pass
    prefill_chunk: int = 256
    max_prompt_tokens: int | None = None  # longer prompts get 400; None: the model's context is the limit

    def __post_init__(self):
        for name, low in (("max_k", 1), ("max_queue", 0), ("max_batch", 1), ("max_tokens_limit", 1),
                          ("max_n", 1), ("max_tree_nodes", 1), ("max_body_bytes", 1), ("prefill_chunk", 0)):
            value = getattr(self, name)
            if not _int(value) or value < low:
                raise ValueError(f"{FLAGS[name]} must be an integer >= {low}, got {value!r}")
        if self.k == "auto":
            if self.draft in (None, defaults.NO_DRAFT):
                raise ValueError("--k auto chooses how many tokens to draft; a server without a drafter "
                                 "(--draft none) drafts none")
            if self.tree is not None:
                raise ValueError("--k auto chooses a chain's k; it does not apply to --tree drafts")
        elif not _int(self.k) or not 1 <= self.k <= self.max_k:
            raise ValueError(f"--k must be an integer in [1, {self.max_k}] or auto, got {self.k!r}")
        m = self.max_prompt_tokens
        if m is not None and (not _int(m) or m < 1):
            raise ValueError(f"--max-prompt-tokens must be an integer >= 1, got {m!r}")
        d = self.default_max_tokens
        if d is not None and (not _int(d) or not 1 <= d <= self.max_tokens_limit):
            raise ValueError(f"--default-max-tokens must be an integer in [1, --max-tokens-limit = "
                             f"{self.max_tokens_limit}], got {d!r} (raise --max-tokens-limit, or lower it)")
        for name in ("max_tv_per_token", "max_tv_per_response"):
            cap = getattr(self, name)
            if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float))
                                    or not 0 <= cap <= 1):
                raise ValueError(f"{FLAGS[name]} must be a total variation in [0, 1], got {cap!r}")
        g = self.shutdown_grace
        if isinstance(g, bool) or not isinstance(g, (int, float)) or not (math.isfinite(g) and g >= 0):
            raise ValueError(f"--shutdown-grace must be a number of seconds >= 0, got {g!r}")
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key.strip()):
            raise ValueError("--api-key must be a non-empty string")
        t = self.body_timeout
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not (math.isfinite(t) and t > 0):
            raise ValueError(f"--body-timeout must be a number of seconds > 0, got {t!r}")
        if self.logprobs_mode not in MODES:
            raise ValueError(f"--logprobs-mode must be one of {', '.join(MODES)}, got {self.logprobs_mode!r}")
        if self.metrics_names not in ("verispec", "vllm"):
            raise ValueError(f"--metrics-names must be verispec or vllm, got {self.metrics_names!r}")
        if self.allow_rules is not None and not self.allow_rules:
            raise ValueError("--allow-rules needs at least one rule name, family or spec")
        if self.tree is not None:
            self._check_tree()

    @property
    def adaptive(self) -> bool:
        """--k auto: speculation adapts to the load (`verispec.speculation.AdaptivePolicy`)."""
        return self.k == "auto"

    @property
    def k_default(self) -> int:
        """A request's k when it gives none: --k, or with --k auto the widest block it may choose."""
        return min(defaults.AUTO_K_MAX, self.max_k) if self.adaptive else self.k

    def _check_tree(self) -> None:
        """--tree: a well-formed shape, a drafter, a tree rule as --rule, at most --max-tree-nodes nodes
        (what needs the models, a width above the vocabulary or a depth over the context, is checked by
        the server once they load). Keeps the shape's canonical spec."""
        try:
            shape = parse_draft_shape(self.tree)
        except (ValueError, TypeError) as err:
            raise ValueError(f"--tree: {err}") from None
        object.__setattr__(self, "tree", shape.spec)
        if self.draft in (None, defaults.NO_DRAFT):
            raise ValueError(f"--tree {shape.spec} needs a draft model; --draft none serves plain decoding")
        try:
            tree_verification_rule(self.rule, shape)
        except ValueError as err:
            raise ValueError(f"--rule '{self.rule}' with --tree {shape.spec}: {err}") from None
        check_tree_nodes(shape, self.k, self.max_tree_nodes, "--tree")

    @property
    def draft_shape(self) -> DraftShape | None:
        """The default draft shape (`tree`), parsed; None: chain drafts."""
        return None if self.tree is None else parse_draft_shape(self.tree)


DYNAMIC_POOL_FACTOR = 8  # a dynamic tree may create up to 8 x --max-tree-nodes candidates while drafting


def check_tree_nodes(shape: DraftShape, k: int, limit: int, where: str) -> None:
    """ValueError unless a full block of `shape` (k: the depth of drafts:n without one) drafts at most
    `limit` nodes (--max-tree-nodes): a tree's target pass grows with its nodes. A dynamic tree keeps
    `nodes` of a candidate pool it builds while drafting (topk + (depth - 1) topk^2 nodes, a draft pass
    scoring up to topk * depth + 1 of them): the pool is bounded too, by DYNAMIC_POOL_FACTOR x `limit`,
    so one request cannot ask for billions of candidates (tree:nodes=1,depth=400,topk=4000)."""
    nodes = shape_nodes(shape, k)
    if nodes > limit:
        raise ValueError(f"{where} {shape.spec} drafts {nodes} nodes per block, more than this server's "
                         f"--max-tree-nodes {limit}: use fewer or narrower levels (or fewer drafts)")
    if isinstance(shape, DynamicTree) and shape.candidates(shape.depth) > DYNAMIC_POOL_FACTOR * limit:
        raise ValueError(f"{where} {shape.spec} creates {shape.candidates(shape.depth)} candidates per block "
                         f"while drafting, more than {DYNAMIC_POOL_FACTOR} x this server's --max-tree-nodes "
                         f"{limit}: use a smaller topk or depth")


def check_port(port) -> int:
    """A TCP port to listen on: 1..65535 (uvicorn would take 99999 and listen on some other port)."""
    if not _int(port) or not 1 <= port <= 65535:
        raise ValueError(f"--port must be an integer in [1, 65535], got {port!r}")
    return port


class APIError(Exception):
    """An error returned to the client in OpenAI's shape."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def shutting_down(detail: str) -> APIError:
    """503 `shutting_down` (OpenAI's shape): the server stops; the client may retry elsewhere or later."""
    return APIError(503, f"the server is shutting down: {detail}", code="shutting_down", kind="server_error",
                    headers={"Retry-After": "1"})


# -- operator guardrails ---------------------------------------------------------------------------


def certifiable_tv(rule: Rule | None) -> float | None:
    """The per-token TV to the target a rule certifies whatever the prefix: 0 for lossless rules and
    plain decoding, `tv` for `budget`, None (no bound) for the others."""
    if rule is None or rule.lossless is True:
        return 0.0
    if rule.name == "budget":
        return float(rule.tv)
    return None


def check_policy(rule: Rule | None, config: ServeConfig) -> None:
    """Raise APIError (400) if the operator's guardrails refuse `rule` (None: plain decoding)."""
    if rule is None:
        return
    if config.allow_rules is not None:
        allowed = set(config.allow_rules)
        if not ({rule.name, rule.family, rule.spec} & allowed):
            raise APIError(400, f"rule '{rule.spec}' is not allowed on this server; allowed rules "
                                f"(names, families or specs): {', '.join(config.allow_rules)}",
                           "verification.rule", "rule_not_allowed")
    if config.diagnostics and getattr(rule, "block_level", False) and not rule.lossless:
        raise APIError(400, f"rule '{rule.spec}' is block-level and lossy: it has no per-position law for "
                            "this server's diagnostics (serve it with --no-diagnostics)",
                       "verification.rule", "rule_without_per_token_law")
    cap = config.max_tv_per_token
    if cap is not None:
        tv = certifiable_tv(rule)
        if tv is None or tv > cap:
            raise APIError(400, f"rule '{rule.spec}' cannot certify a per-token TV to the target <= {cap:g} "
                                f"(this server's --max-tv-per-token); use e.g. 'budget:tv={cap:g},ratio=2' "
                                "or 'lossless'", "verification.rule", "rule_not_certifiable")
