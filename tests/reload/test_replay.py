"""A bucket list sent again at the next update is written as one batch, with every guarantee of the
per-key path: exact weights, bad input refused by name, rollback, and never into storage that moved;
and nothing reload keeps between updates keeps a model alive."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

from weight_sync import (
    DuplicateTensorError,
    LayoutMismatchError,
    Manifest,
    ManifestError,
    begin_update,
    record_metadata_for_reloading,
)
from weight_sync.engine import ReferenceEngine
from weight_sync.reload.replay import ListReplay
from weight_sync.reload.state import get_state
from weight_sync.testing import assert_bitwise_equal, hf_config, random_weights

CFG = hf_config("qwen3", "tiny")
K_PROJ = "model.layers.0.self_attn.k_proj.weight"


def _weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    return [(n, t.contiguous()) for n, t in random_weights(CFG, seed=seed)]


def _buckets(items: list[tuple[str, torch.Tensor]], size: int = 7) -> list[list[tuple[str, torch.Tensor]]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def _update(engine: ReferenceEngine, items: list[tuple[str, torch.Tensor]], **kw) -> None:
    with begin_update(engine.model, Manifest.from_named_tensors(items), **kw) as s:
        for bucket in _buckets(items):
            s.load(bucket)


def _fresh(seed: int) -> ReferenceEngine:
    return ReferenceEngine.from_config(CFG, weights=random_weights(CFG, seed=seed), use_cuda_graph=False)


def _recorded(engine: ReferenceEngine, buckets: list[list[tuple[str, torch.Tensor]]]) -> bool:
    replays = get_state(engine.model).replays
    return all(isinstance(replays.get(tuple(n for n, _ in b)), ListReplay) for b in buckets)


def test_repeated_buckets_are_recorded_once_and_replay_the_exact_weights() -> None:
    engine = _fresh(0)
    for step, seed in enumerate((1, 2, 3, 1)):
        _update(engine, _weights(seed))
        # Every bucket of the bf16 model goes into direct layers: recorded at the first update.
        assert _recorded(engine, _buckets(_weights(seed)))
        assert_bitwise_equal(engine.model, _fresh(seed).model), step


@pytest.fixture(params=["one pass", "per property"])
def checks(request, monkeypatch) -> str:
    """A replay checks its sources in one C++ pass where torch offers it, else property by property: the
    same verdicts either way."""
    if request.param == "per property":
        import weight_sync.reload.replay as replay

        monkeypatch.setattr(replay, "source_guard", lambda tensors: None)
    return request.param


@pytest.mark.parametrize("wrong", ["fewer rows", "transposed", "one more dim"])
def test_a_replayed_bucket_with_a_wrong_shape_is_refused_by_name_and_rolled_back(wrong, checks) -> None:
    engine = _fresh(0)
    good = _weights(1)
    _update(engine, good)
    _update(engine, _weights(2))  # recorded, then replayed

    def reshaped(t: torch.Tensor) -> torch.Tensor:
        if wrong == "fewer rows":
            return torch.zeros(7, t.shape[1], dtype=t.dtype)
        if wrong == "transposed":  # as many elements and dims: only the rows differ
            return t.t().contiguous()
        return t.unsqueeze(0)

    bad = [(n, reshaped(t) if n == K_PROJ else t) for n, t in _weights(3)]
    with (pytest.raises((LayoutMismatchError, ManifestError), match=K_PROJ),
          begin_update(engine.model, Manifest.from_named_tensors(good), rollback=True) as s):
        for bucket in _buckets(bad):
            s.load(bucket)
    assert_bitwise_equal(engine.model, _fresh(2).model)
    _update(engine, _weights(4))  # and the next good update replays again
    assert_bitwise_equal(engine.model, _fresh(4).model)


def test_a_replayed_bucket_in_another_dtype_is_converted_as_the_per_key_path_does(checks) -> None:
    engine = _fresh(0)
    _update(engine, _weights(1))
    wide = [(n, t.float()) for n, t in _weights(2)]  # an fp32 trainer into the bf16 model
    _update(engine, wide)
    fresh = ReferenceEngine.from_config(CFG, weights=iter(wide), use_cuda_graph=False)
    assert_bitwise_equal(engine.model, fresh.model)


def test_a_strided_source_in_a_replayed_bucket_loads_exactly(checks) -> None:
    engine = _fresh(0)
    _update(engine, _weights(1))
    _update(engine, _weights(2))  # recorded, then replayed
    # The same shape and dtype, but a view with a column stride: not what the record's copies assume.
    strided = [(n, torch.stack([t, t], dim=-1)[..., 0] if n == K_PROJ else t) for n, t in _weights(3)]
    assert not dict(strided)[K_PROJ].is_contiguous()
    _update(engine, strided)
    assert_bitwise_equal(engine.model, _fresh(3).model)


def test_a_bucket_repeating_a_key_of_an_earlier_bucket_is_refused_as_a_duplicate() -> None:
    engine = _fresh(0)
    items = _weights(1)
    _update(engine, items)
    buckets = _buckets(_weights(2))
    with (pytest.raises(DuplicateTensorError, match=buckets[0][0][0]),
          begin_update(engine.model, Manifest.from_named_tensors(items), rollback=True) as s):
        s.load(buckets[0])
        s.load(buckets[0])  # recorded, and every one of its keys already arrived
    assert_bitwise_equal(engine.model, _fresh(1).model)


def test_a_failure_after_replayed_buckets_rolls_them_back() -> None:
    engine = _fresh(0)
    items = _weights(1)
    _update(engine, items)
    buckets = _buckets(_weights(2))
    with (pytest.raises(RuntimeError, match="trainer died"),
          begin_update(engine.model, Manifest.from_named_tensors(items), rollback=True) as s):
        for bucket in buckets[:-1]:
            s.load(bucket)  # replayed: the layers' snapshots are taken before these writes
        raise RuntimeError("trainer died")
    assert_bitwise_equal(engine.model, _fresh(1).model)


def test_a_parameter_replaced_between_updates_receives_the_replayed_bucket() -> None:
    engine = _fresh(0)
    _update(engine, _weights(1))
    norm = engine.model.get_submodule("model.layers.0.input_layernorm")
    old = norm.weight.data
    norm.weight.data = old.clone()  # new storage: the recorded destination is the old one
    _update(engine, _weights(2))
    assert_bitwise_equal(engine.model, _fresh(2).model)
    assert not torch.equal(old, norm.weight.data)  # the old storage was not written


class _Logged(torch.Tensor):
    """A tensor subclass with a data_ptr of its own (a replay reads C methods unbound: never for these)."""

    def data_ptr(self) -> int:
        return super().data_ptr()


def test_tensor_subclasses_are_never_replayed_and_load_exactly_through_the_per_key_path() -> None:
    engine = _fresh(0)
    for seed in (1, 2, 3):
        items = [(n, t.as_subclass(_Logged)) for n, t in _weights(seed)]
        _update(engine, items)
        assert_bitwise_equal(engine.model, _fresh(seed).model)
    replays = get_state(engine.model).replays
    assert not any(isinstance(replays.get(tuple(n for n, _ in b)), ListReplay) for b in _buckets(items))


def test_a_record_made_before_the_cached_views_were_dropped_is_never_replayed() -> None:
    engine = _fresh(0)
    _update(engine, _weights(1))
    _update(engine, _weights(2))
    state = get_state(engine.model)
    before = {k: state.replays[k] for k in (tuple(n for n, _ in b) for b in _buckets(_weights(2)))}
    assert all(isinstance(r, ListReplay) for r in before.values())
    norm = engine.model.get_submodule("model.layers.0.input_layernorm")
    norm.weight.data = norm.weight.data.clone()  # moved: the next update drops every cached view
    _update(engine, _weights(3))
    assert_bitwise_equal(engine.model, _fresh(3).model)
    assert all(state.replays.get(k) is not r for k, r in before.items())  # each recorded again (or not)


@pytest.mark.parametrize("quant", [None, "fp8", "fp8_block"])
def test_an_updated_model_is_freed_once_its_owner_lets_go(quant) -> None:
    # The reload state is a weak-keyed entry of the model: nothing it keeps between updates (the audit
    # baseline, the write queue, replay records) may reference the model, or no updated model is freed.
    engine = ReferenceEngine.from_config(CFG, weights=random_weights(CFG, seed=0), use_cuda_graph=False,
                                         quantization=quant)
    for seed in (1, 2):
        _update(engine, _weights(seed))
    alive = weakref.ref(engine.model)
    del engine
    gc.collect()
    assert alive() is None


class _Tied(nn.Module):
    """Two checkpoint keys copied whole into one parameter: the later one wins."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(4, 4), requires_grad=False)

    def load_weights(self, weights) -> None:
        for _, t in weights:
            self.w.data.copy_(t)


def test_a_list_writing_one_place_twice_keeps_the_per_key_order_and_is_never_batched() -> None:
    model = _Tied()
    record_metadata_for_reloading(model)
    for step in range(3):
        items = [("a", torch.full((4, 4), 1.0 + step)), ("b", torch.full((4, 4), 10.0 + step))]
        with begin_update(model, Manifest.from_named_tensors(items)) as s:
            s.load(items)
        assert torch.equal(model.w, items[1][1])
        # One grouped copy would not order the two writes on a device: the list is not recorded.
        assert not isinstance(get_state(model).replays[("a", "b")], ListReplay)


def _whole_list_update(engine: ReferenceEngine, items: list[tuple[str, torch.Tensor]],
                       manifest: Manifest | None = None) -> None:
    with begin_update(engine.model, manifest or Manifest.from_named_tensors(items)) as s:
        s.load(items)


@pytest.fixture
def small_pieces(monkeypatch):
    """Pieces of 4 keys, so the tiny model's one-list update is replayed in many pieces."""
    import weight_sync.reload.replay as replay

    monkeypatch.setattr(replay, "PIECE_KEYS", 4)


def test_a_list_replayed_in_pieces_writes_the_exact_weights(small_pieces, checks) -> None:
    engine = _fresh(0)
    for seed in (1, 2, 3):
        _whole_list_update(engine, _weights(seed))
        rec = get_state(engine.model).replays[tuple(n for n, _ in _weights(seed))]
        assert len(rec.pieces) > 3
        assert all((p.guard is not None) == (checks == "one pass") for p in rec.pieces)
        assert_bitwise_equal(engine.model, _fresh(seed).model)


def test_a_later_piece_in_another_dtype_is_loaded_per_key_after_the_pieces_before_it(small_pieces,
                                                                                    monkeypatch) -> None:
    from weight_sync.reload.session import UpdateSession

    engine = _fresh(0)
    _whole_list_update(engine, _weights(1))
    items = _weights(2)
    late = len(items) - 2  # in the last piece: the pieces before it are replayed, the rest goes per key
    mixed = [(n, t.float() if i == late else t) for i, (n, t) in enumerate(items)]
    per_key: list[str] = []
    load_one = UpdateSession._load_one
    monkeypatch.setattr(UpdateSession, "_load_one", lambda self, n, t: (per_key.append(n), load_one(self, n, t)))
    with begin_update(engine.model, Manifest.from_named_tensors(mixed)) as s:
        s.load(mixed)
    assert per_key == [n for n, _ in items[late // 4 * 4:]]
    fresh = ReferenceEngine.from_config(CFG, weights=iter(mixed), use_cuda_graph=False)
    assert_bitwise_equal(engine.model, fresh.model)


def test_a_later_piece_with_a_wrong_shape_is_refused_by_name_and_every_piece_rolled_back(small_pieces,
                                                                                        checks) -> None:
    engine = _fresh(0)
    good = _weights(1)
    _whole_list_update(engine, good)
    items = _weights(2)
    name, t = items[-2]
    bad = [*items[:-2], (name, torch.zeros(t.shape[0] + 1, *t.shape[1:], dtype=t.dtype)), *items[-1:]]
    with (pytest.raises((LayoutMismatchError, ManifestError), match=name.replace(".", r"\.")),
          begin_update(engine.model, Manifest.from_named_tensors(good), rollback=True) as s):
        s.load(bad)
    assert_bitwise_equal(engine.model, _fresh(1).model)
    _whole_list_update(engine, _weights(3))
    assert_bitwise_equal(engine.model, _fresh(3).model)


def test_a_later_piece_repeating_a_key_already_loaded_is_refused_as_a_duplicate(small_pieces) -> None:
    engine = _fresh(0)
    _whole_list_update(engine, _weights(1))
    items = _weights(2)
    last_name = items[-1][0]
    with (pytest.raises(DuplicateTensorError, match=last_name.replace(".", r"\.")),
          begin_update(engine.model, Manifest.from_named_tensors(items), rollback=True) as s):
        s.load(items[-1:])  # the last key first ...
        s.load(items)  # ... then the recorded list: its last piece holds it again
    assert_bitwise_equal(engine.model, _fresh(1).model)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize(("arch", "quant"), [("qwen3", "fp8_per_channel"), ("qwen3", "fp8_block"),
                                           ("qwen3_moe", "fp8_block"),  # MoE offers no per-channel fp8
                                           ("qwen3", "fp8_per_tensor"), ("qwen3_moe", "fp8_per_tensor")])
@pytest.mark.parametrize("order", ["block order", "reversed"])
def test_a_list_into_band_quantized_layers_is_replayed_and_equals_a_fresh_quantized_load(arch, quant, device, order,
                                                                                         small_pieces) -> None:
    # Rows in multiples of 128: every q/k/v and gate/up band is whole 128x128 blocks, so fp8_block
    # layers take the band path too.
    cfg = hf_config(arch, "tiny", hidden_size=256, num_attention_heads=2, num_key_value_heads=1, head_dim=128,
                    intermediate_size=256, moe_intermediate_size=128)

    def weights(seed: int) -> list[tuple[str, torch.Tensor]]:
        items = [(n, t.contiguous()) for n, t in random_weights(cfg, seed=seed, device=device)]
        # Reversed, a one-scale matrix's bands (q, k, v; an expert's gate and up) still arrive together.
        return items if order == "block order" else items[::-1]

    def fresh(seed: int) -> ReferenceEngine:
        return ReferenceEngine.from_config(cfg, weights=random_weights(cfg, seed=seed, device=device),
                                           quantization=quant, device=device, use_cuda_graph=False)

    engine = fresh(0)
    for step, seed in enumerate((1, 2, 3, 1)):
        items = weights(seed)
        _whole_list_update(engine, items)
        # The engine's first processing makes the kernel tensors the bands are written into: from the
        # next update on the layers are band-quantized, and the list is recorded and then replayed.
        rec = get_state(engine.model).replays.get(tuple(n for n, _ in items))
        assert step < 2 or (isinstance(rec, ListReplay) and any(p.bands for p in rec.pieces)), step
        if step >= 2 and device == "cuda":  # launched from the tables made at the record
            assert all(b[4] is not None for p in rec.pieces for b in p.bands)
        assert_bitwise_equal(engine.model, fresh(seed).model)


def test_a_one_scale_matrix_split_over_two_lists_is_not_replayed_and_still_exact() -> None:
    engine = ReferenceEngine.from_config(CFG, weights=random_weights(CFG, seed=0), quantization="fp8",
                                         use_cuda_graph=False)
    for seed in (1, 2, 3):
        items = _weights(seed)
        cut = next(i for i, (n, _) in enumerate(items) if n.endswith("k_proj.weight"))  # q | k, v: one qkv scale
        with begin_update(engine.model, Manifest.from_named_tensors(items)) as s:
            s.load(items[:cut])
            s.load(items[cut:])
        replays = get_state(engine.model).replays
        assert not isinstance(replays.get(tuple(n for n, _ in items[:cut])), ListReplay)
        assert not isinstance(replays.get(tuple(n for n, _ in items[cut:])), ListReplay)
        fresh = ReferenceEngine.from_config(CFG, weights=random_weights(CFG, seed=seed), quantization="fp8",
                                            use_cuda_graph=False)
        assert_bitwise_equal(engine.model, fresh.model)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize(("arch", "quant"), [("qwen3", None), ("qwen3_moe", None), ("qwen3_moe", "fp8_block"),
                                           ("qwen3_moe", "fp8_per_tensor")])
def test_sources_updated_in_place_between_updates_replay_their_new_values_exactly(arch, quant, device,
                                                                                  small_pieces) -> None:
    # A trainer that updates its tensors in place sends the same memory at every step: on CUDA the
    # replay launches the tables it made at the first such update again, and must still copy (and
    # quantize) the new values.
    cfg = hf_config(arch, "tiny", hidden_size=256, num_attention_heads=2, num_key_value_heads=1, head_dim=128,
                    intermediate_size=256, moe_intermediate_size=128)
    source = [(n, t.contiguous()) for n, t in random_weights(cfg, seed=1, device=device)]

    def fresh(seed: int) -> ReferenceEngine:
        return ReferenceEngine.from_config(cfg, weights=random_weights(cfg, seed=seed, device=device),
                                           quantization=quant, device=device, use_cuda_graph=False)

    engine = fresh(0)
    tables: dict[int, object] = {}
    for step, seed in enumerate((1, 2, 3, 4, 2)):
        for (_, t), (_, new) in zip(source, random_weights(cfg, seed=seed, device=device), strict=True):
            t.copy_(new)  # in place: every source keeps its address
        _whole_list_update(engine, source)
        assert_bitwise_equal(engine.model, fresh(seed).model), step
        rec = get_state(engine.model).replays.get(tuple(n for n, _ in source))
        if device == "cuda" and step >= 3 and isinstance(rec, ListReplay):
            kept = {id(p): (p.small.last.tables, [b[4].last.tables for b in p.bands if b[4] is not None])
                    for p in rec.pieces}
            if step == 4:  # the same table objects as at the update before: launched again, not rebuilt
                assert all(kept[k][0] is tables[k][0] for k in kept)
                assert all(a is b for k in kept for a, b in zip(kept[k][1], tables[k][1], strict=True))
            tables = kept
