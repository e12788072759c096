"""Entry manifests are untrusted input: names never become paths unchecked, every field is validated."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.offload.cache._workers import TinyDiT, load, write_checkpoint
from weight_sync.errors import CacheError
from weight_sync.offload.cache.entry_manifest import parse_manifest

_KEY = "a" * 64
_SHA = "b" * 64


def _doc(**changes: object) -> dict:
    doc: dict = {
        "format": 1,
        "key": _KEY,
        "key_material": {},
        "created_unix_s": 1.0,
        "files": [{"name": "shard-00000-of-00001.safetensors", "bytes": 100, "sha256": _SHA}],
        "tensors": [
            {"name": "blocks.0.weight", "file": "shard-00000-of-00001.safetensors",
             "dtype": "float32", "shape": [2, 3], "sha256": _SHA}
        ],
    }
    doc.update(changes)
    return doc


def _parse(doc: dict) -> object:
    return parse_manifest(json.dumps(doc).encode(), expect_key=_KEY, source="m.json")


def test_a_well_formed_manifest_parses() -> None:
    manifest = _parse(_doc())
    assert manifest.tensors[0].shape == (2, 3) and manifest.total_bytes == 100  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "name",
    ["../../etc/passwd", "/etc/passwd", "shard-00000-of-00001.safetensors/../x",
     "shard-00001-of-00001.safetensors", "shard-0-of-1.safetensors", "manifest.json"],
)
def test_file_names_other_than_the_generated_pattern_are_rejected(name: str) -> None:
    doc = _doc(files=[{"name": name, "bytes": 100, "sha256": _SHA}])
    with pytest.raises(CacheError, match="never turned into paths unchecked"):
        _parse(doc)


@pytest.mark.parametrize(
    ("tensor_changes", "message"),
    [
        ({"name": "../x"}, "is not a dotted identifier"),
        ({"name": "a..b"}, "is not a dotted identifier"),
        ({"file": "other.safetensors"}, "not in the file list"),
        ({"dtype": "float8_e4m3fn"}, "has dtype 'float8_e4m3fn', expected one of"),
        ({"shape": [2, -1]}, "expected non-negative ints"),
        ({"shape": [True]}, "expected non-negative ints"),
        ({"sha256": "xyz"}, "expected a 64-hex-digit SHA-256"),
    ],
)
def test_bad_tensor_records_are_rejected_naming_the_problem(tensor_changes: dict, message: str) -> None:
    tensor = _doc()["tensors"][0] | tensor_changes
    with pytest.raises(CacheError, match=message):
        _parse(_doc(tensors=[tensor]))


def test_a_manifest_for_another_key_or_format_is_rejected() -> None:
    with pytest.raises(CacheError, match="does not match its directory"):
        _parse(_doc(key="c" * 64))
    with pytest.raises(CacheError, match="format 2, expected 1"):
        _parse(_doc(format=2))
    with pytest.raises(CacheError, match="not valid JSON"):
        parse_manifest(b"{", expect_key=_KEY, source="m.json")


def test_a_tampered_manifest_on_disk_makes_the_load_fall_back(tmp_path: Path) -> None:
    ckpt = write_checkpoint(tmp_path / "model.safetensors")
    cache = tmp_path / "cache"
    published = load(TinyDiT(), ckpt, cache)
    published.close()
    assert published.entry_dir is not None
    path = published.entry_dir / "manifest.json"
    doc = json.loads(path.read_text())
    doc["files"][0]["name"] = "../../../outside.safetensors"
    path.chmod(0o600)
    path.write_text(json.dumps(doc))
    calls: list[str] = []
    result = load(TinyDiT(), ckpt, cache, calls=calls)
    assert result.status == "fallback" and "never turned into paths unchecked" in result.reason
    assert calls == ["ordinary_load"]
