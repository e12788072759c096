"""Delta encoding: applying a tensor's encoding to its base gives the new tensor bit for bit, and the
encoding is never larger than sending the tensor plain (plus its small header and table)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("hypothesis")  # the device machine runs GPU tests without it
from hypothesis import given, settings
from hypothesis import strategies as st

from weight_sync.errors import ConfigError, LayoutMismatchError
from weight_sync.transport.delta import (
    FORM_BITMASK,
    FORM_INDEX,
    FORM_PLAIN,
    FORM_SAME,
    apply_delta_,
    changed_mask,
    delta_stats,
    encode_delta,
)

# Every test here runs with the native CPU kernels and with their numpy twins (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("cpu_delta_kernels")
DTYPES = [torch.bfloat16, torch.float32, torch.float16]
PATTERNS = ["empty", "one", "block", "dense", "all", "random"]
_INT = {2: torch.int16, 4: torch.int32}


def _changed(base: torch.Tensor, pattern: str, seed: int, density: float) -> torch.Tensor:
    """A copy of ``base`` with the elements of ``pattern`` given new random bytes (some may repeat)."""
    g = torch.Generator().manual_seed(seed)
    n = base.numel()
    mask = torch.zeros(n, dtype=torch.bool)
    if pattern == "one" and n:
        mask[int(torch.randint(n, (1,), generator=g))] = True
    elif pattern == "block" and n:
        start = int(torch.randint(n, (1,), generator=g))
        mask[start : start + 300] = True
    elif pattern == "dense":
        mask = torch.rand(n, generator=g) < 0.9
    elif pattern == "all":
        mask[:] = True
    elif pattern == "random":
        mask = torch.rand(n, generator=g) < density
    new = base.clone()
    ints = new.view(_INT[base.dtype.itemsize]).reshape(-1)
    info = torch.iinfo(ints.dtype)
    ints[mask] = torch.randint(info.min, info.max, (int(mask.sum()),), generator=g, dtype=torch.int64).to(ints.dtype)
    return new


def _pair(dtype: torch.dtype, pattern: str, numel: int, density: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A random base of ``numel`` elements and a copy of it changed by ``pattern``."""
    base = torch.randn(numel, generator=torch.Generator().manual_seed(seed)).to(dtype)
    return base, _changed(base, pattern, seed + 1, density)


# Random change patterns over tensors of every size, chunk size and dtype (one strategy, many tests).
random_changes = given(
    dtype=st.sampled_from(DTYPES),
    pattern=st.sampled_from(PATTERNS),
    numel=st.integers(0, 5000),
    chunk_elems=st.sampled_from([8, 64, 1000, 1024, 1 << 16, 1 << 17, 3 * (1 << 16) + 8]),
    density=st.floats(0.0, 0.3),
    seed=st.integers(0, 2**16),
)


@settings(max_examples=60, deadline=None)
@random_changes
def test_applying_an_encoding_to_its_base_gives_the_new_tensor_bit_for_bit(
    dtype: torch.dtype, pattern: str, numel: int, chunk_elems: int, density: float, seed: int
) -> None:
    base, new = _pair(dtype, pattern, numel, density, seed)
    enc = encode_delta(new, base, chunk_elems=chunk_elems)
    target = base.clone()
    positions = apply_delta_(target, enc)
    assert torch.equal(target.view(_INT[dtype.itemsize]), new.view(_INT[dtype.itemsize]))
    assert torch.equal(positions, torch.nonzero(changed_mask(new, base)).reshape(-1))
    stats = delta_stats(enc, numel, dtype)
    num_chunks = -(-numel // chunk_elems)
    # Never more than plain bytes, plus the fixed header and table (and 8-byte alignment of 6 regions).
    assert stats.nbytes <= stats.plain_nbytes + 16 + 8 * num_chunks + 6 * 8
    assert sum(stats.chunks) == num_chunks


def test_a_two_dimensional_tensor_is_encoded_by_its_flat_elements() -> None:
    base = torch.randn(300, 70).to(torch.bfloat16)
    new = base.clone()
    new[17, 3] += 1
    target = base.clone()
    assert apply_delta_(target, encode_delta(new, base)).tolist() == [17 * 70 + 3]
    assert torch.equal(target, new)


def test_negative_zero_and_nan_payloads_count_as_changes_and_an_unchanged_nan_does_not() -> None:
    base = torch.tensor([0.0, float("nan"), float("nan"), 1.0])
    new = base.clone()
    new[0] = -0.0
    new.view(torch.int32)[1] = 0x7FC00001  # another NaN payload
    assert changed_mask(new, base).tolist() == [True, True, False, False]
    target = base.clone()
    apply_delta_(target, encode_delta(new, base))
    assert torch.equal(target.view(torch.int32), new.view(torch.int32))


def test_each_chunk_picks_the_smallest_form_and_dense_chunks_go_plain() -> None:
    base = torch.zeros(4 * 1024, dtype=torch.bfloat16)
    new = base.clone()
    new[1024 + 5] = 1.0  # chunk 1: one change -> index
    new[2048 : 2048 + 400 : 2] = 1.0  # chunk 2: 200 changes -> bitmask (128 B + 400 B < 200 * 4 B)
    new[3072:] = 1.0  # chunk 3: every element -> plain
    stats = delta_stats(encode_delta(new, base, chunk_elems=1024), new.numel(), new.dtype)
    assert stats.chunks == (1, 1, 1, 1)
    assert stats.num_changed == 1 + 200 + 1024
    from weight_sync.transport import delta

    forms = delta._parse(encode_delta(new, base, chunk_elems=1024), new.numel(), new.dtype).form.tolist()
    assert forms == [FORM_SAME, FORM_INDEX, FORM_BITMASK, FORM_PLAIN]


def test_a_payload_for_another_tensor_is_refused_naming_what_differs() -> None:
    base = torch.randn(100)
    enc = encode_delta(base + 1, base)
    with pytest.raises(LayoutMismatchError, match="item size"):
        apply_delta_(torch.zeros(100, dtype=torch.bfloat16), enc)
    with pytest.raises(LayoutMismatchError, match="chunks"):
        apply_delta_(torch.zeros(1 << 17), enc)
    with pytest.raises(LayoutMismatchError, match="must match"):
        encode_delta(base, base[:10])
    with pytest.raises(ConfigError, match="chunk_elems"):
        encode_delta(base, base, chunk_elems=12)


def test_a_payload_with_a_repeated_index_offset_is_refused_before_any_write() -> None:
    base = torch.zeros(100)
    new = base.clone()
    new[[3, 40]] = 1.0  # one index chunk: int16 offsets at bytes 24..28 (header 16 + table 8)
    enc = encode_delta(new, base)
    enc[26:28] = enc[24:26]  # offset 40 -> 3
    target = base.clone()
    with pytest.raises(LayoutMismatchError, match="repeat"):
        apply_delta_(target, enc)
    assert torch.equal(target, base)


@settings(max_examples=60, deadline=None)
@random_changes
def test_the_cpu_encoder_writes_the_same_bytes_as_the_torch_encoder_cuda_senders_run(
    dtype: torch.dtype, pattern: str, numel: int, chunk_elems: int, density: float, seed: int
) -> None:
    # A CPU sender (numpy) and a CUDA sender (torch ops) must put the same bytes on the wire: receivers
    # decode either, and a sender may move between them.
    from weight_sync.transport.delta import _encode_torch, encode_delta_with_positions

    base, new = _pair(dtype, pattern, numel, density, seed)
    enc, pos = encode_delta_with_positions(new, base, chunk_elems=chunk_elems)
    ints = _INT[dtype.itemsize]
    enc_t, pos_t = _encode_torch(new.view(ints), base.view(ints), chunk_elems, dtype.itemsize)
    assert torch.equal(enc, enc_t)
    assert torch.equal(pos, pos_t)


@settings(max_examples=40, deadline=None)
@random_changes
def test_a_group_encoded_together_writes_each_tensors_own_bytes_and_moves_every_base(
    dtype: torch.dtype, pattern: str, numel: int, chunk_elems: int, density: float, seed: int
) -> None:
    # CUDA senders encode a group of tensors laid out chunk-aligned in one buffer, with one read-back
    # for the whole group; each tensor's bytes must be what it gets encoded alone, and with advance
    # every base must end up equal to its new tensor.
    from weight_sync.transport.delta import encode_delta_with_positions
    from weight_sync.transport.delta_encode_group import encode_group

    pairs = [_pair(dtype, pattern, numel, density, seed), _pair(dtype, "random", 3000, 0.2, seed + 7),
             _pair(dtype, "empty", 0, 0.0, seed), _pair(dtype, "all", 65, 0.0, seed + 3),
             _pair(dtype, "random", 2 * chunk_elems + 5, 0.6, seed + 11)]
    bases = [base.clone() for base, _ in pairs]
    group = encode_group([(new, b) for (_, new), b in zip(pairs, bases)], chunk_elems, advance=True)
    for (base, new), (enc_g, changed), moved in zip(pairs, group, bases, strict=True):
        enc, pos = encode_delta_with_positions(new, base, chunk_elems=chunk_elems)
        assert torch.equal(enc_g, enc)
        assert changed == pos.numel()
        assert torch.equal(moved.view(_INT[dtype.itemsize]), new.view(_INT[dtype.itemsize]))


@pytest.mark.parametrize("threads", ["1", "2", "3"])
def test_host_tensors_encoded_on_threads_into_an_arena_give_each_tensors_own_bytes_and_move_every_base(
        threads: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # A CPU sender encodes its tensors on several threads (largest first), the encodings written into
    # the memory it keeps across updates: the bytes must be what each tensor gets encoded alone, in the
    # caller's order, and every base must be the new tensor afterwards, update after update.
    from weight_sync import native
    from weight_sync.native import HostArena
    from weight_sync.transport.delta import encode_delta_with_positions, encode_deltas

    monkeypatch.setenv("WEIGHT_SYNC_NATIVE_THREADS", threads)
    monkeypatch.setattr(native, "PARALLEL_MIN_BYTES", 0)  # threads for these small tensors too
    arena = HostArena()
    specs = [(torch.bfloat16, "random", 70_000, 0.02), (torch.float32, "one", 10, 0.0),
             (torch.bfloat16, "empty", 0, 0.0), (torch.float16, "dense", 3000, 0.0),
             (torch.bfloat16, "random", 200_001, 0.3), (torch.bfloat16, "empty", 5000, 0.0)]
    bases = [_pair(dtype, "empty", n, 0.0, seed=i)[0] for i, (dtype, _, n, _) in enumerate(specs)]
    kept = [b.clone() for b in bases]
    for update in range(3):
        news = [_changed(b, pattern, 10 * update + i, density) for i, (b, (_, pattern, _, density))
                in enumerate(zip(kept, specs))]
        arena.reset()
        got = encode_deltas(list(zip(news, kept)), chunk_elems=1 << 16, advance=True, arena=arena)
        for i, (new, base, (enc, changed)) in enumerate(zip(news, bases, got, strict=True)):
            want, pos = encode_delta_with_positions(new, base, chunk_elems=1 << 16)
            assert torch.equal(enc, want), f"update {update}, tensor {i}"
            assert changed == pos.numel()
            assert torch.equal(kept[i].view(_INT[new.dtype.itemsize]), new.view(_INT[new.dtype.itemsize]))
            apply_delta_(base, enc, positions=False)
        assert arena.nbytes or update == 0  # the arena kept the first update's encodings' size


def test_a_group_with_host_bases_moves_only_the_changed_elements_of_each() -> None:
    # A CUDA sender with a pinned base reads the group's changes back once and writes each base's
    # share on the host: positions are in the group's chunk-aligned layout, base i from at[i].
    from weight_sync.transport.delta_encode_group import _scatter_changed

    bases = [torch.zeros(5, dtype=torch.bfloat16), torch.zeros(0, dtype=torch.bfloat16), torch.zeros(3, dtype=torch.bfloat16)]
    vals = torch.tensor([1.0, 2.0, 3.0], dtype=torch.bfloat16).view(torch.int16).numpy()
    _scatter_changed(bases, [0, 8, 8], np.array([1, 4, 10]), vals)
    assert bases[0].tolist() == [0.0, 1.0, 0.0, 0.0, 2.0]
    assert bases[2].tolist() == [0.0, 0.0, 3.0]
    with pytest.raises(LayoutMismatchError, match="contiguous"):
        _scatter_changed([torch.zeros(4, 2).t()], [0], np.array([0]), vals[:1])


@settings(max_examples=60, deadline=None)
@random_changes
def test_the_torch_decoder_cuda_receivers_run_finds_the_positions_the_cpu_decoder_finds(
    dtype: torch.dtype, pattern: str, numel: int, chunk_elems: int, density: float, seed: int
) -> None:
    from weight_sync.transport.delta import _parse, _sparse_positions_torch
    from weight_sync.transport.delta_cpu import sparse_positions_cpu as _sparse_positions_cpu

    base, new = _pair(dtype, pattern, numel, density, seed)
    enc = encode_delta(new, base, chunk_elems=chunk_elems)
    parsed = _parse(enc, numel, dtype)
    for ours, theirs in zip(_sparse_positions_torch(parsed, numel, torch.device("cpu")),
                            _sparse_positions_cpu(parsed, numel)):
        assert torch.equal(ours, theirs)


@pytest.mark.parametrize("decoder", ["cpu", "torch"])
def test_both_decoders_refuse_repeated_offsets_and_positions_beyond_the_tensor(decoder: str) -> None:
    from weight_sync.transport.delta import _parse, _sparse_positions_torch
    from weight_sync.transport.delta_cpu import sparse_positions_cpu as _sparse_positions_cpu

    def positions(enc: torch.Tensor, numel: int) -> None:
        parsed = _parse(enc, numel, torch.float32)
        if decoder == "cpu":
            _sparse_positions_cpu(parsed, numel)
        else:
            _sparse_positions_torch(parsed, numel, torch.device("cpu"))

    base = torch.zeros(100)
    new = base.clone()
    new[[3, 40]] = 1.0  # one index chunk: int16 offsets at bytes 24..28 (header 16 + table 8)
    enc = encode_delta(new, base)
    repeated = enc.clone()
    repeated[26:28] = repeated[24:26]  # offset 40 -> 3
    with pytest.raises(LayoutMismatchError, match="repeat"):
        positions(repeated, 100)
    beyond = enc.clone()
    beyond[26:28] = torch.tensor([99 - 32768], dtype=torch.int16).view(torch.uint8)  # offset 40 -> 99 (of 100)
    positions(beyond, 100)  # the last element: fine
    beyond[26:28] = torch.tensor([100 - 32768], dtype=torch.int16).view(torch.uint8)
    with pytest.raises(LayoutMismatchError, match="beyond"):
        positions(beyond, 100)


def _bitmask_payload() -> torch.Tensor:
    """The encoding of 64 float32 elements, 10 of them changed: one chunk in bitmask form, its 8 bytes
    of bits at payload bytes 24..32 (header 16 + table 8)."""
    base = torch.zeros(64)
    new = base.clone()
    new[torch.arange(0, 60, 6)] = 1.0
    enc = encode_delta(new, base, chunk_elems=64)
    assert delta_stats(enc, 64, torch.float32).chunks == (0, 1, 0, 0)
    return enc


@pytest.mark.parametrize("deferred", [False, True])
def test_the_torch_decoder_refuses_bitmasks_whose_count_differs_from_their_table(deferred: bool) -> None:
    from weight_sync.transport.delta import _parse, _sparse_positions_torch, raise_failed

    enc = _bitmask_payload()
    bad = enc.clone()
    bad[24] |= 2  # element 1 was not changed: one bit more than the table's 10
    parsed = _parse(bad, 64, torch.float32)
    with pytest.raises(LayoutMismatchError, match="different number of changes than the table's 10"):
        if deferred:
            checks: list = []
            _sparse_positions_torch(parsed, 64, torch.device("cpu"), checks)
            raise_failed(checks)  # nothing raised before: the caller reads the checks back
        else:
            _sparse_positions_torch(parsed, 64, torch.device("cpu"))


def test_deferred_checks_are_all_raised_later_and_a_good_payload_passes_them() -> None:
    from weight_sync.transport.delta import _parse, _sparse_positions_torch, raise_failed

    enc = _bitmask_payload()
    checks: list = []
    bpos, ipos = _sparse_positions_torch(_parse(enc, 64, torch.float32), 64, torch.device("cpu"), checks)
    assert checks  # the decode's checks were handed over, not read back
    raise_failed(checks)
    assert torch.equal(bpos, torch.arange(0, 60, 6)) and not ipos.numel()


def test_a_table_naming_an_unknown_chunk_form_is_refused() -> None:
    from weight_sync.transport.delta import decode_delta

    bad = _bitmask_payload().clone()
    bad[16:20] = torch.tensor([7], dtype=torch.int32).view(torch.uint8)  # the first chunk's form
    with pytest.raises(LayoutMismatchError, match=r"chunk form outside 0\.\.3"):
        decode_delta(bad, 64, torch.float32)


def test_headers_read_ahead_for_a_bucket_decode_as_the_payloads_own() -> None:
    from weight_sync.transport.delta import decode_delta, read_heads

    pairs = [_pair(torch.bfloat16, pattern, numel, 0.05, seed)
             for seed, (pattern, numel) in enumerate([("random", 70000), ("one", 10), ("empty", 3)])]
    encs = [encode_delta(new, base) for base, new in pairs]
    heads = read_heads([(enc, base.numel()) for enc, (base, _) in zip(encs, pairs)])
    for enc, (base, _), head in zip(encs, pairs, heads):
        ahead = decode_delta(enc, base.numel(), base.dtype, head=head)
        own = decode_delta(enc, base.numel(), base.dtype)
        assert all(torch.equal(a, b) for a, b in zip(ahead, own))
    with pytest.raises(LayoutMismatchError, match="header bytes"):
        decode_delta(encs[0], pairs[0][0].numel(), torch.bfloat16, head=heads[0][:8])


@settings(max_examples=40, deadline=None)
@random_changes
def test_a_bucket_decoded_together_gives_each_payloads_own_changes(
    dtype: torch.dtype, pattern: str, numel: int, chunk_elems: int, density: float, seed: int
) -> None:
    # CUDA engines decode a bucket's payloads with one set of launches (here on CPU, same code): each
    # payload's positions and values must be those it decodes to alone, whatever forms its chunks took.
    from weight_sync.transport.delta import decode_delta, raise_failed
    from weight_sync.transport.delta_batch import decode_together

    pairs = [_pair(dtype, pattern, numel, density, seed), _pair(dtype, "random", 3000, 0.04, seed + 1),
             _pair(dtype, "one", 70, 0.0, seed + 2), _pair(dtype, "empty", 0, 0.0, seed),
             _pair(dtype, "random", 200, 0.5, seed + 3)]
    encs = [(encode_delta(new, base, chunk_elems=ce), base.numel(), dtype)
            for (base, new), ce in zip(pairs, [chunk_elems, chunk_elems, 64, chunk_elems, 1024])]
    checks: list = []
    together = decode_together(encs, torch.device("cpu"), checks)
    raise_failed(checks)
    for (enc, n, dt), (pos, vals) in zip(encs, together, strict=True):
        want_pos, want_vals = decode_delta(enc, n, dt)
        assert torch.equal(pos, want_pos) and torch.equal(vals, want_vals)


def _same_parse(a: Any, b: Any) -> bool:
    return ((a.chunk_elems, a.num_chunks, a.n_plain_chunks, a.n_bits, a.n_index)
            == (b.chunk_elems, b.num_chunks, b.n_plain_chunks, b.n_bits, b.n_index)
            and np.array_equal(a.form, b.form) and np.array_equal(a.counts, b.counts)
            and all(x.data_ptr() == y.data_ptr() and x.numel() == y.numel() and x.dtype == y.dtype
                    for x, y in zip(a.regions, b.regions, strict=True)))


@settings(max_examples=40, deadline=None)
@random_changes
def test_a_bucket_parsed_together_gives_each_payload_its_own_parse(
    dtype: torch.dtype, pattern: str, numel: int, chunk_elems: int, density: float, seed: int
) -> None:
    # An engine reads the headers and tables of a bucket's payloads in one numpy pass: every field and
    # region of each payload must be what parsing it alone gives, other chunk sizes included.
    from weight_sync.transport.delta import _parse
    from weight_sync.transport.delta_batch import parse_many

    pairs = [_pair(dtype, pattern, numel, density, seed), _pair(dtype, "random", 3000, 0.04, seed + 1),
             _pair(dtype, "empty", 0, 0.0, seed), _pair(dtype, "dense", 200, 0.0, seed + 3)]
    items = [(encode_delta(new, base, chunk_elems=ce), base.numel(), dtype)
             for (base, new), ce in zip(pairs, [chunk_elems, 1 << 16, chunk_elems, 64])]
    for got, (enc, n, dt) in zip(parse_many(items), items, strict=True):
        assert _same_parse(got, _parse(enc, n, dt))


@pytest.mark.parametrize("damage", ["magic", "item size", "form", "length", "chunks"])
def test_a_damaged_header_in_a_bucket_parsed_together_is_refused_by_its_own_message(damage: str) -> None:
    from weight_sync.transport.delta_batch import parse_many

    good = _pair(torch.float32, "random", 5000, 0.01, 1)
    base = torch.zeros(100)
    new = base.clone()
    new[[3, 40]] = 1.0
    bad, numel, dtype = encode_delta(new, base).clone(), 100, torch.float32
    if damage == "magic":
        bad[0] ^= 1
    elif damage == "item size":
        dtype = torch.bfloat16
    elif damage == "form":
        bad[16:20] = torch.tensor([7], dtype=torch.int32).view(torch.uint8)
    elif damage == "length":
        bad = torch.cat([bad, torch.zeros(8, dtype=torch.uint8)])
    else:
        numel = 70_000  # two chunks' worth of elements, a table of one
    items = [(encode_delta(good[1], good[0]), 5000, torch.float32), (bad, numel, dtype)]
    with pytest.raises(LayoutMismatchError):
        parse_many(items)


@pytest.mark.parametrize("damage", ["bit", "repeat", "beyond"])
def test_a_bad_payload_in_a_bucket_is_refused_by_name_of_its_problem(damage: str) -> None:
    from weight_sync.transport.delta_batch import decode_deltas, decode_together

    good = _pair(torch.float32, "random", 5000, 0.01, 1)
    enc_good = encode_delta(good[1], good[0])
    if damage == "bit":
        bad, numel, message = _bitmask_payload().clone(), 64, "different number of changes"
        bad[24] |= 2
    else:
        base = torch.zeros(100)
        new = base.clone()
        new[[3, 40]] = 1.0  # one index chunk: int16 offsets at bytes 24..28
        bad, numel = encode_delta(new, base), 100
        if damage == "repeat":
            bad[26:28] = bad[24:26]
            message = "repeat"
        else:
            bad[26:28] = torch.tensor([100 - 32768], dtype=torch.int16).view(torch.uint8)
            message = "beyond"
    items = [(enc_good, 5000, torch.float32), (bad, numel, torch.float32)]
    checks: list = []
    decode_together(items, torch.device("cpu"), checks)
    failed = torch.stack([c for c, _ in checks]).tolist()
    assert any(f and message in m for f, (_, m) in zip(failed, checks))
    # On CPU each payload decodes alone (numpy) and raises its own error, counted its own way.
    with pytest.raises(LayoutMismatchError, match="changed positions but" if damage == "bit" else message):
        decode_deltas(items)


def test_a_position_beyond_its_tensor_is_refused_in_a_bucket_mixing_bitmask_and_index_payloads() -> None:
    # The batched check reads each tensor's last position from the bitmask or the index positions of
    # the whole bucket: both kinds in one group, the bad one after a bitmask payload.
    from weight_sync.transport.delta_batch import decode_together

    base = torch.zeros(100)
    new = base.clone()
    new[[70, 80]] = 1.0  # chunk 1 of 64 (elements 64..99): two changes, in index form
    bad = encode_delta(new, base, chunk_elems=64)
    assert delta_stats(bad, 100, torch.float32).chunks == (1, 0, 1, 0)
    # Offsets at bytes 32..36 (header 16 + table 16); the second one still increases, into 64 + 50 = 114.
    bad[34:36] = torch.tensor([50 - 32768], dtype=torch.int16).view(torch.uint8)
    for items, refused in (([(_bitmask_payload(), 64, torch.float32), (bad, 100, torch.float32)], True),
                           ([(_bitmask_payload(), 64, torch.float32),
                             (encode_delta(new, base, chunk_elems=64), 100, torch.float32)], False)):
        checks: list = []
        decoded = decode_together(items, torch.device("cpu"), checks)
        failed = [m for f, (_, m) in zip(torch.stack([c for c, _ in checks]).tolist(), checks) if f]
        assert (any("beyond" in m for m in failed), bool(failed)) == (refused, refused)
        if not refused:
            assert decoded[1][0].tolist() == [70, 80] and len(decoded[0][0]) == 10
