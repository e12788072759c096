"""Lower bounds on an exact delta sync's time on this host, measured in the benchmark's own run.

Two bounds, both for new weights ``b`` over base ``a`` (same names, shapes and dtypes):

- **compare**: one pass that reads both versions and writes a byte per element, on as many threads as
  the sender's delta kernels use (``weight_sync.native.threads``: tensors compared at once, numpy
  releasing the GIL); the least work before a sender knows what to send.
- **traffic**: the bytes any exact delta must move through this host's memory, divided by the fastest
  rate measured here with every core. Sender: read both versions (``2 * B``), write its base's changed
  64-byte lines back (``L * 64``, its read folded into the compare). Engine: read and write each of its
  weights' lines that holds a change (``2 * L * 64``). Left out, so the bound stays low: the payload's
  own bytes, any compute, the transport and the update's control round trips, the line a tensor's
  misaligned start or end adds. The rate is the larger of a read pass over ``b`` (a sum of its words)
  and, on CPU, a 256 MiB copy counted as three streams (read, write-allocate read, write): a generous
  rate, hence a bound that errs low. (On a GPU the read pass alone: the largest presets leave no room
  for the copy's buffers.)
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.common import timed
from weight_sync.transport.delta import _as_int

__all__ = ["compare_bound_s", "traffic_bound"]

LINE = 64


def _best_of_3(device: str, fn: Callable[[], Any]) -> float:
    return min(timed(fn, torch.device(device), 3, warmup=0))


def compare_bound_s(device: str, a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Seconds of one compare pass over both versions (``ne`` into preallocated masks; on CPU on the delta
    kernels' threads, the largest tensors first), best of three."""
    pairs = [(_as_int(b[n]), _as_int(t)) for n, t in a.items()]
    masks = [torch.empty(x.shape, dtype=torch.bool, device=x.device) for x, _ in pairs]

    largest_first = sorted(range(len(pairs)), key=lambda i: -pairs[i][0].numel())
    read = 2 * sum(x.numel() * x.element_size() for x, _ in pairs)  # both versions

    def compare() -> None:
        if device == "cpu":
            import numpy as np

            from weight_sync import native

            native.parallel_map(lambda i: np.not_equal(pairs[i][0].numpy(), pairs[i][1].numpy(), out=masks[i].numpy()),
                                largest_first, read)
        else:
            for (x, y), m in zip(pairs, masks):
                torch.ne(x, y, out=m)

    return _best_of_3(device, compare)


def changed_lines(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many 64-byte lines of ``a``'s bytes hold at least one element that differs in ``b``."""
    x, y = _as_int(a), _as_int(b)
    per_line = max(1, LINE // x.element_size())
    changed = x != y
    whole = changed.numel() // per_line * per_line
    lines = int(changed[:whole].view(-1, per_line).any(dim=1).sum())
    return lines + int(bool(changed[whole:].any()))


def _rate_bytes_per_s(device: str, b: dict[str, torch.Tensor]) -> dict[str, float]:
    """The fastest memory rates measured with every core: a read of ``b``'s bytes; on CPU a 256 MiB copy."""
    words = [t.reshape(-1).view(torch.uint8) for t in b.values()]
    words = [w[: w.numel() // 8 * 8].view(torch.int64) for w in words]
    nbytes = sum(w.numel() * 8 for w in words)
    threads = torch.get_num_threads()
    if device == "cpu":
        torch.set_num_threads(os.cpu_count() or 1)
    try:
        rates = {"read_Bps": nbytes / _best_of_3(device, lambda: [w.sum() for w in words])}
        if device == "cpu":
            src = torch.ones(32 << 20, dtype=torch.int64)
            dst = torch.empty_like(src)
            rates["copy_Bps"] = 3 * src.numel() * 8 / _best_of_3(device, lambda: dst.copy_(src))
    finally:
        torch.set_num_threads(threads)
    return rates


def traffic_bound(device: str, a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, float]:
    """The traffic bound's parts: bytes, changed lines, rates and seconds (see the module docstring)."""
    total = sum(t.numel() * t.element_size() for t in a.values())
    lines = sum(changed_lines(t, b[n]) for n, t in a.items())
    rates = _rate_bytes_per_s(device, b)
    traffic = 2 * total + 3 * lines * LINE
    rate = max(rates.values())
    return {"traffic_bytes": traffic, "changed_lines": lines, "lines_fraction": lines * LINE / max(total, 1),
            **rates, "traffic_bound_s": traffic / rate}
