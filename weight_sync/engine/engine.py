"""The reference rollout engine: load an HF checkpoint, generate greedily, take weight updates in place.

Decode runs on static buffers (token ids, pad offsets, the slot being written) so that one code path serves
eager execution and CUDA-graph replay; on CUDA the decode step is captured once and replayed for every
token. Updates write into the tensors the graph was captured with, so no recapture is ever needed.

Asynchronous updates (:meth:`ReferenceEngine.enable_staging`): updates land on a staging twin while the
engine generates; between two decode steps the engine commits a staged version (an in-place copy into the
live tensors), so every token is computed with exactly one version, and
:meth:`ReferenceEngine.generate_with_versions` says which version produced which tokens.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from weight_sync.engine.config import ModelConfig
from weight_sync.engine.model import CausalLM, KVCache
from weight_sync.engine.parallel import TPInfo
from weight_sync.errors import ConfigError, UpdateStateError
from weight_sync.quant.registry import resolve_quantization

if TYPE_CHECKING:
    from weight_sync.reload.staged import CommitReport, StagedWeights, StagingConfig

__all__ = ["KV_AFTER_COMMIT", "ReferenceEngine", "Rollout", "VersionSpan"]

#: What a commit in the middle of a sequence does to its KV cache: 'recompute' (prefill the prompt and
#: the tokens so far with the new weights) or 'keep' (continue on the KV the old version computed).
KV_AFTER_COMMIT = ("recompute", "keep")

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class VersionSpan:
    """Output tokens ``[start, end)`` were computed with the weights of ``version`` (vLLM's
    ``WeightVersionSpan``)."""

    version: Any
    start: int
    end: int


@dataclass(frozen=True, slots=True)
class Rollout:
    """One generated sequence: its new tokens and the versions that produced them, in order."""

    token_ids: list[int]
    weight_versions: tuple[VersionSpan, ...]

    def version_of(self, index: int) -> Any:
        """The version that produced output token ``index``."""
        for span in self.weight_versions:
            if span.start <= index < span.end:
                return span.version
        raise IndexError(f"token index {index} is outside [0, {len(self.token_ids)})")


class ReferenceEngine:
    """A small Qwen3/Qwen3-MoE/Llama engine with vLLM's loading conventions; not a serving system.

    Build it with :meth:`from_checkpoint`. ``generate`` is greedy with a static KV cache; ``logits``
    runs a full forward. Weight updates go through :meth:`reload_weights` / :meth:`begin_update`, the
    same lifecycle that performed the first load.
    """

    def __init__(
        self,
        model: CausalLM,
        *,
        device: torch.device,
        checkpoint_path: Path | None = None,
        quantization: object = None,
        max_batch_size: int = 8,
        max_seq_len: int = 512,
        use_cuda_graph: bool = True,
    ) -> None:
        if max_batch_size < 1 or max_seq_len < 2:
            raise ConfigError(
                f"max_batch_size must be >= 1 and max_seq_len >= 2, got {max_batch_size}, {max_seq_len}"
            )
        self.model = model
        self.config: ModelConfig = model.config
        self.device = device
        self.checkpoint_path = checkpoint_path
        self.quantization = quantization
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len
        self.use_cuda_graph = use_cuda_graph and device.type == "cuda" and model.tp.size == 1
        self._cache: KVCache | None = None
        self._static: dict[str, torch.Tensor] | None = None
        self._graph: torch.cuda.CUDAGraph | None = None
        self.num_graph_replays = 0
        self.last_report: Any = None
        self.staging: StagedWeights | None = None
        self.kv_after_commit = "recompute"
        self.last_commit: CommitReport | None = None
        self._generating = False

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_checkpoint(
        cls,
        path: str | os.PathLike,
        *,
        dtype: torch.dtype | None = None,
        device: str | torch.device = "cpu",
        quantization: object = None,
        tp_group: dist.ProcessGroup | None = None,
        max_batch_size: int = 8,
        max_seq_len: int = 512,
        use_cuda_graph: bool = True,
        load_weights: bool = True,
        progress: bool = False,
        expert_parallel: bool = False,
    ) -> ReferenceEngine:
        """Build the model from ``path/config.json`` and load ``path``'s safetensors through reload.

        ``quantization``: None, a short name ('fp8', 'fp8_per_channel', 'fp8_block', 'int8') or a config
        object; linear layers (and MoE experts: 'fp8' or 'fp8_block') are quantized online while
        loading. ``tp_group``: a torch.distributed group to shard over (every rank calls this with the
        same arguments). ``expert_parallel``: MoE experts are split over the group as whole experts.
        """
        from weight_sync.reload.api import reload_weights

        path = Path(path)
        engine = cls._build(
            ModelConfig.from_pretrained(path), dtype=dtype, device=device, quantization=quantization,
            tp_group=tp_group, max_batch_size=max_batch_size, max_seq_len=max_seq_len,
            use_cuda_graph=use_cuda_graph, expert_parallel=expert_parallel,
        )
        engine.checkpoint_path = path
        if load_weights:
            engine.last_report = reload_weights(
                engine.model, weights_path=path, version="initial", progress=progress
            )
        return engine

    @classmethod
    def from_config(
        cls,
        config: ModelConfig | dict[str, Any],
        *,
        weights: Iterable[tuple[str, torch.Tensor]] | None = None,
        dtype: torch.dtype | None = None,
        device: str | torch.device = "cpu",
        quantization: object = None,
        tp_group: dist.ProcessGroup | None = None,
        max_batch_size: int = 8,
        max_seq_len: int = 512,
        use_cuda_graph: bool = True,
        expert_parallel: bool = False,
    ) -> ReferenceEngine:
        """Build from a config (an HF config dict or :class:`ModelConfig`) and load ``weights``.

        ``weights`` is any iterable of checkpoint-format (name, tensor) pairs, e.g. generated on the
        device by :func:`weight_sync.testing.random_weights`; without it the engine keeps its zero
        weights (quantized layers stay unmaterialized) until the first update.
        """
        from weight_sync.manifest import Manifest
        from weight_sync.reload.api import begin_update

        if isinstance(config, dict):
            config = ModelConfig.from_hf_dict(config)
        engine = cls._build(
            config, dtype=dtype, device=device, quantization=quantization, tp_group=tp_group,
            max_batch_size=max_batch_size, max_seq_len=max_seq_len, use_cuda_graph=use_cuda_graph,
            expert_parallel=expert_parallel,
        )
        if weights is not None:
            items = list(weights)
            with begin_update(engine.model, Manifest.from_named_tensors(items), version="initial") as s:
                s.load(items)
            engine.last_report = s.report
        return engine

    @classmethod
    def _build(
        cls, config: ModelConfig, *, dtype, device, quantization, tp_group, max_batch_size,
        max_seq_len, use_cuda_graph, expert_parallel,
    ) -> ReferenceEngine:
        from weight_sync.reload.api import record_metadata_for_reloading

        if dtype is not None:
            config = ModelConfig(**{**config.to_dict(), "dtype": dtype})
        quant = resolve_quantization(quantization)
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        model = CausalLM(config, tp=TPInfo(tp_group), quantization=quant, device=device,
                         expert_parallel=expert_parallel)
        record_metadata_for_reloading(model)
        return cls(
            model, device=device, quantization=quant, max_batch_size=max_batch_size,
            max_seq_len=max_seq_len, use_cuda_graph=use_cuda_graph,
        )

    # ------------------------------------------------------------------ weight updates
    def reload_weights(
        self,
        weights_path: str | os.PathLike | None = None,
        weights_iterator: Iterable[tuple[str, torch.Tensor]] | None = None,
        **options: Any,
    ):
        """Update weights in place; with neither argument, re-read the checkpoint the engine came from."""
        from weight_sync.reload.api import reload_weights

        if weights_path is None and weights_iterator is None:
            if self.checkpoint_path is None:
                raise ConfigError("reload_weights() needs weights_path or weights_iterator")
            weights_path = self.checkpoint_path
        self.last_report = reload_weights(
            self.model, weights_path=weights_path, weights_iterator=weights_iterator, **options
        )
        return self.last_report

    def begin_update(self, manifest=None, **options: Any):
        """Start an update session on this engine's model (see :func:`weight_sync.begin_update`)."""
        from weight_sync.reload.api import begin_update

        return begin_update(self.model, manifest, **options)

    def fingerprint(self) -> str:
        from weight_sync.reload.report import fingerprint

        return fingerprint(self.model)

    @property
    def weight_version(self) -> Any:
        """The version the engine serves (the last committed update's; None before any)."""
        from weight_sync.reload.state import get_state

        return get_state(self.model, create=True).version

    # ------------------------------------------------------------------ asynchronous updates
    def enable_staging(
        self, config: StagingConfig | None = None, *, kv_after_commit: str = "recompute"
    ) -> StagedWeights:
        """Take updates on a staging twin while generating; commit them between decode steps.

        Returns the :class:`~weight_sync.reload.staged.StagedWeights` to update (directly with its
        ``begin_update``, or as a WeightReceiver's target). ``kv_after_commit``: see KV_AFTER_COMMIT.
        """
        from weight_sync.reload.staged import StagedWeights

        if kv_after_commit not in KV_AFTER_COMMIT:
            raise ConfigError(f"kv_after_commit must be one of {KV_AFTER_COMMIT}, got {kv_after_commit!r}")
        if self.staging is not None:
            raise UpdateStateError("staging is already enabled on this engine")
        if self.model.tp.size > 1:
            # Each rank would find its staged version ready at its own step boundary, while every
            # decode step is collective: ranks could compute one token with two versions.
            raise ConfigError(f"staging needs a single-rank engine (ranks would have to agree on the commit "
                              f"step), got tensor parallel size {self.model.tp.size}")
        model = self.model

        def build(device: torch.device) -> CausalLM:
            return CausalLM(self.config, tp=model.tp, quantization=self.quantization, device=device,
                            expert_parallel=model.expert_parallel)

        self.staging = StagedWeights(model, build, config=config)
        self.kv_after_commit = kv_after_commit
        return self.staging

    def commit_staged(self) -> CommitReport | None:
        """Commit a staged version now (generate does so by itself between steps); None if none."""
        if self._generating:
            raise UpdateStateError("commit_staged() while generate() runs: the engine commits between "
                                   "decode steps on its own")
        return self.last_commit if self._commit_pending() else None

    def _commit_pending(self) -> bool:
        st = self.staging
        if st is None or not st.has_pending():
            return False
        report = st.commit()
        if report is None:
            return False
        self.last_commit = report
        self.last_report = st.last_report
        log.debug("committed staged version %r in %.3f ms (%d bytes)", report.version,
                  report.seconds * 1e3, report.num_bytes)
        return True

    # ------------------------------------------------------------------ inference
    def _check_servable(self) -> None:
        """Refuse to serve half-written weights: an update open on the model, or a torn model."""
        from weight_sync.reload.state import check_servable

        check_servable(self.model)

    def _as_batch(self, token_ids: Sequence[Sequence[int]] | torch.Tensor) -> torch.Tensor:
        if isinstance(token_ids, torch.Tensor):
            ids = token_ids.to(self.device, torch.long)
            if ids.dim() == 1:
                ids = ids[None]
        else:
            lengths = {len(s) for s in token_ids}
            if len(lengths) != 1:
                raise ValueError(f"logits() needs sequences of equal length, got lengths {sorted(lengths)}")
            ids = torch.tensor([list(s) for s in token_ids], dtype=torch.long, device=self.device)
        self._check_ids(ids)
        return ids

    def _check_ids(self, ids: torch.Tensor) -> None:
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.config.vocab_size):
            raise ValueError(
                f"token ids must be in [0, {self.config.vocab_size}), got range "
                f"[{int(ids.min())}, {int(ids.max())}]"
            )

    @torch.no_grad()
    def logits(self, token_ids: Sequence[Sequence[int]] | torch.Tensor) -> torch.Tensor:
        """Full-forward logits, fp32, shape (batch, tokens, vocab)."""
        self._check_servable()
        ids = self._as_batch(token_ids)
        b, t = ids.shape
        pos = torch.arange(t, device=self.device).expand(b, t)
        mask = torch.ones(t, t, dtype=torch.bool, device=self.device).tril()[None, None]
        h = self.model(ids, pos, mask)
        return self.model.compute_logits(h).float()

    def _ensure_static(self) -> dict[str, torch.Tensor]:
        if self._cache is None:
            c = self.config
            kv_local = self.model.num_local_kv_heads
            self._cache = KVCache(
                c.num_hidden_layers, self.max_batch_size, kv_local, self.max_seq_len, c.head_dim,
                c.dtype, self.device,
            )
        if self._static is None:
            bmax, dev = self.max_batch_size, self.device
            self._static = {
                "ids": torch.zeros(bmax, 1, dtype=torch.long, device=dev),
                "pad": torch.zeros(bmax, dtype=torch.long, device=dev),
                "slot": torch.zeros(1, dtype=torch.long, device=dev),
                "keys": torch.arange(self.max_seq_len, device=dev),
                "logits": torch.zeros(bmax, self.config.vocab_size, dtype=torch.float32, device=dev),
            }
        return self._static

    def _decode_step(self) -> None:
        """One decode step over the static buffers (the body of the CUDA graph): next-token logits."""
        s = self._static
        assert s is not None and self._cache is not None
        pos = (s["slot"] - s["pad"]).clamp(min=0)[:, None]
        keys = s["keys"][None]
        mask = ((keys >= s["pad"][:, None]) & (keys <= s["slot"]))[:, None, None, :]
        h = self.model(s["ids"], pos, mask, self._cache, s["slot"])
        s["logits"].copy_(self.model.compute_logits(h[:, -1]))

    def _run_decode(self) -> None:
        if not self.use_cuda_graph:
            self._decode_step()
            return
        if self._graph is None:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):  # warm up kernels and allocator pools off the capture
                for _ in range(2):
                    self._decode_step()
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self._decode_step()
            self._graph = graph
        self._graph.replay()
        self.num_graph_replays += 1

    def generate(
        self,
        prompt_token_ids: Sequence[Sequence[int]],
        max_new_tokens: int,
        *,
        temperature: float = 0.0,
        seed: int | None = None,
    ) -> list[list[int]]:
        """Continue each prompt; returns only the new tokens.

        temperature 0 (default) is greedy; > 0 samples from softmax(logits / temperature) with a
        generator seeded by ``seed`` (reproducible rollouts).
        """
        return [r.token_ids for r in self.generate_with_versions(
            prompt_token_ids, max_new_tokens, temperature=temperature, seed=seed)]

    @torch.no_grad()
    def generate_with_versions(
        self,
        prompt_token_ids: Sequence[Sequence[int]],
        max_new_tokens: int,
        *,
        temperature: float = 0.0,
        seed: int | None = None,
        on_step: Callable[[int], None] | None = None,
    ) -> list[Rollout]:
        """:meth:`generate`, with the weight versions that produced each sequence's tokens.

        With staging enabled, a staged version is committed before the prefill and between any two
        decode steps; the tokens after it come from the new version (see ``kv_after_commit``).
        ``on_step(n)`` runs at every step boundary of a batch, once ``n`` tokens of it exist (1 ..
        max_new_tokens - 1), before the engine looks for a staged version: a caller may update the
        engine there (the pause-for-the-whole-update mode) or stage a version to be committed at once.
        """
        prompts = [list(p) for p in prompt_token_ids]
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        gen = None
        if temperature > 0:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(0 if seed is None else seed)
        out: list[Rollout] = []
        self._generating = True
        try:
            for i in range(0, len(prompts), self.max_batch_size):
                batch = prompts[i : i + self.max_batch_size]
                out.extend(self._generate_batch(batch, max_new_tokens, temperature, gen, on_step))
        finally:
            self._generating = False
        return out

    @staticmethod
    def _pick(logits: torch.Tensor, temperature: float, gen: torch.Generator | None) -> torch.Tensor:
        if temperature == 0:
            return logits.argmax(dim=-1)
        probs = torch.softmax(logits.float() / temperature, dim=-1)
        return torch.multinomial(probs, 1, generator=gen).squeeze(-1)

    @staticmethod
    def _tokens(nxt: torch.Tensor) -> list[int]:
        """The sampled tokens on the host.

        On CUDA the wait for the step is an event's, which releases the GIL: ``tolist()`` alone blocks
        in the device-to-host copy holding it, for the whole step, and a thread staging the next version
        meanwhile (a transport receiving in the background) would get the interpreter only between steps.
        """
        if nxt.is_cuda:
            done = torch.cuda.Event()
            done.record()
            done.synchronize()
        return [int(t) for t in nxt.tolist()]

    def _prefill(self, rows: list[list[int]], pads: torch.Tensor, temperature: float,
                 gen: torch.Generator | None) -> torch.Tensor:
        """Fill the KV cache for left-padded ``rows`` (slots 0..len-1); returns the next tokens."""
        dev = self.device
        ids = torch.tensor(rows, dtype=torch.long, device=dev)
        self._check_ids(ids)
        p = ids.shape[1]
        ar = torch.arange(p, device=dev)
        pos = (ar[None] - pads[:, None]).clamp(min=0)
        # Key j is visible to query i when it is a real token (j >= pad) at or before i; a padding query
        # sees itself only, so no row of the softmax is empty.
        causal = ar[None, :] <= ar[:, None]
        mask = (causal[None] & (ar[None, None, :] >= pads[:, None, None])) | torch.eye(
            p, dtype=torch.bool, device=dev
        )[None]
        h = self.model(ids, pos, mask[:, None], self._cache)
        return self._pick(self.model.compute_logits(h[:, -1]), temperature, gen)

    def _generate_batch(
        self, prompts: list[list[int]], max_new_tokens: int, temperature: float,
        gen: torch.Generator | None, on_step: Callable[[int], None] | None,
    ) -> list[Rollout]:
        s = self._ensure_static()
        assert self._cache is not None
        b = len(prompts)
        p = max(len(x) for x in prompts)
        if p + max_new_tokens > self.max_seq_len:
            raise ValueError(
                f"prompt length {p} + max_new_tokens {max_new_tokens} exceeds max_seq_len {self.max_seq_len}"
            )
        padded = [[0] * (p - len(x)) + x for x in prompts]
        pads = torch.tensor([p - len(x) for x in prompts], dtype=torch.long, device=self.device)
        self._commit_pending()
        self._check_servable()
        # (version, first output index) for every version that produced tokens of this batch.
        starts = [(self.weight_version, 0)]
        nxt = self._prefill(padded, pads, temperature, gen)
        result = [[t] for t in self._tokens(nxt)]
        s["pad"].zero_()
        s["pad"][:b].copy_(pads)
        s["ids"].zero_()
        filled = p  # KV slots written: the next decode step writes slot ``filled``
        for step in range(max_new_tokens - 1):
            # A step boundary: nothing is computing, so a staged version can be made live here.
            if on_step is not None:
                on_step(step + 1)
                self._check_servable()  # the callback may have updated the engine itself
            # A staged version committed here, or an update the callback made: the tokens from here on
            # are the new version's.
            if self._commit_pending() | (self.weight_version != starts[-1][0]):
                if self.weight_version != starts[-1][0]:
                    starts.append((self.weight_version, step + 1))
                if self.kv_after_commit == "recompute":
                    # The new version recomputes the KV of everything so far; it computes the next token.
                    nxt = self._prefill([row + out for row, out in zip(padded, result)], pads,
                                        temperature, gen)
                    filled = p + step + 1
                    for row, tok in zip(result, self._tokens(nxt)):
                        row.append(tok)
                    continue
            s["ids"][:b, 0].copy_(nxt)
            s["slot"].fill_(filled)
            self._run_decode()
            filled += 1
            nxt = self._pick(s["logits"][:b], temperature, gen)
            for row, tok in zip(result, self._tokens(nxt)):
                row.append(tok)
        ends = [start for _, start in starts[1:]] + [max_new_tokens]
        spans = tuple(VersionSpan(v, a, e) for (v, a), e in zip(starts, ends))
        return [Rollout(row, spans) for row in result]
