"""Importing weight_sync (and weight_sync.offload) never initializes CUDA or starts threads."""

from __future__ import annotations

import subprocess
import sys


def test_importing_offload_does_not_touch_cuda_or_the_offload_machinery() -> None:
    code = (
        "import sys, threading, torch\n"
        "import weight_sync\n"
        "assert 'weight_sync.offload.streamer' not in sys.modules, 'weight_sync imports offload'\n"
        "import weight_sync.offload\n"
        "assert not torch.cuda.is_initialized()\n"
        "assert threading.active_count() == 1\n"
        "assert 'diffusers' not in sys.modules\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
