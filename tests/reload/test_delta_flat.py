"""Deltas staged in one buffer and applied by address (the CUDA default; here on CPU, the grouped launch
under Triton's interpreter): every payload decodes to what it decodes to alone, a damaged payload is
refused by name before anything is written, and the engine ends bitwise equal to a full reload, with
rollback restoring every write of an aborted update."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from weight_sync.errors import ConfigError, LayoutMismatchError
from weight_sync.reload.delta_flat import BY_ADDRESS_ENV, by_address_enabled
from weight_sync.transport.delta import decode_delta, delta_stats, encode_delta, raise_failed
from weight_sync.transport.delta_staged import decodable, decode_staged, staged_tables

_DTYPES = [torch.bfloat16, torch.float32, torch.float16, torch.int8, torch.float64]


def _payloads(specs: list[tuple[torch.dtype, int, float, int]], seed: int) -> list[tuple[torch.Tensor, int, torch.dtype]]:
    """(encoding, numel, dtype) per (dtype, numel, density, chunk_elems): random bases, random changes."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for dtype, numel, density, ce in specs:
        base = (torch.randn(numel, generator=g) * 4).to(dtype)
        new = base.clone()
        mask = torch.rand(numel, generator=g) < density
        new[mask] = (torch.randn(int(mask.sum()), generator=g) * 4 + 7).to(dtype)
        out.append((encode_delta(new, base, chunk_elems=ce), numel, dtype))
    return out


def _stage(items: list[tuple[torch.Tensor, int, torch.dtype]]) -> tuple[torch.Tensor, np.ndarray, np.ndarray, np.ndarray]:
    buf = torch.cat([p for p, _, _ in items]) if items else torch.zeros(0, dtype=torch.uint8)
    sizes = np.array([p.numel() for p, _, _ in items], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    return buf, offsets, sizes, np.array([n for _, n, _ in items], dtype=np.int64)


def _decode(items: list[tuple[torch.Tensor, int, torch.dtype]]) -> tuple[np.ndarray, dict[int, tuple[torch.Tensor, torch.Tensor]], list]:
    """(which payloads the staged decode took, their (positions, value bytes), its unread checks)."""
    buf, offsets, sizes, numel = _stage(items)
    item = np.array([d.itemsize for _, _, d in items], dtype=np.int64)
    tab = staged_tables(buf, offsets, sizes, numel, item)
    took = decodable(tab, offsets)
    checks: list = []
    got = {}
    for sel, sp in decode_staged(buf, offsets, tab, np.flatnonzero(took), numel, checks):
        for j, i in enumerate(sel.tolist()):
            b0, nb, i0, ni = int(sp.b_start[j]), int(sp.n_bits[j]), int(sp.i_start[j]), int(sp.n_index[j])
            pos = torch.cat([sp.bpos[b0 : b0 + nb], sp.ipos[i0 : i0 + ni]])
            at = int(sp.values_at[j])
            got[i] = (pos, buf[at : at + (nb + ni) * items[i][2].itemsize])
    return took, got, checks


@settings(max_examples=40, deadline=None)
@given(dtype=st.sampled_from(_DTYPES), numel=st.integers(0, 200_000), density=st.floats(0.0, 0.2),
       chunk_elems=st.sampled_from([64, 1 << 16, 1 << 17]), seed=st.integers(0, 2**16))
def test_staged_payloads_decode_to_each_payloads_own_changes(dtype: torch.dtype, numel: int, density: float,
                                                             chunk_elems: int, seed: int) -> None:
    # The payload under test between others of every form: bitmask chunks (10%), index chunks, none.
    items = _payloads([(torch.bfloat16, 70_000, 0.1, 1 << 16), (dtype, numel, density, chunk_elems),
                       (torch.float32, 3, 0.0, 1 << 16), (torch.float32, 64, 0.2, 64)], seed)
    took, got, checks = _decode(items)
    raise_failed(checks)
    for i, (enc, n, dt) in enumerate(items):
        # Taken whenever its whole table is in the leading bytes the batch reads (the default chunk
        # size, or a table that short); never with plain chunks.
        want_pos, want_vals = decode_delta(enc, n, dt)
        if not took[i]:
            continue
        pos, vals = got[i]
        assert torch.equal(pos, want_pos)
        assert torch.equal(vals, want_vals.contiguous().view(torch.uint8).reshape(-1))
    fits = -(-numel // chunk_elems) <= -(-numel // (1 << 16))
    plain = delta_stats(items[1][0], numel, dtype).chunks[3] > 0
    assert took.tolist() == [True, fits and not plain, True, True]


def test_payloads_with_plain_chunks_or_a_table_beyond_the_read_bytes_are_left_to_the_bucket_path() -> None:
    items = _payloads([(torch.float32, 5000, 0.9, 1 << 16),  # dense: plain chunks
                       (torch.float32, 5000, 0.01, 1024),  # five chunks of 1024: table past 24 bytes
                       (torch.float32, 5000, 0.01, 1 << 16)], seed=3)
    took, got, checks = _decode(items)
    raise_failed(checks)
    assert took.tolist() == [False, False, True] and list(got) == [2]


def _bitmask_payload() -> torch.Tensor:
    """64 float32 elements, 10 changed: one bitmask chunk, its 8 bytes of bits at payload bytes 24..32."""
    base = torch.zeros(64)
    new = base.clone()
    new[torch.arange(0, 60, 6)] = 1.0
    return encode_delta(new, base, chunk_elems=64)


def _index_payload() -> torch.Tensor:
    """100 float32 elements, elements 3 and 40 changed: one index chunk, its int16 offsets at bytes 24..28."""
    base = torch.zeros(100)
    new = base.clone()
    new[[3, 40]] = 1.0
    return encode_delta(new, base)


@pytest.mark.parametrize("damage", ["bits moved between payloads", "repeat", "beyond", "offset outside chunk"])
def test_a_damaged_staged_payload_fails_a_check_named_for_its_problem(damage: str) -> None:
    first, second = _bitmask_payload().clone(), _bitmask_payload().clone()
    good = _payloads([(torch.float32, 5000, 0.01, 1 << 16)], seed=1)[0]
    if damage == "bits moved between payloads":
        # One bit more in one payload, one fewer in the other: the bucket's total still matches.
        first[24] |= 2
        second[24] &= 0xFE
        items, message = [(first, 64, torch.float32), (second, 64, torch.float32), good], "bitmask chunk"
    else:
        bad = _index_payload().clone()
        value = {"repeat": 3, "beyond": 99, "offset outside chunk": 99}[damage]
        if damage == "beyond":  # a chunk of 64 Ki elements over a tensor of 100: 99 < 100 is fine,
            value = 100  # 100 lies beyond the tensor
        if damage == "offset outside chunk":
            # int16 offsets are stored less 32768: every stored value is inside a 64 Ki chunk, so a
            # chunk of 1024 elements is needed to go outside it (its table fits the leading bytes).
            base = torch.zeros(1024)
            new = base.clone()
            new[[3, 40]] = 1.0
            bad = encode_delta(new, base, chunk_elems=1024).clone()
            bad[26:28] = torch.tensor([2000 - 32768], dtype=torch.int16).view(torch.uint8)
            items, message = [good, (bad, 1024, torch.float32)], "outside its chunk"
        else:
            bad[26:28] = torch.tensor([value - 32768], dtype=torch.int16).view(torch.uint8)
            items, message = [good, (bad, 100, torch.float32)], damage
    took, _, checks = _decode(items)
    assert took.all()
    failed = [m for f, (_, m) in zip(torch.stack([c for c, _ in checks]).tolist(), checks) if f]
    assert any(message in m for m in failed), failed
    with pytest.raises(LayoutMismatchError):
        raise_failed(checks)


_CHILD = r"""
import os, sys
assert os.environ.get("TRITON_INTERPRET") == "1"
import pytest
# Not the GPU tests: under the interpreter a Triton kernel handed CUDA tensors crashes the process.
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", "-o", "addopts=", "tests/reload/test_delta_flat.py",
                      "-k", sys.argv[1], "-m", "not gpu"]))
"""


def _interpreted(name: str) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "WS_FLAT_CHILD": "1"}
    out = subprocess.run([sys.executable, "-c", _CHILD, name], capture_output=True, text=True, timeout=900, env=env)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    assert " passed" in out.stdout


needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
child_only = pytest.mark.skipif(os.environ.get("WS_FLAT_CHILD") != "1",
                                reason="runs in a TRITON_INTERPRET=1 child (see the test calling it)")


@needs_triton
def test_deltas_applied_through_addresses_equal_a_full_reload_and_roll_back_under_the_interpreter() -> None:
    _interpreted("by_address")


@pytest.fixture
def _written(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the payloads each batch wrote by address."""
    import weight_sync.reload.delta_flat as delta_flat

    counted: list[int] = []
    write = delta_flat._write

    def spy(update, call, decoded, plans):  # type: ignore[no-untyped-def]
        counted.append(sum(len(sel) for sel, _ in decoded))
        return write(update, call, decoded, plans)

    monkeypatch.setattr(delta_flat, "_write", spy)
    return counted


@pytest.fixture
def _by_address(monkeypatch: pytest.MonkeyPatch, _written: list[int]) -> list[int]:
    """CPU payloads staged and applied by address (under the interpreter)."""
    import weight_sync.reload.delta_apply as delta_apply

    monkeypatch.setattr(delta_apply.InPlaceUpdate, "stage_host", True)
    monkeypatch.setattr(delta_apply.InPlaceUpdate, "flat_interpret", True)
    return _written


@pytest.mark.gpu
def test_staged_payloads_on_cuda_decode_as_on_the_host_and_fail_the_same_checks() -> None:
    items = _payloads([(torch.bfloat16, 300_000, 0.1, 1 << 16), (torch.float32, 70_000, 0.02, 1 << 16),
                       (torch.int8, 200_000, 0.01, 1 << 17), (torch.float32, 3, 0.0, 1 << 16)], seed=5)
    bad = _index_payload().clone()
    bad[26:28] = bad[24:26]  # the second offset repeats the first
    for group, fails in ((items, False), ([*items, (bad, 100, torch.float32)], True)):
        took, got, checks = _decode([(p.cuda(), n, d) for p, n, d in group])
        host_took, host_got, host_checks = _decode(group)
        assert took.tolist() == host_took.tolist() and took.all()
        assert [bool(c) for c, _ in checks] == [bool(c) for c, _ in host_checks]
        assert any(bool(c) for c, _ in checks) == fails
        for i, (pos, vals) in got.items():
            assert torch.equal(pos.cpu(), host_got[i][0]) and torch.equal(vals.cpu(), host_got[i][1])


@pytest.mark.gpu
@pytest.mark.parametrize("quantization", [None, "fp8_block"])
@pytest.mark.parametrize("switch", [None, "1", "0"])
def test_cuda_deltas_go_by_address_unless_switched_off_and_equal_a_full_reload(
        qwen3_a: Path, quantization: str | None, switch: str | None, _written: list[int],
        monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.transport.test_delta_grouped import run_deltas

    if switch is None:
        monkeypatch.delenv(BY_ADDRESS_ENV, raising=False)
    else:
        monkeypatch.setenv(BY_ADDRESS_ENV, switch)
    run_deltas(qwen3_a, quantization, torch.device("cuda"), "device", steps=3)
    assert (sum(_written) > 0) == (switch != "0")


def test_the_by_address_switch_is_on_unless_set_to_zero_and_refuses_other_values(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(BY_ADDRESS_ENV, raising=False)
    assert by_address_enabled()
    monkeypatch.setenv(BY_ADDRESS_ENV, "0")
    assert not by_address_enabled()
    monkeypatch.setenv(BY_ADDRESS_ENV, "1")
    assert by_address_enabled()
    monkeypatch.setenv(BY_ADDRESS_ENV, "yes")
    with pytest.raises(ConfigError, match=f"{BY_ADDRESS_ENV} must be '0' or '1', got 'yes'"):
        by_address_enabled()


@child_only
@pytest.mark.parametrize("quantization", [None, "fp8_block", "fp8_per_channel"])
@pytest.mark.parametrize("policy", ["always", "alternating"])
def test_by_address_deltas_equal_a_full_reload(qwen3_a: Path, quantization: str | None, policy: str,
                                               _by_address: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    import itertools

    import weight_sync.reload.delta_apply as delta_apply
    from tests.transport.test_delta_grouped import run_deltas

    # The CUDA rule on CPU: a weight with changes is requantized whole (by address, into its copy);
    # alternating, every other one takes the tile / row path from views, in the same batch.
    turns = itertools.cycle([True, False])
    monkeypatch.setattr(delta_apply, "_requantize_whole", lambda d, n: n > 0 and (policy == "always" or next(turns)))
    run_deltas(qwen3_a, quantization, torch.device("cpu"), "pinned", steps=2)
    assert sum(_by_address) > 0


@child_only
@pytest.mark.parametrize("quantization", [None, "fp8_block"])
def test_by_address_deltas_aborted_with_rollback_restore_every_write(qwen3_a: Path, quantization: str | None,
                                                                     _by_address: list[int],
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    import weight_sync.reload.delta_apply as delta_apply
    from tests.transport.test_delta_grouped import abort_restores

    monkeypatch.setattr(delta_apply, "_requantize_whole", lambda d, n: n > 0)
    abort_restores(qwen3_a, quantization, torch.device("cpu"))
    assert sum(_by_address) > 0


def _damaged_refused(ckpt: Path, device: torch.device) -> None:
    """An fp8_block engine's delta with one payload whose index offsets repeat is refused by name at the
    finish, and every engine tensor keeps the bytes it had."""
    from tests.transport.test_delta_batched_apply import _engines
    from tests.transport.test_delta_grouped import _change, _equal, _session, _state
    from weight_sync.transport.delta_sync import DeltaSession

    delta, _, base, old = _engines(ckpt, 1 << 30, device)
    before = _state(delta)
    new = _change(old, 2)
    session = DeltaSession(_session(delta, new, 2), base, "delta")
    payloads = {n: encode_delta(new[n], old[n]) for n in new}
    # Index offsets that repeat, in a payload of index chunks only (its offsets right after its table).
    def repeatable(n: str) -> bool:  # index chunks only, the first two changes in the first chunk
        _, bitmask, _, plain = delta_stats(payloads[n], new[n].numel(), new[n].dtype).chunks
        pos = decode_delta(payloads[n], new[n].numel(), new[n].dtype)[0]
        return bitmask == plain == 0 and pos.numel() >= 2 and int(pos[1]) < 1 << 16

    name = max(filter(repeatable, payloads), key=lambda n: payloads[n].numel())
    bad = payloads[name].clone()
    at = 16 + 8 * -(-new[name].numel() // (1 << 16))
    bad[at + 2 : at + 4] = bad[at : at + 2]
    payloads[name] = bad
    session.load([(n, p.to(device)) for n, p in payloads.items()])
    with pytest.raises(LayoutMismatchError, match="repeat or are out of order"):
        session.finish()
    assert _equal(_state(delta), before)


@child_only
def test_by_address_a_damaged_payload_is_refused_by_name_and_nothing_is_written(qwen3_a: Path,
                                                                                _by_address: list[int]) -> None:
    _damaged_refused(qwen3_a, torch.device("cpu"))


@pytest.mark.gpu
def test_a_damaged_cuda_payload_is_refused_by_name_and_nothing_is_written(qwen3_a: Path, _written: list[int],
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(BY_ADDRESS_ENV, raising=False)
    _damaged_refused(qwen3_a, torch.device("cuda"))
    assert sum(_written) == 0  # the batch's checks failed before its first write
