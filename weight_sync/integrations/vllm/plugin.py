"""The ``vllm.general_plugins`` entry point: vLLM calls :func:`register` in every process it starts.

It installs the engine-level hooks (:mod:`~weight_sync.integrations.vllm.engine_hooks`), which stay inert
for engines not configured with weight_sync, and registers the ``weight_sync`` weight-transfer backend
when ``weight_sync.transport`` is available. Safe to call any number of times.
"""

from __future__ import annotations

import importlib.util
import logging

__all__ = ["register"]

log = logging.getLogger(__name__)


def register() -> None:
    from weight_sync.integrations.vllm.engine_hooks import install_engine_hooks

    install_engine_hooks()
    if importlib.util.find_spec("weight_sync.integrations.vllm.transfer") is not None:
        from weight_sync.integrations.vllm.transfer import register_transfer_backend

        register_transfer_backend()
