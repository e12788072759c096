"""The sender's batched native encode writes byte for byte what the per-tensor encoder writes, whatever the
ranges, densities, item sizes, chunk sizes and thread counts, and moves every base to its new tensor."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from weight_sync import native
from weight_sync.errors import LayoutMismatchError
from weight_sync.native import encode as native_encode
from weight_sync.transport.delta import encode_deltas
from weight_sync.transport.delta_cpu import encode_cpu

INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@pytest.fixture(autouse=True)
def kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WEIGHT_SYNC_NATIVE", "1")
    assert native.enabled(), "the native delta kernels must build on the CI machine (a C compiler is there)"


def _pairs(item: int, sizes: list[int], density: float, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(new, base) integer views: ``density`` of each tensor's elements changed (one byte flipped)."""
    rng = np.random.default_rng(seed)
    out = []
    for n in sizes:
        base = torch.from_numpy(rng.integers(0, 256, max(n, 1) * item, dtype=np.uint8)).view(INTS[item])[:n].clone()
        new = base.clone()
        hit = torch.from_numpy(rng.random(n) < density)
        new.view(torch.uint8).view(n, item)[hit, 0] ^= 0x5A
        out.append((new, base))
    return out


def _reference(pairs: list[tuple[torch.Tensor, torch.Tensor]], chunk: int) -> list[tuple[bytes, int]]:
    out = []
    for new, base in pairs:
        enc, _, k, _ = encode_cpu(new.numpy(), base.numpy().copy(), chunk, new.element_size(), positions=False)
        out.append((enc.tobytes(), k))
    return out


@pytest.mark.parametrize("item", [1, 2, 4, 8])
@pytest.mark.parametrize("chunk", [8, 64, 1000, 1 << 16])
@pytest.mark.parametrize("density", [0.0, 0.001, 0.02, 0.07, 0.4, 1.0])
def test_a_batch_encodes_every_tensor_as_the_per_tensor_encoder_does_and_moves_every_base(
    item: int, chunk: int, density: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Ranges of 2 Ki elements: large tensors span many ranges, and dense ones outgrow their scratch
    # (the rest of the range is scanned again as a range of its own).
    monkeypatch.setattr(native_encode, "RANGE_ELEMS", 2048)
    sizes = [0, 1, 7, chunk, chunk + 3, 5000, 3 * 4096 + 17, 20_000]
    pairs = _pairs(item, sizes, density, seed=item * 1000 + chunk)
    want = _reference(pairs, chunk)
    got = native_encode.encode_many(pairs, chunk, advance=True, arena=native.HostArena())
    assert [(enc.numpy().tobytes(), k) for enc, k in got] == want
    assert all(torch.equal(new, base) for new, base in pairs)


@pytest.mark.parametrize("threads", ["1", "2", "3"])
def test_a_batch_large_enough_for_threads_gives_the_same_bytes_on_any_thread_count(
    threads: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(native.THREADS_ENV, threads)
    monkeypatch.setattr(native, "PARALLEL_MIN_BYTES", 0)  # threads however small the work
    monkeypatch.setattr(native_encode, "RANGE_ELEMS", 1 << 16)
    pairs = _pairs(2, [300_000, 1024, 70_001, 0, 5], 0.02, seed=7)
    want = _reference(pairs, 1 << 16)
    got = native_encode.encode_many(pairs, 1 << 16, advance=False)
    assert [(enc.numpy().tobytes(), k) for enc, k in got] == want
    assert not any(torch.equal(new, base) for new, base in pairs[:3])  # no advance: the bases stay


def test_encode_deltas_takes_the_batch_for_host_pairs_and_keeps_its_results() -> None:
    pairs = [(new.view(torch.bfloat16).view(-1, 16), base.view(torch.bfloat16).view(-1, 16).clone())
             for new, base in _pairs(2, [4096, 16 * 999], 0.05, seed=3)]
    want = _reference([(new.reshape(-1).view(torch.int16), base.reshape(-1).view(torch.int16)) for new, base in pairs],
                      1 << 16)
    got = encode_deltas(pairs, advance=True, arena=native.HostArena())
    assert [(enc.numpy().tobytes(), k) for enc, k in got] == want
    # Compared as bytes: random bf16 bytes hold NaNs, which never equal themselves.
    assert all(new.numpy().tobytes() == base.view(torch.int16).numpy().tobytes() for new, base in
               ((n.view(torch.int16), b) for n, b in pairs))


def test_a_batch_refuses_views_it_cannot_scan_and_chunks_its_offsets_cannot_address() -> None:
    new, base = _pairs(2, [64], 0.5, seed=1)[0]
    with pytest.raises(LayoutMismatchError, match="65536"):
        native_encode.encode_many([(new, base)], 1 << 17, advance=False)
    with pytest.raises(LayoutMismatchError, match="contiguous CPU views"):
        native_encode.encode_many([(new[::2], base[::2])], 64, advance=False)
    with pytest.raises(LayoutMismatchError, match=r"int16 .* over torch.int32"):
        native_encode.encode_many([(new, base.view(torch.int32))], 64, advance=False)
    assert not torch.equal(new, base)  # refused before any scan: nothing moved
