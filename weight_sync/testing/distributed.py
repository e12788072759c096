"""Run a function on N fresh ranks with a process group: free port, tracebacks back, no hangs.

The parent hosts the TCPStore on a port the OS picks (port 0), so there is no race for a "free" port; every
child joins it as a client. Each rank returns ``fn(rank, world_size, *args)``'s result (picklable) or its
traceback as text; the first failure terminates the other ranks and raises in the parent, and a run that
outlasts ``timeout_s`` is terminated and reported with the ranks that had not finished.

Ranks are forked from a fork server that has imported torch once (``forkserver`` start method), not
spawned: a spawned rank spends ~3 s importing torch on a 2-core host, a forked one ~0.1 s, and the test
suite starts hundreds of them. The server never runs torch code (no threads, no CUDA), so a fork of it is
as clean as a spawned process; each rank takes the caller's environment as it is at the call (a forked
rank would otherwise see the server's, from its first use) and the caller's working directory and
``sys.path`` (multiprocessing's preparation data). ``WEIGHT_SYNC_RANK_START=spawn`` spawns them instead.
"""

from __future__ import annotations

import functools
import logging
import multiprocessing as mp
import os
import pickle
import queue
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from weight_sync.errors import ConfigError

__all__ = ["DistributedFailure", "rank_context", "run_distributed"]

log = logging.getLogger(__name__)


class DistributedFailure(RuntimeError):
    """A rank raised (the message carries its traceback) or the run timed out."""


# Imported once by the fork server, so that no rank imports them again.
_PRELOAD = ["torch", "torch.distributed", "weight_sync"]


# WEIGHT_SYNC_RANK_START=spawn starts every rank as a fresh interpreter instead (the way out should a
# platform's fork server misbehave); read at each run.
_START_ENV = "WEIGHT_SYNC_RANK_START"
_START_METHODS = ("forkserver", "spawn")


def rank_context() -> Any:
    """The multiprocessing context :func:`run_distributed` starts ranks from: a fork server with torch
    imported (where the platform has one, else spawn), or spawn when ``WEIGHT_SYNC_RANK_START=spawn``."""
    method = os.environ.get(_START_ENV, "forkserver")
    if method not in _START_METHODS:
        raise ConfigError(f"{_START_ENV} must be one of {', '.join(_START_METHODS)}, got {method!r}")
    if method == "forkserver" and "forkserver" not in mp.get_all_start_methods():
        method = "spawn"
    return _context(method)


@functools.cache
def _context(method: str) -> Any:
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _child(
    fn: Callable[..., Any], rank: int, world_size: int, backend: str, port: int, args: tuple,
    results: Any, timeout_s: float, env: dict[str, str],
) -> None:
    # The caller's whole environment at the call (a forked rank inherits the fork server's instead).
    os.environ.clear()
    os.environ.update(env)
    try:
        import torch.distributed as dist

        store = dist.TCPStore("127.0.0.1", port, world_size + 1, is_master=False,
                              timeout=timedelta(seconds=timeout_s))
        try:
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                    timeout=timedelta(seconds=timeout_s))
        except BaseException:
            # Before ``fn`` ran: the parent may spawn the ranks again (see _MESH_ERRORS).
            results.put((rank, "setup-error", traceback.format_exc()))
            return
        try:
            out = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        # Plain pickle copies tensors by value: torch's queue reductions would pass a shared-memory fd
        # that dies with this process before the parent reads it.
        results.put((rank, "ok", pickle.dumps(out)))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))


class _MeshFailure(DistributedFailure):
    """The ranks' process group could not connect its mesh (before ``fn`` ran anywhere)."""


# What a gloo mesh that failed to connect says. On a shared host a connection of the mesh can be closed
# or refused by something outside the run (seen once on CI: "connectFullMesh failed ... Connection closed
# by peer" in a trivial two-rank run); nothing of ``fn`` has run then, so the ranks are spawned once more.
_MESH_ERRORS = ("connectFullMesh", "Connection closed by peer", "Connection reset by peer", "Connection refused")


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout_s: float = 180.0,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Spawn ``world_size`` ranks running ``fn(rank, world_size, *args)``; return results by rank.

    ``fn`` must be importable (defined at module level). ``env`` is added to each child's environment.
    A process group whose connections fail to come up (before ``fn`` runs) is set up once more, with
    freshly spawned ranks; any other failure is raised at once.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    try:
        return _run_once(fn, world_size, args, backend, timeout_s, env)
    except _MeshFailure as e:
        log.warning("run_distributed: the ranks' process group did not connect, spawning them again: %s",
                    str(e).strip().splitlines()[-1])
    try:
        return _run_once(fn, world_size, args, backend, timeout_s, env)
    except _MeshFailure as e:
        raise DistributedFailure(str(e)) from None


def _run_once(fn: Callable[..., Any], world_size: int, args: tuple, backend: str, timeout_s: float,
              env: dict[str, str] | None) -> list[Any]:
    import torch.distributed as dist

    ctx = rank_context()
    store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True,
                          timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
    results = ctx.Queue()
    procs = [
        ctx.Process(
            target=_child,
            args=(fn, r, world_size, backend, store.port, args, results, timeout_s, {**os.environ, **(env or {})}),
            daemon=True,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(out) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(out))
                raise DistributedFailure(f"ranks {missing} did not finish within {timeout_s:.0f} s")
            try:
                rank, status, payload = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs)
                        if r not in out and not p.is_alive() and p.exitcode not in (0, None)]
                if dead:
                    # A rank died without reporting (killed, segfault): give the queue a moment to
                    # deliver a late message, then fail with its exit code.
                    try:
                        rank, status, payload = results.get(timeout=2.0)
                    except queue.Empty:
                        codes = {r: procs[r].exitcode for r in dead}
                        raise DistributedFailure(f"ranks died without a result: exit codes {codes}") from None
                else:
                    continue
            if status == "setup-error":
                kind = _MeshFailure if any(m in payload for m in _MESH_ERRORS) else DistributedFailure
                raise kind(f"rank {rank} of {world_size} failed setting up its process group:\n{payload}")
            if status == "error":
                raise DistributedFailure(f"rank {rank} of {world_size} failed:\n{payload}")
            out[rank] = pickle.loads(payload)
    finally:
        for p in procs:
            if p.is_alive() and len(out) < world_size:
                p.terminate()
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        del store
    return [out[r] for r in range(world_size)]
