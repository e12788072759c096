"""Timeline of one zero-copy ipc update (trainer + engine spans, engine GPU kernels), for issue 15 profiling.

Every method of the transport and session classes is wrapped (a span in perf_counter time and a
profiler range); the engine's last update runs under torch.profiler, whose kernel times are mapped onto
the same clock through the spans both recorded. ZC_DEEP=1 also wraps the per-tensor replay, write and
audit classes (slower, distorts the timeline).

python scripts/zc_trace.py [--device cpu] [--quantization fp8_block] [--preset qwen3-8b] [--out DIR]
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.getcwd())
from benchmarks.bench_transport import _config
from weight_sync.engine import ReferenceEngine
from weight_sync.manifest import Manifest
from weight_sync.testing import random_weights, run_distributed
from weight_sync.transport import TransportConfig, WeightReceiver, WeightSender

SPANS: list[tuple[str, float, float]] = []


def _wrap_all() -> None:
    import importlib
    targets = {
        "weight_sync.transport.sender": ["WeightSender"],
        "weight_sync.transport.receiver": ["WeightReceiver"],
        "weight_sync.transport.group": ["Channel"],
        "weight_sync.transport.zerocopy": ["RegionImporter", "RegionExporter"],
        "weight_sync.transport.zerocopy_sender": None,
        "weight_sync.transport.receiver_link": None,
        "weight_sync.transport.sender_link": None,
        "weight_sync.reload.session": None,
        "weight_sync.reload.ending": None,
        "weight_sync.transport.doorbell": None,
    }
    if os.environ.get("ZC_DEEP"):
        targets.update({"weight_sync.reload.replay": None, "weight_sync.reload.writes": None,
                        "weight_sync.reload.audit": None})
    for modname, classes in targets.items():
        try:
            mod = importlib.import_module(modname)
        except ImportError:
            continue
        names = classes or [n for n, v in vars(mod).items() if isinstance(v, type) and v.__module__ == modname]
        for cname in names:
            cls = getattr(mod, cname)
            for attr, fn in list(vars(cls).items()):
                if callable(fn) and not attr.startswith("__") and not isinstance(fn, (staticmethod, classmethod, type)):
                    setattr(cls, attr, _wrapped(f"{cname}.{attr}", fn))
        if modname == "weight_sync.transport.zerocopy":
            mod.load_in_place = _wrapped("load_in_place", mod.load_in_place)
            import weight_sync.transport.receiver_link as rl
            if hasattr(rl, "load_in_place"):
                rl.load_in_place = mod.load_in_place


def _wrapped(name: str, fn: Any) -> Any:
    @functools.wraps(fn)
    def w(*a: Any, **k: Any) -> Any:
        t0 = time.perf_counter()
        with torch.profiler.record_function("S:" + name):
            try:
                return fn(*a, **k)
            finally:
                SPANS.append((name, t0, time.perf_counter()))
    return w


def rank_fn(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    _wrap_all()
    dev = torch.device(spec["device"], 0) if spec["device"] == "cuda" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    backend = "ipc" if dev.type == "cuda" else "shm"
    store = dist.distributed_c10d._get_default_store()
    cfg = _config(spec["preset"])
    n = spec["repeats"]
    out: dict[str, Any] = {}
    prof_dir = Path(spec["out"])
    if rank == 0:
        weights = list(random_weights(cfg, seed=0, dtype=torch.bfloat16, device=dev))
        manifest = Manifest.from_named_tensors(weights)
        sender = WeightSender(TransportConfig(backend=backend, bucket_bytes=2048 << 20, timeout_s=600, zero_copy=True,
                                              checksum=False, verify="deferred"), num_receivers=1)
        store.set("k", sender.address)
        sender.connect()
        times, starts = [], []
        for r in range(n):
            if dev.type == "cuda":
                torch.cuda.synchronize()
            SPANS.clear()
            t0 = time.perf_counter()
            sender.send(weights, manifest, version=r)
            times.append(time.perf_counter() - t0)
            starts.append(t0)
        out["spans"] = list(SPANS)
        out["t0"] = starts[-1]
        out["times"] = times
        if dev.type == "cuda":
            nbytes = manifest.nbytes
            a = torch.empty(nbytes, dtype=torch.uint8, device=dev)
            b = torch.empty_like(a)
            cs = []
            for _ in range(5):
                torch.cuda.synchronize()
                t = time.perf_counter()
                b.copy_(a)
                torch.cuda.synchronize()
                cs.append(time.perf_counter() - t)
            out["copy_s"] = min(cs)
            del a, b
        sender.close()
    else:
        with tempfile.TemporaryDirectory() as d:
            (Path(d) / "config.json").write_text(json.dumps(cfg))
            engine = ReferenceEngine.from_checkpoint(d, device=dev, quantization=spec["quantization"], load_weights=False)
        receiver = WeightReceiver(engine, store.get("k").decode(), 1, fingerprint=False)
        receiver.connect()
        for r in range(n):
            SPANS.clear()
            if r == n - 1 and spec["profile"]:
                acts = [torch.profiler.ProfilerActivity.CPU]
                if dev.type == "cuda":
                    acts.append(torch.profiler.ProfilerActivity.CUDA)
                with torch.profiler.profile(activities=acts) as p:
                    receiver.receive_update()
                p.export_chrome_trace(str(prof_dir / "engine_trace.json"))
            elif os.environ.get("ZC_CPROFILE") and r >= 2:
                import cProfile
                prof = cProfile.Profile()
                prof.runcall(receiver.receive_update)
                prof.dump_stats(str(prof_dir / f"engine_{r}.prof"))
            else:
                receiver.receive_update()
            if r == n - 2:
                out["spans_noprof"] = list(SPANS)
        out["spans"] = list(SPANS)
        receiver.close()
    return out


def _tree(spans: list[tuple[str, float, float]], t0: float, tag: str, min_ms: float) -> list[tuple[float, str]]:
    rows = []
    for name, a, b in spans:
        if (b - a) * 1e3 >= min_ms:
            rows.append((a - t0, f"{tag} {1e3 * (a - t0):8.3f} -> {1e3 * (b - t0):8.3f} ({1e3 * (b - a):7.3f} ms) {name}"))
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda")
    p.add_argument("--preset", default="qwen3-8b")
    p.add_argument("--quantization", default=None)
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/zc_trace"))
    p.add_argument("--min-ms", type=float, default=0.03)
    p.add_argument("--no-profile", action="store_true")
    a = p.parse_args()
    Path(a.out).mkdir(parents=True, exist_ok=True)
    spec = dict(device=a.device, preset=a.preset, quantization=a.quantization, repeats=a.repeats, out=a.out,
                profile=not a.no_profile)
    trainer, engine = run_distributed(rank_fn, 2, spec, timeout_s=900)
    t0 = trainer["t0"]
    print(f"quantization {a.quantization}: send() times ms: {[round(t * 1e3, 2) for t in trainer['times']]}")
    print(f"median (after 2) {1e3 * statistics.median(trainer['times'][2:]):.2f} ms; copy {1e3 * trainer.get('copy_s', 0):.2f} ms")
    print("== last update (engine profiled), t=0 at the trainer's send entry")
    rows = _tree(trainer["spans"], t0, "T", a.min_ms) + _tree(engine["spans"], t0, "E", a.min_ms)
    trace = Path(a.out) / "engine_trace.json"
    if trace.exists():
        ev = json.loads(trace.read_text())["traceEvents"]
        anchors = {e["name"][2:]: e["ts"] for e in ev if e.get("name", "").startswith("S:") and e.get("ph") == "X"}
        # kineto us -> perf_counter s, from a span both recorded
        offs = [anchors[n] * 1e-6 - s for n, s, _ in engine["spans"] if n in anchors]
        off = statistics.median(offs) if offs else None
        kern = sorted((e["ts"], e["ts"] + e.get("dur", 0), e["name"]) for e in ev
                      if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and e.get("ph") == "X")
        if kern and off is not None:
            first, last = kern[0][0] * 1e-6 - off - t0, kern[-1][1] * 1e-6 - off - t0
            busy = sum(k[1] - k[0] for k in kern) * 1e-3
            rows.append((first, f"G {1e3 * first:8.3f} -> {1e3 * last:8.3f} kernels: {len(kern)}, busy {busy:.3f} ms"))
            gaps = [(kern[i][0] - kern[i - 1][1], kern[i - 1][1], kern[i][2][:50]) for i in range(1, len(kern))]
            for g, at, nm in sorted(gaps, reverse=True)[:8]:
                ts = at * 1e-6 - off - t0
                rows.append((ts, f"G {1e3 * ts:8.3f} gap {g * 1e-3:.3f} ms before {nm}"))
            by: dict[str, list[float]] = {}
            for s, e, nm in kern:
                by.setdefault(nm[:60], []).append((e - s) * 1e-3)
            for nm, d in sorted(by.items(), key=lambda x: -sum(x[1]))[:10]:
                print(f"  kernel {sum(d):8.3f} ms x{len(d):4d}  {nm}")
    for _, line in sorted(rows):
        print(line)
    print("== previous update (no profiler)")
    if "spans_noprof" in engine:
        print("(engine spans of update n-2 only; trainer spans are of the last update)")
        ss = engine["spans_noprof"]
        top = [s for s in ss if s[0] in ("WeightReceiver.receive_update",)]
        if top:
            base = top[0][1]
            for name, x, y in sorted(ss, key=lambda s: s[1]):
                if (y - x) * 1e3 >= a.min_ms:
                    print(f"E {1e3 * (x - base):8.3f} -> {1e3 * (y - base):8.3f} ({1e3 * (y - x):7.3f} ms) {name}")


if __name__ == "__main__":
    main()
