"""weight_sync's reload vs vLLM's own ``reload_weights`` on real vLLM (CPU), same settings, same checkpoints.

Two in-process engines (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so the model lives in this process and its
memory is measurable) with identical engine settings on a ~30M-parameter Qwen3 (preset ``bench``): one plain
vLLM engine whose ``collective_rpc("reload_weights", weights_iterator=...)`` runs vLLM's layerwise reload,
and one built with ``engine_kwargs()`` where the same call runs weight_sync. Each update alternates between
checkpoints A and B (so every update really changes the weights), engines alternate within a round, the
source tensors are preloaded into memory. Time is measured in steady state (repeated updates, the heap
keeping what earlier updates freed); memory in a separate pass where ``malloc_trim`` returns freed heap
before each call, so the only memory a call adds is its own. Peak memory is the growth of the kernel's
RSS high-water mark (reset through /proc/self/clear_refs) over RSS at the call; with preloaded sources and
no files mapped during the call that growth is anonymous memory. Both orders are measured: checkpoint (block)
order, and the same tensors reversed.

    python benchmarks/bench_vllm_reload.py [--repeats 7] [--preset bench]

Writes benchmarks/results/vllm_reload_cpu.{json,md}.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch
from common import PeakMemory, env_markdown, environment, median, write_results

from weight_sync.safetensors_io import iter_checkpoint
from weight_sync.testing import make_checkpoint

ENGINE_ARGS: dict[str, Any] = dict(
    dtype="bfloat16", enforce_eager=True, max_model_len=256, kv_cache_memory_bytes=64 << 20, seed=0
)
PROMPT = "3 4 = "


def _malloc_trim() -> None:
    gc.collect()
    with contextlib.suppress(OSError):  # not glibc: nothing to trim
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _preloaded(path: Path) -> list[tuple[str, torch.Tensor]]:
    # Owned copies in anonymous memory: no file pages move during a timed call.
    return [(n, t.clone()) for n, t in iter_checkpoint(path)]


def _tokens(llm: Any) -> list[int]:
    from vllm import SamplingParams

    out = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    return list(out[0].outputs[0].token_ids)


class _RepackClock:
    """Seconds spent in vLLM's oneDNN weight repacking (``create_onednn_mm``), the cost both share."""

    def __init__(self) -> None:
        from vllm import _custom_ops as ops

        self.seconds = 0.0
        original = ops.create_onednn_mm

        def timed(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t

        ops.create_onednn_mm = timed  # looked up at call time by vLLM's CPU GEMM dispatch


def _timed_reload(llm: Any, items: list[tuple[str, torch.Tensor]], clock: _RepackClock) -> tuple[float, float]:
    """Wall seconds of one update in steady state (the heap keeps what earlier updates freed), and the
    part of them spent repacking."""
    repack0 = clock.seconds
    t = time.perf_counter()
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": items})
    return time.perf_counter() - t, clock.seconds - repack0


def _measured_reload(llm: Any, items: list[tuple[str, torch.Tensor]]) -> int:
    """Peak RSS growth of one update, from a trimmed heap (so reuse of earlier frees hides nothing)."""
    _malloc_trim()
    with PeakMemory(torch.device("cpu")) as peak:
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": items})
    return peak.peak_extra_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7, help="timed updates per engine and order")
    parser.add_argument("--preset", default="bench", help="weight_sync.testing checkpoint preset")
    args = parser.parse_args()

    import vllm
    from vllm import LLM

    import weight_sync
    from weight_sync.integrations.vllm import engine_kwargs

    root = Path(tempfile.mkdtemp(prefix="bench-vllm-reload-"))
    ckpt_a = make_checkpoint(root / "a", preset=args.preset, seed=0)
    ckpt_b = make_checkpoint(root / "b", preset=args.preset, seed=1)
    sources = {"a": _preloaded(ckpt_a), "b": _preloaded(ckpt_b)}
    nbytes = sum(t.numel() * t.element_size() for _, t in sources["a"])
    nparams = sum(t.numel() for _, t in sources["a"])

    engines = {
        "vllm": LLM(model=str(ckpt_a), **ENGINE_ARGS),
        "weight_sync": LLM(model=str(ckpt_a), **ENGINE_ARGS, **engine_kwargs()),
    }
    orders = {"block order": lambda xs: xs, "reversed": lambda xs: xs[::-1]}
    results: dict[str, dict[str, dict[str, list[float]]]] = {
        order: {name: {"seconds": [], "repack_seconds": [], "peak_bytes": []} for name in engines}
        for order in orders
    }
    torch_threads = torch.get_num_threads()  # what the engines serve with (vLLM lowers it in-process)
    clock = _RepackClock()
    first_update_ms: dict[str, float] = {}
    for order, arrange in orders.items():
        # Two untimed updates per engine and order: the first reload (weight_sync builds its plan by a
        # dry run of the model's loaders) is a one-time cost, reported separately.
        for name, llm in engines.items():
            t = time.perf_counter()
            llm.collective_rpc("reload_weights", kwargs={"weights_iterator": arrange(sources["b"])})
            first_update_ms.setdefault(name, (time.perf_counter() - t) * 1e3)
            llm.collective_rpc("reload_weights", kwargs={"weights_iterator": arrange(sources["a"])})
        # Time and memory are separate passes: trimming the heap before a call (needed to see a
        # call's own memory) makes it fault in fresh pages, which is not what repeated updates cost.
        for i in range(2 * args.repeats):
            target = "b" if i % 2 == 0 else "a"
            names = list(engines) if i % 2 == 0 else list(engines)[::-1]
            for name in names:
                items = arrange(sources[target])
                if i < args.repeats:
                    seconds, repack = _timed_reload(engines[name], items, clock)
                    results[order][name]["seconds"].append(seconds)
                    results[order][name]["repack_seconds"].append(repack)
                else:
                    results[order][name]["peak_bytes"].append(_measured_reload(engines[name], items))
        for llm in engines.values():  # end every order on A
            llm.collective_rpc("reload_weights", kwargs={"weights_iterator": sources["a"]})

    # Both engines must serve the same weights after the same updates.
    for target in ("b", "a"):
        toks = {n: (llm.collective_rpc("reload_weights", kwargs={"weights_iterator": sources[target]}),
                    _tokens(llm))[1] for n, llm in engines.items()}
        if toks["vllm"] != toks["weight_sync"]:
            raise SystemExit(f"engines disagree after reloading {target}: {toks}")
    for llm in engines.values():
        llm.llm_engine.engine_core.shutdown()

    env = environment()
    env.update(vllm=vllm.__version__, weight_sync=weight_sync.__version__, torch_threads=torch_threads)
    rows = []
    for order in orders:
        ours, theirs = results[order]["weight_sync"], results[order]["vllm"]
        row = {
            "order": order,
            "ours_ms": median(ours["seconds"]) * 1e3,
            "vllm_ms": median(theirs["seconds"]) * 1e3,
            "ours_repack_ms": median(ours["repack_seconds"]) * 1e3,
            "vllm_repack_ms": median(theirs["repack_seconds"]) * 1e3,
            "ours_peak_mb": median(ours["peak_bytes"]) / 1e6,
            "vllm_peak_mb": median(theirs["peak_bytes"]) / 1e6,
            "ours_peak_max_mb": max(ours["peak_bytes"]) / 1e6,
            "vllm_peak_max_mb": max(theirs["peak_bytes"]) / 1e6,
        }
        row["time_ratio"] = row["ours_ms"] / row["vllm_ms"]
        row["memory_ratio"] = (row["ours_peak_mb"] / row["vllm_peak_mb"]) if row["vllm_peak_mb"] > 0 else None
        rows.append(row)

    payload = {"environment": env, "preset": args.preset, "num_params": nparams, "checkpoint_bytes": nbytes,
               "repeats": args.repeats, "engine_args": ENGINE_ARGS, "rows": rows,
               "first_update_ms": first_update_ms, "raw": results}
    lines = [
        "# weight_sync reload vs vLLM's own reload_weights (CPU, real vLLM)",
        "",
        env_markdown(env),
        "",
        f"Model: Qwen3 preset `{args.preset}`, {nparams / 1e6:.1f}M parameters, {nbytes / 1e6:.1f} MB of bf16 "
        f"tensors per update, from an in-memory iterator through `collective_rpc(\"reload_weights\")`. Two "
        f"in-process engines with identical settings `{ENGINE_ARGS}`; the weight_sync engine adds only "
        f"`engine_kwargs()` (defaults: no rollback, no fingerprint). Medians of {args.repeats} updates per "
        "engine and order, alternating checkpoints A/B and engine order. Time: steady state (repeated "
        "updates). Peak: a separate pass of as many updates, each from a trimmed heap; growth of the RSS "
        "high-water mark over RSS at the call (anonymous memory: sources preloaded, no file mapped). "
        "Goal: time <= 0.7x, memory <= 1.0x.",
        "",
        "| order | weight_sync ms | vLLM ms | time ratio | weight_sync peak MB | vLLM peak MB | memory ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        mem = "n/a" if r["memory_ratio"] is None else f"{r['memory_ratio']:.2f}x"
        lines.append(
            f"| {r['order']} | {r['ours_ms']:.1f} | {r['vllm_ms']:.1f} | **{r['time_ratio']:.2f}x** | "
            f"{r['ours_peak_mb']:.1f} (max {r['ours_peak_max_mb']:.1f}) | "
            f"{r['vllm_peak_mb']:.1f} (max {r['vllm_peak_max_mb']:.1f}) | **{mem}** |"
        )
    lines += [
        "",
        "oneDNN weight repacking inside those updates (vLLM's CPU GEMM dispatch, the same work on both "
        "engines): " + "; ".join(
            f"{r['order']}: weight_sync {r['ours_repack_ms']:.1f} ms, vLLM {r['vllm_repack_ms']:.1f} ms"
            for r in rows
        ) + ". Time outside repacking: " + "; ".join(
            f"{r['order']}: {(r['ours_ms'] - r['ours_repack_ms']) / (r['vllm_ms'] - r['vllm_repack_ms']):.2f}x"
            for r in rows
        ) + ".",
        "",
        f"First update on each engine (one-time; weight_sync builds its plan by a dry run of vLLM's "
        f"loaders on meta tensors): weight_sync {first_update_ms['weight_sync']:.0f} ms, "
        f"vLLM {first_update_ms['vllm']:.0f} ms.",
        "",
        "Both engines generate the same greedy tokens after the same sequence of updates (checked).",
        "",
    ]
    markdown = "\n".join(lines)
    j, m = write_results("vllm_reload_cpu", payload, markdown)
    print(markdown)
    print(f"wrote {j} and {m}")


if __name__ == "__main__":
    main()
