"""OffloadConfig and its flags: the seed's names and defaults, and the combinations it rejects."""

from __future__ import annotations

import argparse

import pytest

from weight_sync.errors import ConfigError
from weight_sync.offload import (
    DEFAULT_RUNTIME_CACHE_DIR,
    OffloadConfig,
    add_offload_args,
    config_from_args,
)
from weight_sync.offload.gather_group import gather_group_ranks


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_offload_args(parser)
    return parser.parse_args(list(argv))


def test_flags_have_the_seed_names_and_defaults() -> None:
    parser = argparse.ArgumentParser()
    add_offload_args(parser)
    flags = {s for a in parser._actions for s in a.option_strings} - {"-h", "--help"}
    assert flags == {
        "--enable-distributed-layerwise-offload", "--data-parallel-size", "--dlo-use-allgather",
        "--dlo-no-use-allgather", "--dlo-resident-layers", "--usp", "--dlo-enable-runtime-cache",
        "--dlo-runtime-cache-dir", "--dlo-runtime-cache-lock-timeout",
    }
    cfg = config_from_args(_parse())
    assert cfg == OffloadConfig()
    assert (cfg.enable_distributed_layerwise_offload, cfg.data_parallel_size, cfg.dlo_use_allgather) == (
        False, 1, True)
    assert (cfg.dlo_resident_layers, cfg.usp, cfg.dlo_enable_runtime_cache) == (0, 1, False)
    assert cfg.dlo_runtime_cache_dir == DEFAULT_RUNTIME_CACHE_DIR
    assert cfg.dlo_runtime_cache_lock_timeout == 600.0


def test_flags_and_keyword_options_build_the_same_config() -> None:
    args = _parse("--enable-distributed-layerwise-offload", "--data-parallel-size", "4",
                  "--dlo-no-use-allgather", "--dlo-enable-runtime-cache",
                  "--dlo-runtime-cache-dir", "/tmp/x", "--dlo-runtime-cache-lock-timeout", "5")
    assert config_from_args(args) == OffloadConfig(
        enable_distributed_layerwise_offload=True, data_parallel_size=4, dlo_use_allgather=False,
        dlo_enable_runtime_cache=True, dlo_runtime_cache_dir="/tmp/x", dlo_runtime_cache_lock_timeout=5.0,
    )


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"dlo_resident_layers": 2}, "dlo_resident_layers=2 requires --dlo-no-use-allgather"),
        ({"use_hsdp": True}, "double-shard"),
        ({"dlo_enable_runtime_cache": True}, "dlo_enable_runtime_cache=True requires --dlo-no-use-allgather"),
    ],
)
def test_invalid_combinations_with_active_allgather_are_rejected_with_the_reason(
    options: dict, match: str
) -> None:
    with pytest.raises(ConfigError, match=match):
        OffloadConfig(data_parallel_size=2, **options)
    # The same options are fine without AllGather.
    OffloadConfig(data_parallel_size=2, dlo_use_allgather=False, **options)


@pytest.mark.parametrize("name", ["fp8", "fp8_per_channel", "fp8_block", "int8"])
def test_every_registry_quantization_is_accepted_with_allgather_and_with_the_runtime_cache(name: str) -> None:
    # Beyond the seed: quantized blocks shard like any others, and the cache holds the dense weights
    # that quantization starts from.
    assert OffloadConfig(data_parallel_size=2, quantization=name).allgather_active
    OffloadConfig(dlo_use_allgather=False, dlo_enable_runtime_cache=True, quantization=name)


def test_allgather_flag_is_inert_with_a_gather_group_of_one() -> None:
    cfg = OffloadConfig(dlo_resident_layers=3, dlo_enable_runtime_cache=True)
    assert cfg.dlo_use_allgather and not cfg.allgather_active and cfg.gather_group_size == 1


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"data_parallel_size": 0}, "data_parallel_size must be an int >= 1, got: 0"),
        ({"usp": -1}, "usp must be"),
        ({"dlo_resident_layers": -1}, "dlo_resident_layers must be"),
        ({"dlo_runtime_cache_lock_timeout": 0}, "lock_timeout must be > 0"),
        ({"alignment_bytes": 100}, "power of two"),
        ({"quantization": "fp4"}, r"quantization must be None or one of .*'fp8_block'.* got: 'fp4'"),
    ],
)
def test_out_of_range_values_are_rejected_naming_the_option(options: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        OffloadConfig(**options)


def test_unknown_keyword_option_is_named() -> None:
    with pytest.raises(ConfigError, match="dlo_use_allgater"):
        OffloadConfig.from_kwargs(dlo_use_allgater=False)


def test_gather_group_is_the_dp_group_then_the_sp_group_and_never_spans_tp() -> None:
    dp = OffloadConfig(data_parallel_size=2, usp=2, tensor_parallel_size=2)
    assert gather_group_ranks(dp) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    sp = OffloadConfig(usp=4, tensor_parallel_size=2)
    assert gather_group_ranks(sp) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    for groups, tp in ((gather_group_ranks(dp), 2), (gather_group_ranks(sp), 2)):
        for g in groups:
            assert len({r % tp for r in g}) == 1  # one TP coordinate per group
