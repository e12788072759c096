"""DP waves: grouping requests, and rejecting None or unequal step counts before anything runs."""

from __future__ import annotations

import pytest

from weight_sync.errors import ConfigError
from weight_sync.offload import DenoiseRequest, form_waves, run_wave


def _reqs(*steps: int | None) -> list[DenoiseRequest]:
    return [DenoiseRequest(request_id=f"r{i}", num_inference_steps=s) for i, s in enumerate(steps)]


def test_requests_form_waves_of_up_to_dp_one_per_rank() -> None:
    waves = form_waves(_reqs(4, 4, 8, 8, 8), 2)
    assert [[r.request_id for r in w.requests] for w in waves] == [["r0", "r1"], ["r2", "r3"], ["r4"]]
    assert waves[2].request_for(0).request_id == "r4"  # type: ignore[union-attr]
    assert waves[2].request_for(1) is None


def test_unequal_steps_anywhere_in_the_batch_reject_it_before_any_wave_runs() -> None:
    with pytest.raises(ConfigError, match="r2=4, r3=8"):
        form_waves(_reqs(4, 4, 4, 8), 2)


def test_none_steps_are_rejected() -> None:
    with pytest.raises(ConfigError, match="num_inference_steps=None"):
        form_waves(_reqs(4, None), 2)


def test_a_rank_without_a_request_runs_a_filler_pass_of_the_same_length() -> None:
    (wave,) = form_waves(_reqs(6), 2)
    calls: list[tuple[str | None, int]] = []

    def run(req: DenoiseRequest | None, steps: int) -> str:
        calls.append((req.request_id if req else None, steps))
        return "out"

    assert run_wave(wave, dp_rank=0, run=run) == "out"
    assert run_wave(wave, dp_rank=1, run=run) is None
    assert calls == [("r0", 6), (None, 6)]
