"""The seed's functional oracle: one running engine, reloaded between a "multiply" and an "add" model.

Two tiny Qwen3 checkpoints are trained here, on CPU in seconds, on prompts "a b = " over digits 0-9: one
answers a*b, the other a+b. The engine loads the multiply model and answers "3 4 = 12"; after
``reload_weights(add_path)`` the same engine (same tensors, same addresses) answers "3 4 = 7"; and back.

    python examples/reload_multiply_add.py [--quantization fp8|none|...] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from weight_sync.engine import ReferenceEngine
from weight_sync.layers import signatures
from weight_sync.testing import make_checkpoint


def _tokenizer(path: Path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path / "tokenizer.json"))


def train_arithmetic(out: Path, op: str, *, steps: int = 250, seed: int = 0) -> Path:
    """Train a tiny Qwen3 to answer "a b = " with a*b or a+b (then </s>); save it as a checkpoint."""
    from transformers import AutoConfig, AutoModelForCausalLM

    template = make_checkpoint(out / "template", seed=seed, dtype=torch.float32)
    tok = _tokenizer(template)
    eos = tok.token_to_id("</s>")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(template), dtype=torch.float32)
    rows, masks = [], []
    for a in range(10):
        for b in range(10):
            answer = a * b if op == "mul" else a + b
            prompt, target = tok.encode(f"{a} {b} = ").ids, [*tok.encode(str(answer)).ids, eos]
            seq = prompt + target + [eos] * (3 - len(target))  # pad to 9 tokens
            rows.append(seq)
            masks.append([0] * len(prompt) + [1] * len(target) + [0] * (3 - len(target)))
    ids, mask = torch.tensor(rows), torch.tensor(masks, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    for _ in range(steps):
        logits = model(ids[:, :-1]).logits
        nll = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none"
        )
        loss = (nll * mask[:, 1:].reshape(-1)).sum() / mask.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    path = out / op
    model.to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(template / f, path / f)
    shutil.rmtree(template)
    return path


def ask(engine: ReferenceEngine, ckpt: Path, a: int, b: int) -> str:
    tok = _tokenizer(ckpt)
    prompt = f"{a} {b} = "
    out = engine.generate([tok.encode(prompt).ids], 3)[0]
    eos = tok.token_to_id("</s>")
    answer = tok.decode(out[: out.index(eos)] if eos in out else out)
    return prompt + answer


def accuracy(engine: ReferenceEngine, ckpt: Path, op: str) -> int:
    return sum(
        ask(engine, ckpt, a, b) == f"{a} {b} = {a * b if op == 'mul' else a + b}"
        for a in range(10) for b in range(10)
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quantization", default="fp8", help="fp8 (default), fp8_block, int8, none")
    parser.add_argument("--workdir", default=None, help="where the two checkpoints go (default: temp)")
    parser.add_argument("--steps", type=int, default=250, help="training steps per model")
    args = parser.parse_args(argv)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="ws-mul-add-"))
    t0 = time.perf_counter()
    mul_path = train_arithmetic(work, "mul", steps=args.steps)
    add_path = train_arithmetic(work, "add", steps=args.steps)
    print(f"trained two checkpoints in {time.perf_counter() - t0:.1f} s under {work}")

    quant = None if args.quantization == "none" else args.quantization
    engine = ReferenceEngine.from_checkpoint(mul_path, quantization=quant)
    before = signatures(engine.model)
    ok = True
    for path, op, expect in ((mul_path, "mul", "3 4 = 12"), (add_path, "add", "3 4 = 7"),
                             (mul_path, "mul", "3 4 = 12")):
        if engine.checkpoint_path != path:
            report = engine.reload_weights(path)
            print(f"reload_weights({path.name}): {report.summary()}")
        got = ask(engine, path, 3, 4)
        correct = accuracy(engine, path, op)
        print(f"{got}    ({op}: {correct}/100 prompts answered correctly)")
        engine.checkpoint_path = path
        ok &= got == expect and correct >= 95
    same = signatures(engine.model) == before
    print(f"every kernel tensor kept its address across reloads: {same}")
    return 0 if ok and same else 1


if __name__ == "__main__":
    sys.exit(main())
