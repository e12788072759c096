"""The Triton fp8 dequantize kernel under Triton's CPU interpreter against the torch path: the same weight.

As in test_fp8_triton_interpret.py the kernel runs in one child process with ``TRITON_INTERPRET=1``.
The interpreter's own float conversions are not the GPU's (fp8 widening, and rounding into bf16/fp16),
so the child swaps in torch's - after checking that the kernel asks for round-to-nearest-even - and the
test checks what the kernel itself decides: which scale each element takes (tensor, per row, per tile,
ragged edges, a row stride wider than the rows) and the one fp32 multiply. The GPU test
(test_fp8_gpu.py) runs the same comparison compiled.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch

from tests.quant._fp8_cases import random_weight, run_interpreted
from weight_sync.quant.fp8 import Fp8Config, dequantize_fp8, quantize_fp8

needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="Triton is not installed: no interpreter to run the kernel"
)

_CHILD = r"""
import os, sys
assert os.environ.get("TRITON_INTERPRET") == "1"
import numpy as np, torch
import triton.language as tl
from triton.runtime import interpreter
from weight_sync.quant.fp8_triton import dequantize_fp8_triton

TORCH = {tl.float32: torch.float32, tl.bfloat16: torch.bfloat16, tl.float16: torch.float16,
         tl.float8e4nv: torch.float8_e4m3fn}
BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
convert = interpreter.InterpreterBuilder.create_fp_to_fp
def create_fp_to_fp(self, src, dst_type, rounding_mode):
    a, b = src.dtype.scalar, dst_type.scalar
    if (a, b) in ((tl.float8e4nv, tl.float32), (tl.float32, tl.bfloat16), (tl.float32, tl.float16)):
        if a == tl.float32:
            assert rounding_mode == interpreter._ir.ROUNDING_MODE.RTNE, rounding_mode
        t = torch.from_numpy(np.ascontiguousarray(src.data)).view(TORCH[a]).to(TORCH[b])
        data = t.view(BITS[t.element_size()]).numpy().view(interpreter._get_np_dtype(dst_type))
        return interpreter.TensorHandle(data, b)
    return convert(self, src, dst_type, rounding_mode)
interpreter.InterpreterBuilder.create_fp_to_fp = create_fp_to_fp
# fp32 -> bf16 with rtne is emitted as an fptrunc (round to nearest even on the GPU, as LLVM defines it);
# the interpreter truncates it.
trunc = interpreter.InterpreterBuilder.create_fp_trunc
def create_fp_trunc(self, src, dst_type):
    if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
        return create_fp_to_fp(self, src, dst_type, interpreter._ir.ROUNDING_MODE.RTNE)
    return trunc(self, src, dst_type)
interpreter.InterpreterBuilder.create_fp_trunc = create_fp_trunc

out = {}
for name, c in torch.load(sys.argv[1]).items():
    out[name] = dequantize_fp8_triton(c["q"], c["s"], c["granularity"], c["block"], c["dtype"])
torch.save(out, sys.argv[2])
"""


def _cases() -> dict[str, dict[str, Any]]:
    cases: dict[str, dict[str, Any]] = {}
    for granularity, block in (("tensor", (128, 128)), ("channel", (128, 128)), ("block", (128, 128)),
                               ("block", (64, 32))):
        for i, shape in enumerate([(256, 384), (200, 300), (1, 5), (129, 129)]):
            config = Fp8Config(granularity=granularity, block_size=block)
            q, s = quantize_fp8(random_weight(shape, torch.float32, i), config)
            for dtype in (torch.bfloat16, torch.float16, torch.float32):
                name = f"{granularity}{block}-{shape}-{dtype}".replace(" ", "").replace("torch.", "")
                cases[name] = {"q": q, "s": s, "granularity": granularity, "block": block, "dtype": dtype}
        # A column prefix of a wider weight: a row stride wider than the rows (whole tiles of it).
        q, s = quantize_fp8(random_weight((160, 256), torch.float32, 9), Fp8Config(granularity=granularity,
                                                                                   block_size=block))
        cols = 2 * block[1] if granularity == "block" else 100
        ss = s[:, : cols // block[1]] if granularity == "block" else s
        cases[f"{granularity}{block}-prefix".replace(" ", "")] = {
            "q": q[:, :cols], "s": ss, "granularity": granularity, "block": block, "dtype": torch.bfloat16}
    return cases


CASES = _cases()


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    return run_interpreted(_CHILD, CASES, tmp_path_factory.mktemp("fp8_dequant_interpret"))


@needs_triton
@pytest.mark.parametrize("name", list(CASES))
def test_the_interpreted_dequantize_gives_the_torch_paths_weight_bitwise(name: str, interpreted) -> None:
    c, got = CASES[name], interpreted[name]
    ref = dequantize_fp8(c["q"], c["s"], Fp8Config(granularity=c["granularity"], block_size=c["block"]), c["dtype"])
    assert got.dtype == ref.dtype and got.shape == ref.shape
    bits = {2: torch.int16, 4: torch.int32}[ref.element_size()]
    assert torch.equal(got.view(bits), ref.view(bits)), name
