"""Host-weight loading: choose direct-checkpoint mmap, the runtime-weight cache, or the ordinary loader.

The decision is taken once, before DLO is enabled, and recorded on the module as a :class:`HostWeights`
that ``enable_layerwise_offload`` consumes; DLO never makes a second checkpoint-compatibility decision.

* ``dlo_enable_runtime_cache``: delegate to ``weight_sync.offload.cache.load_with_runtime_cache``
  (imported lazily), which either maps a published entry or runs the ordinary loader and publishes.
  Its tensors are pageable mmap views; DLO stages them through two pinned buffers.
* TP1: map the safetensors files directly (``checkpoint_mmap``); any mismatch falls back to the ordinary
  loader before the module is touched.
* Otherwise (TP > 1, or a fallback): the ordinary loader fills private host tensors.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from weight_sync.errors import ConfigError
from weight_sync.offload.checkpoint_mmap import (
    apply_mmap_plan,
    plan_checkpoint_mmap,
    run_post_load_hooks,
)
from weight_sync.offload.config import OffloadConfig
from weight_sync.safetensors_io import checkpoint_files, map_safetensors

__all__ = [
    "HOST_WEIGHTS_ATTR",
    "HostWeights",
    "load_host_weights",
    "load_state_from_checkpoint",
]

logger = logging.getLogger(__name__)

HOST_WEIGHTS_ATTR = "_weight_sync_host_weights"

HostWeightsSource = Literal["ordinary", "checkpoint_mmap", "runtime_cache"]


@dataclass(frozen=True)
class HostWeights:
    """How a module's host weights were loaded (what DLO streams from)."""

    source: HostWeightsSource
    num_fallbacks: int = 0
    fallback_reasons: tuple[str, ...] = ()
    cache_status: str | None = None
    files: tuple[Path, ...] = ()
    # The runtime cache's result holds the shared lease on the mapped entry: keeping it here keeps the
    # entry safe from eviction for as long as the module streams from it.
    cache_result: Any = field(default=None, repr=False, compare=False)

    @property
    def mapped(self) -> bool:
        return self.source in ("checkpoint_mmap", "runtime_cache")


def load_state_from_checkpoint(module: nn.Module, files: Sequence[Path], *, prefix: str = "") -> None:
    """The default ordinary loader: copy checkpoint tensors into the module's own (private) tensors."""
    state: dict[str, torch.Tensor] = {}
    for f in files:
        for name, t in map_safetensors(f).items():
            if name.startswith(prefix):
                state[name[len(prefix) :]] = t
    with torch.no_grad():
        result = module.load_state_dict(state, strict=True)
    del result
    run_post_load_hooks(module)


def _dominant_dtype(module: nn.Module) -> str:
    counts: dict[torch.dtype, int] = {}
    for p in module.parameters():
        counts[p.dtype] = counts.get(p.dtype, 0) + p.numel()
    dtype = max(counts, key=lambda d: counts[d]) if counts else torch.float32
    return str(dtype).removeprefix("torch.")


def load_host_weights(
    module: nn.Module,
    checkpoint_dir: str | os.PathLike,
    config: OffloadConfig,
    *,
    ordinary_loader: Callable[[nn.Module], None] | None = None,
    prefix: str = "",
    transform_id: str = "identity",
    model_version: str | None = None,
    tp_rank: int = 0,
) -> HostWeights:
    """Load ``module``'s host weights from ``checkpoint_dir`` and record how (see the module docstring).

    ``ordinary_loader(module)`` is the model's own loader (TP-aware, with its callbacks); by default the
    checkpoint is copied into the module with ``load_state_dict``. ``prefix`` is stripped from checkpoint
    names. ``transform_id`` / ``model_version`` / ``tp_rank`` feed the runtime-cache key.
    """
    files = checkpoint_files(checkpoint_dir)

    def ordinary() -> None:
        if ordinary_loader is not None:
            ordinary_loader(module)
        else:
            load_state_from_checkpoint(module, files, prefix=prefix)

    if config.dlo_enable_runtime_cache:
        result = _load_with_cache(
            module, files, config, ordinary, transform_id=transform_id,
            model_version=model_version or Path(checkpoint_dir).name, tp_rank=tp_rank,
        )
    elif config.tensor_parallel_size != 1:
        reason = (
            f"direct checkpoint mmap requires TP1, got tensor_parallel_size="
            f"{config.tensor_parallel_size}; using the ordinary TP-aware loader"
        )
        logger.info(reason)
        ordinary()
        result = HostWeights("ordinary", 1, (reason,), files=tuple(files))
    else:
        plan, reason = plan_checkpoint_mmap(module, files, prefix=prefix)
        if plan is None:
            # Nothing has been touched yet: the ordinary loader sees the module exactly as built.
            logger.warning("direct checkpoint mmap falls back to the ordinary loader: %s", reason)
            ordinary()
            result = HostWeights("ordinary", 1, (reason,), files=tuple(files))
        else:
            apply_mmap_plan(module, plan)
            result = HostWeights("checkpoint_mmap", files=tuple(files))
    setattr(module, HOST_WEIGHTS_ATTR, result)
    return result


def _load_with_cache(
    module: nn.Module, files: Sequence[Path], config: OffloadConfig, ordinary: Callable[[], None], *,
    transform_id: str, model_version: str, tp_rank: int,
) -> HostWeights:
    try:
        from weight_sync.offload.cache import LayoutIdentity, load_with_runtime_cache
    except ImportError as e:
        raise ConfigError(
            "dlo_enable_runtime_cache=True needs weight_sync.offload.cache, which cannot be imported "
            f"here: {e}"
        ) from e
    layout = LayoutIdentity(
        tp_size=config.tensor_parallel_size,
        tp_rank=tp_rank,
        sp_impl="usp" if config.usp > 1 else None,
        sp_size=config.usp,
        dtype=_dominant_dtype(module),
        # Always dense: the cache holds the final ordinary-loader weights, and DLO's online
        # quantization (config.quantization) runs after it, from the mapping, when offload is enabled.
        # Dense and quantized offloads of one model therefore share one entry.
        layout="dense",
        model_version=model_version,
    )
    res = load_with_runtime_cache(
        module,
        checkpoint_files=list(files),
        transform_id=transform_id,
        layout=layout,
        ordinary_load=ordinary,
        tensor_names=None,
        cache_dir=config.dlo_runtime_cache_dir,
        lock_timeout_s=config.dlo_runtime_cache_lock_timeout,
    )
    status = str(res.status)
    if status == "fallback":
        reason = f"runtime cache fell back to the ordinary tensors: {getattr(res, 'reason', '')}"
        logger.warning(reason)
        return HostWeights(
            "ordinary", 1, (reason,), cache_status=status, files=tuple(files), cache_result=res
        )
    return HostWeights("runtime_cache", cache_status=status, files=tuple(files), cache_result=res)
