"""Blocks: grouping checkpoint names into transformer blocks, the unit of ordering and streaming.

A name belongs to the block named by its *outermost* integer path segment: ``model.layers.3.mlp.up_proj``
is in block ``model.layers.3``, and an MoE expert ``model.layers.3.mlp.experts.7.w1`` is in block 3 as
well (the inner ``7`` indexes an expert, not a block). Names with no integer segment form the *pre*
group (before the first block: embeddings) or the *post* group (after the last block: final norm, head).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = [
    "BlockKey",
    "block_key",
    "group_by_block",
    "order_by_block",
]


@dataclass(frozen=True, slots=True, order=True)
class BlockKey:
    """Identifies a group of names: ``kind`` is 'pre', 'block' or 'post'; blocks carry prefix and index."""

    rank: int  # 0 pre, 1 block, 2 post: sorts groups in forward order
    prefix: str
    index: int

    @property
    def kind(self) -> str:
        return ("pre", "block", "post")[self.rank]

    @property
    def name(self) -> str:
        """Human-readable name: 'model.layers.3', '<pre>' or '<post>'."""
        if self.rank == 1:
            return f"{self.prefix}.{self.index}" if self.prefix else str(self.index)
        return f"<{self.kind}>"


PRE = BlockKey(0, "", -1)
POST = BlockKey(2, "", -1)


# Cached: every update's bucket plan groups the same few hundred names again (a delta's wire manifest
# changes its sizes, not its names), and splitting them is most of that grouping's cost.
@functools.lru_cache(maxsize=1 << 17)
def _split_block(name: str) -> tuple[str, int] | None:
    parts = name.split(".")
    for i, p in enumerate(parts):
        if p.isdigit():
            return ".".join(parts[:i]), int(p)
    return None


@functools.lru_cache(maxsize=1 << 17)
def _indexed_key(name: str) -> BlockKey | None:
    """The block of an indexed name (None for an un-indexed one), made once per name."""
    split = _split_block(name)
    return None if split is None else BlockKey(1, split[0], split[1])


_INPUT_HINTS = ("embed", "wte", "wpe", "proj_in", "patch", "time_", "context_embed", "x_embed")


def _looks_like_input(name: str) -> bool:
    return any(h in name for h in _INPUT_HINTS)


def block_key(name: str, *, after_blocks: bool = False) -> BlockKey:
    """Return the block a checkpoint name belongs to.

    ``after_blocks`` decides where an un-indexed name goes (pre or post); callers that know the model's
    order pass it (see :func:`group_by_block`).
    """
    split = _split_block(name)
    if split is None:
        return POST if after_blocks else PRE
    prefix, index = split
    return BlockKey(1, prefix, index)


def group_by_block(
    names: Iterable[str], *, reference_order: Sequence[str] | None = None
) -> dict[BlockKey, list[str]]:
    """Group names into pre / block / post groups, returned in forward (execution) order.

    Un-indexed names are *pre* when they come before the first indexed name of ``reference_order``
    (e.g. the model's own parameter order) and *post* otherwise. Without a reference order (file order
    means nothing: safetensors sorts its header by dtype), names that look like input embeddings or
    input projections are *pre* and the rest *post*. Several block lists (``blocks.*`` then
    ``single_blocks.*``) keep the order in which their first member appears.
    """
    names = list(names)
    order = list(reference_order) if reference_order is not None else names
    position = {n: i for i, n in enumerate(order)}
    first_indexed = min(
        (position[n] for n in order if _split_block(n) is not None), default=len(order)
    )

    def is_pre(n: str) -> bool:
        if reference_order is not None and n in position:
            return position[n] < first_indexed
        return _looks_like_input(n)

    prefix_rank: dict[str, int] = {}
    for n in order:
        split = _split_block(n)
        if split is not None and split[0] not in prefix_rank:
            prefix_rank[split[0]] = len(prefix_rank)
    groups: dict[BlockKey, list[str]] = {}
    for n in names:
        key = _indexed_key(n)
        if key is None:
            key = PRE if is_pre(n) else POST
        else:
            prefix_rank.setdefault(key.prefix, len(prefix_rank))
        groups.setdefault(key, []).append(n)

    def sort_key(k: BlockKey) -> tuple[int, int, int]:
        return (k.rank, prefix_rank.get(k.prefix, 0), k.index)

    return {k: groups[k] for k in sorted(groups, key=sort_key)}


def order_by_block(names: Iterable[str], *, reference_order: Sequence[str] | None = None) -> list[str]:
    """Names reordered so that every block is complete before the next starts (stable within a block)."""
    return [n for group in group_by_block(names, reference_order=reference_order).values() for n in group]
