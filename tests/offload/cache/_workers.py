"""Shared helpers and spawned-process workers for the runtime-cache tests (importable by spawn)."""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from weight_sync.offload.cache import (
    LayoutIdentity,
    RuntimeCacheResult,
    _faults,
    load_with_runtime_cache,
)
from weight_sync.safetensors_io import map_safetensors

LAYOUT = LayoutIdentity(
    tp_size=1, tp_rank=0, sp_impl=None, sp_size=1, dtype="float32", layout="dense", model_version="v1"
)
TRANSFORM = "tests.offload.cache.copy_loader@1"


class TinyDiT(nn.Module):
    """A stand-in for a DiT: ``num_blocks`` linear weights, a bf16 norm, an int64 persistent buffer and a
    non-persistent buffer. Parameters are ``torch.empty`` so that construction touches no pages."""

    def __init__(self, *, num_blocks: int = 4, block_elems: int = 4096) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Module() for _ in range(num_blocks))
        for block in self.blocks:
            block.weight = nn.Parameter(torch.empty(block_elems // 64, 64))
        self.norm = nn.Parameter(torch.empty(7, dtype=torch.bfloat16))
        self.register_buffer("step", torch.empty(3, dtype=torch.int64))
        self.register_buffer("rope", torch.ones(5), persistent=False)


def checkpoint_tensors(*, num_blocks: int = 4, block_elems: int = 4096, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {
        f"blocks.{i}.weight": torch.randn(block_elems // 64, 64, generator=g) for i in range(num_blocks)
    }
    out["norm"] = torch.randn(7, generator=g).to(torch.bfloat16)
    out["step"] = torch.arange(3, dtype=torch.int64) + seed
    return out


def write_checkpoint(path: Path, **kwargs: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(checkpoint_tensors(**kwargs), str(path))
    return path


def copy_loader(module: nn.Module, checkpoint: Path, calls: list[str] | None = None) -> Callable[[], None]:
    """The "ordinary loader": copy every checkpoint tensor into the module's existing tensors."""

    def load() -> None:
        if calls is not None:
            calls.append("ordinary_load")
        tensors = dict(module.named_parameters()) | dict(module.named_buffers())
        with torch.no_grad():
            for name, t in map_safetensors(checkpoint).items():
                tensors[name].copy_(t)

    return load


def load(module: nn.Module, checkpoint: Path, cache_dir: Path, *, lock_timeout_s: float = 30.0,
         calls: list[str] | None = None) -> RuntimeCacheResult:
    return load_with_runtime_cache(
        module,
        checkpoint_files=[checkpoint],
        transform_id=TRANSFORM,
        layout=LAYOUT,
        ordinary_load=copy_loader(module, checkpoint, calls),
        tensor_names=None,
        cache_dir=str(cache_dir),
        lock_timeout_s=lock_timeout_s,
    )


def mapped_inodes(under: Path) -> set[tuple[str, int]]:
    """(path, inode) of every file under ``under`` that this process maps (from /proc/self/maps)."""
    out: set[tuple[str, int]] = set()
    prefix = os.path.realpath(under)
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].strip().startswith(prefix):
                out.add((parts[5].strip(), int(parts[4])))
    return out


def pss_kib(pid: int) -> int:
    """Proportional set size of a process in KiB, from /proc/<pid>/smaps_rollup."""
    text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    m = re.search(r"^Pss:\s+(\d+) kB", text, re.MULTILINE)
    if not m:
        raise RuntimeError(f"/proc/{pid}/smaps_rollup has no Pss line")
    return int(m.group(1))


def _touch_all(module: nn.Module) -> float:
    # Fault in every page the weights occupy, as a forward pass would, so PSS reflects them.
    return float(sum(float(t.float().sum()) for t in module.state_dict().values()))


def sharing_worker(conn: Connection, checkpoint: str, cache_dir: str, use_cache: bool, sizes: dict) -> None:
    """Build, report "ready", wait for "go", load (through the cache or privately), touch the weights,
    report, then stay alive until the parent says "exit" so it can measure PSS of all peers at once."""
    torch.set_num_threads(1)
    module = TinyDiT(**sizes)
    # Made before the baseline so the reference values are not counted as loading cost.
    expected = checkpoint_tensors(**sizes)
    _touch_all(TinyDiT(num_blocks=1, block_elems=64))  # warm up torch's kernels before the baseline
    conn.send(("ready", os.getpid()))
    assert conn.recv() == "go"
    if use_cache:
        result = load(module, Path(checkpoint), Path(cache_dir), lock_timeout_s=120)
        status, reason = result.status, result.reason
    else:
        copy_loader(module, Path(checkpoint))()
        status, reason = "private", ""
    _touch_all(module)
    equal = all(torch.equal(module.state_dict()[k], v) for k, v in expected.items())
    conn.send(("loaded", status, reason, equal, sorted(mapped_inodes(Path(cache_dir)))))
    assert conn.recv() == "exit"


def crash_worker(conn: Connection, checkpoint: str, cache_dir: str, point: str) -> None:
    """Publish through the cache, but stop at ``point``: report it, then block until killed (SIGKILL)."""

    def injector(reached: str) -> None:
        if reached == point:
            conn.send(("at", reached))
            conn.recv()  # never answered: the parent kills this process here
            raise AssertionError("crash_worker was meant to be killed")

    with _faults.install(injector):
        load(TinyDiT(), Path(checkpoint), Path(cache_dir))
    conn.send(("finished without reaching", point))


def holder_worker(conn: Connection, checkpoint: str, cache_dir: str) -> None:
    """Map the cache (a hit), report, and keep the mapping until the parent closes the pipe."""
    module = TinyDiT()
    result = load(module, Path(checkpoint), Path(cache_dir))
    conn.send((result.status, _touch_all(module)))
    with contextlib.suppress(EOFError):
        conn.recv()
