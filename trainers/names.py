"""Name mapping between trainer parameter names and engine checkpoint names.

The default is Hugging Face naming: the trainer's names are the checkpoint's names once wrapper segments
are removed (``_orig_mod.`` from torch.compile, ``_fsdp_wrapped_module.`` / ``_checkpoint_wrapped_module.``
from FSDP1 and activation checkpointing, a leading ``module.`` from DDP, a leading ``base_model.model.``
from a peft PeftModel). Anything else goes through a mapping hook: a dict (every trainer name must be
listed; ``None`` skips a tensor), a callable (return the engine name, or ``None`` to skip), or regex rules.
All unmapped names are reported at once, before anything is sent.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence

from weight_sync.errors import WeightSyncError

__all__ = ["NameMap", "UnmappedNameError", "strip_wrappers"]

_INNER_WRAPPERS = ("_orig_mod.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")
_LEADING_WRAPPERS = ("module.", "base_model.model.")


class UnmappedNameError(WeightSyncError, KeyError):
    """Trainer tensors that the name map does not know (all of them, listed in the message)."""

    def __init__(self, message: str, names: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.names = names

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def strip_wrappers(name: str) -> str:
    """Remove wrapper segments that compile / FSDP1 / checkpointing / DDP / peft add to parameter names."""
    for w in _INNER_WRAPPERS:
        name = name.replace(w, "")
    changed = True
    while changed:
        changed = False
        for w in _LEADING_WRAPPERS:
            if name.startswith(w):
                name, changed = name[len(w) :], True
    return name


class NameMap:
    """Maps trainer names (wrappers already stripped) to engine names, or to ``None`` to skip a tensor.

    ``NameMap()`` is the identity (HF naming). ``NameMap({"wte.weight": "model.embed_tokens.weight", ...})``
    requires every name to be listed. ``NameMap(fn)`` calls ``fn(name)``; a KeyError from it means
    unmapped. ``NameMap.from_rules([(r"^h\\.(\\d+)\\.attn\\.q\\.", r"model.layers.\\1.self_attn.q_proj."),
    ...])`` applies the first matching regex; with ``strict=True`` names matching no rule are unmapped.
    """

    def __init__(self, mapping: Mapping[str, str | None] | Callable[[str], str | None] | None = None) -> None:
        self._mapping = mapping

    @classmethod
    def from_rules(cls, rules: Sequence[tuple[str, str]], *, strict: bool = True) -> NameMap:
        compiled = [(re.compile(p), r) for p, r in rules]

        def apply(name: str) -> str | None:
            for pattern, repl in compiled:
                if pattern.search(name):
                    return pattern.sub(repl, name)
            if strict:
                raise KeyError(name)
            return name

        return cls(apply)

    def __call__(self, name: str) -> str | None:
        """The engine name for ``name`` (``None``: skip); raises KeyError when unmapped."""
        m = self._mapping
        if m is None:
            return name
        if isinstance(m, Mapping):
            return m[name]
        return m(name)

    def map_all(self, names: Iterable[str]) -> list[tuple[str, str]]:
        """``[(trainer_name, engine_name)]`` for every mapped name; raises once listing every unmapped one."""
        out: list[tuple[str, str]] = []
        unmapped: list[str] = []
        seen: dict[str, str] = {}
        for n in names:
            try:
                target = self(n)
            except KeyError:
                unmapped.append(n)
                continue
            if target is None:
                continue
            if not isinstance(target, str) or not target:
                raise UnmappedNameError(f"name map returned {target!r} for {n!r}; expected a non-empty str or None")
            if target in seen:
                raise UnmappedNameError(
                    f"name map sends both {seen[target]!r} and {n!r} to {target!r}; engine names must be unique"
                )
            seen[target] = n
            out.append((n, target))
        if unmapped:
            shown = ", ".join(repr(u) for u in unmapped[:10])
            more = f" and {len(unmapped) - 10} more" if len(unmapped) > 10 else ""
            raise UnmappedNameError(
                f"{len(unmapped)} trainer tensor(s) have no engine name in the name map: {shown}{more}; "
                "map them (or map them to None to skip them)",
                tuple(unmapped),
            )
        return out
