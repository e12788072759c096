"""Engine worker processes driven over pipes with JSON commands: a control plane without Ray.

``EngineProcesses(checkpoint, num_workers, devices=[...])`` starts one process per worker, each holding a
:class:`~trainers.rollout.RolloutWorker`; ``call``/``call_each`` run a RolloutWorker method on every
worker and return the results; ``submit``/``collect`` split that so the trainer can drive its sender
while the workers receive. Commands and results are JSON (never pickle); weights never pass through
here, they travel over the transport. Every wait for a worker has a timeout.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
from typing import Any

from weight_sync.errors import TransportTimeout, WeightSyncError

__all__ = ["EngineProcesses", "RemoteWorkerError"]


class RemoteWorkerError(WeightSyncError):
    """A worker process raised; the message names the worker, the method and the remote error."""


def _worker_main(conn: Any, spec_json: str) -> None:
    import torch

    spec = json.loads(spec_json)
    torch.set_num_threads(int(spec.get("threads", 1)))
    try:
        from trainers.rollout import RolloutWorker

        dtype = getattr(torch, spec["dtype"]) if spec.get("dtype") else None
        worker = RolloutWorker(spec["checkpoint"], device=spec["device"], dtype=dtype,
                               quantization=spec.get("quantization"))
        conn.send_bytes(json.dumps({"ok": True, "result": worker.get_address()}).encode())
    except Exception as e:
        conn.send_bytes(json.dumps({"ok": False, "error": type(e).__name__, "message": str(e)}).encode())
        return
    while True:
        msg = json.loads(conn.recv_bytes())
        if msg["method"] == "exit":
            break
        try:
            result = worker.collective_rpc(msg["method"], tuple(msg.get("args", ())), msg.get("kwargs") or {})
            reply = {"ok": True, "result": result}
        except Exception as e:
            reply = {"ok": False, "error": type(e).__name__, "message": str(e)}
        conn.send_bytes(json.dumps(reply, default=str).encode())
    worker.shutdown()
    conn.close()


class EngineProcesses:
    """``num_workers`` engine processes (one RolloutWorker each), e.g. ``devices=["cpu"]`` or ``["cuda:1"]``."""

    def __init__(
        self,
        checkpoint: str,
        num_workers: int,
        *,
        devices: list[str],
        quantization: str | None = None,
        dtype: str | None = "bfloat16",
        timeout_s: float = 600.0,
        threads: int = 1,
    ) -> None:
        if num_workers < 1 or len(devices) != num_workers:
            raise ValueError(f"need num_workers >= 1 and one device per worker, got {num_workers}, {devices}")
        self.timeout_s = timeout_s
        self.devices = list(devices)
        ctx = mp.get_context("spawn")
        self._conns, self._procs = [], []
        for i in range(num_workers):
            parent, child = ctx.Pipe()
            spec = json.dumps({"checkpoint": str(checkpoint), "device": devices[i], "quantization": quantization,
                               "dtype": dtype, "threads": threads})
            p = ctx.Process(target=_worker_main, args=(child, spec), daemon=True, name=f"engine-worker-{i}")
            p.start()
            self._conns.append(parent)
            self._procs.append(p)
        self.addresses = self._collect_all("start")
        self._pending: str | None = None

    def __len__(self) -> int:
        return len(self._conns)

    def _recv(self, i: int, method: str) -> Any:
        conn = self._conns[i]
        if not conn.poll(self.timeout_s):
            raise TransportTimeout(f"engine worker {i}: no answer to {method} within {self.timeout_s:.0f} s")
        try:
            reply = json.loads(conn.recv_bytes())
        except EOFError:
            raise RemoteWorkerError(
                f"engine worker {i} exited (code {self._procs[i].exitcode}) during {method}"
            ) from None
        if not reply["ok"]:
            raise RemoteWorkerError(f"engine worker {i}: {method} failed: {reply['error']}: {reply['message']}")
        return reply["result"]

    def _collect_all(self, method: str) -> list[Any]:
        results, first_error = [], None
        for i in range(len(self._conns)):
            try:
                results.append(self._recv(i, method))
            except WeightSyncError as e:  # keep draining the other workers' replies first
                first_error = first_error or e
                results.append(None)
        if first_error is not None:
            raise first_error
        return results

    def submit_each(self, method: str, args_per_worker: list[tuple], kwargs: dict[str, Any] | None = None) -> None:
        """Send ``method`` to every worker (its own args each) without waiting."""
        if self._pending is not None:
            raise RuntimeError(f"collect() the pending {self._pending} first")
        for conn, args in zip(self._conns, args_per_worker):
            conn.send_bytes(json.dumps({"method": method, "args": list(args), "kwargs": kwargs or {}}).encode())
        self._pending = method

    def submit(self, method: str, *args: Any, **kwargs: Any) -> None:
        self.submit_each(method, [args] * len(self._conns), kwargs)

    def collect(self) -> list[Any]:
        """Results of the pending call, by worker (raises the first worker failure after draining all)."""
        method, self._pending = self._pending, None
        assert method is not None, "nothing was submitted"
        return self._collect_all(method)

    def call(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        self.submit(method, *args, **kwargs)
        return self.collect()

    def call_each(self, method: str, args_per_worker: list[tuple], kwargs: dict[str, Any] | None = None) -> list[Any]:
        self.submit_each(method, args_per_worker, kwargs)
        return self.collect()

    def close(self) -> None:
        for conn in self._conns:
            with contextlib.suppress(BrokenPipeError, OSError):
                conn.send_bytes(json.dumps({"method": "exit"}).encode())
        for p in self._procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
        self._conns, self._procs = [], []

    def __enter__(self) -> EngineProcesses:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
