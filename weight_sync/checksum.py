"""On-device checksums of tensors and transport buckets, computed in one read pass.

The checksum of ``n`` bytes keeps two 32-bit sums of the little-endian 32-bit words (the last one
zero-padded): a plain sum and a sum weighted by ``(i % 65521) + 1``, so flipped bytes and swapped words both
change it (it is not cryptographic); the 64-bit value is ``(plain << 32 | weighted) ^ n``, identical on CPU
and CUDA. Only the low 32 bits of each sum matter, so the words can be summed as signed
int32 with wrap-around (equal mod 2**32 to the unsigned sums), and the weighted sum needs no weight
tensor as large as the data: viewing the words as rows of 65521 columns, every column has one weight,
so one column reduction (no int64 copy of the data) followed by a 65521-element dot product gives both
sums. The result stays on the device (two int64 words), so the sender writes it into the trailer and the
receiver compares it without a host round trip of the data.
"""

from __future__ import annotations

import functools

import torch

__all__ = [
    "ChecksumWorkspace",
    "bucket_checksum",
    "checksum_value",
    "prepare_checksum",
    "reuse_workspace",
    "tensor_checksum",
    "tensor_checksums",
]

_PERIOD = 65521
_MASK32 = 0xFFFFFFFF
_weights: dict[torch.device, torch.Tensor] = {}


def _weight_rows(device: torch.device) -> torch.Tensor:
    """int64 [2, 65521]: a row of ones (plain sum) and the column weights 1..65521 (weighted sum)."""
    w = _weights.get(device)
    if w is None:
        # Made on the device itself: no host->device copy (and so no synchronization) on first use.
        ones = torch.ones(_PERIOD, dtype=torch.int64, device=device)
        w = torch.stack([ones, torch.arange(1, _PERIOD + 1, dtype=torch.int64, device=device)])
        _weights[device] = w
    return w


def prepare_checksum(device: torch.device) -> None:
    """Create the weight rows of ``device`` and wait for them, while nothing else is in flight (connect).

    The rows are made by kernels on whichever stream asks first and then read from other streams (pack,
    compute); made and completed up front, no stream can read them early, and no later first use has to
    synchronize a stream that may be waiting on a transfer.
    """
    _weight_rows(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class ChecksumWorkspace:
    """The intermediates of :func:`bucket_checksum` (1.3 MB), allocated once per transport side.

    Without one every checksum allocates its column sums and weighted products; during a live update
    those transient megabytes land on top of the engine's peak memory. A workspace belongs to one
    stream's work at a time (the sender's pack stream, a receiver's compute stream): two streams sharing
    one would race on it.
    """

    def __init__(self, device: torch.device) -> None:
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            # Tensors always carry an index: 'cuda' alone would never match them (and never be used).
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.cols = torch.empty(_PERIOD, dtype=torch.int32, device=self.device)
        self.products = torch.empty((2, _PERIOD), dtype=torch.int64, device=self.device)
        self.sums = torch.empty(2, dtype=torch.int64, device=self.device)
        self.tail = torch.empty(2, dtype=torch.int64, device=self.device)


def reuse_workspace(workspace: ChecksumWorkspace | None, device: torch.device) -> ChecksumWorkspace:
    """``workspace`` if it is on ``device``, else a new one there (allocated on first use, then kept)."""
    return workspace if workspace is not None and workspace.device == device else ChecksumWorkspace(device)


def bucket_checksum(
    data: torch.Tensor, out: torch.Tensor | None = None, workspace: ChecksumWorkspace | None = None
) -> torch.Tensor:
    """Return int64 ``[hi, lo]`` (the two 32-bit sums) for a 1-D uint8 tensor of 4-byte multiple length.

    ``checksum_value(result, data.numel())`` equals ``tensor_checksum(data)``. With ``out`` (an int64
    tensor of 2 elements, e.g. two trailer words) the result is written there on the current stream and
    ``out`` is returned: nothing is read back to the host.

    Few kernels on purpose (this runs once per bucket on each side): the words are summed as signed int32
    (congruent mod 2**32 to the unsigned words); both sums come from one multiply by the [2, 65521]
    weight rows and one row reduction, in int64 without overflow (|column sum| < 2**31, weights <= 65521,
    65521 columns: < 2**63), and only the final mask takes them mod 2**32.
    """
    if data.dtype != torch.uint8 or data.dim() != 1:
        raise ValueError(f"bucket_checksum needs a 1-D uint8 tensor, got {tuple(data.shape)} {data.dtype}")
    if data.numel() % 4:
        raise ValueError(f"bucket_checksum needs a length that is a multiple of 4, got {data.numel()}")
    words = data.view(torch.int32)
    n = words.numel()
    rows = n // _PERIOD
    tail = n - rows * _PERIOD
    weights = _weight_rows(data.device)
    ws = workspace if workspace is not None and workspace.device == data.device else None
    acc: torch.Tensor | None = None
    if rows:
        # int32 accumulation output: the reduction accumulates wider and wraps on the final cast, which
        # is exactly the column sum mod 2**32 without materializing an int64 copy of the data.
        block = words[: rows * _PERIOD].view(rows, _PERIOD)
        if ws is None:
            cols = block.sum(dim=0, dtype=torch.int32)
            acc = (cols * weights).sum(dim=1)
        else:
            torch.sum(block, dim=0, dtype=torch.int32, out=ws.cols)
            torch.mul(ws.cols, weights, out=ws.products)
            acc = torch.sum(ws.products, dim=1, out=ws.sums)
    if tail:
        if ws is None:
            part = (words[rows * _PERIOD :] * weights[:, :tail]).sum(dim=1)
        else:
            prod = ws.products[:, :tail]
            torch.mul(words[rows * _PERIOD :], weights[:, :tail], out=prod)
            part = torch.sum(prod, dim=1, out=ws.tail)
        acc = part if acc is None else acc.add_(part)
    if acc is None:
        return out.zero_() if out is not None else torch.zeros(2, dtype=torch.int64, device=data.device)
    if out is not None:
        return torch.bitwise_and(acc, _MASK32, out=out)
    return acc.bitwise_and_(_MASK32)


def checksum_value(halves: tuple[int, int] | list[int] | torch.Tensor, nbytes: int) -> int:
    """Combine ``[hi, lo]`` into the 64-bit value ``tensor_checksum`` returns for ``nbytes`` bytes."""
    hi, lo = (int(x) for x in (halves.tolist() if isinstance(halves, torch.Tensor) else halves))
    return ((hi & _MASK32) << 32 | (lo & _MASK32)) ^ nbytes


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes in element order as a 1-D uint8 tensor (a view where the layout allows).

    ``contiguous()`` keeps the stride of a size-1 dimension, and a stride of 0 there (a scale built by
    ``expand``, as vLLM does for some) is refused by the byte view: such a tensor is copied first.
    """
    flat = t.detach().contiguous().reshape(-1)
    if flat.numel() and flat.stride(0) != 1:
        flat = flat.clone(memory_format=torch.contiguous_format)
    return flat.view(torch.uint8)


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as a 1-D uint8 tensor that starts on a word boundary (a view 2 bytes into its
    storage is copied: its words cannot be viewed in place)."""
    flat = raw_bytes(t)
    return flat.clone() if flat.storage_offset() % 4 else flat


def tensor_checksum(t: torch.Tensor) -> int:
    """The 64-bit checksum of a tensor's bytes (module docstring), any length, any device; one read pass,
    no int64 copy of the data, one read-back of two words."""
    flat = _flat_bytes(t)
    n = flat.numel()
    whole = n - n % 4
    hi, lo = bucket_checksum(flat[:whole]).tolist() if whole else (0, 0)
    if n % 4:
        # The last partial word, zero-padded (as tensor_checksum pads), at word index whole // 4.
        word = int.from_bytes(bytes(flat[whole:].cpu().tolist()), "little")
        hi = (hi + word) & _MASK32
        lo = (lo + word * ((whole // 4) % _PERIOD + 1)) & _MASK32
    return checksum_value((hi, lo), n)


@functools.cache
def _triton() -> bool:
    from weight_sync.quant.fp8_triton import triton_available

    return triton_available()


def tensor_checksums(tensors: list[torch.Tensor]) -> list[int]:
    """``[tensor_checksum(t) for t in tensors]`` with one read-back per device instead of one per tensor.

    Each tensor's two sums stay on its device until all of them are queued, so a model's hundreds of
    checksums pipeline on the device instead of waiting for each other (a fingerprint of a 399-tensor 8B
    model spent most of its time in those waits). On CUDA with Triton, all of a device's tensors go
    through one grouped kernel at memory speed (:mod:`weight_sync.checksum_triton`). Tensors whose
    length is not a multiple of 4 take :func:`tensor_checksum` (their last partial word is read on the
    host anyway).
    """
    out = [0] * len(tensors)
    pending: dict[torch.device, list[tuple[int, int, torch.Tensor]]] = {}
    grouped: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
    for i, t in enumerate(tensors):
        if t.is_cuda and t.is_contiguous():
            # Already its bytes in element order at its address (a contiguous tensor's size-1
            # dimensions never move it): no views to make, a few microseconds each over a model.
            nbytes = t.numel() * t.element_size()
            if nbytes and nbytes % 4 == 0 and t.data_ptr() % 4 == 0 and _triton():
                grouped.setdefault(t.device, []).append((i, t))
                continue
        flat = _flat_bytes(t)
        n = flat.numel()
        if n % 4 or n == 0:
            out[i] = tensor_checksum(t)
        elif flat.is_cuda and flat.data_ptr() % 4 == 0 and _triton():
            grouped.setdefault(flat.device, []).append((i, flat))
        else:
            pending.setdefault(flat.device, []).append((i, n, bucket_checksum(flat)))
    for group in grouped.values():
        # One Triton launch for all of a device's tensors (checksum_triton.py), bitwise the same sums.
        from weight_sync.checksum_triton import word_sums

        sums = word_sums([flat for _, flat in group]).tolist()
        for (i, flat), halves in zip(group, sums):
            out[i] = checksum_value(halves, flat.numel() * flat.element_size())
    for items in pending.values():
        halves = torch.stack([h for _, _, h in items]).tolist()
        for (i, n, _), (hi, lo) in zip(items, halves):
            out[i] = checksum_value((hi, lo), n)
    return out
