"""The main job, in process: a QeRL-style loop that trains a policy and syncs it into an fp8 engine.

Each step: the fp8 reference engine samples rollouts; a transformers model (the trainer, fp32) takes one
policy-gradient step (reward = fraction of generated tokens that are printable characters rather
than filler tokens, group-normalized
advantages); its weights then go through ``begin_update`` / ``load`` / ``finish`` into the engine, which
serves the next rollouts. Every step also checks the engine against a fresh engine loaded from the
trainer's weights (fingerprints must match), so a silently wrong sync cannot pass.
"""

from __future__ import annotations

import json
import logging
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from weight_sync.engine import ReferenceEngine
from weight_sync.layers import order_by_block
from weight_sync.manifest import Manifest
from weight_sync.testing import make_checkpoint
from weight_sync.testing.checkpoint import CHARS, SPECIAL_TOKENS

__all__ = ["DemoConfig", "StepResult", "run_demo", "trainer_weights"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class DemoConfig:
    """Knobs of the demo loop (defaults finish in well under a minute on 2 CPU cores)."""

    steps: int = 15
    prompts_per_step: int = 8
    samples_per_prompt: int = 4
    new_tokens: int = 8
    lr: float = 1e-2
    temperature: float = 1.0
    quantization: str | None = "fp8"
    seed: int = 0
    target_chars: str = "".join(CHARS)
    out_dir: Path = Path("runs/demo")
    verify: bool = True

    def __post_init__(self) -> None:
        for name in ("steps", "prompts_per_step", "samples_per_prompt", "new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.samples_per_prompt < 2:
            raise ValueError("samples_per_prompt must be >= 2 (advantages are relative within a group)")


@dataclass(frozen=True, slots=True)
class StepResult:
    step: int
    reward: float
    sync_s: float
    sync_bytes: int
    fingerprint_match: bool | None


def trainer_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named parameters of a transformers causal LM, complete blocks in forward order."""
    params = dict(model.named_parameters())
    for name in order_by_block(params, reference_order=list(params)):
        yield name, params[name].detach()


def _target_ids(chars: str) -> torch.Tensor:
    return torch.tensor([len(SPECIAL_TOKENS) + CHARS.index(c) for c in chars])


def _sequence_logprobs(model, full: torch.Tensor, prompt_len: int) -> torch.Tensor:
    logits = model(full).logits[:, prompt_len - 1 : -1].float()
    targets = full[:, prompt_len:]
    return torch.log_softmax(logits, -1).gather(-1, targets[..., None]).squeeze(-1).sum(-1)


def _fresh_fingerprint(model, config_dir: Path, scratch: Path, quantization: str | None) -> str:
    from safetensors.torch import save_file

    for f in ("config.json",):
        (scratch / f).write_bytes((config_dir / f).read_bytes())
    save_file({n: t.contiguous() for n, t in trainer_weights(model)}, str(scratch / "model.safetensors"))
    return ReferenceEngine.from_checkpoint(
        scratch, dtype=torch.bfloat16, quantization=quantization
    ).fingerprint()


def run_demo(config: DemoConfig) -> list[StepResult]:
    """Run the loop; returns one result per step and writes results.json + reward_curve.png."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(config.seed)
    out = Path(config.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ckpt = make_checkpoint(out / "policy-init", seed=config.seed, dtype=torch.float32)
    trainer = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    trainer.train()
    opt = torch.optim.Adam(trainer.parameters(), lr=config.lr)
    engine = ReferenceEngine.from_checkpoint(ckpt, dtype=torch.bfloat16, quantization=config.quantization)
    manifest = Manifest.from_named_tensors(trainer_weights(trainer))
    targets = _target_ids(config.target_chars)
    gen = torch.Generator().manual_seed(config.seed)
    results: list[StepResult] = []
    scratch = Path(tempfile.mkdtemp(prefix="ws-demo-"))
    print(f"engine: reference, quantization={config.quantization}; trainer: transformers fp32; "
          f"{len(manifest)} tensors, {manifest.nbytes / 1e6:.1f} MB per sync")
    for step in range(config.steps):
        prompts = torch.randint(len(SPECIAL_TOKENS), len(SPECIAL_TOKENS) + len(CHARS),
                                (config.prompts_per_step, 4), generator=gen).tolist()
        batch = [p for p in prompts for _ in range(config.samples_per_prompt)]
        completions = engine.generate(batch, config.new_tokens, temperature=config.temperature,
                                      seed=config.seed * 100_003 + step)
        comp = torch.tensor(completions)
        rewards = torch.isin(comp, targets).float().mean(-1)
        grouped = rewards.view(config.prompts_per_step, config.samples_per_prompt)
        adv = (grouped - grouped.mean(-1, keepdim=True)).view(-1)
        full = torch.cat([torch.tensor(batch), comp], dim=1)
        loss = -(adv * _sequence_logprobs(trainer, full, 4)).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        t0 = time.perf_counter()
        with engine.begin_update(manifest, version=step + 1) as session:
            session.load(trainer_weights(trainer))
        report = engine.last_report = session.report
        sync_s = time.perf_counter() - t0
        match = None
        if config.verify:
            match = _fresh_fingerprint(trainer, ckpt, scratch, config.quantization) == report.fingerprint
        res = StepResult(step + 1, float(rewards.mean()), sync_s, report.num_bytes, match)
        results.append(res)
        print(f"step {res.step:3d}  reward {res.reward:.3f}  sync {res.sync_s * 1e3:7.1f} ms  "
              f"{res.sync_bytes / 1e6:5.2f} MB  fingerprint match: {res.fingerprint_match}")
    (out / "results.json").write_text(json.dumps(
        {"config": {k: str(v) for k, v in asdict(config).items()}, "steps": [asdict(r) for r in results]},
        indent=1,
    ))
    _plot(results, out / "reward_curve.png")
    return results


def _plot(results: list[StepResult], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed; skipping %s", path)
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([r.step for r in results], [r.reward for r in results], marker="o")
    ax.set_xlabel("step (one weight sync per step)")
    ax.set_ylabel("reward (digit fraction)")
    ax.set_title("QeRL demo: trainer -> fp8 reference engine")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
