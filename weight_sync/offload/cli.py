"""``weight-sync offload-demo``: denoise with the synthetic DiT under DLO, optionally verifying bitwise.

Takes the seed's flags (``--data-parallel-size``, ``--dlo-no-use-allgather``, ``--usp``, ...). With a
gather group larger than one it spawns one process per rank (gloo on CPU, NCCL on GPU). ``--verify``
also runs the resident model on the same noise and exits non-zero unless every rank's output is
bitwise equal. With ``--quantization NAME`` (a quant-registry name) the block linears are quantized
online when DLO takes them, and ``--verify`` compares against the resident model quantized the same way:
the same modules with every block ``nn.Linear`` replaced by ``weight_sync.quant.modules.QuantizedLinear`` (the
registry's processor), kept on the device - built with ``weight_sync.quant`` alone, not the offload code.

Host weights come from a checkpoint when ``--checkpoint DIR`` is given or the runtime cache is enabled.
Without ``--checkpoint`` the demo uses one deterministic path per model configuration
(``weight_sync.offload.demo_checkpoint``), written once under a lock, so concurrent demos of one
configuration share one checkpoint file - and one runtime-cache entry, as replicas of one model path do.
The demo always enables DLO; ``--enable-distributed-layerwise-offload`` is accepted for parity with the
serving flags.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from weight_sync.errors import ConfigError
from weight_sync.offload.config import OffloadConfig, add_offload_args, config_from_args

if TYPE_CHECKING:
    from weight_sync.testing.dit import SyntheticDiTPipeline

__all__ = ["register"]

logger = logging.getLogger(__name__)

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _timed(fn: Any, device: torch.device) -> tuple[Any, float]:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out, (time.perf_counter() - t0) * 1e3


def _demo_rank(rank: int, world: int, opts: dict[str, Any]) -> dict[str, Any]:
    """One rank of the demo (module level: spawned ranks import it)."""
    from weight_sync.offload import enable_layerwise_offload, load_host_weights
    from weight_sync.testing.dit import DiTConfig, SyntheticDiTPipeline

    cfg = OffloadConfig(**opts["config"])
    device = torch.device(cfg.resolved_device())
    if device.type == "cuda" and world > 1:
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        cfg = OffloadConfig(**{**opts["config"], "device": str(device)})
    dtype = _DTYPES[opts["dtype"]]
    dit = DiTConfig(**opts["dit"])
    torch.manual_seed(opts["seed"])
    pipe = SyntheticDiTPipeline(dit).to(dtype).eval()
    result: dict[str, Any] = {"rank": rank, "device": str(device)}
    gen = dict(batch=opts["batch"], tokens=opts["tokens"], num_inference_steps=opts["steps"],
               seed=opts["seed"] + rank, dtype=dtype, device=device)
    expected = None
    if opts["verify"]:
        resident = _resident_oracle(pipe, cfg.quantization, device)
        resident.generate(**{**gen, "num_inference_steps": 1})  # warm-up
        expected, result["resident_ms"] = _timed(lambda: resident.generate(**gen), device)
        del resident
    if opts["checkpoint"]:
        host = load_host_weights(pipe.transformer, opts["checkpoint"], cfg)
        result["host_weights"] = host.source
        result["cache_status"] = host.cache_status
    handle = enable_layerwise_offload(pipe, cfg)
    pipe.generate(**{**gen, "num_inference_steps": 1})  # warm-up: first loads, lazy inits
    out, result["offload_ms"] = _timed(lambda: pipe.generate(**gen), device)
    result["metrics"] = handle.metrics()
    if cfg.trace:
        result["trace"] = [s.__dict__ for s in handle.trace()]
    if expected is not None:
        result["bitwise_equal"] = bool(torch.equal(out.cpu(), expected.cpu()))
    handle.disable()
    return result


def _resident_oracle(
    pipe: SyntheticDiTPipeline, quantization: str | None, device: torch.device
) -> SyntheticDiTPipeline:
    """The model ``--verify`` compares with: a resident copy, its block linears quantized like DLO's.

    Built from ``weight_sync.quant`` only (no offload code): the same modules, every ``nn.Linear`` of
    every block replaced by the registry's quantized representation, quantized on the host as DLO does,
    then kept on the device.
    """
    resident = copy.deepcopy(pipe)
    if quantization is not None:
        from weight_sync.quant.modules import quantize_linears

        with torch.no_grad():
            for block in resident.transformer.blocks:
                quantize_linears(block, quantization)
    return resident.to(device)


def _model_key(opts: dict[str, Any]) -> dict[str, Any]:
    """What determines the demo checkpoint's bytes (its default path is keyed by a digest of this)."""
    return {"dit": opts["dit"], "dtype": opts["dtype"], "seed": opts["seed"]}


def _write_checkpoint(file: Path, opts: dict[str, Any]) -> None:
    from safetensors.torch import save_file

    from weight_sync.testing.dit import DiTConfig, SyntheticDiTPipeline

    torch.manual_seed(opts["seed"])
    pipe = SyntheticDiTPipeline(DiTConfig(**opts["dit"])).to(_DTYPES[opts["dtype"]])
    save_file({k: v.contiguous() for k, v in pipe.transformer.state_dict().items()}, str(file))


def _run(args: argparse.Namespace) -> int:
    config = config_from_args(
        args, enable_distributed_layerwise_offload=True, device=args.device, trace=bool(args.trace),
        quantization=args.quantization,
    )
    opts: dict[str, Any] = {
        "config": {f: getattr(config, f) for f in OffloadConfig.__dataclass_fields__},
        "dit": {"hidden": args.hidden, "heads": args.heads, "num_blocks": args.num_blocks,
                "in_channels": args.in_channels},
        "dtype": args.dtype, "batch": args.batch, "tokens": args.tokens, "steps": args.steps,
        "seed": args.seed, "verify": args.verify, "checkpoint": None,
    }
    if args.rl:
        from weight_sync.offload.rl_demo import run_rl_demo

        if config.dlo_enable_runtime_cache or args.checkpoint or args.dtype != "float32":
            raise ConfigError("--rl trains a float32 policy held by the trainer: it takes no --checkpoint, "
                              "--dlo-enable-runtime-cache or --dtype (--quantization: the engine streams "
                              "the policy quantized and requantizes every update)")
        opts.update(rl_steps=args.rl_steps, lr=args.rl_lr, eval_seed=args.seed + 10_000)
        return run_rl_demo(config, opts, png=Path(args.rl_png), timeout_s=args.timeout)
    if args.checkpoint is not None or config.dlo_enable_runtime_cache:
        from weight_sync.offload.demo_checkpoint import default_checkpoint_dir, ensure_checkpoint

        # Not a private temp dir per run: its file identity would key a cache entry of its own, so
        # concurrent demos of one model would never share (see demo_checkpoint).
        path = Path(args.checkpoint) if args.checkpoint else default_checkpoint_dir(_model_key(opts))
        ensure_checkpoint(path, lambda file: _write_checkpoint(file, opts),
                          lock_timeout_s=config.dlo_runtime_cache_lock_timeout)
        opts["checkpoint"] = str(path)
    world = config.world_size if config.allgather_active else 1
    if world > 1:
        from weight_sync.testing import run_distributed

        backend = "nccl" if config.resolved_device().startswith("cuda") else "gloo"
        results = run_distributed(_demo_rank, world, opts, backend=backend, timeout_s=args.timeout)
    else:
        results = [_demo_rank(0, 1, opts)]
    ok = True
    for r in results:
        trace = r.pop("trace", None)
        if trace is not None and args.trace:
            out = Path(args.trace)
            if len(results) > 1:
                out = out.with_name(f"{out.stem}.rank{r['rank']}{out.suffix}")
            out.write_text(json.dumps(trace))
            r["trace_file"] = str(out)
        print(json.dumps(r, sort_keys=True))
        if args.verify and not r.get("bitwise_equal", False):
            ok = False
    if args.verify:
        oracle = "resident" if config.quantization is None else f"resident {config.quantization}"
        print(f"verify: offloaded output is bitwise equal to {oracle} on every rank" if ok
              else f"verify: FAILED - offloaded output differs from {oracle}")
    return 0 if ok else 1


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "offload-demo",
        help="denoise with a synthetic DiT under distributed layerwise offload",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from weight_sync.quant.registry import QUANTIZATION_NAMES

    add_offload_args(p)
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 (default: cuda when available)")
    p.add_argument("--num-blocks", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--in-channels", type=int, default=16)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=4, help="denoising steps (num_inference_steps)")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quantization", default=None, choices=sorted(QUANTIZATION_NAMES),
                   help="quantize the block linears online (quant registry name); --verify then compares "
                   "with the resident model quantized the same way")
    p.add_argument("--checkpoint", default=None, metavar="DIR",
                   help="load host weights from this safetensors dir (written first if missing; default "
                   "with the runtime cache: one shared path per model configuration under the temp dir)")
    p.add_argument("--verify", action="store_true",
                   help="also run the resident model (quantized the same way with --quantization); "
                   "exit 1 unless outputs are bitwise equal")
    p.add_argument("--rl", action="store_true",
                   help="diffusion RL: a trainer improves the policy each step and syncs it over gloo into "
                        "an engine serving it under DLO; checks each served output against a fresh resident "
                        "load (weight_sync.offload.rl_demo)")
    p.add_argument("--rl-steps", type=int, default=8, help="--rl: optimizer steps (one weight sync each)")
    p.add_argument("--rl-lr", type=float, default=3e-3, help="--rl: Adam learning rate")
    p.add_argument("--rl-png", default="offload_rl_reward.png", metavar="PATH",
                   help="--rl: where the reward curve is written")
    p.add_argument("--trace", default=None, metavar="PATH", help="write the block timeline as JSON")
    p.add_argument("--timeout", type=float, default=600.0, help="multi-rank timeout in seconds")
    p.set_defaults(func=_run)
