"""A vLLM OpenAI server updated over HTTP: weights pushed over gloo and reloaded from a path.

Starts ``python -m vllm.entrypoints.openai.api_server`` on the multiply model (see
reload_multiply_add.py) with ``engine_cli_args()`` and ``VLLM_SERVER_DEV_MODE=1`` (vLLM's RL routes and
``/collective_rpc`` exist only in dev mode). The trainer side, this script, then drives it with
:class:`~weight_sync.integrations.vllm.WeightSyncClient` over :class:`HTTPControl`: it pushes the add
model's weights over a gloo transport (``/init_weight_transfer_engine``, ``/start_weight_update``,
``/update_weights``, ``/finish_weight_update``), asks ``/v1/completions`` for "3 4 = ", reloads the
multiply model from its path through ``/collective_rpc``, and reads the engine's fingerprint and status.

    python examples/vllm_http.py [--workdir DIR] [--port 0]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from reload_multiply_add import train_arithmetic  # the seed's oracle checkpoints

from weight_sync.safetensors_io import iter_checkpoint


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_listening(port: int, timeout_s: float = 60.0) -> None:
    """Uvicorn reports startup before its socket accepts; wait (bounded) until a connection succeeds."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)  # polling an external server's socket, not synchronizing our own threads


def _complete(url: str, model: str, prompt: str) -> str:
    body = {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0.0, "stop": ["</s>"]}
    req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return prompt + json.loads(resp.read())["choices"][0]["text"].strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--port", type=int, default=0, help="server port (0: pick a free one)")
    args = parser.parse_args()

    from weight_sync.integrations.vllm import HTTPControl, WeightSyncClient, engine_cli_args

    work = args.workdir or Path(tempfile.mkdtemp(prefix="ws-vllm-http-"))
    mul, add = train_arithmetic(work / "mul", "mul"), train_arithmetic(work / "add", "add", seed=1)
    port = args.port or _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(mul),
           "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16", "--enforce-eager",
           "--max-model-len", "64", "--kv-cache-memory-bytes", str(32 << 20), *engine_cli_args()]
    server = subprocess.Popen(cmd, env={**os.environ, "VLLM_SERVER_DEV_MODE": "1"},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log: list[str] = []
    ready = threading.Event()

    def drain() -> None:  # keeps the server's pipe from filling up, and notices when it is ready
        assert server.stdout is not None
        for line in server.stdout:
            log.append(line)
            if "Application startup complete" in line:
                ready.set()
        ready.set()

    threading.Thread(target=drain, daemon=True).start()
    try:
        if not ready.wait(600) or server.poll() is not None:
            raise SystemExit("the server did not start:\n" + "".join(log[-30:]))
        _wait_listening(port)
        print("multiply model serves: ", _complete(url, str(mul), "3 4 = "))
        with WeightSyncClient(HTTPControl(url)) as client:
            client.connect()
            report = client.push(dict(iter_checkpoint(add)), version="add-1")
            print(f"pushed add over gloo:   {_complete(url, str(mul), '3 4 = ')}  "
                  f"({report.num_bytes / 1e6:.1f} MB, engine version {client.weight_version()})")
            client.reload_weights(weights_path=str(mul), version="mul-2")
            print("reloaded mul from path:", _complete(url, str(mul), "3 4 = "))
            print("fingerprint:", client.fingerprint()[0][:16], "status:", client.status()[0])
    finally:
        server.terminate()
        server.wait(60)


if __name__ == "__main__":
    main()
