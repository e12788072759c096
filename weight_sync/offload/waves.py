"""DP concurrency: waves of up to ``dp`` requests, one per rank, denoised in lockstep.

With AllGather, every rank of the gather group must enter every block's collective, so the ranks of a
wave must run the same number of denoising steps (different prompts are fine: the block order is the
same). A wave whose requests carry ``None`` or unequal ``num_inference_steps`` is rejected while it is
being formed - every rank sees the whole wave, so all ranks reject it identically, before any
collective. A rank without a request in a partial wave runs a filler pass so its peers' gathers still
have a partner.

This is a scheduler-side convenience: what holds the promise is the call guard on the offloaded
pipeline's call path (``weight_sync.offload.call_guard``), which rejects a mismatched call on every rank
whether or not the caller formed waves.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from weight_sync.errors import ConfigError

__all__ = [
    "DenoiseRequest",
    "Wave",
    "form_waves",
    "run_wave",
]

T = TypeVar("T")


@dataclass(frozen=True, kw_only=True)
class DenoiseRequest:
    """One generation request: an id, its step count and whatever the pipeline needs (``payload``)."""

    request_id: str
    num_inference_steps: int | None
    seed: int = 0
    payload: Any = None


@dataclass(frozen=True)
class Wave:
    """Up to ``dp_size`` requests that run together; request k runs on DP rank k."""

    requests: tuple[DenoiseRequest, ...]
    num_inference_steps: int
    dp_size: int

    def request_for(self, dp_rank: int) -> DenoiseRequest | None:
        """This rank's request, or None: the rank then runs a filler pass of the same length."""
        if not 0 <= dp_rank < self.dp_size:
            raise ConfigError(f"dp_rank must be in [0, {self.dp_size}), got: {dp_rank}")
        return self.requests[dp_rank] if dp_rank < len(self.requests) else None


def _check_steps(wave: Sequence[DenoiseRequest]) -> int:
    for r in wave:
        s = r.num_inference_steps
        if s is None:
            raise ConfigError(
                f"request {r.request_id!r} has num_inference_steps=None; with DP concurrency every "
                "request must set an explicit step count, because every rank must enter each collective"
            )
        if isinstance(s, bool) or not isinstance(s, int) or s < 1:
            raise ConfigError(f"request {r.request_id!r}: num_inference_steps must be an int >= 1, got {s!r}")
    steps = {r.num_inference_steps for r in wave}
    if len(steps) != 1:
        shown = ", ".join(f"{r.request_id}={r.num_inference_steps}" for r in wave)
        raise ConfigError(
            f"requests of one DP wave must share num_inference_steps, got {shown}; ranks running "
            "different step counts would wait forever in each other's block gathers"
        )
    return int(wave[0].num_inference_steps)  # type: ignore[arg-type]


def form_waves(requests: Sequence[DenoiseRequest], dp_size: int) -> list[Wave]:
    """Split ``requests`` (in arrival order) into waves of up to ``dp_size``; validate all of them first."""
    if isinstance(dp_size, bool) or not isinstance(dp_size, int) or dp_size < 1:
        raise ConfigError(f"dp_size must be an int >= 1, got: {dp_size!r}")
    if not requests:
        return []
    chunks = [tuple(requests[i : i + dp_size]) for i in range(0, len(requests), dp_size)]
    # Validate every wave before returning any: a caller never starts a wave of a batch that contains
    # an invalid one further on.
    steps = [_check_steps(c) for c in chunks]
    return [Wave(c, s, dp_size) for c, s in zip(chunks, steps)]


def run_wave(
    wave: Wave, *, dp_rank: int, run: Callable[[DenoiseRequest | None, int], T]
) -> T | None:
    """Run this rank's part of ``wave``: ``run(request, steps)``, or ``run(None, steps)`` as filler.

    Returns the request's result, or None for a filler pass.
    """
    request = wave.request_for(dp_rank)
    result = run(request, wave.num_inference_steps)
    return result if request is not None else None
