"""The ``weight-sync`` command: subcommands are registered by the packages that implement them.

Each command module exposes ``register(subparsers)``. Built-in modules live inside weight_sync; the
trainer-side ``demo`` comes from the ``weight_sync.commands`` entry-point group, so weight_sync never
imports ``trainers`` itself.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence
from importlib import metadata
from typing import Any

__all__ = ["build_parser", "main"]

BUILTIN_COMMAND_MODULES = (
    "weight_sync.testing.cli",
    "weight_sync.engine.cli",
    "weight_sync.offload.cli",
    "weight_sync.offload.cache.cli",
)


def _command_modules() -> list[Any]:
    mods: list[Any] = []
    for name in BUILTIN_COMMAND_MODULES:
        try:
            mods.append(importlib.import_module(name))
        except ModuleNotFoundError as e:
            # Not built (yet): the module itself or its package is absent. Anything else missing is a
            # real broken dependency inside the module and must surface.
            if not (e.name and (name == e.name or name.startswith(e.name + "."))):
                raise
    for ep in sorted(metadata.entry_points(group="weight_sync.commands"), key=lambda e: e.name):
        mods.append(ep.load())
    return mods


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="weight-sync",
        description="Move weights into live inference engines: reload, transports, layerwise offload.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for mod in _command_modules():
        register = getattr(mod, "register", mod)
        register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(levelname)s %(name)s: %(message)s",
    )
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
