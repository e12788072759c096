"""make_checkpoint writes what transformers loads, with odd sizes and a round-tripping tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from weight_sync.errors import ConfigError
from weight_sync.safetensors_io import read_header
from weight_sync.testing import make_checkpoint, run_distributed
from weight_sync.testing.distributed import DistributedFailure


def test_checkpoint_has_config_weights_and_a_tokenizer_that_round_trips(tmp_path: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    path = make_checkpoint(tmp_path / "c", arch="llama", tie_word_embeddings=True)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["tie_word_embeddings"] is True
    names = set(read_header(path / "model.safetensors"))
    assert "lm_head.weight" not in names and "model.layers.1.mlp.down_proj.weight" in names
    tok = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
    assert tok.decode(tok.encode("3 4 = 12").ids) == "3 4 = 12"
    assert tok.get_vocab_size() == 1024


def test_config_overrides_reach_config_and_shapes(tmp_path: Path) -> None:
    path = make_checkpoint(tmp_path / "odd", hidden_size=96, num_attention_heads=3, head_dim=32,
                           num_key_value_heads=1, tokenizer=False)
    hdr = read_header(path / "model.safetensors")
    assert hdr["model.layers.0.self_attn.q_proj.weight"].shape == (96, 96)
    assert hdr["model.layers.0.self_attn.k_proj.weight"].shape == (32, 96)


def test_unknown_arch_or_preset_is_rejected_with_the_choices(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"arch must be one of \['llama', 'qwen3', 'qwen3_moe'\]"):
        make_checkpoint(tmp_path / "x", arch="gpt2")
    with pytest.raises(ConfigError, match="preset must be one of"):
        make_checkpoint(tmp_path / "x", preset="huge")


def _ok(rank: int, world: int) -> int:
    return rank * 10 + world


def _boom(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("rank one exploded")


def _hang(rank: int, world: int) -> None:
    import threading

    import torch.distributed as dist

    if rank == 0:
        dist.barrier()  # waits for rank 1, which is stuck
    else:
        threading.Event().wait()  # a rank that never returns


def _env_and_cwd(rank: int, world: int) -> tuple[str | None, str | None, str]:
    import os

    return os.environ.get("WS_TEST_PROBE"), os.environ.get("WS_TEST_GIVEN"), os.getcwd()


def test_run_distributed_returns_results_by_rank() -> None:
    assert run_distributed(_ok, 2) == [2, 12]


def test_ranks_see_the_callers_environment_and_directory_as_they_are_at_each_call(monkeypatch, tmp_path) -> None:
    # Ranks fork from a server started at the first call: what changed since must still reach them.
    run_distributed(_ok, 1)
    monkeypatch.setenv("WS_TEST_PROBE", "set after the first call")
    monkeypatch.chdir(tmp_path)
    got = run_distributed(_env_and_cwd, 2, env={"WS_TEST_GIVEN": "given"})
    assert got == [("set after the first call", "given", str(tmp_path))] * 2
    monkeypatch.delenv("WS_TEST_PROBE")
    assert run_distributed(_env_and_cwd, 1)[0][:2] == (None, None)


def test_run_distributed_raises_with_the_failing_ranks_traceback() -> None:
    with pytest.raises(DistributedFailure, match=r"rank 1 of 2 failed:(.|\n)*rank one exploded"):
        run_distributed(_boom, 2)


def test_ranks_are_spawned_when_asked_and_an_unknown_start_method_is_refused_by_name(monkeypatch) -> None:
    from weight_sync.testing import rank_context

    monkeypatch.delenv("WEIGHT_SYNC_RANK_START", raising=False)  # (a run of the suite may set it)
    assert rank_context().get_start_method() == "forkserver"
    monkeypatch.setenv("WEIGHT_SYNC_RANK_START", "spawn")
    assert rank_context().get_start_method() == "spawn"
    assert run_distributed(_ok, 2) == [2, 12]
    monkeypatch.setenv("WEIGHT_SYNC_RANK_START", "fork")
    with pytest.raises(ConfigError, match=r"WEIGHT_SYNC_RANK_START must be one of forkserver, spawn, got 'fork'"):
        run_distributed(_ok, 2)


def test_a_process_group_that_fails_to_connect_is_set_up_once_more_and_then_reported(monkeypatch, caplog) -> None:
    from weight_sync.testing import distributed

    calls = []

    def flaky(*a):
        calls.append(a)
        if len(calls) == 1:
            raise distributed._MeshFailure("rank 0 of 2 failed setting up its process group:\nconnectFullMesh failed")
        return ["ok", "ok"]

    monkeypatch.setattr(distributed, "_run_once", flaky)
    assert run_distributed(_ok, 2) == ["ok", "ok"] and len(calls) == 2
    assert "did not connect, spawning them again" in caplog.text

    def broken(*a):
        raise distributed._MeshFailure("rank 1 of 2 failed setting up its process group:\nconnectFullMesh failed")

    monkeypatch.setattr(distributed, "_run_once", broken)
    with pytest.raises(DistributedFailure, match="failed setting up its process group") as raised:
        run_distributed(_ok, 2)
    assert type(raised.value) is DistributedFailure  # reported after the second attempt, not retried again


def test_a_process_group_setup_error_that_is_no_connection_failure_is_raised_at_once() -> None:
    # A misconfiguration fails the same way every time: no second attempt.
    with pytest.raises(DistributedFailure, match="failed setting up its process group"):
        run_distributed(_ok, 2, env={"GLOO_SOCKET_IFNAME": "ws-no-such-interface"})


def test_run_distributed_times_out_instead_of_hanging() -> None:
    with pytest.raises(DistributedFailure, match=r"ranks \[0, 1\] did not finish within 8 s"):
        run_distributed(_hang, 2, timeout_s=8)
