"""Zero-copy colocated transfer on CPU (shm): engines load from the trainer's own tensors in place."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.transport.harness_zero_copy import (
    call_in_start,
    engine_rebinds_between_updates,
    zero_copy_lifecycle,
    zero_copy_refused_manifest,
    zero_copy_source_fails,
    zero_copy_split_calls,
)
from weight_sync.errors import ConfigError
from weight_sync.testing import run_distributed
from weight_sync.transport import TransportConfig


@pytest.mark.parametrize("tp", [1, 2])
def test_engines_load_the_trainers_tensors_in_place_and_each_storage_is_exported_once(
    tp: int, qwen3_a: Path, qwen3_b: Path
) -> None:
    results = run_distributed(zero_copy_lifecycle, 1 + tp, str(qwen3_a), str(qwen3_b), timeout_s=240)
    trainer, engines = results[0], results[1:]
    n = trainer["num_tensors"]
    exported = [s["exported"] for s in trainer["stats"]]
    # Update 1 exports every storage; the in-place step exports nothing; a replaced parameter and a
    # temporary are two new storages; the two-call update reuses everything.
    assert exported == [n, n, n + 2, n + 2]
    # Live regions: the replaced parameter's old storage is dropped at update 3, the temporary (alive
    # until after its update) at update 4.
    live = [s["regions"] for s in trainer["stats"]]
    assert live == [n, n, n + 1, n]
    for rank, e in enumerate(engines, start=1):
        assert e["fingerprints"] == e["fresh"], f"rank {rank}"
        assert [fps[rank - 1] for fps in trainer["fingerprints"]] == e["fingerprints"]
        assert e["regions"] == live, f"rank {rank} holds exactly the sender's live regions"
        assert e["bitwise_equal"], f"rank {rank}"
        # The trainer changed its tensors after the last update: the engine holds copies, not aliases.
        assert e["after_trainer_moved_on"] == e["fingerprints"][-1], f"rank {rank}"
        assert e["closed_regions"] == 0


def test_a_failing_source_rolls_the_engine_back_and_the_next_update_starts_from_fresh_exports(
    qwen3_a: Path, qwen3_b: Path
) -> None:
    trainer, engine = run_distributed(zero_copy_source_fails, 2, str(qwen3_a), str(qwen3_b), timeout_s=240)
    (_, t1, m1), (_, t2, m2), clean, again = trainer["outcomes"]
    # Every rank raises the sender's error (an "Agreed" subclass of it names the failing rank).
    assert t1.endswith("SourceError") and "injected trainer failure" in m1, (t1, m1)
    assert t2.endswith("ManifestError") and "float64" in m2, (t2, m2)
    assert clean[1] == again[1] == "ok", (clean, again)
    assert [o[1] for o in engine["outcomes"]] == [t1, t2, "ok", "ok"], engine["outcomes"]
    failing, wrong, after_clean, after_again = engine["after"]
    for a in (failing, wrong):
        assert a["rolled_back"] and a["torn"] is None, a
        assert a["regions"] == 0, "a failed call releases every import"
    assert after_clean["regions"] == after_again["regions"] == trainer["stats"]["regions"]
    assert engine["final"] == engine["fresh_b"]


def test_a_refused_manifest_closes_the_source_writes_nothing_and_exports_nothing(qwen3_a: Path,
                                                                                qwen3_b: Path) -> None:
    trainer, engine = run_distributed(zero_copy_refused_manifest, 2, str(qwen3_a), str(qwen3_b), timeout_s=240)
    (_, c1, _), (_, t2, m2), (_, c3, _) = trainer["outcomes"]
    assert c1 == c3 == "ok" and t2.endswith("ManifestError") and trainer["short"] in m2, trainer["outcomes"]
    assert [o[1] for o in engine["outcomes"]] == ["ok", t2, "ok"], engine["outcomes"]
    assert trainer["closed"] == [True], "the trainer's source is closed when the update is refused"
    n = trainer["num_tensors"]
    assert trainer["exported"] == [n, n, n], "nothing is exported for a refused update; the next one reuses all"
    clean, refused, again = engine["fingerprints"]
    assert clean == refused == again == engine["fresh_b"] and engine["torn"] is None


@pytest.mark.parametrize(("backend", "zero_copy"), [("shm", True), ("shm", False), ("gloo", False)])
def test_a_repeated_send_to_one_receiver_rides_its_call_in_the_start_header(backend: str, zero_copy: bool,
                                                                           qwen3_a: Path, qwen3_b: Path) -> None:
    trainer, engine = run_distributed(call_in_start, 2, str(qwen3_a), str(qwen3_b), backend, zero_copy,
                                      timeout_s=240)
    assert trainer["outcomes"][:3] == ["ok"] * 3 and trainer["outcomes"][4] == "ok", trainer["outcomes"]
    assert "refuses the update at begin" in trainer["outcomes"][3], "the refusal is agreed on both sides"
    assert "refuses the update at begin" in engine["outcomes"][3] and engine["outcomes"][:3] == ["ok"] * 3
    # Control messages per update on the trainer. The first: start header and status, call header and
    # status (with the folded commit vote). A repeat: one header, one status. Phase by phase, the engine
    # does not fold its commit, so a finish header and status follow (4, not 6). After the refusal the
    # manifest and every region are sent anew: a full start again.
    assert trainer["controls"] == [4, 2, 4, None, 4], trainer["controls"]
    if zero_copy:  # exported at the first update and once more after the refusal (a failed call resets them)
        assert trainer["exported"] == 2 * trainer["num_tensors"]
    fps, fresh = engine["fingerprints"], engine["fresh"]
    assert fps[:3] == fresh[:3] and fps[4] == fresh[4], "each committed update equals a fresh load"
    assert fps[3] == fps[2] and engine["torn"] == [None] * 5, "the refused update wrote nothing"


def test_an_update_split_into_calls_from_a_lazy_source_equals_a_fresh_load(qwen3_a: Path, qwen3_b: Path) -> None:
    trainer, engine = run_distributed(zero_copy_split_calls, 2, str(qwen3_a), str(qwen3_b), 3, timeout_s=240)
    assert engine["fingerprint"] == engine["fresh"]
    assert trainer["fingerprints"] == [engine["fresh"]]
    assert trainer["num_buckets"] == 0, "zero-copy packs nothing"


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"backend": "gloo", "zero_copy": True, "checksum": False}, "colocated backend"),
        ({"backend": "nccl", "zero_copy": True, "checksum": False}, "colocated backend"),
        ({"backend": "shm", "zero_copy": True}, "checksum=False"),
    ],
)
def test_zero_copy_is_rejected_where_it_cannot_work(kwargs: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        TransportConfig(**kwargs)


@pytest.mark.parametrize("zero_copy", [True, False], ids=["zero-copy", "buffered"])
def test_a_parameter_the_engine_rebinds_between_updates_receives_the_next_update(zero_copy: bool, qwen3_a: Path,
                                                                                 qwen3_b: Path) -> None:
    # The receiver re-checks the model's pointers while it waits for the sender's header: the check
    # must still see the engine's own change made before it began waiting.
    _, engine = run_distributed(engine_rebinds_between_updates, 2, str(qwen3_a), str(qwen3_b), zero_copy,
                                timeout_s=240)
    assert engine["fingerprint"] == engine["fresh"]
    assert engine["new_tensor_loaded"]
    assert engine["old_tensor_untouched"]


def _remembered(exporter, tensors):
    _, rows = exporter.table(tensors)
    exporter.remember(tensors, rows)
    return rows


def test_a_call_of_tensors_lying_where_the_last_ones_lay_repeats_its_table_without_a_lookup() -> None:
    import torch

    from weight_sync.transport.zerocopy import RegionExporter

    exporter = RegionExporter("shm", torch.device("cpu"), [1])
    params = [torch.randn(4, 8), torch.randn(3), torch.randn(2, 2)]
    rows = _remembered(exporter, params)
    assert exporter.repeat_rows(params) is rows
    for p in params:
        p.add_(1)  # an optimizer step: new values, same memory
    assert exporter.repeat_rows(params) is rows
    assert exporter.repeat_rows([p.detach() for p in params]) is rows  # other tensor objects, same memory


def test_any_move_of_a_tensor_or_its_region_makes_the_call_look_its_tensors_up_again() -> None:
    import gc

    import torch

    from weight_sync.transport.zerocopy import RegionExporter

    exporter = RegionExporter("shm", torch.device("cpu"), [1])
    params = [torch.randn(4, 8), torch.randn(3), torch.randn(2, 2)]
    _remembered(exporter, params)
    moved = [params[0].clone(), *params[1:]]  # a replaced parameter: new memory
    assert exporter.repeat_rows(moved) is None
    assert exporter.repeat_rows([params[0].view(8, 4), *params[1:]]) is None  # same memory, other shape
    assert exporter.repeat_rows(params[:2]) is None
    temporary = torch.randn(5)
    _remembered(exporter, [*params, temporary])
    del temporary
    gc.collect()
    exporter.control()  # the temporary's storage died: its region goes, and with it the remembered table
    assert exporter.repeat_rows([*params, torch.randn(5)]) is None
    _remembered(exporter, params)
    exporter.forget_tables()  # a new manifest
    assert exporter.repeat_rows(params) is None
    _remembered(exporter, params)
    exporter.reset()  # a failed call
    assert exporter.repeat_rows(params) is None
