"""Importing the transport (and the trainer side) never imports ray and never initializes CUDA."""

from __future__ import annotations

import subprocess
import sys


def test_import_weight_sync_transport_and_trainers_is_lean() -> None:
    code = (
        "import sys, torch, weight_sync, weight_sync.transport, trainers\n"
        "assert 'ray' not in sys.modules, 'ray was imported'\n"
        "assert not torch.cuda.is_initialized(), 'CUDA was initialized'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
