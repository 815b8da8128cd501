"""A lean forward pass for Llama-architecture models (Touvron et al. 2023), for decoding speed.

Also Qwen2 (`supports`): the same block with q/k/v biases, untied head, rope_theta from the config.

Same maths as transformers' `LlamaForCausalLM` (RMSNorm, rotary embeddings with the default RoPE,
grouped-query attention, SwiGLU MLP, optionally tied head), from the same weights, but laid out for
batch-1 decoding on a CPU: q/k/v and gate/up projections are fused into one matmul each, rotary
tables are precomputed, and the KV cache is a preallocated buffer per layer, so a rollback after
rejected draft tokens is just a shorter length (no copy). Tests check its logits against the
transformers model it wraps.

Matmuls: decoding reads every weight once per forward pass, so it is memory-bound, and the layout
decides the speed. Measured on this project's CPUs (benchmarks/RESULTS.md): in fp32 a single-token
step is fastest as `x @ W^T` with W^T stored contiguous (a GEMV), a pass over k+1 tokens (the
verification pass) with oneDNN's prepacked weights, where MKL's small-M GEMM behind `F.linear`
reads the weights at a third of the bandwidth; in bf16 oneDNN's packed kernel is the fastest for
every row count (a CPU with bf16 units: 'bf16 and int4 in the lean forward'). `Linear` keeps both
layouts in fp32 (2x weight memory), the packed one only in bf16, and falls back to `F.linear` where
oneDNN is unavailable (or on a GPU).
Int4 weights: `verispec.models.int4`.

Batched decoding (`LeanBatchCache`, `forward_batch`, `LeanBatchSession`): many rows in one forward
pass, each row at its own position in its own cache slot (per-row RoPE, scattered key/value writes,
a per-row causal mask). Batch 1 keeps `LeanSession`, which skips that bookkeeping.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from verispec.models.base import CachedSession, check_batch_request
from verispec.models.int4 import DENSE_ABOVE, Int4Linear, Int4Plan
from verispec.models.int4 import available as int4_kernels


def supports(model) -> bool:
    """Whether `model` is a Llama-style model this lean pass reproduces exactly: Llama, or Qwen2
    (Qwen Team 2024: Llama's block with q/k/v biases, no o_proj bias, its own RoPE base, optionally
    an untied head) when no layer uses sliding-window attention."""
    cfg = model.config
    rope = getattr(cfg, "rope_parameters", None) or {}
    kind = getattr(cfg, "model_type", "")
    if kind == "qwen2":
        # transformers 5.24: layer_types marks sliding layers only when use_sliding_window is set
        layer_types = getattr(cfg, "layer_types", None) or []
        if getattr(cfg, "use_sliding_window", False) or any(t != "full_attention" for t in layer_types):
            return False
    elif kind != "llama":
        return False
    return (rope.get("rope_type", "default") == "default" and "rope_theta" in rope
            and getattr(cfg, "hidden_act", "silu") == "silu" and not getattr(cfg, "pretraining_tp", 1) > 1)


class Linear:
    """y = x W^T (+ b) for x [..., m, in], choosing the kernel by rows and dtype (module docstring)."""

    def __init__(self, weight: Tensor, bias: Tensor | None = None):
        self.bias = bias
        self.packed = self._pack(weight)
        self.weight_t = self.weight = None
        if self.packed is not None and weight.dtype == torch.bfloat16:
            pass  # bf16 runs the packed kernel for every row count: no second copy of the weights
        elif weight.device.type == "cpu":
            self.weight_t = weight.t().contiguous()  # [in, out]: fp32 one-row steps (a GEMV)
        else:
            self.weight = weight

    @staticmethod
    def _pack(weight: Tensor) -> Tensor | None:
        if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
            return None
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, 8)
            probe = torch.randn(3, weight.shape[1], dtype=weight.dtype)
            got = torch.ops.mkldnn._linear_pointwise(probe, packed, None, "none", [], "")
            want = probe.float() @ weight.float().t()
            if (got.float() - want).abs().max() > 1e-2 * (want.abs().max() + 1):
                return None  # a kernel that disagrees is not used
            return packed
        except (RuntimeError, AttributeError):
            return None

    def __call__(self, x: Tensor) -> Tensor:
        # Kernel by the GEMM's row count M = B*m, not m: [B, 1, in] with B > 1 is a small-M GEMM,
        # where `x @ W^T` leaves MKL's GEMV path. Measured (`python benchmarks/kernels/batch_forward.py
        # --kernels`, benchmarks/RESULTS.md "Batched forward passes"; the default target's five
        # weight shapes summed, median us, x @ W^T vs packed), 1 thread: M=1 875 vs 2926, M=2 1899 vs
        # 2817, M=4 5465 vs 3821, M=16 8591 vs 5414, M=64 16415 vs 12145; 2 threads (a loaded
        # machine, an ad-hoc run of the same loop): M=1 637 vs 15411, M=4 29564 vs 14601, M=64 30714
        # vs 14998. So in fp32 the GEMV for M == 1 and oneDNN packed above (M = 2-3 on one thread is
        # the one mild loss), as for batch 1. bf16 takes oneDNN packed for every M (`python
        # benchmarks/kernels/int4_kernels.py`: one row 106 ms packed vs 238 ms x @ W^T over a 1.5B's layers).
        if self.packed is not None and (self.weight_t is None or x.numel() > x.shape[-1]):
            flat = x.reshape(-1, x.shape[-1])  # [B*m, in]
            y = torch.ops.mkldnn._linear_pointwise(flat, self.packed, self.bias, "none", [], "")
            return y.view(*x.shape[:-1], -1)  # [B, m, out]
        if self.weight_t is None:
            return F.linear(x, self.weight, self.bias)
        y = x @ self.weight_t
        return y if self.bias is None else y + self.bias


class PartsLinear:
    """y = x [W_1; W_2; ...]^T (+ b) straight from the parts' own tensors (a fused projection's q, k and v,
    or gate and up, as transformers holds them), with no fused copy: an int4 projection's dense twin for
    prompts (`verispec.models.int4.Int4Linear`). The tensors are the loaded model's, so a model loaded
    from safetensors keeps them as the file's memory-mapped pages (shared between processes, reclaimable)
    instead of private memory."""

    def __init__(self, weights: Sequence[Tensor], bias: Tensor | None = None):
        self.weights = list(weights)  # each [out_i, in]
        sizes = [w.shape[0] for w in self.weights]
        self.biases = [None] * len(sizes) if bias is None else list(bias.split(sizes))

    def __call__(self, x: Tensor) -> Tensor:
        parts = [F.linear(x, w, b) for w, b in zip(self.weights, self.biases)]  # each [..., out_i]
        return parts[0] if len(parts) == 1 else torch.cat(parts, -1)  # [..., out]


SHARE_ABOVE = 500_000_000  # parameters; see `_alias`


def _alias(param: torch.nn.Parameter, linear: Linear, lo: int, hi: int) -> None:
    """Point a transformers weight [out, in] at rows lo..hi of `linear`'s stored W^T (a view, same
    values), so the wrapped model and the lean pass hold one copy instead of two (a 1.5B model in fp32
    is 7 GB per copy, its 0.5B draft 2.5 GB: both must fit in 24 GB beside oneDNN's packed copies).
    Only where the dtype and device already agree (no rounding, no move) and `linear` keeps a W^T (fp32:
    bf16 keeps oneDNN's packed copy only, so transformers' own tensors are the one other copy). Done for
    models above SHARE_ABOVE parameters only: smaller ones keep transformers' own contiguous layout, so
    its forward (the `hf` backend, the assisted-generation baselines in benchmarks/) is untouched; a
    benchmark timing transformers' forward on a larger model loads a copy that never builds lean
    weights."""
    src = getattr(linear, "weight_t", None)
    if src is None or src.dtype != param.dtype or src.device != param.device or src.is_inference():
        return
    view = src[:, lo:hi].t()  # [out, in], strided
    if view.shape != param.shape:
        return
    with torch.no_grad():
        if not torch.equal(view, param.data):
            raise RuntimeError("lean weight layout disagrees with the transformers weight")
        param.data = view


class LeanLlama:
    """Weights of a transformers Llama model, laid out for a fast incremental forward."""

    def __init__(self, hf_model, dtype: torch.dtype = torch.float32, int4: Int4Plan | None = None,
                 dense_prompts: bool = True, after_layer: Callable[[], object] | None = None):
        """`int4`: which projections to hold as int4 codes (`verispec.models.int4`; bf16 compute only).
        `dense_prompts`: int4 projections keep transformers' dense tensors as twins for long context
        passes (fast prompts); False: prompts run the int4 kernel too (slower prompts, and the dense
        tensors are never read after the build: the low-memory models). `after_layer`: called once
        each layer is built (the low-memory models drop the file pages it read: a lower peak)."""
        if not supports(hf_model):
            raise ValueError("the lean backend supports Llama and Qwen2 (no sliding window) models with "
                             f"default RoPE, got {hf_model.config.model_type}")
        if int4 is not None and (dtype != torch.bfloat16 or not int4_kernels()):
            raise ValueError("int4 weights need bf16 compute and torch's CPU int4 kernels "
                             f"(dtype {dtype}, kernels available: {int4_kernels()})")
        cfg = hf_model.config
        share = sum(p.numel() for p in hf_model.parameters()) > SHARE_ABOVE  # one weight copy (`_alias`)
        self.int4 = int4 is not None
        self.dtype = dtype
        self.device = hf_model.get_output_embeddings().weight.device
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.eps = cfg.rms_norm_eps
        inner = hf_model.model
        cast = lambda t: t.detach().to(dtype)  # noqa: E731

        def linear(names: list[str], parts: list[Tensor], bias: Tensor | None = None,
                   prefill: bool = True) -> Linear | Int4Linear:
            """The (fused) projection of `parts` (transformers' weights, each [out_i, in]): dense, or int4
            codes where the plan gives them, with the parts themselves as the dense twin for prompts when
            `prefill` (`Int4Linear`; not for the head, whose rows are the logits asked for, not a feed)."""
            fused = cast(parts[0] if len(parts) == 1 else torch.cat(parts))  # [out, in]
            codes = None if int4 is None else int4(names, fused)
            if codes is None:
                return Linear(fused, bias)
            twin = PartsLinear([cast(p) for p in parts], bias) if prefill and dense_prompts else None
            return Int4Linear(*codes, bias, dense=twin)

        self.embed = cast(inner.embed_tokens.weight)
        self.layers = []
        for i, layer in enumerate(inner.layers[: cfg.num_hidden_layers]):
            att, mlp = layer.self_attn, layer.mlp
            bias = None
            if att.q_proj.bias is not None:
                bias = cast(torch.cat([att.q_proj.bias, att.k_proj.bias, att.v_proj.bias]))
            name = f"model.layers.{i}.{{}}.weight".format
            self.layers.append({
                "norm_in": cast(layer.input_layernorm.weight),
                "norm_post": cast(layer.post_attention_layernorm.weight),
                "qkv": linear([name(f"self_attn.{x}_proj") for x in "qkv"],
                              [att.q_proj.weight, att.k_proj.weight, att.v_proj.weight], bias),
                "o": linear([name("self_attn.o_proj")], [att.o_proj.weight],
                            None if att.o_proj.bias is None else cast(att.o_proj.bias)),
                "gate_up": linear([name("mlp.gate_proj"), name("mlp.up_proj")],
                                  [mlp.gate_proj.weight, mlp.up_proj.weight]),
                "down": linear([name("mlp.down_proj")], [mlp.down_proj.weight]),
            })
            if mlp.gate_proj.bias is not None:
                raise ValueError("the lean backend does not support MLP biases")
            if after_layer is not None:
                after_layer()
            w = self.layers[-1]
            nq, nkv = self.n_heads * self.head_dim, self.n_kv * self.head_dim
            if not share:
                continue
            _alias(att.q_proj.weight, w["qkv"], 0, nq)
            _alias(att.k_proj.weight, w["qkv"], nq, nq + nkv)
            _alias(att.v_proj.weight, w["qkv"], nq + nkv, nq + 2 * nkv)
            _alias(att.o_proj.weight, w["o"], 0, att.o_proj.weight.shape[0])
            inter = mlp.gate_proj.weight.shape[0]
            _alias(mlp.gate_proj.weight, w["gate_up"], 0, inter)
            _alias(mlp.up_proj.weight, w["gate_up"], inter, 2 * inter)
            _alias(mlp.down_proj.weight, w["down"], 0, mlp.down_proj.weight.shape[0])
        self.norm = cast(inner.norm.weight)
        head = hf_model.get_output_embeddings().weight
        self.head = linear(["lm_head.weight"], [head], prefill=False)
        if share and head is not inner.embed_tokens.weight:  # a tied head stays the embedding's own tensor
            _alias(head, self.head, 0, head.shape[0])
        theta = cfg.rope_parameters["rope_theta"]
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float,
                                                      device=self.device)
                                         / self.head_dim))
        self._rope(max(256, cfg.max_position_embeddings))

    def _rope(self, length: int) -> None:
        positions = torch.arange(length, dtype=torch.float, device=self.device)
        freqs = positions[:, None] * self.inv_freq[None]  # [L, hd/2]
        emb = torch.cat([freqs, freqs], -1)  # [L, hd]
        self.cos, self.sin = emb.cos().to(self.dtype), emb.sin().to(self.dtype)

    def _rms(self, x: Tensor, weight: Tensor) -> Tensor:
        xf = x.float()
        return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)

    @staticmethod
    def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
        return x * cos + rotated * sin

    def forward(self, tokens: Tensor, cache: LeanCache) -> Tensor:
        """tokens [B, m] at positions cache.length .. +m -> logits [B, m, V] (float32); extends the cache."""
        return self.logits(self.hidden(tokens, cache))

    def logits(self, hidden: Tensor) -> Tensor:
        """Final norm and head: hidden [..., d] -> logits [..., V] float32 on the CPU (rule maths run
        there)."""
        return self.head(self._rms(hidden, self.norm)).float().cpu()

    def context(self, tokens: Tensor, cache) -> None:
        """Feed positions whose logits nobody asked for (a prompt before its last token) into the cache,
        through int4 projections' dense twins when longer than DENSE_ABOVE (`verispec.models.int4`)."""
        self.hidden(tokens, cache, dense=tokens.shape[1] > DENSE_ABOVE)

    def hidden(self, tokens: Tensor, cache, dense: bool = False) -> Tensor:
        """tokens [B, m] at positions cache.length .. +m -> last hidden states [B, m, d]; extends the
        cache (a `LeanCache`, or `_SlotView` of one row of a `LeanBatchCache`). `dense`: int4 projections
        use their dense twins (a long context pass, `verispec.models.int4.Int4Linear`)."""
        mm = (lambda lin: getattr(lin, "dense", None) or lin) if dense else (lambda lin: lin)  # noqa: E731
        b, m = tokens.shape
        start = cache.length
        end = start + m
        cache.reserve(end)
        if end > self.cos.shape[0]:
            self._rope(2 * end)
        cos, sin = self.cos[start:end], self.sin[start:end]  # [m, hd]
        nq, nkv, hd = self.n_heads * self.head_dim, self.n_kv * self.head_dim, self.head_dim
        mask = None
        if m > 1:  # causal among the new tokens; every new token sees the whole cached prefix
            positions = torch.arange(end, device=self.device)
            mask = positions[None, :] <= positions[start:, None]  # [m, end]
        x = self.embed[tokens.to(self.device)]  # [B, m, d]
        for i, w in enumerate(self.layers):
            h = self._rms(x, w["norm_in"])
            qkv = mm(w["qkv"])(h)  # [B, m, nq + 2 nkv]
            q = qkv[..., :nq].view(b, m, self.n_heads, hd).transpose(1, 2)  # [B, H, m, hd]
            k = qkv[..., nq : nq + nkv].view(b, m, self.n_kv, hd).transpose(1, 2)  # [B, Hkv, m, hd]
            v = qkv[..., nq + nkv :].view(b, m, self.n_kv, hd).transpose(1, 2)
            q, k = self._rotate(q, cos, sin), self._rotate(k, cos, sin)
            keys, values = cache.write(i, start, k, v)  # [B, Hkv, end, hd]
            att = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask,
                                                 enable_gqa=self.n_kv != self.n_heads)
            x = x + mm(w["o"])(att.transpose(1, 2).reshape(b, m, nq))  # [B, m, d]
            h = self._rms(x, w["norm_post"])
            gate, up = mm(w["gate_up"])(h).chunk(2, -1)
            x = x + mm(w["down"])(F.silu(gate) * up)
        cache.length = end
        return x


class LeanCache:
    """Preallocated keys/values per layer: [B, Hkv, capacity, hd], grown by doubling."""

    def __init__(self, model: LeanLlama, batch: int = 1, capacity: int = 512):
        self.model, self.batch, self.length = model, batch, 0
        shape = (batch, model.n_kv, capacity, model.head_dim)
        self.k = [torch.empty(shape, dtype=model.dtype, device=model.device) for _ in model.layers]
        self.v = [torch.empty(shape, dtype=model.dtype, device=model.device) for _ in model.layers]

    def reserve(self, length: int) -> None:
        capacity = self.k[0].shape[2]
        if length <= capacity:
            return
        new = max(length, 2 * capacity)
        for store in (self.k, self.v):
            for i, old in enumerate(store):
                grown = torch.empty((*old.shape[:2], new, old.shape[3]), dtype=old.dtype, device=old.device)
                grown[:, :, : self.length] = old[:, :, : self.length]
                store[i] = grown

    def write(self, layer: int, start: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        end = start + k.shape[2]
        self.k[layer][:, :, start:end] = k
        self.v[layer][:, :, start:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]


class LeanSession(CachedSession):
    def __init__(self, owner, lean: LeanLlama):
        super().__init__()
        self.owner, self.lean = owner, lean
        self.cache = LeanCache(lean)
        self.split_context = lean.int4

    def _crop(self, length: int) -> None:
        self.cache.length = min(self.cache.length, length)  # the buffer keeps its storage

    @torch.inference_mode()
    def _feed(self, tokens: Tensor) -> Tensor:
        self.owner.calls += 1
        return self.lean.forward(tokens, self.cache)

    @torch.inference_mode()
    def _feed_context(self, tokens: Tensor) -> None:
        self.owner.calls += 1
        self.lean.context(tokens, self.cache)


# -- batched: many rows in one forward pass, each row with its own cache length ----------------------


class LeanBatchCache:
    """Keys/values for R row slots per layer, [R, Hkv, capacity, hd], and per-slot lengths [R].

    Rolling a row back is a shorter length; rows take a free slot (`acquire`) and give it back
    (`release`). Capacity and slot count grow by doubling, from one slot (a batch of one, the common
    single-prompt call, zeroes no buffers it does not use). Buffers start zeroed, so masked keys and
    values beyond a row's length are always finite (a masked score is exactly 0 after the softmax;
    0 * NaN would not be).
    """

    def __init__(self, model: LeanLlama, slots: int = 1, capacity: int = 256):
        self.model = model
        shape = (slots, model.n_kv, capacity, model.head_dim)
        self.k = [torch.zeros(shape, dtype=model.dtype, device=model.device) for _ in model.layers]
        self.v = [torch.zeros(shape, dtype=model.dtype, device=model.device) for _ in model.layers]
        self.lengths = torch.zeros(slots, dtype=torch.long)  # [R], on the CPU
        self._free = list(range(slots))

    @property
    def slots(self) -> int:
        return self.k[0].shape[0]

    @property
    def capacity(self) -> int:
        return self.k[0].shape[2]

    @torch.inference_mode(False)  # ordinary tensors even when grown inside a pass (see LeanBatchSession)
    def _grow(self, slots: int, capacity: int) -> None:
        old_slots, old_cap = self.slots, self.capacity
        for store in (self.k, self.v):
            for i, old in enumerate(store):
                grown = old.new_zeros((slots, old.shape[1], capacity, old.shape[3]))
                grown[:old_slots, :, :old_cap] = old
                store[i] = grown
        if slots > old_slots:
            self.lengths = torch.cat([self.lengths, self.lengths.new_zeros(slots - old_slots)])
            self._free += list(range(old_slots, slots))

    def reserve(self, length: int) -> None:
        """Room for positions 0 .. length-1 in every slot."""
        if length > self.capacity:
            self._grow(self.slots, max(length, 2 * self.capacity))

    def acquire(self) -> int:
        """A free slot (the lowest, so active rows stay packed), its length 0."""
        if not self._free:
            self._grow(2 * self.slots, self.capacity)
        slot = min(self._free)
        self._free.remove(slot)
        self.lengths[slot] = 0
        return slot

    def release(self, slot: int) -> None:
        if slot in self._free or not 0 <= slot < self.slots:
            raise ValueError(f"slot {slot} is not in use")
        self.lengths[slot] = 0
        self._free.append(slot)


class _SlotView:
    """One slot of a `LeanBatchCache` seen as a batch-1 `LeanCache`, so a batch of one row runs
    `LeanLlama.hidden` (contiguous writes, no per-row RoPE gather or mask) on the batch cache."""

    def __init__(self, cache: LeanBatchCache, slot: int):
        self.cache, self.slot = cache, slot

    @property
    def length(self) -> int:
        return int(self.cache.lengths[self.slot])

    @length.setter
    def length(self, value: int) -> None:
        self.cache.lengths[self.slot] = value

    def reserve(self, length: int) -> None:
        self.cache.reserve(length)

    def write(self, layer: int, start: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        end, row = start + k.shape[2], slice(self.slot, self.slot + 1)
        keys, values = self.cache.k[layer], self.cache.v[layer]  # [R, Hkv, capacity, hd]
        keys[row, :, start:end] = k
        values[row, :, start:end] = v
        return keys[row, :, :end], values[row, :, :end]  # [1, Hkv, end, hd]


def forward_batch(lean: LeanLlama, tokens: Tensor, counts: Tensor, slots: Tensor, cache: LeanBatchCache,
                  keep: Tensor | None = None) -> Tensor:
    """One forward pass over several cache slots, each row at its own position.

    tokens [B, m]: right-padded new tokens, row b's first counts[b] are real (m = max counts), fed at
    positions cache.lengths[slots[b]] + j. Keys/values are scattered at each row's own positions and
    query j of row b attends to keys 0 .. start_b + j of its slot only (mask [B, 1, m, L]); padded
    queries are computed and discarded (their keys sit beyond the row's new length, which no real
    query sees). keep: flat indices into the B*m positions whose logits are wanted (default all).
    Returns logits [len(keep), V] float32 on the CPU; cache.lengths[slots] += counts.
    """
    b, m = tokens.shape
    dev = lean.device
    if b == 1:  # one row: the batch-1 pass over its slot, logits only where wanted
        x = lean.hidden(tokens, _SlotView(cache, int(slots[0])))[0]  # [m, d]
        return lean.logits(x if keep is None else x[keep.to(dev)])  # [K, V]
    starts = cache.lengths[slots]  # [B]
    steps = torch.arange(m)
    positions = starts[:, None] + steps[None]  # [B, m], padded ones included
    length = int(positions[:, -1].max()) + 1  # keys 0 .. L-1 cover every row's (padded) positions
    cache.reserve(length)
    if length > lean.cos.shape[0]:
        lean._rope(2 * length)
    pos_dev = positions.to(dev)
    cos, sin = lean.cos[pos_dev][:, None], lean.sin[pos_dev][:, None]  # [B, 1, m, hd]
    keys_at = torch.arange(length)
    mask = (keys_at[None, None, :] <= positions[:, :, None])[:, None].to(dev)  # [B, 1, m, L]
    slot_dev = slots.to(dev)
    first = int(slots[0])
    packed = bool((slots == torch.arange(first, first + b)).all())  # a slice view instead of a gather
    nq, nkv, hd = lean.n_heads * lean.head_dim, lean.n_kv * lean.head_dim, lean.head_dim
    gqa = lean.n_kv != lean.n_heads
    x = lean.embed[tokens.to(dev)]  # [B, m, d]
    for i, w in enumerate(lean.layers):
        h = lean._rms(x, w["norm_in"])
        qkv = w["qkv"](h)  # [B, m, nq + 2 nkv]
        q = qkv[..., :nq].view(b, m, lean.n_heads, hd).transpose(1, 2)  # [B, H, m, hd]
        k = qkv[..., nq : nq + nkv].view(b, m, lean.n_kv, hd).transpose(1, 2)  # [B, Hkv, m, hd]
        v = qkv[..., nq + nkv :].view(b, m, lean.n_kv, hd)  # [B, m, Hkv, hd]
        q, k = lean._rotate(q, cos, sin), lean._rotate(k, cos, sin)
        # scatter: cache[slot_b, :, start_b + j] = key j of row b (advanced indices first: [B, m, Hkv, hd])
        cache.k[i][slot_dev[:, None], :, pos_dev] = k.transpose(1, 2)
        cache.v[i][slot_dev[:, None], :, pos_dev] = v
        rows = slice(first, first + b) if packed else slot_dev
        keys, values = cache.k[i][rows, :, :length], cache.v[i][rows, :, :length]  # [B, Hkv, L, hd]
        att = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=gqa)
        x = x + w["o"](att.transpose(1, 2).reshape(b, m, nq))  # [B, m, d]
        h = lean._rms(x, w["norm_post"])
        gate, up = w["gate_up"](h).chunk(2, -1)
        x = x + w["down"](F.silu(gate) * up)
    cache.lengths[slots] = starts + counts
    x = x.reshape(b * m, -1)  # [B*m, d]
    return lean.logits(x if keep is None else x[keep.to(dev)])  # [K, V]


class LeanBatchSession:
    """`BatchSession` over a `LeanBatchCache`: per row, keep the longest cached prefix agreeing with
    the requested tokens (a rollback is a shorter length), then feed the rest of all rows in ONE
    `forward_batch` pass. Rows are sorted by slot, so a packed set of slots attends through views."""

    def __init__(self, owner, lean: LeanLlama):
        self.owner, self.lean = owner, lean
        self.cache = LeanBatchCache(lean)
        self._slot: dict[int, int] = {}
        self._cached: dict[int, Tensor] = {}

    def cached(self, row: int) -> Tensor:
        """The token ids row `row`'s cache holds, [length]."""
        return self._cached.get(row, torch.zeros(0, dtype=torch.long))

    def release(self, row: int) -> None:
        slot = self._slot.pop(row, None)
        self._cached.pop(row, None)
        if slot is not None:
            self.cache.release(slot)

    def slot(self, row: int) -> int:
        """Row `row`'s cache slot (a fresh one, length 0, for a row seen for the first time)."""
        if row not in self._slot:
            self._slot[row] = self.cache.acquire()
            self._cached[row] = torch.zeros(0, dtype=torch.long)
        return self._slot[row]

    def set_cached(self, row: int, tokens: Tensor) -> None:
        """Record that row `row`'s cache now holds `tokens` [length] (its slot's length must match):
        for passes that write the cache themselves (`verispec.models.lean_tree.score_tree`)."""
        slot = self.slot(row)
        if int(self.cache.lengths[slot]) != tokens.shape[0]:
            raise ValueError(f"row {row}: the cache holds {int(self.cache.lengths[slot])} positions, "
                             f"not the {tokens.shape[0]} tokens given")
        self._cached[row] = tokens.to(torch.long).cpu().clone()

    # inference_mode, not no_grad: no autograd view/version bookkeeping per op (measured: no_grad cost the
    # default pair's batch-1 decoding 12% more instructions, benchmarks/RESULTS.md "One engine"). The
    # cache's buffers stay ordinary tensors (created outside, grown with inference mode off), so rows can
    # be rolled back, compacted and released outside it; the logits returned are inference tensors,
    # read-only to callers (as the batch-1 loop's always were).
    @torch.inference_mode()
    def logits_for(self, rows: Sequence[int], tokens: Sequence[Tensor], n: Sequence[int]) -> list[Tensor]:
        check_batch_request(rows, tokens, n)
        feeds, slots, fresh = [], [], []
        for row, seq, count in zip(rows, tokens, n):
            seq = seq.to(torch.long).cpu()
            if row not in self._slot:
                self._slot[row] = self.cache.acquire()
            slot = self._slot[row]
            held = self._cached.get(row, seq[:0])
            fresh.append(held.shape[0] == 0)
            common = min(held.shape[0], seq.shape[0] - count)
            if common > 0:  # length of the agreeing prefix
                same = held[:common] == seq[:common]  # [common]
                common = int(same.to(torch.int64).cumprod(0).sum())
            self.cache.lengths[slot] = common
            feeds.append(seq[common:])
            slots.append(slot)
        # a row joining rows already decoding (continuous batching: an empty cache beside filled ones)
        # would pad every row of the pass to its prompt: its context goes in a pass of its own instead
        # (rows that all start together, a static batch, still share one pass)
        joining = any(fresh) and not all(fresh)
        for i, (feed, count) in enumerate(zip(feeds, n)):
            if feed.shape[0] > count and (self.lean.int4 or joining):
                # int4 projections, or a joining row: the row's context (before its last n) in a pass of
                # its own, as `CachedSession.logits_for` does at batch 1; then every row's last n together
                self.owner.calls += 1
                self.lean.context(feed[None, :-count], _SlotView(self.cache, slots[i]))  # [1, c]
                feeds[i] = feed[-count:]
        self.owner.calls += 1
        if len(rows) == 1:  # one row: the batch-1 pass on its slot, without padding, gathers or index tensors
            x = self.lean.hidden(feeds[0][None], _SlotView(self.cache, slots[0]))[0]  # [m, d]
            self._cached[rows[0]] = tokens[0].to(torch.long).cpu().clone()
            return [self.lean.logits(x[-n[0]:])]  # [n, V]
        order = sorted(range(len(rows)), key=slots.__getitem__)
        counts = torch.tensor([feeds[i].shape[0] for i in order])  # [B]
        width = int(counts.max())
        padded = torch.zeros(len(order), width, dtype=torch.long)  # [B, m], right-padded with token 0
        for b, i in enumerate(order):
            padded[b, : counts[b]] = feeds[i]
        wanted = torch.tensor([n[i] for i in order])  # [B]
        # flat indices (b * m + j) of each row's last n_b real positions, rows in slot order
        ends = torch.arange(len(order)) * width + counts  # [B]
        keep = torch.cat([torch.arange(int(e) - int(w), int(e)) for e, w in zip(ends, wanted)])  # [sum n]
        slot_ids = torch.tensor([slots[i] for i in order])  # [B], ascending
        logits = forward_batch(self.lean, padded, counts, slot_ids, self.cache, keep)  # [sum n, V]
        for row, seq in zip(rows, tokens):
            self._cached[row] = seq.to(torch.long).cpu().clone()
        parts = logits.split(wanted.tolist())  # per row in slot order, [n_b, V]
        out: list[Tensor] = [None] * len(rows)  # type: ignore[list-item]
        for b, i in enumerate(order):
            out[i] = parts[b]
        return out
