"""The writes of one ``load`` call that are cheaper together: small copies and band quantizations.

A reload's host time is mostly launches: a copy of a 3 MB expert slice costs ~8 us of host time in
``copy_`` for ~1 us of device time, a Triton quantization of it tens of microseconds. Writes into live
tensors that nothing reads before the update ends can be queued and launched together instead: small
copies as one grouped launch (``grouped_copy.copy_many``), band quantizations as one grouped kernel per
method and shape (``RowBands.quantize``). Big copies go out at once: their launch is cheap next to
the copy, and the device starts on them while the host goes on.

Every queued entry holds its source tensor, so its memory is not reused before the launch. The queue
is flushed at the end of every ``load`` call (the caller may reuse its tensors afterwards), whenever it
holds more than ``limit_bytes`` of sources (the device starts on those meanwhile; a generator streaming
a model is held back at most that much), and before a copy into a destination already queued (writes
to one place keep their order). One per model (``ModelState.write_queue``): the writers it makes are
cached with the model's destination views and serve every later update while pointers are unchanged.

Bands of a matrix with one scale (per-tensor fp8: ``RowBands.matrix_rows``) wait until every row of
their matrix is queued, and are quantized together: the scale needs the whole matrix's absmax. A
matrix still incomplete when a ``load`` call ends (its keys straddle two calls) keeps private copies
of the bands it has (:meth:`WriteQueue.carry`) - the staging of that one matrix, counted as buffered -
and is quantized when its last band arrives, in a later call.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from weight_sync.quant.online import RowBands
from weight_sync.reload.grouped_copy import copy_many

__all__ = ["WriteQueue"]

# Copies of up to this many bytes are queued; bigger ones are launched on arrival.
SMALL_COPY_BYTES = 4 << 20


class _Matrix:
    """The queued bands of one one-scale matrix of ``layer``: rows still to come, and the first
    ``carried`` items already private copies (``spilled[i]``: item i's copy is in host memory)."""

    __slots__ = ("carried", "items", "layer", "left", "spilled")

    def __init__(self, layer: str, rows: int) -> None:
        self.layer = layer
        self.left = rows
        self.items: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.carried = 0
        self.spilled: list[bool] = []


#: ``carrier(layer, src) -> (private copy, whether it is in host memory)``; ``release(nbytes, spilled)``.
Carrier = Callable[[str, torch.Tensor], tuple[torch.Tensor, bool]]
Release = Callable[[int, bool], None]


def _on(src: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``src`` on the kernel tensors' device in the model-format ``dtype``.

    A host source of a device engine is copied over first (a blocking copy: the caller may reuse a
    pinned source once the call returns), so its quantization runs on the device like every other
    band's. A wider wire dtype (an fp32 trainer into a bf16 model) is then rounded into ``dtype``: the
    staged path rounds it into model-format staging before quantizing, and so must a band, or its bytes
    would differ from a fresh load's.
    """
    if src.device != device:
        src = src.to(device)
    return src if src.dtype is dtype else src.to(dtype)


class WriteQueue:
    """Queued small copies and band quantizations of one ``load`` call (see the module docstring)."""

    __slots__ = ("bands", "carrier", "carry_now", "copy_dst", "copy_src", "limit_bytes", "matrices", "nbytes",
                 "release", "targets", "written")

    def __init__(self, limit_bytes: int = 512 << 20) -> None:
        self.bands: dict[Callable[..., None], list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
        self.copy_dst: list[torch.Tensor] = []
        self.copy_src: list[torch.Tensor] = []
        self.targets: set[int] = set()  # data_ptr of every queued copy's destination
        # Bands of one-scale matrices still missing rows, by their scale view's data_ptr.
        self.matrices: dict[int, _Matrix] = {}
        # Set by the session: where incomplete matrices keep private copies of their bands (its staging
        # budget decides), and whether a band must be copied at once (a generator's tensor may be reused
        # as soon as the next one is asked for; a list's live until the call returns).
        self.carrier: Carrier | None = None
        self.release: Release | None = None
        self.written: Callable[[str], None] | None = None  # called as a matrix of the layer becomes whole
        self.carry_now = False
        self.nbytes = 0
        self.limit_bytes = limit_bytes

    def band_writer(self, band: RowBands, q: torch.Tensor, s: torch.Tensor, dtype: torch.dtype,
                    layer: str = "") -> Callable[[torch.Tensor], None]:
        """``fn(src)`` queueing the band quantization of ``src`` into ``q`` / ``s`` (of ``layer``, whose
        model format is ``dtype``; ``src`` is moved and converted first, see :func:`_on`)."""
        quantize = band.quantize
        if band.matrix_rows:
            return self._matrix_writer(band, q, s, dtype, layer)

        def fn(src: torch.Tensor) -> None:
            src = _on(src, q.device, dtype)
            items = self.bands.get(quantize)
            if items is None:
                items = self.bands[quantize] = []
            items.append((src, q, s))
            self._added(src.nbytes)

        return fn

    def _matrix_writer(self, band: RowBands, q: torch.Tensor, s: torch.Tensor, dtype: torch.dtype,
                       layer: str) -> Callable[[torch.Tensor], None]:
        quantize, rows, slot = band.quantize, band.matrix_rows, s.data_ptr()

        def fn(src: torch.Tensor) -> None:
            src = _on(src, q.device, dtype)  # as band_writer
            m = self.matrices.get(slot)
            if m is None:
                m = self.matrices[slot] = _Matrix(layer, rows)
            m.items.append((src, q, s))
            m.left -= src.shape[0]
            if m.left:
                if self.carry_now:
                    self._carry(m)
                return
            # The matrix is whole: its bands (some perhaps carried over from earlier) go out with the next
            # launch, the carried ones back on the matrix's device.
            del self.matrices[slot]
            if self.written is not None:
                self.written(layer)
            items = m.items
            for i in range(m.carried):
                w = items[i][0]
                assert self.release is not None  # set whenever anything was carried
                self.release(w.nbytes, m.spilled[i])
                if w.device != q.device:
                    items[i] = (w.to(q.device, non_blocking=True), q, items[i][2])
            queued = self.bands.get(quantize)
            if queued is None:
                queued = self.bands[quantize] = []
            queued.extend(items)
            self._added(src.nbytes)

        return fn

    def copier(self, dst: torch.Tensor) -> Callable[[torch.Tensor], None]:
        """``fn(src)``: ``dst.copy_(src)``, queued when small (same dtype and device)."""
        copy, ptr, dtype, device = dst.copy_, dst.data_ptr(), dst.dtype, dst.device

        def fn(src: torch.Tensor) -> None:
            nbytes = src.nbytes
            if nbytes > SMALL_COPY_BYTES or src.dtype != dtype or src.device != device:
                copy(src)
                return
            if ptr in self.targets:
                self.flush()
            self.targets.add(ptr)
            self.copy_dst.append(dst)
            self.copy_src.append(src)
            self._added(nbytes)

        return fn

    def _added(self, nbytes: int) -> None:
        self.nbytes += nbytes
        if self.nbytes > self.limit_bytes:
            self.flush()

    def flush(self) -> None:
        """Launch everything queued (incomplete one-scale matrices keep waiting for their rows)."""
        bands, dst, src = self.bands, self.copy_dst, self.copy_src
        self.bands, self.copy_dst, self.copy_src = {}, [], []
        self.targets = set()
        self.nbytes = 0
        if dst:
            copy_many(dst, src)
        for quantize, items in bands.items():
            quantize(items)

    def carry(self) -> None:
        """End of a ``load`` call: incomplete one-scale matrices copy the bands they hold out of the
        caller's memory, which may be reused once the call returns."""
        for m in self.matrices.values():
            self._carry(m)

    def _carry(self, m: _Matrix) -> None:
        assert self.carrier is not None, "a session sets WriteQueue.carrier before loading"
        for i in range(m.carried, len(m.items)):
            src, q, s = m.items[i]
            copy, spilled = self.carrier(m.layer, src)
            m.items[i] = (copy, q, s)
            m.spilled.append(spilled)
        m.carried = len(m.items)

    def waiting_layers(self) -> set[str]:
        """Layers with a one-scale matrix still missing rows."""
        return {m.layer for m in self.matrices.values()}

    def drop(self) -> None:
        """Forget everything queued (the update failed: its layers are rolled back or torn)."""
        self.bands, self.copy_dst, self.copy_src = {}, [], []
        self.targets = set()
        self.matrices = {}
        self.carry_now = False
        self.nbytes = 0
