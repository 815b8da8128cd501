"""Hugging Face transformers backend: any `AutoModelForCausalLM`, from a directory or a GGUF file.

Pinned to transformers 5.24 (its cache API moves between releases: in 5.x `DynamicCache.crop(n)`
takes a *negative* number of tokens to remove, and the forward argument is `cache=`).
Weights may be stored in bf16; computation is fp32 by default (the tiny default draft is slower in
bf16 than in fp32 on CPU).
"""

from __future__ import annotations

import copy
import logging
import math
import os
from pathlib import Path

import torch
import transformers
from safetensors import safe_open
from torch import Tensor
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from verispec.models import lean
from verispec.models.base import BatchSession, CachedSession, PerRowBatchSession, named_token_ids
from verispec.models.int4 import Int4Plan, drop_file_pages, trim_heap
from verispec.models.lean import SHARE_ABOVE, LeanBatchSession, LeanLlama, LeanSession

log = logging.getLogger(__name__)


class HFModel:
    """A causal LM with its tokenizer; loaded once, used by any number of sessions.

    backend: "lean" runs Llama-architecture models through `verispec.models.lean` (same weights,
    same maths, less overhead); "hf" runs transformers' own forward with a DynamicCache; "auto"
    (default, or the VERISPEC_BACKEND environment variable) picks lean where it applies.
    """

    def __init__(self, model, tokenizer, name: str, backend: str | None = None,
                 stop_tokens: tuple[str, ...] = (), int4: Int4Plan | None = None, dense_prompts: bool = True):
        backend = backend or os.environ.get("VERISPEC_BACKEND", "auto")
        if backend not in ("auto", "lean", "hf"):
            raise ValueError(f"backend must be auto, lean or hf, got {backend!r}")
        if int4 is not None and backend == "hf":
            raise ValueError("int4 weights run in the lean backend only; not with backend 'hf'")
        self.int4 = int4  # which projections the lean forward holds as int4 codes (verispec.models.int4)
        if not dense_prompts and int4 is None:
            raise ValueError("dense_prompts=False applies to int4 weights only")
        # int4: prompts through dense twins (True) or the int4 kernel, the file's pages dropped (False)
        self.dense_prompts = dense_prompts
        if backend == "lean" and not lean.supports(model):
            raise ValueError(
                f"the lean backend does not support {model.config.model_type} models; use backend='hf'")
        self.backend = "lean" if backend == "lean" or (backend == "auto" and lean.supports(model)) else "hf"
        self._lean = None
        self._warned_rows = False
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.name = name
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
        self.eos_token_id = eos if eos is not None else _first(model.config.eos_token_id)
        self.stop_token_ids = stop_token_ids(model, tokenizer, stop_tokens)
        self.calls = 0
        # the most positions the model attends to (prompt + generated); checked by decode.check_context
        limit = getattr(model.config, "max_position_embeddings", None)
        self.max_context = int(limit) if isinstance(limit, int) and limit > 0 else None

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def _lean_model(self):
        if self._lean is None:
            # low-memory int4: nothing reads the mapped dense weights after the build, so the pages each
            # layer's build read leave the resident set as it ends (a lower peak), and all at the end
            # (and of the GGUF a Q4_K plan reads its codes from)
            drop = None
            if not self.dense_prompts:
                sources = [getattr(self.model.config, "_name_or_path", ""), getattr(self.int4, "path", "")]
                sources = [s for s in sources if s and Path(s).exists()]
                drop = lambda: drop_file_pages(*sources)  # noqa: E731
            self._lean = LeanLlama(self.model, dtype=next(self.model.parameters()).dtype, int4=self.int4,
                                   dense_prompts=self.dense_prompts, after_layer=drop)
            release = getattr(self.int4, "release", None)  # a plan holding a file's memory map
            if release is not None:
                release()
            if drop is not None:
                drop()
                trim_heap()
        return self._lean

    def session(self):
        if self.backend == "lean":
            return LeanSession(self, self._lean_model())
        return HFSession(self)

    def batch_session(self) -> BatchSession:
        """Many rows in one forward pass (lean backend); row by row for transformers' own forward."""
        if self.backend == "lean":
            return LeanBatchSession(self, self._lean_model())
        if not self._warned_rows:
            self._warned_rows = True
            log.info("%s (%s, transformers backend) decodes batched rows one by one, not in one forward pass",
                     self.name, self.model.config.model_type)
        return PerRowBatchSession(self)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def truncated(self, layers: int) -> HFModel:
        """A self-draft: the first `layers` decoder layers plus the final norm and head, sharing weights."""
        total = self.model.config.num_hidden_layers
        if not 1 <= layers < total:
            raise ValueError(
                f"self-draft needs 1 <= layers < {total} (the target's layer count), got {layers}")
        def shallow(module: torch.nn.Module) -> torch.nn.Module:
            # copy.copy shares the `_modules` dict: give the copy its own, or replacing a submodule of
            # the copy would replace it in the target too
            twin = copy.copy(module)
            twin._modules = dict(module._modules)
            return twin

        config = copy.copy(self.model.config)
        config.num_hidden_layers = layers
        inner = shallow(self.model.model)
        inner.config = config
        inner.layers = torch.nn.ModuleList(list(self.model.model.layers[:layers]))
        draft = shallow(self.model)
        draft.config = config
        draft.model = inner
        return HFModel(draft, self.tokenizer, f"{self.name}[self:layers={layers}]", backend=self.backend,
                       int4=self.int4, dense_prompts=self.dense_prompts)

    def with_int4(self, plan: Int4Plan, name: str, dense_prompts: bool = True) -> HFModel:
        """The same transformers model, run by the lean forward with the projections `plan` picks held as
        int4 codes (bf16 compute: load the model in bfloat16); a new model object named `name`.
        `dense_prompts=False`: prompts through the int4 kernel too, and the model file's mapped pages
        dropped from the resident set once the lean forward is built (`int4.drop_file_pages`)."""
        model = HFModel(self.model, self.tokenizer, name, backend="lean", int4=plan,
                        dense_prompts=dense_prompts)
        model.stop_token_ids = self.stop_token_ids
        return model


class HFSession(CachedSession):
    def __init__(self, owner: HFModel):
        super().__init__()
        self.owner = owner
        self.cache = DynamicCache(config=owner.model.config)

    def _crop(self, length: int) -> None:
        current = self.cache.get_seq_length()
        if length < current:
            self.cache.crop(length - current)  # transformers 5.x: a negative count of tokens to remove

    @torch.inference_mode()
    def _feed(self, tokens: Tensor) -> Tensor:
        self.owner.calls += 1
        out = self.owner.model(input_ids=tokens.to(self.owner.device), cache=self.cache, use_cache=True)
        return out.logits.float().cpu()  # rule maths run on the CPU (a [k+1, V] copy per block)


def weight_count(directory: Path) -> int | None:
    """Parameters stored in a model directory's safetensors files (read from their headers only);
    None where there are none (a GGUF file, a .bin checkpoint)."""
    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        return None

    total = 0
    for file in files:
        with safe_open(file, "pt") as handle:
            for name in handle.keys():
                total += math.prod(handle.get_slice(name).get_shape())
    return total


def proc_kib_field(path: str, field: str) -> int | None:
    """Bytes of a `Field:  N kB` line of a /proc file (/proc/meminfo, /proc/self/status), None where
    the file or the field is missing (not Linux)."""
    try:
        with open(path, encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def available_memory() -> int | None:
    """Bytes the kernel says a new allocation can get (MemAvailable), None where it does not say."""
    return proc_kib_field("/proc/meminfo", "MemAvailable")


def check_memory(directory: Path, dtype: torch.dtype, device: str, name: str) -> None:
    """Refuse, before loading, a model that cannot fit: a clear MemoryError instead of the OOM killer.

    Estimate on CPU: parameters x bytes per element x copies, where the copies are the weights and
    the lean pass's oneDNN-packed matmul weights (2; 3 below `lean.SHARE_ABOVE` parameters, whose
    transformers weights are not shared with the lean layout), plus 10%. Measured for the Qwen pair
    in fp32: 14 GB (1.5B) + 5 GB (0.5B) resident (benchmarks/RESULTS.md). VERISPEC_SKIP_MEMORY_CHECK=1
    skips the check (swap, or memory the kernel will reclaim)."""
    if torch.device(device).type != "cpu" or os.environ.get("VERISPEC_SKIP_MEMORY_CHECK") == "1":
        return

    params, free = weight_count(directory), available_memory()
    if params is None or free is None:
        return
    per = torch.finfo(dtype).bits // 8 if dtype.is_floating_point else 4
    copies = 2 if params > SHARE_ABOVE else 3
    need = int(1.1 * params * per * copies)
    if need <= free:
        return
    hint = ("--dtype bfloat16 (dtype=torch.bfloat16) halves it, at a cost in speed on CPUs without bf16 "
            "instructions (benchmarks/RESULTS.md, 'Qwen2.5-Coder pair')" if per == 4
            else "free memory, or use a machine with more")
    dtype_name = str(dtype).removeprefix("torch.")
    raise MemoryError(f"loading {name} in {dtype_name} needs about {need / 1e9:.1f} GB "
                      f"({params / 1e9:.2f}B parameters x {per} bytes x {copies} copies: the weights and the "
                      f"lean pass's packed copy, +10%), but {free / 1e9:.1f} GB is available; {hint}. "
                      "VERISPEC_SKIP_MEMORY_CHECK=1 loads anyway")


def _ids(value) -> list[int]:
    """An eos_token_id setting (None, an int or a list of ints) as a list."""
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def _first(value) -> int | None:
    ids = _ids(value)
    return ids[0] if ids else None


def stop_token_ids(model, tokenizer, stop_tokens: tuple[str, ...] = ()) -> frozenset[int]:
    """Every token id that ends a generation, as transformers' `generate` stops: the tokenizer's
    eos token, the config's and generation config's `eos_token_id` (an int or a list), and the named
    `stop_tokens` (token strings of the vocabulary, e.g. Qwen's "<|endoftext|>", which its GGUF
    files leave out of the generation config)."""
    ids = _ids(getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None)
    ids += _ids(getattr(model.config, "eos_token_id", None))
    ids += _ids(getattr(getattr(model, "generation_config", None), "eos_token_id", None))
    return frozenset(ids + named_token_ids(tokenizer, stop_tokens))


def load_hf(path: str | Path, *, gguf_file: str | None = None, name: str | None = None,
            device: str = "cpu", dtype: torch.dtype = torch.float32,
            stop_tokens: tuple[str, ...] = ()) -> HFModel:
    """Load a causal LM and its tokenizer from a local directory (optionally a GGUF file in it);
    `stop_tokens`: extra end-of-sequence tokens (see `stop_token_ids`)."""

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"model not found: {path} "
                                "(give a local directory, a .gguf file, or a named model)")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"{path} is a file but not a .gguf file; give a model directory or a GGUF file")
        path, gguf_file = path.parent, path.name
    elif path.is_dir() and not (path / "config.json").exists():
        ggufs = sorted(p.name for p in path.glob("*.gguf"))
        shown = ", ".join(str(path / g) for g in ggufs[:3])
        hint = f"; it holds GGUF files, give one of them: {shown}" if ggufs else ""
        raise FileNotFoundError(f"no model in {path}: a model directory needs a config.json and weights "
                                f"(an AutoModelForCausalLM save), or give a .gguf file{hint}")
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    if not gguf_file:
        check_memory(path, dtype, device, name or str(path))
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs)
    except OSError as err:
        raise FileNotFoundError(f"could not load a causal LM from {path}: {err}") from err
    return HFModel(model.to(device), tokenizer, name or str(path / (gguf_file or "")),
                   stop_tokens=stop_tokens)
