"""Asynchronous RL benchmark: decode throughput of the reference engine while updates arrive every N steps.

One engine, one run, three modes side by side, for each weight source:

- ``none``: decode only (the baseline);
- ``pause``: every N decode steps generation stops for the whole update (receive, process, write into the
  live tensors), as every path does today (vLLM's ``pause_generation`` included);
- ``staged``: every N steps the trainer starts an update that lands on the staging twin while the engine
  keeps decoding; the engine stops only to commit it (an in-place copy of the kernel bytes) at the next
  step boundary. A trainer still pushing the previous version when the next is due skips that one
  (``skipped``): the engine never waits for it.

Sources: ``local`` (the trainer's tensors in this process, on the engine's device: the colocated case
without a transport), and transports from a trainer process: ``gloo`` (the trainer's tensors in host
memory) and ``ipc`` (CUDA, colocated on the engine's GPU). The KV cache is kept across commits
(``kv_after_commit='keep'``, PipelineRL's choice), so a commit costs only its copy.

Reported per mode: tokens/s and its ratio to ``none``, updates committed (skipped), the generation pause
per update (median, max) and its ratio to one device copy of the committed kernel bytes (timed here on
a 1 GiB buffer and scaled). Goals (GPU, staging on the device): pause <= 1.2x one copy; staged
throughput >= 0.9x none.

    python benchmarks/bench_async.py                            # CPU, CI-sized (~1-2 min)
    python benchmarks/bench_async.py --device cuda --preset qwen3-8b --batch 8 --steps 512 \\
        --every 64 --sources local,ipc --tag h200               # one H200, CUDA graphs, colocated
    python benchmarks/bench_async.py --device cuda --preset qwen3-8b --batch 8 --steps 1536 \\
        --every 512 --sources gloo --repeats 1 --tag h200_gloo  # the slow path (~13 s per update)
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import env_markdown, environment, write_results

from weight_sync.engine import ReferenceEngine
from weight_sync.manifest import Manifest
from weight_sync.reload.staged import StagingConfig
from weight_sync.testing import hf_config, random_weights
from weight_sync.transport import (
    PushHandle,
    TransportConfig,
    WeightReceiver,
    WeightSender,
    push_to_staging,
)

MODES = ("none", "pause", "staged")
SOURCES = ("local", "gloo", "ipc")


def _weight_sets(cfg: dict[str, Any], device: str, where: str | None = None) -> list[list[tuple[str, torch.Tensor]]]:
    """Two versions' weights, made once on ``device`` and kept on ``where`` (default: the same);
    updates alternate between them, so every update changes every byte."""
    dtype = getattr(torch, cfg["torch_dtype"]) if "torch_dtype" in cfg else torch.bfloat16
    return [[(n, t.to(where or device)) for n, t in random_weights(cfg, seed=s, dtype=dtype, device=device)]
            for s in (1, 2)]


def _trainer_process(cfg: dict[str, Any], backend: str, device: str, where: str, conn: Any) -> None:
    """The trainer: a WeightSender per connection, one push per ('push', version) command."""
    if device == "cpu":
        torch.set_num_threads(1)  # the engine process has the cores it was given
    # Random weights are made on the GPU when there is one (an 8B set takes minutes on host cores).
    sets = _weight_sets(cfg, device, where)
    manifest = Manifest.from_named_tensors(sets[0])
    sender: WeightSender | None = None
    try:
        while True:
            cmd, arg = conn.recv()
            if cmd == "connect":
                sender = WeightSender(TransportConfig(backend=backend, timeout_s=600, bucket_bytes=64 << 20),
                                      num_receivers=1)
                conn.send(sender.address)
                sender.connect()
            elif cmd == "push":
                assert sender is not None
                sender.send(sets[arg % 2], manifest, version=arg)
            elif cmd == "disconnect":
                assert sender is not None
                sender.close()
                sender = None
            else:
                return
    finally:
        if sender is not None:
            sender.close()


class Source:
    """Where updates come from: stage one (in the background) or apply one to the live engine (blocking)."""

    def __init__(self, kind: str, cfg: dict[str, Any], device: torch.device) -> None:
        self.kind = kind
        self._proc: Any = None
        self.receiver: WeightReceiver | None = None
        if kind == "local":
            self.sets = _weight_sets(cfg, str(device))
            self.manifest = Manifest.from_named_tensors(self.sets[0])
            return
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        # ipc: the trainer's tensors on the engine's GPU; gloo: in host memory.
        where = str(device) if kind == "ipc" else "cpu"
        self._proc = ctx.Process(target=_trainer_process, args=(cfg, kind, str(device), where, child),
                                 daemon=True)
        self._proc.start()

    def connect(self, target: Any) -> None:
        if self.kind == "local":
            return
        self._conn.send(("connect", None))
        self.receiver = WeightReceiver(target, self._conn.recv(), 1)
        self.receiver.connect()

    def disconnect(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
            self.receiver = None
            self._conn.send(("disconnect", None))

    def apply(self, engine: ReferenceEngine, version: int) -> None:
        """The whole update into the live engine, while nothing generates."""
        if self.kind == "local":
            with engine.begin_update(self.manifest, version=version) as s:
                s.load(self.sets[version % 2])
            return
        assert self.receiver is not None
        self._conn.send(("push", version))
        self.receiver.receive_update()

    def stage(self, engine: ReferenceEngine, version: int) -> PushHandle[Any]:
        assert engine.staging is not None
        if self.kind == "local":
            return push_to_staging(engine.staging, self.sets[version % 2], self.manifest, version=version)
        receiver = self.receiver
        assert receiver is not None
        self._conn.send(("push", version))
        return PushHandle(receiver.receive_update, version=version, device=engine.staging.device)

    def close(self) -> None:
        self.disconnect()
        if self._proc is not None:
            self._conn.send(("exit", None))
            self._proc.join(60)


def _copy_bound_s(num_bytes: int, device: torch.device, host_staged: bool) -> float:
    """One copy of ``num_bytes`` (device to device, or pinned host to device), from a 1 GiB buffer."""
    n = min(num_bytes, 1 << 30)
    src = torch.empty(n, dtype=torch.uint8, device="cpu" if host_staged else device,
                      pin_memory=host_staged and device.type == "cuda")
    dst = torch.empty(n, dtype=torch.uint8, device=device)
    times = []
    for _ in range(6):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times[1:]) * num_bytes / n


def run_mode(engine: ReferenceEngine, source: Source, mode: str, prompts: list[list[int]], steps: int,
             every: int, first_version: int) -> dict[str, Any]:
    pauses: list[float] = []
    committed: list[Any] = []
    commits_before = engine.staging.num_commits if engine.staging is not None else 0
    skipped = 0
    handle: PushHandle[Any] | None = None
    version = first_version

    def sync() -> None:
        if engine.device.type == "cuda":
            torch.cuda.synchronize(engine.device)

    def note_commit() -> None:
        st = engine.staging
        if (st is not None and st.last_commit is not None and st.num_commits > commits_before
                and st.last_commit.version not in committed):
            committed.append(st.last_commit.version)
            pauses.append(st.last_commit.seconds)

    def on_step(n: int) -> None:
        nonlocal handle, version, skipped
        note_commit()
        if mode == "none" or n % every:
            return
        if mode == "pause":
            sync()
            t = time.perf_counter()
            source.apply(engine, version)
            sync()
            pauses.append(time.perf_counter() - t)
            committed.append(version)
            version += 1
            return
        if handle is not None and not handle.done():
            skipped += 1  # the trainer is still pushing the last version: it skips this one
            return
        if handle is not None:
            handle.wait()  # re-raises a failed staged update
        handle = source.stage(engine, version)
        version += 1

    sync()
    t0 = time.perf_counter()
    out = engine.generate_with_versions(prompts, steps, on_step=on_step)
    sync()
    seconds = time.perf_counter() - t0
    note_commit()
    late = 0
    if handle is not None:
        handle.wait()
        if engine.commit_staged() is not None:  # ready only after the last step: not part of the run
            note_commit()
            committed.pop()
            pauses.pop()
            late = 1
    spans = {len(r.weight_versions) for r in out}
    return {
        "mode": mode, "seconds": seconds, "tokens": len(prompts) * steps,
        "tokens_per_s": len(prompts) * steps / seconds, "updates": len(committed), "skipped": skipped, "late": late,
        "pauses_ms": [x * 1e3 for x in pauses], "spans_per_sequence": sorted(spans),
        "next_version": version,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--steps", type=int, default=96, help="decode steps per mode")
    ap.add_argument("--every", type=int, default=16, help="an update every this many decode steps")
    ap.add_argument("--sources", default="local,gloo")
    ap.add_argument("--repeats", type=int, default=3, help="runs per mode, interleaved")
    ap.add_argument("--quantization", default=None, help="online quantization of the engine (e.g. fp8)")
    ap.add_argument("--placement", default="auto", choices=["auto", "device", "host"])
    ap.add_argument("--threads", type=int, default=1, help="torch threads of this process (the trainer uses 1)")
    ap.add_argument("--dtype", default=None, choices=["bfloat16", "float32"],
                    help="engine and trainer dtype (default: bfloat16 on CUDA, float32 on CPU)")
    ap.add_argument("--tag", default="cpu")
    ap.add_argument("--results-dir", default=None, help="write the results here instead of benchmarks/results")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    sources = [s for s in args.sources.split(",") if s]
    bad = [s for s in sources if s not in SOURCES]
    if bad:
        raise SystemExit(f"--sources must be among {SOURCES}, got {bad}")
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", 0)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    cfg = hf_config("qwen3", args.preset, dtype=dtype)
    engine = ReferenceEngine.from_config(cfg, weights=random_weights(cfg, seed=0, dtype=dtype, device=str(device)),
                                         dtype=dtype, device=device, max_batch_size=args.batch,
                                         quantization=args.quantization,
                                         max_seq_len=args.prompt_len + args.steps + 8)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(4, cfg["vocab_size"], (args.batch, args.prompt_len), generator=g).tolist()
    engine.generate(prompts, 8)  # warm-up (captures the CUDA graph)
    # Staging is enabled before every run, so all modes run with the same memory in use.
    staging = engine.enable_staging(StagingConfig(placement=args.placement), kv_after_commit="keep")
    staging_info = {"placement": staging.placement, "num_bytes": staging.num_bytes}
    runs: list[dict[str, Any]] = []
    version = 1
    for kind in sources:
        source = Source(kind, cfg, device)
        try:
            # Modes interleaved over the repeats: a drift of the machine's load hits all of them alike.
            for rep in range(args.repeats):
                for mode in MODES:
                    if mode != "none":
                        source.connect(staging if mode == "staged" else engine)
                    try:
                        run = run_mode(engine, source, mode, prompts, args.steps, args.every, version)
                    finally:
                        source.disconnect()
                    version = run.pop("next_version")
                    run.update(source=kind, repeat=rep)
                    runs.append(run)
                    print(f"{kind:6s} {mode:7s} #{rep} {run['tokens_per_s']:9.1f} tok/s  updates "
                          f"{run['updates']} (skipped {run['skipped']})", flush=True)
        finally:
            source.close()
            del source  # a local source holds two model-size weight sets on the device
            if device.type == "cuda":
                torch.cuda.empty_cache()  # ... which a colocated trainer process may need next
    num_bytes = staging.num_bytes
    bound_s = _copy_bound_s(num_bytes, device, staging.placement == "host" and device.type == "cuda")
    rows = []
    for kind in sources:
        base = None
        for mode in MODES:
            mine = [r for r in runs if r["source"] == kind and r["mode"] == mode]
            pauses = [x for r in mine for x in r["pauses_ms"]]
            tps = statistics.median(r["tokens_per_s"] for r in mine)
            base = tps if mode == "none" else base
            assert base is not None
            pm = statistics.median(pauses) if pauses else None
            rows.append({
                "source": kind, "mode": mode, "tokens_per_s": tps,
                "tokens_per_s_range": [min(r["tokens_per_s"] for r in mine), max(r["tokens_per_s"] for r in mine)], "throughput_vs_none": tps / base,
                "updates": sum(r["updates"] for r in mine), "skipped": sum(r["skipped"] for r in mine),
                "late": sum(r["late"] for r in mine),
                "pause_median_ms": pm, "pause_max_ms": max(pauses) if pauses else None,
                "pause_vs_one_copy": pm / 1e3 / bound_s if pm is not None else None,
            })
    env = environment()
    payload = {"env": env, "args": vars(args), "staging": staging_info, "committed_bytes": num_bytes,
               "one_copy_ms": bound_s * 1e3, "rows": rows, "runs": runs}
    md = [f"# Asynchronous updates: decode throughput with an update every {args.every} steps ({args.tag})", "",
          env_markdown(env), "",
          f"Preset `{args.preset}` ({dtype}, quantization {args.quantization}), batch {args.batch}, prompt {args.prompt_len}, {args.steps} decode "
          f"steps per run, {args.repeats} runs per mode interleaved (tok/s: median run; pauses: all runs); staging twin: {staging_info.get('placement')} ({num_bytes / 1e6:.1f} MB of kernel tensors); "
          f"one copy of those bytes: {bound_s * 1e3:.2f} ms. KV kept across commits.", "",
          "| source | mode | tok/s (median) | tok/s (min-max) | vs none | updates (skipped, late) | pause median ms | "
          "pause max ms | pause / one copy |",
          "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        pm = "-" if r["pause_median_ms"] is None else f"{r['pause_median_ms']:.2f}"
        px = "-" if r["pause_max_ms"] is None else f"{r['pause_max_ms']:.2f}"
        pr = "-" if r["pause_vs_one_copy"] is None else f"{r['pause_vs_one_copy']:.2f}x"
        lo, hi = r["tokens_per_s_range"]
        md.append(f"| {r['source']} | {r['mode']} | {r['tokens_per_s']:.1f} | {lo:.1f}-{hi:.1f} | "
                  f"{r['throughput_vs_none']:.2f}x | "
                  f"{r['updates']} ({r['skipped']}, {r['late']}) | {pm} | {px} | {pr} |")
    md += ["", "Goals (GPU, staging on the device): staged pause <= 1.2x one copy; staged throughput >= 0.9x "
               "none. A skipped update is one the trainer could not start because the previous one was "
               "still travelling (the engine never waits for it); a late one was staged but ready only "
               "after the run's last step (not counted in updates). Where the min-max ranges of a source's "
               "modes overlap, their throughput ratios are within this machine's noise."]
    text = "\n".join(md) + "\n"
    if args.results_dir is None:
        j, m = write_results(f"async_{args.tag}", payload, text)
    else:
        j, m = Path(args.results_dir) / f"async_{args.tag}.json", Path(args.results_dir) / f"async_{args.tag}.md"
        j.write_text(json.dumps(payload, indent=1, default=str))
        m.write_text(text)
    print(f"wrote {j} and {m}")


if __name__ == "__main__":
    main()
