"""llama.cpp backend: a GGUF file run as is by llama.cpp (through llama-cpp-python's C API).

The model's weights stay quantized (e.g. Qwen2.5-Coder's Q4_K_M), so the Qwen pair needs about
1.6 GB instead of 20 GB in fp32, and llama.cpp's CPU kernels score one token and k+1 tokens. The
logits are still full-vocabulary float32 rows, so every rule's exact law and every diagnostic is
unchanged (docs/design.md, 'Layering': a backend only answers `Session.logits_for`).

- `LlamaCppModel`: the `LanguageModel` (name, vocab_size, eos_token_id, stop_token_ids, session(),
  batch_session()); the project's tokenizer (transformers' GGUF tokenizer, as `verispec.models.qwen`
  builds it) so token ids match the other backends.
- `LlamaCppBatchSession`: one llama.cpp context holding one sequence id per row; each
  `logits_for` keeps every row's longest agreeing cached prefix (`llama_memory_seq_rm` drops the
  rest) and feeds all rows' remaining tokens in one `llama_decode` (split only past `n_batch`
  tokens), asking llama.cpp for logits at each row's last n positions only.
- `LlamaCppSession`: the batch-1 `Session` over the same machinery.

Exactness (`exact=True`, the default): greedy speculative decoding must emit exactly plain greedy
decoding's tokens, so a token's logits must not depend on the other tokens fed with it (a 1-token
step against a (k+1)-token verification pass, one row against a batch). ggml's fastest CPU paths
break that: their activations are re-quantized per matmul, so a different summation order moves
logits by up to 0.5 (measured on the Qwen pair), enough to flip near-tied argmaxes. Exact mode turns
off each path measured to do it: repacked weight layouts (`use_extra_bufts`), the tiled K-quant
matmul for >= 8 rows (`GGML_CPU_TILED_MM=0`, set by `library()` unless already set), flash attention
(its split-KV path for one query over >= 512 cells and its tiled path for >= 64 queries), and, at
build time, llamafile's tinyBLAS for >= 2 rows (`-DGGML_LLAMAFILE=OFF`; docs/guide.md, 'llama.cpp
backend'). `batch_invariant`
says whether all of them are off; the tests check the logits are then identical.

Threads: `threads=`, else the one setting of every entry point (`verispec.threads.resolve_threads`:
`$VERISPEC_THREADS`, else the physical cores this process may use).
Install: `pip install "verispec[llamacpp]"` builds llama-cpp-python from source (docs/guide.md,
'llama.cpp backend').
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import weakref
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
import transformers
from torch import Tensor
from transformers import AutoTokenizer

from verispec.models.base import check_batch_request, named_token_ids
from verispec.threads import resolve_threads

BACKEND = "llamacpp"
TOKENIZER_MARKER = "verispec-source.json"
TILED_ENV = "GGML_CPU_TILED_MM"  # ggml reads it once, at its first matmul: 0 turns the tiled path off
FLASH_ATTN_AUTO, FLASH_ATTN_DISABLED = -1, 0  # llama_flash_attn_type
log = logging.getLogger(__name__)
INSTALL_HINT = ('the llama.cpp backend needs llama-cpp-python: pip install "verispec[llamacpp]" '
                "(built from source; see the docs/guide.md, 'llama.cpp backend')")


_LIB = None


def library():
    """The `llama_cpp` module, its backend initialised once and its logging quietened (errors only);
    ImportError with the install command when it is missing."""
    global _LIB
    if _LIB is None:
        try:
            import llama_cpp
        except ImportError as err:
            raise ImportError(INSTALL_HINT) from err
        logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)  # its log callback reads this
        os.environ.setdefault(TILED_ENV, "0")  # before any matmul: exact mode needs it (module docstring)
        llama_cpp.llama_backend_init()
        _LIB = llama_cpp
    return _LIB


def build_features() -> dict[str, str]:
    """ggml's CPU features as this llama-cpp-python build reports them, e.g. {"LLAMAFILE": "1"}."""
    text = library().llama_print_system_info().decode(errors="replace")
    pairs = (item.split("=", 1) for item in text.replace("CPU :", "").split("|") if "=" in item)
    return {key.strip(): value.strip() for key, value in pairs}


EXTRA_BUFTS_ENV = "VERISPEC_LLAMACPP_EXTRA_BUFTS"  # 1: repacked / AMX layouts even where they crashed


def extra_buffers_unsafe() -> bool:
    """Whether llama.cpp's extra weight layouts (`use_extra_bufts`) are kept off in fast mode too: where
    this build has ggml's AMX layout (`AMX_INT8 = 1`: the CPU has AMX tiles), unless
    `$VERISPEC_LLAMACPP_EXTRA_BUFTS=1`. Measured 2026-12-03 on an Intel Xeon with AMX (2-core VM),
    llama-cpp-python 0.3.36 built with GGML_NATIVE: the first `llama_decode` of either Qwen GGUF
    segfaults with them on, in verispec and in llama-cpp-python's own `Llama` alike, and runs with
    them off (benchmarks/RESULTS.md, 'llama.cpp fast mode on an AMX CPU')."""
    if os.environ.get(EXTRA_BUFTS_ENV, "").strip() == "1":
        return False
    return build_features().get("AMX_INT8") == "1"


def invariance_breakers() -> list[str]:
    """What keeps this process from batch-invariant logits in exact mode (empty: nothing)."""
    found = []
    if build_features().get("LLAMAFILE") == "1":
        found.append("llama-cpp-python was built with llamafile's tinyBLAS (rebuild with "
                     "CMAKE_ARGS=-DGGML_LLAMAFILE=OFF, docs/guide.md, 'llama.cpp backend')")
    if os.environ.get(TILED_ENV, "0").strip() != "0":
        found.append(f"{TILED_ENV}={os.environ[TILED_ENV]} turns ggml's tiled matmul on")
    return found


def available() -> bool:
    """Whether llama-cpp-python can be imported (no exception)."""
    try:
        library()
        return True
    except ImportError:
        return False


def agreeing_prefix(held: Tensor, tokens: Tensor, n: int) -> int:
    """Length of the longest prefix of the 1-D `held` that agrees with `tokens`, at most
    len(tokens) - n (the last n tokens are always re-fed: their logits are asked for)."""
    limit = min(held.shape[0], tokens.shape[0] - n)
    if limit <= 0:
        return 0
    same = held[:limit] == tokens[:limit]  # [limit]
    return int(same.to(torch.int64).cumprod(0).sum())


class LlamaCppModel:
    """A GGUF model loaded by llama.cpp, with the project's tokenizer; used by any number of sessions.

    threads: llama.cpp's threads for every context (default `verispec.threads.resolve_threads()`);
    context: the most positions one row may hold (prompt + generated), the `max_context` that
    `decode.check_context` enforces; max_rows: the most rows a batched session holds at once;
    row_context: the most positions one row of a batched session may hold (each row has its own KV
    stream of this size, so its cells start at 0 as in a batch-1 session: the attention sums in the
    same order); n_batch: the most tokens one `llama_decode` call takes (longer feeds are split); exact:
    batch-invariant kernels (module docstring), whose success `batch_invariant` reports; False runs
    llama.cpp's fastest defaults (but the extra weight layouts where they crash: `extra_buffers_unsafe`)."""

    backend = BACKEND

    def __init__(self, gguf: str | Path, tokenizer, name: str, *, threads: int | None = None,
                 context: int = 4096, max_rows: int = 8, row_context: int = 2048, n_batch: int = 512,
                 stop_tokens: tuple[str, ...] = (), exact: bool = True):
        lib = library()
        gguf = Path(gguf)
        if not gguf.is_file():
            raise FileNotFoundError(f"GGUF file not found: {gguf}")
        threads = resolve_threads(threads)
        for key, value, low in (("threads", threads, 1), ("context", context, 16),
                                ("row_context", row_context, 16), ("max_rows", max_rows, 1),
                                ("n_batch", n_batch, 1)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{key} must be an integer >= {low}, got {value!r}")
        params = lib.llama_model_default_params()
        params.n_gpu_layers = 0
        # repacked layouts: another kernel for 1 row than for many (off in exact mode); off in fast mode
        # too where they crash (`extra_buffers_unsafe`)
        unsafe = not exact and extra_buffers_unsafe()
        if unsafe:
            log.warning("%s: llama.cpp's repacked/AMX weight layouts stay off on this CPU (they crashed the "
                        "first decode on an AMX CPU; %s=1 turns them on)", name, EXTRA_BUFTS_ENV)
        params.use_extra_bufts = not exact and not unsafe
        handle = lib.llama_model_load_from_file(str(gguf).encode(), params)
        if not handle:
            raise ValueError(f"llama.cpp could not load {gguf} (not a GGUF model file it supports)")
        self._handle = handle
        weakref.finalize(self, lib.llama_model_free, handle)
        self._vocab = lib.llama_model_get_vocab(handle)
        self.name = name
        self.path = gguf
        self.exact = exact
        breakers = invariance_breakers() if exact else ["exact=False"]
        self.batch_invariant = not breakers
        if exact and breakers:
            log.warning("%s: logits may depend on the batch (greedy SD may differ from plain greedy): %s",
                        name, "; ".join(breakers))
        self.tokenizer = tokenizer
        self.threads = threads
        self.n_batch = n_batch
        self.row_context = row_context
        self.max_rows = max_rows
        self.vocab_size = int(lib.llama_vocab_n_tokens(self._vocab))
        if tokenizer is not None and len(tokenizer) > self.vocab_size:
            raise ValueError(f"{name}: the tokenizer has {len(tokenizer)} tokens but the GGUF's output layer "
                             f"has {self.vocab_size} rows; the tokenizer is not this model's")
        train = int(lib.llama_model_n_ctx_train(handle))
        self.max_context = min(context, train) if train > 0 else context
        eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
        gguf_eos = int(lib.llama_vocab_eos(self._vocab))
        self.eos_token_id = int(eos) if eos is not None else (gguf_eos if gguf_eos >= 0 else None)
        self.stop_token_ids = stop_token_ids(tokenizer, [self.eos_token_id, gguf_eos], stop_tokens)
        self.num_parameters = int(lib.llama_model_n_params(handle))
        self.model_bytes = int(lib.llama_model_size(handle))
        self.calls = 0

    def session(self) -> LlamaCppSession:
        return LlamaCppSession(self)

    def batch_session(self) -> LlamaCppBatchSession:
        return LlamaCppBatchSession(self)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def gguf_tokenize(self, text: str, special: bool = True) -> list[int]:
        """`text` tokenized by llama.cpp's own tokenizer (the GGUF's), without BOS; special=True
        parses control tokens such as <|im_start|>. For checking the tokenizer against the GGUF."""
        lib = library()
        data = text.encode("utf-8")
        size = len(data) + 16
        out = (lib.llama_token * size)()
        count = lib.llama_tokenize(self._vocab, data, len(data), out, size, False, special)
        if count < 0:
            raise ValueError(f"llama_tokenize needs {-count} slots for {len(data)} bytes")
        return list(out[:count])

    def new_context(self, n_ctx: int, n_seq: int):
        """A llama.cpp context over this model (freed when the returned owner object is collected)."""
        lib = library()
        params = lib.llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_batch = params.n_ubatch = self.n_batch
        params.n_seq_max = n_seq
        params.n_threads = params.n_threads_batch = self.threads
        # one KV stream per sequence (n_ctx / n_seq cells each): a row's cells start at 0 whatever the
        # other rows hold, so attention sums over them in the batch-1 order (a shared stream does not)
        params.kv_unified = False
        params.no_perf = True
        params.embeddings = False
        params.flash_attn_type = FLASH_ATTN_DISABLED if self.exact else FLASH_ATTN_AUTO
        ctx = lib.llama_init_from_model(self._handle, params)
        if not ctx:
            raise MemoryError(f"llama.cpp could not create a context of {n_ctx} positions for {self.name}")
        return ctx


def stop_token_ids(tokenizer, eos_ids: Sequence[int | None], stop_tokens: tuple[str, ...]) -> frozenset[int]:
    """Every id that ends a generation: the given eos ids and the named `stop_tokens` (vocabulary
    strings, e.g. Qwen's "<|endoftext|>"), as `verispec.models.hf.stop_token_ids` computes them."""
    ids = [int(i) for i in eos_ids if i is not None and int(i) >= 0]
    return frozenset(ids + named_token_ids(tokenizer, stop_tokens))


class LlamaCppBatchSession:
    """`BatchSession` on one llama.cpp context: caller row ids map to sequence ids; one decode per call.

    The context is created on the first call, with `n_seq` sequences (default the model's max_rows)
    of `row_ctx` positions each (default the model's row_context)."""

    def __init__(self, owner: LlamaCppModel, n_seq: int | None = None, row_ctx: int | None = None):
        self.owner = owner
        self.n_seq = owner.max_rows if n_seq is None else n_seq
        self.row_ctx = min(owner.max_context, owner.row_context if row_ctx is None else row_ctx)
        self._ctx = None
        self._batch = None
        self._seq: dict[int, int] = {}  # caller row id -> llama.cpp sequence id
        self._held: dict[int, Tensor] = {}  # caller row id -> the tokens its sequence holds [length]
        self._free: list[int] = list(range(self.n_seq - 1, -1, -1))  # a stack, lowest id on top

    def _open(self) -> None:
        lib = library()
        ctx = self.owner.new_context(self.n_seq * self.row_ctx, self.n_seq)
        batch = lib.llama_batch_init(self.owner.n_batch, 0, 1)
        self._ctx, self._batch = ctx, batch
        self._mem = lib.llama_get_memory(ctx)
        # free the batch, then the context; the finalizer holds the owner, so the model outlives them
        weakref.finalize(self, _free_context, lib, ctx, batch, self.owner)
        n = self.owner.n_batch
        self._token = np.ctypeslib.as_array(batch.token, shape=(n,))
        self._pos = np.ctypeslib.as_array(batch.pos, shape=(n,))
        self._n_seq_id = np.ctypeslib.as_array(batch.n_seq_id, shape=(n,))
        self._logits = np.ctypeslib.as_array(batch.logits, shape=(n,))
        self._seq_ptr = [batch.seq_id[i] for i in range(n)]  # each points to one llama_seq_id

    def release(self, row: int) -> None:
        seq = self._seq.pop(row, None)
        self._held.pop(row, None)
        if seq is not None:
            library().llama_memory_seq_rm(self._mem, seq, -1, -1)
            self._free.append(seq)

    def held(self, row: int) -> Tensor:
        """The token ids row `row`'s sequence holds, [length] (empty for an unknown row)."""
        return self._held.get(row, torch.zeros(0, dtype=torch.long))

    def logits_for(self, rows: Sequence[int], tokens: Sequence[Tensor], n: Sequence[int]) -> list[Tensor]:
        """Per row: tokens [L_i] -> logits [n_i, V] (float32, CPU) predicting its last n_i positions."""
        check_batch_request(rows, tokens, n)
        vocab = self.owner.vocab_size
        for row, seq in zip(rows, tokens):
            if seq.shape[0] > self.row_ctx:
                raise ValueError(f"row {row}: {seq.shape[0]} tokens exceed the {self.row_ctx} positions a "
                                 f"row of {self.owner.name} may hold (LlamaCppModel row_context=)")
            if seq.numel() and (int(seq.min()) < 0 or int(seq.max()) >= vocab):
                raise ValueError(f"row {row}: token ids must be in [0, {vocab})")
        new = [row for row in rows if row not in self._seq]
        if len(new) > len(self._free):
            raise ValueError(f"{self.owner.name}: a batched session holds at most {self.n_seq} rows "
                             f"(LlamaCppModel max_rows=); release rows first")
        if self._ctx is None:
            self._open()
        lib = library()
        for row in new:
            self._seq[row] = self._free.pop()
            self._held[row] = torch.zeros(0, dtype=torch.long)
        feeds = []  # (seq id, first position, tokens to feed, outputs wanted)
        for row, seq, count in zip(rows, tokens, n):
            seq = seq.to(torch.long).cpu()
            keep = agreeing_prefix(self._held[row], seq, count)
            if keep < self._held[row].shape[0]:
                lib.llama_memory_seq_rm(self._mem, self._seq[row], keep, -1)
            feeds.append((self._seq[row], keep, seq[keep:].tolist(), count))
            self._held[row] = seq[:keep]  # what the cache holds until this decode succeeds
        try:
            out = self._decode(feeds)
        except BaseException:
            for row in rows:  # a failed decode may leave a part of the feed cached: forget the rows
                lib.llama_memory_seq_rm(self._mem, self._seq[row], -1, -1)
                self._held[row] = torch.zeros(0, dtype=torch.long)
            raise
        for row, seq in zip(rows, tokens):
            self._held[row] = seq.to(torch.long).cpu().clone()
        return out

    def _decode(self, feeds: list[tuple[int, int, list[int], int]]) -> list[Tensor]:
        """Feed every row's tokens (in chunks of at most n_batch tokens); the logits of the last
        `count` tokens of each feed, float32 [count, V] each."""
        lib = library()
        size, vocab = self.owner.n_batch, self.owner.vocab_size
        flat = [(seq, start + j, tok, j >= len(toks) - count)
                for seq, start, toks, count in feeds for j, tok in enumerate(toks)]
        chunks: list[np.ndarray] = []
        for begin in range(0, len(flat), size):
            part = flat[begin : begin + size]
            m = len(part)
            self._token[:m] = [p[2] for p in part]
            self._pos[:m] = [p[1] for p in part]
            self._n_seq_id[:m] = 1
            self._logits[:m] = [p[3] for p in part]
            for i, p in enumerate(part):
                self._seq_ptr[i][0] = p[0]
            self._batch.n_tokens = m
            rc = lib.llama_decode(self._ctx, self._batch)
            if begin == 0:
                self.owner.calls += 1
            if rc != 0:
                hint = (f"no KV cells left for a row of at most {self.row_ctx} positions "
                        "(LlamaCppModel row_context=)" if rc == 1 else "see llama.cpp's log")
                raise RuntimeError(f"llama_decode failed with code {rc} on {self.owner.name}: {hint}")
            outputs = sum(p[3] for p in part)
            if outputs:
                view = np.ctypeslib.as_array(lib.llama_get_logits(self._ctx), shape=(outputs, vocab))
                chunks.append(view.copy())  # [outputs, V], in batch order
        logits = torch.from_numpy(np.concatenate(chunks)) if chunks else torch.zeros(0, vocab)  # [sum n, V]
        return list(torch.split(logits, [count for *_, count in feeds]))  # [count_i, V] each


def _free_context(lib, ctx, batch, owner: LlamaCppModel) -> None:
    """Free a session's batch and context (`owner` is held only so the model is freed after them)."""
    lib.llama_batch_free(batch)
    lib.llama_free(ctx)


class LlamaCppSession:
    """`Session` (batch-1 decoding) over a `LlamaCppBatchSession` whose rows are the B rows of
    `tokens [B, L]`; sized for B on the first call (a later call with another B is refused)."""

    def __init__(self, owner: LlamaCppModel):
        self.owner = owner
        self._rows: LlamaCppBatchSession | None = None
        self._width = 0

    @property
    def cached(self) -> Tensor:
        if self._rows is None:
            return torch.zeros((1, 0), dtype=torch.long)
        held = [self._rows.held(b) for b in range(self._width)]
        length = min(h.shape[0] for h in held)
        return torch.stack([h[:length] for h in held])  # [B, length]

    def logits_for(self, tokens: Tensor, n: int) -> Tensor:
        """tokens [B, L] -> logits [B, n, V] (float32) predicting positions L-n+1 .. L."""
        if tokens.ndim != 2 or tokens.shape[1] < n or n < 1:
            raise ValueError(
                f"logits_for needs tokens [B, L] with L >= n >= 1, got {tuple(tokens.shape)} and n={n}")
        width = tokens.shape[0]
        if self._rows is None:
            self._rows = LlamaCppBatchSession(self.owner, n_seq=width, row_ctx=self.owner.max_context)
            self._width = width
        elif width != self._width:
            raise ValueError(f"this session holds {self._width} row(s); got tokens for {width}")
        out = self._rows.logits_for(list(range(width)), list(tokens), [n] * width)
        return torch.stack(out)  # [B, n, V]


def gguf_tokenizer(path: str | Path, cache: Path | None = None, key: str | None = None):
    """The project's tokenizer for a GGUF file: transformers' tokenizer read from the GGUF's metadata
    (what `verispec.models.qwen` saves beside its converted weights), no weights loaded. Reading it
    takes a minute on two cores, so with `cache` (a directory) and `key` (the GGUF's sha256) it is
    saved there once and read back while the directory's marker records the same key."""
    transformers.utils.logging.set_verbosity_error()
    path = Path(path)
    marker = cache / TOKENIZER_MARKER if cache is not None else None
    if marker is not None and key is not None:
        try:
            if json.loads(marker.read_text()).get("source_sha256") == key:
                return AutoTokenizer.from_pretrained(cache)
        except (OSError, ValueError, AttributeError):
            pass  # missing or unreadable: rebuilt below
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    if marker is not None and key is not None:
        tmp = cache.with_name(f"{cache.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            tokenizer.save_pretrained(tmp)
            (tmp / TOKENIZER_MARKER).write_text(json.dumps({"source_sha256": key, "source": path.name}))
            shutil.rmtree(cache, ignore_errors=True)
            os.replace(tmp, cache)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return tokenizer


def load_llamacpp(path: str | Path, *, name: str | None = None, tokenizer=None, threads: int | None = None,
                  stop_tokens: tuple[str, ...] = (), tokenizer_cache: Path | None = None,
                  sha256: str | None = None, exact: bool | None = None, **options) -> LlamaCppModel:
    """A GGUF file -> LlamaCppModel (its tokenizer read from the GGUF unless given, cached in
    `tokenizer_cache` under the file's `sha256`: `gguf_tokenizer`); `options`: context,
    max_rows, row_context, n_batch (see LlamaCppModel); exact None reads `VERISPEC_LLAMACPP_EXACT`
    (0: llama.cpp's fast kernels, whose logits depend on the batch; default 1)."""
    path = Path(path)
    if not path.is_file() or path.suffix != ".gguf":
        raise FileNotFoundError(f"the llama.cpp backend needs a .gguf file, got {path}")
    library()  # fail with the install hint before reading the tokenizer
    tok = gguf_tokenizer(path, tokenizer_cache, sha256) if tokenizer is None else tokenizer
    if exact is None:
        exact = os.environ.get("VERISPEC_LLAMACPP_EXACT", "1").strip() != "0"
    return LlamaCppModel(path, tok, name or path.stem, threads=threads, stop_tokens=stop_tokens, exact=exact,
                         **options)
