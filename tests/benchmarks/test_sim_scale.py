"""benchmarks/sim_scale.py runs small in seconds and its table's claims hold."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import torch

from tests.transport._routes_ranks import FixedTP
from weight_sync.engine.model import CausalLM
from weight_sync.engine.parallel import pad_vocab

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "sim_scale.py"


def _load_sim():
    spec = importlib.util.spec_from_file_location("sim_scale", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("sim_scale", module)
    spec.loader.exec_module(module)
    return module


def test_the_small_simulation_writes_a_table_whose_claims_are_consistent(tmp_path: Path) -> None:
    sim = _load_sim()
    rows = sim.main(["--small", "--out", str(tmp_path), "--name", "sim"])
    payload = json.loads((tmp_path / "sim.json").read_text())
    assert payload["rows"] == json.loads(json.dumps(rows, default=str))
    assert (tmp_path / "sim.png").stat().st_size > 0
    table = (tmp_path / "sim.md").read_text()
    for r in rows:
        b, s = r["broadcast"], r["sharded"]
        assert r["layout"] in table
        # Every engine GPU receives exactly its shard; together the engines receive E x the model's
        # sharded bytes, never less than E whole models' worth of distinct data.
        assert s["received_equals_needed"]
        assert s["total_bytes"] >= r["engines"] * r["model_bytes"]
        assert s["busiest_link_bytes"] <= b["busiest_link_bytes"]
        assert s["bound_s"] <= b["bound_s"]
        assert r["speedup"] == b["bound_s"] / s["bound_s"]
    published = [r for r in rows if r["published"]["sharded_s"]]
    assert {r["model"] for r in published} == {"Qwen3-235B-A22B", "Kimi-K2-sized"}
    assert "64.72" in table and "3.49" in table and "7.53" in table


def test_an_engine_gpu_receives_the_bytes_of_its_own_parameters_in_the_simulation() -> None:
    sim = _load_sim()
    s = sim.Scenario(model="Qwen3-8B", trainer_gpus=16, engines=2, tp=8, expert_parallel=False)
    row = sim.simulate(s, nic_gbps=50.0, nvlink_gbps=450.0, layers=2)
    cfg = sim.MODELS["Qwen3-8B"]()
    cfg = type(cfg)(**{**cfg.to_dict(), "num_hidden_layers": 2, "dtype": torch.bfloat16})
    # The engine rank's own parameters, built on meta (no memory), minus the vocabulary padding rows
    # that no checkpoint row fills (the last rank's, in the embedding and the head).
    received = row["sharded"]["received_bytes_by_engine_rank"]
    assert len(received) == 16
    for rank in range(8):
        model = CausalLM(cfg, tp=FixedTP(fixed_size=8, fixed_rank=rank), device="meta")
        shard = sum(p.numel() * p.element_size() for p in model.parameters())
        pad_rows = pad_vocab(cfg.vocab_size, 8) - cfg.vocab_size if rank == 7 else 0
        expected = shard - 2 * pad_rows * cfg.hidden_size * 2  # embedding + head, bf16
        assert received[rank] == received[8 + rank] == expected, rank
