"""Delta sync's native CPU kernels give exactly what their numpy twins give, and refuse what those refuse."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from weight_sync import native
from weight_sync.errors import LayoutMismatchError
from weight_sync.reload.delta_checksum import checksum_change_np as _checksum_change_np

INTS = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}


@pytest.fixture(autouse=True)
def kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WEIGHT_SYNC_NATIVE", "1")
    assert native.enabled(), "the native delta kernels must build on the CI machine (a C compiler is there)"


@pytest.fixture(params=["simd", "portable"])
def scan_kind(request: pytest.FixtureRequest) -> Iterator[str]:
    """The vector scan where this CPU has one, and the portable loops (both must agree)."""
    had = native.simd()
    if request.param == "simd" and not had:
        pytest.skip("this CPU has no vector scan (AVX-512 VBMI2 or AVX2): the portable scan is the only one")
    native.simd(request.param == "simd")
    try:
        yield request.param
    finally:
        native.simd(had)


def _pair(item: int, n: int, density: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, n * item, dtype=np.uint8).view(INTS[item])
    new = base.copy()
    hit = rng.random(n) < density
    new.view(np.uint8).reshape(n, item)[hit, 0] ^= 0x5A  # one byte of each chosen element flipped
    return new, base


@pytest.mark.parametrize("item", [1, 2, 4, 8])
@pytest.mark.parametrize("n, chunk", [(0, 64), (7, 8), (1000, 64), (70_001, 1 << 16), (5000, 1000), (300, 8)])
@pytest.mark.parametrize("density", [0.0, 0.001, 0.02, 0.3, 1.0])
def test_the_scan_finds_the_changed_positions_values_and_chunk_counts_numpy_finds(
    item: int, n: int, chunk: int, density: float, scan_kind: str
) -> None:
    new, base = _pair(item, n, density, seed=n + item)
    pos, vals, counts = native.delta_scan(new, base, chunk)
    want = np.flatnonzero(new != base)
    assert np.array_equal(pos, want)
    assert np.array_equal(vals, new[want])
    num_chunks = -(-n // chunk)
    assert np.array_equal(counts, np.diff(np.searchsorted(want, np.arange(num_chunks + 1) * chunk)))


@pytest.mark.parametrize("item", [1, 2, 4, 8])
@pytest.mark.parametrize("n, chunk", [(0, 64), (7, 8), (1000, 64), (200_001, 1 << 16), (5000, 1000)])
@pytest.mark.parametrize("density", [0.0, 0.02, 0.3, 1.0])
def test_the_offsets_scan_stores_each_change_as_its_encoded_16_bit_offset_and_moves_the_base_alike(
    item: int, n: int, chunk: int, density: float, scan_kind: str
) -> None:
    new, base = _pair(item, n, density, seed=n + 3 * item)
    pos, vals, counts = native.delta_scan(new, base.copy(), chunk)
    moved = base.copy()
    off, off_vals, off_counts = native.delta_scan(new, moved, chunk, advance=True, offsets=True)
    assert off.dtype == np.uint16
    assert np.array_equal(off, ((pos % chunk) ^ 0x8000).astype(np.uint16))  # offset - 32768 as int16 bits
    assert np.array_equal(off_vals, vals) and np.array_equal(off_counts, counts)
    assert np.array_equal(moved, new)


def test_the_offsets_scan_refuses_chunks_its_offsets_cannot_address() -> None:
    new, base = _pair(2, 10, 0.5, seed=1)
    with pytest.raises(LayoutMismatchError, match="65536"):
        native.delta_scan(new, base, (1 << 16) + 8, offsets=True)


@pytest.mark.parametrize("density", [0.001, 0.02, 0.6])
def test_the_scan_continues_in_a_larger_buffer_when_dense_and_advance_moves_the_base(
        scan_kind: str, density: float) -> None:
    # 60% changed: far beyond the first buffer's ~3%, so the scan stops at chunk boundaries and resumes.
    # Sparse: the vector scans skip unchanged groups, whose base bytes must already be the new ones.
    new, base = _pair(2, 300_000, density, seed=3)
    want = np.flatnonzero(new != base)
    pos, vals, _ = native.delta_scan(new, base, 1024, advance=True)
    assert np.array_equal(pos, want) and np.array_equal(vals, new[want])
    assert np.array_equal(base, new)  # the base is the new version now


@pytest.mark.parametrize("item", [1, 2, 4, 8])
@pytest.mark.parametrize("first", [0, 1, 3, 65521 + 5])
def test_a_scatter_writes_the_values_returns_the_old_ones_and_moves_the_checksum_as_numpy_does(
    item: int, first: int
) -> None:
    # ``first``: the destination's first element inside the checksummed tensor (a q slice of a qkv).
    byte_base = first * item
    rng = np.random.default_rng(item)
    dst = rng.integers(0, 256, 4096 * item, dtype=np.uint8).view(INTS[item])
    pos = np.sort(rng.choice(dst.size, 700, replace=False)).astype(np.int64)
    vals = rng.integers(0, 256, pos.size * item, dtype=np.uint8).view(INTS[item])
    want_dst = dst.copy()
    want_old = want_dst[pos].copy()
    want_dst[pos] = vals
    old, sums = native.scatter(dst, pos, vals, byte_base)
    assert np.array_equal(dst, want_dst) and np.array_equal(old, want_old)
    assert np.array_equal(sums, _checksum_change_np(pos * item + byte_base, want_old, vals, item))


def test_a_scatter_beyond_its_destination_or_of_other_values_is_refused_before_any_write() -> None:
    dst = np.arange(100, dtype=np.int16)
    with pytest.raises(LayoutMismatchError, match="outside the destination's 100 elements"):
        native.scatter(dst, np.array([3, 100], dtype=np.int64), np.array([7, 7], dtype=np.int16), 0)
    with pytest.raises(LayoutMismatchError, match="values of int32 for 2 positions of a int16"):
        native.scatter(dst, np.array([3, 4], dtype=np.int64), np.array([7, 7], dtype=np.int32), 0)
    with pytest.raises(LayoutMismatchError, match="1 values of int16 for 2 positions"):
        native.scatter(dst, np.array([3, 4], dtype=np.int64), np.array([7], dtype=np.int16), 0)
    assert np.array_equal(dst, np.arange(100, dtype=np.int16))


@pytest.mark.parametrize("off_bytes", [2, 4])
def test_index_chunks_decode_to_their_positions_and_bad_offsets_are_named(off_bytes: int) -> None:
    chunk = 1 << 16 if off_bytes == 2 else 1 << 17
    chunks = np.array([0, 3, 4], dtype=np.int64)
    within = [np.array([0, 5, chunk - 1]), np.array([17]), np.array([2, 3])]
    counts = np.array([w.size for w in within], dtype=np.int64)
    flat = np.concatenate(within)
    raw = ((flat - 32768).astype(np.int16) if off_bytes == 2 else flat.astype(np.int32)).view(np.uint8)
    want = np.concatenate([c * chunk + w for c, w in zip(chunks, within)])
    assert np.array_equal(native.index_positions(chunks, counts, raw, off_bytes, chunk), want)
    repeated = raw.copy().view(np.int16 if off_bytes == 2 else np.int32)
    repeated[1] = repeated[0]
    with pytest.raises(LayoutMismatchError, match="repeat or are out of order"):
        native.index_positions(chunks, counts, repeated.view(np.uint8), off_bytes, chunk)
    if off_bytes == 4:
        outside = raw.copy().view(np.int32)
        outside[3] = chunk  # one past the chunk's end
        with pytest.raises(LayoutMismatchError, match="outside its chunk"):
            native.index_positions(chunks, counts, outside.view(np.uint8), off_bytes, chunk)


def test_bitmask_chunks_decode_to_their_positions_and_a_miscounted_mask_is_refused() -> None:
    chunk = 64
    rng = np.random.default_rng(5)
    masks = rng.random(3 * chunk) < 0.3
    bits = np.packbits(masks, bitorder="little")
    chunks = np.array([1, 4, 9], dtype=np.int64)
    hit = np.flatnonzero(masks)
    want = chunks[hit // chunk] * chunk + hit % chunk
    assert np.array_equal(native.bitmask_positions(bits, chunks, chunk, int(masks.sum())), want)
    with pytest.raises(LayoutMismatchError, match="changed positions but"):
        native.bitmask_positions(bits, chunks, chunk, int(masks.sum()) - 1)  # one bit more than counted


def test_without_a_compiler_or_when_turned_off_the_numpy_paths_are_used(tmp_path) -> None:
    code = "from weight_sync import native; print(native.enabled())"
    env = {**os.environ, "WEIGHT_SYNC_NATIVE_CACHE": str(tmp_path), "CC": "/bin/false"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False" and not list(tmp_path.glob("*.so"))
    env = {**os.environ, "WEIGHT_SYNC_NATIVE": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_a_scatter_of_tensors_gives_what_the_scatter_of_arrays_gives_and_refuses_the_same_input() -> None:
    rng = np.random.default_rng(5)
    dst = rng.integers(0, 256, 8192, dtype=np.uint8).view(np.int16)
    pos = np.sort(rng.choice(dst.size, 500, replace=False)).astype(np.int64)
    vals = rng.integers(0, 256, pos.size * 2, dtype=np.uint8).view(np.int16)
    t_dst, orig = torch.from_numpy(dst.copy()), dst.copy()
    want_old, want_sums = native.scatter(dst, pos, vals, 6)
    old, sums = native.scatter_tensors(t_dst, torch.from_numpy(pos), torch.from_numpy(vals), 6)
    assert np.array_equal(t_dst.numpy(), dst) and np.array_equal(old.numpy(), want_old)
    assert sums.tolist() == want_sums.tolist()
    # Strided positions and values are read as their elements, not their storage.
    t_dst2 = torch.from_numpy(dst.copy())
    wide_pos = torch.stack([torch.from_numpy(pos), torch.zeros(pos.size, dtype=torch.int64)], 1)[:, 0]
    wide_vals = torch.stack([torch.zeros(pos.size, dtype=torch.int16), torch.from_numpy(want_old)], 1)[:, 1]
    native.scatter_tensors(t_dst2, wide_pos, wide_vals, 6)  # writes the old values back
    assert not wide_pos.is_contiguous() and np.array_equal(t_dst2.numpy(), orig)
    before = t_dst2.clone()
    with pytest.raises(LayoutMismatchError, match="outside the destination's 4096 elements"):
        native.scatter_tensors(t_dst2, torch.tensor([3, 4096]), torch.tensor([7, 7], dtype=torch.int16), 0)
    with pytest.raises(LayoutMismatchError, match=r"values of torch\.int32 for 2 positions"):
        native.scatter_tensors(t_dst2, torch.tensor([3, 4]), torch.tensor([7, 7], dtype=torch.int32), 0)
    with pytest.raises(LayoutMismatchError, match="flat and contiguous"):
        native.scatter_tensors(t_dst2.view(64, 64).t(), torch.tensor([3]), torch.tensor([7], dtype=torch.int16), 0)
    assert torch.equal(t_dst2, before)


def _index_encoding(n: int, chunk: int, density: float, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(positions, chunks, counts, 16-bit offsets) of random changes of ``n`` elements, index-encoded."""
    rng = np.random.default_rng(seed)
    pos = np.flatnonzero(rng.random(n) < density)
    per = np.bincount(pos // chunk, minlength=-(-n // chunk))
    chunks = np.flatnonzero(per)
    offsets = ((pos % chunk) - 32768).astype(np.int16)
    return pos, chunks, per[chunks], offsets


@pytest.mark.parametrize("item", [1, 2, 4, 8])
@pytest.mark.parametrize("n, chunk, density", [(0, 64, 0.0), (5000, 1000, 0.02), (300_000, 1 << 16, 0.05),
                                               (70_001, 1 << 16, 0.9), (3000, 64, 0.0)])
@pytest.mark.parametrize("byte_base", [24, 26, 27, (1 << 34) + 65521 * 4 - 2])
def test_a_scatter_from_offsets_writes_and_moves_the_checksum_as_a_scatter_from_positions(
    item: int, n: int, chunk: int, density: float, byte_base: int, scan_kind: str
) -> None:
    # The byte bases put the tensor at every position in a checksum word, and one just below a multiple
    # of the weights' modulus (65521) far into a large model: the 16-bit path's running word modulus.
    rng = np.random.default_rng(n + item)
    dst = rng.integers(0, 256, n * item, dtype=np.uint8).view(INTS[item])
    pos, chunks, counts, offsets = _index_encoding(n, chunk, density, seed=n)
    vals = rng.integers(0, 256, pos.size * item, dtype=np.uint8).view(INTS[item])
    want = dst.copy()
    _, want_sums = native.scatter(want, pos, vals, byte_base)
    got = torch.from_numpy(dst.copy())
    batch = native.OffsetBatch()
    batch.add("w", got, chunks, counts, offsets, chunk, torch.from_numpy(vals), byte_base)
    batch.check()
    (sums,) = batch.scatter()
    assert np.array_equal(got.numpy(), want)
    assert isinstance(sums, torch.Tensor) and sums.tolist() == want_sums.tolist()


def _offset_batch(seed: int, bad: int | None = None, table: bool = False
                  ) -> tuple[native.OffsetBatch, list[torch.Tensor], list[np.ndarray], list[np.ndarray]]:
    """A batch of 12 index-only encodings of every item size (the ``bad``-th one's offsets repeating):
    the batch, its destinations, what each should hold after its write, and its checksum move. ``table``:
    added together as arrays (``add_table``, chunks of 4 Ki: an encoding spans up to 49 chunks, which
    the caller may cut into pieces), else one by one."""
    rng = np.random.default_rng(seed)
    batch, dsts, wants, sums = native.OffsetBatch(), [], [], []
    chunk = 4096 if table else 1 << 16
    rows: list[tuple[int, ...]] = []
    all_counts: list[np.ndarray] = []
    keep: list[object] = []
    for i in range(12):
        item, n = (1, 2, 4, 8)[i % 4], int(rng.integers(1000, 200_000))
        pos, chunks, counts, offsets = _index_encoding(n, chunk, 0.03, seed=seed + i)
        if i == bad:
            offsets[1] = offsets[0]
        dst = rng.integers(0, 256, n * item, dtype=np.uint8).view(INTS[item])
        vals = rng.integers(0, 256, pos.size * item, dtype=np.uint8).view(INTS[item])
        want = dst.copy()
        _, moved = native.scatter(want, pos, vals, 8 * i)
        dsts.append(torch.from_numpy(dst))
        wants.append(want)
        sums.append(np.asarray(moved))
        if not table:
            batch.add(f"layers.{i}.weight", dsts[-1], chunks, counts, offsets, chunk, torch.from_numpy(vals), 8 * i)
            continue
        every = np.zeros(-(-n // chunk), dtype=np.int64)  # a count for every chunk, 0 where unchanged
        every[chunks] = counts
        rows.append((dst.ctypes.data, n, sum(c.size for c in all_counts), every.size, offsets.ctypes.data,
                     vals.ctypes.data, item, 8 * i))
        all_counts.append(every)
        keep += [offsets, vals]
    if table:
        r = np.array(rows, dtype=np.int64)
        batch.add_table([f"layers.{i}.weight" for i in range(12)], r[:, 0], r[:, 1], np.concatenate(all_counts),
                        r[:, 2], r[:, 3], np.full(12, chunk), r[:, 4], r[:, 5], r[:, 6], r[:, 7], keep)
    return batch, dsts, wants, sums


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("table", [False, True])
def test_a_batch_of_encodings_is_written_on_threads_as_each_is_written_alone(
    threads: int, table: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(native.THREADS_ENV, str(threads))
    monkeypatch.setattr(native, "PARALLEL_MIN_BYTES", 0)  # small work on the threads too
    monkeypatch.setattr(native, "PIECE_CHUNKS", 4)  # encodings of up to 49 chunks cut into pieces of 4
    batch, dsts, wants, sums = _offset_batch(seed=5, table=table)
    batch.check()
    moves = batch.scatter()
    for dst, want, moved, got in zip(dsts, wants, sums, moves):
        assert np.array_equal(dst.numpy(), want)
        assert isinstance(got, torch.Tensor) and got.tolist() == moved.tolist()


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("table", [False, True])
def test_a_batch_names_its_damaged_encoding_and_its_scatter_writes_only_the_sound_ones(
    threads: int, table: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(native.THREADS_ENV, str(threads))
    monkeypatch.setattr(native, "PARALLEL_MIN_BYTES", 0)
    monkeypatch.setattr(native, "PIECE_CHUNKS", 4)
    batch, dsts, wants, _ = _offset_batch(seed=9, bad=7, table=table)
    before = [d.clone() for d in dsts]
    with pytest.raises(LayoutMismatchError, match=r"layers\.7\.weight: .*repeat or are out of order"):
        batch.check()
    assert all(torch.equal(d, b) for d, b in zip(dsts, before)), "a check writes nothing"
    moves = batch.scatter()
    assert isinstance(moves[7], LayoutMismatchError) and "layers.7.weight" in str(moves[7])
    # Its damaged piece writes nothing (an encoding cut into pieces may have its other pieces written:
    # the engine tears its layer, as for any failed write without rollback).
    untouched = 4 * 4096 if table else None  # the first piece: 4 chunks of 4 Ki elements
    assert torch.equal(dsts[7][:untouched], before[7][:untouched])
    for i, (dst, want) in enumerate(zip(dsts, wants)):
        if i != 7:
            assert np.array_equal(dst.numpy(), want), i


@pytest.mark.parametrize("damage, message", [("outside", "outside its chunk"), ("repeat", "repeat"),
                                             ("beyond", "beyond the tensor")])
def test_a_scatter_from_offsets_refuses_a_damaged_encoding_and_writes_nothing(damage: str, message: str) -> None:
    pos, chunks, counts, offsets = _index_encoding(5000, 1000, 0.05, seed=1)
    n = 5000
    if damage == "outside":
        offsets[3] = np.int16(1500 - 32768)  # a chunk of 1000 elements has no offset 1500
    elif damage == "repeat":
        offsets[4] = offsets[3]
    else:
        n = int(pos[-1])  # the last change lies one past the tensor's end
    dst = torch.zeros(5000, dtype=torch.int16)
    vals = torch.ones(pos.size, dtype=torch.int16)
    batch = native.OffsetBatch()
    batch.add("w", dst[:n], chunks, counts, offsets, 1000, vals, 0)
    with pytest.raises(LayoutMismatchError, match=message):
        batch.check()
    (refused,) = batch.scatter()  # the write checks again, and writes nothing of a refused encoding
    assert isinstance(refused, LayoutMismatchError) and message in str(refused)
    assert not dst.any()


@pytest.mark.parametrize("item", [1, 2, 4, 8])
@pytest.mark.parametrize("chunk", [8, 64, 1000, 1 << 16, 1 << 17])
def test_the_forms_kernel_picks_every_chunks_form_as_the_format_does(item: int, chunk: int) -> None:
    from weight_sync.transport.delta_format import _offset_bytes, forms_of_sizes

    rng = np.random.default_rng(chunk + item)
    numel = 37 * chunk - chunk // 3  # a short last chunk
    nchunks = -(-numel // chunk)
    sizes = np.full(nchunks, chunk, dtype=np.int64)
    sizes[-1] = numel - (nchunks - 1) * chunk
    # Counts from none to every element, and the counts where two forms cost the same (ties).
    ob = _offset_bytes(chunk)
    ties = [(chunk * item) // (ob + item), (chunk // 8) // ob, 0, 1, chunk]
    counts = np.minimum(np.concatenate([rng.integers(0, chunk + 1, nchunks - len(ties)), ties]), sizes)
    assert np.array_equal(native.forms(counts, chunk, numel, item, ob), forms_of_sizes(counts, sizes, chunk, item))
