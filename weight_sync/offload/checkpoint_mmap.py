"""Direct-checkpoint mmap: a DiT's tensors become views of its safetensors files (TP1 only).

Processes on one node that map the same files share the immutable pages through the page cache, so DP
replicas hold one host copy between them. The plan is validated completely - names, coverage, shape,
dtype, layout - *before* the module is touched; any mismatch returns a reason and the caller runs the
ordinary loader on the untouched module. Only then:

1. non-persistent buffers (RoPE tables, ...) are saved,
2. the module moves to the meta device (the constructor's weights are released),
3. every persistent tensor is rebuilt as an mmap view with its class and attributes restored,
4. the saved non-persistent buffers are restored, and
5. the module's ``post_load_weights()`` and ``validate_loaded_weights()`` hooks run, as after a load.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from weight_sync.errors import WeightSyncError
from weight_sync.layers import capture_layer, install_tensor, rematerialize
from weight_sync.safetensors_io import map_safetensors

__all__ = [
    "MmapPlan",
    "apply_mmap_plan",
    "plan_checkpoint_mmap",
    "run_post_load_hooks",
]


@dataclass
class MmapPlan:
    """A validated mapping from every persistent tensor name of a module to its mmap view."""

    views: dict[str, torch.Tensor]
    files: tuple[Path, ...]

    @property
    def nbytes(self) -> int:
        return sum(v.numel() * v.element_size() for v in self.views.values())


def _first(items: Sequence[str], n: int = 5) -> str:
    shown = ", ".join(sorted(items)[:n])
    return shown + (f" (and {len(items) - n} more)" if len(items) > n else "")


def plan_checkpoint_mmap(
    module: nn.Module, files: Sequence[Path], *, prefix: str = ""
) -> tuple[MmapPlan | None, str]:
    """Map ``files`` and check they cover ``module``'s persistent tensors exactly.

    Returns ``(plan, "")`` or ``(None, reason)``; never modifies ``module``.
    """
    mapped: dict[str, torch.Tensor] = {}
    try:
        for f in files:
            for name, t in map_safetensors(f).items():
                if not name.startswith(prefix):
                    return None, f"{f.name}: tensor {name!r} is outside the module prefix {prefix!r}"
                key = name[len(prefix) :]
                if key in mapped:
                    return None, f"tensor {name!r} appears in more than one checkpoint file"
                mapped[key] = t
    except WeightSyncError as e:
        return None, f"cannot map the checkpoint: {e}"
    expected = module.state_dict(keep_vars=True)
    missing = [n for n in expected if n not in mapped]
    if missing:
        return None, f"the checkpoint lacks {len(missing)} tensor(s) of the module: {_first(missing)}"
    extra = [n for n in mapped if n not in expected]
    if extra:
        return None, (
            f"the checkpoint holds {len(extra)} tensor(s) the module does not own (a mixed DiT / "
            f"non-DiT source falls back completely): {_first(extra)}"
        )
    for name, t in expected.items():
        v = mapped[name]
        if tuple(v.shape) != tuple(t.shape) or v.dtype != t.dtype:
            return None, (
                f"{name}: module expects {tuple(t.shape)} {t.dtype}, checkpoint has "
                f"{tuple(v.shape)} {v.dtype}"
            )
        if t.numel() > 1 and not t.is_contiguous():
            return None, (
                f"{name}: module keeps a non-contiguous layout (stride {tuple(t.stride())}) that a "
                "contiguous checkpoint view cannot provide"
            )
        if v.data_ptr() == t.data_ptr() and t.numel():
            return None, f"{name}: already mapped"
    return MmapPlan({n: mapped[n] for n in expected}, tuple(files)), ""


def run_post_load_hooks(module: nn.Module) -> None:
    """Call the module's post-load lifecycle hooks, as an ordinary load would."""
    for hook in ("post_load_weights", "validate_loaded_weights"):
        fn = getattr(module, hook, None)
        if callable(fn):
            fn()


def apply_mmap_plan(module: nn.Module, plan: MmapPlan) -> None:
    """Re-home ``module``'s persistent tensors onto the plan's mmap views (see the module docstring)."""
    # Capture everything needed to rebuild the tensors before the module goes to meta: records keep
    # class, requires_grad and loader attributes; ids keep tied tensors tied.
    captured = []
    saved_non_persistent: list[tuple[nn.Module, str, torch.Tensor]] = []
    for mod_name, mod in module.named_modules():
        records = capture_layer(mod)
        for name, rec in records.items():
            t = mod._parameters.get(name)
            if t is None:
                t = mod._buffers[name]
            if rec.kind == "buffer" and not rec.persistent:
                saved_non_persistent.append((mod, name, t))
                continue
            qual = f"{mod_name}.{name}" if mod_name else name
            captured.append((mod, rec, qual, id(t)))
    module.to("meta")
    rebuilt: dict[int, torch.Tensor] = {}
    for mod, rec, qual, tid in captured:
        if tid not in rebuilt:
            rebuilt[tid] = rematerialize(rec, "cpu", data=plan.views[qual])
        install_tensor(mod, rec, rebuilt[tid])
    for mod, name, buf in saved_non_persistent:
        mod.register_buffer(name, buf, persistent=False)
    run_post_load_hooks(module)
