"""Shared benchmark plumbing: environment description, memory probes, timing, result files."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def environment() -> dict[str, Any]:
    """Hardware and versions, stated in every result file."""
    env: dict[str, Any] = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
    }
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
        env["gpus"] = torch.cuda.device_count()
        env["cuda"] = torch.version.cuda
    return env


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def rss_bytes() -> int:
    """Resident set size of this process (VmRSS)."""
    return _status_kb("VmRSS") * 1024


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


class PeakMemory:
    """Peak extra memory of a region: CUDA max allocated on GPU, VmHWM growth on CPU.

    On CPU the kernel's high-water mark is reset through /proc/self/clear_refs (Linux >= 4.0), so the
    peak is the region's own, not the process's history.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.peak_extra_bytes = 0

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
        else:
            _malloc_trim()  # return freed heap first, or reuse of earlier frees would hide the region's peak
            Path("/proc/self/clear_refs").write_text("5")
            self._base = rss_bytes()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_extra_bytes = torch.cuda.max_memory_allocated(self.device) - self._base
        else:
            self.peak_extra_bytes = max(0, _status_kb("VmHWM") * 1024 - self._base)


def _malloc_trim() -> None:
    import ctypes
    import gc

    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to trim
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def timed(fn: Callable[[], Any], device: torch.device, repeats: int, warmup: int = 1) -> list[float]:
    """Wall seconds of ``fn`` per repeat (synchronized on CUDA), after ``warmup`` untimed runs."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        out.append(time.perf_counter() - t)
    return out


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def cast_copy_eps(device: torch.device, repeats: int) -> float:
    """bf16 elements per second a cast copy into fp8 moves (read 2 bytes, write 1), on 512 M elements
    (16 M off CUDA)."""
    n = 1 << (29 if device.type == "cuda" else 24)
    src = torch.empty(n, dtype=torch.bfloat16, device=device).fill_(1)
    dst = torch.empty(n, dtype=torch.float8_e4m3fn, device=device)
    return n / median(timed(lambda: dst.copy_(src), device, repeats))


def fp8_elements(model: torch.nn.Module) -> int:
    """How many fp8 elements ``model`` holds (what an fp8 engine's reload writes as fp8)."""
    return sum(t.numel() for t in model.state_dict().values() if t.dtype == torch.float8_e4m3fn)


def format_bound_s(fmt: str, fp8: int, nbytes: int, copy_Bps: float, cast_eps: float) -> float:
    """The hardware bound of a reload of ``nbytes`` of bf16 tensors into an engine in format ``fmt``
    holding ``fp8`` fp8 elements (:func:`fp8_elements`).

    bf16: one device copy. fp8 (block or channel scales): what is quantized is read once and written
    once as fp8 (a cast copy of the same elements), the rest copied; per-tensor scales (``fp8``) read
    what is quantized twice (the absmax, then the cast), so its part is 5/3 of the cast copy.
    """
    if fmt == "bf16":
        return nbytes / copy_Bps
    cast_s = fp8 / cast_eps * (5 / 3 if fmt == "fp8" else 1.0)
    return cast_s + max(nbytes - 2 * fp8, 0) / copy_Bps


def write_results(name: str, payload: dict[str, Any], markdown: str) -> tuple[Path, Path]:
    """Write ``<name>.json`` and ``<name>.md`` under benchmarks/results/."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    j, m = RESULTS / f"{name}.json", RESULTS / f"{name}.md"
    j.write_text(json.dumps(payload, indent=1, default=str))
    m.write_text(markdown)
    return j, m


def env_markdown(env: dict[str, Any]) -> str:
    lines = [f"- {k}: `{v}`" for k, v in env.items()]
    return "\n".join(lines)


def profiled(fn: Callable[..., Any], out_dir: str | None, rank: int, *args: Any) -> Any:
    """``fn(*args)``, under cProfile when ``out_dir`` is given: the profile of this rank goes to
    ``out_dir/rank<rank>.prof`` (the times ``fn`` measures then include the profiler's cost)."""
    if not out_dir:
        return fn(*args)
    import cProfile

    prof = cProfile.Profile()
    try:
        return prof.runcall(fn, *args)
    finally:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        prof.dump_stats(str(Path(out_dir) / f"rank{rank}.prof"))
