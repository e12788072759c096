"""``weight-sync offload-demo --rl``: diffusion RL with the policy served offloaded and synced over gloo.

The trainer (this process) holds a small synthetic DiT policy and improves it with a differentiable
reward (the negative mean squared distance of the denoised sample to a target value, back-propagated
through the Euler sampler: the direct reward fine-tuning of DRaFT / ReFL, the simplest reward that
learns in a few steps). After every optimizer step it sends the weights over the gloo transport
(``WeightSender``) into the engine: one process per rank (``--data-parallel-size`` ranks with AllGather,
else one), spawned here, serving the policy under DLO and receiving each update with ``WeightReceiver``
straight into its offloaded host storage (``weight_sync.offload.update``). Each step the engine
denoises a fixed evaluation seed; the trainer denoises the same seed with a fresh resident model loaded
from its own weights, and the two outputs must be bitwise equal (compared by SHA-256 of the bytes, the
only thing the engine reports back with its reward and update time). With ``--quantization NAME`` the
engine streams the policy's block linears quantized (fp8 / int8) and requantizes every update it receives
from the trainer's full-precision weights; the oracle is then the fresh resident model quantized the same
way. It prints one JSON line per step, writes the reward curve as a PNG, and returns non-zero on any
mismatch.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from pathlib import Path
from typing import Any

import torch

from weight_sync.offload.config import OffloadConfig

__all__ = ["run_rl_demo"]

_TARGET = 0.5


def _reward(x: torch.Tensor) -> torch.Tensor:
    return -((x.float() - _TARGET) ** 2).mean()


def _digest(x: torch.Tensor) -> str:
    return hashlib.sha256(x.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _sample(transformer: torch.nn.Module, latents: torch.Tensor, steps: int) -> torch.Tensor:
    """The pipeline's Euler loop, differentiable (``SyntheticDiTPipeline.forward`` runs without grad)."""
    x = latents
    sigmas = torch.linspace(1.0, 0.0, steps + 1).tolist()
    for i in range(steps):
        t = torch.full((x.shape[0],), sigmas[i], device=x.device)
        x = x + (sigmas[i + 1] - sigmas[i]) * transformer(x, t)
    return x


def _engine_rank(rank: int, world: int, address: str, opts: dict[str, Any], results: Any) -> dict[str, Any]:
    """One engine rank (module level: spawned): serve under DLO, receive every update, report each step."""
    from weight_sync.offload import enable_layerwise_offload
    from weight_sync.testing.dit import DiTConfig, SyntheticDiTPipeline
    from weight_sync.transport import WeightReceiver

    torch.set_num_threads(1)
    cfg = OffloadConfig(**opts["config"])
    torch.manual_seed(opts["seed"] + 1000)  # not the trainer's weights: only the syncs make them equal
    pipe = SyntheticDiTPipeline(DiTConfig(**opts["dit"])).eval()
    handle = enable_layerwise_offload(pipe, cfg)
    receiver = WeightReceiver(pipe.transformer, address, rank + 1)
    receiver.connect()
    try:
        for step in range(opts["rl_steps"]):
            report = receiver.receive_update()
            update_s = report.seconds.get("total", 0.0)  # the session's time, not the wait for the trainer
            out = pipe.generate(batch=opts["batch"], tokens=opts["tokens"], num_inference_steps=opts["steps"],
                                seed=opts["eval_seed"])
            results.put({"step": step, "rank": rank, "digest": _digest(out),
                         "reward": float(_reward(out)), "engine_update_s": update_s,
                         "version": receiver.weight_version})
        metrics = handle.metrics()
    finally:
        receiver.close()
    handle.disable()
    return {"rank": rank, "num_updates": metrics["num_updates"], "host_bytes": metrics["host_bytes"],
            "block_bytes": metrics["block_bytes"]}


def _plot(path: Path, rewards: list[float]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.plot(range(1, len(rewards) + 1), rewards, marker="o")
    ax.set_xlabel("RL step (one weight sync each)")
    ax.set_ylabel("reward of the served policy")
    ax.set_title("offload-demo --rl: reward of the offloaded engine")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_rl_demo(config: OffloadConfig, opts: dict[str, Any], *, png: Path, timeout_s: float) -> int:
    """The trainer loop (see the module docstring); 0 when every step's outputs were bitwise equal."""
    import multiprocessing as mp

    from weight_sync.manifest import Manifest
    from weight_sync.testing import run_distributed
    from weight_sync.testing.dit import DiTConfig, SyntheticDiTPipeline, make_latents
    from weight_sync.transport import TransportConfig, WeightSender

    world = config.world_size if config.allgather_active else 1
    dit = DiTConfig(**opts["dit"])
    torch.manual_seed(opts["seed"])
    policy = SyntheticDiTPipeline(dit).transformer.train()
    optimizer = torch.optim.Adam(policy.parameters(), lr=opts["lr"])
    sender = WeightSender(TransportConfig(backend="gloo", timeout_s=timeout_s), num_receivers=world)
    results: Any = mp.get_context("spawn").Queue()
    engine_out: dict[str, Any] = {}

    def engines() -> None:
        try:
            engine_out["ranks"] = run_distributed(_engine_rank, world, sender.address, opts, results,
                                                  timeout_s=timeout_s)
        except BaseException as e:  # reported by the trainer loop, which stops waiting
            engine_out["error"] = e
            results.put({"error": f"{type(e).__name__}: {e}"})

    thread = threading.Thread(target=engines, name="offload-rl-engines", daemon=True)
    thread.start()
    sender.connect()
    rewards: list[float] = []
    ok = True
    try:
        for step in range(opts["rl_steps"]):
            latents = make_latents(batch=opts["batch"], tokens=opts["tokens"], channels=dit.in_channels,
                                   seed=opts["seed"] + 1 + step, dtype=torch.float32, device="cpu")
            loss = -_reward(_sample(policy, latents, opts["steps"]))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            weights = [(k, v.detach()) for k, v in policy.state_dict().items()]
            t0 = time.perf_counter()
            sender.send(weights, Manifest.from_named_tensors(weights), version=step + 1)
            sync_s = time.perf_counter() - t0
            # The oracle: a fresh resident model loaded with the trainer's weights, same evaluation seed.
            fresh = SyntheticDiTPipeline(dit).eval()
            fresh.transformer.load_state_dict(dict(weights))
            if config.quantization is not None:  # quantized the same way, without any offload code
                from weight_sync.quant.modules import quantize_linears

                with torch.no_grad():
                    for block in fresh.transformer.blocks:
                        quantize_linears(block, config.quantization)
            expected = _digest(fresh.generate(batch=opts["batch"], tokens=opts["tokens"],
                                              num_inference_steps=opts["steps"], seed=opts["eval_seed"]))
            reports = [results.get(timeout=timeout_s) for _ in range(world)]
            errors = [r["error"] for r in reports if "error" in r]
            if errors:
                raise RuntimeError(f"the engine failed at step {step + 1}: {errors[0]}")
            equal = all(r["digest"] == expected and r["step"] == step for r in reports)
            ok = ok and equal
            reward = reports[0]["reward"]
            rewards.append(reward)
            print(json.dumps({"step": step + 1, "reward": round(reward, 6), "sync_ms": round(sync_s * 1e3, 2),
                              "engine_update_ms": round(max(r["engine_update_s"] for r in reports) * 1e3, 2),
                              "ranks": world, "equal_to_fresh_resident": equal}), flush=True)
    finally:
        sender.close()
        thread.join(timeout=timeout_s)
    if "error" in engine_out:
        raise RuntimeError(f"the engine processes failed: {engine_out['error']}") from engine_out["error"]
    _plot(png, rewards)
    improved = len(rewards) > 1 and rewards[-1] > rewards[0]
    print(json.dumps({"reward_first": rewards[0], "reward_last": rewards[-1], "improved": improved,
                      "all_equal": ok, "png": str(png), "engine": engine_out.get("ranks")}), flush=True)
    print("rl: every served output was bitwise equal to a fresh resident load of the trainer's weights"
          if ok else "rl: FAILED - the offloaded engine served something else than the trainer's weights")
    return 0 if ok else 1
