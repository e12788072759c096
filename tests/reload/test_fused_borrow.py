"""Keys that already lie in the caller's memory as a fused tensor (q/k/v, gate/up packed back to back in one
bucket) are processed where they lie: no staging copy, same result, the caller may reuse its buffer."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from torch import nn

from weight_sync import Manifest, begin_update, record_metadata_for_reloading
from weight_sync.engine import ReferenceEngine
from weight_sync.errors import DuplicateTensorError, ManifestError
from weight_sync.reload import mark_layers_processed, torn_reason
from weight_sync.reload.state import get_state
from weight_sync.testing import assert_bitwise_equal, hf_config, random_weights

ROWS = 4  # rows per key; a fused weight has two keys' rows: (2 * ROWS, 4)


class FusedLinear(nn.Module):
    """A fused weight (rows of key ``a`` then ``b``) and a fused bias, processed by a read-only processor
    into kernel tensors of the same layout (2x the input). ``narrow`` loads only the first ``ROWS`` rows of
    each (twice as tall) key, as a tensor-parallel shard does; ``keep`` holds on to the input, which a
    read-only processor must not do."""

    def __init__(self, *, narrow: bool = False, keep: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(2 * ROWS, 4), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(2 * ROWS), requires_grad=False)
        for p in (self.weight, self.bias):
            p.weight_loader = self.load  # type: ignore[attr-defined]
        self.narrow, self.keep = narrow, keep
        self.ws_processor_reads_input = True
        self.seen: list[tuple[int, int]] = []  # (weight, bias) addresses each processing read

    def load(self, param: torch.Tensor, loaded: torch.Tensor, shard: str) -> None:
        if self.narrow:
            loaded = loaded.narrow(0, 0, ROWS)
        param.data[(0 if shard == "a" else ROWS) : (ROWS if shard == "a" else 2 * ROWS)].copy_(loaded)

    def process_weights_after_loading(self) -> None:
        self.seen.append((self.weight.data_ptr(), self.bias.data_ptr()))
        if self.keep:
            self.kept = [self.weight.detach()]
        self.weight = nn.Parameter(self.weight.detach() * 2, requires_grad=False)
        self.bias = nn.Parameter(self.bias.detach() * 2, requires_grad=False)


class Model(nn.Module):
    def __init__(self, layers: int = 2, **kw) -> None:
        super().__init__()
        self.layers = nn.ModuleList(FusedLinear(**kw) for _ in range(layers))

    def load_weights(self, weights) -> set[str]:
        for name, t in weights:
            layer, _, key = name.rpartition(".")  # layers.0.weight_a / layers.0.bias_b
            tensor, shard = key.split("_")
            p = getattr(self.get_submodule(layer), tensor)
            p.weight_loader(p, t, shard)
        return set()


def _loaded(layers: int = 2, **kw) -> Model:
    """Built, recorded, loaded and processed once by 'another loader' (as vLLM does its first load)."""
    model = Model(layers, **kw)
    record_metadata_for_reloading(model)
    with torch.no_grad():
        model.load_weights(_weights(model, 0))
    for layer in model.layers:
        layer.process_weights_after_loading()
    mark_layers_processed(model)
    return model


def _weights(model: Model, seed: int) -> list[tuple[str, torch.Tensor]]:
    """Per layer, in fused order: weight_a, weight_b, bias_a, bias_b (separate tensors)."""
    g = torch.Generator().manual_seed(seed)
    rows = 2 * ROWS if model.layers[0].narrow else ROWS
    out = []
    for i in range(len(model.layers)):
        out += [(f"layers.{i}.weight_a", torch.randn(rows, 4, generator=g)),
                (f"layers.{i}.weight_b", torch.randn(rows, 4, generator=g)),
                (f"layers.{i}.bias_a", torch.randn(rows, generator=g)),
                (f"layers.{i}.bias_b", torch.randn(rows, generator=g))]
    return out


def _packed(weights: list[tuple[str, torch.Tensor]], gaps: dict[str, int] | None = None,
            dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, list[tuple[str, torch.Tensor]]]:
    """One byte buffer holding ``weights`` back to back (``gaps``: elements left free before a key), and
    the views of it a transport hands over (``buf[a:b].view(dtype).view(shape)``, as the receiver does)."""
    gaps = gaps or {}
    size = dtype.itemsize
    flat = torch.full((sum(t.numel() + gaps.get(n, 0) for n, t in weights) * size,), 0xFF, dtype=torch.uint8)
    views, off = [], 0
    for n, t in weights:
        off += gaps.get(n, 0) * size
        views.append((n, flat[off : off + t.numel() * size].view(dtype).view(t.shape)))
        views[-1][1].copy_(t)
        off += t.numel() * size
    return flat, views


def _inside(ptr: int, buf: torch.Tensor) -> bool:
    return buf.data_ptr() <= ptr < buf.data_ptr() + buf.numel() * buf.element_size()


def _expected(weights: list[tuple[str, torch.Tensor]], i: int) -> tuple[torch.Tensor, torch.Tensor]:
    w = dict(weights)
    return (torch.cat([w[f"layers.{i}.weight_a"], w[f"layers.{i}.weight_b"]]).float() * 2,
            torch.cat([w[f"layers.{i}.bias_a"], w[f"layers.{i}.bias_b"]]).float() * 2)


def _load(model: Model, batches, manifest_of=None, **options):
    weights = [item for batch in batches for item in batch] if manifest_of is None else manifest_of
    with begin_update(model, Manifest.from_named_tensors(weights), **options) as session:
        for batch in batches:
            session.load(batch)
    return session.report


def test_fused_keys_adjacent_in_one_buffer_are_processed_where_they_lie() -> None:
    model, twin = _loaded(), _loaded()
    weights = _weights(model, 1)
    flat, views = _packed(weights)
    report = _load(model, [views])
    _load(twin, [[(n, t.clone()) for n, t in weights]])
    assert_bitwise_equal(model, twin)  # as if every key had been copied into staging
    for i, layer in enumerate(model.layers):
        assert all(_inside(p, flat) for p in layer.seen[-1])  # the processor read the caller's buffer
        assert torch.equal(layer.weight, _expected(weights, i)[0])
        assert torch.equal(layer.bias, _expected(weights, i)[1])
    assert report.peak_buffered_bytes == 0 and report.spilled_bytes == 0  # no staging at all
    assert report.keys_replayed == len(weights)
    # load() has returned: the caller reuses its buffer, the served weights do not follow.
    flat.fill_(7.0)
    assert_bitwise_equal(model, twin)


def test_a_qwen_like_engine_quantizing_online_borrows_bucket_views_by_default_bitwise_like_copies() -> None:
    cfg = hf_config("qwen3", "tiny")

    def engine(quant: str) -> ReferenceEngine:
        # No opt-in here: the engine's online quantization declares that its processing only reads.
        return ReferenceEngine.from_config(cfg, weights=random_weights(cfg, seed=0), quantization=quant)

    for quant in ("fp8", "int8"):
        served, twin = engine(quant), engine(quant)
        weights = list(random_weights(cfg, seed=1))
        flat, views = _packed(weights, dtype=weights[0][1].dtype)
        manifest = Manifest.from_named_tensors(weights)
        buckets: dict[str, list[tuple[str, torch.Tensor]]] = {}
        for n, t in views:  # one bucket per block, as the receiver hands them over
            buckets.setdefault(n.split(".")[2] if ".layers." in n else n, []).append((n, t))
        with begin_update(served.model, manifest) as s:
            for bucket in buckets.values():
                s.load(bucket)
        with begin_update(twin.model, manifest) as copied:
            copied.load((n, t.clone()) for n, t in weights)
        assert s.report is not None and copied.report is not None
        if quant == "int8":
            # Per-channel scales are quantized key by key into the kernel tensors (reload/bands.py): no
            # staging to borrow, from a list or from a generator.
            assert s.report.layers_banded and copied.report.layers_banded == s.report.layers_banded
            assert s.report.peak_buffered_bytes == 0 == copied.report.peak_buffered_bytes
        else:
            assert s.report.peak_buffered_bytes == 0 < copied.report.peak_buffered_bytes
        assert any("qkv_proj" in n for n in s.report.layers_processed)
        assert all(info.reads_input for info in get_state(served.model).layers.values() if not info.direct)
        assert_bitwise_equal(served.model, twin.model)
        flat.zero_()
        assert_bitwise_equal(served.model, twin.model)
        assert served.generate([[5, 6, 7]], 4) == twin.generate([[5, 6, 7]], 4)


def _separate_storages(weights, *, first_spans_all: bool):
    """Tensors at adjacent addresses that are nevertheless different storages (numpy-backed); with
    ``first_spans_all`` each layer's first key is a view of one storage spanning the whole buffer."""
    arr = np.zeros(sum(t.numel() for _, t in weights), dtype=np.float32)
    whole = torch.from_numpy(arr)
    out, off = [], 0
    for n, t in weights:
        part = whole[off : off + t.numel()] if first_spans_all and n.endswith("_a") \
            else torch.from_numpy(arr[off : off + t.numel()])
        v = part.view(t.shape)
        v.copy_(t)
        out.append((n, v))
        off += t.numel()
    return whole, out


@pytest.mark.parametrize("case", ["gap", "other order", "separate storages", "aliasing storages",
                                  "bfloat16 into float32", "narrowed shards"])
def test_keys_that_do_not_lie_as_the_fused_tensor_are_staged_and_still_correct(case: str) -> None:
    model = _loaded(narrow=case == "narrowed shards")
    weights = _weights(model, 1)
    if case == "bfloat16 into float32":
        weights = [(n, t.bfloat16()) for n, t in weights]
    if case == "gap":
        flat, views = _packed(weights, gaps={n: 1 for n, _ in weights if n.endswith("_b")})
    elif case == "other order":  # b's rows before a's in memory: not the fused row order
        order = [w for pair in zip(weights[1::2], weights[0::2]) for w in pair]
        flat, views = _packed(order)
    elif case.endswith("storages"):
        flat, views = _separate_storages(weights, first_spans_all=case == "aliasing storages")
    else:
        flat, views = _packed(weights, dtype=weights[0][1].dtype)
    report = _load(model, [views])
    for i, layer in enumerate(model.layers):
        assert not any(_inside(p, flat) for p in layer.seen[-1])
        w = dict(weights)
        if case == "narrowed shards":
            a, b = w[f"layers.{i}.weight_a"][:ROWS], w[f"layers.{i}.weight_b"][:ROWS]
            assert torch.equal(layer.weight, torch.cat([a, b]) * 2)
        else:
            assert torch.equal(layer.weight, _expected(weights, i)[0])
            assert torch.equal(layer.bias, _expected(weights, i)[1])
    assert report.peak_buffered_bytes > 0


def test_a_layer_whose_keys_arrive_in_two_load_calls_is_staged_and_the_next_layer_still_borrows() -> None:
    model = _loaded()
    weights = _weights(model, 1)
    flat, views = _packed(weights)
    report = _load(model, [views[:1], views[1:]])
    assert not any(_inside(p, flat) for p in model.layers[0].seen[-1])
    assert all(_inside(p, flat) for p in model.layers[1].seen[-1])
    for i, layer in enumerate(model.layers):
        assert torch.equal(layer.weight, _expected(weights, i)[0])
        assert torch.equal(layer.bias, _expected(weights, i)[1])
    assert report.peak_buffered_bytes == (2 * ROWS * 4 + 2 * ROWS) * 4  # layer 0 only


def test_of_two_interleaved_layers_the_first_borrows_and_neither_is_taken_for_keeping_its_input(
    caplog: pytest.LogCaptureFixture,
) -> None:
    model = _loaded()
    weights = _weights(model, 1)
    w = dict(weights)
    # Each layer's weight keys and bias keys adjacent, but the two layers' keys interleaved.
    order = [f"layers.{i}.{t}_{k}" for t in ("weight", "bias") for i in (0, 1) for k in "ab"]
    flat, views = _packed([(n, w[n]) for n in order])
    with caplog.at_level(logging.WARNING, logger="weight_sync.reload.session"):
        _load(model, [views])
    assert all(_inside(p, flat) for p in model.layers[0].seen[-1])
    assert not any(_inside(p, flat) for p in model.layers[1].seen[-1])
    assert "kept a reference" not in caplog.text
    assert all(info.reads_input for info in get_state(model).layers.values())
    for i, layer in enumerate(model.layers):
        assert torch.equal(layer.weight, _expected(weights, i)[0])
        assert torch.equal(layer.bias, _expected(weights, i)[1])


def test_a_layer_borrows_its_adjacent_weight_and_stages_its_bias_that_is_not() -> None:
    model = _loaded()
    weights = _weights(model, 1)
    flat, views = _packed(weights, gaps={n: 3 for n, _ in weights if n.endswith("bias_b")})
    report = _load(model, [views])
    for i, layer in enumerate(model.layers):
        weight_ptr, bias_ptr = layer.seen[-1]
        assert _inside(weight_ptr, flat) and not _inside(bias_ptr, flat)
        assert torch.equal(layer.weight, _expected(weights, i)[0])
        assert torch.equal(layer.bias, _expected(weights, i)[1])
    # Only the bias was staged (one layer at a time: they arrive in layer order).
    assert report.peak_buffered_bytes == 2 * ROWS * 4
    flat.fill_(7.0)
    assert torch.equal(model.layers[0].weight, _expected(weights, 0)[0])


def test_a_processor_that_keeps_its_input_is_processed_again_from_a_copy_and_never_borrows_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    model = _loaded(keep=True)
    weights = _weights(model, 1)
    flat, views = _packed(weights)
    with caplog.at_level(logging.WARNING, logger="weight_sync.reload.session"):
        report = _load(model, [views], rollback=True)
    assert "kept a reference to its input" in caplog.text
    for i, layer in enumerate(model.layers):
        assert not _inside(layer.kept[0].data_ptr(), flat)  # serves from its own copy
        assert torch.equal(layer.kept[0], _expected(weights, i)[0] / 2)
        assert torch.equal(layer.weight, _expected(weights, i)[0])
        assert get_state(model).layers[f"layers.{i}"].reads_input is False
    assert sorted(report.layers_processed) == ["layers.0", "layers.1"]
    flat.fill_(7.0)
    assert torch.equal(model.layers[0].kept[0], _expected(weights, 0)[0] / 2)
    # The next update copies from the start.
    weights = _weights(model, 2)
    flat, views = _packed(weights)
    _load(model, [views])
    assert not any(_inside(p, flat) for layer in model.layers for p in layer.seen[-1])
    assert torch.equal(model.layers[1].weight, _expected(weights, 1)[0])


def test_rollback_after_a_failure_later_in_the_update_restores_every_borrowed_layer_bitwise() -> None:
    model, before = _loaded(3), _loaded(3)
    weights = _weights(model, 1)
    flat, views = _packed(weights)
    bad = views[9][0], views[9][1].view(-1)  # layers.2.weight_b, announced (4, 4), sent flat
    with pytest.raises(ManifestError, match=r"layers\.2\.weight_b"):
        _load(model, [views[:4], [*views[4:9], bad, *views[10:]]], manifest_of=weights, rollback=True)
    assert _inside(model.layers[0].seen[-1][0], flat) and _inside(model.layers[1].seen[-1][0], flat)
    assert_bitwise_equal(model, before)
    assert torn_reason(model) is None
    report = _load(model, [_packed(weights)[1]])  # and the next update goes through
    assert report.peak_buffered_bytes == 0


def test_a_borrowing_layer_whose_key_fails_validation_is_left_as_it_was() -> None:
    model, before = _loaded(), _loaded()
    weights = _weights(model, 1)
    _, views = _packed(weights)
    # Same bytes, same element count, another shape than announced: checked like any key.
    views[1] = views[1][0], views[1][1].view(2, 2 * 4)
    with pytest.raises(ManifestError, match=r"layers\.0\.weight_b"):
        _load(model, [views], manifest_of=weights)
    assert_bitwise_equal(model, before)
    assert torn_reason(model) is None
    # A key sent twice in one batch is a duplicate, as anywhere else.
    views = _packed(weights)[1]
    with pytest.raises(DuplicateTensorError, match=r"layers\.0\.weight_a"):
        _load(model, [[*views, views[0]]], manifest_of=weights)


def test_a_generator_is_loaded_one_key_at_a_time_as_before() -> None:
    model = _loaded()
    weights = _weights(model, 1)
    flat, views = _packed(weights)
    report = _load(model, [(x for x in views)], manifest_of=weights)
    assert not any(_inside(p, flat) for layer in model.layers for p in layer.seen[-1])
    assert report.peak_buffered_bytes > 0
    for i, layer in enumerate(model.layers):
        assert torch.equal(layer.weight, _expected(weights, i)[0])
