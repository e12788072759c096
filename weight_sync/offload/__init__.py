"""Distributed layerwise offload (DLO): stream transformer blocks from host memory through two device slots.

``enable_layerwise_offload(module_or_pipeline, config)`` keeps the non-block weights on the device and
the blocks on the host; each block is copied (H2D, optionally 1/dp per rank plus AllGather) into one of
two fixed device slots while the previous block computes. ``load_host_weights`` chooses how host weights
are loaded (direct checkpoint mmap, the runtime-weight cache, or the ordinary loader) beforehand.
With AllGather, every call of the offloaded pipeline is agreed by the gather group before its first
gather (``call_guard``: step count, arguments, shapes; all ranks raise the same error on a mismatch);
``form_waves`` / ``run_wave`` help a scheduler run data-parallel requests in lockstep.

Limitations:
  * Inference only: while offload is enabled, block parameters alias slot memory outside their forward
    (their values are only meaningful inside it), and autograd through streamed blocks is unsupported.
  * Every rank of a gather group must run the same blocks in the same order (lockstep denoising with an
    identical, explicit step count); with AllGather, ``enable`` and ``disable`` are collective. The call
    guard rejects calls that differ in arguments or input shapes, but not a path that depends on tensor
    values inside one call.
  * Direct checkpoint mmap needs TP1 and an exact match of names, shapes, dtypes and contiguous layouts;
    otherwise the ordinary loader runs (before the module is touched).
  * Tensors shared between a streamed block and anything else cannot stream (ConfigError).
  * CUDA graphs / ``torch.compile`` over streamed blocks are not supported: the hooks re-point
    parameters in Python before each block.
  * Ranks are laid out ``((dp * usp) + sp) * tp + tp_rank``; other layouts need their own groups.
  * ``quantization`` quantizes only plain ``nn.Linear`` modules of the blocks, once and for good
    (``disable`` keeps kernel format); the runtime cache holds the dense weights it starts from.
"""

from weight_sync.offload.config import (
    DEFAULT_RUNTIME_CACHE_DIR,
    OffloadConfig,
    add_offload_args,
    config_from_args,
)
from weight_sync.offload.handle import OffloadHandle, enable_layerwise_offload
from weight_sync.offload.host_weights import HostWeights, load_host_weights
from weight_sync.offload.metrics import OffloadMetrics, Span
from weight_sync.offload.plan import OffloadPlan, Topology, resolve_topology
from weight_sync.offload.waves import DenoiseRequest, Wave, form_waves, run_wave

__all__ = [
    "DEFAULT_RUNTIME_CACHE_DIR",
    "DenoiseRequest",
    "HostWeights",
    "OffloadConfig",
    "OffloadHandle",
    "OffloadMetrics",
    "OffloadPlan",
    "Span",
    "Topology",
    "Wave",
    "add_offload_args",
    "config_from_args",
    "enable_layerwise_offload",
    "form_waves",
    "load_host_weights",
    "resolve_topology",
    "run_wave",
]
