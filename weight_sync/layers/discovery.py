"""Finding the blocks of a module: declared attribute paths first, then the largest uniform ModuleList."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

__all__ = [
    "find_block_lists",
    "get_submodule_path",
    "largest_uniform_module_list",
]


def get_submodule_path(root: nn.Module, path: str) -> nn.Module:
    """``root.get_submodule(path)`` with an error that names the missing segment."""
    mod = root
    for seg in path.split(".") if path else []:
        if not hasattr(mod, seg):
            raise AttributeError(
                f"{type(root).__name__} has no submodule {path!r}: {type(mod).__name__} lacks {seg!r}"
            )
        mod = getattr(mod, seg)
    if not isinstance(mod, nn.Module):
        raise TypeError(f"{path!r} is a {type(mod).__name__}, expected an nn.Module")
    return mod


def largest_uniform_module_list(root: nn.Module) -> tuple[str, nn.ModuleList] | None:
    """The ModuleList with the most parameters whose children all share one type (>= 2 children)."""
    best: tuple[int, str, nn.ModuleList] | None = None
    for name, mod in root.named_modules():
        if not isinstance(mod, nn.ModuleList) or len(mod) < 2:
            continue
        if len({type(c) for c in mod}) != 1:
            continue
        size = sum(p.numel() for p in mod.parameters())
        if best is None or size > best[0]:
            best = (size, name, mod)
    return None if best is None else (best[1], best[2])


def find_block_lists(
    root: nn.Module, attrs: Sequence[str] | None = None
) -> list[tuple[str, nn.ModuleList]]:
    """Block lists of ``root``: the declared ``attrs`` (paths to ModuleLists) or the heuristic's pick."""
    if attrs:
        out = []
        for path in attrs:
            mod = get_submodule_path(root, path)
            if not isinstance(mod, nn.ModuleList):
                raise TypeError(f"block path {path!r} is a {type(mod).__name__}, expected nn.ModuleList")
            out.append((path, mod))
        return out
    found = largest_uniform_module_list(root)
    return [] if found is None else [found]
