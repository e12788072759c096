"""Local checkpoints in vLLM's formats: safetensors and torch files (weights only), hub ids from the cache."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from weight_sync import WeightSyncError
from weight_sync.checkpoints import (
    checkpoint_format,
    checkpoint_metas,
    map_checkpoint,
    resolve_checkpoint,
)
from weight_sync.engine import ReferenceEngine
from weight_sync.safetensors_io import iter_checkpoint
from weight_sync.testing import assert_bitwise_equal


def _as_torch_checkpoint(src: Path, dst: Path, shards: int = 1) -> Path:
    """``src``'s config and tensors saved as pytorch_model*.bin (with an index when sharded)."""
    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    items = list(iter_checkpoint(src))
    if shards == 1:
        torch.save({n: t.clone() for n, t in items}, dst / "pytorch_model.bin")
        return dst
    weight_map = {}
    for i in range(shards):
        fname = f"pytorch_model-{i + 1:05d}-of-{shards:05d}.bin"
        part = {n: t.clone() for n, t in items[i::shards]}
        torch.save(part, dst / fname)
        weight_map.update(dict.fromkeys(part, fname))
    (dst / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return dst


@pytest.mark.parametrize("shards", [1, 2])
def test_a_pytorch_model_bin_checkpoint_reloads_bitwise_like_its_safetensors_twin(shards, tmp_path, qwen3_a, qwen3_b) -> None:
    bin_b = _as_torch_checkpoint(qwen3_b, tmp_path / "b_bin", shards)
    assert checkpoint_format(bin_b) == "torch"
    engine = ReferenceEngine.from_checkpoint(qwen3_a, quantization="fp8")
    report = engine.reload_weights(bin_b)
    assert report.num_tensors == len(list(iter_checkpoint(qwen3_b)))
    assert_bitwise_equal(engine.model, ReferenceEngine.from_checkpoint(qwen3_b, quantization="fp8").model)
    assert_bitwise_equal(ReferenceEngine.from_checkpoint(bin_b).model, ReferenceEngine.from_checkpoint(qwen3_b).model)


def test_a_single_pt_file_is_a_checkpoint_and_its_manifest_needs_no_weights_read(tmp_path, qwen3_b) -> None:
    items = list(iter_checkpoint(qwen3_b))
    torch.save(dict(items), tmp_path / "weights.pt")
    metas = checkpoint_metas(tmp_path / "weights.pt")
    assert [(m.name, m.shape, m.dtype) for m in metas] == [(n, tuple(t.shape), t.dtype) for n, t in items]
    mapped = map_checkpoint(tmp_path / "weights.pt")
    assert all(torch.equal(mapped[n], t) for n, t in items)


def test_a_directory_with_both_formats_reads_the_safetensors(tmp_path, qwen3_a, qwen3_b) -> None:
    both = _as_torch_checkpoint(qwen3_b, tmp_path / "both")
    for f in qwen3_a.glob("*.safetensors"):
        shutil.copy(f, both / f.name)
    assert checkpoint_format(both) == "safetensors"
    engine = ReferenceEngine.from_checkpoint(qwen3_b)
    engine.reload_weights(both)
    assert_bitwise_equal(engine.model, ReferenceEngine.from_checkpoint(qwen3_a).model)


class _NotAWeight:
    def __reduce__(self):
        return (print, ("this must never run",))


def test_a_torch_file_with_arbitrary_objects_is_refused_without_unpickling_and_the_model_is_untouched(
    tmp_path, qwen3_a, qwen3_b, capsys
) -> None:
    ckpt = _as_torch_checkpoint(qwen3_b, tmp_path / "evil")
    state = torch.load(ckpt / "pytorch_model.bin", weights_only=True)
    torch.save({**state, "payload": _NotAWeight()}, ckpt / "pytorch_model.bin")
    engine = ReferenceEngine.from_checkpoint(qwen3_a)
    with pytest.raises(WeightSyncError, match=r"pytorch_model\.bin: cannot read as a weights-only torch file"):
        engine.reload_weights(ckpt)
    assert "this must never run" not in capsys.readouterr().out
    assert_bitwise_equal(engine.model, ReferenceEngine.from_checkpoint(qwen3_a).model)


def test_a_nested_state_dict_is_refused_naming_the_entry(tmp_path) -> None:
    torch.save({"model": {"w": torch.zeros(2)}}, tmp_path / "nested.pt")
    with pytest.raises(WeightSyncError, match=r"nested\.pt: expected a flat state dict of tensors.*'model': dict"):
        map_checkpoint(tmp_path / "nested.pt")


def test_a_directory_without_weights_says_what_it_looked_for(tmp_path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(WeightSyncError, match=r"no weights found.*safetensors.*pytorch_model\*\.bin"):
        checkpoint_format(tmp_path)


def test_a_hub_id_resolves_only_from_the_local_cache(tmp_path, monkeypatch, qwen3_b) -> None:
    pytest.importorskip("huggingface_hub")
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    with pytest.raises(WeightSyncError, match=r"'acme/tiny' is not a local path and not in the local Hugging Face cache"):
        resolve_checkpoint("acme/tiny")
    snapshot = cache / "models--acme--tiny" / "snapshots" / "0123abcd"
    shutil.copytree(qwen3_b, snapshot)
    (cache / "models--acme--tiny" / "refs").mkdir()
    (cache / "models--acme--tiny" / "refs" / "main").write_text("0123abcd")
    assert resolve_checkpoint("acme/tiny") == snapshot
    with pytest.raises(WeightSyncError, match="does not exist"):
        resolve_checkpoint(tmp_path / "nowhere")
