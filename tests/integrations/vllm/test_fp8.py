"""``quantization="fp8"`` (online fp8): weight_sync's reload equals vLLM's own, bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.integrations.vllm.conftest import driver_model, greedy, start_llm, stop_llm
from weight_sync.checksum import raw_bytes

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm


def _kernel_tensors(llm) -> dict[str, torch.Tensor]:
    """Every graph-visible tensor of the in-process model but KV caches, copied to host, raw bytes."""
    from weight_sync.layers import iter_graph_visible_tensors

    return {
        name: t.detach().clone()
        for name, t in iter_graph_visible_tensors(driver_model(llm))
        if not name.endswith(".kv_cache")
    }


def _assert_bitwise_equal(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> None:
    assert sorted(ours) == sorted(theirs)
    for name, t in theirs.items():
        o = ours[name]
        assert (o.dtype, tuple(o.shape), o.stride()) == (t.dtype, tuple(t.shape), t.stride()), name
        # raw_bytes copies a scale whose size-1 dimension has stride 0 (vLLM expands some).
        assert torch.equal(raw_bytes(o), raw_bytes(t)), name


@pytest.fixture(scope="module")
def vllm_reload_of_b(vllm_ckpts: dict[str, Path]):
    """Kernel tensors and tokens of a plain fp8 vLLM engine on A after vLLM's own reload_weights(B)."""
    from weight_sync.integrations.vllm.cpu_fp8 import install_cpu_fp8_fallback

    install_cpu_fp8_fallback()  # in-process engines share this process's kernels
    llm = start_llm(vllm_ckpts["a"], weight_sync=False, quantization="fp8")
    try:
        llm.collective_rpc("reload_weights", kwargs={"weights_path": str(vllm_ckpts["b"])})
        return _kernel_tensors(llm), greedy(llm)
    finally:
        stop_llm(llm)


def test_fp8_reload_gives_every_kernel_tensor_bitwise_equal_to_vllms_own_reload(vllm_ckpts, vllm_reload_of_b) -> None:
    theirs, their_tokens = vllm_reload_of_b
    llm = start_llm(vllm_ckpts["a"], quantization="fp8", options={"cpu_fp8_fallback": True})
    try:
        before = _kernel_tensors(llm)
        weight = "model.layers.0.self_attn.qkv_proj.weight"
        assert before[weight].dtype == torch.float8_e4m3fn
        assert not torch.equal(before[weight].view(torch.uint8), theirs[weight].view(torch.uint8))
        [report] = llm.collective_rpc("reload_weights", kwargs={"weights_path": str(vllm_ckpts["b"])})
        assert "model.layers.0.self_attn.qkv_proj" in report["layers_processed"]
        _assert_bitwise_equal(_kernel_tensors(llm), theirs)
        assert greedy(llm) == their_tokens
        llm.collective_rpc("reload_weights", kwargs={"weights_path": str(vllm_ckpts["a"])})
        _assert_bitwise_equal(_kernel_tensors(llm), before)
    finally:
        stop_llm(llm)


def _tile_state_after_request(_: object) -> tuple[bool, bool, bool]:
    """In a fresh process: (AMX tiles present, what the request answered, whether Linux now permits them)."""
    import ctypes

    from weight_sync.integrations.vllm.cpu_fp8 import request_amx_tile_state

    answered = request_amx_tile_state()
    libc = ctypes.CDLL(None, use_errno=True)
    permitted = ctypes.c_uint64(0)
    arch_get_xcomp_perm, sys_arch_prctl, xtiledata = 0x1022, 158, 18
    ok = libc.syscall(sys_arch_prctl, arch_get_xcomp_perm, ctypes.byref(permitted)) == 0
    return torch.cpu._is_amx_tile_supported(), answered, ok and bool(permitted.value >> xtiledata & 1)


@pytest.mark.skipif(not hasattr(torch.cpu, "_init_amx"), reason="this torch cannot ask for AMX tile state")
def test_a_fresh_engine_process_holds_amx_tile_state_before_vllms_amx_fp8_kernels_run() -> None:
    # vLLM spawns engine processes on CPU; one that never asked for tile state dies with SIGILL at its
    # first AMX fp8 GEMM. The worker asks in load_model; in a fresh process the request is granted
    # exactly where the CPU has AMX tiles.
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(1) as pool:
        has_amx, answered, permitted = pool.map(_tile_state_after_request, [None])[0]
    assert answered == has_amx
    assert permitted == has_amx
