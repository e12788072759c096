"""MoE over two gloo ranks: experts split inside (TP) or as whole experts (EP) give one rank's results."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from weight_sync.engine import ReferenceEngine
from weight_sync.testing import bitwise_equal, kernel_tensors, make_checkpoint, run_distributed

PROMPT = [[5, 6, 7, 8, 9, 10]]
EXPERTS = "model.layers.0.mlp.experts."


def _experts(engine: ReferenceEngine) -> dict[str, torch.Tensor]:
    """Layer 0's expert tensors, fp8 as their bytes (uint8): fp8 storages do not unpickle in the parent."""
    return {
        k: (v.view(torch.uint8) if v.dtype == torch.float8_e4m3fn else v).detach().clone()
        for k, v in kernel_tensors(engine.model).items() if k.startswith(EXPERTS)
    }


def _on_rank(rank: int, world: int, a: str, b: str) -> dict[str, Any]:
    group = dist.group.WORLD
    out: dict[str, Any] = {}
    for mode in ("tp", "ep"):
        ep = mode == "ep"
        engine = ReferenceEngine.from_checkpoint(a, dtype=torch.float32, tp_group=group, expert_parallel=ep)
        out[f"{mode}_logits"] = engine.logits(PROMPT)
        out[f"{mode}_tokens"] = engine.generate(PROMPT, 4)
        for quant in ("fp8", "fp8_block"):
            q = ReferenceEngine.from_checkpoint(a, quantization=quant, tp_group=group, expert_parallel=ep)
            out[f"{mode}_{quant}"] = _experts(q)
    for mode in ("tp", "ep"):
        for quant in (None, "fp8", "fp8_block"):
            # A reload of B into an engine on A equals a fresh engine on B (quantized experts are
            # processed expert by expert on the reload, as their keys arrive).
            ep = mode == "ep"
            engine = ReferenceEngine.from_checkpoint(a, quantization=quant, tp_group=group, expert_parallel=ep)
            report = engine.reload_weights(b)
            fresh = ReferenceEngine.from_checkpoint(b, quantization=quant, tp_group=group, expert_parallel=ep)
            got, want = kernel_tensors(engine.model), kernel_tensors(fresh.model)
            out[f"reload_{mode}_{quant}"] = sorted(n for n in want if not bitwise_equal(got[n], want[n]))
            out[f"ignored_{mode}_{quant}"] = [n for n in report.keys_ignored if n.startswith("model.layers.0.")]
            out[f"report_{mode}_{quant}"] = (report.layers_per_unit, report.units_processed,
                                             report.peak_buffered_bytes)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], Path]:
    root = tmp_path_factory.mktemp("moe_parallel")
    a = make_checkpoint(root / "a", arch="qwen3_moe", vocab_size=1000, seed=0, tokenizer=False)
    b = make_checkpoint(root / "b", arch="qwen3_moe", vocab_size=1000, seed=1, tokenizer=False)
    return run_distributed(_on_rank, 2, str(a), str(b)), a


@pytest.mark.parametrize("mode", ["tp", "ep"])
def test_tp2_and_ep2_logits_and_tokens_equal_tp1(mode: str, results) -> None:
    ranks, a = results
    ref = ReferenceEngine.from_checkpoint(a, dtype=torch.float32)
    for r in ranks:
        torch.testing.assert_close(r[f"{mode}_logits"], ref.logits(PROMPT))
        assert r[f"{mode}_tokens"] == ref.generate(PROMPT, 4)


def test_tp2_fp8_experts_are_row_and_column_slices_of_tp1_with_the_same_scales(results) -> None:
    ranks, a = results
    one = _experts(ReferenceEngine.from_checkpoint(a, quantization="fp8"))
    w13, w2 = one[EXPERTS + "w13_weight"], one[EXPERTS + "w2_weight"]
    for rank, r in enumerate(ranks):
        got = r["tp_fp8"]
        rows = slice(rank * 32, rank * 32 + 32)  # moe_intermediate_size 64 over 2 ranks
        gate_up = torch.cat([w13[:, :64][:, rows], w13[:, 64:][:, rows]], dim=1)
        assert torch.equal(got[EXPERTS + "w13_weight"], gate_up)
        assert torch.equal(got[EXPERTS + "w2_weight"], w2[:, :, rows])
        # Scales MAX-reduced over the ranks that split an expert: the unsplit expert's scale.
        for name in ("w13_weight_scale", "w2_weight_scale"):
            assert torch.equal(got[EXPERTS + name], one[EXPERTS + name])


@pytest.mark.parametrize("quant", ["fp8", "fp8_block"])
def test_ep2_ranks_hold_whole_experts_identical_to_tp1s(quant: str, results) -> None:
    ranks, a = results
    one = _experts(ReferenceEngine.from_checkpoint(a, quantization=quant))
    for rank, r in enumerate(ranks):
        got = r[f"ep_{quant}"]
        assert set(got) == set(one)
        for name, t in one.items():  # rank r holds experts 4r..4r+3 (8 experts over 2 ranks)
            assert bitwise_equal(got[name], t[rank * 4 : rank * 4 + 4]), name


@pytest.mark.parametrize("quant", [None, "fp8", "fp8_block"])
def test_ep2_reload_equals_fresh_and_each_rank_ignores_the_others_experts(quant, results) -> None:
    ranks, _ = results
    for rank, r in enumerate(ranks):
        assert r[f"reload_ep_{quant}"] == []
        others = range(4, 8) if rank == 0 else range(4)
        assert sorted(r[f"ignored_ep_{quant}"]) == sorted(
            f"{EXPERTS}{e}.{p}.weight" for e in others for p in ("gate_proj", "up_proj", "down_proj")
        )


@pytest.mark.parametrize("mode", ["tp", "ep"])
@pytest.mark.parametrize("quant", ["fp8", "fp8_block"])
def test_tp2_and_ep2_reloads_process_each_local_expert_on_its_own_bitwise_equal_to_fresh(
    mode: str, quant: str, results
) -> None:
    ranks, _ = results
    # TP inside experts: every rank holds all 8 experts at half width (w13 [64, 128] + w2 [128, 32]
    # bf16 staging each); EP: 4 whole experts per rank (w13 [128, 128] + w2 [128, 64]).
    local, one_expert = (8, (64 * 128 + 128 * 32) * 2) if mode == "tp" else (4, (128 * 128 + 128 * 64) * 2)
    for r in ranks:
        assert r[f"reload_{mode}_{quant}"] == []
        per_unit, units, peak = r[f"report_{mode}_{quant}"]
        if mode == "ep" and quant == "fp8":
            # Whole experts per rank: per-tensor scales need no reduction, so each expert's bands are
            # quantized together from the stream (reload/writes.py) - no unit staging at all.
            assert per_unit == () and units == 0 and peak < one_expert
            continue
        assert per_unit == ("model.layers.0.mlp.experts", "model.layers.1.mlp.experts")
        assert units == 2 * local
        assert peak < local * one_expert  # never the whole experts layer's staging


def test_tp2_reload_without_quantization_writes_experts_in_place(results) -> None:
    ranks, _ = results
    for r in ranks:
        assert r["reload_tp_None"] == [] and r["report_tp_None"] == ((), 0, 0)
