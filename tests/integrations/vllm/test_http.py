"""An OpenAI-compatible vLLM server (dev mode) driven over HTTP by the trainer-side client."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integrations.vllm.conftest import ENGINE_ARGS, MAX_TOKENS, PROMPTS, checkpoint_items

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(vllm_ckpts: dict[str, Path], fresh_tokens) -> Iterator[str]:
    from weight_sync.integrations.vllm import engine_cli_args

    port = _free_port()
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(vllm_ckpts["a"]),
        "--host", "127.0.0.1", "--port", str(port), "--dtype", ENGINE_ARGS["dtype"], "--enforce-eager",
        "--max-model-len", str(ENGINE_ARGS["max_model_len"]),
        "--kv-cache-memory-bytes", str(ENGINE_ARGS["kv_cache_memory_bytes"]), "--seed", "0",
        *engine_cli_args(),
    ]
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log: list[str] = []
    assert proc.stdout is not None
    # Readiness is the server's own log line; reading blocks until it appears or the server exits.
    for line in proc.stdout:
        log.append(line)
        if "Application startup complete" in line:
            break
    if proc.poll() is not None:
        pytest.fail("the vLLM server exited during startup:\n" + "".join(log[-40:]))
    drain = threading.Thread(target=lambda: [log.append(x) for x in proc.stdout], daemon=True)  # type: ignore[union-attr]
    drain.start()
    _wait_listening(port)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait_listening(port: int, timeout_s: float = 60.0) -> None:
    """Uvicorn logs startup before its socket accepts connections; connect until it does (bounded).

    The wait polls another process's socket (there is nothing of ours to synchronize with)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            threading.Event().wait(0.1)


def _completions(url: str, model: str) -> list[list[int]]:
    out = []
    for prompt in PROMPTS:
        body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
                "return_token_ids": True}
        req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as resp:
            out.append(json.loads(resp.read())["choices"][0]["token_ids"])
    return out


def test_reload_and_push_through_the_http_routes_serve_like_fresh_engines(server, vllm_ckpts, fresh_tokens) -> None:
    from weight_sync.integrations.vllm import HTTPControl, WeightSyncClient

    model = str(vllm_ckpts["a"])
    assert _completions(server, model) == fresh_tokens["a"]
    with WeightSyncClient(HTTPControl(server)) as client:
        [report] = client.reload_weights(weights_path=vllm_ckpts["b"], version="b-path")
        assert report["version"] == "b-path"
        assert _completions(server, model) == fresh_tokens["b"]
        client.connect()
        client.push(dict(checkpoint_items(vllm_ckpts["a"])), version=5)
        assert _completions(server, model) == fresh_tokens["a"]
        assert client.weight_version() == "5"
        client.reload_weights(weights_iterator=checkpoint_items(vllm_ckpts["b"]))
        assert _completions(server, model) == fresh_tokens["b"]
        assert client.status() == [{"torn": None, "version": None, "updating": False}]
        assert len(client.fingerprint()[0]) == 64


def test_vllms_trainer_api_over_its_http_client_updates_the_server_like_a_fresh_engine(
    server, vllm_ckpts, fresh_tokens
) -> None:
    # upstream's examples/rl/rlhf_http_nccl.py with only the init info (backend) and transport changed
    from vllm.distributed.weight_transfer import (
        HTTPVLLMWeightSyncClient,
        ModuleSource,
        WeightTransferTrainerFactory,
    )

    from tests.integrations.vllm.test_transfer import hf_trainer_model, load_trainer_weights
    from weight_sync.integrations.vllm.trainer import WeightSyncTrainerInitInfo

    model = hf_trainer_model(vllm_ckpts["b"])
    with urllib.request.urlopen(f"{server}/get_world_size", timeout=30) as resp:
        world_size = json.loads(resp.read())["world_size"] + 1
    engine = WeightTransferTrainerFactory.trainer_init(
        init_info=WeightSyncTrainerInitInfo(world_size=world_size, rank=0, packed=True, transport="gloo"),
        client=HTTPVLLMWeightSyncClient(server),
        source=ModuleSource(model),
    )
    try:
        engine.send_weights()
        assert _completions(server, str(vllm_ckpts["a"])) == fresh_tokens["b"]
        load_trainer_weights(model, vllm_ckpts["a"])
        engine.send_weights()
        assert _completions(server, str(vllm_ckpts["a"])) == fresh_tokens["a"]
    finally:
        engine.shutdown()
