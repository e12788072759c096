"""The integration's parts that need no running engine: import hygiene, options, spools, engine kwargs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from weight_sync import ConfigError, DuplicateTensorError, ManifestError, SourceError
from weight_sync.integrations.vllm import WeightSyncOptions, open_handoff, share_weights
from weight_sync.integrations.vllm.handoff import as_handle


def test_importing_weight_sync_and_its_vllm_integration_package_never_imports_vllm() -> None:
    code = (
        "import sys, weight_sync, weight_sync.integrations, weight_sync.integrations.vllm; "
        "assert 'vllm' not in sys.modules, sorted(m for m in sys.modules if m.startswith('vllm'))"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"rollback": "yes"}, r"rollback must be a bool, got 'yes'"),
        ({"budget_bytes": -1}, r"budget_bytes must be None or an int >= 0, got -1"),
        ({"update_timeout_s": 0}, r"update_timeout_s must be > 0, got 0"),
    ],
)
def test_options_are_validated_naming_the_field_and_the_value(kwargs, pattern) -> None:
    with pytest.raises(ConfigError, match=pattern):
        WeightSyncOptions(**kwargs)


def test_options_round_trip_through_json_and_unknown_keys_are_named() -> None:
    opts = WeightSyncOptions(rollback=True, budget_bytes=1 << 20)
    assert WeightSyncOptions.from_dict(json.loads(json.dumps(opts.to_dict()))) == opts
    with pytest.raises(ConfigError, match=r"unknown weight_sync option\(s\) \['rolback'\]"):
        WeightSyncOptions.from_dict({"rolback": True})


def _tensors() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("model.layers.1.mlp.down_proj.weight", torch.randn(5, 3, generator=g).to(torch.bfloat16)),
        ("model.embed_tokens.weight", torch.randn(7, 3, generator=g)),
        ("scalar", torch.tensor(3, dtype=torch.int64)),
        ("model.layers.0.self_attn.q_proj.weight", torch.randn(3, 3, generator=g).t()),  # non-contiguous
    ]


def test_a_spool_hands_tensors_over_in_their_order_bitwise_and_is_removed_on_close(tmp_path: Path) -> None:
    items = _tensors()
    with share_weights(iter(items), directory=tmp_path, version=7) as spool:
        handle = json.loads(json.dumps(spool.handle))  # what crosses a process boundary
        reader = open_handoff(handle)
        assert reader.manifest.version == 7
        assert [m.name for m in reader.manifest] == [n for n, _ in items]
        got = list(reader)
        assert [n for n, _ in got] == [n for n, _ in items]
        for (_, want), (_, have) in zip(items, got):
            assert have.dtype == want.dtype and torch.equal(have, want)
        assert as_handle(json.dumps(handle)) == handle
        path = spool.path
        assert path.stat().st_mode & 0o777 == 0o700
    assert not path.exists()


def test_a_failing_source_names_the_last_tensor_and_leaves_no_spool(tmp_path: Path) -> None:
    def broken():
        yield _tensors()[0]
        raise OSError("trainer went away")

    with pytest.raises(SourceError, match=r"after 'model\.layers\.1\.mlp\.down_proj\.weight'.*trainer went away"):
        share_weights(broken(), directory=tmp_path)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(DuplicateTensorError, match=r"scalar: appears twice"):
        share_weights([_tensors()[2], _tensors()[2]], directory=tmp_path)


@pytest.mark.parametrize(
    ("handle", "pattern"),
    [
        ({"weight_sync_handoff": "relative/ws-handoff-x"}, r"not an absolute ws-handoff-\* directory"),
        ({"weight_sync_handoff": "/etc"}, r"not an absolute ws-handoff-\* directory"),
        ({"weight_sync_handoff": "/tmp/ws-handoff-does-not-exist"}, r"is not a directory"),
        ({"path": "/tmp"}, r"not a weight_sync handoff handle"),
    ],
)
def test_handles_that_do_not_name_a_live_spool_are_refused(handle, pattern) -> None:
    with pytest.raises(ManifestError, match=pattern):
        open_handoff(handle)


@pytest.mark.vllm
def test_engine_kwargs_name_the_platform_worker_and_carry_the_options_as_json() -> None:
    pytest.importorskip("vllm")
    from weight_sync.integrations.vllm import engine_cli_args, engine_kwargs

    kw = engine_kwargs(rollback=True)
    assert kw["worker_cls"] == "weight_sync.integrations.vllm.worker_cpu.WeightSyncCPUWorker"
    assert kw["additional_config"] == {"weight_sync": WeightSyncOptions(rollback=True).to_dict()}
    assert kw["weight_transfer_config"] == {"backend": "weight_sync"}
    args = engine_cli_args(rollback=True)
    assert args[args.index("--additional-config") + 1] == json.dumps(kw["additional_config"])
    with pytest.raises(ConfigError, match="budget_bytes"):
        engine_kwargs(budget_bytes=-5)
