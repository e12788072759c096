"""The transport benchmark's report: markdown table, throughput plot and time-per-phase plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["bound_note", "checks", "control", "control_budget_s", "cpu", "markdown", "plot", "plot_phases", "waits"]


def bound_note(r: dict[str, Any], quantization: str | None) -> str:
    """'; 1.52x the fp8_block bound (8.57 ms)' for a row that measured its format's bound, else ''."""
    if "bound_s" not in r:
        return ""
    return f"; {r['ratio_vs_bound']:.2f}x the {quantization} bound ({r['bound_s'] * 1e3:.2f} ms)"


def waits(w: dict[str, int] | None) -> str:
    """'readback 1, comm 40 (12 blocked)': the nonzero host waits of one update."""
    if not w:
        return "n/a"
    parts = [f"{k} {v}" for k, v in w.items() if v and k != "blocked"]
    return ", ".join(parts) + f" ({w.get('blocked', 0)} blocked)"


def control_budget_s(num_tensors: int) -> float:
    """Issue 15's control-plane goal per update: ~1 ms plus ~2 us per tensor of host time."""
    return 1e-3 + 2e-6 * num_tensors


def control(r: dict[str, Any], num_tensors: int) -> str:
    if "control_seconds" not in r:
        return "n/a"
    return f"{r['control_seconds'] * 1e3:.2f} ({control_budget_s(num_tensors) * 1e3:.2f})"


def cpu(r: dict[str, Any]) -> str:
    if "sender_cpu_seconds" not in r:
        return "n/a"
    return f"{r['sender_cpu_seconds'] * 1e3:.2f} / {r.get('engine_cpu_seconds', 0.0) * 1e3:.2f}"


def checks(run: dict[str, Any]) -> str:
    """Which guarantees ran in the row: manifest validation and pointer audit always, checksums as set."""
    ck = "checksums" if run.get("checksum", True) else "no checksums"
    return f"manifest, audit, commit vote, {ck}"


def markdown(result: dict[str, Any]) -> str:
    env = result["environment"]
    lines = [f"# Transport benchmark ({result['tag']})", "", f"Command: `{env['command']}`  ",
             f"Date: {env['date']}; torch {env['torch']}; {env.get('gpus') or str(env['cpus']) + ' CPUs'}", ""]
    for run in result["runs"]:
        lines += [f"## {run['backend']}{' zero-copy' if run.get('zero_copy') else ''}, engine quantization {run['quantization'] or 'none'}, "
                  f"verify {run.get('verify', 'before_load')}", "",
                  f"{run['num_tensors']} tensors, {run['num_bytes'] / 1e9:.3f} GB per update, largest block "
                  f"{run['largest_block_bytes'] / 1e6:.1f} MB.", ""]
        baseline = "raw broadcast" if run["backend"] in ("nccl", "gloo") else "one device copy"
        lines.append(f"| bucket MB | buckets | update s (start..commit) | data s | control ms (budget) | "
                     "host CPU ms trainer / engine | call s (update_weights) | "
                     f"data GB/s | {baseline} s | data / call / end-to-end vs baseline | extra engine MB (bound) | "
                     "checks | host waits per update: trainer / engine |")
        lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in run["rows"]:
            if "raw_s" in r:
                base = f"{r['raw_s']:.4f} ({r['raw_gbps']:.1f} GB/s)"
                ratio = (f"{r['data_ratio_vs_raw']:.3f}x / {r['call_ratio_vs_raw']:.3f}x / {r['ratio_vs_raw']:.3f}x "
                         "of raw throughput")
            else:
                base = f"{r['copy_s']:.4f}"
                ratio = (f"{r['data_ratio_vs_copy']:.2f}x / {r['call_ratio_vs_copy']:.2f}x / {r['ratio_vs_copy']:.2f}x "
                         "the copy time" + bound_note(r, run["quantization"]))
            mem = (f"{r['extra_engine_bytes'] / 1e6:.0f} ({r['memory_bound_bytes'] / 1e6:.0f})"
                   if "extra_engine_bytes" in r else "n/a (CPU)")
            lines.append(f"| {r['bucket_mb']} | {r['num_buckets']} | {r['seconds']:.4f} | {r['data_seconds']:.4f} | "
                         f"{control(r, run['num_tensors'])} | {cpu(r)} | "
                         f"{r['call_seconds']:.4f} | {r['data_gbps']:.2f} | {base} | {ratio} | {mem} | {checks(run)} | "
                         f"{waits(r.get('sender_waits'))} / {waits(r.get('engine_waits'))} |")
        lines.append("")
    if result.get("baseline"):
        b = result["baseline"]
        where = f"commit {b['commit']}" if b.get("commit") else f"the code in {b['code']}, commit not known"
        lines += [f"## Baseline: the previous code path ({where}), same arguments, in this run", ""]
        lines += ["| backend | bucket MB | update s (start..commit) | data s | control ms (budget) | "
                  "host CPU ms trainer / engine | ours: control ms | ours: host CPU ms trainer / engine |",
                  "|---|---|---|---|---|---|---|---|"]
        ours = {(r["backend"], r.get("zero_copy"), r["quantization"]): r for r in result["runs"]}
        for run in b["runs"]:
            mine = ours.get((run["backend"], run.get("zero_copy"), run["quantization"]))
            for k, r in enumerate(run["rows"]):
                m = mine["rows"][k] if mine and k < len(mine["rows"]) else {}
                name = f"{run['backend']}{'+zc' if run.get('zero_copy') else ''}"
                lines.append(f"| {name} | {r['bucket_mb']} | {r['seconds']:.4f} | {r['data_seconds']:.4f} | "
                             f"{control(r, run['num_tensors'])} | {cpu(r)} | "
                             f"{control(m, run['num_tensors']) if m else 'n/a'} | {cpu(m) if m else 'n/a'} |")
        lines.append("")
    if result.get("rss"):
        rss = result["rss"]
        lines += ["## RSS over repeated updates (gloo, CPU)", "",
                  f"{rss['updates']} consecutive updates after 10 warm-up updates: trainer RSS "
                  f"{rss['trainer_rss_after_warmup'] / 1e6:.1f} MB before, "
                  f"{rss['trainer_rss_last'] / 1e6:.1f} MB at the end ({rss['trainer_growth']:+.2%}); the engine side "
                  "is checked by tests/transport/test_memory.py (50 updates, both processes, <= 1%).", ""]
    lines += ["Host waits (last update, each side): 'readback' = device values read to the host (deferred "
              "verification: 1 per update_weights call), 'comm' = waits on a collective, 'device' = waits on a "
              "CUDA event, 'link' = doorbell records (shm/ipc), 'control' = header and status exchanges; "
              "'blocked' = how many found the work still running (the host actually stopped).", ""]
    lines += ["Control = start..commit minus the data phase on the trainer (median over updates; the budget in "
              "parentheses is issue 15's ~1 ms + ~2 us per tensor). Host CPU = the main thread's CPU time "
              "(time.thread_time) over one whole update on each side: data work (packing, loads) and control "
              "(manifest, audit, exchanges) together; waits on the peer are not CPU. Every row ran manifest "
              "validation, the pointer audit and the agreed commit; 'checks' says whether checksums ran.", ""]
    if any("bound_s" in r for run in result["runs"] for r in run["rows"]):
        lines += ["Format bound (rows of an fp8 engine, measured in the same run on the engine's device): what "
                  "the engine holds in fp8 read once as bf16 and written once as fp8 (a bf16 -> fp8 cast copy "
                  "of as many elements, 512 M elements per launch, scaled), per-tensor scales 5/3 of it (the "
                  "absmax reads it first), plus one device copy of the rest; the same bound as "
                  "bench_reload.py's. The ratio is start..commit over it.", ""]
    lines += ["Method: two processes; each update is timed on the trainer from start_weight_update to the "
              "engine's agreed commit (finish_weight_update), median of the repeats after warm-up; 'data' is "
              "TransferReport.transfer_seconds, the sender's time in update_weights until its last bucket is "
              "handed over: nccl/gloo, until its last broadcast completed (every byte is on the receivers; "
              "their check and load of the last bucket and the call's status exchange fall outside it); "
              "buffered shm/ipc, until every receiver released every bucket (all loaded); zero-copy, until "
              "every receiver loaded and reported (the status exchange included: the loads happen inside "
              "it). 'call' is TransferReport.call_seconds, the update_weights call from entry to return as the "
              "trainer sees it (for nccl/gloo and buffered links: data plus the receivers' check and load of "
              "the last bucket and the status exchange). The raw "
              "baseline broadcasts the same bytes in buckets of the same size with two buffers on a fresh group "
              "of the same backend, between the same processes, in the same run; the copy baseline is one "
              "flat device copy of the same bytes. Zero-copy runs ('+zc') use no buffers and no checksums: each "
              "engine copies straight from the trainer's tensors (exported once, at the first update), so "
              "their bucket size is unused. Extra engine memory = transport buffers + split-tensor "
              "staging + transient peak during an update; bound = 2 buffers + the largest block.", ""]
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        print(f"[bench] matplotlib is not installed: no {path.name}")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for run in result["runs"]:
        xs = [r["bucket_mb"] for r in run["rows"]]
        label = f"{run['backend']}{' zero-copy' if run.get('zero_copy') else ''} ({run['quantization'] or 'bf16'})"
        ax.plot(xs, [r["data_gbps"] for r in run["rows"]], marker="o", label=f"{label}, update_weights")
        ax.plot(xs, [r["gbps"] for r in run["rows"]], marker=".", linestyle="-.", alpha=0.6,
                label=f"{label}, start..commit")
        if run["rows"] and "raw_gbps" in run["rows"][0]:
            ax.plot(xs, [r["raw_gbps"] for r in run["rows"]], linestyle="--", marker="x",
                    label=f"raw {run['backend']} broadcast")
        if run["rows"] and "copy_s" in run["rows"][0]:
            copy = run["num_bytes"] / run["rows"][0]["copy_s"] / 1e9
            ax.axhline(copy, linestyle=":", color="gray", label="one device copy")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("bucket size (MB)")
    ax.set_ylabel("GB/s (payload per update)")
    ax.set_title(f"weight update throughput vs bucket size ({result['tag']})")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_phases(result: dict[str, Any], path: Path) -> None:
    """Time per phase of one update, per row: the data phase and the control around it (start..commit
    minus data), next to the row's baseline (one device copy, or a raw broadcast of the same bytes)."""
    try:
        import matplotlib
    except ImportError:
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [(f"{run['backend']}{'+zc' if run.get('zero_copy') else ''} {run['quantization'] or 'bf16'} "
             f"{r['bucket_mb']} MiB", r) for run in result["runs"] for r in run["rows"]]
    if not rows:
        return
    fig, ax = plt.subplots(figsize=(8, 0.6 * len(rows) + 2.4))
    ys = list(range(len(rows)))
    data = [r["data_seconds"] * 1e3 for _, r in rows]
    control = [(r["seconds"] - r["data_seconds"]) * 1e3 for _, r in rows]
    ax.barh(ys, data, color="tab:blue", label="data (until the last bucket is loaded)")
    ax.barh(ys, control, left=data, color="tab:orange", label="control (start, status exchanges, commit)")
    for y, (_, r) in zip(ys, rows):
        base = r.get("copy_s") or r.get("raw_s")
        if base:
            ax.plot([base * 1e3] * 2, [y - 0.4, y + 0.4], color="black", linewidth=2)
        total = r["seconds"] * 1e3
        ratio = f" = {r['seconds'] / base:.2f}x" if base else ""
        ax.text(total, y, f" {total:.1f} ms{ratio}", va="center", fontsize=8)
    ax.plot([], [], color="black", linewidth=2, label="baseline (one device copy / raw broadcast)")
    ax.set_yticks(ys, [label for label, _ in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("ms per update (start..commit, median)")
    ax.set_title(f"time per phase of an update ({result['tag']})")
    ax.set_xlim(0, max(d + c for d, c in zip(data, control)) * 1.3)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.3 - 0.6 / len(rows)), ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
