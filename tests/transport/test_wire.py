"""Wire records, checksums and configuration: JSON only, validated, errors that name the problem."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("hypothesis")  # the device machine runs GPU tests without it
from hypothesis import given, settings
from hypothesis import strategies as st

from weight_sync.checksum import ChecksumWorkspace, tensor_checksum, tensor_checksums
from weight_sync.errors import ConfigError, TransportError
from weight_sync.transport import TransportConfig, bucket_checksum, checksum_value
from weight_sync.transport.wire import (
    STATUS_SLOT_BYTES,
    ControlHeader,
    Hello,
    RankStatus,
    WireParams,
)


def _reference_checksum(t: torch.Tensor) -> int:
    """The checksum's definition, computed the plain way (int64 words, explicit weights)."""
    flat = t.detach().clone().contiguous().view(-1).view(torch.uint8)  # a copy starts on a word boundary
    n = flat.numel()
    if n % 4:
        flat = torch.cat([flat, flat.new_zeros((-n) % 4)])
    words = flat.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    weights = (torch.arange(words.numel(), dtype=torch.int64) % 65521) + 1
    s1, s2 = int(words.sum()), int((words * weights).sum())
    return ((s1 & 0xFFFFFFFF) << 32 | (s2 & 0xFFFFFFFF)) ^ n


@settings(max_examples=40, deadline=None)
@given(words=st.integers(0, 3 * 65521 + 17), seed=st.integers(0, 2**31 - 1))
def test_bucket_checksum_equals_the_checksum_definition(words: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (4 * words,), dtype=torch.uint8, generator=g)
    assert checksum_value(bucket_checksum(data), data.numel()) == _reference_checksum(data)


@pytest.mark.parametrize("shape", [(0,), (1,), (3,), (7, 5), (65521 * 2 + 3,)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8, torch.float8_e4m3fn])
def test_tensor_checksum_equals_the_checksum_definition(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    t = torch.randn(shape).to(dtype)
    assert tensor_checksum(t) == _reference_checksum(t)


def test_checksums_of_many_tensors_at_once_equal_each_tensors_own() -> None:
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(shape, generator=g).to(dtype) for shape, dtype in [
        ((0,), torch.float32), ((3,), torch.uint8), ((7, 5), torch.bfloat16), ((65521 * 2 + 3,), torch.float32),
        ((16, 16), torch.float8_e4m3fn), ((5,), torch.bfloat16)]]
    tensors.append(torch.randn(8, 6, generator=g)[:, 1:4])  # not contiguous
    tensors.append(torch.randn(1001, generator=g).to(torch.bfloat16)[1:])  # 2 bytes into its storage
    assert tensor_checksums(tensors) == [_reference_checksum(t) for t in tensors]
    assert tensor_checksums([]) == []


_TRITON_CHILD = r"""
import sys, torch
from weight_sync.checksum import checksum_value
from weight_sync.checksum_triton import word_sums
tensors = torch.load(sys.argv[1])
sums = word_sums(tensors)
torch.save([checksum_value(sums[i], t.numel() * t.element_size()) for i, t in enumerate(tensors)], sys.argv[2])
"""


def test_the_grouped_triton_checksum_kernel_equals_the_definition_under_the_interpreter(tmp_path) -> None:
    import importlib.util
    import os
    import subprocess
    import sys

    if importlib.util.find_spec("triton") is None:
        pytest.skip("Triton is not installed: no interpreter to run the kernel")
    g = torch.Generator().manual_seed(3)
    tensors = [torch.randint(-2**31, 2**31 - 1, (n,), dtype=torch.int32, generator=g)
               for n in (1, 65520, 65521, 65522, 65521 * 2 + 7)] + [torch.randn(50, 77, generator=g).to(torch.bfloat16)]
    torch.save(tensors, tmp_path / "in.pt")
    out = subprocess.run([sys.executable, "-c", _TRITON_CHILD, str(tmp_path / "in.pt"), str(tmp_path / "out.pt")],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert out.returncode == 0, out.stderr[-4000:]
    assert torch.load(tmp_path / "out.pt") == [_reference_checksum(t) for t in tensors]


def test_a_flipped_byte_changes_the_bucket_checksum() -> None:
    data = torch.randint(0, 256, (1 << 16,), dtype=torch.uint8)
    before = bucket_checksum(data).tolist()
    data[12345] ^= 1
    assert bucket_checksum(data).tolist() != before


def test_a_checksum_written_into_trailer_words_equals_the_returned_one() -> None:
    data = torch.randint(0, 256, (4 * (65521 + 5),), dtype=torch.uint8)
    trailer = torch.full((8,), -1, dtype=torch.int64)
    out = bucket_checksum(data, out=trailer[6:8])
    assert out.data_ptr() == trailer[6:8].data_ptr()
    assert trailer[6:8].tolist() == bucket_checksum(data).tolist() and trailer[:6].tolist() == [-1] * 6
    assert bucket_checksum(data[:0], out=trailer[6:8]).tolist() == [0, 0]


def test_records_round_trip_through_json() -> None:
    params = WireParams(backend="gloo", bucket_bytes=1024, num_buffers=2, checksum=True, timeout_s=3.0,
                        align_bytes=256, world_size=3, verify="before_load")
    assert WireParams.from_json(params.to_json()) == params
    hello = Hello(rank=2, host="h", pid=7, device="cpu")
    assert Hello.from_json(hello.to_json()) == hello
    header = ControlHeader(kind="call", seq=4, call=2, first=3, count=5, num_buckets=6)
    assert ControlHeader.from_json(header.to_json()) == header


def test_wire_parameters_default_to_deferred_verification() -> None:
    assert TransportConfig().verify == "deferred"
    raw = json.dumps({"backend": "gloo", "bucket_bytes": 1024, "num_buffers": 2, "checksum": True, "timeout_s": 3.0,
                      "align_bytes": 256, "world_size": 2})
    assert WireParams.from_json(raw).verify == "deferred"


def test_a_record_from_another_protocol_version_is_refused() -> None:
    raw = json.dumps({"kind": "start", "seq": 1, "protocol": 99})
    with pytest.raises(TransportError, match="protocol 99"):
        ControlHeader.from_json(raw)


def test_a_record_missing_fields_names_them() -> None:
    with pytest.raises(TransportError, match="seq"):
        ControlHeader.from_json(json.dumps({"kind": "start"}))


def test_a_long_status_message_is_truncated_to_valid_json() -> None:
    status = RankStatus(rank=1, ok=False, phase="update_weights", error_type="X", message="m" * 50_000)
    raw = status.to_bytes()
    assert len(raw) <= STATUS_SLOT_BYTES
    back = RankStatus.from_bytes(raw, 1)
    assert not back.ok and back.message.endswith("(truncated)")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"backend": "tcp"}, "backend must be one of"),
        ({"bucket_bytes": 1000}, "bucket_bytes must be"),
        ({"bucket_bytes": 4096 + 1}, "multiple of 256"),
        ({"num_buffers": 1}, r"num_buffers must be an int in \[2, 8\]"),
        ({"timeout_s": 0}, "timeout_s must be a positive"),
        ({"verify": "after_commit"}, r"verify must be one of \['deferred', 'before_load'\]"),
        ({"backend": "disk"}, "needs directory="),
        ({"backend": "nccl", "device": "cpu"}, "needs a CUDA device"),
        ({"backend": "shm", "device": "cuda:0"}, "keeps its buffers on the CPU"),
    ],
)
def test_invalid_configs_name_the_field_and_the_value(kwargs: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        TransportConfig(**kwargs)


@pytest.mark.parametrize("words", [1, 65520, 65521, 65522, 3 * 65521 + 17])
def test_a_reused_workspace_gives_the_same_checksum_as_fresh_intermediates(words: int) -> None:
    ws = ChecksumWorkspace(torch.device("cpu"))
    for seed in range(2):  # the second pass reuses what the first wrote
        g = torch.Generator().manual_seed(seed)
        data = torch.randint(0, 256, (4 * words,), dtype=torch.uint8, generator=g)
        assert bucket_checksum(data, workspace=ws).tolist() == bucket_checksum(data).tolist()
