"""``weight-sync make-checkpoint``: write a tiny HF checkpoint locally."""

from __future__ import annotations

import argparse
import json

from weight_sync.engine.config import MODEL_DTYPES
from weight_sync.testing.checkpoint import ARCHS, PRESETS, make_checkpoint


def _parse_override(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"--set expects KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def _run(args: argparse.Namespace) -> int:
    path = make_checkpoint(
        args.path, arch=args.arch, preset=args.preset, seed=args.seed, dtype=MODEL_DTYPES[args.dtype],
        tokenizer=not args.no_tokenizer, **dict(args.set),
    )
    print(f"wrote {args.arch}/{args.preset} (seed {args.seed}) to {path}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "make-checkpoint",
        help="write a tiny HF-format checkpoint (config, safetensors, tokenizer)",
        description="Write a random HF-format model directory that transformers and vLLM can load.",
    )
    p.add_argument("path", help="output directory")
    p.add_argument("--arch", choices=sorted(ARCHS), default="qwen3")
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=sorted(MODEL_DTYPES), default="bfloat16")
    p.add_argument("--no-tokenizer", action="store_true", help="skip tokenizer files")
    p.add_argument("--set", type=_parse_override, action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field (JSON value), e.g. --set hidden_size=96")
    p.set_defaults(func=_run)
