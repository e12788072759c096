"""The main job, in process: a QeRL-style loop that trains a policy and syncs it into an fp8 engine.

Each step: the fp8 reference engine samples rollouts; a transformers model (the trainer, fp32) takes one
policy-gradient step (reward = fraction of generated tokens that are printable characters rather
than filler tokens, group-normalized
advantages); its weights then go through ``begin_update`` / ``load`` / ``finish`` into the engine, which
serves the next rollouts. Every step also checks the engine against a fresh engine loaded from the
trainer's weights (fingerprints must match), so a silently wrong sync cannot pass.

``asynchronous=True`` (``--async``, engine in process): the rollouts of step k+1 are generated while step
k's weights travel into the engine's staging twin (a non-blocking push); the engine commits them between
two decode steps, so a rollout may hold tokens of two versions, each token of exactly one. Each step
reports the staleness of its rollouts (optimizer steps between the trainer and the version that
generated a token) and checks the update that arrived against a fresh engine, as the synchronous loop.
"""

from __future__ import annotations

import json
import logging
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from weight_sync.engine import ReferenceEngine
from weight_sync.errors import ConfigError
from weight_sync.layers import order_by_block
from weight_sync.manifest import Manifest
from weight_sync.testing import make_checkpoint
from weight_sync.testing.checkpoint import CHARS, SPECIAL_TOKENS

__all__ = ["ENGINES", "TRANSPORTS", "DemoConfig", "StepResult", "run_demo", "trainer_weights"]

# 'inproc': the engine lives in the trainer's process; the others run engine worker processes.
TRANSPORTS = ("inproc", "gloo", "shm", "nccl", "ipc")
# 'reference': weight_sync's engine; 'vllm': the installed vLLM through its RL API (trainers.demo_vllm).
ENGINES = ("reference", "vllm")

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
    transport: str = "gloo"
    workers: int = 1
    bucket_bytes: int = 1 << 20
    zero_copy: bool = False
    # Delta sync: each step ships only the bytes that changed since the engines' last committed version
    # (weights travel as bf16, the engines' dtype, so an element changes only when its bf16 value does).
    delta: bool = False
    # Asynchronous RL: generate step k+1's rollouts while step k's weights are staged (reference engine
    # in process; vLLM: pushed into every worker's staging twin, committed under
    # pause_generation(mode="keep")).
    asynchronous: bool = False
    engine: str = "reference"
    # vLLM, asynchronous: pause generation for the whole update (transfer, processing, copy) through
    # vLLM's RL API instead of staging it and pausing only for the commit - the mode to compare against.
    pause_whole_update: bool = False

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ConfigError(f"engine must be one of {ENGINES}, got {self.engine!r}")
        for name in ("steps", "prompts_per_step", "samples_per_prompt", "new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {self.transport!r}")
        if self.workers < 1 or (self.transport == "inproc" and self.workers != 1):
            raise ValueError(f"workers must be >= 1 (exactly 1 with transport 'inproc'), got {self.workers}")
        if self.zero_copy and self.transport not in ("ipc", "shm"):
            raise ValueError(f"zero_copy needs transport 'ipc' or 'shm', got {self.transport!r}")
        if self.delta and (self.transport == "inproc" or self.zero_copy):
            raise ValueError(f"delta needs a buffered transport to engine processes, got transport "
                             f"{self.transport!r}, zero_copy={self.zero_copy}")
        if self.pause_whole_update and not (self.engine == "vllm" and self.asynchronous):
            raise ConfigError(f"pause_whole_update is a mode of the asynchronous vLLM loop: it needs engine 'vllm' "
                              f"and asynchronous, got engine {self.engine!r}, asynchronous={self.asynchronous}")
        if self.engine == "vllm":
            self._check_vllm()
        elif self.asynchronous and (self.transport != "inproc" or self.delta):
            raise ValueError(f"asynchronous needs transport 'inproc' (the engine stages in this process) and "
                             f"full updates, got transport {self.transport!r}, delta={self.delta}")
        if self.samples_per_prompt < 2:
            raise ValueError("samples_per_prompt must be >= 2 (advantages are relative within a group)")

    def _check_vllm(self) -> None:
        # vLLM's workers receive over a transport; one engine with one worker (TP = 1); vLLM's own fp8.
        if self.transport == "inproc" or self.workers != 1 or self.zero_copy:
            raise ConfigError(f"engine 'vllm' needs a transport to its worker ('gloo' on CPU), one worker and "
                             f"buffered updates, got transport {self.transport!r}, workers={self.workers}, "
                             f"zero_copy={self.zero_copy}")
        if self.quantization not in ("fp8", None):
            raise ConfigError(f"engine 'vllm' runs quantization 'fp8' (vLLM's online fp8) or none, got "
                             f"{self.quantization!r}")


@dataclass(frozen=True, slots=True)
class StepResult:
    step: int
    reward: float
    sync_s: float
    sync_bytes: int
    fingerprint_match: bool | None
    sync_mode: str | None = None  # delta sync: 'delta', or 'full' (first step, refused base)
    # Asynchronous: optimizer steps between the trainer and the versions of this step's rollout tokens
    # (max, mean), and how long the trainer waited for the previous push before its optimizer step.
    staleness_max: int | None = None
    staleness_mean: float | None = None
    wait_s: float | None = None
    # vLLM, asynchronous: how long generation was paused for the update (the commit only, when staged;
    # sync_s is then the push, which ran while the engine generated).
    paused_s: float | None = None


def trainer_weights(model: torch.nn.Module, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named parameters of a transformers causal LM, complete blocks in forward order (cast to
    ``dtype`` when given)."""
    params = dict(model.named_parameters())
    for name in order_by_block(params, reference_order=list(params)):
        t = params[name].detach()
        yield name, t if dtype is None else t.to(dtype)


def _target_ids(chars: str) -> torch.Tensor:
    return torch.tensor([len(SPECIAL_TOKENS) + CHARS.index(c) for c in chars])


def _sequence_logprobs(model, full: torch.Tensor, prompt_len: int) -> torch.Tensor:
    logits = model(full).logits[:, prompt_len - 1 : -1].float()
    targets = full[:, prompt_len:]
    return torch.log_softmax(logits, -1).gather(-1, targets[..., None]).squeeze(-1).sum(-1)


def _fresh_fingerprint(model, config_dir: Path, scratch: Path, quantization: str | None,
                       device: str = "cpu") -> str:
    from safetensors.torch import save_file

    for f in ("config.json",):
        (scratch / f).write_bytes((config_dir / f).read_bytes())
    save_file({n: t.contiguous() for n, t in trainer_weights(model)}, str(scratch / "model.safetensors"))
    # Built on the engines' device: online quantization is compared bitwise, on the hardware that ran it.
    return ReferenceEngine.from_checkpoint(
        scratch, dtype=torch.bfloat16, quantization=quantization, device=device
    ).fingerprint()


def run_demo(config: DemoConfig, *, vllm_engine: Any = None) -> list[StepResult]:
    """Run the loop; returns one result per step and writes results.json + reward_curve.png.

    ``vllm_engine``: with ``engine='vllm'``, a :class:`trainers.demo_vllm.VLLMDemoEngine` to run on (reset to
    this run's initial checkpoint first) instead of one started and shut down here.
    """
    from transformers import AutoModelForCausalLM

    torch.manual_seed(config.seed)
    out = Path(config.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ckpt = make_checkpoint(out / "policy-init", seed=config.seed, dtype=torch.float32)
    trainer = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    if config.transport == "ipc" and config.zero_copy:
        trainer.to("cuda:0")  # zero-copy ipc exports the trainer's own tensors: they must be on the GPU
    trainer.train()
    opt = torch.optim.Adam(trainer.parameters(), lr=config.lr)
    targets = _target_ids(config.target_chars)
    gen = torch.Generator().manual_seed(config.seed)
    scratch = Path(tempfile.mkdtemp(prefix="ws-demo-"))
    if config.engine == "vllm":
        from trainers.demo_vllm import run_vllm_loop

        results = run_vllm_loop(config, trainer, opt, targets, gen, ckpt, scratch, engine=vllm_engine)
        _save(config, results, out)
        return results
    engine, workers, sender = None, None, None
    if config.transport == "inproc":
        engine = ReferenceEngine.from_checkpoint(ckpt, dtype=torch.bfloat16, quantization=config.quantization)
    else:
        workers, sender = _start_workers(config, ckpt)
    manifest = Manifest.from_named_tensors(trainer_weights(trainer, _wire_dtype(config)))
    results: list[StepResult] = []
    where = ("in process" if workers is None
             else f"{len(workers)} worker process(es) over {config.transport}")
    print(f"engine: reference, quantization={config.quantization}, {where}; trainer: transformers fp32; "
          f"{len(manifest)} tensors, {manifest.nbytes / 1e6:.1f} MB per sync")
    try:
        if config.asynchronous:
            assert engine is not None
            results = _async_loop(config, trainer, opt, engine, manifest, targets, gen, ckpt, scratch)
        else:
            results = _loop(config, trainer, opt, engine, workers, sender, manifest, targets, gen, ckpt,
                            scratch)
    finally:
        if sender is not None:
            sender.close()
        if workers is not None:
            workers.close()
    _save(config, results, out)
    return results


def _save(config: DemoConfig, results: list[StepResult], out: Path) -> None:
    (out / "results.json").write_text(json.dumps(
        {"config": {k: str(v) for k, v in asdict(config).items()}, "steps": [asdict(r) for r in results]},
        indent=1,
    ))
    _plot(results, out / "reward_curve.png", config.engine)


def _wire_dtype(config: DemoConfig) -> torch.dtype | None:
    return torch.bfloat16 if config.delta else None


def _start_workers(config: DemoConfig, ckpt: Path):
    """Engine worker processes (one RolloutWorker each) connected to a sender in this process."""
    from trainers.remote import EngineProcesses
    from weight_sync.transport import TransportConfig, WeightSender

    if config.transport == "nccl":
        devices = [f"cuda:{i + 1}" for i in range(config.workers)]  # the sender's buffers use cuda:0
    elif config.transport == "ipc":
        devices = ["cuda:0"] * config.workers  # colocated with the sender's buffers
    else:
        devices = ["cpu"] * config.workers
    workers = EngineProcesses(str(ckpt), config.workers, devices=devices, quantization=config.quantization)
    try:
        # zero_copy: engines read the trainer's parameters in place (no buffers, no checksums).
        sender = WeightSender(TransportConfig(backend=config.transport, bucket_bytes=config.bucket_bytes,
                                              timeout_s=120, zero_copy=config.zero_copy,
                                              checksum=not config.zero_copy, delta=config.delta),
                               num_receivers=config.workers)
        workers.submit_each("init_weight_transfer_engine",
                            [({"address": sender.address, "rank": i + 1},) for i in range(config.workers)])
        sender.connect()
        workers.collect()
    except BaseException:
        workers.close()
        raise
    return workers, sender


def _rollouts(config: DemoConfig, engine, workers, batch: list[list[int]], step: int) -> list[list[int]]:
    seed = config.seed * 100_003 + step
    if workers is None:
        return engine.generate(batch, config.new_tokens, temperature=config.temperature, seed=seed)
    per = -(-len(batch) // len(workers))
    chunks = [batch[i * per : (i + 1) * per] for i in range(len(workers))]
    parts = workers.call_each("generate", [(c, config.new_tokens) for c in chunks],
                              {"temperature": config.temperature, "seed": seed})
    return [c for part in parts for c in part]


def _sync(config: DemoConfig, trainer, engine, workers, sender, manifest: Manifest, step: int):
    """Push the trainer's weights into every engine; returns (bytes, the engines' fingerprints)."""
    if workers is None:
        with engine.begin_update(manifest, version=step + 1) as session:
            session.load(trainer_weights(trainer))
        report = engine.last_report = session.report
        return report.num_bytes, [report.fingerprint], None
    workers.submit("receive_update")
    try:
        report = sender.send(trainer_weights(trainer, _wire_dtype(config)), manifest, version=step + 1)
    finally:
        workers.collect()
    return report.num_bytes, report.fingerprints, report.delta.get("mode")


def _batch(config: DemoConfig, gen: torch.Generator) -> list[list[int]]:
    prompts = torch.randint(len(SPECIAL_TOKENS), len(SPECIAL_TOKENS) + len(CHARS),
                            (config.prompts_per_step, 4), generator=gen).tolist()
    return [p for p in prompts for _ in range(config.samples_per_prompt)]


def _train_step(config: DemoConfig, trainer, opt, batch: list[list[int]], completions: list[list[int]],
                targets: torch.Tensor) -> float:
    """One policy-gradient step on group-normalized rewards; returns the mean reward."""
    comp = torch.tensor(completions)
    rewards = torch.isin(comp, targets).float().mean(-1)
    grouped = rewards.view(config.prompts_per_step, config.samples_per_prompt)
    adv = (grouped - grouped.mean(-1, keepdim=True)).view(-1)
    full = torch.cat([torch.tensor(batch), comp], dim=1)
    device = next(trainer.parameters()).device
    loss = -(adv.to(device) * _sequence_logprobs(trainer, full.to(device), 4)).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    return float(rewards.mean())


def _loop(config, trainer, opt, engine, workers, sender, manifest, targets, gen, ckpt, scratch) -> list[StepResult]:
    results: list[StepResult] = []
    for step in range(config.steps):
        batch = _batch(config, gen)
        completions = _rollouts(config, engine, workers, batch, step)
        reward = _train_step(config, trainer, opt, batch, completions, targets)
        t0 = time.perf_counter()
        num_bytes, fingerprints, mode = _sync(config, trainer, engine, workers, sender, manifest, step)
        sync_s = time.perf_counter() - t0
        match = None
        if config.verify:
            device = "cpu" if workers is None else workers.devices[0]
            expected = _fresh_fingerprint(trainer, ckpt, scratch, config.quantization, device)
            match = all(fp == expected for fp in fingerprints)
        res = StepResult(step + 1, reward, sync_s, num_bytes, match, mode)
        results.append(res)
        print(f"step {res.step:3d}  reward {res.reward:.3f}  sync {res.sync_s * 1e3:7.1f} ms  "
              f"{res.sync_bytes / 1e6:5.2f} MB  fingerprint match: {res.fingerprint_match}"
              + (f"  ({mode})" if mode else ""))
    return results


def _async_loop(config: DemoConfig, trainer, opt, engine: ReferenceEngine, manifest: Manifest,
                targets: torch.Tensor, gen: torch.Generator, ckpt: Path, scratch: Path) -> list[StepResult]:
    """One-step off-policy: rollouts of step k+1 are generated while the push of version k is staged."""
    from weight_sync.transport import PushHandle, push_to_staging

    staging = engine.enable_staging()
    results: list[StepResult] = []
    handle: PushHandle | None = None
    for step in range(config.steps):
        batch = _batch(config, gen)
        rollouts = engine.generate_with_versions(batch, config.new_tokens, temperature=config.temperature,
                                                 seed=config.seed * 100_003 + step)
        # The trainer has made ``step`` optimizer steps; a token of version v is step - v steps behind
        # (the first checkpoint is version 0).
        lags = [step - (0 if span.version == "initial" else span.version)
                for r in rollouts for span in r.weight_versions for _ in range(span.end - span.start)]
        # The push in flight reads the trainer's parameters: the optimizer may change them only after it.
        match, sync_s, num_bytes, wait_s = None, 0.0, 0, 0.0
        if handle is not None:
            t0 = time.perf_counter()
            report = handle.wait()
            done = time.perf_counter()
            sync_s, num_bytes, wait_s = handle.seconds or 0.0, report.num_bytes, done - t0
            if config.verify:
                match = report.fingerprint == _fresh_fingerprint(trainer, ckpt, scratch, config.quantization)
        reward = _train_step(config, trainer, opt, batch, [r.token_ids for r in rollouts], targets)
        handle = push_to_staging(staging, trainer_weights(trainer), manifest, version=step + 1)
        res = StepResult(step + 1, reward, sync_s, num_bytes, match, None, max(lags),
                         sum(lags) / len(lags), wait_s)
        results.append(res)
        print(f"step {res.step:3d}  reward {res.reward:.3f}  staleness max {res.staleness_max} mean "
              f"{res.staleness_mean:.2f}  push of v{step}: {res.sync_s * 1e3:7.1f} ms, trainer waited "
              f"{wait_s * 1e3:6.1f} ms  {res.sync_bytes / 1e6:5.2f} MB  fingerprint match: {res.fingerprint_match}")
    if handle is not None:
        report = handle.wait()
        engine.commit_staged()
        if config.verify:
            expected = _fresh_fingerprint(trainer, ckpt, scratch, config.quantization)
            ok = report.fingerprint == expected == engine.fingerprint()
            print(f"final push v{config.steps} committed: fingerprint match: {ok}")
            last = results[-1]
            results[-1] = StepResult(**{**asdict(last), "fingerprint_match": last.fingerprint_match is not False and ok})
    return results


def _plot(results: list[StepResult], path: Path, engine: str = "reference") -> None:
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
    ax.set_ylabel("reward (printable-token fraction)")
    ax.set_title(f"QeRL demo: trainer -> {engine} engine")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
