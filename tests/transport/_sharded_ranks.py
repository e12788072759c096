"""Functions run on spawned ranks for the sharded data-plane tests (gloo): FSDP2 trainers, TP engine ranks.

Ranks ``0..T-1`` are trainer ranks, ranks ``T..`` engine ranks (engine ``j``'s TP rank ``t`` is engine
rank ``j * 2 + t``). The trainers' next version is the checkpoint plus a small step per update, applied
to their local shards; an engine rank checks itself against a fresh rank loaded with the same weights
whole through the engine's own loaders.
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from tests.transport._routes_ranks import FixedTP
from weight_sync.engine.config import ModelConfig
from weight_sync.engine.model import CausalLM
from weight_sync.transport.sharded import ShardedConfig, ShardedSender
from weight_sync.transport.sharded_receiver import ShardedReceiver

NUM_TRAINERS = 2
TP = 2


def step(t: torch.Tensor, version: int) -> torch.Tensor:
    """Version ``version``'s change, elementwise (so a shard and the whole tensor change alike)."""
    return t.add_(0.01 * version)


def expected_weights(ckpt: str, version: int) -> dict[str, torch.Tensor]:
    """The trainers' weights after updates 1..version, computed whole from the checkpoint."""
    full = load_file(f"{ckpt}/model.safetensors")
    for v in range(1, version + 1):
        for t in full.values():
            step(t, v)
    return full


def engine_rank_model(ckpt: str, engine_rank: int, expert_parallel: bool = False) -> CausalLM:
    """A zero-filled engine rank (TP rank ``engine_rank % 2``): an element no region writes stays 0."""
    with open(f"{ckpt}/config.json") as f:
        cfg = ModelConfig.from_hf_dict(json.load(f))
    model = CausalLM(cfg, tp=FixedTP(fixed_size=TP, fixed_rank=engine_rank % TP), expert_parallel=expert_parallel)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    return model


def wrong_parameters(model: CausalLM, ckpt: str, engine_rank: int, version: int) -> list[str]:
    """Parameters of ``model`` that differ from a fresh rank loaded with version ``version`` whole."""
    fresh = engine_rank_model(ckpt, engine_rank, model.expert_parallel)
    fresh.load_weights(expected_weights(ckpt, version).items())
    got = dict(model.named_parameters())
    return sorted(n for n, p in fresh.named_parameters() if not torch.equal(got[n], p))


def _share_address(address: str | None, rank: int) -> str:
    """Trainer rank 0's store address to every rank (a uint8 tensor over the test's world group)."""
    buf = torch.zeros(256, dtype=torch.uint8)
    if rank == 0:
        raw = address.encode()  # type: ignore[union-attr]
        buf[: len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
    dist.broadcast(buf, 0)
    return bytes(buf[buf != 0].tolist()).decode()


def fsdp_trainers_to_tp_engines(rank: int, world: int, ckpt: str, num_updates: int) -> dict[str, Any]:
    """``num_updates`` sharded updates, then one over a new transport in broadcast mode.

    Trainer ranks return their per-engine-rank region bytes per update; engine ranks the parameters
    that differ from a fresh load after each update and the region bytes they received.
    """
    trainers = dist.new_group(list(range(NUM_TRAINERS)))  # every rank takes part in creating a group
    num_engine_ranks = world - NUM_TRAINERS
    out: dict[str, Any] = {"updates": []}
    modes = ["sharded"] * num_updates + ["broadcast"]
    if rank < NUM_TRAINERS:
        import transformers
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        from trainers.fsdp import FSDPSource

        model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16)
        mesh = DeviceMesh.from_group(trainers, "cpu")
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        source = FSDPSource(model, group=trainers)
        sender = None
        for version, mode in enumerate(modes, start=1):
            if version == 1 or mode != modes[version - 2]:
                if sender is not None:
                    sender.close()
                cfg = ShardedConfig(num_trainers=NUM_TRAINERS, num_engine_ranks=num_engine_ranks, mode=mode,
                                    bucket_bytes=16 << 10, timeout_s=30.0, host="127.0.0.1")
                if rank == 0:
                    sender = ShardedSender(cfg, 0)
                    _share_address(sender.address, 0)
                else:
                    sender = ShardedSender(cfg, rank, _share_address(None, rank))
                sender.connect()
            with torch.no_grad():
                for p in model.parameters():
                    step(p, version)
            report = sender.send(*source.shards(), version=version)  # type: ignore[union-attr]
            out["updates"].append({"mode": report.mode, "region_bytes": report.region_bytes})
        sender.close()  # type: ignore[union-attr]
        return out
    d = rank - NUM_TRAINERS
    engine = engine_rank_model(ckpt, d)
    receiver = None
    for version, mode in enumerate(modes, start=1):
        if version == 1 or mode != modes[version - 2]:
            if receiver is not None:
                receiver.close()
            receiver = ShardedReceiver(engine, _share_address(None, rank), d, rollback=True)
            receiver.connect()
        update = receiver.receive_update()  # type: ignore[union-attr]
        last = receiver.last_report  # type: ignore[union-attr]
        out["updates"].append({
            "version": update.version, "mode": last.mode, "region_bytes": last.region_bytes,
            "wrong": wrong_parameters(engine, ckpt, d, version),
        })
    receiver.close()  # type: ignore[union-attr]
    return out


# ------------------------------------------------------------------------------ a rank killed mid-update
FAULT_TIMEOUT_S = 8.0
KILL_AFTER = 4  # buckets: several of the victim's buckets have moved by then, most have not


def _checkpoint_pieces(ckpt: str, rank: int, version: int) -> tuple[list, dict[str, torch.Tensor], Any]:
    """An FSDP-layout trainer rank without FSDP: its Shard(0) piece of every tensor of version ``version``."""
    from weight_sync.manifest import Manifest, TensorMeta
    from weight_sync.transport.routes_layouts import fsdp_holdings

    full = expected_weights(ckpt, version)
    with open(f"{ckpt}/config.json") as f:
        cfg = ModelConfig.from_hf_dict(json.load(f))
    from weight_sync.transport.routes_reference import reference_checkpoint_metas

    metas = [TensorMeta(m.name, m.dtype, m.shape) for m in reference_checkpoint_metas(cfg) if m.name in full]
    holdings = fsdp_holdings(metas, NUM_TRAINERS)
    local = {h.name: full[h.name][tuple(slice(a, b) for a, b in p.box)].clone()
             for h in holdings for p in h.pieces if p.rank == rank}
    return holdings, local, Manifest(tuple(metas))


def _report_death(events: Any, role: str) -> None:
    """Put the time of death on ``events`` (flushed: the queue's feeder thread dies with us), then die."""
    import os
    import signal
    import time

    events.put(("died", role, time.time()))
    events.close()
    events.join_thread()
    os.kill(os.getpid(), signal.SIGKILL)


def _die_after(n: int, events: Any, role: str) -> None:
    """SIGKILL this process once ``n`` of its buckets have moved (sent by a trainer, taken by an engine)."""
    from weight_sync.transport import sharded

    if role == "trainer":
        real = sharded._isend
        count = [0]

        def isend(*args: Any) -> Any:
            count[0] += 1
            if count[0] > n:
                _report_death(events, role)
            return real(*args)

        sharded._isend = isend  # type: ignore[assignment]
    else:
        real_check = sharded.check_trailer
        count = [0]

        def check(*args: Any) -> None:
            count[0] += 1
            if count[0] > n:
                _report_death(events, role)
            real_check(*args)

        sharded.check_trailer = check  # type: ignore[assignment]


def fault_rank(rank: int, victim: int, first_round: int, inbox: Any, events: Any, ckpt: str) -> None:
    """One rank of the fault test: round 1 = update v1, then v2 with ``victim`` killed; round 2 = v3.

    Ranks 0, 1 are trainer ranks, 2, 3 the engine ranks of one TP=2 engine (rank 2 rolls back, rank 3
    does not). A replacement of the victim starts at round 2. Reports every outcome on ``events``.
    """
    import time

    from weight_sync.reload import torn_reason

    d = rank - NUM_TRAINERS
    engine = engine_rank_model(ckpt, d) if d >= 0 else None
    if engine is not None:
        # Plan the reload once before connecting: recording the loaders' copies is the slow part of a
        # first update, and on a loaded CI machine it could outlast the test's short timeout.
        from weight_sync.transport.routes_layouts import needs_from_model

        needs_from_model(engine, _checkpoint_pieces(ckpt, 0, 0)[2].tensors, d)
    for rnd in range(first_round, 3):
        versions = [1, 2] if rnd == 1 else [3]
        cfg = ShardedConfig(num_trainers=NUM_TRAINERS, num_engine_ranks=2, mode="sharded", bucket_bytes=16 << 10,
                            timeout_s=FAULT_TIMEOUT_S, host="127.0.0.1")
        if rank == 0:
            end: Any = ShardedSender(cfg, 0)
            events.put(("address", rnd, end.address))
        else:
            _, got_round, address = inbox.get(timeout=120)
            assert got_round == rnd, (got_round, rnd)
            end = (ShardedSender(cfg, rank, address) if d < 0 else
                   ShardedReceiver(engine, address, d, rollback=d == 0))
        end.connect()
        for v in versions:
            if rank == victim and v == 2:
                _die_after(KILL_AFTER, events, "trainer" if d < 0 else "engine")
            t0 = time.time()
            try:
                if d < 0:
                    end.send(*_checkpoint_pieces(ckpt, rank, v), version=v)
                else:
                    end.receive_update()
            except Exception as e:
                state = None
                if engine is not None:
                    state = {"torn": torn_reason(engine) is not None,
                             "rolled_back": wrong_parameters(engine, ckpt, d, 1) == []}
                events.put(("raised", rank, v, time.time(), time.time() - t0, f"{type(e).__name__}: {e}"[:400], state))
                break
            wrong = wrong_parameters(engine, ckpt, d, v) if engine is not None else []
            events.put(("committed", rank, v, wrong))
        end.close()
    events.put(("done", rank))


def nccl_trainer_to_engine(rank: int, world: int, ckpt: str) -> list[str]:
    """One trainer rank (GPU 0) -> one TP=1 engine rank (GPU 1) over NCCL point to point, two updates."""
    from weight_sync.transport.routes_layouts import whole_holdings

    torch.cuda.set_device(rank)
    cfg = ShardedConfig(num_trainers=1, num_engine_ranks=1, backend="nccl", mode="sharded", timeout_s=60.0,
                        host="127.0.0.1")
    wrong: list[str] = []
    if rank == 0:
        sender = ShardedSender(cfg, 0)
        _share_address(sender.address, 0)
        sender.connect()
        for v in (1, 2):
            _, local, manifest = _checkpoint_pieces(ckpt, 0, v)
            full = expected_weights(ckpt, v)
            local = {n: full[n].cuda() for n in local}
            sender.send(whole_holdings(manifest.tensors, [0]), local, manifest, version=v)
        sender.close()
        return wrong
    with open(f"{ckpt}/config.json") as f:
        mcfg = ModelConfig.from_hf_dict(json.load(f))
    engine = CausalLM(mcfg, tp=FixedTP(fixed_size=1, fixed_rank=0)).cuda()
    receiver = ShardedReceiver(engine, _share_address(None, rank), 0)
    receiver.connect()
    for v in (1, 2):
        receiver.receive_update()
        fresh = CausalLM(mcfg, tp=FixedTP(fixed_size=1, fixed_rank=0))
        fresh.load_weights(expected_weights(ckpt, v).items())
        got = {n: p.cpu() for n, p in engine.named_parameters()}
        wrong += [f"v{v} {n}" for n, p in fresh.named_parameters() if not torch.equal(got[n], p)]
    receiver.close()
    return wrong


def checkpoint_trainers_to_ep_engines(rank: int, world: int, ckpt: str, num_updates: int) -> dict[str, Any]:
    """MoE: 2 trainer ranks holding Shard(0) pieces -> one engine of 2 expert-parallel ranks, sharded."""
    out: dict[str, Any] = {"updates": []}
    cfg = ShardedConfig(num_trainers=NUM_TRAINERS, num_engine_ranks=world - NUM_TRAINERS, mode="sharded",
                        bucket_bytes=16 << 10, timeout_s=30.0, host="127.0.0.1")
    if rank < NUM_TRAINERS:
        if rank == 0:
            sender = ShardedSender(cfg, 0)
            _share_address(sender.address, 0)
        else:
            sender = ShardedSender(cfg, rank, _share_address(None, rank))
        sender.connect()
        for v in range(1, num_updates + 1):
            report = sender.send(*_checkpoint_pieces(ckpt, rank, v), version=v)
            out["updates"].append({"region_bytes": report.region_bytes})
        sender.close()
        return out
    d = rank - NUM_TRAINERS
    engine = engine_rank_model(ckpt, d, expert_parallel=True)
    receiver = ShardedReceiver(engine, _share_address(None, rank), d)
    receiver.connect()
    for v in range(1, num_updates + 1):
        receiver.receive_update()
        last = receiver.last_report
        out["updates"].append({"region_bytes": last.region_bytes,  # type: ignore[union-attr]
                               "wrong": wrong_parameters(engine, ckpt, d, v)})
    receiver.close()
    return out
