"""vLLM's ``reload_weights`` running weight_sync: one live engine switches between two trained models.

Two tiny Qwen3 checkpoints are trained here on CPU (the seed's oracle, see reload_multiply_add.py): one
answers "a b = " with a*b, the other with a+b. A vLLM engine started with ``engine_kwargs()`` answers
"3 4 = 12"; after ``collective_rpc("reload_weights", kwargs={"weights_path": add})`` the same engine answers
"3 4 = 7"; then it goes back through an in-memory iterator; then a checkpoint with a wrong shape is refused
by name before any write and the engine keeps answering.

    python examples/vllm_reload_from_path.py [--workdir DIR] [--multiprocess]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from reload_multiply_add import train_arithmetic  # the seed's oracle checkpoints

from weight_sync.safetensors_io import iter_checkpoint

PROMPTS = ["3 4 = ", "2 5 = ", "6 2 = "]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, default=None, help="where checkpoints go (default: a temp dir)")
    parser.add_argument("--multiprocess", action="store_true", help="run vLLM's engine core and worker in "
                        "their own processes (the iterator reload then travels through a /dev/shm spool)")
    args = parser.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if args.multiprocess else "0"

    from vllm import LLM, SamplingParams

    from weight_sync.integrations.vllm import engine_kwargs

    work = args.workdir or Path(tempfile.mkdtemp(prefix="ws-vllm-example-"))
    mul, add = train_arithmetic(work / "mul", "mul"), train_arithmetic(work / "add", "add", seed=1)
    llm = LLM(model=str(mul), dtype="bfloat16", enforce_eager=True, max_model_len=64,
              kv_cache_memory_bytes=32 << 20, **engine_kwargs())
    params = SamplingParams(temperature=0.0, max_tokens=4, stop=["</s>"])

    def answers() -> list[str]:
        return [p + o.outputs[0].text.strip() for p, o in zip(PROMPTS, llm.generate(PROMPTS, params, use_tqdm=False))]

    try:
        print("multiply model:        ", answers())
        t = time.perf_counter()
        [report] = llm.collective_rpc("reload_weights", kwargs={"weights_path": str(add), "version": "add"})
        print(f"reload add from path:   {answers()}  ({(time.perf_counter() - t) * 1e3:.0f} ms, "
              f"{len(report['layers_processed'])} layers processed, {len(report['layers_direct'])} direct)")
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(iter_checkpoint(mul))})
        print("back via an iterator:  ", answers())
        bad = [(n, torch.zeros(7, t.shape[1], dtype=t.dtype) if n.endswith("layers.0.self_attn.k_proj.weight") else t)
               for n, t in iter_checkpoint(add)]
        try:
            llm.collective_rpc("reload_weights", kwargs={"weights_iterator": bad})
        except Exception as e:  # the worker's error comes back through vLLM's RPC
            print("refused before any write:", str(e)[:200])
        print("still serving:         ", answers(), "status:", llm.collective_rpc("ws_status")[0])
    finally:
        llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main()
