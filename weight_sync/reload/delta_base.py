"""An engine rank's delta state across updates, and the destinations of its in-place writes.

What ``weight_sync.reload.delta_apply`` keeps between updates (:class:`DeltaApplier`): the model-format
copies of quantized weights, their absmax state, the checksums the last committed update left, the
routes of the last delta and, per target of those routes, its destination's views (made once: a delta
writes hundreds of tensors, and each view costs a torch call of host time per update).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from weight_sync import native
from weight_sync.errors import LayoutMismatchError
from weight_sync.quant.fp8 import Fp8LinearMethod
from weight_sync.quant.online import OnlineQuantLinearMethod
from weight_sync.reload.delta_routes import Target, live_tensor, plan_routes
from weight_sync.reload.state import LayerInfo

__all__ = ["DeltaApplier"]

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _as_int(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.bool else t.view(_INT_OF_SIZE[t.dtype.itemsize])


@dataclass(slots=True)
class _LiveDst:
    """A live target's destination, its views made once per route set (:meth:`DeltaApplier.live_dst`):
    a delta writes hundreds of tensors, and each view costs a torch call of host time per update."""

    target: Target
    live: torch.Tensor  # the parameter or buffer (its identity and address checked on every use)
    ptr: int
    flat: torch.Tensor  # its elements as integers of its item size, flat
    region: torch.Tensor  # the target's run of ``flat``
    size: int
    dtype: torch.dtype
    device: torch.device


@dataclass(slots=True)
class _QuantDst:
    """A quantized target's model-format copy and kernel tensors, made once per route set
    (:meth:`DeltaApplier.quant_dst`)."""

    target: Target
    base: torch.Tensor  # the model-format copy (identity checked)
    base_int: torch.Tensor  # its elements as integers, flat
    q_param: torch.Tensor  # the live kernel tensors (identity and address checked)
    s_param: torch.Tensor
    ptrs: tuple[int, int]
    q: torch.Tensor  # their detached views
    s: torch.Tensor
    method: OnlineQuantLinearMethod
    # Changes from which the weight is requantized whole (_requantize_whole), None: never.
    whole_from: int | None
    # Whether the copy's dtype and device let its writes join the grouped launch.
    base_dtype: torch.dtype
    base_device: torch.device


def _whole_from(method: OnlineQuantLinearMethod, base: torch.Tensor, q: torch.Tensor) -> int | None:
    """The number of changes from which a weight is requantized whole (grouped, after the bucket) rather
    than tile by tile / row by row; None: never. On CUDA, with its model-format copy on the kernel
    tensors' device, block or per-channel fp8 scales, and on average at least one change per scale unit
    (nearly every tile or row is then touched, and the per-weight launches and device sync of the
    incremental path cost far more than one grouped pass over the weight)."""
    if not (q.is_cuda and base.device == q.device and isinstance(method, Fp8LinearMethod)):
        return None
    granularity = method.config.granularity
    if granularity == "block":
        bn, bk = method.config.block_size
        return -(-base.numel() // (bn * bk))
    return base.shape[0] if granularity == "channel" else None



class DeltaApplier:
    """An engine rank's in-place delta state across updates: the model-format copies of quantized
    weights, their absmax state (per block tile or per tensor, see
    :func:`weight_sync.quant.delta.delta_absmax`; on the kernel tensors' device) and the checksums of
    the tensors the last committed update left."""

    def __init__(self) -> None:
        self.bases: dict[tuple[str, str], torch.Tensor] = {}
        self.absmax: dict[tuple[str, str], torch.Tensor] = {}
        self.checksums: dict[int, tuple[int, torch.dtype, tuple[int, ...], int]] = {}
        # The routes of the last delta update and what they were derived from (see routes_for).
        self._routes: tuple[tuple[Any, ...], dict[str, tuple[Target, ...] | None]] | None = None
        # Per target of those routes (by id; the entry names its target): its destination's views.
        self._dst: dict[int, _LiveDst | _QuantDst] = {}
        # The host decode's positions and the scatters' old values of one update at a time (kept for
        # its rollback until it ends); InPlaceUpdate resets it when the next update begins.
        self.arena = native.HostArena()

    def routes_for(self, session: Any, mode: str) -> dict[str, tuple[Target, ...] | None]:
        """Every expected key's route for an update of ``session`` (a copy the update may extend).

        A delta update reuses the last delta's routes while nothing they derive from changed: the same
        plan at the same generation (no key planned again), the same cached-view epoch (the session
        bumps it when any graph-visible tensor moved since the last commit) and the same keys. A full
        update computes them afresh (its layers may be processed for the first time) and drops the
        cache, as any failure does (:meth:`forget`); its committed routes become the cache when nothing
        they derive from changed during it (:meth:`keep_routes`)."""
        state, plan, names = session.state, session.plan, session.expected or frozenset()
        if mode != "delta":
            self._routes = None
            self._dst = {}
            return plan_routes(state, plan, names)
        key = self.route_key(session)
        if self._routes is None or self._routes[0] != key:
            self._routes = (key, plan_routes(state, plan, names))
            self._dst = {}
        return dict(self._routes[1])

    @staticmethod
    def route_key(session: Any) -> tuple[Any, ...]:
        """What every route derives from: the plan and its generation, the cached-view epoch, the keys,
        and which layers hold kernel-format tensors (a layer processed for the first time has new
        kernel tensors, and routes into them)."""
        state, plan = session.state, session.plan
        return (id(state), id(plan), plan.generation, state.views_epoch, session.expected or frozenset(),
                tuple(info.processed for info in state.layers.values()))

    def keep_routes(self, key: tuple[Any, ...], routes: dict[str, tuple[Target, ...] | None], session: Any) -> None:
        """Keep a committed full update's routes for the next delta when the state it leaves still
        gives ``key`` (its begin's): the first delta after a full update then plans none again."""
        if self.route_key(session) == key:
            self._routes = (key, routes)
            self._dst = {}

    def live_dst(self, info: LayerInfo, t: Target) -> _LiveDst:
        """``t``'s live tensor and its views, made again when the tensor or its storage is not the one
        they were made of (a parameter replaced, or its ``.data`` swapped)."""
        live = live_tensor(info.module, t.tensor)
        assert live is not None  # routed only to existing live tensors
        d = self._dst.get(id(t))
        if type(d) is _LiveDst and d.target is t and d.live is live and d.ptr == live.data_ptr():
            return d
        flat = _as_int(live.detach().view(-1))
        d = _LiveDst(t, live, live.data_ptr(), flat, flat[t.dst_offset : t.dst_offset + t.numel],
                     live.element_size(), live.dtype, live.device)
        self._dst[id(t)] = d
        return d

    def quant_dst(self, info: LayerInfo, t: Target) -> _QuantDst:
        """``t``'s model-format copy and kernel tensors (made again when any of them is not the one the
        entry was made of); refuses a target whose copy the last full update did not record."""
        base = self.bases.get((info.name, t.tensor))
        if base is None:
            raise LayoutMismatchError(
                f"{info.name}.{t.tensor}: a delta needs the model-format copy recorded by the last full "
                "update, found none"
            )
        mod = info.module
        q, s = live_tensor(mod, "weight"), live_tensor(mod, "weight_scale")
        assert q is not None and s is not None  # checked when routed
        d = self._dst.get(id(t))
        if (type(d) is _QuantDst and d.target is t and d.base is base and d.q_param is q and d.s_param is s
                and d.ptrs == (q.data_ptr(), s.data_ptr())):
            return d
        method = mod.quant_method
        assert isinstance(method, OnlineQuantLinearMethod)  # checked when routed
        d = _QuantDst(t, base, _as_int(base.view(-1)), q, s, (q.data_ptr(), s.data_ptr()), q.detach(), s.detach(),
                      method, _whole_from(method, base, q), base.dtype, base.device)
        self._dst[id(t)] = d
        return d

    @property
    def nbytes(self) -> int:
        """Memory the model-format copies and their absmax state hold (bytes)."""
        return sum(t.numel() * t.element_size() for t in (*self.bases.values(), *self.absmax.values()))

    def model_format_copy(self, info: LayerInfo, tensor: str, device: torch.device) -> torch.Tensor:
        """The kept model-format copy of ``info``'s ``tensor`` on ``device`` (host memory is pinned when
        CUDA is there; zero-filled when new: unwritten regions are padding, zero as in the staging)."""
        rec = info.records[tensor]
        key = (info.name, tensor)
        base = self.bases.get(key)
        if base is None or base.dtype != rec.dtype or tuple(base.shape) != tuple(rec.shape) or base.device != device:
            pin = device.type == "cpu" and torch.cuda.is_available()
            base = torch.zeros(tuple(rec.shape), dtype=rec.dtype, device=device, pin_memory=pin)
            self.bases[key] = base
        return base

    def keep_only(self, keys: set[tuple[str, str]]) -> None:
        for key in [k for k in self.bases if k not in keys]:
            del self.bases[key]
        for key in [k for k in self.absmax if k not in keys]:
            del self.absmax[key]

    def forget(self) -> None:
        self.checksums = {}
        self.absmax = {}
        self._routes = None
        self._dst = {}
