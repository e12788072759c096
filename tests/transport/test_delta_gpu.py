"""CUDA delta apply (run on the device machine): dense changes into block- and channel-scaled fp8 weights
take the grouped whole requantization when the model-format copies live on the device, the tile / row
path when they are pinned on the host; both stay bitwise equal to a full reload."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.transport.test_delta_grouped import run_deltas


@pytest.mark.gpu
@pytest.mark.parametrize("quantization", ["fp8_block", "fp8_per_channel"])
@pytest.mark.parametrize("base_where", ["device", "pinned"])
def test_cuda_deltas_into_fp8_engines_equal_a_full_reload(qwen3_a: Path, quantization: str, base_where: str) -> None:
    whole = run_deltas(qwen3_a, quantization, torch.device("cuda"), base_where, steps=3)
    assert (whole > 0) == (base_where == "device")


def _bf16_pairs(specs: list[tuple[int, float]], seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(base, new) bf16 pairs on the host: ``numel`` elements, a ``density`` of them moved by 0.25."""
    g = torch.Generator().manual_seed(seed)
    pairs = []
    for numel, density in specs:
        base = torch.randn(numel, generator=g).to(torch.bfloat16)
        new = base.clone()
        new[torch.rand(numel, generator=g) < density] += 0.25
        pairs.append((base, new))
    return pairs


# A dense group (host bases copied back whole) and a sparse one (host bases get the changes scattered).
_GROUPS = {"dense": [(300_000, 0.02), (70_001, 0.5), (10, 0.0), (0, 0.0), (131_072, 1.0)],
           "sparse": [(1_000_000, 0.001), (70_001, 0.0005), (10, 0.0), (0, 0.0)]}


@pytest.mark.gpu
@pytest.mark.parametrize("base_where", ["device", "pinned"])
@pytest.mark.parametrize("group", sorted(_GROUPS))
def test_a_cuda_group_encodes_to_the_bytes_a_cpu_sender_writes_and_moves_its_bases(base_where: str, group: str) -> None:
    from weight_sync.transport.delta import encode_delta_with_positions, encode_deltas
    from weight_sync.transport.delta_encode_group import scatter_pays

    pairs = _bf16_pairs(_GROUPS[group], seed=0)
    changed = sum(int((new != base).sum()) for base, new in pairs)
    assert scatter_pays(changed, sum(new.numel() * 2 for _, new in pairs)) == (group == "sparse")
    pairs.append((torch.randn(1000), torch.randn(1000)))  # another item size: a group of its own
    bases = [b.clone().cuda() if base_where == "device" else b.clone().pin_memory() for b, _ in pairs]
    on_gpu = encode_deltas([(new.cuda(), b) for (_, new), b in zip(pairs, bases)], advance=True)
    for (base, new), (enc, changed), moved in zip(pairs, on_gpu, bases, strict=True):
        want_enc, want_pos = encode_delta_with_positions(new, base)
        assert torch.equal(enc.cpu(), want_enc) and changed == want_pos.numel()
        assert torch.equal(moved.cpu(), new)


@pytest.mark.gpu
def test_a_cuda_bucket_decodes_together_to_each_payloads_changes_and_names_a_bad_one() -> None:
    from weight_sync.errors import LayoutMismatchError
    from weight_sync.transport.delta import decode_delta, encode_delta
    from weight_sync.transport.delta_batch import decode_deltas

    items = [(encode_delta(new, base), base.numel(), torch.bfloat16) for base, new in
             _bf16_pairs([(300_000, 0.02), (70_001, 0.3), (10, 0.0), (0, 0.0), (131_072, 0.9)], seed=1)]
    together = decode_deltas([(enc.cuda(), n, dt) for enc, n, dt in items])
    for (enc, n, dt), (pos, vals) in zip(items, together, strict=True):
        want_pos, want_vals = decode_delta(enc, n, dt)
        assert torch.equal(pos.cpu(), want_pos) and torch.equal(vals.cpu(), want_vals)
    base = torch.zeros(100)
    new = base.clone()
    new[[3, 40]] = 1.0
    bad = encode_delta(new, base)
    bad[26:28] = bad[24:26]  # offset 40 -> 3: a repeat
    with pytest.raises(LayoutMismatchError, match="repeat"):
        decode_deltas([(items[0][0].cuda(), items[0][1], torch.bfloat16), (bad.cuda(), 100, torch.float32)])


@pytest.mark.gpu
def test_cuda_deltas_written_tensor_by_tensor_equal_the_grouped_writes(qwen3_a: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # scatter_many declining (what it does off Triton) sends every queued write of the view path
    # through torch indexing.
    import weight_sync.reload.delta_apply as delta_apply
    from weight_sync.reload.delta_flat import BY_ADDRESS_ENV

    monkeypatch.setenv(BY_ADDRESS_ENV, "0")
    monkeypatch.setattr(delta_apply, "scatter_many", lambda *a, **k: False)
    assert run_deltas(qwen3_a, "fp8_block", torch.device("cuda"), "device", steps=2) > 0


@pytest.mark.gpu
@pytest.mark.parametrize("quantization", [None, "fp8_block"])
@pytest.mark.parametrize("by_address", ["1", "0"])
def test_an_aborted_cuda_delta_restores_every_grouped_write(qwen3_a: Path, quantization: str | None,
                                                            by_address: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.transport.test_delta_grouped import abort_restores
    from weight_sync.reload.delta_flat import BY_ADDRESS_ENV

    monkeypatch.setenv(BY_ADDRESS_ENV, by_address)
    abort_restores(qwen3_a, quantization, torch.device("cuda"))
