"""The call guard: the ranks of a gather group agree on every offloaded call before its first AllGather.

Why. With AllGather each rank's submission thread issues one collective per block load, and the ranks
pair those collectives by order alone. A call that runs a different number of blocks on one rank (another
step count, ``num_inference_steps=None`` where a peer passed a number, an input that sends the pipeline
down another path) leaves a peer waiting in a gather nobody joins, or pairs one rank's block with another
block of its peer: a hang, or silently mixed weights.

The unit of agreement is one *call*: the outermost forward of the offloaded root, of a DiT module that
owns a ring, or - called on its own - of a streamed block, whichever the user calls. Forwards nested in
it are part of it and are not agreed again, so a pipeline call costs one exchange, not one per block or
per step. Its record extends the schedule digest compared at enable (what streams, in which order, how
gathers are laid out) with:
  * the module called, the number of calls agreed before it and of block loads issued before it (equal on
    every rank unless an earlier call already ran differently somewhere);
  * every argument of its ``forward``, bound to the signature with defaults applied: values of non-tensor
    arguments (step counts, timestep / sigma lists, guidance scales, flags, strings, None), dtypes and
    shapes of tensors, recursively through lists, tuples and dicts; a device by its type; any other
    object (a generator, a callback) by its type only. Tensor values (latents, prompt embeddings, noise)
    are request data and may differ; so may arguments the pipeline's ``OffloadPlan.rank_local_args``
    names (an int seed), recorded only as passed.
Shapes are agreed because a pipeline may branch on them (batch splitting, guidance batching); the
guard cannot tell which do, so it is strict, and a mismatch is an error rather than a hang.

When and how. A forward pre-hook, registered ahead of the streamer's hooks, runs before the call queues
its first load. The exchange uses the gather group's gloo control group, never the weights'
communicator, which the submission thread may be using at that moment (the prefetch of the previous
call's last block); its waits are bounded by ``transfer_timeout_s``. The common path is one all-gather of
a 36-byte head (SHA-256 of the record and its length); only when the digests differ does a second
all-gather carry the records, so that every rank builds the same message from the same data.

On a mismatch every rank raises the same ``ConfigError`` naming each differing field with every rank's
value. No load of the call has been queued, so the group stays consistent and a corrected call may
follow. ``num_inference_steps=None`` on every rank is rejected too (an explicit count is required).
A peer that never makes the call makes the wait time out (``TransportTimeout``); the guard then refuses
every later call and ``disable()``, because the group's order is no longer known.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from weight_sync.errors import ConfigError, TransportError, WeightSyncError
from weight_sync.offload.gather_group import GatherGroup
from weight_sync.offload.metrics import OffloadMetrics

__all__ = [
    "CallGuard",
    "describe_call",
    "describe_value",
]

logger = logging.getLogger(__name__)

# Record fields that are not arguments; the spaces keep them apart from any parameter name.
_CALLED = "called module"
_CALLS_BEFORE = "calls before"
_LOADS_BEFORE = "loads before"
_DRIFT_FIELDS = (_CALLS_BEFORE, _LOADS_BEFORE)
_STEPS = "num_inference_steps"
_MAX_DEPTH = 4
_SHOWN_CHARS = 80


def describe_value(value: Any, depth: int = 0) -> str:
    """What of ``value`` must be equal on every rank: scalars by value, tensors by dtype and shape."""
    if isinstance(value, torch.Tensor):
        return f"tensor {str(value.dtype).removeprefix('torch.')} {list(value.shape)}"
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value)
    if isinstance(value, torch.dtype):
        return str(value)
    if isinstance(value, torch.device):
        return f"device {value.type}"  # cuda:0 on rank 0 and cuda:1 on rank 1 is the same call
    if depth < _MAX_DEPTH:
        if isinstance(value, (list, tuple)):
            inner = ", ".join(describe_value(v, depth + 1) for v in value)
            return f"[{inner}]" if isinstance(value, list) else f"({inner})"
        if isinstance(value, dict):
            items = sorted(value.items(), key=lambda kv: repr(kv[0]))
            return "{" + ", ".join(f"{k!r}: {describe_value(v, depth + 1)}" for k, v in items) + "}"
    return f"<{type(value).__name__}>"


def describe_call(
    signature: inspect.Signature | None, args: tuple[Any, ...], kwargs: dict[str, Any], *,
    rank_local: Iterable[str] = (),
) -> list[tuple[str, str]]:
    """The call's arguments as (name, description) pairs, defaults applied, in signature order."""
    local = set(rank_local)
    try:
        if signature is None:
            raise TypeError("no signature")
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        named = list(bound.arguments.items())
    except TypeError:
        # The forward will reject these arguments itself; describing them raw keeps every rank's
        # record comparable until it does.
        named = [(f"#{i}", a) for i, a in enumerate(args)] + sorted(kwargs.items())
    return [(n, "<rank-local>" if n in local else describe_value(v)) for n, v in named]


def _signature_of(module: nn.Module) -> inspect.Signature | None:
    try:
        return inspect.signature(module.forward)
    except (TypeError, ValueError):  # a builtin or C-implemented forward has none
        return None


class CallGuard:
    """Agrees each outermost call of the guarded modules across the gather group (see module doc)."""

    def __init__(
        self, *, gather: GatherGroup, schedule_digest: bytes, loads_issued: Callable[[], int],
        metrics: OffloadMetrics, rank_local_args: Sequence[str] = (),
    ) -> None:
        self.gather, self.metrics = gather, metrics
        self._schedule = schedule_digest.hex()[:16]
        self._loads_issued = loads_issued
        self._rank_local = tuple(rank_local_args)
        self._num_calls = 0
        self._outer: int | None = None  # id() of the module whose forward is the call in progress
        self._broken: str | None = None
        self._hooks: list[Any] = []

    def install(self, modules: Sequence[tuple[str, nn.Module]]) -> None:
        """Guard each ``(name, module)``: the root, the ring owners, then the streamed blocks."""
        seen: set[int] = set()
        for name, module in modules:
            if id(module) in seen:
                continue
            seen.add(id(module))
            signature = _signature_of(module)

            def pre(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], *,
                    _name: str = name, _sig: inspect.Signature | None = signature) -> None:
                self._enter(_name, _sig, mod, args, kwargs)

            def post(mod: nn.Module, args: tuple[Any, ...], output: Any) -> None:
                if self._outer == id(mod):
                    self._outer = None

            # prepend: on a block, agreement must precede the streamer's pre-hook, which queues loads.
            self._hooks.append(module.register_forward_pre_hook(pre, prepend=True, with_kwargs=True))
            # always_call: a call that raises (the agreement itself, or the forward) still ends.
            self._hooks.append(module.register_forward_hook(post, always_call=True))

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def _enter(
        self, name: str, signature: inspect.Signature | None, module: nn.Module,
        args: tuple[Any, ...], kwargs: dict[str, Any],
    ) -> None:
        if self._outer is not None:
            return  # nested in a call that was agreed as a whole
        # Marked before agreeing: if the agreement raises, the always-called forward hook ends the call.
        self._outer = id(module)
        self.agree(name, describe_call(signature, args, kwargs, rank_local=self._rank_local))

    def agree(self, called: str, arguments: Sequence[tuple[str, str]]) -> None:
        """Raise the same error on every rank unless all members make this call; bounded wait."""
        if self._broken is not None:
            raise WeightSyncError(
                f"[rank {self.gather.global_rank}] DLO call {called!r}: an earlier agreement of this "
                f"gather group failed ({self._broken}); the ranks' transfer order is no longer known, "
                "so offload refuses further calls - restart the group's processes"
            )
        record = [
            ("schedule", self._schedule), (_CALLED, called), (_CALLS_BEFORE, str(self._num_calls)),
            (_LOADS_BEFORE, str(self._loads_issued())), *arguments,
        ]
        payload = json.dumps(record).encode()
        head = hashlib.sha256(payload).digest() + len(payload).to_bytes(4, "little")
        what = f"DLO agreement on the call {called!r}"
        records: list[Any] = []
        try:
            heads = self.gather.exchange_fixed(head, what=what)
            if len({h[:32] for h in heads}) != 1:
                longest = max(int.from_bytes(h[32:], "little") for h in heads)
                padded = payload.ljust(longest, b" ")  # JSON ignores trailing whitespace
                records = [json.loads(p) for p in self.gather.exchange_fixed(padded, what=what)]
        except TransportError as e:
            # The peers' position in the call order is unknown now: a later exchange could pair this
            # rank's call with another call of theirs.
            self._broken = f"{type(e).__name__} in the agreement on the call {called!r}"
            raise
        if records:
            message = _mismatch_message(self.gather.members, records)
            logger.error("[rank %d] %s", self.gather.global_rank, message)
            raise ConfigError(message)
        steps = dict(arguments).get(_STEPS)
        if steps == "None":
            raise ConfigError(
                f"DLO call {called!r}: num_inference_steps is None on every rank of the gather group "
                f"(ranks {list(self.gather.members)}); with AllGather every rank must enter each block's "
                "gather, so the step count must be explicit (and equal on every rank)"
            )
        self._num_calls += 1
        self.metrics.num_call_agreements += 1


def _shown(value: str | None) -> str:
    if value is None:
        return "(absent)"
    return value if len(value) <= _SHOWN_CHARS else value[: _SHOWN_CHARS - 3] + "..."


def _mismatch_message(members: Sequence[int], records: list[list[list[str]]]) -> str:
    """One message from every rank's record; the same on every rank, since all hold the same records."""
    fields = [dict((k, v) for k, v in r) for r in records]
    called = fields[0].get(_CALLED, "?")
    names = list(dict.fromkeys(k for r in records for k, _ in r))
    differing = [n for n in names if len({f.get(n) for f in fields}) > 1]
    parts = [
        f"{n}: " + ", ".join(f"rank {rank}: {_shown(f.get(n))}" for rank, f in zip(members, fields))
        for n in differing
    ]
    drift = ""
    if any(n in _DRIFT_FIELDS for n in differing):
        drift = (" The ranks' transfers already differ from an earlier call (a call that ran or failed "
                 "on some ranks only); this group cannot continue.")
    return (
        f"DLO call {called!r} differs across the gather group (ranks {list(members)}) before its first "
        f"AllGather: {'; '.join(parts)}. Every rank of a gather group must make the same call - the same "
        "step count, schedule and input shapes (tensor values may differ) - because each rank must enter "
        "every block's AllGather in the same order; nothing of this call was transferred." + drift
    )
