"""``weight-sync generate``: load a checkpoint into the reference engine and generate greedily."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from weight_sync.engine.config import MODEL_DTYPES
from weight_sync.quant.registry import QUANTIZATION_NAMES


def encode(path: Path, text: str) -> list[int]:
    """Token ids of ``text`` with the checkpoint's tokenizer (tokenizers library, no network)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path / "tokenizer.json")).encode(text).ids


def decode(path: Path, ids: list[int]) -> str:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path / "tokenizer.json")).decode(ids)


def _run(args: argparse.Namespace) -> int:
    from weight_sync.engine.engine import ReferenceEngine

    path = Path(args.checkpoint)
    t0 = time.perf_counter()
    engine = ReferenceEngine.from_checkpoint(
        path, dtype=MODEL_DTYPES[args.dtype] if args.dtype else None, device=args.device,
        quantization=args.quantization, progress=True,
    )
    load_s = time.perf_counter() - t0
    prompts = args.prompt or ["3 4 = "]
    ids = [encode(path, p) for p in prompts]
    t1 = time.perf_counter()
    outs = engine.generate(ids, args.max_new_tokens)
    gen_s = time.perf_counter() - t1
    for prompt, out in zip(prompts, outs):
        if args.json:
            print(json.dumps({"prompt": prompt, "token_ids": out, "text": decode(path, out)}))
        else:
            print(f"{prompt!r} -> {decode(path, out)!r}")
    print(f"loaded in {load_s:.2f} s ({engine.last_report.summary()}); generated in {gen_s:.2f} s")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate",
        help="greedy generation with the reference engine",
        description="Load a checkpoint into the reference engine and print greedy continuations.",
    )
    p.add_argument("checkpoint", help="HF model directory (config.json + safetensors + tokenizer)")
    p.add_argument("--prompt", action="append", help="prompt text (repeatable); default '3 4 = '")
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--quantization", choices=sorted(QUANTIZATION_NAMES), default=None)
    p.add_argument("--dtype", choices=sorted(MODEL_DTYPES), default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", action="store_true", help="one JSON object per prompt")
    p.set_defaults(func=_run)
