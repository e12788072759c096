"""Layout announcements for route plans: what trainer ranks hold, what engine ranks need.

Trainer side: :func:`holdings_from_placements` reads DTensor placements (``Shard(dim)`` with
torch's chunking: ``ceil(n / k)`` elements per rank, the last ones shorter or empty; ``Replicate``;
several mesh dimensions sharding one tensor dimension split it in mesh order), :func:`holdings_from_dtensors`
reads them off live DTensors, :func:`fsdp_holdings` and :func:`whole_holdings` describe FSDP2-style
``Shard(0)`` trainers and replicated or expert-parallel ones without any tensor.

Engine side: :func:`needs_from_model` turns the reload plan of a live engine rank (the copies its
``weight_loader`` s were recorded making, see :mod:`weight_sync.reload.recorder`) into needed boxes and
destination views; :func:`merge_needs` joins the announcements of several ranks
(:mod:`.routes_reference` computes the same for the reference engine's layout from its config alone).

Every announcer builds its piece tuples through caches, so that tensors of one pattern (every block's
``q_proj``) share one tuple and :func:`~weight_sync.transport.routes.plan_routes` intersects it once.

Limitations: ``_StridedShard`` (FSDP2 over TP) and ``Partial`` placements are refused; a key the engine
loads through a computing loader is announced whole with ``param=None``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence
from functools import lru_cache
from typing import Any

import torch
from torch import nn

from weight_sync.errors import ConfigError, ManifestError
from weight_sync.manifest import TensorMeta
from weight_sync.reload.plan import contiguous_strides
from weight_sync.transport.routes import Box, Holding, Need, NeedPiece, Piece, fmt_box

__all__ = [
    "fsdp_holdings",
    "holdings_from_dtensors",
    "holdings_from_placements",
    "merge_needs",
    "needs_from_key_plans",
    "needs_from_model",
    "whole_holdings",
]

# ------------------------------------------------------------------------------------------ trainer


def _normalize(placements: Sequence[Any], name: str) -> tuple[tuple[str, int], ...]:
    """Placements as ('S', dim) / ('R', 0); anything else is refused by name."""
    from torch.distributed.tensor import Replicate, Shard

    out = []
    for p in placements:
        if isinstance(p, Shard) and not hasattr(p, "split_factor"):
            out.append(("S", int(p.dim)))
        elif isinstance(p, Replicate):
            out.append(("R", 0))
        else:
            raise ManifestError(
                f"{name}: placement {p!r} cannot be announced: route plans read Shard(dim) and "
                "Replicate (a Partial tensor is held by no rank until reduced; _StridedShard is not "
                "supported yet)"
            )
    return tuple(out)


@lru_cache(maxsize=4096)
def _placement_pieces(
    shape: tuple[int, ...], mesh: tuple, mesh_shape: tuple[int, ...], placements: tuple[tuple[str, int], ...]
) -> tuple[Piece, ...]:
    flat = list(_flatten(mesh))
    pieces = []
    for index, coord in enumerate(itertools.product(*(range(k) for k in mesh_shape))):
        box = [(0, n) for n in shape]
        for (kind, dim), k, c in zip(placements, mesh_shape, coord):
            if kind != "S":
                continue
            a, b = box[dim]
            n = b - a
            chunk = -(-n // k)  # torch's Shard: ceil(n / k) per rank, the tail shorter or empty
            start, stop = min(chunk * c, n), min(chunk * c + chunk, n)
            box[dim] = (a + start, a + stop)
        pieces.append(Piece(rank=int(flat[index]), box=tuple(box)))
    return tuple(pieces)


def _flatten(mesh: Any) -> Iterable[int]:
    if isinstance(mesh, (list, tuple)):
        for m in mesh:
            yield from _flatten(m)
    else:
        yield int(mesh)


def _mesh_shape(mesh: Any) -> tuple[int, ...]:
    shape = []
    while isinstance(mesh, (list, tuple)):
        shape.append(len(mesh))
        mesh = mesh[0] if mesh else 0
    return tuple(shape)


def _freeze(mesh: Any) -> Any:
    return tuple(_freeze(m) for m in mesh) if isinstance(mesh, (list, tuple)) else int(mesh)


def holdings_from_placements(
    name: str, shape: Sequence[int], dtype: torch.dtype, mesh: Any, placements: Sequence[Any]
) -> Holding:
    """What each rank of ``mesh`` (nested lists of global ranks) holds of a DTensor with ``placements``."""
    mesh_t = _freeze(mesh.tolist() if isinstance(mesh, torch.Tensor) else mesh)
    mesh_shape = _mesh_shape(mesh_t)
    if len(mesh_shape) != len(placements):
        raise ManifestError(f"{name}: {len(placements)} placements for a mesh of shape {mesh_shape}")
    norm = _normalize(placements, name)
    shape_t = tuple(int(n) for n in shape)
    for kind, dim in norm:
        if kind == "S" and not 0 <= dim < len(shape_t):
            raise ManifestError(f"{name}: Shard({dim}) of a tensor of shape {shape_t}")
    return Holding(name=name, shape=shape_t, dtype=dtype,
                   pieces=_placement_pieces(shape_t, mesh_t, mesh_shape, norm))


def holdings_from_dtensors(
    named: Iterable[tuple[str, torch.Tensor]], *, plain_ranks: Sequence[int] = (0,)
) -> list[Holding]:
    """Holdings of every rank, read off one rank's tensors (placements are equal on every rank).

    DTensors announce their mesh and placements; plain tensors are held whole by ``plain_ranks``.
    """
    from torch.distributed.tensor import DTensor

    out = []
    for name, t in named:
        if isinstance(t, DTensor):
            out.append(holdings_from_placements(
                name, tuple(t.shape), t.dtype, t.device_mesh.mesh.tolist(), t.placements
            ))
        else:
            out.extend(whole_holdings([TensorMeta(name, t.dtype, tuple(t.shape))], plain_ranks))
    return out


@lru_cache(maxsize=4096)
def _fsdp_pieces(shape: tuple[int, ...], ranks: tuple[int, ...], dim: int) -> tuple[Piece, ...]:
    from torch.distributed.tensor import Shard

    return _placement_pieces(shape, ranks, (len(ranks),), _normalize([Shard(dim)], "fsdp"))


def fsdp_holdings(metas: Iterable[TensorMeta], ranks: Sequence[int] | int, *, dim: int = 0) -> list[Holding]:
    """FSDP2-style holdings: every tensor ``Shard(dim)`` over ``ranks`` (a count means ``0..n-1``)."""
    rank_t = tuple(range(ranks)) if isinstance(ranks, int) else tuple(ranks)
    if not rank_t:
        raise ConfigError("ranks must name at least one trainer rank, got none")
    out = []
    for m in metas:
        shape = tuple(m.shape)
        if not shape:  # a scalar cannot be sharded: FSDP2 keeps it whole on every rank
            out.extend(whole_holdings([m], rank_t))
            continue
        out.append(Holding(name=m.name, shape=shape, dtype=m.dtype, pieces=_fsdp_pieces(shape, rank_t, dim)))
    return out


@lru_cache(maxsize=4096)
def _whole_pieces(shape: tuple[int, ...], ranks: tuple[int, ...]) -> tuple[Piece, ...]:
    box = tuple((0, n) for n in shape)
    return tuple(Piece(rank=r, box=box) for r in ranks)


def whole_holdings(
    metas: Iterable[TensorMeta], ranks: Sequence[int] | Callable[[str], Sequence[int]]
) -> list[Holding]:
    """Whole tensors on ``ranks`` (replicated), or on ``ranks(name)`` (expert parallel: the owner)."""
    out = []
    for m in metas:
        owners = tuple(ranks(m.name) if callable(ranks) else ranks)
        out.append(Holding(name=m.name, shape=tuple(m.shape), dtype=m.dtype,
                           pieces=_whole_pieces(tuple(m.shape), owners)))
    return out


# ------------------------------------------------------------------------------------------- engine


def _view_box(name: str, shape: tuple[int, ...], offset: int, size: tuple[int, ...],
              stride: tuple[int, ...]) -> Box:
    """The box a strided view of a contiguous tensor of ``shape`` covers; refused when it is no box."""
    cs = contiguous_strides(shape)
    if len(size) != len(shape) or any(n > 1 and s != c for n, s, c in zip(size, stride, cs)):
        raise ManifestError(
            f"{name}: the engine's loader reads a view (size {size}, stride {stride}) of {shape} that is "
            "not a box of it; route plans need loaders that narrow (or announce it whole)"
        )
    box, rest = [], offset
    for n, c, full in zip(size, cs, shape):
        start = rest // c
        rest -= start * c
        box.append((start, start + n))
        if start + n > full:
            raise ManifestError(f"{name}: the engine's loader reads past the tensor: {fmt_box(tuple(box))}")
    return tuple(box)


def needs_from_key_plans(key_plans: Iterable[Any], rank: int) -> list[Need]:
    """The needs of engine rank ``rank`` from its reload key plans (:class:`~weight_sync.reload.KeyPlan`).

    A copy-planned key needs the boxes its recorded copies read; an ignored key (another rank's expert,
    a tied head) needs nothing; a key loaded through a computing loader needs the whole tensor, for
    the engine's own loader (``param=None``). A key copied into two tensors is refused by name.
    """
    out = []
    for kp in key_plans:
        shape = tuple(kp.shape)
        if kp.mode == "ignored":
            continue
        if kp.mode == "loader":
            out.append(Need(name=kp.name, shape=shape, dtype=kp.dtype, param=None,
                            pieces=(NeedPiece(rank=rank, box=tuple((0, n) for n in shape)),)))
            continue
        params = {f"{op.layer}.{op.tensor}" for op in kp.ops}
        if len(params) != 1:
            raise ManifestError(f"{kp.name}: copied into {sorted(params)}; a route need fills one parameter")
        pieces = []
        for op in kp.ops:
            if tuple(op.src_size) != tuple(op.dst_size):
                raise ManifestError(f"{kp.name}: the loader copies {op.src_size} into {op.dst_size} (a "
                                    "broadcasting copy cannot be routed)")
            if 0 in op.src_size:
                continue
            box = _view_box(kp.name, shape, op.src_offset, tuple(op.src_size), tuple(op.src_stride))
            pieces.append(NeedPiece(rank=rank, box=box, dst_offset=op.dst_offset,
                                    dst_stride=tuple(op.dst_stride)))
        out.append(Need(name=kp.name, shape=shape, dtype=kp.dtype, param=params.pop(), pieces=tuple(pieces)))
    return out


def needs_from_model(model: nn.Module, metas: Iterable[TensorMeta], rank: int) -> list[Need]:
    """Engine rank ``rank``'s needs for ``metas``, from ``model``'s reload plan (planned now where missing).

    Keys the plan refuses (unknown names, wrong shapes) raise the reload plan's own error for the first.
    """
    from weight_sync.reload.recorder import plan_keys
    from weight_sync.reload.state import get_state

    metas = list(metas)
    state = get_state(model, create=True)
    known = state.plan.keys if state.plan is not None else {}
    todo = [m for m in metas if m.name not in known]
    planned, problems = plan_keys(model, state, todo) if todo else ([], {})
    if problems:
        first = next(iter(problems))
        raise ManifestError(f"{first}: the engine cannot plan it: {problems[first]}") from problems[first]
    by_name = {**{kp.name: kp for kp in planned}, **{m.name: known[m.name] for m in metas if m.name in known}}
    return needs_from_key_plans((by_name[m.name] for m in metas), rank)


def merge_needs(
    announcements: Iterable[Iterable[Need]], *, order: Iterable[str] | None = None
) -> list[Need]:
    """One need per tensor from several engine ranks' announcements.

    ``order``: tensor names in the order to keep (the manifest's block order); by default first seen
    (a tensor only a later rank needs, such as its experts, then comes after the earlier ranks' ones).
    Ranks must agree on a tensor's shape, dtype and destination parameter, else ManifestError.
    """
    merged: dict[str, Need] = {}
    for needs in announcements:
        for n in needs:
            old = merged.get(n.name)
            if old is None:
                merged[n.name] = n
                continue
            if (old.shape, old.dtype, old.param) != (n.shape, n.dtype, n.param):
                raise ManifestError(
                    f"{n.name}: engine ranks disagree: {old.shape} {old.dtype} into {old.param} vs "
                    f"{n.shape} {n.dtype} into {n.param}"
                )
            merged[n.name] = Need(name=n.name, shape=n.shape, dtype=n.dtype, param=n.param,
                                  pieces=old.pieces + n.pieces)
    if order is None:
        return list(merged.values())
    rank = {name: i for i, name in enumerate(order)}
    return sorted(merged.values(), key=lambda n: rank.get(n.name, len(rank)))
