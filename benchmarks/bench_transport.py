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

sys.path.insert(0, str(Path(__file__).resolve().parent))  # (the benchmarks' own modules: no weight_sync there)

from common import cast_copy_eps, format_bound_s, fp8_elements
from transport_report import bound_note, control, cpu, markdown, plot, plot_phases, waits

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
    if rank != 0:
        # Counted after the updates: an engine made with load_weights=False quantizes at its first load.
        out["fp8_elements"] = fp8_elements(engine.model)
        if device.type == "cuda" and out["fp8_elements"]:
            # The fp8 engine's format bound needs the cast rate of the device the engine writes on.
            out["cast_eps"] = cast_copy_eps(device, repeats)
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
            if "cast_eps" in engine and quantization is not None:
                # Per-tensor scales read what is quantized twice; block and channel scales once.
                fmt = "fp8" if quantization in ("fp8", "fp8_per_tensor") else "fp8_block"
                row["bound_s"] = format_bound_s(fmt, engine["fp8_elements"], trainer["num_bytes"],
                                                trainer["num_bytes"] / trainer["copy_s"], engine["cast_eps"])
                row["ratio_vs_bound"] = t["seconds"] / row["bound_s"]
        if "extra_engine_bytes" in e:
            bucket = t["bucket_mb"] << 20
            buffers = 0 if backend == "ipc" or zero_copy else args.num_buffers * (bucket + TRAILER_BYTES)
            row["memory_bound_bytes"] = buffers + trainer["largest_block_bytes"]
        rows.append(row)
    return {"backend": backend, "zero_copy": zero_copy, "quantization": quantization, "verify": args.verify,
            "checksum": spec["checksum"] and not zero_copy, "num_bytes": trainer["num_bytes"],
            "num_tensors": trainer["num_tensors"], "largest_block_bytes": trainer["largest_block_bytes"],
            "engine_fp8_elements": engine.get("fp8_elements", 0), "rows": rows}


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
                              f"{r['call_ratio_vs_copy']:.2f}x / end-to-end {r['ratio_vs_copy']:.2f}x the copy"
                              f"{bound_note(r, q)}")
                mem = (f", extra engine {r['extra_engine_bytes'] / 1e6:.0f} MB (bound {r['memory_bound_bytes'] / 1e6:.0f})"
                       if "extra_engine_bytes" in r else "")
                print(f"  bucket {r['bucket_mb']} MiB: update {r['seconds']:.4f} s, data {r['data_seconds']:.4f} s, "
                      f"control {control(r, run['num_tensors'])} ms, host CPU {cpu(r)} ms, "
                      f"call {r['call_seconds']:.4f} s "
                      f"({r['data_gbps']:.2f} GB/s){extra}{mem}", flush=True)
                print(f"    host waits per update: trainer {waits(r.get('sender_waits'))}; "
                      f"engine {waits(r.get('engine_waits'))}", flush=True)
            result["runs"].append(run)
    if not cuda and args.rss_updates:
        result["rss"] = _rss_run(args)
        print(f"[bench] RSS growth over {args.rss_updates} updates: {result['rss']['trainer_growth']:+.2%}")
    if args.baseline_code:
        result["baseline"] = _baseline_run(args, argv if argv is not None else sys.argv[1:], tag)
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = RESULTS / f"transport_{tag}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1, default=str))
    stem.with_suffix(".md").write_text(markdown(result))
    plot(result, stem.with_suffix(".png"))
    plot_phases(result, stem.parent / f"{stem.name}_phases.png")
    print(f"[bench] wrote {stem}.json/.md/.png and {stem.name}_phases.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
