"""Plan once: where each checkpoint key lands, recorded by a dry run of the model's own loaders on meta.

Every layer's model-format tensors are temporarily replaced by meta tensors (same class and loader
attributes), ``model.load_weights`` runs on meta tensors of the announced shapes, and a dispatch mode
records each ``aten.copy_`` into a layer tensor as a :class:`~weight_sync.reload.plan.CopyOp`: which slice
(offset, size, stride) of which tensor, from which slice of the incoming tensor. Nothing is read or
written, so a bad manifest is found before any byte of the model changes. Replaying a key is then a few
strided copies.

Loaders that compute on the incoming tensor (anything but views before the copy) cannot be replayed as
copies; their keys are marked ``loader`` and run through the real loader, which stays the fallback.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from weight_sync.errors import LayoutMismatchError, WeightSyncError
from weight_sync.layers.blocks import block_key
from weight_sync.layers.meta import install_tensor, rematerialize
from weight_sync.manifest import TensorMeta
from weight_sync.reload.plan import CopyOp, KeyMode, KeyPlan, LoaderCall, loader_call_args
from weight_sync.reload.state import LayerInfo, ModelState, model_load_weights

__all__ = ["plan_keys", "swapped_tensors"]


@contextlib.contextmanager
def swapped_tensors(
    layers: Iterable[LayerInfo], on_call: Callable[[LoaderCall], None] | None = None
) -> Iterator[dict[int, tuple[str, str]]]:
    """Install meta model-format tensors on ``layers``; yield storage id -> (layer, tensor); restore.

    ``on_call`` is told of every ``weight_loader`` call made on an installed tensor.
    """
    saved: list[tuple[nn.Module, dict, dict, dict]] = []
    storages: dict[int, tuple[str, str]] = {}
    try:
        for info in layers:
            mod = info.module
            attrs = {k: v for k, v in vars(mod).items() if isinstance(v, torch.Tensor)}
            saved.append((mod, dict(mod._parameters), dict(mod._buffers), attrs))
            for rec in info.records.values():
                t = rematerialize(rec, "meta")  # same class, layout and loader attributes; no memory
                loader = getattr(t, "weight_loader", None)
                if on_call is not None and loader is not None:
                    t.weight_loader = _reporting(loader, info.name, rec.name, on_call)  # type: ignore[attr-defined]
                install_tensor(mod, rec, t)
                storages[t.untyped_storage()._cdata] = (info.name, rec.name)
        yield storages
    finally:
        for mod, params, buffers, attrs in saved:
            mod._parameters.clear()
            mod._parameters.update(params)
            mod._buffers.clear()
            mod._buffers.update(buffers)
            for k in [k for k, v in vars(mod).items() if isinstance(v, torch.Tensor)]:
                del mod.__dict__[k]
            mod.__dict__.update(attrs)


def _reporting(loader: Callable[..., Any], layer: str, tensor: str,
               on_call: Callable[[LoaderCall], None]) -> Callable[..., Any]:
    """``loader``, telling ``on_call`` of each call (layer, tensor, its arguments) before running it."""

    def call(*args: Any, **kwargs: Any) -> Any:
        bound = loader_call_args(loader, args, kwargs)
        if bound is not None:
            on_call((layer, tensor, bound))
        return loader(*args, **kwargs)

    return call


def _is_mutating(func) -> bool:
    schema = func._schema
    return any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)


class _Recorder(TorchDispatchMode):
    """Records copies into known layer storages while ``model.load_weights`` runs on meta tensors."""

    def __init__(self, storages: dict[int, tuple[str, str]], bases: dict[tuple[str, str], int]) -> None:
        super().__init__()
        self.storages = storages
        self.bases = bases  # (layer, tensor) -> storage offset of the installed tensor
        self.key: str | None = None
        self.src: torch.Tensor | None = None
        self.ops: list[CopyOp] = []
        self.loader_layers: set[str] = set()
        self.computed = False
        self.calls: list[LoaderCall] = []

    def start(self, key: str, src: torch.Tensor) -> None:
        self.key, self.src = key, src
        self.ops, self.loader_layers, self.computed, self.calls = [], set(), False, []

    def on_call(self, call: LoaderCall) -> None:
        if self.key is not None:
            self.calls.append(call)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.key is not None and _is_mutating(func) and args and isinstance(args[0], torch.Tensor):
            dst = args[0]
            target = self.storages.get(dst.untyped_storage()._cdata)
            # A write into an empty view changes nothing (vLLM's vocab loader zero-fills the padding
            # rows past the checkpoint's, which is an empty slice when there is no padding).
            if target is not None and dst.numel() > 0:
                src = args[1] if len(args) > 1 and isinstance(args[1], torch.Tensor) else None
                if (
                    func is torch.ops.aten.copy_.default
                    and src is not None
                    and self.src is not None
                    and src.untyped_storage()._cdata == self.src.untyped_storage()._cdata
                ):
                    if dst.dtype.is_floating_point and not self.src.dtype.is_floating_point:
                        raise LayoutMismatchError(
                            f"expects a floating-point tensor for {target[0]}.{target[1]} "
                            f"({str(dst.dtype).removeprefix('torch.')}), got "
                            f"{str(self.src.dtype).removeprefix('torch.')}"
                        )
                    if dst.dtype.itemsize == 1 and self.src.dtype.is_floating_point and self.src.dtype.itemsize > 1:
                        # An 8-bit destination of a wider float is quantized bytes whose scales live
                        # elsewhere: a plain cast into it would serve garbage (its scales untouched).
                        raise LayoutMismatchError(
                            f"{target[0]}.{target[1]} holds {str(dst.dtype).removeprefix('torch.')} (8-bit "
                            f"kernel format) and the update brings {str(self.src.dtype).removeprefix('torch.')}: "
                            "copying would cast away its scales; record the model in model format "
                            "(record_metadata_for_reloading before quantizing it) so reload quantizes it"
                        )
                    whole = (
                        src.storage_offset() == self.src.storage_offset()
                        and tuple(src.shape) == tuple(self.src.shape)
                        and tuple(src.stride()) == tuple(self.src.stride())
                    )
                    self.ops.append(
                        CopyOp(
                            layer=target[0],
                            tensor=target[1],
                            dst_offset=dst.storage_offset() - self.bases[target],
                            dst_size=tuple(dst.shape),
                            dst_stride=tuple(dst.stride()),
                            src_offset=src.storage_offset() - self.src.storage_offset(),
                            src_size=tuple(src.shape),
                            src_stride=tuple(src.stride()),
                            src_whole=whole,
                        )
                    )
                else:
                    # Written from something computed (or by an op other than copy_): not replayable.
                    self.computed = True
                    self.loader_layers.add(target[0])
        return func(*args, **kwargs)


def plan_keys(
    model: nn.Module, state: ModelState, metas: Iterable[TensorMeta]
) -> tuple[list[KeyPlan], dict[str, WeightSyncError]]:
    """Dry-run the model's loaders for ``metas``; returns (key plans, problems by key name).

    A key with a problem (unknown name, wrong shape, integer data for a float weight) has no plan. The
    model is untouched: loaders only ever see meta tensors.

    Swapping a layer to meta costs time, so a few keys are planned against the layers of their own
    block plus the un-indexed layers (embeddings, norms, heads); a loader that writes elsewhere fails
    on the real tensor it meets (a copy from meta raises before writing), and its key is re-planned
    against every layer.
    """
    metas = list(metas)
    if not metas:
        return [], {}
    layers = list(state.layers.values())
    if len(metas) * 2 >= len(layers):
        return _dry_run(model, layers, metas)
    outside = [i for i in layers if i.block.startswith("<")]
    by_block: dict[str, list[TensorMeta]] = {}
    for m in metas:
        by_block.setdefault(block_key(m.name).name, []).append(m)
    plans: list[KeyPlan] = []
    problems: dict[str, WeightSyncError] = {}
    for block, group in by_block.items():
        candidates = [i for i in layers if i.block == block] + (
            [] if block.startswith("<") else outside
        )
        got, bad = _dry_run(model, candidates, group)
        plans.extend(got)
        if bad:
            retry, still_bad = _dry_run(model, layers, [m for m in group if m.name in bad])
            plans.extend(retry)
            problems.update(still_bad)
    return plans, problems


def _dry_run(
    model: nn.Module, layers: list[LayerInfo], metas: list[TensorMeta]
) -> tuple[list[KeyPlan], dict[str, WeightSyncError]]:
    """Run ``load_weights`` on meta tensors with ``layers`` swapped to meta, recording the copies."""
    plans: list[KeyPlan] = []
    problems: dict[str, WeightSyncError] = {}
    load = model_load_weights(model)
    rec = _Recorder({}, {})
    with swapped_tensors(layers, rec.on_call) as storages:
        bases: dict[tuple[str, str], int] = {}
        for info in layers:
            for name in info.records:
                t: torch.Tensor | None = info.module._parameters.get(name)
                if t is None:
                    t = info.module._buffers.get(name)
                bases[(info.name, name)] = int(t.storage_offset()) if t is not None else 0
        rec.storages, rec.bases = storages, bases
        pending = list(metas)
        while pending:
            current: list[TensorMeta] = []

            def feed(
                items: list[TensorMeta], current: list[TensorMeta]
            ) -> Iterator[tuple[str, torch.Tensor]]:
                for m in items:
                    # Finish the previous key: load_weights pulls the next item only when it is done.
                    if current:
                        plans.append(_finish(current[-1], rec))
                    current.append(m)
                    src = torch.empty(m.shape, dtype=m.dtype, device="meta")
                    rec.start(m.name, src)
                    yield m.name, src

            try:
                with rec:
                    load(feed(pending, current))
                if current:
                    plans.append(_finish(current[-1], rec))
                pending = []
            except WeightSyncError as e:
                bad = current[-1] if current else pending[0]
                problems[bad.name] = e
                pending = pending[len(current) or 1 :]
            except (RuntimeError, ValueError, IndexError, KeyError, AssertionError,
                    NotImplementedError, TypeError) as e:
                bad = current[-1] if current else pending[0]
                problems[bad.name] = LayoutMismatchError(
                    f"{bad.name}: the model's loader rejected {bad.shape} "
                    f"{str(bad.dtype).removeprefix('torch.')}: {type(e).__name__}: {e}"
                )
                pending = pending[len(current) or 1 :]
            finally:
                rec.key = None
    return [kp for kp in plans if kp.name not in problems], problems


def _finish(meta: TensorMeta, rec: _Recorder) -> KeyPlan:
    layers = tuple(dict.fromkeys([op.layer for op in rec.ops] + sorted(rec.loader_layers)))
    if rec.computed:
        mode: KeyMode = "loader"
    elif rec.ops:
        mode = "copy"
    else:
        mode = "ignored"
    return KeyPlan(
        name=meta.name,
        shape=torch.Size(meta.shape),
        dtype=meta.dtype,
        mode=mode,
        layers=layers,
        ops=tuple(rec.ops) if mode == "copy" else (),
        calls=tuple(rec.calls),
    )

