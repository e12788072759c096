"""Predict weight-sync time past this machine: the real route planner on real model shapes and layouts.

For each scenario (a model's shape table, an FSDP trainer of N GPUs, E engines of TP/EP width T on 8-GPU
nodes), the route planner of ``weight_sync.transport.routes`` (the code a sharded sync would run, not a
copy) plans the sharded transfer from shape-only descriptors - nothing is allocated - and the byte
accounting gives the bytes every link carries. Two designs are compared:

- broadcast from one rank (today's sender): the trainer assembles full tensors (FSDP all-gather: every
  trainer GPU receives (N-1)/N of the model) and rank 0 broadcasts each whole tensor to every engine GPU
  (pipelined, so every link on the way carries the model once);
- the sharded plan: every trainer GPU sends its regions straight to the engine GPUs that need them.

Trainer and engine GPUs sit on different nodes, so every byte of the sync crosses one NIC per GPU
(``--nic-GBps``, one direction); the FSDP gather runs over NVLink (``--nvlink-GBps``) when the trainer fits
in one node. A design's predicted time is the time its busiest link needs (a lower bound: no packing,
no control plane, perfect overlap of the gather with the broadcast). Published measurements are shown
beside the predictions; they include everything the bound leaves out.

Run: ``.venv/bin/python benchmarks/sim_scale.py`` (full shapes, ~1 min on 2 cores) or ``--small`` (two
layers per model, seconds; what CI runs). Writes sim_scale.{json,md,png} under benchmarks/results/.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS, env_markdown, environment

from weight_sync.engine.config import ModelConfig
from weight_sync.testing.checkpoint import MOE_PRESETS, PRESETS, hf_config
from weight_sync.transport.routes import plan_routes
from weight_sync.transport.routes_layouts import fsdp_holdings
from weight_sync.transport.routes_reference import (
    reference_checkpoint_metas,
    reference_engine_needs,
)

GPUS_PER_NODE = 8
# The source of the published numbers, as issue 17 and ../shared/PRIOR_ART.md cite them.
SOURCE = "vLLM sharded RDT (NIXL pull) as cited in issue 17 / PRIOR_ART.md"


def _qwen3_235b() -> ModelConfig:
    # Qwen/Qwen3-235B-A22B config.json: 94 layers, 128 experts (top-8) of width 1536, 64 q / 4 kv heads.
    return ModelConfig(
        arch="qwen3_moe", vocab_size=151936, hidden_size=4096, num_hidden_layers=94,
        num_attention_heads=64, num_key_value_heads=4, head_dim=128, intermediate_size=12288,
        num_experts=128, num_experts_per_tok=8, moe_intermediate_size=1536, norm_topk_prob=True,
    )


def _kimi_k2_sized() -> ModelConfig:
    # Kimi-K2's sizes (hidden 7168, 61 layers, first one dense of width 18432, 384 experts of width
    # 2048, vocab 163840) in the reference engine's Qwen3-MoE form: GQA 64 q / 8 kv heads of 128
    # stand in for MLA and the shared expert is left out (~1.03T parameters vs Kimi-K2's 1.04T).
    return ModelConfig(
        arch="qwen3_moe", vocab_size=163840, hidden_size=7168, num_hidden_layers=61,
        num_attention_heads=64, num_key_value_heads=8, head_dim=128, intermediate_size=18432,
        num_experts=384, num_experts_per_tok=8, moe_intermediate_size=2048, mlp_only_layers=(0,),
        norm_topk_prob=True,
    )


MODELS = {
    "Qwen3-8B": lambda: ModelConfig.from_hf_dict(hf_config("qwen3", "qwen3-8b")),
    "Qwen3-30B-A3B": lambda: ModelConfig.from_hf_dict(hf_config("qwen3_moe", "qwen3-30b-a3b")),
    "Qwen3-235B-A22B": _qwen3_235b,
    "Kimi-K2-sized": _kimi_k2_sized,
}
assert "qwen3-8b" in PRESETS and "qwen3-30b-a3b" in MOE_PRESETS


@dataclass(frozen=True, kw_only=True, slots=True)
class Scenario:
    """One model on one layout, with what was published for it (None: nothing)."""

    model: str
    trainer_gpus: int
    engines: int
    tp: int
    expert_parallel: bool
    published_broadcast_s: float | None = None
    published_sharded_s: float | None = None
    note: str = ""

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise ValueError(f"model must be one of {sorted(MODELS)}, got {self.model!r}")
        for f in ("trainer_gpus", "engines", "tp"):
            if getattr(self, f) < 1:
                raise ValueError(f"{f} must be >= 1, got {getattr(self, f)}")

    @property
    def layout(self) -> str:
        par = "EP" if self.expert_parallel else "TP"
        return f"{self.trainer_gpus} FSDP -> {self.engines} x {par}{self.tp}"


SCENARIOS = (
    Scenario(model="Qwen3-8B", trainer_gpus=64, engines=8, tp=8, expert_parallel=False),
    Scenario(model="Qwen3-30B-A3B", trainer_gpus=64, engines=8, tp=8, expert_parallel=True),
    Scenario(model="Qwen3-235B-A22B", trainer_gpus=64, engines=8, tp=8, expert_parallel=True),
    Scenario(model="Qwen3-235B-A22B", trainer_gpus=16, engines=2, tp=8, expert_parallel=True,
             published_broadcast_s=64.72, published_sharded_s=3.49,
             note="published: 2 trainer + 2 inference nodes; NCCL broadcast vs pipelined EP-local sharded"),
    Scenario(model="Kimi-K2-sized", trainer_gpus=256, engines=4, tp=32, expert_parallel=True,
             published_sharded_s=7.53,
             note="published: 32 trainer + 16 inference 8xH100 nodes, 7.9 TB moved (4 engine copies "
                  "assumed), speed of light ~1.25 s"),
)


def simulate(s: Scenario, *, nic_gbps: float, nvlink_gbps: float, layers: int | None = None) -> dict[str, Any]:
    """Plan the sharded sync of ``s`` and bound both designs' times by their busiest link."""
    cfg = MODELS[s.model]()
    if layers is not None:
        cfg = replace(cfg, num_hidden_layers=layers,
                      mlp_only_layers=tuple(i for i in cfg.mlp_only_layers if i < layers))
    t0 = time.perf_counter()
    metas = reference_checkpoint_metas(cfg)
    plan = plan_routes(
        fsdp_holdings(metas, s.trainer_gpus),
        reference_engine_needs(cfg, tp_size=s.tp, num_engines=s.engines, expert_parallel=s.expert_parallel),
    )
    sent, received, needed = plan.bytes_sent(), plan.bytes_received(), plan.needed_bytes()
    plan_s = time.perf_counter() - t0
    model = plan.model_bytes
    nic = nic_gbps * 1e9
    # Broadcast: the all-gather gives every trainer GPU (N-1)/N of the model (NVLink inside one node,
    # else the NIC bounds the ring); the pipelined broadcast then carries the model over every link.
    gather_bytes = model * (s.trainer_gpus - 1) // s.trainer_gpus
    gather_bw = nvlink_gbps * 1e9 if s.trainer_gpus <= GPUS_PER_NODE else nic
    bcast_link = model
    bcast_s = max(gather_bytes / gather_bw, bcast_link / nic)
    busiest_sent, busiest_recv = max(sent.values()), max(received.values())
    sharded_link = max(busiest_sent, busiest_recv)
    sharded_s = sharded_link / nic
    return {
        "model": s.model, "layout": s.layout, "note": s.note,
        "params": sum(m.numel for m in metas), "model_bytes": model,
        "num_tensors": len(metas), "trainer_gpus": s.trainer_gpus, "engines": s.engines, "tp": s.tp,
        "expert_parallel": s.expert_parallel, "plan_s": plan_s,
        "broadcast": {"gather_bytes_per_gpu": gather_bytes, "busiest_link_bytes": bcast_link,
                      "gather_s": gather_bytes / gather_bw, "broadcast_s": bcast_link / nic,
                      "bound_s": bcast_s},
        "sharded": {
            "busiest_link_bytes": sharded_link,
            "busiest_link": "trainer NIC egress" if busiest_sent >= busiest_recv else "engine NIC ingress",
            "sent_bytes_min_max": [min(sent.values()), busiest_sent],
            "received_bytes_min_max": [min(received.values()), busiest_recv],
            "received_bytes_by_engine_rank": [received[d] for d in sorted(received)],
            "num_links": len(plan.bytes_per_link()),
            "received_equals_needed": received == needed,
            "total_bytes": sum(received.values()),
            "bound_s": sharded_s,
        },
        "speedup": bcast_s / sharded_s,
        "published": {"broadcast_s": s.published_broadcast_s, "sharded_s": s.published_sharded_s,
                      "source": SOURCE if (s.published_broadcast_s or s.published_sharded_s) else None},
    }


def _gb(n: float) -> str:
    return f"{n / 1e9:,.1f}"


def _published(x: float | None, bound: float) -> str:
    return "-" if x is None else f"{x:.2f} ({x / bound:.1f}x bound)"


def markdown(rows: list[dict[str, Any]], args: argparse.Namespace, env: dict[str, Any]) -> str:
    """The table: predicted bounds of both designs beside the published measurements."""
    out = [
        "# Weight sync past one machine: predicted by the route planner",
        "",
        f"Links: one NIC per GPU at {args.nic_GBps} GB/s per direction, NVLink {args.nvlink_GBps} GB/s "
        f"per GPU, {GPUS_PER_NODE} GPUs per node; trainer and engines on different nodes. Bound = bytes "
        "on the busiest link / its bandwidth (no packing, control plane or overlap losses). Published "
        f"numbers: {SOURCE}.",
        "",
        "| model | params | bf16 GB | layout | broadcast: busiest link GB | broadcast bound s | sharded: "
        "busiest link GB (which) | sharded bound s | ratio | published broadcast s | published sharded s "
        "| plan s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        b, sh, p = r["broadcast"], r["sharded"], r["published"]
        out.append(
            f"| {r['model']} | {r['params'] / 1e9:,.1f}B | {_gb(r['model_bytes'])} | {r['layout']} | "
            f"{_gb(b['busiest_link_bytes'])} (+{_gb(b['gather_bytes_per_gpu'])} gather) | "
            f"{b['bound_s']:.2f} | {_gb(sh['busiest_link_bytes'])} ({sh['busiest_link']}) | "
            f"{sh['bound_s']:.2f} | {r['speedup']:.1f}x | {_published(p['broadcast_s'], b['bound_s'])} | "
            f"{_published(p['sharded_s'], sh['bound_s'])} | {r['plan_s']:.2f} |"
        )
    notes = [f"- {r['model']}, {r['layout']}: {r['note']}" for r in rows if r["note"]]
    out += ["", *notes, "",
            "Every engine GPU receives exactly the bytes of its shard (checked: received == needed on "
            "every engine rank); broadcast delivers the whole model to each.",
            "", "## Environment", env_markdown(env), ""]
    return "\n".join(out)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Bars of both bounds per scenario (log scale), published measurements as markers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.5))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["broadcast"]["bound_s"] for r in rows], 0.4,
           label="broadcast from one rank (bound)")
    ax.bar([x + 0.2 for x in xs], [r["sharded"]["bound_s"] for r in rows], 0.4, label="sharded plan (bound)")
    for x, r in zip(xs, rows):
        p = r["published"]
        if p["broadcast_s"]:
            ax.plot(x - 0.2, p["broadcast_s"], "kv", label="published broadcast" if x == 3 else None)
        if p["sharded_s"]:
            ax.plot(x + 0.2, p["sharded_s"], "k^", label="published sharded" if x == 3 else None)
    ax.set_xticks(list(xs), [f"{r['model']}\n{r['layout']}" for r in rows], fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("sync time, s")
    ax.set_title("Predicted weight-sync bounds (busiest link) vs published")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nic-GBps", type=float, default=50.0, help="per-GPU NIC, one direction (400 Gb/s)")
    ap.add_argument("--nvlink-GBps", type=float, default=450.0, help="per-GPU NVLink, one direction (H100)")
    ap.add_argument("--small", action="store_true", help="two layers per model (CI: seconds)")
    ap.add_argument("--out", type=Path, default=RESULTS, help="directory for the result files")
    ap.add_argument("--name", default=None, help="result file stem (default sim_scale[_small])")
    args = ap.parse_args(argv)
    if args.nic_GBps <= 0 or args.nvlink_GBps <= 0:
        ap.error(f"bandwidths must be positive, got {args.nic_GBps} and {args.nvlink_GBps}")
    layers = 2 if args.small else None
    rows = [simulate(s, nic_gbps=args.nic_GBps, nvlink_gbps=args.nvlink_GBps, layers=layers)
            for s in SCENARIOS]
    env = environment()
    md = markdown(rows, args, env)
    name = args.name or ("sim_scale_small" if args.small else "sim_scale")
    args.out.mkdir(parents=True, exist_ok=True)
    import json

    payload = {"env": env, "nic_GBps": args.nic_GBps, "nvlink_GBps": args.nvlink_GBps,
               "small": args.small, "rows": rows}
    (args.out / f"{name}.json").write_text(json.dumps(payload, indent=1, default=str))
    (args.out / f"{name}.md").write_text(md)
    plot(rows, args.out / f"{name}.png")
    print(md)
    return rows


if __name__ == "__main__":
    main()
