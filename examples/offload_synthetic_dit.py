"""Stream a synthetic DiT's blocks from host memory and check the result against the resident model.

    python examples/offload_synthetic_dit.py            # cuda when available, else cpu

Loads the transformer from a safetensors checkpoint with ``load_host_weights`` (direct mmap on TP1),
enables DLO without AllGather, denoises, and prints the metrics and whether the output is bitwise
equal to the resident model's.
"""

from __future__ import annotations

import copy
import json
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from weight_sync.offload import OffloadConfig, enable_layerwise_offload, load_host_weights
from weight_sync.testing.dit import DiTConfig, SyntheticDiTPipeline


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    dit = DiTConfig(hidden=256, heads=4, num_blocks=8)
    torch.manual_seed(0)
    reference = SyntheticDiTPipeline(dit).to(dtype).eval()
    resident = copy.deepcopy(reference).to(device)
    expected = resident.generate(tokens=128, num_inference_steps=4, seed=7)

    config = OffloadConfig(
        enable_distributed_layerwise_offload=True, dlo_use_allgather=False, device=device
    )
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp)
        save_file({k: v.contiguous() for k, v in reference.transformer.state_dict().items()},
                  str(ckpt / "model.safetensors"))
        pipe = SyntheticDiTPipeline(dit).to(dtype).eval()  # fresh random init: the load must win
        host = load_host_weights(pipe.transformer, ckpt, config)
        print(f"host weights: {host.source} {host.fallback_reasons or ''}")
        with enable_layerwise_offload(pipe, config) as handle:
            out = pipe.generate(tokens=128, num_inference_steps=4, seed=7)
            print(json.dumps(handle.metrics(), indent=1))
    print("bitwise equal to resident:", torch.equal(out.cpu(), expected.cpu()))


if __name__ == "__main__":
    main()
