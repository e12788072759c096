"""The writes of one ``load`` call that are cheaper together: small copies and band quantizations.

A reload's host time is mostly launches: a copy of a 3 MB expert slice costs ~8 us of host time in
``copy_`` for ~1 us of device time, a Triton quantization of it tens of microseconds. Writes into live
tensors that nothing reads before the update ends can be queued and launched together instead: small
copies as one ``torch._foreach_copy_`` (multi-tensor kernels), band quantizations as one grouped kernel
per method and shape (``RowBands.quantize``). Big copies go out at once: their launch is cheap next to
the copy, and the device starts on them while the host goes on.

Every queued entry holds its source tensor, so its memory is not reused before the launch. The queue
is flushed at the end of every ``load`` call (the caller may reuse its tensors afterwards), whenever it
holds more than ``limit_bytes`` of sources (the device starts on those meanwhile; a generator streaming
a model is held back at most that much), and before a copy into a destination already queued (writes
to one place keep their order). One per model (``ModelState.write_queue``): the writers it makes are
cached with the model's destination views and serve every later update while pointers are unchanged.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from weight_sync.quant.online import RowBands

__all__ = ["WriteQueue"]

# Copies of up to this many bytes are queued; bigger ones are launched on arrival.
SMALL_COPY_BYTES = 4 << 20


class WriteQueue:
    """Queued small copies and band quantizations of one ``load`` call (see the module docstring)."""

    __slots__ = ("bands", "copy_dst", "copy_src", "limit_bytes", "nbytes", "targets")

    def __init__(self, limit_bytes: int = 512 << 20) -> None:
        self.bands: dict[Callable[..., None], list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
        self.copy_dst: list[torch.Tensor] = []
        self.copy_src: list[torch.Tensor] = []
        self.targets: set[int] = set()  # data_ptr of every queued copy's destination
        self.nbytes = 0
        self.limit_bytes = limit_bytes

    def band_writer(self, band: RowBands, q: torch.Tensor, s: torch.Tensor) -> Callable[[torch.Tensor], None]:
        """``fn(src)`` queueing the band quantization of ``src`` into ``q`` / ``s``."""
        quantize = band.quantize

        def fn(src: torch.Tensor) -> None:
            items = self.bands.get(quantize)
            if items is None:
                items = self.bands[quantize] = []
            items.append((src, q, s))
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
        """Launch everything queued."""
        bands, dst, src = self.bands, self.copy_dst, self.copy_src
        self.drop()
        if dst:
            torch._foreach_copy_(dst, src)
        for quantize, items in bands.items():
            quantize(items)

    def drop(self) -> None:
        """Forget everything queued (the update failed: its layers are rolled back or torn)."""
        self.bands, self.copy_dst, self.copy_src = {}, [], []
        self.targets = set()
        self.nbytes = 0
