"""Offload configuration: the seed's flags and defaults, validated once into a frozen ``OffloadConfig``.

The command-line flags (``add_offload_args``) and the Python keyword arguments use the same names
(``--dlo-use-allgather`` <-> ``dlo_use_allgather``). Combinations the design cannot serve are rejected
here, with the reason, before any model is touched.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from typing import Any

from weight_sync.errors import ConfigError

__all__ = [
    "DEFAULT_RUNTIME_CACHE_DIR",
    "OffloadConfig",
    "add_offload_args",
    "config_from_args",
]

DEFAULT_RUNTIME_CACHE_DIR = "~/.cache/weight-sync/dlo-runtime-weights"


@dataclass(frozen=True, kw_only=True, slots=True)
class OffloadConfig:
    """What DLO does: which weights stream, how they are sharded, where host copies live.

    Seed flags (same names on the command line):
      ``enable_distributed_layerwise_offload``: turn DLO on (``enable_layerwise_offload`` requires it).
      ``data_parallel_size``: DP ranks; with AllGather also the weight-sharding group.
      ``dlo_use_allgather``: shard host weights 1/group per rank and rebuild blocks with AllGather.
        Inert (no collective, rank-local transfers) when the effective group size is 1.
      ``dlo_resident_layers``: keep this many leading main-DiT blocks on the device (no-AllGather only).
      ``usp``: sequence-parallel world size; the gather group when ``data_parallel_size`` is 1.
      ``dlo_enable_runtime_cache`` / ``dlo_runtime_cache_dir`` / ``dlo_runtime_cache_lock_timeout``:
        the node-local runtime-weight cache (``weight_sync.offload.cache``), no-AllGather only.

    Python-only knobs (deployment facts and tuning, not seed flags):
      ``tensor_parallel_size``: TP world size; ranks are laid out ``((dp * usp) + sp) * tp + tp_rank``.
      ``use_hsdp``: declared so that HSDP with AllGather (double sharding) is rejected.
      ``quantization``: a quant-registry name (``fp8``, ``fp8_per_channel``, ``fp8_block``, ``int8``,
        ...): every ``nn.Linear`` of the offloaded blocks is quantized online when DLO takes them, and
        the quantized bytes + scales are what the host holds, streams and computes from
        (``weight_sync.offload.quantize``). Works with AllGather (shards of the quantized blocks), every
        host storage, and the runtime cache (which holds the dense weights quantization starts from).
      ``device``: where blocks run (default: ``cuda`` when available, else ``cpu``).
      ``pin_in_place_budget_bytes``: the most mmap'd checkpoint bytes to pin in place. Default 0 (off:
        mmap'd blocks stage through two pinned slots): on the H200 test hosts (Firecracker VMs) the
        read-only in-place registration hung the process on 2026-11-30, so it is opt-in until that is
        understood; pass a budget (e.g. half of physical memory) to enable it.
      ``alignment_bytes``: byte alignment of every tensor inside a slot (kernels and SIMD paths).
      ``transfer_timeout_s``: the longest the compute thread waits for a transfer to be submitted, and
        for its gather group's peers to join the agreement on a call (``weight_sync.offload.call_guard``).
      ``trace``: record a per-block timeline (compute / H2D / AllGather); ``trace_capacity`` spans.
      ``dlo_landing_buffers``: with AllGather, copy each shard into one of two device *landing* buffers
        (one shard each) and gather out of place into the slot, so the shard H2D no longer waits for the
        slot to be free (see ``weight_sync.offload.submitter``). Costs 2 x shard bytes of device memory.
        Requires ``dlo_use_allgather``; inert (nothing allocated) when the gather group has size 1.
      ``update_host_budget_bytes``: the most host bytes a weight update may allocate to move this rank
        off read-only mapped host weights (checkpoint mmap, runtime cache) into a private pinned arena
        on its first update (``weight_sync.offload.update``). None (default): the host's MemAvailable at
        that moment; 0: updates of mapped host weights are refused.
    """

    enable_distributed_layerwise_offload: bool = False
    data_parallel_size: int = 1
    dlo_use_allgather: bool = True
    dlo_resident_layers: int = 0
    usp: int = 1
    dlo_enable_runtime_cache: bool = False
    dlo_runtime_cache_dir: str = DEFAULT_RUNTIME_CACHE_DIR
    dlo_runtime_cache_lock_timeout: float = 600.0
    tensor_parallel_size: int = 1
    use_hsdp: bool = False
    quantization: str | None = None
    device: str | None = None
    pin_in_place_budget_bytes: int | None = None
    alignment_bytes: int = 512
    transfer_timeout_s: float = 600.0
    trace: bool = False
    trace_capacity: int = 8192
    dlo_landing_buffers: bool = False
    update_host_budget_bytes: int | None = None

    def __post_init__(self) -> None:
        for name in ("data_parallel_size", "usp", "tensor_parallel_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be an int >= 1, got: {value!r}")
        n = self.dlo_resident_layers
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ConfigError(f"dlo_resident_layers must be an int >= 0, got: {n!r}")
        if self.dlo_runtime_cache_lock_timeout <= 0:
            raise ConfigError(
                f"dlo_runtime_cache_lock_timeout must be > 0 seconds, got: "
                f"{self.dlo_runtime_cache_lock_timeout!r}"
            )
        if not self.dlo_runtime_cache_dir:
            raise ConfigError("dlo_runtime_cache_dir must be a non-empty path")
        a = self.alignment_bytes
        if isinstance(a, bool) or not isinstance(a, int) or a < 16 or a & (a - 1):
            raise ConfigError(f"alignment_bytes must be a power of two >= 16, got: {a!r}")
        if self.pin_in_place_budget_bytes is not None and self.pin_in_place_budget_bytes < 0:
            raise ConfigError(
                f"pin_in_place_budget_bytes must be >= 0 or None, got: {self.pin_in_place_budget_bytes!r}"
            )
        b = self.update_host_budget_bytes
        if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b < 0):
            raise ConfigError(f"update_host_budget_bytes must be an int >= 0 or None, got: {b!r}")
        if self.transfer_timeout_s <= 0:
            raise ConfigError(f"transfer_timeout_s must be > 0, got: {self.transfer_timeout_s!r}")
        if self.trace_capacity < 1:
            raise ConfigError(f"trace_capacity must be >= 1, got: {self.trace_capacity!r}")
        if not isinstance(self.dlo_landing_buffers, bool):
            raise ConfigError(f"dlo_landing_buffers must be a bool, got: {self.dlo_landing_buffers!r}")
        if self.dlo_landing_buffers and not self.dlo_use_allgather:
            raise ConfigError(
                "dlo_landing_buffers=True requires dlo_use_allgather=True (--dlo-use-allgather): landing "
                "buffers stage this rank's AllGather shard on the device, but with "
                "--dlo-no-use-allgather each block is copied whole into its slot and there is no shard "
                "to land"
            )
        if self.quantization is not None:
            _check_quantization(self.quantization)
        self._reject_invalid_combinations()

    def _reject_invalid_combinations(self) -> None:
        if not self.allgather_active:
            return
        why = (
            f"AllGather is active (dlo_use_allgather=True with a gather group of "
            f"{self.gather_group_size} from {self._group_origin()})"
        )
        if self.dlo_resident_layers:
            raise ConfigError(
                f"dlo_resident_layers={self.dlo_resident_layers} requires --dlo-no-use-allgather: {why}, "
                "and a resident block would hold a full copy on every rank while its shard is never used"
            )
        if self.use_hsdp:
            raise ConfigError(
                f"use_hsdp=True cannot be combined with DLO AllGather: {why}; HSDP already shards the "
                "weights and sharding them again would double-shard (pass --dlo-no-use-allgather)"
            )
        if self.dlo_enable_runtime_cache:
            raise ConfigError(
                f"dlo_enable_runtime_cache=True requires --dlo-no-use-allgather: {why}; the cache maps "
                "complete rank-local layouts, while AllGather keeps only a 1/group shard per rank"
            )

    def _group_origin(self) -> str:
        if self.data_parallel_size > 1:
            return f"data_parallel_size={self.data_parallel_size}"
        if self.usp > 1:
            return f"usp={self.usp}"
        return "no parallelism"

    @property
    def gather_group_size(self) -> int:
        """Ranks that hold the same weights: DP when dp > 1, else SP when usp > 1, else 1."""
        if self.data_parallel_size > 1:
            return self.data_parallel_size
        return self.usp

    @property
    def allgather_active(self) -> bool:
        """True when blocks are sharded and rebuilt by a collective (AllGather on, group > 1)."""
        return self.dlo_use_allgather and self.gather_group_size > 1

    @property
    def world_size(self) -> int:
        """The world these sizes describe: dp * usp * tp."""
        return self.data_parallel_size * self.usp * self.tensor_parallel_size

    def resolved_device(self) -> str:
        """``device``, or ``cuda`` when a GPU is present and ``cpu`` otherwise."""
        if self.device is not None:
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def resolved_pin_budget_bytes(self) -> int:
        """The pin-in-place budget in bytes (default 0: opt-in, see ``pin_in_place_budget_bytes``)."""
        if self.pin_in_place_budget_bytes is not None:
            return self.pin_in_place_budget_bytes
        return 0

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> OffloadConfig:
        """Build a config from keyword arguments, naming any unknown one."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ConfigError(f"unknown offload option(s) {unknown}; known: {sorted(known)}")
        return cls(**kwargs)


def _check_quantization(name: object) -> None:
    """``name`` must be one of the quant registry's names (checked without importing it at module load)."""
    from weight_sync.quant.registry import QUANTIZATION_NAMES

    if not isinstance(name, str) or name not in QUANTIZATION_NAMES:
        raise ConfigError(
            f"quantization must be None or one of the quant registry's names {sorted(QUANTIZATION_NAMES)}, "
            f"got: {name!r}"
        )


def add_offload_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """Add the seed's DLO flags to ``parser`` (names and defaults as in the seed)."""
    parser.add_argument(
        "--enable-distributed-layerwise-offload", action="store_true", default=False,
        help="enable distributed layerwise offload (DLO)",
    )
    parser.add_argument(
        "--data-parallel-size", type=int, default=1, metavar="N",
        help="DP ranks and, with AllGather, the weight-sharding group (default 1)",
    )
    parser.add_argument(
        "--dlo-use-allgather", dest="dlo_use_allgather", action="store_true", default=True,
        help="shard host weights and reconstruct blocks with AllGather (default)",
    )
    parser.add_argument(
        "--dlo-no-use-allgather", dest="dlo_use_allgather", action="store_false",
        help="stream complete rank-local blocks without a DLO weight collective",
    )
    parser.add_argument(
        "--dlo-resident-layers", type=int, default=0, metavar="N",
        help="keep N leading main-DiT blocks on the device (requires --dlo-no-use-allgather)",
    )
    parser.add_argument(
        "--usp", type=int, default=1, metavar="N",
        help="sequence-parallel world size (the gather group when --data-parallel-size is 1)",
    )
    parser.add_argument(
        "--dlo-enable-runtime-cache", action="store_true", default=False,
        help="share final ordinary-loader DiT weights through a node-local mmap cache "
        "(requires --dlo-no-use-allgather)",
    )
    parser.add_argument(
        "--dlo-runtime-cache-dir", default=DEFAULT_RUNTIME_CACHE_DIR, metavar="PATH",
        help=f"shared local-disk cache root (default {DEFAULT_RUNTIME_CACHE_DIR})",
    )
    parser.add_argument(
        "--dlo-runtime-cache-lock-timeout", type=float, default=600.0, metavar="SECONDS",
        help="maximum wait for another process publishing the same layout (default 600)",
    )


_ARG_FIELDS = (
    "enable_distributed_layerwise_offload",
    "data_parallel_size",
    "dlo_use_allgather",
    "dlo_resident_layers",
    "usp",
    "dlo_enable_runtime_cache",
    "dlo_runtime_cache_dir",
    "dlo_runtime_cache_lock_timeout",
)


def config_from_args(args: argparse.Namespace, **overrides: Any) -> OffloadConfig:
    """An ``OffloadConfig`` from parsed ``add_offload_args`` flags plus Python-only ``overrides``."""
    values = {name: getattr(args, name) for name in _ARG_FIELDS}
    values.update(overrides)
    return OffloadConfig.from_kwargs(**values)
