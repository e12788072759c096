"""Reliability long run: the lifecycle fuzzer's machines over many sequences, violations counted by kind.

The same machines as ``tests/reload/test_lifecycle_fuzz.py``, in record mode: a violation (the engine
served something other than one committed version, refused without cause, accepted a bad update, moved a
pointer, left a shim or leaked) is counted with the shortest step log that led to it, and the sequence
starts again on a fresh engine instead of stopping the run. In process: the reference engine in fp8, bf16
and fp32, a plain ``nn.Module``, and on request the tiny Qwen3-MoE engine in fp8 and fp8_block
(hypothesis state machines, no shrinking). Spawned: the fp8 engine at
TP=2 over gloo (random replays on two ranks) and transports whose sender is SIGKILLed after a random
number of tensors (gloo and shm, rollback on and off).

    python benchmarks/bench_reliability.py --sequences 5000
    python benchmarks/bench_reliability.py --sequences 200 --tp2-sequences 10 --transport-runs 2 --tag smoke
"""

from __future__ import annotations

import argparse
import logging
import random
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.append(str(ROOT))  # after PYTHONPATH: a run may point weight_sync at another tree

from common import env_markdown, environment, write_results  # noqa: E402

# Relative shares of the TP=1 sequences (normalized over the machines run). The MoE machines are opt-in
# (--machines ...,moe_fp8,moe_fp8_block), so the default run stays comparable with earlier results.
SHARES = {"fp8": 0.35, "bf16": 0.25, "fp32": 0.15, "plain": 0.25, "moe_fp8": 0.2, "moe_fp8_block": 0.15}


def run_in_process(machines: list[str], sequences: int, steps: int, seed: int = 0) -> dict:
    import hypothesis.core
    from hypothesis import HealthCheck, Phase, settings
    from hypothesis.stateful import run_state_machine_as_test

    import tests.reload._fuzz_machines as fm
    from tests.reload._fuzz_drivers import STATS
    from tests.reload._fuzz_world import FRESH

    share = sum(SHARES[m] for m in machines)
    out = {}
    for m in machines:
        n = max(1, round(sequences * SHARES[m] / share))
        fm.RECORDER = rec = fm.Recorder()
        STATS.clear()
        builds = FRESH.builds
        t0 = time.perf_counter()
        # Reproducible: seed 0 is hypothesis' derandomized stream, another seed forces its seed (each
        # worker of a parallel run has its own). No shrinking (violations are recorded, not raised), no
        # example database.
        hypothesis.core.global_force_seed = seed or None
        run_state_machine_as_test(fm.MACHINES[m], settings=settings(
            max_examples=n, stateful_step_count=steps, deadline=None, derandomize=not seed,
            database=None, phases=[Phase.generate], suppress_health_check=list(HealthCheck)))
        out[m] = {"sequences": rec.sequences, "steps": rec.steps, "seconds": time.perf_counter() - t0,
                  "fresh_builds": FRESH.builds - builds, "stats": dict(STATS), "violations": rec.violations}
        fm.RECORDER = None
        print(f"{m}: {rec.sequences} sequences, {rec.steps} steps, "
              f"{sum(v['count'] for v in rec.violations.values())} violation(s) "
              f"{ {k: v['count'] for k, v in rec.violations.items()} } in {out[m]['seconds']:.0f} s", flush=True)
    return out


def run_tp2(sequences: int, steps: int, seed: int) -> dict:
    from tests.reload._fuzz_spawned import replay_tp
    from weight_sync.testing import run_distributed

    t0 = time.perf_counter()
    seeds = [seed * 100_000 + i for i in range(sequences)]
    r0, r1 = run_distributed(replay_tp, 2, "fp8", seeds, steps, timeout_s=max(300, 30 * sequences))
    violations: dict[str, dict] = {}
    for rank, r in enumerate((r0, r1)):
        for v in r["violations"]:
            e = violations.setdefault(v["kind"], {"count": 0, "example": None})
            e["count"] += 1
            if e["example"] is None or len(v["steps"]) < len(e["example"]["steps"]):
                e["example"] = {**v, "rank": rank}
    out = {"sequences": r0["sequences"], "steps": r0["steps"], "seconds": time.perf_counter() - t0,
           "stats": r0["stats"], "violations": violations, "ranks_agree": r0["steps"] == r1["steps"]}
    print(f"tp2: {out['sequences']} sequences, {out['steps']} steps, "
          f"{ {k: v['count'] for k, v in violations.items()} } in {out['seconds']:.0f} s", flush=True)
    return out


def run_transport(runs: int, seed: int) -> dict:
    from tests.reload._fuzz_spawned import run_killed_sender
    from tests.reload._fuzz_world import assets

    a = assets()
    rng = random.Random(seed)
    t0 = time.perf_counter()
    rows, violations = [], Counter()
    for i in range(runs):
        backend = ("shm", "gloo")[i % 2]
        rollback = (False, True)[(i // 2) % 2]
        after = rng.randrange(0, len(a.names))
        v = run_killed_sender(backend, "fp8", rollback, after, str(a.paths[0]), str(a.paths[1]))
        bad = []
        if v.get("error"):
            bad.append(f"engine process: {v['error']}")
        bad += v.get("problems", [])
        if v.get("raised") is None and not v.get("error"):
            bad.append("the receiver did not raise")
        if v.get("shm_left"):
            bad.append(f"shm files left: {v['shm_left']}")
        if v.get("children_left"):
            bad.append(f"processes left: {v['children_left']}")
        for b in bad:
            violations[b.split(":")[0]] += 1
        rows.append({"backend": backend, "rollback": rollback, "killed_after_tensors": after,
                     "raised": (v.get("raised") or "")[:160], "torn": v.get("torn") is not None,
                     "violations": bad})
        print(f"transport {i}: {backend} rollback={rollback} killed after {after} tensors -> "
              f"{'torn' if v.get('torn') else 'servable'}, {bad or 'ok'}", flush=True)
    return {"runs": runs, "seconds": time.perf_counter() - t0, "rows": rows, "violations": dict(violations)}


def _markdown(env: dict, payload: dict, args: argparse.Namespace) -> str:
    md = [f"# Reliability long run ({args.tag})", "", env_markdown(env), "",
          "The lifecycle fuzzer of `tests/reload/test_lifecycle_fuzz.py` in record mode: every step is "
          "checked (kernel tensors bitwise equal to a fresh load of the one version the engine must serve, "
          "or every serving call refuses naming the failure; no graph-visible tensor moved; no session or "
          "shim left), every sequence ends with a good full update and a hygiene count (threads, fds, "
          "child processes). A violation restarts the sequence on a fresh engine. Baseline for the "
          f"counts: the same command on the code before the hole fixes ({args.baseline_note}).", "",
          f"weight_sync code: `{payload['code']}`. Total wall time: {payload['seconds']:.0f} s.", "",
          "| machine | sequences | steps | seconds (summed over workers) | fresh loads built | violations |", "|---|---|---|---|---|---|"]
    for m, r in payload["in_process"].items():
        vs = ", ".join(f"{k} {v['count']}" for k, v in r["violations"].items()) or "none"
        md.append(f"| {m} (TP=1) | {r['sequences']} | {r['steps']} | {r['seconds']:.0f} | "
                  f"{r['fresh_builds']} | {vs} |")
    if payload.get("tp2"):
        r = payload["tp2"]
        vs = ", ".join(f"{k} {v['count']}" for k, v in r["violations"].items()) or "none"
        md.append(f"| fp8 TP=2 gloo (replay) | {r['sequences']} | {r['steps']} | {r['seconds']:.0f} | - | {vs} |")
    if payload.get("transport"):
        r = payload["transport"]
        vs = ", ".join(f"{k} {v}" for k, v in r["violations"].items()) or "none"
        md.append(f"| sender killed (gloo/shm) | {r['runs']} | - | {r['seconds']:.0f} | - | {vs} |")
    rules, faults = Counter(), Counter()
    for r in [*payload["in_process"].values(), *([payload["tp2"]] if payload.get("tp2") else [])]:
        for k, v in r["stats"].items():
            if k.startswith("rule:"):
                rules[k[5:]] += v
            elif k.startswith("fault:"):
                faults[k[6:]] += v
    md += ["", "Rules run: " + ", ".join(f"{k} {v}" for k, v in rules.most_common()) + ".", "",
           "Faults injected: " + ", ".join(f"{k} {v}" for k, v in faults.most_common()) + ".", ""]
    examples = [(m, k, v["example"]) for m, r in payload["in_process"].items() for k, v in r["violations"].items()]
    if examples:
        md += ["## Shortest sequence per violation kind", ""]
        for m, k, ex in examples:
            md += [f"- **{k}** ({m}): {ex['message'][:300]}", "  steps: " + " -> ".join(
                f"{s[0]}({', '.join(f'{a}={b}' for a, b in s[1].items())})" for s in ex["steps"]), ""]
    return "\n".join(md)


def _merge_in_process(parts: list[dict]) -> dict:
    out: dict[str, dict] = {}
    for part in parts:
        for m, r in part.items():
            o = out.setdefault(m, {"sequences": 0, "steps": 0, "seconds": 0.0, "fresh_builds": 0,
                                   "stats": Counter(), "violations": {}})
            for k in ("sequences", "steps", "seconds", "fresh_builds"):
                o[k] += r[k]
            o["stats"].update(r["stats"])
            for kind, v in r["violations"].items():
                e = o["violations"].setdefault(kind, {"count": 0, "machines": Counter(), "example": None})
                e["count"] += v["count"]
                e["machines"].update(v["machines"])
                if e["example"] is None or len(v["example"]["steps"]) < len(e["example"]["steps"]):
                    e["example"] = v["example"]
    return out


def _parallel(args: argparse.Namespace, tp2: int) -> dict:
    """Workers: the in-process machines split ``--workers`` ways (seeds seed+1..), TP=2 and transport in
    two more processes; each writes its JSON part, merged here."""
    import json
    import subprocess
    import tempfile

    tmp = Path(tempfile.mkdtemp(prefix="ws_reliability_"))
    me = [sys.executable, str(Path(__file__).resolve())]
    common = ["--steps", str(args.steps), "--machines", args.machines]
    jobs = []
    for i in range(args.workers):
        n = args.sequences // args.workers + (1 if i < args.sequences % args.workers else 0)
        jobs.append(["--part", "in_process", "--sequences", str(n), "--seed", str(args.seed * 1000 + i + 1)])
    if tp2:
        jobs.append(["--part", "tp2", "--tp2-sequences", str(tp2), "--seed", str(args.seed)])
    if args.transport_runs:
        jobs.append(["--part", "transport", "--transport-runs", str(args.transport_runs), "--seed", str(args.seed)])
    procs = []
    for i, job in enumerate(jobs):
        log = open(tmp / f"part{i}.log", "w")  # noqa: SIM115 - closed after the wait below
        procs.append((subprocess.Popen([*me, *common, *job, "--part-out", str(tmp / f"part{i}.json")],
                                       stdout=log, stderr=subprocess.STDOUT), log, i, job))
    parts = []
    for p, log, i, job in procs:
        code = p.wait()
        log.close()
        if code != 0:
            raise RuntimeError(f"worker {job} exited {code}:\n{(tmp / f'part{i}.log').read_text()[-3000:]}")
        parts.append(json.loads((tmp / f"part{i}.json").read_text()))
    merged = {"in_process": _merge_in_process([p["in_process"] for p in parts if "in_process" in p])}
    merged["tp2"] = next((p["tp2"] for p in parts if "tp2" in p), None)
    merged["transport"] = next((p["transport"] for p in parts if "transport" in p), None)
    return merged


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sequences", type=int, default=5000, help="TP=1 sequences, shared by the machines")
    p.add_argument("--steps", type=int, default=20, help="rules per sequence (stateful_step_count)")
    p.add_argument("--machines", default="fp8,bf16,fp32,plain")
    p.add_argument("--tp2-sequences", type=int, default=None, help="default: sequences / 100")
    p.add_argument("--transport-runs", type=int, default=4)
    p.add_argument("--seed", type=int, default=0, help="0: derandomized; else the seed of every part")
    p.add_argument("--workers", type=int, default=1, help="processes for the in-process machines")
    p.add_argument("--tag", default="cpu", help="result file suffix: reliability[_tag]")
    p.add_argument("--results-dir", default=None, help="default benchmarks/results")
    p.add_argument("--baseline-note", default="see docs/benchmarks.md")
    p.add_argument("--part", choices=("in_process", "tp2", "transport"), help=argparse.SUPPRESS)
    p.add_argument("--part-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    logging.disable(logging.WARNING)  # the out-of-order staging warning fires on every shuffled update
    import weight_sync

    tp2 = args.tp2_sequences if args.tp2_sequences is not None else max(1, args.sequences // 100)
    if args.part:
        import json

        if args.part == "in_process":
            part = {"in_process": run_in_process(args.machines.split(","), args.sequences, args.steps, args.seed)}
        elif args.part == "tp2":
            part = {"tp2": run_tp2(tp2, args.steps, args.seed)}
        else:
            part = {"transport": run_transport(args.transport_runs, args.seed)}
        Path(args.part_out).write_text(json.dumps(part, default=str))
        return 0
    env = environment()
    print(env, flush=True)
    t0 = time.perf_counter()
    payload = {"env": env, "code": str(Path(weight_sync.__file__).parent),
               "config": {k: getattr(args, k) for k in ("sequences", "steps", "machines", "tp2_sequences",
                                                         "transport_runs", "seed", "workers")}}
    if args.workers > 1:
        payload.update(_parallel(args, tp2))
    else:
        payload["in_process"] = run_in_process(args.machines.split(","), args.sequences, args.steps, args.seed)
        payload["tp2"] = run_tp2(tp2, args.steps, args.seed) if tp2 else None
        payload["transport"] = run_transport(args.transport_runs, args.seed) if args.transport_runs else None
    payload["seconds"] = time.perf_counter() - t0
    name = "reliability" if args.tag == "cpu" else f"reliability_{args.tag}"
    if args.results_dir:
        import common

        common.RESULTS = Path(args.results_dir)
    j, m = write_results(name, payload, _markdown(env, payload, args))
    print(f"wrote {j} and {m} ({payload['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
