"""Weight-only int4 matmuls for the lean forward (bf16 activations), and where their codes come from.

A decoding step reads every weight once, so on a CPU its time is the bytes of weights it reads
(docs/design.md 'Backends'; benchmarks/RESULTS.md 'int4 weights in the lean forward'). Storing a
projection as 4-bit codes with a bf16 scale and zero per group of 32 inputs (the layout of torch's CPU
kernel `_weight_int4pack_mm_for_cpu`) reads about a third of its bf16 bytes. Logits stay float32 over
the whole vocabulary, so every rule's exact law is computed as before, of this model.

Two sources of codes (an `Int4Plan`: the HF names of a (fused) projection and its dense weight ->
codes, scales and mins, or None to keep it dense):

- `Q4KPlan`: the GGUF's own Q4_K codes (llama.cpp's k-quants store, per group of 32 weights,
  w = d * sc * q - dmin * m with q in 0..15), only for tensors the GGUF stores as Q4_K; every other
  tensor (Q6_K, Q5_0, Q8_0, ...) stays dense. So the int4 target reads 4 bits exactly where the file
  has 4 bits, and differs from the bf16 dequantisation only in where it rounds (bf16 scale and zero
  instead of bf16 weights). Checked at load: decoding the codes and rounding to the dense dtype gives the
  dense weight bit for bit, or loading refuses.
- `requantize`: min/max int4 quantisation of any dense weight (group 32, asymmetric). Lossy: meant for
  drafts, whose numerics never change the output law of a lossless rule.

The kernel computes each output row from its own input row only (no split of the reduction by the
row count), so a one-token step and a (k+1)-token verification give bit-identical rows at these
matmuls (tests/test_int4.py). Attention still rounds a query by the query count, so greedy SD equals
greedy decoding but at near ties (docs/design/engine.md, 'Weights and kernels of the lean forward').
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch
from torch import Tensor

GROUP = 32  # inputs per scale/zero pair: a Q4_K sub-block
# rows packed or requantised at a time (bounded temporaries: a 0.5B head is 136M weights); a multiple
# of the kernel's 64-row packing blocks, so packed chunks side by side are the packed whole (tested)
ROWS = 4096
# codes uint8 or int32 [out, in] in 0..15, scales [out, in/32], mins [out, in/32]: w = code * scale + min
Codes = tuple[Tensor, Tensor, Tensor]
Int4Plan = Callable[[Sequence[str], Tensor], "Codes | None"]


def available() -> bool:
    """Whether this torch build has the CPU int4 kernels."""
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")


def supported(out: int, inp: int) -> bool:
    """Shapes the kernel takes: whole groups of 32 inputs, outputs in blocks of 16 (its column tiles)."""
    return inp % GROUP == 0 and out % 16 == 0


def dequantize(codes: Tensor, scales: Tensor, mins: Tensor) -> Tensor:
    """w = q * scale + min per group of 32 inputs, float32 [out, in] (the reference of `Int4Linear`)."""
    out, inp = codes.shape
    groups = codes.view(out, inp // GROUP, GROUP).float()  # [out, in/32, 32]
    return (groups * scales.float()[..., None] + mins.float()[..., None]).view(out, inp)


DENSE_ABOVE = 16  # a context pass longer than this many tokens runs the dense twins (see Int4Linear)


class Int4Linear:
    """y = x W^T (+ b) with W held as int4 codes; x [..., in] bf16 -> y [..., out] bf16.

    torch's kernel works through the rows four at a time, each group costing about one row's time
    (benchmarks/RESULTS.md, 'bf16 and int4 in the lean forward'): cheap for a decoding step or a
    verification of up to 3 drafts, slow for a 166-token prompt (2.5 s on the Qwen 1.5B against 0.22-0.32 s
    in bf16). So a projection may keep `dense`, its dense bf16 weights (`lean.PartsLinear`: the loaded
    model's own tensors, no copy), for *context* positions (those
    whose logits nobody asked for: a prompt before its last token). The lean sessions feed a call's
    context in a pass of its own (`LeanLlama.context`: dense when longer than DENSE_ABOVE tokens), then
    the positions whose logits are wanted in int4: plain decoding and speculative
    decoding split a prompt the same way (all but the last token are context in both), so every
    scored position meets the same kernels whatever else shares its call."""

    def __init__(self, codes: Tensor, scales: Tensor, mins: Tensor, bias: Tensor | None = None,
                 dense: Callable[[Tensor], Tensor] | None = None):
        out, inp = codes.shape
        if not supported(out, inp) or scales.shape != (out, inp // GROUP) or mins.shape != scales.shape:
            raise ValueError(f"int4 weights need in % {GROUP} == 0, out % 16 == 0 and one scale/min per "
                             f"group, got codes {tuple(codes.shape)}, scales {tuple(scales.shape)}, "
                             f"mins {tuple(mins.shape)}")
        if int(codes.min()) < 0 or int(codes.max()) > 15:
            raise ValueError("int4 codes must lie in 0..15")
        self.out_features, self.in_features = out, inp
        pack = torch.ops.aten._convert_weight_to_int4pack_for_cpu
        self.packed = torch.cat([pack(codes[i : i + ROWS].to(torch.int32).contiguous(), 1)  # opaque layout
                                 for i in range(0, out, ROWS)])  # [out, in/2], ROWS rows at a time
        # the kernel's w = (q - 8) * scale + zero, so zero = min + 8 * scale; [in/32, out, 2]
        zeros = mins.float() + 8 * scales.float()
        self.scale_zeros = torch.stack([scales.float(), zeros], -1).transpose(0, 1).contiguous().bfloat16()
        self.bias = None if bias is None else bias.to(torch.bfloat16)
        self.dense = dense

    def __call__(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()  # [B*m, in]
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, GROUP, self.scale_zeros)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)  # [..., out]


MADV_DONTNEED = 4  # Linux <sys/mman.h>


def _libc() -> ctypes.CDLL:
    """The C library (OSError where there is none to load)."""
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def drop_file_pages(*paths: str | Path) -> int:
    """Unmap from this process's resident set the pages of mappings of each file in `paths`, or of files
    under a directory there (a safetensors model's memory-mapped weights, a GGUF read for its codes)
    that hold the file's own bytes, with madvise(MADV_DONTNEED); returns the bytes advised.

    For the low-memory int4 models (`dense_prompts=False`), once the lean forward is built: every int4
    projection then reads its codes only, so the dense tensors transformers mapped from the file are
    never read again, yet the pages the load touched would stay resident (counted in VmRSS) until the
    kernel reclaims them. A dropped page is read again from the page cache (or the file) if anything
    touches it later, with the same bytes, so nothing is lost: torch maps the file copy-on-write
    (rw-p), and a mapping with any page written (`Anonymous` above 0 in /proc/self/smaps: dropping it
    would bring back the file's bytes) is left alone. Linux only; elsewhere, or if /proc is
    unreadable, returns 0."""
    roots = [os.path.realpath(p) for p in paths]
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
        libc = _libc()
    except OSError:
        return 0
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    mappings = []  # [start, end, path, anonymous kB]
    for line in lines:
        fields = line.split(maxsplit=5)  # a mapping: address perms offset dev inode [path]
        if "-" in fields[0] and len(fields) >= 5 and not fields[0].endswith(":"):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            mappings.append([start, end, fields[5].strip() if len(fields) == 6 else "", 0])
        elif fields[0] == "Anonymous:" and mappings:
            mappings[-1][3] = int(fields[1])
    dropped = 0
    for start, end, path, anonymous in mappings:
        inside = any(path == root or path.startswith(root + os.sep) for root in roots)
        if inside and anonymous == 0:
            if libc.madvise(ctypes.c_void_p(start), end - start, MADV_DONTNEED) == 0:
                dropped += end - start
    return dropped


def trim_heap() -> None:
    """Hand the C heap's free memory back to the system (glibc `malloc_trim(0)`; a no-op elsewhere):
    after a low-memory model's build, whose temporaries (float32 copies of each weight) would otherwise
    stay in the process's resident set as free heap."""
    try:
        _libc().malloc_trim(0)
    except (OSError, AttributeError):
        pass


def requantize(names: Sequence[str], weight: Tensor) -> Codes | None:
    """Min/max int4 codes (uint8) of `weight` [out, in], per group of 32 inputs (lossy; for drafts);
    ROWS rows at a time, so the float32 temporaries stay small (each row's codes are its own)."""
    out, inp = weight.shape
    if not supported(out, inp):
        return None
    parts = [_requantize_rows(weight[i : i + ROWS]) for i in range(0, out, ROWS)]
    codes, scales, mins = (torch.cat(list(x)) for x in zip(*parts))
    return codes, scales, mins


def _requantize_rows(weight: Tensor) -> Codes:
    out, inp = weight.shape
    groups = weight.detach().float().view(out, inp // GROUP, GROUP)  # [rows, in/32, 32]
    low, high = groups.amin(-1), groups.amax(-1)
    scales = ((high - low) / 15).clamp(min=torch.finfo(torch.float32).tiny)
    codes = torch.round((groups - low[..., None]) / scales[..., None]).clamp(0, 15).to(torch.uint8)
    return codes.view(out, inp), scales, low


# -- the GGUF's own Q4_K codes -------------------------------------------------------------------

_HF_TO_GGUF = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down"}


def gguf_name(hf_name: str) -> str | None:
    """transformers' parameter name -> llama.cpp's tensor name (model.layers.3.mlp.up_proj.weight ->
    blk.3.ffn_up.weight), or None for one without a counterpart here."""
    if hf_name == "lm_head.weight":
        return "output.weight"
    parts = hf_name.split(".")
    if len(parts) == 6 and parts[:2] == ["model", "layers"] and parts[-1] == "weight":
        short = _HF_TO_GGUF.get(".".join(parts[3:5]))
        return None if short is None else f"blk.{parts[2]}.{short}.weight"
    return None


def q4k_codes(blocks: np.ndarray, rows: int, cols: int) -> Codes:
    """Decode Q4_K super-blocks (uint8 [rows, cols/256 * 144]: f16 d, f16 dmin, 12 bytes of 6-bit scales
    and mins, 128 bytes of 4-bit codes) into codes [rows, cols], scales = d*sc and mins = -dmin*m per 32.
    Same unpacking as the gguf package's Q4_K.dequantize_blocks (llama.cpp's dequantize_row_q4_K), whose
    6-bit scale/min unpacking it calls."""
    from gguf.quants import Q4_K  # the qwen extra

    n = rows * cols // 256
    raw = np.ascontiguousarray(blocks).reshape(n, 144)  # one row per super-block of 256 weights
    d = raw[:, 0:2].copy().view(np.float16).astype(np.float32)  # [n, 1]
    dmin = raw[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, mn = Q4_K.get_scale_min(raw[:, 4:16])  # 8 scales and 8 mins of 6 bits in 12 bytes: [n, 8] each
    qs = raw[:, 16:].reshape(n, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    codes = (qs & 0x0F).reshape(rows, cols)  # sub-block j of a super-block: low then high nibbles
    scales = (d * sc.astype(np.float32)).reshape(rows, cols // GROUP)
    mins = (-dmin * mn.astype(np.float32)).reshape(rows, cols // GROUP)
    return torch.from_numpy(np.ascontiguousarray(codes)), torch.from_numpy(scales), torch.from_numpy(mins)


class Q4KPlan:
    """The GGUF file's Q4_K tensors as int4 codes (a fused projection only when all its parts are Q4_K);
    every other tensor stays dense. Verified at load against the dense (dequantised) weight."""

    def __init__(self, gguf_path: Path):
        self.path = Path(gguf_path)
        self._tensors: dict | None = None

    @property
    def tensors(self) -> dict:
        """The file's tensors by llama.cpp name (a memory map, opened on first use)."""
        if self._tensors is None:
            import gguf  # transformers' GGUF loading needs it too (the qwen extra)

            self._tensors = {t.name: t for t in gguf.GGUFReader(str(self.path)).tensors}
        return self._tensors

    def release(self) -> None:
        """Drop the memory map (its pages count as resident once read); reopened if called again."""
        self._tensors = None

    def __call__(self, names: Sequence[str], weight: Tensor) -> Codes | None:
        found = [self.tensors.get(gguf_name(n) or "") for n in names]
        if any(t is None or t.tensor_type.name != "Q4_K" for t in found) or not supported(*weight.shape):
            return None
        parts = [q4k_codes(t.data, int(t.shape[1]), int(t.shape[0])) for t in found]  # ne = (in, out)
        codes, scales, mins = (torch.cat(list(p), 0) for p in zip(*parts))
        if codes.shape != weight.shape or not torch.equal(
                dequantize(codes, scales, mins).to(weight.dtype), weight.detach()):
            raise ValueError(f"the Q4_K codes of {', '.join(names)} in {self.path.name} do not reproduce the "
                             "dense weights loaded from the same file; refusing int4 weights")
        return codes, scales, mins
