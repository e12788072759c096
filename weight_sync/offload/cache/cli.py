"""``weight-sync cache ls | verify | evict``: inspect and trim a runtime-weight cache root."""

from __future__ import annotations

import argparse
import re
import time

from weight_sync.errors import CacheError, ConfigError
from weight_sync.offload.cache.eviction import evict_entries, list_entries, verify_entry
from weight_sync.offload.cache.root import CacheRoot
from weight_sync.offload.cache.runtime import DEFAULT_CACHE_DIR

__all__ = ["parse_bytes", "parse_duration", "register"]

_UNITS = {
    "": 1,
    "k": 10**3,
    "m": 10**6,
    "g": 10**9,
    "t": 10**12,
    "ki": 2**10,
    "mi": 2**20,
    "gi": 2**30,
    "ti": 2**40,
}
_DURATIONS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_bytes(text: str) -> int:
    """``1073741824``, ``500M``, ``2GiB``, ``1.5G`` -> bytes (k/M/G/T are powers of 10, Ki/Mi/Gi/Ti of 2)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?)?b?\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"expected a size like 500M or 2GiB, got {text!r}")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])


def parse_duration(text: str) -> float:
    """``90``, ``90s``, ``30m``, ``12h``, ``7d``, ``2w`` -> seconds."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(
            f"expected a duration like 90s, 30m, 12h or 7d, got {text!r}"
        )
    return float(m.group(1)) * _DURATIONS[(m.group(2) or "s").lower()]


def _human(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024:
            return f"{size:.1f} {unit}" if unit != "B" else f"{n} B"
        size /= 1024
    return f"{size:.1f} TiB"


def _when(t: float | None) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(t)) if t is not None else "?"


def _root(args: argparse.Namespace) -> CacheRoot:
    root = CacheRoot.at(args.dir)
    if not root.path.is_dir():
        raise SystemExit(f"weight-sync cache: {root.path} is not a directory")
    return root


def _ls(args: argparse.Namespace) -> int:
    root = _root(args)
    entries = list_entries(root)
    for e in entries:
        state = "in-use" if e.in_use else "idle"
        extra = f"  PROBLEM: {e.problem}" if e.problem else ""
        print(
            f"{e.key[:16]}  {_human(e.nbytes):>10}  {state:6}  created {_when(e.created_unix_s)}  "
            f"used {_when(e.last_used_unix_s)}  {e.description}{extra}"
        )
    total = sum(e.nbytes for e in entries)
    print(f"{len(entries)} entries, {_human(total)} in {root.path}")
    return 0


def _verify(args: argparse.Namespace) -> int:
    root = _root(args)
    failed = 0
    keys = root.entry_keys()
    for key in keys:
        problem = verify_entry(root, key)
        if problem is None:
            print(f"ok    {key[:16]}")
        else:
            failed += 1
            print(f"FAIL  {key[:16]}  {problem}")
    print(f"{len(keys) - failed} of {len(keys)} entries valid in {root.path}")
    return 1 if failed else 0


def _evict(args: argparse.Namespace) -> int:
    root = _root(args)
    try:
        report = evict_entries(
            root, max_bytes=args.max_bytes, older_than_s=args.older_than, dry_run=args.dry_run
        )
    except (ConfigError, CacheError) as err:
        raise SystemExit(f"weight-sync cache evict: {err}") from err
    verb = "would remove" if args.dry_run else "removed"
    for e in report.removed:
        print(f"{verb} {e.key[:16]}  {_human(e.nbytes)}  {e.description}")
    for e in report.kept_in_use:
        print(f"kept    {e.key[:16]}  {_human(e.nbytes)}  in use by a live process")
    if report.removed_temp_dirs:
        print(f"removed {report.removed_temp_dirs} stale temp/trash dirs")
    print(
        f"{len(report.removed)} entries {verb}, {_human(report.remaining_bytes)} left in {root.path}"
    )
    if args.max_bytes is not None and report.remaining_bytes > args.max_bytes:
        print(
            f"cache still holds {report.remaining_bytes} bytes, above --max-bytes {args.max_bytes}: "
            f"the remaining entries are in use"
        )
        return 1
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "cache",
        help="inspect, verify and evict the DLO runtime-weight cache",
        description="Inspect, verify and evict entries of a runtime-weight cache root. Entries that a "
        "live process maps are never removed.",
    )
    cmds = p.add_subparsers(dest="cache_command", metavar="ACTION", required=True)

    def common(q: argparse.ArgumentParser) -> None:
        q.add_argument(
            "--dir", default=DEFAULT_CACHE_DIR, help=f"cache root (default {DEFAULT_CACHE_DIR})"
        )

    q = cmds.add_parser(
        "ls", help="one line per entry: key, size, in-use, created, last used, layout"
    )
    common(q)
    q.set_defaults(func=_ls)
    q = cmds.add_parser("verify", help="validate every entry's SHA-256s; exit 1 if any is invalid")
    common(q)
    q.set_defaults(func=_verify)
    q = cmds.add_parser("evict", help="remove idle entries by age and/or total size")
    common(q)
    q.add_argument(
        "--max-bytes",
        type=parse_bytes,
        default=None,
        metavar="N",
        help="remove least recently used idle entries until at most N bytes remain (500M, 2GiB)",
    )
    q.add_argument(
        "--older-than",
        type=parse_duration,
        default=None,
        metavar="D",
        help="remove idle entries last used more than D ago (90s, 30m, 12h, 7d)",
    )
    q.add_argument("--dry-run", action="store_true", help="print what would be removed")
    q.set_defaults(func=_evict)
