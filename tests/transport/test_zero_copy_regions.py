"""Zero-copy region bookkeeping in one process (shm kind): exports, tables, drops and views."""

from __future__ import annotations

import gc

import pytest
import torch

from weight_sync.errors import SourceError, TransportError
from weight_sync.manifest import TensorMeta
from weight_sync.transport.zerocopy import EMPTY, RegionExporter, RegionImporter


def _metas(named: list[tuple[str, torch.Tensor]]) -> tuple[TensorMeta, ...]:
    return tuple(TensorMeta(n, t.dtype, tuple(t.shape)) for n, t in named)


def _pair() -> tuple[RegionExporter, RegionImporter]:
    return RegionExporter("shm", torch.device("cpu"), [1]), RegionImporter("shm", 1, torch.device("cpu"))


def test_views_of_one_storage_share_a_region_and_read_the_senders_bytes() -> None:
    exporter, importer = _pair()
    fused = torch.arange(24, dtype=torch.float32)
    named = [("q", fused[:8].view(2, 4)), ("k", fused[8:16]), ("v", fused[16:].view(4, 2)),
             ("bias", torch.ones(3, dtype=torch.bfloat16)), ("empty", torch.empty(0, 5))]
    regions, table = exporter.table([t for _, t in named])
    assert len(regions) == 2 and len(exporter) == 2  # the fused storage once, the bias once
    assert table[0][0] == table[1][0] == table[2][0] and [r[1] for r in table[:3]] == [0, 32, 64]
    assert table[4] == [EMPTY, 0]
    importer.add(regions)
    views = importer.views(table, _metas(named))
    for (name, got), (_, want) in zip(views, named):
        assert torch.equal(got, want), name
    fused.add_(100)  # the trainer writes in place: receivers read the same memory
    assert torch.equal(importer.views(table, _metas(named))[1][1], fused[8:16])


def test_a_dead_storage_is_dropped_at_the_next_header_and_a_repeated_table_travels_as_a_flag() -> None:
    exporter, importer = _pair()
    keep, temp = torch.zeros(4), torch.ones(4)
    regions, table = exporter.table([keep, temp])
    first = exporter.payload((0, 2), regions, table)
    assert not first["same_table"] and first["table"] == table
    again = exporter.payload((0, 2), [], exporter.table([keep, temp])[1])
    assert again["same_table"] and again["table"] == [] and again["drop"] == []
    importer.add(first["regions"])
    metas = _metas([("keep", keep), ("temp", temp)])
    assert importer.call_views((0, 2), first, metas) is importer.call_views((0, 2), again, metas)
    del temp, regions, table
    gc.collect()
    control = exporter.control()
    assert control["drop"] == [first["table"][1][0]] and len(exporter) == 1
    importer.drop(control["drop"])
    assert len(importer) == 1
    with pytest.raises(TransportError, match="does not hold"):
        importer.call_views((0, 2), {"same_table": True}, metas)  # views went with the dropped region


def test_a_reset_forgets_every_region_on_both_sides_and_exports_afresh() -> None:
    exporter, importer = _pair()
    w = torch.zeros(8)
    regions, _ = exporter.table([w])
    importer.add(regions)
    exporter.reset()
    control = exporter.control()
    assert control == {"drop": [], "reset": True} and len(exporter) == 0
    importer.drop(control["drop"], reset=control["reset"])
    assert len(importer) == 0
    regions2, _ = exporter.table([w])
    assert regions2[0]["id"] != regions[0]["id"], "region ids never repeat"
    assert exporter.control()["reset"] is False


def test_tensors_the_backend_cannot_share_and_tables_that_do_not_fit_are_rejected() -> None:
    exporter, importer = _pair()
    with pytest.raises(SourceError, match="shares CPU tensors only"):
        exporter.shareable("w", torch.empty(2, device="meta"))
    strided = torch.zeros(4, 4).t()
    assert exporter.shareable("w", strided).is_contiguous()
    w = torch.zeros(4)  # alive while receivers import it, as the sender holds a call's tensors
    regions, table = exporter.table([w])
    importer.add(regions)
    too_big = (TensorMeta("w", torch.float32, (8,)),)
    with pytest.raises(TransportError, match="does not fit region"):
        importer.views(table, too_big)
    with pytest.raises(TransportError, match="never exported"):
        importer.views([[99, 0]], (TensorMeta("w", torch.float32, (4,)),))
    with pytest.raises(TransportError, match="exported twice"):
        importer.add(regions)


class _RecordingExporter(RegionExporter):
    """Bookkeeping only: records exports instead of sharing memory."""

    def _export(self, region_id: int, storage: torch.UntypedStorage) -> dict:
        return {"id": region_id, "nbytes": storage.nbytes()}


def test_a_storage_resized_in_place_is_exported_again_and_its_old_region_dropped() -> None:
    # FSDP-style trainers free and re-allocate a parameter's memory with storage.resize_ (same object).
    exporter = _RecordingExporter("shm", torch.device("cpu"), [1])
    w = torch.zeros(1024)
    first, _ = exporter.table([w])
    storage = w.untyped_storage()
    storage.resize_(0)
    storage.resize_(8192)  # new memory (on CUDA never the old block: the import keeps it in IPC limbo)
    again, _ = exporter.table([w])
    assert [r["id"] for r in again] == [first[0]["id"] + 1]
    assert exporter.control()["drop"] == [first[0]["id"]] and len(exporter) == 1
    assert exporter.table([w])[0] == [], "unchanged memory is not exported again"
