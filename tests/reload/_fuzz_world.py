"""The lifecycle fuzzer's model of the world: committed versions, fresh loads of them, and the checks.

A *version* is a dict of checkpoint-format tensors. The base versions are four tiny checkpoints of one
arch (dense Qwen3 or Qwen3-MoE; seeds 0-3, written to disk once per process and arch); a partial update
that commits makes a composite version (each name keeps the seed it was last committed from), so a version
is named by one seed per tensor.

The world remembers which version the engine must serve (``expected``) and whether a failed update may
have left it torn (``torn_allowed``). After every step the engine either refuses to serve (torn, and only
where a failure allowed it) or its kernel tensors equal, bitwise, those of a fresh engine loaded from
``expected`` -- built once per version and cached. Every other outcome is a :class:`Violation`, one
subclass per kind so that hypothesis reports distinct holes as distinct bugs.
"""

from __future__ import annotations

import atexit
import gc
import multiprocessing
import os
import re
import shutil
import tempfile
import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from weight_sync.layers.tensors import signatures
from weight_sync.safetensors_io import iter_checkpoint
from weight_sync.testing import bitwise_equal, hf_config, kernel_tensors, make_checkpoint

SEEDS = (0, 1, 2, 3)
PROMPT = [[5, 6, 7]]
GEN_PROMPT = [[5, 6]]
GEN_TOKENS = 3


# ---------------------------------------------------------------------------------------- violations
class Violation(AssertionError):
    """The engine broke the promise: it served something other than one committed version, or worse."""


class MixedVersionsServed(Violation):
    """Not torn, yet its kernel tensors differ from a fresh load of the version it must serve."""


class TornAfterGoodUpdate(Violation):
    """Refuses to serve where no failure allowed it (after a good update, or a failure rolled back)."""


class RefusalWithoutReason(Violation):
    """Torn, yet a serving call did not refuse, or refused without naming the failure."""


class ServedDuringOpenUpdate(Violation):
    """generate/logits ran while an update session was open (on half-written weights)."""


class BadUpdateAccepted(Violation):
    """An update with an injected fault (or an incomplete one) committed."""


class GoodUpdateRejected(Violation):
    """A well-formed update raised."""


class WrongError(Violation):
    """A bad update failed, but with an error that does not name the fault."""


class PointerMoved(Violation):
    """A graph-visible tensor changed data_ptr, shape, dtype or stride."""


class ShimLeft(Violation):
    """The load_weights routing shim of initialize_layerwise_reload outlived its session."""


class SessionLeft(Violation):
    """The model still has an active session although the caller's update ended."""


class ServingMismatch(Violation):
    """Serving outputs differ from a fresh engine of the expected version."""


class Leaked(Violation):
    """Threads, file descriptors, child processes or shm files outlived the sequence."""


# ---------------------------------------------------------------------------------------- assets
@dataclass(frozen=True)
class Assets:
    """Checkpoints and their tensors, made once per process."""

    root: Path
    cfg: dict[str, Any]
    names: tuple[str, ...]
    paths: dict[int, Path]
    items: dict[int, dict[str, torch.Tensor]]
    faulty_paths: dict[str, Path]


@dataclass(frozen=True)
class Faults:
    """Where an arch's faulty checkpoint directories put their fault (keys of its checkpoint)."""

    shape: tuple[str, tuple[int, ...]]  # a key and the wrong shape written under it
    dtype: str  # a key written as int32
    unknown: tuple[str, str]  # a key the model lacks, and the key whose tensor it carries
    missing: str  # a key left out


K_PROJ = "model.layers.0.self_attn.k_proj.weight"

FAULTS_BY_ARCH = {
    "qwen3": Faults(shape=(K_PROJ, (7, 128)), dtype=K_PROJ,
                    unknown=("model.layers.7.mlp.up_proj.weight", "model.layers.0.mlp.up_proj.weight"),
                    missing="model.norm.weight"),
    # Expert keys, a router and an expert id past the model's 8: the MoE parts of the name space.
    "qwen3_moe": Faults(shape=("model.layers.0.mlp.experts.3.down_proj.weight", (7, 64)),
                        dtype="model.layers.1.mlp.gate.weight",
                        unknown=("model.layers.0.mlp.experts.8.up_proj.weight",
                                 "model.layers.0.mlp.experts.0.up_proj.weight"),
                        missing="model.layers.1.mlp.experts.7.gate_proj.weight"),
}

_ASSETS: dict[str, Assets] = {}


def assets(arch: str = "qwen3") -> Assets:
    """The tiny checkpoints of ``arch`` (a key of :data:`FAULTS_BY_ARCH`), made on first use."""
    if arch not in _ASSETS:
        from safetensors.torch import save_file

        root = Path(tempfile.mkdtemp(prefix="ws_fuzz_" if arch == "qwen3" else f"ws_fuzz_{arch}_"))
        atexit.register(shutil.rmtree, root, True)
        cfg = hf_config(arch, "tiny")
        paths, items = {}, {}
        for s in SEEDS:
            paths[s] = make_checkpoint(root / f"v{s}", arch=arch, seed=s, tokenizer=False)
            items[s] = {n: t.clone() for n, t in iter_checkpoint(paths[s])}
        names = tuple(items[0])
        # Checkpoint directories whose headers announce a fault (reload_weights(weights_path=...)).
        base, f = items[1], FAULTS_BY_ARCH[arch]
        shape_name, bad_shape = f.shape
        unknown_name, carried = f.unknown
        faulty = {
            "shape": {**base, shape_name: torch.zeros(bad_shape, dtype=base[shape_name].dtype)},
            "dtype": {**base, f.dtype: torch.zeros(base[f.dtype].shape, dtype=torch.int32)},
            "unknown": {**base, unknown_name: base[carried].clone()},
            "missing": {n: t for n, t in base.items() if n != f.missing},
        }
        assert f.missing in base, f.missing
        faulty_paths = {}
        for label, tensors in faulty.items():
            d = root / f"faulty_{label}"
            d.mkdir()
            shutil.copy(paths[1] / "config.json", d / "config.json")
            save_file({n: t.contiguous() for n, t in tensors.items()}, str(d / "model.safetensors"),
                      metadata={"format": "pt"})
            faulty_paths[label] = d
        _ASSETS[arch] = Assets(root, cfg, names, paths, items, faulty_paths)
    return _ASSETS[arch]


def layer_of(name: str) -> str:
    """The engine layer a checkpoint key lands in (q/k/v fuse into qkv_proj, gate/up into gate_up_proj,
    every expert's gate/up/down of a sparse block into its one ``mlp.experts``)."""
    layer = name.rsplit(".", 1)[0]
    layer = re.sub(r"self_attn\.[qkv]_proj$", "self_attn.qkv_proj", layer)
    layer = re.sub(r"mlp\.experts\.\d+\.(gate|up|down)_proj$", "mlp.experts", layer)
    return re.sub(r"mlp\.(gate|up)_proj$", "mlp.gate_up_proj", layer)


# ---------------------------------------------------------------------------------------- versions
VersionKey = tuple  # one seed per name, in the names' canonical order


def base_key(seed: int, names: tuple[str, ...]) -> VersionKey:
    return (seed,) * len(names)


def merged_key(key: VersionKey, names: tuple[str, ...], subset: set[str], seed: int) -> VersionKey:
    return tuple(seed if n in subset else s for n, s in zip(names, key))


def describe_key(key: VersionKey, names: tuple[str, ...]) -> str:
    seeds = sorted(set(key))
    if len(seeds) == 1:
        return f"v{seeds[0]}"
    main = max(seeds, key=key.count)
    others = {n: s for n, s in zip(names, key) if s != main}
    return f"v{main} with " + ", ".join(f"{n}=v{s}" for n, s in list(others.items())[:4]) + (
        f" (+{len(others) - 4})" if len(others) > 4 else "")


def version_items(key: VersionKey, names: tuple[str, ...], table: dict[int, dict[str, torch.Tensor]]
                  ) -> list[tuple[str, torch.Tensor]]:
    return [(n, table[s][n]) for n, s in zip(names, key)]


@dataclass
class Fresh:
    """What a freshly loaded engine (or module) of one version holds and serves."""

    kernel: dict[str, torch.Tensor]
    logits: torch.Tensor | None = None
    tokens: list[list[int]] | None = None


class FreshCache:
    """Fresh loads by (flavor, version key), built on first use, least recently used dropped."""

    def __init__(self, limit: int = 192) -> None:
        self.limit = limit
        self._d: OrderedDict[tuple, Fresh] = OrderedDict()
        self.builds = 0

    def get(self, key: tuple, build) -> Fresh:
        hit = self._d.get(key)
        if hit is not None:
            self._d.move_to_end(key)
            return hit
        fresh = build()
        self.builds += 1
        self._d[key] = fresh
        if len(self._d) > self.limit:
            self._d.popitem(last=False)
        return fresh


FRESH = FreshCache()


def snapshot_kernel(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in kernel_tensors(model).items()}


def kernel_differences(model: nn.Module, want: dict[str, torch.Tensor]) -> list[str]:
    """Names of kernel tensors whose layout or bytes differ from ``want`` (and names only one side has)."""
    got = kernel_tensors(model)
    out = sorted(set(got) ^ set(want))
    out += [n for n in want if n in got and not bitwise_equal(got[n], want[n])]
    return out


# ---------------------------------------------------------------------------------------- the world
@dataclass
class World:
    """What the engine must be doing now."""

    expected: VersionKey
    torn_allowed: bool = False

    def committed_full(self, key: VersionKey) -> None:
        self.expected, self.torn_allowed = key, False

    def committed_partial(self, key: VersionKey) -> None:
        # A partial commit changes what the untouched layers must hold nothing about: a model torn
        # before may still refuse (its half-written layers may lie outside the subset).
        self.expected = key

    def failed(self, *, rollback: bool, before_any_write: bool) -> None:
        if not rollback and not before_any_write:
            self.torn_allowed = True


def check_pointers(model: nn.Module, baseline: dict) -> None:
    now = signatures(model)
    moved = [n for n, sig in baseline.items() if now.get(n) != sig]
    if moved:
        raise PointerMoved(f"{len(moved)} graph-visible tensor(s) changed: {moved[:5]}")


# ---------------------------------------------------------------------------------------- hygiene
def _fd_targets() -> tuple[str, ...]:
    """What every open file descriptor of the process points at (``readlink`` of /proc/self/fd/N)."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            continue  # the descriptor listdir itself used, closed again
    return tuple(sorted(out))


# Descriptors that code anywhere in the process opens once, on first use, and keeps for the process's
# life (a shared library or data file read lazily, a random-number device, an epoll or eventfd of a
# runtime): a sequence that happens to run first blames itself for them. Whatever a weight update could
# leak - a socket or pipe of a transport, a checkpoint or temporary file, shared memory - is none of these.
_PROCESS_LIFETIME = re.compile(r"^(/usr/|/lib|/opt/|/etc/|/proc/|/sys/|/dev/(u?random|null|zero)$|anon_inode:)"
                               r"|/site-packages/|/\.pyenv/")


# How long a socket opened during a sequence may take to close before it counts as leaked. Native threads
# of libraries an earlier test used in this process open and close sockets at their own pace, outside any
# Python thread (Ray's gRPC client keeps native threads and a socket after ``ray.shutdown()``; a CI run saw
# one extra socket at a check that the sequence's replay did not see): nothing in the process signals when
# they are done, so the check polls. A socket a sequence leaks stays open, and is reported after the grace.
_SOCKET_GRACE_S = 5.0


def _still_open(opened: list[str]) -> list[str]:
    """``opened`` less the sockets among them that close within :data:`_SOCKET_GRACE_S`."""
    others = [t for t in opened if not t.startswith("socket:")]
    sockets = [t for t in opened if t.startswith("socket:")]
    deadline = time.monotonic() + _SOCKET_GRACE_S
    wait = threading.Event()
    while sockets and time.monotonic() < deadline:
        wait.wait(0.05)
        gc.collect()
        now = set(_fd_targets())
        sockets = [t for t in sockets if t in now]
    return others + sockets


# Who started each thread: Thread.start records the starting thread on the new one, so that a sequence is
# held to the threads it started (directly, or through threads it started) and not to threads that code
# running beside it started meanwhile (a pool or timer an earlier test left running in the same process).
_thread_start = threading.Thread.start


def _recording_start(self: threading.Thread) -> None:
    self._ws_started_by = threading.current_thread()  # type: ignore[attr-defined]
    _thread_start(self)


threading.Thread.start = _recording_start  # type: ignore[method-assign]


def _started_by(t: threading.Thread, owner: threading.Thread, before: frozenset[threading.Thread]) -> bool:
    """Whether ``owner`` started ``t``, directly or through threads started since ``before`` was taken (a
    thread already alive then, started by ``owner`` or not, is not one of them)."""
    by = getattr(t, "_ws_started_by", None)
    while by is not None:
        if by is owner:
            return True
        if by in before:
            return False
        by = getattr(by, "_ws_started_by", None)
    return False


@dataclass(frozen=True)
class Hygiene:
    """What a sequence could leak, taken before it and compared after it: the threads alive (and the one
    running the sequence), the open file descriptors (what each points at) and the count of child processes."""

    threads: frozenset[threading.Thread]
    owner: threading.Thread
    fd_targets: tuple[str, ...]
    children: int

    @property
    def fds(self) -> int:
        return len(self.fd_targets)

    @classmethod
    def take(cls) -> Hygiene:
        gc.collect()
        return cls(frozenset(threading.enumerate()), threading.current_thread(), _fd_targets(),
                   len(multiprocessing.active_children()))

    def check(self, label: str) -> None:
        now = Hygiene.take()
        # A thread leaks when the sequence started it and it is still alive; counting all threads of the
        # process would blame the sequence for a thread started by other code meanwhile (and miss a leak
        # while another thread ended).
        left = sorted(t.name for t in now.threads - self.threads if _started_by(t, self.owner, self.threads))
        grown: dict[str, Any] = {k: (getattr(self, k), getattr(now, k)) for k in ("fds", "children")
                                 if getattr(now, k) > getattr(self, k)}
        if "fds" in grown:
            opened = Counter(now.fd_targets) - Counter(self.fd_targets)
            kept = _still_open(sorted(t for t in opened.elements() if not _PROCESS_LIFETIME.search(t)))
            if kept:
                grown["fds"] = (*grown["fds"], kept)
            else:
                del grown["fds"]  # only process-lifetime descriptors opened on first use
        if left:
            grown["threads"] = left
        if grown:
            names = sorted(t.name for t in threading.enumerate())
            raise Leaked(f"{label}: grew (before, after): {grown}; threads now {names}")
