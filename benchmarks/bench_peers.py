"""Host -> GPU update next to MoonshotAI's checkpoint-engine and the pinned H2D bound, in one run.

The trainer's weights sit in pinned host memory (checkpoint-engine's design point). Rows, same model
(default preset ``qwen3-8b``: 399 tensors, 16.4 GB bf16), same bytes, same run:

- **bound, per tensor**: one ``copy_(non_blocking=True)`` (cudaMemcpyAsync) per tensor from pinned memory
  into preallocated device tensors, one synchronize at the end;
- **bound, contiguous**: one copy of the whole pinned buffer into one device buffer;
- **weight_sync**: ``begin_update(engine.model, manifest)`` + ``load(pinned tensors)`` into a live
  reference engine (manifest validation, pointer audit and fingerprint on, as by default); a second row
  with the fingerprint off, labelled so;
- **checkpoint-engine** (exact version in the results): ``ParameterServer.register_checkpoint`` (its own
  pinned copy, untimed), ``gather_metas`` once, then timed ``ParameterServer.update``: its H2D buffer,
  double-buffered IPC buckets over ZMQ to a worker process whose ``update_weights_from_ipc(run=...)``
  callback is the reference engine's ``load_weights``. The process group is made once (``auto_pg=False``),
  its fastest setting; with ``auto_pg=True`` it would rebuild the NCCL group on every update.

Every phase runs in a spawned child with a timeout, so a failing or hanging peer still leaves a table
(its row says why). After timing, the checkpoint-engine worker's fingerprint is compared with ours: both
engines must hold the same bytes.

    python benchmarks/bench_peers.py --tag h200 --profile        # one H200 (checkpoint-engine on PYTHONPATH)
    python benchmarks/bench_peers.py --quick                     # CPU: our side only, small model

Results: ``benchmarks/results/peers_<tag>.{json,md}`` (+ ``_profile.txt`` with ``--profile``).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import socket
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS, env_markdown, environment, median, timed

ALIGN = 256  # bytes; tensors start on 256-byte boundaries in the flat pinned buffer (as in checkpoint-engine)
PEER = "checkpoint_engine"


# ---------------------------------------------------------------- plumbing shared by the children
def _say(msg: str) -> None:
    print(f"[bench_peers {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _device(spec: dict[str, Any]) -> torch.device:
    device = torch.device(spec["device"])
    if device.type == "cuda":
        if device.index is None:  # set_device needs an index; "cuda" means the first GPU here
            device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
    return device


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _cfg(spec: dict[str, Any]) -> dict[str, Any]:
    from weight_sync.testing import hf_config

    return hf_config("qwen3", spec["preset"], torch.bfloat16)


def _host_source(spec: dict[str, Any], device: torch.device) -> tuple[torch.Tensor, list[tuple[str, torch.Tensor]]]:
    """The trainer's weights (seed 1) as views of one flat host buffer, pinned when the engine is on CUDA.

    One flat buffer, not a pinned allocation per tensor: the caching host allocator rounds each one up
    to a power of two (up to 2x the bytes), and a trainer keeping a host copy keeps one buffer anyway.
    """
    from weight_sync.testing import random_weights

    # Generated on the device (fast; the bytes do not depend on where), then copied into the host buffer.
    src = list(random_weights(_cfg(spec), seed=1, dtype=torch.bfloat16, device=device))
    offsets, total = [], 0
    for _, t in src:
        offsets.append(total)
        total += (t.nbytes + ALIGN - 1) // ALIGN * ALIGN
    flat = torch.empty(total, dtype=torch.uint8, pin_memory=device.type == "cuda")
    items = []
    for (name, t), off in zip(src, offsets, strict=True):
        view = flat[off:off + t.nbytes].view(t.dtype).view(t.shape)
        view.copy_(t)
        items.append((name, view))
    del src
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return flat, items


def _child(fn: Callable[..., dict[str, Any]], q: Any, who: int, *args: Any) -> None:
    # Results and failures travel as plain dicts: a traceback as text, never an exception object.
    try:
        q.put({"who": who, "ok": True, **fn(q, *args)})
    except BaseException as e:  # reported to the parent, which prints and tabulates it
        q.put({"who": who, "ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()})


def _run_phase(name: str, targets: list[tuple[Callable[..., dict[str, Any]], tuple]], timeout_s: float,
               ) -> dict[str, Any]:
    """Run ``targets`` in spawned children; the first one's result is the phase's. Never raises.

    A child reports progress as ``{"phase": ...}`` messages, so a timeout names the step it hung in; a
    failure of any child ends the phase (the others are killed if they do not exit).
    """
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_child, args=(fn, q, i, *args), daemon=False)
             for i, (fn, args) in enumerate(targets)]
    _say(f"phase {name}: start ({len(procs)} process(es), timeout {timeout_s:.0f} s)")
    t0 = time.perf_counter()
    for p in procs:
        p.start()
    step, result = "starting", None
    deadline = time.monotonic() + timeout_s
    try:
        while result is None:
            left = deadline - time.monotonic()
            if left <= 0:
                result = {"ok": False, "error": f"timed out after {timeout_s:.0f} s in step '{step}'"}
                break
            try:
                msg = q.get(timeout=min(left, 5.0))
            except queue.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    result = {"ok": False, "error": f"a child died (exit code {dead[0].exitcode}) in step '{step}'"}
                continue
            if "phase" in msg:
                step = msg["phase"]
                _say(f"phase {name}: {step}")
            elif msg["who"] == 0 or not msg["ok"]:  # the first child's result, or any child's failure
                result = msg
    finally:
        # A finished phase's children exit on their own; after a failure or a timeout they may be stuck
        # in a device call or a socket, so they get only a short grace before they are killed.
        grace = 30.0 if result is not None and result["ok"] else 3.0
        for p in procs:
            p.join(timeout=grace)
        for p in procs:
            if p.is_alive():  # our own child, by its handle: stuck in a device call or a socket
                p.kill()
                p.join(timeout=10)
    result["wall_s"] = time.perf_counter() - t0
    status = "ok" if result["ok"] else f"FAILED: {result['error']}"
    _say(f"phase {name}: {status} ({result['wall_s']:.1f} s)")
    if not result["ok"] and result.get("traceback"):
        print(result["traceback"], flush=True)
    return result


# ---------------------------------------------------------------- our side and the bound (one child)
def local_phase(q: Any, spec: dict[str, Any]) -> dict[str, Any]:
    """The pinned H2D bounds and weight_sync's update from the same pinned tensors, in one process."""
    from weight_sync import Manifest, begin_update
    from weight_sync.engine import ReferenceEngine
    from weight_sync.testing import random_weights

    device = _device(spec)
    if device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    reps, warm = spec["repeats"], spec["warmup"]
    q.put({"phase": "pinned host source"})
    flat, items = _host_source(spec, device)
    nbytes = sum(t.nbytes for _, t in items)
    out: dict[str, Any] = {"num_tensors": len(items), "num_bytes": nbytes,
                           "pinned": bool(flat.is_pinned()) if device.type == "cuda" else False}

    q.put({"phase": "bound: one copy per tensor"})
    dsts = [torch.empty(t.shape, dtype=t.dtype, device=device) for _, t in items]

    def per_tensor() -> None:
        for d, (_, s) in zip(dsts, items, strict=True):
            d.copy_(s, non_blocking=True)

    out["bound_per_tensor_s"] = timed(per_tensor, device, reps, warm)
    assert all(torch.equal(d.cpu(), s) for d, (_, s) in zip(dsts[:3], items[:3], strict=True))
    dsts.clear()  # frees the device tensors before the contiguous copy needs as many bytes again
    if device.type == "cuda":
        torch.cuda.empty_cache()

    q.put({"phase": "bound: one contiguous copy"})
    dflat = [torch.empty(flat.numel(), dtype=torch.uint8, device=device)]
    out["bound_contiguous_s"] = timed(lambda: dflat[0].copy_(flat, non_blocking=True), device, reps, warm)
    dflat.clear()
    if device.type == "cuda":
        torch.cuda.empty_cache()

    q.put({"phase": "reference engine (seed 0)"})
    cfg = _cfg(spec)
    engine = ReferenceEngine.from_config(cfg, weights=random_weights(cfg, seed=0, device=device), device=device)
    manifest = Manifest.from_named_tensors(items)
    reports: list[Any] = []

    def ours(fp: bool) -> Callable[[], None]:
        def run() -> None:
            with begin_update(engine.model, manifest, fingerprint=fp) as s:
                s.load(items)
            reports.append(s.report)
        return run

    # The first update plans (recorded once per model): it is the warm-up, untimed, like the peer's first.
    for label, fp in (("weight_sync", True), ("weight_sync_nofp", False)):
        q.put({"phase": f"{label}: {warm} warm-up + {reps} timed updates"})
        reports.clear()
        out[f"{label}_s"] = timed(ours(fp), device, reps, warm)
        last = reports[-1]
        out[f"{label}_phases_s"] = {k: v for k, v in last.seconds.items()}
        out[f"{label}_fingerprint"] = last.fingerprint
        out[f"{label}_layers"] = {"direct": len(last.layers_direct), "processed": len(last.layers_processed),
                                  "keys_replayed": last.keys_replayed, "keys_via_loader": last.keys_via_loader}
    params = dict(engine.model.named_parameters())
    embed = params.get("model.embed_tokens.weight")
    out["weight_sync_spot_check"] = bool(embed is not None and torch.equal(embed.cpu(), items[0][1]))

    if spec["profile"]:
        q.put({"phase": "profile: one weight_sync update"})
        try:
            out["profile"] = _profile(ours(True), device)
        except Exception:  # the profile is a diagnosis, not a result: its failure must not cost the rows
            out["profile"] = "profiling failed:\n" + traceback.format_exc()
    return out


def _profile(fn: Callable[[], None], device: torch.device) -> str:
    """torch.profiler's table of one update: where host time and device time go."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    _sync(device)
    with profile(activities=acts) as prof:
        fn()
        _sync(device)
    ka = prof.key_averages()
    parts = []
    for key in (["self_device_time_total"] if device.type == "cuda" else []) + ["self_cpu_time_total"]:
        parts.append(f"## sorted by {key}\n" + ka.table(sort_by=key, row_limit=25))
    return "\n\n".join(parts)


# ---------------------------------------------------------------- checkpoint-engine (two children)
def peer_worker(q: Any, spec: dict[str, Any], conn: Any) -> dict[str, Any]:
    """The engine side: a reference engine fed by ``update_weights_from_ipc(run=model.load_weights)``."""
    import zmq
    from checkpoint_engine.worker import update_weights_from_ipc

    from weight_sync import fingerprint
    from weight_sync.engine import ReferenceEngine
    from weight_sync.testing import random_weights

    device = _device(spec)
    cfg = _cfg(spec)
    engine = ReferenceEngine.from_config(cfg, weights=random_weights(cfg, seed=0, device=device), device=device)
    ctx = zmq.Context()
    conn.send(("ready", None))
    while True:
        cmd, arg = conn.recv()
        if cmd == "stop":
            break
        if cmd == "fingerprint":
            conn.send(("ok", fingerprint(engine.model)))
            continue
        run_s: list[float] = []

        def run(weights: list[tuple[str, torch.Tensor]], run_s: list[float] = run_s) -> None:
            t0 = time.perf_counter()
            engine.model.load_weights(weights)
            _sync(device)
            run_s.append(time.perf_counter() - t0)

        try:
            update_weights_from_ipc(ctx, arg, device.index or 0, run=run)
        except BaseException:  # the parameter server's thread waits for this answer
            conn.send(("error", traceback.format_exc()))
            raise
        conn.send(("ok", run_s))
    ctx.term()
    return {}


def peer_server(q: Any, spec: dict[str, Any], conn: Any, port: int) -> dict[str, Any]:
    """The trainer side: checkpoint-engine's ParameterServer over a world of one (NCCL, TCPStore)."""
    # ParameterServer reads RANK from the environment even when rank=0 is passed (``rank or env``).
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", LOCAL_RANK="0")
    # NVLink multicast stays off on the shared H200 hosts (as in scripts/gpu_check.sh).
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    if spec.get("peer_bucket_gb"):
        os.environ["PS_MAX_BUCKET_SIZE_GB"] = str(spec["peer_bucket_gb"])
    import checkpoint_engine
    import checkpoint_engine.ps as ce_ps
    from checkpoint_engine import ParameterServer

    from weight_sync.testing import random_weights

    device = _device(spec)
    out: dict[str, Any] = {"version": checkpoint_engine.__version__, "notes": []}
    try:
        ce_ps.get_ip()
    except Exception as e:  # no resolvable address: loopback is all a world of one uses
        ce_ps.get_ip = lambda: "127.0.0.1"
        out["notes"].append(f"get_ip() failed ({e}); patched to 127.0.0.1")
    q.put({"phase": "peer: waiting for the worker's engine"})
    if not conn.poll(spec["step_timeout_s"]):
        raise TimeoutError(f"worker not ready after {spec['step_timeout_s']} s")
    conn.recv()

    q.put({"phase": "peer: ParameterServer + register_checkpoint (its pinned copy, untimed)"})
    ps = ParameterServer(rank=0, world_size=1, auto_pg=False, master_addr="127.0.0.1", master_port=port)
    ps.init_process_group()
    cfg = _cfg(spec)
    named = dict(random_weights(cfg, seed=1, dtype=torch.bfloat16, device=device))
    t0 = time.perf_counter()
    ps.register_checkpoint("bench", named_tensors=named)
    out["register_s"] = time.perf_counter() - t0
    out["num_tensors"] = len(named)
    out["num_bytes"] = sum(t.nbytes for t in named.values())
    del named
    torch.cuda.empty_cache()
    ps.gather_metas("bench")
    out["pinned_pool_bytes"] = sum(b.size for b in ps._get_memory_pool("bench"))

    def req_func(socket_paths: list[tuple[str, str]]) -> None:
        # Runs in ParameterServer's request thread, like the HTTP call to vLLM in its examples.
        conn.send(("update", dict(socket_paths)[ps._device_uuid]))

    times, run_s = [], []
    n = spec["warmup"] + spec["repeats"]
    for i in range(n):
        q.put({"phase": f"peer: update {i + 1}/{n}" + (" (warm-up)" if i < spec["warmup"] else "")})
        _sync(device)
        t0 = time.perf_counter()
        ps.update("bench", req_func)
        _sync(device)
        dt = time.perf_counter() - t0
        if not conn.poll(spec["step_timeout_s"]):
            raise TimeoutError(f"worker gave no answer for update {i + 1} within {spec['step_timeout_s']} s")
        status, val = conn.recv()
        if status != "ok":
            raise RuntimeError(f"checkpoint-engine worker failed:\n{val}")
        if i >= spec["warmup"]:
            times.append(dt)
            run_s.append(val)
    out["update_s"] = times
    out["num_buckets"] = len(run_s[-1]) if run_s else 0
    out["worker_load_s"] = [sum(r) for r in run_s]
    conn.send(("fingerprint", None))
    if not conn.poll(spec["step_timeout_s"]):
        raise TimeoutError("worker gave no fingerprint")
    out["fingerprint"] = conn.recv()[1]
    conn.send(("stop", None))
    torch.distributed.destroy_process_group()
    return out


def _peer_skip_reason(args: argparse.Namespace) -> str | None:
    if args.skip_peer:
        return "skipped (--skip-peer)"
    if torch.device(args.device).type != "cuda":
        return "skipped on CPU: checkpoint-engine moves buckets by CUDA IPC and NCCL"
    try:
        import checkpoint_engine  # noqa: F401
        import zmq  # noqa: F401
    except ImportError as e:
        return f"not importable ({e}); install the .whl/ wheels into a dir on PYTHONPATH"
    return None


def peer_phase(args: argparse.Namespace, spec: dict[str, Any]) -> dict[str, Any]:
    reason = _peer_skip_reason(args)
    if reason:
        _say(f"phase peer: {reason}")
        return {"ok": False, "error": reason, "skipped": True}
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    port = _free_port()
    return _run_phase("peer", [(peer_server, (spec, a, port)), (peer_worker, (spec, b))], args.peer_timeout_s)


# ---------------------------------------------------------------- rows, goals, files
OURS_CHECKS = "manifest validation, pointer audit, fingerprint (no wire: transport checksums n/a)"
OURS_NOFP_CHECKS = "manifest validation, pointer audit; fingerprint OFF (this row only)"
PEER_CHECKS = "none (checkpoint-engine has no manifest validation, checksums or pointer audit)"


def build_rows(local: dict[str, Any], peer: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """One row per method, each with its ratio to the bound; and the issue's goals, evaluated."""
    rows: list[dict[str, Any]] = []
    bound = None
    if local.get("ok"):
        bound = min(median(local["bound_per_tensor_s"]), median(local["bound_contiguous_s"]))
    nbytes = local.get("num_bytes") or peer.get("num_bytes")

    def row(method: str, times: list[float] | None, checks: str, note: str = "", **extra: Any) -> None:
        s = median(times) if times else None
        rows.append({"method": method, "seconds": s, "seconds_all": times,
                     "gbps": nbytes / s / 1e9 if s and nbytes else None,
                     "ratio_vs_bound": s / bound if s and bound else None,
                     "checks": checks, "note": note, **extra})

    if local.get("ok"):
        row("bound: pinned H2D, one copy per tensor", local["bound_per_tensor_s"], "-")
        row("bound: pinned H2D, one contiguous copy", local["bound_contiguous_s"], "-")
        row("weight_sync begin_update + load (pinned host tensors)", local["weight_sync_s"], OURS_CHECKS,
            phases_s=local["weight_sync_phases_s"])
        row("weight_sync, fingerprint off", local["weight_sync_nofp_s"], OURS_NOFP_CHECKS,
            phases_s=local["weight_sync_nofp_phases_s"])
    else:
        for m in ("bound: pinned H2D", "weight_sync begin_update + load (pinned host tensors)"):
            row(m, None, "-", note=f"not measured: {local.get('error')}")
    if peer.get("ok"):
        same = local.get("weight_sync_fingerprint") == peer["fingerprint"] if local.get("ok") else None
        row(f"checkpoint-engine {peer['version']} ParameterServer.update -> IPC worker (load_weights)",
            peer["update_s"], PEER_CHECKS,
            note=f"{peer['num_buckets']} buckets; auto_pg=False (group made once); engine bytes equal to "
                 f"weight_sync's: {same}", worker_load_s=median(peer["worker_load_s"]), same_bytes_as_ours=same)
    else:
        row("checkpoint-engine ParameterServer.update -> IPC worker (load_weights)", None, PEER_CHECKS,
            note=f"not measured: {peer.get('error')}")

    ours = rows[2]["seconds"] if local.get("ok") else None
    peer_s = rows[-1]["seconds"]
    goals: dict[str, Any] = {"bound_s": bound}
    if ours and bound:
        goals["ours_within_1.1x_bound"] = ours <= 1.1 * bound
    if ours and peer_s and bound:
        goals["ours_le_0.9x_peer"] = ours <= 0.9 * peer_s
        goals["peer_within_1.1x_bound"] = peer_s <= 1.1 * bound
        goals["ours_within_1.05x_bound"] = ours <= 1.05 * bound
        goals["peer_goal_met"] = goals["ours_le_0.9x_peer"] or (goals["peer_within_1.1x_bound"]
                                                                and goals["ours_within_1.05x_bound"])
        goals["ours_vs_peer"] = ours / peer_s
    return rows, goals


def _fmt(x: float | None, scale: float = 1e3, spec: str = ".1f") -> str:
    return "-" if x is None else format(x * scale, spec)


def markdown(result: dict[str, Any]) -> str:
    env, rows, goals = result["env"], result["rows"], result["goals"]
    local, peer = result["local"], result["peer"]
    nb = local.get("num_bytes") or peer.get("num_bytes") or 0
    nt = local.get("num_tensors") or peer.get("num_tensors") or 0
    lines = [f"# Host -> GPU update next to checkpoint-engine ({result['tag']})", "", env_markdown(env),
             f"- peer: `checkpoint-engine {peer.get('version', 'not run')}`", "",
             f"Model: Qwen3-shaped preset `{result['preset']}`, {nt} tensors, {nb / 1e9:.2f} GB bf16, the "
             "trainer's copy in one host buffer (pinned on CUDA). Medians of "
             f"{result['repeats']} timed updates after {result['warmup']} warm-up(s), all in this run.", ""]
    if result["device"] == "cpu":
        lines += ["**CPU quick mode**: host memory is not pinned and the 'H2D' rows are host memcpys; the "
                  "numbers check the plumbing, not the hardware.", ""]
    lines += ["| method | ms | GB/s | x bound | checks that ran | note |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['method']} | {_fmt(r['seconds'])} | {_fmt(r['gbps'], 1, '.2f')} | "
                     f"{_fmt(r['ratio_vs_bound'], 1, '.3f')} | {r['checks']} | {r['note']} |")
    lines += ["", "Bound: the faster of the two pinned copies. Goals (issue 15): "]
    for k, v in goals.items():
        if k != "bound_s":
            lines.append(f"- {k}: {v if not isinstance(v, float) else f'{v:.3f}'}")
    if local.get("ok"):
        ph = local["weight_sync_phases_s"]
        lines += ["", "weight_sync phases of the last timed update (ms): "
                  + ", ".join(f"{k} {v * 1e3:.2f}" for k, v in ph.items()),
                  f"spot check (embedding bytes equal to the source): {local['weight_sync_spot_check']}"]
    if peer.get("ok"):
        lines += [f"checkpoint-engine: register_checkpoint {peer['register_s']:.1f} s (untimed), worker "
                  f"load_weights per update {median(peer['worker_load_s']) * 1e3:.1f} ms over "
                  f"{peer['num_buckets']} buckets. Notes: {'; '.join(peer['notes']) or 'none'}"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="CPU, preset 'small', 2 repeats; the peer is skipped")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--preset", default=None, help="weight_sync.testing preset (default qwen3-8b; quick: small)")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--skip-peer", action="store_true")
    p.add_argument("--peer-bucket-gb", type=float, default=None,
                   help="checkpoint-engine's PS_MAX_BUCKET_SIZE_GB (its default: 8)")
    p.add_argument("--local-timeout-s", type=float, default=220.0, help="timeout of the bound + ours phase")
    p.add_argument("--peer-timeout-s", type=float, default=300.0, help="timeout of the checkpoint-engine phase")
    p.add_argument("--profile", action="store_true", help="write torch.profiler's table of one of our updates")
    p.add_argument("--tag", default=None, help="result file suffix (default: h200 on CUDA, cpu otherwise)")
    p.add_argument("--results-dir", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    if args.quick:
        args.device = args.device or "cpu"
        args.preset = args.preset or "small"
        args.repeats = args.repeats or 2
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.preset = args.preset or "qwen3-8b"
    args.repeats = args.repeats or 5
    device = torch.device(args.device)
    tag = args.tag or ("h200" if device.type == "cuda" else "cpu")
    env = environment()
    _say(f"environment: {env}")
    spec = {"device": args.device, "preset": args.preset, "repeats": args.repeats, "warmup": args.warmup,
            "profile": args.profile, "peer_bucket_gb": args.peer_bucket_gb,
            "step_timeout_s": max(30.0, args.peer_timeout_s - 30)}
    local = _run_phase("bound + weight_sync", [(local_phase, (spec,))], args.local_timeout_s)
    peer = peer_phase(args, spec)
    rows, goals = build_rows(local, peer)
    profile = local.pop("profile", None)
    result = {"tag": tag, "device": device.type, "preset": args.preset, "repeats": args.repeats,
              "warmup": args.warmup, "env": env, "peer_version": peer.get("version"),
              "rows": rows, "goals": goals, "local": local, "peer": peer}
    md = markdown(result)
    args.results_dir.mkdir(parents=True, exist_ok=True)
    j, m = args.results_dir / f"peers_{tag}.json", args.results_dir / f"peers_{tag}.md"
    j.write_text(json.dumps(result, indent=1, default=str))
    m.write_text(md)
    if profile:
        (args.results_dir / f"peers_{tag}_profile.txt").write_text(profile)
    print(md, flush=True)
    _say(f"wrote {j} and {m}")
    return 0 if local.get("ok") and (peer.get("ok") or peer.get("skipped")) else 1


if __name__ == "__main__":
    sys.exit(main())
