"""vLLM's RL API (init/start/update/finish_weight_update) driven over a gloo transport by a trainer process."""

from __future__ import annotations

import multiprocessing as mp
import threading
import time
from pathlib import Path

import pytest

from tests.integrations.vllm.conftest import greedy, start_llm, stop_llm
from tests.integrations.vllm.trainer_process import K_PROJ, run_trainer

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

TIMEOUT_S = 20.0


@pytest.fixture(scope="module")
def llm(vllm_ckpts: dict[str, Path], fresh_tokens):
    engine = start_llm(vllm_ckpts["a"])
    yield engine
    stop_llm(engine)


class Trainer:
    """A spawned trainer process running ``steps``; ``address`` is its sender's rendezvous address."""

    def __init__(self, steps: list[tuple[str, Path]], zero_copy: bool = False, num_receivers: int = 1) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=run_trainer,
                                args=(child, [(k, str(p)) for k, p in steps], TIMEOUT_S, zero_copy, num_receivers))
        self.proc.start()
        self.address = self.recv()

    def recv(self) -> str:
        assert self.conn.poll(120), "the trainer process did not answer within 120 s"
        return self.conn.recv()

    def join(self) -> int | None:
        """The trainer's exit code, waiting at most 60 s (then killing it).

        Waits for the exit status itself (``waitpid``, on a thread), not with ``Process.join(timeout)``:
        that waits on the process's sentinel pipe, which a zero-copy trainer's ``torch_shm_manager``
        inherits and holds open for about a minute after the trainer has exited."""
        waiter = threading.Thread(target=self.proc.join, daemon=True)  # no timeout: a blocking waitpid
        waiter.start()
        waiter.join(60)
        if waiter.is_alive():
            self.proc.kill()
            waiter.join()
        return self.proc.exitcode


def _described(path: Path, names: list[str] | None = None, **override) -> dict:
    """vLLM's NCCL-style update_info for ``names`` (default: all) of the checkpoint at ``path``."""
    from weight_sync.safetensors_io import iter_checkpoint

    tensors = dict(iter_checkpoint(path))
    names = names if names is not None else list(tensors)
    info = {"names": names, "dtype_names": [str(tensors[n].dtype).split(".")[-1] for n in names],
            "shapes": [list(tensors[n].shape) for n in names]}
    return {**info, **override}


def _update(llm, version: str | None = None) -> None:
    llm.start_weight_update()
    llm.update_weights({"update_info": {}})
    llm.finish_weight_update(weight_version=version)


def test_updates_from_a_trainer_process_serve_like_fresh_engines_and_a_to_b_to_a_is_exact(
    llm, vllm_ckpts, fresh_tokens
) -> None:
    fp_a = llm.collective_rpc("ws_fingerprint")[0]
    trainer = Trainer([("good", vllm_ckpts["b"]), ("good", vllm_ckpts["a"])])
    llm.init_weight_transfer_engine({"init_info": {"address": trainer.address}})
    _update(llm, "b")
    assert trainer.recv() == "committed 1"
    assert greedy(llm) == fresh_tokens["b"]
    assert llm.get_weight_version() == "b"
    report = llm.collective_rpc("ws_last_report")[0]
    assert report["version"] == 1 and report["num_tensors"] == 25
    _update(llm, "a")
    assert trainer.recv() == "committed 2"
    assert greedy(llm) == fresh_tokens["a"]
    assert llm.collective_rpc("ws_fingerprint")[0] == fp_a
    assert trainer.recv() == "done"
    assert trainer.join() == 0


def test_a_zero_copy_shm_trainer_updates_the_live_engine_like_a_fresh_one(llm, vllm_ckpts, fresh_tokens) -> None:
    # The engine's workers copy straight from the trainer process's tensors (its checkpoint files, moved
    # into shared memory once per update).
    trainer = Trainer([("good", vllm_ckpts["b"]), ("good", vllm_ckpts["a"])], zero_copy=True)
    llm.init_weight_transfer_engine({"init_info": {"address": trainer.address}})
    _update(llm, "b")
    assert trainer.recv() == "committed 1"
    assert greedy(llm) == fresh_tokens["b"]
    _update(llm, "a")
    assert trainer.recv() == "committed 2"
    assert greedy(llm) == fresh_tokens["a"]
    assert trainer.recv() == "done"
    assert trainer.join() == 0


def test_a_manifest_with_a_wrong_shape_is_refused_on_both_sides_and_the_next_update_works(
    llm, vllm_ckpts, fresh_tokens
) -> None:
    trainer = Trainer([("good", vllm_ckpts["a"]), ("bad_shape", vllm_ckpts["b"]), ("good", vllm_ckpts["b"])])
    llm.init_weight_transfer_engine({"init_info": {"address": trainer.address}})
    _update(llm)
    assert trainer.recv() == "committed 1"
    with pytest.raises(Exception, match=rf"{K_PROJ}.*\(64, 128\).*\(7, 128\)"):
        llm.start_weight_update()
    assert trainer.recv().startswith("refused AgreedManifestError: start_weight_update failed on 1 of 2 ranks")
    assert llm.collective_rpc("ws_status")[0]["torn"] is None
    assert greedy(llm) == fresh_tokens["a"]  # still serving the previous weights
    _update(llm)
    assert trainer.recv() == "committed 3"
    assert greedy(llm) == fresh_tokens["b"]
    assert trainer.recv() == "done"
    assert trainer.join() == 0


def test_a_killed_trainer_is_reported_within_the_timeout_and_the_engine_refuses_until_a_good_update(
    llm, vllm_ckpts, fresh_tokens
) -> None:
    from weight_sync import TornModelError

    dying = Trainer([("die", vllm_ckpts["b"])])
    llm.init_weight_transfer_engine({"init_info": {"address": dying.address}})
    llm.start_weight_update()
    t0 = time.monotonic()
    with pytest.raises(Exception, match=r"(?i)timed out|timeout|closed|reset|peer|connection"):
        llm.update_weights({"update_info": {}})
    assert time.monotonic() - t0 < TIMEOUT_S + 15
    assert dying.join() == -9
    assert llm.collective_rpc("ws_status")[0]["torn"]  # buckets before the kill were written
    with pytest.raises(TornModelError, match=r"refused"):
        greedy(llm)
    healthy = Trainer([("good", vllm_ckpts["b"])])
    llm.init_weight_transfer_engine({"init_info": {"address": healthy.address}})
    _update(llm)
    assert healthy.recv() == "committed 1"
    assert llm.collective_rpc("ws_status")[0]["torn"] is None
    assert greedy(llm) == fresh_tokens["b"]
    assert healthy.recv() == "done"
    assert healthy.join() == 0


# An update_info vLLM's parse rejects inside the worker's update_weights, before the receiver takes the
# sender's call (a field no backend has).
REJECTED_INFO = {"not_a_field": 1}
REJECTED_MESSAGE = "unexpected keyword argument 'not_a_field'"


def _failed_within(outcome: str, limit_s: float) -> None:
    """The trainer's report of a failed call: the agreed error naming the engine's, well before its timeout."""
    assert outcome.startswith("failed TransportError after "), outcome
    assert REJECTED_MESSAGE in outcome and "rank 1 in update_weights" in outcome, outcome
    elapsed = float(outcome.split(" after ", 1)[1].split(" s:", 1)[0])
    assert elapsed < limit_s, f"the trainer learned of the engine's failure after {elapsed} s: {outcome}"


def test_an_update_the_engine_fails_fails_the_trainer_at_once_and_the_same_connection_updates_next(
    llm, vllm_ckpts, fresh_tokens
) -> None:
    trainer = Trainer([("good", vllm_ckpts["a"]), ("rejected", vllm_ckpts["b"]), ("good", vllm_ckpts["b"])])
    llm.init_weight_transfer_engine({"init_info": {"address": trainer.address}})
    _update(llm)
    assert trainer.recv() == "committed 1"
    llm.start_weight_update()
    with pytest.raises(Exception, match=REJECTED_MESSAGE):
        llm.update_weights({"update_info": REJECTED_INFO})
    _failed_within(trainer.recv(), TIMEOUT_S / 2)
    # Nothing of the failed update was written: the session is over on both sides, the old weights serve.
    assert llm.collective_rpc("ws_status")[0] == {"torn": None, "version": 1, "updating": False}
    assert greedy(llm) == fresh_tokens["a"]
    # A reload is not refused as "already in progress", and the next update runs on the same connection.
    llm.collective_rpc("reload_weights", kwargs={"weights_path": str(vllm_ckpts["a"]), "version": "reload"})
    _update(llm, "b")
    assert trainer.recv() == "committed 3"
    assert llm.collective_rpc("ws_status")[0] == {"torn": None, "version": 3, "updating": False}
    assert greedy(llm) == fresh_tokens["b"]
    assert trainer.recv() == "done"
    assert trainer.join() == 0


def test_an_update_the_engine_fails_after_a_first_call_leaves_it_torn_until_the_next_update_on_the_connection(
    llm, vllm_ckpts, fresh_tokens
) -> None:
    from weight_sync import TornModelError

    trainer = Trainer([("good", vllm_ckpts["a"]), ("rejected_second", vllm_ckpts["b"]), ("good", vllm_ckpts["b"])])
    llm.init_weight_transfer_engine({"init_info": {"address": trainer.address}})
    _update(llm)
    assert trainer.recv() == "committed 1"
    llm.start_weight_update()
    llm.update_weights({"update_info": {}})  # the first half of checkpoint B is written
    assert trainer.recv() == "first call sent"
    with pytest.raises(Exception, match=REJECTED_MESSAGE):
        llm.update_weights({"update_info": REJECTED_INFO})
    _failed_within(trainer.recv(), TIMEOUT_S / 2)
    status = llm.collective_rpc("ws_status")[0]
    assert status["updating"] is False and REJECTED_MESSAGE in (status["torn"] or ""), status
    with pytest.raises(TornModelError, match=r"refused"):
        greedy(llm)
    _update(llm, "b")
    assert trainer.recv() == "committed 3"
    assert llm.collective_rpc("ws_status")[0]["torn"] is None
    assert greedy(llm) == fresh_tokens["b"]
    assert trainer.recv() == "done"
    assert trainer.join() == 0


def test_a_finish_that_fails_ends_the_session_and_the_next_start_works_on_the_same_connection(
    llm, vllm_ckpts, fresh_tokens
) -> None:
    from weight_sync import TornModelError

    trainer = Trainer([("good", vllm_ckpts["a"]), ("incomplete", vllm_ckpts["b"]), ("good", vllm_ckpts["b"])])
    llm.init_weight_transfer_engine({"init_info": {"address": trainer.address}})
    _update(llm)
    assert trainer.recv() == "committed 1"
    llm.start_weight_update()
    llm.update_weights({"update_info": {}})  # half of checkpoint B's tensors
    with pytest.raises(Exception, match=r"announced tensor\(s\) never arrived"):
        llm.finish_weight_update()
    assert trainer.recv().startswith("failed AgreedManifestError: finish_weight_update failed")
    status = llm.collective_rpc("ws_status")[0]
    assert status["updating"] is False and status["torn"], status
    with pytest.raises(TornModelError, match=r"refused"):
        greedy(llm)
    _update(llm, "b")  # vLLM's own session must be over too, or this start is refused as "already active"
    assert trainer.recv() == "committed 3"
    assert llm.collective_rpc("ws_status")[0]["torn"] is None
    assert greedy(llm) == fresh_tokens["b"]
    assert trainer.recv() == "done"
    assert trainer.join() == 0


def test_an_init_info_in_vllms_nccl_format_connects_and_vllm_style_chunked_updates_commit(
    llm, vllm_ckpts, fresh_tokens
) -> None:
    from tests.integrations.vllm.trainer_process import chunks

    trainer = Trainer([("chunked", vllm_ckpts["b"]), ("chunked", vllm_ckpts["a"])])
    host, port = trainer.address.rsplit(":", 1)
    # What vLLM's NCCLTrainerWeightTransferEngine sends its workers (worker_init_payload).
    llm.init_weight_transfer_engine({"init_info": {
        "master_address": host, "master_port": int(port), "rank_offset": 1, "world_size": 2,
        "packed": True, "packed_buffer_size_bytes": 64 << 10, "packed_num_buffers": 2}})
    for key, version in (("b", "b"), ("a", "a")):
        llm.start_weight_update()
        for names in chunks(vllm_ckpts[key]):  # each call describes its own chunk, as vLLM's trainers do
            llm.update_weights({"update_info": _described(vllm_ckpts[key], names)})
        llm.finish_weight_update(weight_version=version)
        assert trainer.recv().startswith("committed")
        assert greedy(llm) == fresh_tokens[key]
        assert llm.collective_rpc("ws_last_report")[0]["num_tensors"] == 25
    assert trainer.recv() == "done"
    assert trainer.join() == 0


def test_init_info_wire_parameters_that_contradict_the_sender_are_refused_naming_the_field(llm) -> None:
    trainer = Trainer([])
    host, port = trainer.address.rsplit(":", 1)
    with pytest.raises(Exception, match=r"init_info packed_buffer_size_bytes: the sender at .* has 65536.*says 1024"):
        llm.init_weight_transfer_engine({"init_info": {
            "master_address": host, "master_port": int(port), "rank_offset": 1, "world_size": 2,
            "packed_buffer_size_bytes": 1024}})
    with pytest.raises(Exception, match=r"nccl_unique_id_b64"):
        llm.init_weight_transfer_engine({"init_info": {"rank_offset": 1, "world_size": 2,
                                                       "nccl_unique_id_b64": "AAAA"}})
    trainer.proc.kill()
    trainer.join()


@pytest.mark.parametrize(("field", "message"), [
    ("shapes", rf"update_info shapes\[\d+\] \({K_PROJ}\): the sender's manifest announces \(64, 128\), update_info says \(7, 128\)"),
    ("dtype_names", rf"update_info dtype_names\[\d+\] \({K_PROJ}\): .*announces bfloat16, update_info says float32"),
    ("names", r"update_info names: the sender's update_weights call carries 25 tensor\(s\), update_info describes 24"),
])
def test_an_update_info_that_contradicts_the_manifest_is_refused_on_both_sides_before_any_write(
    field, message, llm, vllm_ckpts, fresh_tokens
) -> None:
    trainer = Trainer([("good", vllm_ckpts["a"]), ("rejected", vllm_ckpts["b"]), ("good", vllm_ckpts["b"])])
    llm.init_weight_transfer_engine({"init_info": {"address": trainer.address}})
    _update(llm)
    assert trainer.recv() == "committed 1"
    info = _described(vllm_ckpts["b"])
    i = info["names"].index(K_PROJ)
    if field == "shapes":
        info["shapes"][i] = [7, 128]
    elif field == "dtype_names":
        info["dtype_names"][i] = "float32"
    else:
        for key in ("names", "dtype_names", "shapes"):
            del info[key][i]
    llm.start_weight_update()
    with pytest.raises(Exception, match=message):
        llm.update_weights({"update_info": info})
    outcome = trainer.recv()
    assert outcome.startswith("failed TransportError") and f"update_info {field}" in outcome, outcome
    assert llm.collective_rpc("ws_status")[0] == {"torn": None, "version": 1, "updating": False}
    assert greedy(llm) == fresh_tokens["a"]
    llm.start_weight_update()
    llm.update_weights({"update_info": _described(vllm_ckpts["b"])})  # an agreeing description is accepted
    llm.finish_weight_update()
    assert trainer.recv() == "committed 3"
    assert greedy(llm) == fresh_tokens["b"]
    assert trainer.recv() == "done"
    assert trainer.join() == 0


def hf_trainer_model(path: Path):
    """The trainer's model as upstream's RL examples hold it: a transformers model in bf16."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16)


def load_trainer_weights(model, path: Path) -> None:
    """Stand-in for a training step: the trainer's parameters become checkpoint ``path``'s."""
    from weight_sync.safetensors_io import iter_checkpoint

    model.load_state_dict(dict(iter_checkpoint(path)), strict=True)


def test_vllms_trainer_api_with_a_module_source_drives_weight_syncs_sender(llm, vllm_ckpts, fresh_tokens) -> None:
    from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory

    from weight_sync.integrations.vllm import LLMControl
    from weight_sync.integrations.vllm.trainer import WeightSyncTrainerInitInfo

    model = hf_trainer_model(vllm_ckpts["b"])
    engine = WeightTransferTrainerFactory.trainer_init(
        init_info=WeightSyncTrainerInitInfo(world_size=2, rank=0, packed=True, packed_buffer_size_bytes=64 << 10,
                                            timeout_s=TIMEOUT_S),
        client=LLMControl(llm),
        source=ModuleSource(model),
    )
    try:
        engine.send_weights(weight_version="b")
        assert greedy(llm) == fresh_tokens["b"]
        assert llm.get_weight_version() == "b"
        load_trainer_weights(model, vllm_ckpts["a"])
        engine.send_weights()
        assert greedy(llm) == fresh_tokens["a"]
        assert engine.last_report is not None and engine.last_report.version == 2
        assert llm.collective_rpc("ws_last_report")[0]["num_tensors"] == 25
    finally:
        engine.shutdown()
