"""ModuleSource / CheckpointSource: manifests from metadata, block order, name mapping, dtype casts."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from tests.trainers.conftest import load_hf
from trainers import CheckpointSource, ModuleSource, NameMap, UnmappedNameError, strip_wrappers
from weight_sync.engine import ReferenceEngine
from weight_sync.layers import order_by_block
from weight_sync.transport import TransportConfig, WeightReceiver, WeightSender, check_block_order


def test_manifest_comes_from_metadata_of_a_model_on_the_meta_device(qwen3_b: Path) -> None:
    import transformers

    config = transformers.AutoConfig.from_pretrained(str(qwen3_b))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    manifest = ModuleSource(model).manifest(version=7)
    assert manifest.version == 7
    assert set(manifest.names) == set(CheckpointSource(qwen3_b).manifest().names)
    check_block_order(manifest.names)
    assert manifest.names[0] == "model.embed_tokens.weight" and manifest.names[-1] == "lm_head.weight"


def _send_in_threads(source, manifest, engine, **cfg) -> object:
    """A sender and a receiver in two threads of this process (their gloo groups are separate)."""
    sender = WeightSender(TransportConfig(backend="gloo", bucket_bytes=64 << 10, timeout_s=30, **cfg))
    receiver = WeightReceiver(engine, sender.address, 1)
    t = threading.Thread(target=receiver.connect)
    t.start()
    sender.connect()
    t.join()
    out: dict = {}
    t = threading.Thread(target=lambda: out.setdefault("report", receiver.receive_update()))
    t.start()
    sender.send(source, manifest, version=1)
    t.join()
    sender.close()
    receiver.close()
    return out["report"]


def test_an_hf_model_sent_over_the_transport_equals_a_fresh_engine_load(hf_b, qwen3_a: Path, qwen3_b: Path) -> None:
    source = ModuleSource(hf_b)
    engine = ReferenceEngine.from_checkpoint(qwen3_a)
    report = _send_in_threads(source, source.manifest(), engine)
    assert report.fingerprint == ReferenceEngine.from_checkpoint(qwen3_b).fingerprint()


def test_fp32_trainer_weights_are_cast_to_the_wire_dtype_on_the_fly(qwen3_a: Path, qwen3_b: Path) -> None:
    model = load_hf(qwen3_b, torch.float32)
    source = ModuleSource(model, dtype=torch.bfloat16)
    assert {m.dtype for m in source.manifest()} == {torch.bfloat16}
    engine = ReferenceEngine.from_checkpoint(qwen3_a)
    report = _send_in_threads(source, source.manifest(), engine)
    # The checkpoint is bf16, so fp32 -> bf16 recovers it exactly.
    assert report.fingerprint == ReferenceEngine.from_checkpoint(qwen3_b).fingerprint()


def test_source_tensors_follow_the_manifest_order(hf_b) -> None:
    source = ModuleSource(hf_b)
    assert [n for n, _ in source] == list(source.manifest().names)
    names = list(source.manifest().names)
    assert order_by_block(names, reference_order=names) == names


def test_wrapper_segments_are_stripped_from_names() -> None:
    assert strip_wrappers("_orig_mod.model.layers.0._checkpoint_wrapped_module.mlp.up_proj.weight") == (
        "model.layers.0.mlp.up_proj.weight"
    )
    assert strip_wrappers("module.base_model.model.lm_head.weight") == "lm_head.weight"


def test_a_compiled_model_keeps_hf_names() -> None:
    inner = torch.nn.Sequential(torch.nn.Linear(2, 2))
    wrapper = torch.nn.Module()
    wrapper._orig_mod = inner
    assert [e.name for e in ModuleSource(wrapper).entries] == ["0.weight", "0.bias"]


def test_a_dict_name_map_reports_every_unmapped_name_at_once(hf_b) -> None:
    mapping = {"model.embed_tokens.weight": "model.embed_tokens.weight"}
    with pytest.raises(UnmappedNameError) as info:
        ModuleSource(hf_b, NameMap(mapping))
    err = info.value
    assert len(err.names) == len(list(hf_b.named_parameters())) - 1
    assert "lm_head.weight" in err.names and "24 trainer tensor(s)" in str(err) and "map them" in str(err)


def test_rules_rename_and_none_skips() -> None:
    model = torch.nn.Module()
    model.h = torch.nn.ModuleList([torch.nn.Linear(2, 2, bias=False) for _ in range(2)])
    model.wte = torch.nn.Embedding(4, 2)
    rules = NameMap.from_rules([(r"^h\.(\d+)\.", r"model.layers.\1.mlp.up_proj."), (r"^wte\.", "model.embed_tokens.")])
    names = [e.name for e in ModuleSource(model, rules).entries]
    # Un-indexed names keep their side of the blocks from the module's registration order.
    assert names == ["model.layers.0.mlp.up_proj.weight", "model.layers.1.mlp.up_proj.weight", "model.embed_tokens.weight"]
    skip = NameMap(lambda n: None if n.startswith("wte") else n)
    assert [e.name for e in ModuleSource(model, skip).entries] == ["h.0.weight", "h.1.weight"]


def test_two_trainer_names_mapped_to_one_engine_name_are_refused() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    with pytest.raises(UnmappedNameError, match="engine names must be unique"):
        ModuleSource(model, NameMap(lambda n: "x.weight"))


def test_checkpoint_source_yields_its_manifest_in_order(qwen3_b: Path) -> None:
    src = CheckpointSource(qwen3_b)
    assert [n for n, _ in src] == list(src.manifest().names)
    check_block_order(src.manifest().names)
