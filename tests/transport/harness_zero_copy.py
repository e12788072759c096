"""Multi-process zero-copy scenarios (shm on CPU): rank 0 is the trainer, ranks 1..N engine workers."""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.distributed as dist

from tests.transport.harness import connect_pair
from trainers import CheckpointSource
from weight_sync.engine import ReferenceEngine
from weight_sync.reload import torn_reason

ZERO_COPY = {"zero_copy": True, "checksum": False}


def _trainer_weights(ckpt: str) -> dict[str, torch.Tensor]:
    """The trainer's own tensors (each its own storage), like a model's parameters."""
    return {n: t.clone() for n, t in CheckpointSource(ckpt)}


def zero_copy_lifecycle(rank: int, world: int, ckpt_a: str, ckpt_b: str) -> dict:
    """Four updates from the trainer's tensors: b; a written in place (an optimizer step); a with one
    parameter replaced and one tensor made on the fly; a again in two calls. Both sides report how many
    storages are exported / imported after each update; engines report fingerprints."""
    end, engine, group = connect_pair(rank, world, "shm", ckpt_a, config=ZERO_COPY)
    manifest = CheckpointSource(ckpt_b).manifest()
    names = list(manifest.names)
    if rank == 0:
        w, a = _trainer_weights(ckpt_b), _trainer_weights(ckpt_a)
        stats, fps = [], []

        def sent(report: Any) -> None:
            stats.append(end.zero_copy_stats)
            fps.append(report.fingerprints)

        sent(end.send(list(w.items()), manifest, 1))
        for n in names:
            w[n].copy_(a[n])  # in place: the same storages
        sent(end.send(list(w.items()), manifest, 2))
        w[names[0]] = a[names[0]].clone()  # a new storage; the old one dies
        call3 = [(n, t * 1 if n == names[1] else t) for n, t in w.items()]  # a temporary for names[1]
        sent(end.send(call3, manifest, 3))
        del call3  # the temporary dies after its update
        end.start_weight_update(manifest, 4)
        half = len(names) // 2
        items = list(w.items())
        end.update_weights(items[:half], names=names[:half])
        end.update_weights(items[half:], names=names[half:])
        sent(end.finish_weight_update())
        for t in w.values():
            t.add_(1)  # the trainer moves on: engines must hold copies, not aliases
        dist.barrier()
        dist.barrier()
        end.close()
        return {"stats": stats, "fingerprints": fps, "num_tensors": len(names)}
    fps, regions = [], []
    for _ in range(4):
        fps.append(end.receive_update().fingerprint)
        regions.append(end.zero_copy_regions)
    dist.barrier()
    after_trainer_moved_on = engine.fingerprint()
    dist.barrier()
    fresh_b = ReferenceEngine.from_checkpoint(ckpt_b, tp_group=group).fingerprint()
    fresh_a = ReferenceEngine.from_checkpoint(ckpt_a, tp_group=group)
    state = engine.model.state_dict()
    equal = all(torch.equal(state[k], v) for k, v in fresh_a.model.state_dict().items())
    end.close()
    return {"fingerprints": fps, "regions": regions, "fresh": [fresh_b] + [fresh_a.fingerprint()] * 3,
            "after_trainer_moved_on": after_trainer_moved_on, "bitwise_equal": equal,
            "closed_regions": end.zero_copy_regions}


def zero_copy_source_fails(rank: int, world: int, ckpt_a: str, ckpt_b: str) -> dict:
    """The trainer's source raises after 20 tensors: every rank raises, the engine rolls back; a tensor
    with the wrong dtype is rejected before any write; then clean updates commit."""
    end, engine, _ = connect_pair(rank, world, "shm", ckpt_a, tp=False, rollback=True, config=ZERO_COPY)
    manifest = CheckpointSource(ckpt_b).manifest()
    if rank == 0:
        w = _trainer_weights(ckpt_b)

        def failing():
            for i, item in enumerate(w.items()):
                if i == 20:
                    raise RuntimeError("injected trainer failure after 20 tensors")
                yield item

        wrong = [(n, t.double() if i == 5 else t) for i, (n, t) in enumerate(w.items())]
        outcomes = []
        for label, tensors in (("failing", failing()), ("wrong dtype", wrong), ("clean", list(w.items())),
                               ("clean again", list(w.items()))):
            try:
                end.send(tensors, manifest, version=label)
                outcomes.append((label, "ok", ""))
            except Exception as e:
                outcomes.append((label, type(e).__name__, str(e)))
        stats = end.zero_copy_stats
        end.close()
        return {"outcomes": outcomes, "stats": stats}
    before = engine.fingerprint()
    outcomes, after = [], []
    for label in ("failing", "wrong dtype", "clean", "clean again"):
        try:
            end.receive_update()
            outcomes.append((label, "ok", ""))
        except Exception as e:
            outcomes.append((label, type(e).__name__, str(e)))
        after.append({"rolled_back": engine.fingerprint() == before, "torn": torn_reason(engine.model),
                      "regions": end.zero_copy_regions})
    fresh_b = ReferenceEngine.from_checkpoint(ckpt_b).fingerprint()
    final = engine.fingerprint()
    end.close()
    return {"outcomes": outcomes, "after": after, "final": final, "fresh_b": fresh_b}


def zero_copy_split_calls(rank: int, world: int, ckpt_a: str, ckpt_b: str, calls: int) -> dict:
    """One update in ``calls`` calls through a generator source (the tensors are produced lazily)."""
    end, engine, _ = connect_pair(rank, world, "shm", ckpt_a, tp=False, config=ZERO_COPY)
    if rank == 0:
        src = CheckpointSource(ckpt_b)
        manifest = src.manifest()
        w = _trainer_weights(ckpt_b)
        end.start_weight_update(manifest, 1)
        names = list(manifest.names)
        cuts = [len(names) * i // calls for i in range(calls + 1)]
        for lo, hi in itertools.pairwise(cuts):
            end.update_weights(((n, w[n]) for n in names[lo:hi]), names=names[lo:hi])
        report = end.finish_weight_update()
        end.close()
        return {"fingerprints": report.fingerprints, "num_buckets": report.num_buckets}
    end.receive_update()
    fresh = ReferenceEngine.from_checkpoint(ckpt_b).fingerprint()
    result = {"fingerprint": engine.fingerprint(), "fresh": fresh}
    end.close()
    return result


def zero_copy_refused_manifest(rank: int, world: int, ckpt_a: str, ckpt_b: str) -> dict:
    """send() produces the call's tensors while the engines validate the manifest: an update whose
    manifest the engine refuses (one tensor announced a row short) closes the trainer's source, exports
    nothing and writes nothing; the next clean update reuses every export."""
    end, engine, _ = connect_pair(rank, world, "shm", ckpt_a, tp=False, rollback=True, config=ZERO_COPY)
    manifest = CheckpointSource(ckpt_b).manifest()
    if rank == 0:
        from weight_sync import Manifest

        w = _trainer_weights(ckpt_b)
        short = next(n for n, t in w.items() if t.dim() == 2)
        wrong = {**w, short: w[short][:-1]}  # a view of the same storage, one row short
        bad = Manifest.from_named_tensors(list(wrong.items()))
        produced: list[str] = []
        closed: list[bool] = []

        def source():  # one tensor more than announced: suspended there until someone closes it
            try:
                for item in wrong.items():
                    produced.append(item[0])
                    yield item
                yield "unannounced.weight", torch.zeros(1)
            finally:
                closed.append(True)

        outcomes, exported = [], []
        for label, items, m in (("clean", list(w.items()), manifest), ("refused", source(), bad),
                                ("clean again", list(w.items()), manifest)):
            try:
                end.send(items, m, version=label)
                outcomes.append((label, "ok", ""))
            except Exception as e:
                outcomes.append((label, type(e).__name__, str(e)))
            exported.append(end.zero_copy_stats["exported"])
        end.close()
        return {"outcomes": outcomes, "exported": exported, "closed": closed, "short": short,
                "num_tensors": len(w)}
    outcomes, fingerprints = [], []
    for label in ("clean", "refused", "clean again"):
        try:
            end.receive_update()
            outcomes.append((label, "ok", ""))
        except Exception as e:
            outcomes.append((label, type(e).__name__, str(e)))
        fingerprints.append(engine.fingerprint())
    fresh_b = ReferenceEngine.from_checkpoint(ckpt_b).fingerprint()
    torn = torn_reason(engine.model)
    end.close()
    return {"outcomes": outcomes, "fingerprints": fingerprints, "fresh_b": fresh_b, "torn": torn}


def call_in_start(rank: int, world: int, ckpt_a: str, ckpt_b: str, backend: str, zero_copy: bool) -> dict:
    """send() to one receiver of a manifest it accepted before rides its call in the start header (zero-copy:
    of the tensors it sent last time). Five updates of the trainer's tensors, updated in place: whole
    (receive_update), whole, then driven phase by phase, then one the engine refuses at begin, then whole
    again."""
    end, engine, _ = connect_pair(rank, world, backend, ckpt_a, tp=False, rollback=True,
                                  config=ZERO_COPY if zero_copy else None)
    manifest = CheckpointSource(ckpt_b).manifest()
    if rank == 0:
        w, a = _trainer_weights(ckpt_b), _trainer_weights(ckpt_a)
        outcomes, controls = [], []
        for step in range(5):
            for n, t in w.items():
                t.copy_((a if step % 2 else _trainer_weights(ckpt_b))[n])  # in place: the same storages
            try:
                report = end.send(list(w.items()), manifest, version=step)
                outcomes.append("ok")
                controls.append(report.host_waits.get("control"))
            except Exception as e:
                outcomes.append(f"{type(e).__name__}: {e}")
                controls.append(None)
        exported = end.zero_copy_stats["exported"] if zero_copy else None
        end.close()
        return {"outcomes": outcomes, "controls": controls, "exported": exported, "num_tensors": len(w)}
    fresh = {0: ReferenceEngine.from_checkpoint(ckpt_b).fingerprint(),
             1: ReferenceEngine.from_checkpoint(ckpt_a).fingerprint()}
    outcomes, fingerprints, torn = [], [], []
    real_begin = engine.begin_update

    def refusing_begin(manifest: Any, **opts: Any) -> Any:
        raise RuntimeError("this engine refuses the update at begin")

    for step in range(5):
        try:
            if step == 2:  # phase by phase: the call waits in the receiver for update_weights
                end.start_weight_update()
                loaded = end.update_weights()
                end.finish_weight_update()
                assert loaded == len(manifest)
            else:
                engine.begin_update = refusing_begin if step == 3 else real_begin  # type: ignore[method-assign]
                end.receive_update()
            outcomes.append("ok")
        except Exception as e:
            outcomes.append(f"{type(e).__name__}: {e}")
        fingerprints.append(engine.fingerprint())
        torn.append(torn_reason(engine.model))
    end.close()
    return {"outcomes": outcomes, "fingerprints": fingerprints, "torn": torn,
            "fresh": [fresh[step % 2] for step in range(5)]}


def engine_rebinds_between_updates(rank: int, world: int, ckpt_a: str, ckpt_b: str, zero_copy: bool) -> dict:
    """Updates b then a over shm; between them the engine rebinds a norm weight to a new tensor (its own
    code, before it waits for the next update): the second update must land in the new tensor."""
    end, engine, _ = connect_pair(rank, world, "shm", ckpt_a, tp=False, config=ZERO_COPY if zero_copy else None)
    if rank == 0:
        for version, ckpt in ((1, ckpt_b), (2, ckpt_a)):
            src = CheckpointSource(ckpt)
            tensors = _trainer_weights(ckpt)
            end.send(list(tensors.items()), src.manifest(version), version)
            dist.barrier()
        end.close()
        return {}
    end.receive_update()
    name = next(n for n, _ in engine.model.named_parameters() if n.endswith("norm.weight"))
    owner, attr = name.rsplit(".", 1)
    module = engine.model.get_submodule(owner)
    old = getattr(module, attr)
    setattr(module, attr, torch.nn.Parameter(old.detach().clone(), requires_grad=False))
    dist.barrier()
    report = end.receive_update()
    dist.barrier()
    fresh = ReferenceEngine.from_checkpoint(ckpt_a)
    end.close()
    return {"fingerprint": report.fingerprint, "fresh": fresh.fingerprint(),
            "new_tensor_loaded": torch.equal(getattr(module, attr), fresh.model.get_parameter(name)),
            "old_tensor_untouched": not torch.equal(old, fresh.model.get_parameter(name))}
