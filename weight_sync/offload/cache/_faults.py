"""Test-only fault injection for the publisher: crash or fail at named points of a publication.

The publisher calls :func:`reach` at each point (see :data:`POINTS`). Nothing happens unless a test has
installed an injector in the same process with :func:`install`; there is deliberately no environment
variable, flag or config field that arms it, so a production process cannot trigger it by accident.
Tests run the publisher in a spawned worker that installs an injector which, for example, reports the
point over a pipe and waits to be killed with SIGKILL.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

__all__ = ["POINTS", "install", "reach"]

# In publication order. "write_chunk" is reached before every chunk of tensor bytes is written.
POINTS = (
    "write_chunk",
    "after_temp_write",
    "before_fsync",
    "before_rename",
    "after_rename",
)

_injector: Callable[[str], None] | None = None


def reach(point: str) -> None:
    """Called by the publisher at ``point``; a no-op unless a test installed an injector."""
    if _injector is not None:
        _injector(point)


@contextmanager
def install(injector: Callable[[str], None]) -> Iterator[None]:
    """Install ``injector`` (called with each point name) for the duration of the ``with`` block."""
    global _injector
    previous, _injector = _injector, injector
    try:
        yield
    finally:
        _injector = previous
