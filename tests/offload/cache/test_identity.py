"""Layout identity and cache keys: who shares an entry, and what makes a key change."""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path

import pytest
import torch

from tests.offload.cache._workers import LAYOUT, TRANSFORM, write_checkpoint
from weight_sync.errors import ConfigError
from weight_sync.offload.cache import LayoutIdentity, compute_cache_key
from weight_sync.offload.cache.identity import TensorSpec, checkpoint_identity

_SPECS = [TensorSpec("blocks.0.weight", (4, 4), torch.float32)]


def _key(files: list[Path], *, layout: LayoutIdentity = LAYOUT, mode: str = "stat",
         transform_id: str = TRANSFORM, specs: list[TensorSpec] = _SPECS) -> str:
    return compute_cache_key(
        checkpoint=checkpoint_identity(files, mode=mode),  # type: ignore[arg-type]
        transform_id=transform_id, layout=layout, tensors=specs,
    ).digest


def test_layout_identity_has_no_dp_or_sp_rank_fields() -> None:
    names = {f.name for f in dataclasses.fields(LayoutIdentity)}
    assert names == {"tp_size", "tp_rank", "sp_impl", "sp_size", "dtype", "layout", "model_version"}
    with pytest.raises(TypeError):
        LayoutIdentity(tp_size=1, tp_rank=0, sp_impl=None, sp_size=1, dtype="bf16", layout="dense",
                       model_version="v1", dp_rank=3)  # type: ignore[call-arg]


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"tp_rank": 2}, r"tp_rank must be in \[0, 1\), got: 2"),
        ({"tp_size": 0}, r"tp_size must be an int >= 1, got: 0"),
        ({"sp_size": 4}, r"sp_impl must name the SP implementation when sp_size > 1"),
        ({"dtype": " "}, r"dtype must be a non-empty str, got: ' '"),
        ({"model_version": ""}, r"model_version must be a non-empty str"),
    ],
)
def test_layout_identity_rejects_invalid_fields_naming_them(changes: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        dataclasses.replace(LAYOUT, **changes)


def test_two_tp_engines_share_two_entries_one_per_tp_coordinate(tmp_path: Path) -> None:
    ckpt = write_checkpoint(tmp_path / "model.safetensors")
    tp0, tp1 = (dataclasses.replace(LAYOUT, tp_size=2, tp_rank=r) for r in (0, 1))
    # Engine A and engine B build their identities independently; DP/SP rank never enters.
    engine_a = {_key([ckpt], layout=tp0), _key([ckpt], layout=tp1)}
    engine_b = {_key([ckpt], layout=dataclasses.replace(tp0)), _key([ckpt], layout=dataclasses.replace(tp1))}
    assert engine_a == engine_b and len(engine_a) == 2


@pytest.mark.parametrize(
    "changes",
    [{"sp_impl": "ulysses", "sp_size": 2}, {"dtype": "bfloat16"}, {"layout": "padded"},
     {"model_version": "v2"}],
)
def test_every_layout_field_changes_the_key(changes: dict, tmp_path: Path) -> None:
    ckpt = write_checkpoint(tmp_path / "model.safetensors")
    assert _key([ckpt]) != _key([ckpt], layout=dataclasses.replace(LAYOUT, **changes))


def test_transform_id_and_tensor_schema_change_the_key(tmp_path: Path) -> None:
    ckpt = write_checkpoint(tmp_path / "model.safetensors")
    assert _key([ckpt]) != _key([ckpt], transform_id=TRANSFORM + "+fused")
    assert _key([ckpt]) != _key([ckpt], specs=[TensorSpec("blocks.0.weight", (4, 4), torch.bfloat16)])


def test_rewriting_a_checkpoint_file_in_place_changes_the_stat_key(tmp_path: Path) -> None:
    ckpt = write_checkpoint(tmp_path / "model.safetensors", seed=0)
    before = _key([ckpt])
    st = ckpt.stat()
    replacement = write_checkpoint(tmp_path / "other.safetensors", seed=1)
    shutil.copyfile(replacement, ckpt)  # same size, new contents, same inode
    os.utime(ckpt, ns=(st.st_atime_ns, st.st_mtime_ns))  # even with the old mtime restored
    assert ckpt.stat().st_size == st.st_size and ckpt.stat().st_ino == st.st_ino
    assert _key([ckpt]) != before


def test_sha256_identity_shares_one_key_across_copies_of_a_checkpoint(tmp_path: Path) -> None:
    a = write_checkpoint(tmp_path / "a" / "model.safetensors")
    b = tmp_path / "b" / "model.safetensors"
    b.parent.mkdir()
    shutil.copyfile(a, b)
    assert _key([a]) != _key([b])
    assert _key([a], mode="sha256") == _key([b], mode="sha256")
    other = write_checkpoint(tmp_path / "c" / "model.safetensors", seed=5)
    assert _key([a], mode="sha256") != _key([other], mode="sha256")


def test_missing_checkpoint_file_is_a_config_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"checkpoint file .*nope\.safetensors cannot be read"):
        checkpoint_identity([tmp_path / "nope.safetensors"])
