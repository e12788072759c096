"""Runtime-weight cache: startup time (miss vs hit vs no cache) and summed PSS (cache vs private copies).

Each startup runs in a fresh spawned process (imports excluded from the timing): build the module with
untouched ``torch.empty`` parameters, then either the ordinary loader alone (baseline), a cache miss
(load + publish into an empty cache root) or a cache hit (validate + map). The ordinary loader here is a
bare copy out of a page-cache-warm safetensors file - the cheapest possible loader, so the hit's
advantage over real loaders (transforms, TP slicing, cold disk) is larger than measured here.

PSS: N processes load the same weights at once, privately or through the cache; every process touches
all weights; /proc/<pid>/smaps_rollup is read for all of them while all are alive, before and after
loading, and the summed growth is reported against one copy of the weights.

    .venv/bin/python benchmarks/bench_runtime_cache.py [--size-mib 256] [--repeats 3] [--procs 4]

Writes benchmarks/results/runtime_cache_cpu.json and .md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import platform
import re
import shutil
import statistics
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path

import safetensors
import torch
from safetensors.torch import save_file
from torch import nn

import weight_sync
from weight_sync.offload.cache import LayoutIdentity, load_with_runtime_cache
from weight_sync.offload.cache.publish import DEFAULT_MAX_SHARD_BYTES
from weight_sync.offload.cache.root import filesystem_type
from weight_sync.safetensors_io import map_safetensors

RESULTS = Path(__file__).resolve().parent / "results"
LAYOUT = LayoutIdentity(
    tp_size=1, tp_rank=0, sp_impl=None, sp_size=1, dtype="float32", layout="dense", model_version="bench"
)
BLOCK_MIB = 16


class SyntheticDiT(nn.Module):
    """``num_blocks`` blocks of one 16 MiB float32 weight each, allocated but untouched."""

    def __init__(self, num_blocks: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Module() for _ in range(num_blocks))
        for block in self.blocks:
            block.weight = nn.Parameter(torch.empty(BLOCK_MIB * 1024, 256))


def _loader(module: nn.Module, ckpt: Path):
    def load() -> None:
        params = dict(module.named_parameters())
        with torch.no_grad():
            for name, t in map_safetensors(ckpt).items():
                params[name].copy_(t)

    return load


def _pss_kib(pid: int) -> int:
    m = re.search(r"^Pss:\s+(\d+) kB", Path(f"/proc/{pid}/smaps_rollup").read_text(), re.MULTILINE)
    if not m:
        raise RuntimeError(f"/proc/{pid}/smaps_rollup has no Pss line")
    return int(m.group(1))


def _touch(module: nn.Module) -> float:
    with torch.no_grad():
        return float(sum(float(p.sum()) for p in module.parameters()))


def _status_mib() -> dict[str, float]:
    text = Path("/proc/self/status").read_text()
    return {
        k: int(re.search(rf"^{k}:\s+(\d+) kB", text, re.MULTILINE).group(1)) / 1024  # type: ignore[union-attr]
        for k in ("VmHWM", "VmRSS", "RssAnon", "RssFile")
    }


def _startup_worker(
    conn: Connection, mode: str, ckpt: str, cache: str, num_blocks: int, max_shard_bytes: int
) -> None:
    torch.set_num_threads(1)
    _touch(SyntheticDiT(0))
    # Writing 5 to clear_refs resets the peak-RSS mark (VmHWM), so the peak below is the startup's own
    # and not the import's.
    Path("/proc/self/clear_refs").write_text("5")
    before = _status_mib()
    start = time.perf_counter()
    module = SyntheticDiT(num_blocks)
    status = "ordinary"
    if mode == "ordinary":
        _loader(module, Path(ckpt))()
    else:
        result = load_with_runtime_cache(
            module, checkpoint_files=[ckpt], transform_id="bench.copy@1", layout=LAYOUT,
            ordinary_load=_loader(module, Path(ckpt)), tensor_names=None, cache_dir=cache,
            lock_timeout_s=600, max_shard_bytes=max_shard_bytes,
        )
        status = result.status
    elapsed = time.perf_counter() - start
    _touch(module)
    after = _status_mib()
    conn.send({
        "status": status,
        "startup_s": elapsed,
        "peak_rss_growth_mib": after["VmHWM"] - before["VmRSS"],
        "private_growth_mib": after["RssAnon"] - before["RssAnon"],
        "file_backed_growth_mib": after["RssFile"] - before["RssFile"],
    })


def _sharing_worker(conn: Connection, use_cache: bool, ckpt: str, cache: str, num_blocks: int) -> None:
    torch.set_num_threads(1)
    module = SyntheticDiT(num_blocks)
    _touch(SyntheticDiT(0))
    conn.send(os.getpid())
    conn.recv()
    status = "private"
    if use_cache:
        result = load_with_runtime_cache(
            module, checkpoint_files=[ckpt], transform_id="bench.copy@1", layout=LAYOUT,
            ordinary_load=_loader(module, Path(ckpt)), tensor_names=None, cache_dir=cache,
            lock_timeout_s=600,
        )
        status = result.status
    else:
        _loader(module, Path(ckpt))()
    _touch(module)
    conn.send(status)
    conn.recv()


def _spawn(ctx: mp.context.SpawnContext, target, *args) -> tuple[mp.Process, Connection]:
    parent, child = ctx.Pipe()
    p = ctx.Process(target=target, args=(child, *args))
    p.start()
    child.close()
    return p, parent


def _startup(
    ctx: mp.context.SpawnContext, mode: str, ckpt: Path, cache: Path, num_blocks: int, shard: int
) -> dict:
    p, conn = _spawn(ctx, _startup_worker, mode, str(ckpt), str(cache), num_blocks, shard)
    report = conn.recv()
    p.join()
    if p.exitcode != 0:
        raise RuntimeError(f"startup worker ({mode}) exited with {p.exitcode}")
    return report


def _sharing(ctx: mp.context.SpawnContext, use_cache: bool, procs: int, ckpt: Path, cache: Path,
             num_blocks: int) -> dict:
    started = [_spawn(ctx, _sharing_worker, use_cache, str(ckpt), str(cache), num_blocks) for _ in range(procs)]
    pids = [conn.recv() for _, conn in started]
    before = {pid: _pss_kib(pid) for pid in pids}
    for _, conn in started:
        conn.send("go")
    statuses = [conn.recv() for _, conn in started]
    after = {pid: _pss_kib(pid) for pid in pids}
    for p, conn in started:
        conn.send("exit")
        p.join()
        if p.exitcode != 0:
            raise RuntimeError(f"sharing worker exited with {p.exitcode}")
    return {"statuses": statuses, "pss_growth_mib": sum(after[p] - before[p] for p in pids) / 1024}


def _cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=256, help="model size (multiple of 16 MiB)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--procs", type=int, default=4, help="processes in the PSS comparison")
    parser.add_argument("--max-shard-mib", type=int, default=None,
                        help="shard size when publishing (default: the library's)")
    parser.add_argument("--workdir", default=None, help="where checkpoint and cache live (local disk)")
    parser.add_argument("--out", default=str(RESULTS / "runtime_cache_cpu"))
    args = parser.parse_args()
    if args.size_mib < BLOCK_MIB or args.size_mib % BLOCK_MIB:
        parser.error(f"--size-mib must be a positive multiple of {BLOCK_MIB}, got {args.size_mib}")
    num_blocks = args.size_mib // BLOCK_MIB
    shard = DEFAULT_MAX_SHARD_BYTES if args.max_shard_mib is None else args.max_shard_mib << 20
    ctx = mp.get_context("spawn")
    work = Path(tempfile.mkdtemp(prefix="bench_runtime_cache_", dir=args.workdir))
    try:
        ckpt = work / "model.safetensors"
        g = torch.Generator().manual_seed(0)
        save_file({f"blocks.{i}.weight": torch.randn(BLOCK_MIB * 1024, 256, generator=g)
                   for i in range(num_blocks)}, str(ckpt))
        _startup(ctx, "ordinary", ckpt, work / "unused", num_blocks, shard)  # warm the checkpoint's page cache

        runs: dict[str, list[dict]] = {"ordinary": [], "miss": [], "hit": []}
        for i in range(args.repeats):
            cache = work / f"cache{i}"
            runs["ordinary"].append(_startup(ctx, "ordinary", ckpt, cache, num_blocks, shard))
            runs["miss"].append(_startup(ctx, "cache", ckpt, cache, num_blocks, shard))
            runs["hit"].append(_startup(ctx, "cache", ckpt, cache, num_blocks, shard))
            assert runs["miss"][-1]["status"] == "published", runs["miss"][-1]
            assert runs["hit"][-1]["status"] == "hit", runs["hit"][-1]
            shutil.rmtree(cache)
        startup = {
            mode: {
                "median_s": statistics.median(r["startup_s"] for r in rs),
                "all_s": [round(r["startup_s"], 4) for r in rs],
                "peak_rss_growth_mib": statistics.median(r["peak_rss_growth_mib"] for r in rs),
                "private_growth_mib": statistics.median(r["private_growth_mib"] for r in rs),
                "file_backed_growth_mib": statistics.median(r["file_backed_growth_mib"] for r in rs),
            }
            for mode, rs in runs.items()
        }
        private = _sharing(ctx, False, args.procs, ckpt, work / "cache_pss", num_blocks)
        shared = _sharing(ctx, True, args.procs, ckpt, work / "cache_pss", num_blocks)
        fstype = filesystem_type(work)
    finally:
        shutil.rmtree(work, ignore_errors=False)

    one_copy_mib = float(args.size_mib)
    result = {
        "benchmark": "runtime_cache",
        "date": datetime.date.today().isoformat(),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "hardware": {
            "cpu": _cpu_model(), "cpus": os.cpu_count(), "platform": platform.platform(),
            "cache_filesystem": fstype,
        },
        "versions": {
            "python": platform.python_version(), "torch": torch.__version__,
            "safetensors": safetensors.__version__, "weight_sync": weight_sync.__version__,
        },
        "model_mib": args.size_mib,
        "max_shard_mib": shard >> 20,
        "startup": startup,
        "ratios": {
            "miss_over_hit": startup["miss"]["median_s"] / startup["hit"]["median_s"],
            "ordinary_over_hit": startup["ordinary"]["median_s"] / startup["hit"]["median_s"],
            "miss_over_ordinary": startup["miss"]["median_s"] / startup["ordinary"]["median_s"],
        },
        "pss": {
            "procs": args.procs,
            "private_growth_mib": private["pss_growth_mib"],
            "private_over_one_copy": private["pss_growth_mib"] / one_copy_mib,
            "cache_growth_mib": shared["pss_growth_mib"],
            "cache_over_one_copy": shared["pss_growth_mib"] / one_copy_mib,
            "cache_statuses": sorted(shared["statuses"]),
        },
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".md").write_text(_markdown(result))
    print(_markdown(result))
    return 0


def _markdown(r: dict) -> str:
    s, ratios, pss = r["startup"], r["ratios"], r["pss"]
    hw, v = r["hardware"], r["versions"]
    rows = "\n".join(
        f"| {label} | {s[m]['median_s'] * 1000:.0f} ms | {', '.join(f'{x * 1000:.0f}' for x in s[m]['all_s'])} "
        f"| {s[m]['peak_rss_growth_mib']:.0f} MiB | {s[m]['private_growth_mib']:.0f} MiB "
        f"| {s[m]['file_backed_growth_mib']:.0f} MiB |"
        for m, label in (("ordinary", "ordinary load, no cache (baseline)"),
                         ("miss", "cache miss: load + publish"), ("hit", "cache hit: validate + map"))
    )
    return f"""# Runtime-weight cache: startup and PSS ({r['date']})

Command: `{r['command']}`
Hardware: {hw['cpu']}, {hw['cpus']} CPUs, {hw['platform']}; cache on {hw['cache_filesystem']}.
Versions: Python {v['python']}, torch {v['torch']}, safetensors {v['safetensors']}, weight_sync {v['weight_sync']}.
Model: {r['model_mib']} MiB float32 in 16 MiB blocks, cache shards of {r['max_shard_mib']} MiB; page cache warm; fresh process per startup.

## Startup (module construction + load, median of repeats)

| mode | median | runs (ms) | peak RSS growth | private (anon) after | file-backed after |
| --- | --- | --- | --- | --- | --- |
{rows}

- miss / hit: **{ratios['miss_over_hit']:.2f}x** (a hit skips the ordinary loader entirely)
- ordinary / hit: {ratios['ordinary_over_hit']:.2f}x (the baseline loader is a bare page-cache copy; a
  hit pays one SHA-256 pass over the entry instead, so real loaders with transforms gain more)
- miss / ordinary: {ratios['miss_over_ordinary']:.2f}x (the one-time cost of publishing: write, hash, fsync)

Memory columns are one process's growth over the startup (VmHWM reset through /proc/self/clear_refs;
RssAnon and RssFile after all weights were touched). Peak RSS counts resident file-backed pages too:
a hit's weights are shareable page cache, not private memory.

## Summed PSS growth of {pss['procs']} processes loading at once

| mode | summed PSS growth | x one copy |
| --- | --- | --- |
| private copies (no cache) | {pss['private_growth_mib']:.0f} MiB | {pss['private_over_one_copy']:.2f}x |
| runtime cache | {pss['cache_growth_mib']:.0f} MiB | {pss['cache_over_one_copy']:.2f}x |

Cache statuses: {', '.join(pss['cache_statuses'])}.
"""


if __name__ == "__main__":
    sys.exit(main())
