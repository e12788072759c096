"""The shared layer machinery: block grouping, graph-visible tensors, meta records, manifests."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from weight_sync import Manifest, ManifestError, PointerChangedError, TensorMeta
from weight_sync.layers import (
    block_key,
    capture_layer,
    graph_visible_tensors,
    group_by_block,
    order_by_block,
    rematerialize,
    signatures,
    verify_signatures,
)
from weight_sync.manifest import tensor_checksum


def test_names_group_by_their_outermost_integer_segment() -> None:
    assert block_key("model.layers.3.mlp.up_proj.weight").name == "model.layers.3"
    assert block_key("model.layers.3.mlp.experts.7.w1.weight").name == "model.layers.3"
    assert block_key("transformer.blocks.12.attn.qkv.weight").name == "transformer.blocks.12"


def test_unindexed_names_form_pre_and_post_groups_in_forward_order() -> None:
    names = ["lm_head.weight", "model.layers.10.a", "model.norm.weight", "model.layers.2.b",
             "model.embed_tokens.weight", "model.layers.2.mlp.experts.7.w"]
    groups = group_by_block(names)
    assert [k.name for k in groups] == ["<pre>", "model.layers.2", "model.layers.10", "<post>"]
    assert groups[next(iter(groups))] == ["model.embed_tokens.weight"]
    assert order_by_block(names)[:3] == ["model.embed_tokens.weight", "model.layers.2.b",
                                         "model.layers.2.mlp.experts.7.w"]


def test_a_reference_order_decides_pre_and_post_for_unindexed_names() -> None:
    ref = ["proj_a.weight", "blocks.0.w", "blocks.1.w", "proj_b.weight"]
    groups = group_by_block(["proj_b.weight", "blocks.1.w", "proj_a.weight"], reference_order=ref)
    assert [k.kind for k in groups] == ["pre", "block", "post"]


class WithAttrs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4, 2))
        self.register_buffer("scale", torch.ones(4))
        self.workspace = torch.zeros(3)


def test_graph_visible_tensors_include_parameters_buffers_and_tensor_attributes() -> None:
    assert set(graph_visible_tensors(WithAttrs())) == {"weight", "scale", "workspace"}


def test_rematerialized_tensors_are_zero_filled_with_class_layout_and_attributes() -> None:
    layer = WithAttrs()
    layer.weight.weight_loader = print
    records = capture_layer(layer)
    t = rematerialize(records["weight"], "cpu")
    assert isinstance(t, nn.Parameter) and t.weight_loader is print
    assert t.shape == (4, 2) and t.stride() == (2, 1) and not t.any()


def test_verify_signatures_names_a_tensor_that_moved() -> None:
    layer = WithAttrs()
    before = signatures(layer)
    layer.workspace = torch.zeros(3)
    with pytest.raises(PointerChangedError, match="workspace"):
        verify_signatures(layer, before)


def test_manifests_round_trip_through_json_and_reject_duplicates() -> None:
    m = Manifest((TensorMeta("a", torch.bfloat16, (2, 3), checksum=7),
                  TensorMeta("b", torch.float8_e4m3fn, (4,))), version=3)
    back = Manifest.from_json(m.to_json())
    assert back == m and back.version == 3 and back["a"].checksum == 7
    with pytest.raises(ManifestError, match="twice"):
        Manifest((TensorMeta("a", torch.float32, (1,)), TensorMeta("a", torch.float32, (1,))))
    with pytest.raises(ManifestError, match="not valid JSON"):
        Manifest.from_json("{")


def test_tensor_checksum_sees_one_flipped_byte_and_swapped_words() -> None:
    t = torch.arange(64, dtype=torch.float32)
    base = tensor_checksum(t)
    flipped = t.clone()
    flipped.view(torch.uint8)[17] ^= 1
    swapped = t.clone()
    swapped[[3, 4]] = swapped[[4, 3]]
    assert tensor_checksum(flipped) != base and tensor_checksum(swapped) != base
    assert tensor_checksum(t.clone()) == base
