"""The built-in reference rollout engine: a Qwen3/Qwen3-MoE/Llama decoder with vLLM's loading conventions.

Fused ``qkv_proj`` / ``gate_up_proj`` with ``weight_loader(param, loaded, shard_id)``, column/row/vocab
parallel layers over a torch.distributed group, fused MoE experts (``w13_weight`` / ``w2_weight`` with
vLLM's ``weight_loader(param, loaded, weight_name, shard_id, expert_id)``, tensor or expert parallel),
greedy generation with a static KV cache, CUDA-graph decode on GPU, online quantization through
:mod:`weight_sync.quant`.

Limitations: default rotary embeddings only; no sampling (greedy); TP decode is eager (no CUDA graph);
MoE experts are computed one at a time (no fused kernel), and all experts on every token inside a CUDA
graph; no shared experts.
"""

from weight_sync.engine.config import SUPPORTED_ARCHITECTURES, ModelConfig
from weight_sync.engine.engine import KV_AFTER_COMMIT, ReferenceEngine, Rollout, VersionSpan
from weight_sync.engine.model import CausalLM
from weight_sync.engine.moe import FusedMoE, SparseMoeBlock
from weight_sync.engine.parallel import TPInfo

__all__ = [
    "KV_AFTER_COMMIT",
    "SUPPORTED_ARCHITECTURES",
    "CausalLM",
    "FusedMoE",
    "ModelConfig",
    "ReferenceEngine",
    "Rollout",
    "SparseMoeBlock",
    "TPInfo",
    "VersionSpan",
]
