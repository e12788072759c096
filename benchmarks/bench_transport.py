"""Transport benchmark: a full weight update through WeightSender -> WeightReceiver -> reference engine.

Two processes (trainer rank 0, engine rank 1). For every bucket size it times complete updates (start,
every bucket, the engine's commit) and, in the same run on the same two processes, a baseline:

- nccl / gloo: a raw ``broadcast`` of the same number of bytes, in buckets of the same size, on a fresh
  group of the same backend (what a perfect pipeline would reach);
- ipc / shm: one device copy of the same number of bytes (one flat copy on the trainer's device).

It also reports the engine's peak extra memory during an update (buffers + staging + transient) against
the bound 2 buffers + 1 block, (CPU) the RSS growth over repeated updates, and the host waits of one
update on each side (``TransferReport.host_waits``: read backs of device values, waits on collectives,
device events and doorbell records, and how many of them found the work still running).

GPU (2x H200): random Qwen3-8B-shaped bf16 weights are generated on GPU0, the engine lives on GPU1::

    python benchmarks/bench_transport.py --tag h200x2     # = --device cuda --preset qwen3-8b --backends nccl,ipc
                                                         #   --quantization none,fp8_block --bucket-mb 64,256,1024,2048

Colocated on one GPU, buffered ipc next to zero-copy ipc (``+zc``: engines copy from the trainer's tensors)::

    python benchmarks/bench_transport.py --backends ipc,ipc+zc --bucket-mb 2048 --tag h200_ipc_zc

CPU (small model, gloo, shm and zero-copy shm, plus 50 updates for RSS)::

    python benchmarks/bench_transport.py --device cpu --preset bench --backends gloo,shm,shm+zc --bucket-mb 1,4,16

Results: ``benchmarks/results/transport_<tag>.{json,md,png}`` (tag: --tag, default 'cpu' or 'gpu').
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from weight_sync.engine import ReferenceEngine
from weight_sync.layers import group_by_block
from weight_sync.manifest import Manifest
from weight_sync.testing import hf_config, random_weights, run_distributed
from weight_sync.transport import TransportConfig, WeightReceiver, WeightSender
from weight_sync.transport.wire import TRAILER_BYTES

RESULTS = Path(__file__).resolve().parent / "results"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rss() -> int:
    import resource

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _devices(backend: str, rank: int, device: str) -> torch.device:
    if device == "cpu":
        return torch.device("cpu")
    return torch.device("cuda", 0 if backend == "ipc" else rank)


def _largest_block_bytes(manifest: Manifest) -> int:
    sizes = {m.name: m.nbytes for m in manifest}
    groups = group_by_block(manifest.names, reference_order=list(manifest.names))
    return max(sum(sizes[n] for n in names) for names in groups.values())


def _raw_group(backend: str, tag: str, rank: int, timeout_s: float) -> Any:
    from datetime import timedelta

    store = dist.PrefixStore(f"raw/{tag}", dist.distributed_c10d._get_default_store())
    if backend == "nccl":
        return dist.ProcessGroupNCCL(store, rank, 2)
    return dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=timeout_s))


def _raw_broadcast_s(backend: str, tag: str, rank: int, device: torch.device, total: int, chunk: int,
                     repeats: int) -> float:
    """Median seconds to broadcast ``total`` bytes in ``chunk``-byte broadcasts (two buffers, like ours)."""
    pg = _raw_group(backend, tag, rank, 300)
    bufs = [torch.empty(chunk, dtype=torch.uint8, device=device) for _ in range(2)]
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    done = torch.zeros(1, device=device)
    times = []
    for r in range(repeats + 1):
        pg.allreduce([done]).wait()
        _sync(device)
        t0 = time.perf_counter()
        works, left, i = [], total, 0
        while left > 0:
            n = min(chunk, left)
            works.append(pg.broadcast([bufs[i % 2][:n]], opts))
            left, i = left - n, i + 1
        for w in works:
            w.wait()
        pg.allreduce([done]).wait()  # the receiver has everything
        _sync(device)
        if r:
            times.append(time.perf_counter() - t0)
    del bufs
    return statistics.median(times)


def _copy_s(device: torch.device, total: int, repeats: int) -> float:
    src = torch.empty(total, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for r in range(repeats + 1):
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        if r:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


# Qwen3-8B's 399 tensor names (36 blocks) with tiny tensors (~0.2 MB in all): the data phase is nearly
# nothing, so an update's time is its control plane and per-tensor host work.
NAMES_8B = dict(num_hidden_layers=36, hidden_size=16, intermediate_size=32, head_dim=4, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=256)


def _config(preset: str) -> dict[str, Any]:
    if preset == "names-8b":
        return hf_config("qwen3", "tiny", torch.bfloat16, **NAMES_8B)
    return hf_config("qwen3", preset, torch.bfloat16)


def bench_rank(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    if spec.get("profile"):
        # Appended, not prepended: a --baseline-code run keeps importing weight_sync from its DIR.
        sys.path.append(str(Path(__file__).resolve().parents[1]))
        from benchmarks.common import profiled

        name = spec["backend"] + ("+zc" if spec.get("zero_copy") else "") + f"_{spec['quantization'] or 'none'}"
        return profiled(_bench_rank, str(Path(spec["profile"]) / name), rank, rank, world, spec)
    return _bench_rank(rank, world, spec)


def _bench_rank(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    backend, repeats = spec["backend"], spec["repeats"]
    device = _devices(backend, rank, spec["device"])
    if device.type == "cpu":
        # Two processes share the host: without this, each process's intra-op threads spin against the
        # other's and against the gloo threads (20x slower on a 2-core machine).
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = dist.distributed_c10d._get_default_store()
    cfg = _config(spec["preset"])
    out: dict[str, Any] = {"rank": rank, "device": str(device), "buckets": []}
    if rank == 0:
        weights = list(random_weights(cfg, seed=0, dtype=torch.bfloat16, device=device))
        manifest = Manifest.from_named_tensors(weights)
        total = manifest.nbytes
        out.update(num_bytes=total, num_tensors=len(manifest), largest_block_bytes=_largest_block_bytes(manifest))
        if backend in ("ipc", "shm"):
            out["copy_s"] = _copy_s(device, total, repeats)
    else:
        with tempfile.TemporaryDirectory() as d:
            (Path(d) / "config.json").write_text(json.dumps(cfg))
            engine = ReferenceEngine.from_checkpoint(d, device=device, quantization=spec["quantization"],
                                                     load_weights=False)
    for bucket_mb in spec["bucket_mb"]:
        bucket = bucket_mb << 20
        key = f"bench/{backend}/{bucket_mb}"
        row: dict[str, Any] = {"bucket_mb": bucket_mb}
        if rank == 0:
            zero_copy = spec.get("zero_copy", False)
            sender = WeightSender(TransportConfig(backend=backend, bucket_bytes=bucket, timeout_s=600,
                                                  num_buffers=spec["num_buffers"], zero_copy=zero_copy,
                                                  checksum=spec["checksum"] and not zero_copy,
                                                  verify=spec["verify"]), num_receivers=1)
            store.set(key, sender.address)
            sender.connect()
            times, data_times, call_times, cpu_times, rss = [], [], [], [], []
            for r in range(spec["warmup"] + repeats):
                _sync(device)
                t0, c0 = time.perf_counter(), time.thread_time()
                report = sender.send(weights, manifest, version=r)
                dt, dc = time.perf_counter() - t0, time.thread_time() - c0
                if r >= spec["warmup"]:
                    times.append(dt)
                    data_times.append(report.transfer_seconds)
                    call_times.append(report.call_seconds)
                    cpu_times.append(dc)
                rss.append(_rss())
            sender.close()
            row.update(sender_waits=report.host_waits,
                       engine_waits=report.receivers[0].get("transport", {}) if report.receivers else {})
            row.update(seconds=statistics.median(times), seconds_all=times, num_buckets=report.num_buckets,
                       gbps=total / statistics.median(times) / 1e9, data_seconds=statistics.median(data_times),
                       call_seconds=statistics.median(call_times),
                       # Control: start..commit minus the data phase, per update (the median of the
                       # differences, not the difference of the medians).
                       control_seconds=statistics.median(t - d for t, d in zip(times, data_times)),
                       sender_cpu_seconds=statistics.median(cpu_times),
                       data_gbps=total / statistics.median(data_times) / 1e9, rss_first=rss[0], rss_last=rss[-1],
                       rss_after_warmup=rss[min(len(rss), spec["warmup"]) - 1])
        else:
            receiver = WeightReceiver(engine, store.get(key).decode(), 1, fingerprint=False)
            receiver.connect()
            receiver.receive_update()  # warm-up (the first one is the engine's first load)
            for _ in range(spec["warmup"] - 1):
                receiver.receive_update()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                base = torch.cuda.memory_allocated(device)
                torch.cuda.reset_peak_memory_stats(device)
            fp_times, engine_walls, engine_cpus = [], [], []
            for _ in range(repeats):
                t0, c0 = time.perf_counter(), time.thread_time()
                report = receiver.receive_update()
                engine_walls.append(time.perf_counter() - t0)
                engine_cpus.append(time.thread_time() - c0)
                fp_times.append(report.seconds.get("total", 0.0))
            # The engine's host (main-thread CPU) time per update: its data work (loads) and its control.
            row.update(engine_seconds=statistics.median(engine_walls),
                       engine_cpu_seconds=statistics.median(engine_cpus))
            if device.type == "cuda":
                transient = torch.cuda.max_memory_allocated(device) - base
                buffers = 0 if backend == "ipc" or spec.get("zero_copy") else spec["num_buffers"] * (bucket + TRAILER_BYTES)
                staging = receiver.staging_bytes
                row.update(extra_engine_bytes=buffers + staging + transient, engine_buffers=buffers,
                           engine_staging=staging, engine_transient=transient)
            row["engine_peak_buffered_bytes"] = report.peak_buffered_bytes
            receiver.close()
        if backend in ("nccl", "gloo"):
            total_bytes = out.get("num_bytes") or 0
            size = torch.tensor([total_bytes], dtype=torch.int64)
            dist.broadcast(size, 0)
            row["raw_s"] = _raw_broadcast_s(backend, f"{bucket_mb}", rank, device, int(size), bucket, repeats)
        out["buckets"].append(row)
    return out


def _run(args: argparse.Namespace, name: str, quantization: str | None) -> dict[str, Any]:
    # 'ipc+zc' / 'shm+zc': the backend with TransportConfig(zero_copy=True) (no buffers, no checksum).
    backend, zero_copy = name.removesuffix("+zc"), name.endswith("+zc")
    spec = dict(backend=backend, zero_copy=zero_copy, device=args.device, preset=args.preset, quantization=quantization,
                bucket_mb=args.bucket_mb, repeats=args.repeats, warmup=args.warmup, checksum=not args.no_checksum,
                num_buffers=args.num_buffers,
                verify=args.verify, profile=args.profile)
    trainer, engine = run_distributed(bench_rank, 2, spec, timeout_s=args.timeout_s)
    rows = []
    for t, e in zip(trainer["buckets"], engine["buckets"]):
        row = {**t, **{k: v for k, v in e.items() if k != "bucket_mb"}}
        if "raw_s" in t:
            row["raw_gbps"] = trainer["num_bytes"] / t["raw_s"] / 1e9
            row["ratio_vs_raw"] = t["raw_s"] / t["seconds"]
            row["data_ratio_vs_raw"] = t["raw_s"] / t["data_seconds"]
            row["call_ratio_vs_raw"] = t["raw_s"] / t["call_seconds"]
        if "copy_s" in trainer:
            row["copy_s"] = trainer["copy_s"]
            row["ratio_vs_copy"] = t["seconds"] / trainer["copy_s"]
            row["data_ratio_vs_copy"] = t["data_seconds"] / trainer["copy_s"]
            row["call_ratio_vs_copy"] = t["call_seconds"] / trainer["copy_s"]
        if "extra_engine_bytes" in e:
            bucket = t["bucket_mb"] << 20
            buffers = 0 if backend == "ipc" or zero_copy else args.num_buffers * (bucket + TRAILER_BYTES)
            row["memory_bound_bytes"] = buffers + trainer["largest_block_bytes"]
        rows.append(row)
    return {"backend": backend, "zero_copy": zero_copy, "quantization": quantization, "verify": args.verify,
            "checksum": spec["checksum"] and not zero_copy, "num_bytes": trainer["num_bytes"],
            "num_tensors": trainer["num_tensors"], "largest_block_bytes": trainer["largest_block_bytes"],
            "rows": rows}


def _rss_run(args: argparse.Namespace) -> dict[str, Any]:
    """50 updates over gloo on CPU: RSS of both processes after the warm-up and at the end."""
    spec = dict(backend="gloo", device="cpu", preset=args.preset, quantization=None, bucket_mb=[args.bucket_mb[0]],
                repeats=args.rss_updates, warmup=10, checksum=True, verify=args.verify, num_buffers=args.num_buffers)
    trainer, _ = run_distributed(bench_rank, 2, spec, timeout_s=args.timeout_s)
    row = trainer["buckets"][0]
    return {"updates": args.rss_updates, "trainer_rss_after_warmup": row["rss_after_warmup"],
            "trainer_rss_last": row["rss_last"],
            "trainer_growth": (row["rss_last"] - row["rss_after_warmup"]) / row["rss_after_warmup"]}


def _environment(args: argparse.Namespace) -> dict[str, Any]:
    env = {"python": platform.python_version(), "torch": torch.__version__, "platform": platform.platform(),
           "cpus": os.cpu_count(), "command": "python " + " ".join(sys.argv),
           "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    if torch.cuda.is_available():
        env["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        env["cuda"] = torch.version.cuda
        env["nccl"] = ".".join(map(str, torch.cuda.nccl.version())) if hasattr(torch.cuda, "nccl") else None
    return env


def _waits(w: dict[str, int] | None) -> str:
    """'readback 1, comm 40 (12 blocked)': the nonzero host waits of one update."""
    if not w:
        return "n/a"
    parts = [f"{k} {v}" for k, v in w.items() if v and k != "blocked"]
    return ", ".join(parts) + f" ({w.get('blocked', 0)} blocked)"


def control_budget_s(num_tensors: int) -> float:
    """Issue 15's control-plane goal per update: ~1 ms plus ~2 us per tensor of host time."""
    return 1e-3 + 2e-6 * num_tensors


def _control(r: dict[str, Any], num_tensors: int) -> str:
    if "control_seconds" not in r:
        return "n/a"
    return f"{r['control_seconds'] * 1e3:.2f} ({control_budget_s(num_tensors) * 1e3:.2f})"


def _cpu(r: dict[str, Any]) -> str:
    if "sender_cpu_seconds" not in r:
        return "n/a"
    return f"{r['sender_cpu_seconds'] * 1e3:.2f} / {r.get('engine_cpu_seconds', 0.0) * 1e3:.2f}"


def _checks(run: dict[str, Any]) -> str:
    """Which guarantees ran in the row: manifest validation and pointer audit always, checksums as set."""
    ck = "checksums" if run.get("checksum", True) else "no checksums"
    return f"manifest, audit, commit vote, {ck}"


def _markdown(result: dict[str, Any]) -> str:
    env = result["environment"]
    lines = [f"# Transport benchmark ({result['tag']})", "", f"Command: `{env['command']}`  ",
             f"Date: {env['date']}; torch {env['torch']}; {env.get('gpus') or str(env['cpus']) + ' CPUs'}", ""]
    for run in result["runs"]:
        lines += [f"## {run['backend']}{' zero-copy' if run.get('zero_copy') else ''}, engine quantization {run['quantization'] or 'none'}, "
                  f"verify {run.get('verify', 'before_load')}", "",
                  f"{run['num_tensors']} tensors, {run['num_bytes'] / 1e9:.3f} GB per update, largest block "
                  f"{run['largest_block_bytes'] / 1e6:.1f} MB.", ""]
        baseline = "raw broadcast" if run["backend"] in ("nccl", "gloo") else "one device copy"
        lines.append(f"| bucket MB | buckets | update s (start..commit) | data s | control ms (budget) | "
                     "host CPU ms trainer / engine | call s (update_weights) | "
                     f"data GB/s | {baseline} s | data / call / end-to-end vs baseline | extra engine MB (bound) | "
                     "checks | host waits per update: trainer / engine |")
        lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in run["rows"]:
            if "raw_s" in r:
                base = f"{r['raw_s']:.4f} ({r['raw_gbps']:.1f} GB/s)"
                ratio = (f"{r['data_ratio_vs_raw']:.3f}x / {r['call_ratio_vs_raw']:.3f}x / {r['ratio_vs_raw']:.3f}x "
                         "of raw throughput")
            else:
                base = f"{r['copy_s']:.4f}"
                ratio = (f"{r['data_ratio_vs_copy']:.2f}x / {r['call_ratio_vs_copy']:.2f}x / {r['ratio_vs_copy']:.2f}x "
                         "the copy time")
            mem = (f"{r['extra_engine_bytes'] / 1e6:.0f} ({r['memory_bound_bytes'] / 1e6:.0f})"
                   if "extra_engine_bytes" in r else "n/a (CPU)")
            lines.append(f"| {r['bucket_mb']} | {r['num_buckets']} | {r['seconds']:.4f} | {r['data_seconds']:.4f} | "
                         f"{_control(r, run['num_tensors'])} | {_cpu(r)} | "
                         f"{r['call_seconds']:.4f} | {r['data_gbps']:.2f} | {base} | {ratio} | {mem} | {_checks(run)} | "
                         f"{_waits(r.get('sender_waits'))} / {_waits(r.get('engine_waits'))} |")
        lines.append("")
    if result.get("baseline"):
        b = result["baseline"]
        where = f"commit {b['commit']}" if b.get("commit") else f"the code in {b['code']}, commit not known"
        lines += [f"## Baseline: the previous code path ({where}), same arguments, in this run", ""]
        lines += ["| backend | bucket MB | update s (start..commit) | data s | control ms (budget) | "
                  "host CPU ms trainer / engine | ours: control ms | ours: host CPU ms trainer / engine |",
                  "|---|---|---|---|---|---|---|---|"]
        ours = {(r["backend"], r.get("zero_copy"), r["quantization"]): r for r in result["runs"]}
        for run in b["runs"]:
            mine = ours.get((run["backend"], run.get("zero_copy"), run["quantization"]))
            for k, r in enumerate(run["rows"]):
                m = mine["rows"][k] if mine and k < len(mine["rows"]) else {}
                name = f"{run['backend']}{'+zc' if run.get('zero_copy') else ''}"
                lines.append(f"| {name} | {r['bucket_mb']} | {r['seconds']:.4f} | {r['data_seconds']:.4f} | "
                             f"{_control(r, run['num_tensors'])} | {_cpu(r)} | "
                             f"{_control(m, run['num_tensors']) if m else 'n/a'} | {_cpu(m) if m else 'n/a'} |")
        lines.append("")
    if result.get("rss"):
        rss = result["rss"]
        lines += ["## RSS over repeated updates (gloo, CPU)", "",
                  f"{rss['updates']} consecutive updates after 10 warm-up updates: trainer RSS "
                  f"{rss['trainer_rss_after_warmup'] / 1e6:.1f} MB before, "
                  f"{rss['trainer_rss_last'] / 1e6:.1f} MB at the end ({rss['trainer_growth']:+.2%}); the engine side "
                  "is checked by tests/transport/test_memory.py (50 updates, both processes, <= 1%).", ""]
    lines += ["Host waits (last update, each side): 'readback' = device values read to the host (deferred "
              "verification: 1 per update_weights call), 'comm' = waits on a collective, 'device' = waits on a "
              "CUDA event, 'link' = doorbell records (shm/ipc), 'control' = header and status exchanges; "
              "'blocked' = how many found the work still running (the host actually stopped).", ""]
    lines += ["Control = start..commit minus the data phase on the trainer (median over updates; the budget in "
              "parentheses is issue 15's ~1 ms + ~2 us per tensor). Host CPU = the main thread's CPU time "
              "(time.thread_time) over one whole update on each side: data work (packing, loads) and control "
              "(manifest, audit, exchanges) together; waits on the peer are not CPU. Every row ran manifest "
              "validation, the pointer audit and the agreed commit; 'checks' says whether checksums ran.", ""]
    lines += ["Method: two processes; each update is timed on the trainer from start_weight_update to the "
              "engine's agreed commit (finish_weight_update), median of the repeats after warm-up; 'data' is "
              "TransferReport.transfer_seconds, the sender's time in update_weights until its last bucket is "
              "handed over: nccl/gloo, until its last broadcast completed (every byte is on the receivers; "
              "their check and load of the last bucket and the call's status exchange fall outside it); "
              "buffered shm/ipc, until every receiver released every bucket (all loaded); zero-copy, until "
              "every receiver loaded and reported (the status exchange included: the loads happen inside "
              "it). 'call' is TransferReport.call_seconds, the update_weights call from entry to return as the "
              "trainer sees it (for nccl/gloo and buffered links: data plus the receivers' check and load of "
              "the last bucket and the status exchange). The raw "
              "baseline broadcasts the same bytes in buckets of the same size with two buffers on a fresh group "
              "of the same backend, between the same processes, in the same run; the copy baseline is one "
              "flat device copy of the same bytes. Zero-copy runs ('+zc') use no buffers and no checksums: each "
              "engine copies straight from the trainer's tensors (exported once, at the first update), so "
              "their bucket size is unused. Extra engine memory = transport buffers + split-tensor "
              "staging + transient peak during an update; bound = 2 buffers + the largest block.", ""]
    return "\n".join(lines)


def _plot(result: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        print(f"[bench] matplotlib is not installed: no {path.name}")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for run in result["runs"]:
        xs = [r["bucket_mb"] for r in run["rows"]]
        label = f"{run['backend']}{' zero-copy' if run.get('zero_copy') else ''} ({run['quantization'] or 'bf16'})"
        ax.plot(xs, [r["data_gbps"] for r in run["rows"]], marker="o", label=f"{label}, update_weights")
        ax.plot(xs, [r["gbps"] for r in run["rows"]], marker=".", linestyle="-.", alpha=0.6,
                label=f"{label}, start..commit")
        if run["rows"] and "raw_gbps" in run["rows"][0]:
            ax.plot(xs, [r["raw_gbps"] for r in run["rows"]], linestyle="--", marker="x",
                    label=f"raw {run['backend']} broadcast")
        if run["rows"] and "copy_s" in run["rows"][0]:
            copy = run["num_bytes"] / run["rows"][0]["copy_s"] / 1e9
            ax.axhline(copy, linestyle=":", color="gray", label="one device copy")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("bucket size (MB)")
    ax.set_ylabel("GB/s (payload per update)")
    ax.set_title(f"weight update throughput vs bucket size ({result['tag']})")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_phases(result: dict[str, Any], path: Path) -> None:
    """Time per phase of one update, per row: the data phase and the control around it (start..commit
    minus data), next to the row's baseline (one device copy, or a raw broadcast of the same bytes)."""
    try:
        import matplotlib
    except ImportError:
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [(f"{run['backend']}{'+zc' if run.get('zero_copy') else ''} {run['quantization'] or 'bf16'} "
             f"{r['bucket_mb']} MiB", r) for run in result["runs"] for r in run["rows"]]
    if not rows:
        return
    fig, ax = plt.subplots(figsize=(8, 0.6 * len(rows) + 2.4))
    ys = list(range(len(rows)))
    data = [r["data_seconds"] * 1e3 for _, r in rows]
    control = [(r["seconds"] - r["data_seconds"]) * 1e3 for _, r in rows]
    ax.barh(ys, data, color="tab:blue", label="data (until the last bucket is loaded)")
    ax.barh(ys, control, left=data, color="tab:orange", label="control (start, status exchanges, commit)")
    for y, (_, r) in zip(ys, rows):
        base = r.get("copy_s") or r.get("raw_s")
        if base:
            ax.plot([base * 1e3] * 2, [y - 0.4, y + 0.4], color="black", linewidth=2)
        total = r["seconds"] * 1e3
        ratio = f" = {r['seconds'] / base:.2f}x" if base else ""
        ax.text(total, y, f" {total:.1f} ms{ratio}", va="center", fontsize=8)
    ax.plot([], [], color="black", linewidth=2, label="baseline (one device copy / raw broadcast)")
    ax.set_yticks(ys, [label for label, _ in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("ms per update (start..commit, median)")
    ax.set_title(f"time per phase of an update ({result['tag']})")
    ax.set_xlim(0, max(d + c for d, c in zip(data, control)) * 1.3)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.3 - 0.6 / len(rows)), ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def _baseline_run(args: argparse.Namespace, argv: list[str], tag: str) -> dict[str, Any]:
    """This benchmark, same arguments, with weight_sync imported from ``--baseline-code`` (a subprocess:
    spawned ranks import weight_sync before they could be redirected)."""
    import subprocess

    root = Path(args.baseline_code).resolve()
    if not (root / "weight_sync" / "__init__.py").is_file():
        raise SystemExit(f"--baseline-code: {root} has no weight_sync package")
    rest, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in ("--baseline-code", "--tag"):
            skip = True
            continue
        if a.startswith(("--baseline-code=", "--tag=")):
            continue
        rest.append(a)
    base_tag = f"{tag}_baseline_code"
    env = dict(os.environ, PYTHONPATH=f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    subprocess.run([sys.executable, __file__, *rest, "--tag", base_tag], env=env, check=True)
    out = json.loads((RESULTS / f"transport_{base_tag}.json").read_text())
    for name in ("json", "md", "png"):
        (RESULTS / f"transport_{base_tag}.{name}").unlink(missing_ok=True)  # kept inside our result
    (RESULTS / f"transport_{base_tag}_phases.png").unlink(missing_ok=True)
    # A DIR inside another checkout (an untracked copy) would report that checkout's HEAD: record a
    # commit only when DIR is the top of a checkout of its own (a git worktree, a clone).
    top = subprocess.run(["git", "-C", str(root), "rev-parse", "--show-toplevel"], capture_output=True, text=True)
    commit = None
    if top.returncode == 0 and Path(top.stdout.strip()).resolve() == root:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True)
        commit = head.stdout.strip() or None
    return {"code": str(root), "commit": commit, "runs": out["runs"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when available")
    p.add_argument("--preset", default=None, help="model preset (default: qwen3-8b on cuda, bench on cpu)")
    p.add_argument("--backends", default=None,
                   help="comma list (default: nccl,ipc on cuda, gloo,shm on cpu); 'ipc+zc' / 'shm+zc': zero-copy")
    p.add_argument("--quantization", default=None,
                   help="comma list of engine quantizations, for every backend (default: none,fp8_block on cuda, none on cpu)")
    p.add_argument("--bucket-mb", default=None, help="comma list of bucket sizes in MiB")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--no-checksum", action="store_true", help="disable per-bucket checksums")
    p.add_argument("--num-buffers", type=int, default=2, help="transport buffers per side (2..8)")
    p.add_argument("--verify", choices=["deferred", "before_load"], default="deferred",
                   help="when receivers check each bucket (TransportConfig.verify)")
    p.add_argument("--rss-updates", type=int, default=50,
                   help="CPU: consecutive updates (after 10 warm-up updates) for the RSS check (0: skip)")
    p.add_argument("--timeout-s", type=float, default=1800)
    p.add_argument("--tag", default=None)
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="write a cProfile of each rank of each run to DIR/<backend>_<quantization>/rank<N>.prof "
                        "(the times then include the profiler)")
    p.add_argument("--baseline-code", default=None, metavar="DIR",
                   help="also run every backend with weight_sync imported from DIR (a checkout of the previous "
                        "code path, e.g. a git worktree), in this run; its rows are reported next to ours")
    args = p.parse_args(argv)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = args.device == "cuda"
    args.preset = args.preset or ("qwen3-8b" if cuda else "bench")
    default_backends = ("nccl,ipc" if torch.cuda.device_count() >= 2 else "ipc") if cuda else "gloo,shm,shm+zc"
    backends = (args.backends or default_backends).split(",")
    args.bucket_mb = [int(x) for x in (args.bucket_mb or ("64,256,1024,2048" if cuda else "1,4,16")).split(",")]
    quants = [None if q == "none" else q for q in (args.quantization or ("none,fp8_block" if cuda else "none")).split(",")]
    tag = args.tag or ("gpu" if cuda else "cpu")
    result: dict[str, Any] = {"tag": tag, "environment": _environment(args), "preset": args.preset, "runs": []}
    for backend in backends:
        # Every backend honours --quantization: the engine quantizes online whatever carried the weights.
        for q in quants:
            if backend.endswith("+zc") and backend.removesuffix("+zc") not in ("ipc", "shm"):
                p.error(f"--backends: zero-copy ('+zc') needs ipc or shm, got {backend!r}")
            print(f"[bench] {backend} quantization={q or 'none'} buckets={args.bucket_mb} MiB", flush=True)
            run = _run(args, backend, q)
            for r in run["rows"]:
                extra = (f" raw {r['raw_gbps']:.2f} GB/s, ratio data {r['data_ratio_vs_raw']:.3f} / call "
                         f"{r['call_ratio_vs_raw']:.3f} / end-to-end {r['ratio_vs_raw']:.3f}" if "raw_s" in r
                         else f" copy {r['copy_s']:.4f} s, data {r['data_ratio_vs_copy']:.2f}x / call "
                              f"{r['call_ratio_vs_copy']:.2f}x / end-to-end {r['ratio_vs_copy']:.2f}x the copy")
                mem = (f", extra engine {r['extra_engine_bytes'] / 1e6:.0f} MB (bound {r['memory_bound_bytes'] / 1e6:.0f})"
                       if "extra_engine_bytes" in r else "")
                print(f"  bucket {r['bucket_mb']} MiB: update {r['seconds']:.4f} s, data {r['data_seconds']:.4f} s, "
                      f"control {_control(r, run['num_tensors'])} ms, host CPU {_cpu(r)} ms, "
                      f"call {r['call_seconds']:.4f} s "
                      f"({r['data_gbps']:.2f} GB/s){extra}{mem}", flush=True)
                print(f"    host waits per update: trainer {_waits(r.get('sender_waits'))}; "
                      f"engine {_waits(r.get('engine_waits'))}", flush=True)
            result["runs"].append(run)
    if not cuda and args.rss_updates:
        result["rss"] = _rss_run(args)
        print(f"[bench] RSS growth over {args.rss_updates} updates: {result['rss']['trainer_growth']:+.2%}")
    if args.baseline_code:
        result["baseline"] = _baseline_run(args, argv if argv is not None else sys.argv[1:], tag)
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = RESULTS / f"transport_{tag}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1, default=str))
    stem.with_suffix(".md").write_text(_markdown(result))
    _plot(result, stem.with_suffix(".png"))
    _plot_phases(result, stem.parent / f"{stem.name}_phases.png")
    print(f"[bench] wrote {stem}.json/.md/.png and {stem.name}_phases.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
