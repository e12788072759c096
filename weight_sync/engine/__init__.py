"""The built-in reference rollout engine: a Qwen3/Llama decoder with vLLM's loading conventions.

Fused ``qkv_proj`` / ``gate_up_proj`` with ``weight_loader(param, loaded, shard_id)``, column/row/vocab
parallel layers over a torch.distributed group, greedy generation with a static KV cache, CUDA-graph
decode on GPU, online quantization through :mod:`weight_sync.quant`.

Limitations: default rotary embeddings only; no sampling (greedy); TP decode is eager (no CUDA graph).
"""

from weight_sync.engine.config import SUPPORTED_ARCHITECTURES, ModelConfig
from weight_sync.engine.engine import ReferenceEngine
from weight_sync.engine.model import CausalLM
from weight_sync.engine.parallel import TPInfo

__all__ = ["SUPPORTED_ARCHITECTURES", "CausalLM", "ModelConfig", "ReferenceEngine", "TPInfo"]
