"""Sender side of a zero-copy call: its tensors produced from the source, checked and tabled.

``WeightSender`` runs the protocol (headers, status exchanges, the agreed outcome); this holds what a
zero-copy call needs besides: the exported regions (:class:`~weight_sync.transport.zerocopy.
RegionExporter`), the interprocess event receivers wait for, and the call produced ahead of its header.

A ``send()`` produces its call early, off the update's critical path:

- *before the start header*, when the tensors are the last whole call's again (``repeat``): the
  manifest's names, then layouts and pointers in one pass each (``RegionExporter.repeat_rows``). A call
  ready this early can ride in the start header of an update to one receiver (``call_in_start``);
- *otherwise while the receivers validate the manifest* (``produce``, between the start header and its
  status exchange): the source is iterated and checked against the manifest, and the table kept only if
  every storage was exported already (``known_rows``), so nothing is exported before every receiver
  accepted the manifest.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from operator import itemgetter
from typing import Any

import torch

from weight_sync.manifest import Manifest, TensorMeta
from weight_sync.transport.source import Checked, close_source
from weight_sync.transport.zerocopy import RegionExporter

__all__ = ["ZeroCopyCalls"]

# A call produced ahead of its header: (tensors, the source's iterator or None, the error that stopped
# the source or None, the table of its regions or None when a storage still needs an export).
Early = tuple[list[torch.Tensor], Any, BaseException | None, list[list[int]] | None]


class ZeroCopyCalls:
    """The zero-copy state of one sender: regions, the receivers' event, the call produced early."""

    def __init__(self, exporter: RegionExporter, event: Any, device: torch.device) -> None:
        self.exporter = exporter
        self.event = event  # ipc: an interprocess CUDA event recorded once a call's tensors are produced
        self.device = device
        self.early: Early | None = None
        self._collected_epoch = -1  # the exporter's epoch at the last ipc_collect

    def produced(self) -> None:
        """Mark the point on the caller's stream where the call's tensors are ready (receivers wait on it)."""
        if self.event is not None:
            self.event.record(torch.cuda.current_stream(self.device))

    def tensors(self, it: Iterator[tuple[str, torch.Tensor]], metas: tuple[TensorMeta, ...],
                first: int) -> tuple[list[torch.Tensor], BaseException | None]:
        """The call's tensors from the source, checked against the manifest and shareable (the ones
        produced so far, and the error that stopped the source, if any)."""
        tensors: list[torch.Tensor] = []
        source = Checked(it, metas, first)
        try:
            for index, meta in enumerate(metas):
                tensors.append(self.exporter.shareable(meta.name, source.next_tensor(index)))
            source.expect_end()
        except (Exception, KeyboardInterrupt) as e:
            return tensors, e
        return tensors, None

    def repeat(self, named_tensors: Any, manifest: Manifest) -> bool:
        """Whether ``send``'s list of (name, tensor) pairs is the last whole call's tensors again (a
        trainer's parameters, updated in place). If so the call is ready (``early``) without a tensor
        checked or looked up on its own; nothing of the source is consumed either way."""
        if type(named_tensors) not in (list, tuple) or len(named_tensors) != len(manifest):
            return False
        try:
            if tuple(map(itemgetter(0), named_tensors)) != manifest.names:
                return False
            tensors = list(map(itemgetter(1), named_tensors))
            table = self.exporter.repeat_rows(tensors)
        except (TypeError, IndexError):
            return False  # not (name, tensor) pairs: the call checks them one by one and names the problem
        if table is None:
            return False
        self.early = (tensors, None, None, table)
        return True

    def produce(self, named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
                manifest: Manifest) -> None:
        """Produce the whole call (``early``) while the receivers validate ``manifest``: its tensors, and
        its table if no storage needs an export. Never raises: a failure is the call's to report."""
        if self.repeat(named_tensors, manifest):
            return
        metas = manifest.tensors
        tensors: list[torch.Tensor] = []
        it: Iterator[tuple[str, torch.Tensor]] | None = None
        table = None
        try:
            if isinstance(named_tensors, Mapping):
                mapping = named_tensors
                named_tensors = ((m.name, mapping.get(m.name)) for m in metas)  # type: ignore[misc]
            it = iter(named_tensors)
            tensors, error = self.tensors(it, metas, 0)
            if error is None:
                table = self.exporter.known_rows(tensors)
                if table is not None:
                    self.exporter.remember(tensors, table)
        except (Exception, KeyboardInterrupt) as e:  # reported in the call, as a source failing there would be
            error = e
        self.early = (tensors, it, error, table)

    def drop_early(self, named_tensors: Any) -> None:
        """The update ended before its call (a refused start): close the source the call had begun."""
        if self.early is not None:
            close_source(self.early[1], named_tensors)
            self.early = None

    def call(self, named_tensors: Iterable[tuple[str, torch.Tensor]], metas: tuple[TensorMeta, ...],
             first: int, whole: bool, error: BaseException | None,
             ) -> tuple[list[torch.Tensor], list[dict[str, Any]], list[list[int]] | None, BaseException | None]:
        """A call's (tensors, new region records, table, error): the call produced early if there is one,
        else produced now; on an error the source is closed and every region reset (the table is None and
        the records are the exports to release). ``whole``: the call covers the manifest (remembered for
        the next call's ``repeat``)."""
        early, self.early = self.early, None
        regions: list[dict[str, Any]] = []
        table: list[list[int]] | None = None
        it: Any = None
        if early is not None:
            tensors, it, early_error, table = early
            error = error or early_error
        else:
            tensors = []
            if error is None:
                it = iter(named_tensors)
                tensors, error = self.tensors(it, metas, first)
        if error is None and table is None:
            try:
                regions, table = self.exporter.table(tensors)
                if whole:
                    self.exporter.remember(tensors, table)  # the next send() of tensors lying there: one pass
            except (Exception, KeyboardInterrupt) as e:
                error = e
        if error is not None:
            close_source(it, named_tensors)
            tensors = []
            # Receivers import what was exported before the failure only to release it with the rest.
            return tensors, self.exporter.abandon(), None, error
        self.produced()
        return tensors, regions, table, None

    def collect(self) -> None:
        """After a committed update over ipc: free exports whose importers are gone, once regions came or
        went since the last time (~0.15 ms of host time a call otherwise)."""
        if self.exporter.epoch != self._collected_epoch:
            torch.cuda.ipc_collect()
            self._collected_epoch = self.exporter.epoch
