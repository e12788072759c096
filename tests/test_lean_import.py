"""Importing weight_sync stays light: no CUDA initialization, no vllm, no ray."""

from __future__ import annotations

import subprocess
import sys


def test_import_weight_sync_initializes_no_cuda_and_imports_neither_vllm_nor_ray() -> None:
    code = (
        "import sys, torch\n"
        "import weight_sync, weight_sync.engine, weight_sync.reload, weight_sync.quant, weight_sync.layers\n"
        "assert not torch.cuda.is_initialized(), 'CUDA initialized by import'\n"
        "bad = [m for m in ('vllm', 'ray') if m in sys.modules]\n"
        "assert not bad, f'imported {bad}'\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_public_api_lists_are_sorted_and_resolve() -> None:
    import weight_sync

    names = [n for n in weight_sync.__all__ if n != "__version__"]
    assert names == sorted(names)
    for n in weight_sync.__all__:
        assert hasattr(weight_sync, n), n
