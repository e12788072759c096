"""Native CPU kernels for delta sync's per-element passes, compiled on first use and loaded with ctypes.

Delta sync on CPU spends its time in passes over the changed elements: finding them (a compare and a
nonzero), gathering their values, moving the sender's base, decoding positions and scattering values
into the engine's tensors with their checksum moves. numpy does each as a separate pass, and its
nonzero, boolean indexing and fancy assignment branch on every changed element, which on a busy host
costs 20-40 ns per change: at 2% changed, several times the compare itself. ``delta.c`` does each job
in one branch-free pass (see its comments).

The source is compiled once per machine with the C compiler (``$CC``, else ``cc``) into a cache
directory (``$WEIGHT_SYNC_NATIVE_CACHE``, else ``~/.cache/weight_sync/native``, else a per-user
directory under the temporary directory) under a name made from the source's hash, so processes share
one build and a changed source builds anew. No Python headers are needed: the library is plain C loaded
through ctypes. Where there is no compiler, the build fails,
or ``WEIGHT_SYNC_NATIVE=0`` is set, :func:`enabled` is False and callers use their numpy paths, which
give the same bytes (the tests run both).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from itertools import pairwise
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch

from weight_sync.errors import ConfigError, LayoutMismatchError
from weight_sync.native.arena import HostArena

T = TypeVar("T")
R = TypeVar("R")

__all__ = ["HostArena", "OffsetBatch", "bitmask_positions", "delta_scan", "enabled", "forms", "index_positions",
           "library", "parallel_map", "parallel_settle", "scan_kind", "scatter", "scatter_tensors", "simd", "threads"]

log = logging.getLogger(__name__)

# One library from these sources (encode.c calls delta.c's scan).
_SOURCES = (Path(__file__).with_name("delta.c"), Path(__file__).with_name("encode.c"))
_FLAGS = ("-O3", "-fPIC", "-shared")
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
THREADS_ENV = "WEIGHT_SYNC_NATIVE_THREADS"
_MAX_THREADS = 8
_pool: tuple[int, int, ThreadPoolExecutor] | None = None  # (pid, workers, pool)
_local = threading.local()

_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_SIGNATURES = {
    "ws_delta_scan": (_I64, [_P, _P, _I64, _INT, _I64, _I64, _INT, _P, _P, _I64, _P, _P]),
    "ws_delta_scan_offsets": (_I64, [_P, _P, _I64, _INT, _I64, _I64, _INT, _P, _P, _I64, _P, _P]),
    "ws_scatter": (_INT, [_P, _I64, _P, _P, _I64, _INT, _I64, _P, _P]),
    "ws_index_positions": (_INT, [_P, _P, _I64, _P, _INT, _I64, _P]),
    "ws_check_offsets_many": (_INT, [_P, _I64, _P]),
    "ws_forms": (None, [_P, _I64, _I64, _I64, _I64, _I64, _P]),
    "ws_scatter_offsets_many": (_INT, [_P, _I64, _I64, _P]),
    "ws_bitmask_positions": (_I64, [_P, _I64, _P, _I64, _P, _I64]),
    "ws_scan_ranges": (None, [_P, _I64, _I64]),
    "ws_encode_sizes": (None, [_P, _I64]),
    "ws_encode_write": (None, [_P, _P, _I64, _I64]),
    "ws_init": (None, [_INT]),
    "ws_simd": (_INT, []),
}


def _cache_dirs() -> list[Path]:
    """Where the built library may live, in order: ``$WEIGHT_SYNC_NATIVE_CACHE`` if set, else the user's
    cache, then a per-user directory under the temporary directory (a read-only home still builds)."""
    given = os.environ.get("WEIGHT_SYNC_NATIVE_CACHE")
    if given:
        return [Path(given)]
    return [Path.home() / ".cache" / "weight_sync" / "native",
            Path(tempfile.gettempdir()) / f"weight_sync-native-{os.getuid()}"]


def _writable_dir(dirs: list[Path]) -> Path:
    for d in dirs:
        try:
            d.mkdir(parents=True, exist_ok=True)
        except OSError:
            continue
        if os.access(d, os.W_OK):
            return d
    raise OSError(f"no writable directory for the native kernels among {[str(d) for d in dirs]}")


def _build(source: bytes, compiler: str) -> Path:
    """The compiled library for ``source``, built into the cache unless already there."""
    key = hashlib.sha256(source + repr((_FLAGS, compiler, platform.machine(), platform.system())).encode())
    name = f"libws_delta_{key.hexdigest()[:16]}.so"
    dirs = _cache_dirs()
    for d in dirs:
        if (d / name).exists():
            return d / name
    out = _writable_dir(dirs) / name
    # Built under a temporary name and renamed: processes building at once each rename a whole library.
    fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        subprocess.run([compiler, *_FLAGS, "-o", tmp, *map(str, _SOURCES)], check=True, capture_output=True,
                       timeout=120)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def library() -> ctypes.CDLL | None:
    """The loaded kernels, built on the first call; None where they cannot be (the reason is logged
    once) or ``WEIGHT_SYNC_NATIVE=0`` turns them off (read at every call, so tests can switch)."""
    global _lib, _tried
    if os.environ.get("WEIGHT_SYNC_NATIVE", "1") == "0":
        return None
    if _tried:
        return _lib
    with _lock:
        if not _tried:
            compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
            try:
                if not compiler:
                    raise OSError("no C compiler found (set CC)")
                lib = ctypes.CDLL(str(_build(b"".join(p.read_bytes() for p in _SOURCES), compiler)))
                for name, (res, args) in _SIGNATURES.items():
                    fn = getattr(lib, name)
                    fn.restype, fn.argtypes = res, args
                lib.ws_init(int(os.environ.get("WEIGHT_SYNC_NATIVE_SIMD", "1") != "0"))
                _lib = lib
            except (OSError, subprocess.SubprocessError) as e:
                detail = getattr(e, "stderr", b"") or b""
                log.info("native delta kernels unavailable, using numpy: %s %s", e,
                         detail.decode(errors="replace")[:500])
            _tried = True
    return _lib


def enabled() -> bool:
    """Whether the native kernels are in use (built and not turned off)."""
    return library() is not None


def simd(enable: bool | None = None) -> bool:
    """Whether the scans use this CPU's vector extensions (AVX-512, else AVX2, where it has them);
    ``enable`` switches them first (False: the portable loops, which must give the same results)."""
    lib = _need(library())
    if enable is not None:
        lib.ws_init(int(enable))
    return bool(lib.ws_simd())


def scan_kind() -> str:
    """The scan 16-bit tensors (bf16) take here: ``"AVX-512"``, ``"AVX2"`` or ``"portable"``."""
    return ("portable", "AVX2", "AVX-512")[_need(library()).ws_simd()]


def _ptr(a: np.ndarray) -> int:
    return a.ctypes.data


def _need(lib: ctypes.CDLL | None) -> ctypes.CDLL:
    if lib is None:
        raise RuntimeError("weight_sync.native: the kernels are not available (check enabled() first)")
    return lib


def threads() -> int:
    """How many threads the delta passes of one update spread over (tensors encoded, payloads decoded and
    scattered at once; the kernels run without the GIL): ``$WEIGHT_SYNC_NATIVE_THREADS``, else every core
    this process may run on, at most 8."""
    given = os.environ.get(THREADS_ENV)
    if given is None:
        return max(1, min(_MAX_THREADS, len(os.sched_getaffinity(0))))
    try:
        n = int(given)
    except ValueError:
        n = 0
    if n < 1:
        raise ConfigError(f"{THREADS_ENV} must be a positive integer, got {given!r}")
    return n


#: Below this many bytes read or written by all the calls of a :func:`parallel_map`, one thread runs
#: them: each call's return takes the GIL back from a thread running Python, and on small work that
#: wait costs more than the second core gives (bench_delta at 2% changed on the 2-core CI host: the
#: 49 MB small preset's send() took 0.072 s with its tensors on two threads, 0.062 s on one; the
#: 1.19 GB Qwen3-0.6B shape's encode 0.15-0.19 s on two, 0.19-0.24 s on one).
PARALLEL_MIN_BYTES = 128 << 20

#: Chunks per row of an :class:`OffsetBatch` encoding added by ``add_table`` (8 Mi elements at 64 Ki).
PIECE_CHUNKS = 128


def parallel_settle(fn: Callable[[T], R], items: Sequence[T], work_bytes: int) -> list[R | Exception]:
    """Each ``fn(x)`` of ``items``, or the exception it raised, in order: on :func:`threads` threads when
    the calls read or write at least :data:`PARALLEL_MIN_BYTES` together (``work_bytes``), else on this
    thread. Every call runs to its end, so a caller records what each successful call wrote before it
    raises the first failure."""
    global _pool

    def settled(x: T) -> R | Exception:
        try:
            return fn(x)
        except Exception as e:  # the caller's to raise, once it has recorded the others
            return e

    workers = min(threads(), len(items)) if work_bytes >= PARALLEL_MIN_BYTES else 1
    if workers < 2:
        return [settled(x) for x in items]
    pid = os.getpid()
    if _pool is None or _pool[0] != pid or _pool[1] < workers:
        if _pool is not None and _pool[0] == pid:
            _pool[2].shutdown(wait=False)  # outgrown (the thread count was raised): its threads end
        # A forked child has the parent's pool object but none of its threads: it makes its own.
        size = max(workers, threads())
        _pool = (pid, size, ThreadPoolExecutor(size, thread_name_prefix="weight_sync-native"))
    futures = [_pool[2].submit(settled, x) for x in items]
    wait(futures)
    return [f.result() for f in futures]


def parallel_map(fn: Callable[[T], R], items: Sequence[T], work_bytes: int) -> list[R]:
    """``[fn(x) for x in items]`` as :func:`parallel_settle` runs them; the first error in ``items``'
    order is raised once every call has ended."""
    out = parallel_settle(fn, items, work_bytes)
    for r in out:
        if isinstance(r, Exception):
            raise r
    return out  # type: ignore[return-value]  # no exception among them


def _spans(work: np.ndarray, parts: int) -> list[tuple[int, int]]:
    """Cut rows of a kernel's table into at most ``parts`` runs of about equal ``work`` (one kernel call
    each; more runs than threads let a thread that ends early take the next)."""
    done = np.cumsum(work)
    if not done.size:
        return []
    total = int(done[-1])
    cuts = np.searchsorted(done, [total * k / parts for k in range(1, parts)], side="right").tolist()
    return [(a, b) for a, b in pairwise([0, *cuts, done.size]) if b > a]


def _scratch(name: str, n: int, dtype: np.dtype) -> np.ndarray:
    """``n`` entries of a buffer this thread keeps and grows (never shrinks): the scans' outputs. Fresh
    buffers of that size cost their page faults on every update, on a VM host more than the scan."""
    have = getattr(_local, name, None)
    if have is None or have.nbytes < n * dtype.itemsize:
        have = np.empty(max(n * dtype.itemsize, 2 * (0 if have is None else have.nbytes)), dtype=np.uint8)
        setattr(_local, name, have)
    return have[: n * dtype.itemsize].view(dtype)


def delta_scan(new: np.ndarray, base: np.ndarray, chunk: int, *, advance: bool = False, scratch: bool = False,
               offsets: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(positions, values, counts)`` of the elements whose bytes differ between ``new`` and ``base``
    (flat, contiguous, one integer dtype): ascending int64 positions, ``new``'s values there, and the
    changed count of every ``chunk`` elements. With ``advance`` the base is moved to ``new`` as well.
    ``offsets`` (chunks of at most 64 Ki elements): instead of positions, each change's offset in its
    chunk as an encoding stores 16-bit index offsets (uint16, the offset less 32768 in two's
    complement). ``scratch``: positions and values may lie in this thread's scratch buffers, valid
    until its next scan (for a caller that copies them out at once)."""
    lib = _need(library())
    n, item = new.size, new.dtype.itemsize
    if offsets and chunk > 1 << 16:
        raise LayoutMismatchError(f"delta scan: 16-bit offsets need chunks of at most 65536 elements, got {chunk}")
    num_chunks = -(-n // chunk)
    counts = np.empty(num_chunks, dtype=np.int64)
    nxt = ctypes.c_int64(0)
    pos_type = np.dtype(np.uint16 if offsets else np.int64)
    scan = lib.ws_delta_scan_offsets if offsets else lib.ws_delta_scan
    # Room for about 3% changed plus one chunk; a denser tensor continues into a larger buffer (the scan
    # stops at a chunk boundary when the next chunk might not fit).
    cap = min(n, n // 32 + chunk)
    parts: list[tuple[np.ndarray, np.ndarray]] = []
    at = 0
    while True:
        # 64 entries of slack: the vector scans store whole registers past the last change.
        if scratch and not parts:
            pos = _scratch("scan_pos", cap + 64, pos_type)
            vals = _scratch("scan_vals", cap + 64, new.dtype)
        else:
            pos = np.empty(cap + 64, dtype=pos_type)
            vals = np.empty(cap + 64, dtype=new.dtype)
        k = scan(_ptr(new), _ptr(base), n, item, chunk, at, int(advance), _ptr(pos), _ptr(vals), cap, _ptr(counts),
                 ctypes.byref(nxt))
        if k < 0:
            raise LayoutMismatchError(f"delta scan: item size {item} is not 1, 2, 4 or 8 bytes")
        parts.append((pos[:k], vals[:k]))
        at = nxt.value
        if at >= num_chunks:
            break
        cap = min(n - at * chunk, max(2 * cap, chunk))
    if len(parts) == 1:
        return parts[0][0], parts[0][1], counts
    return np.concatenate([p for p, _ in parts]), np.concatenate([v for _, v in parts]), counts


def forms(counts: np.ndarray, chunk: int, numel: int, item: int, off_bytes: int) -> np.ndarray:
    """Per chunk of a tensor of ``numel`` elements the cheapest form of its ``counts`` changes, as
    ``weight_sync.transport.delta_format.forms_of_sizes`` decides them (int64)."""
    counts = np.ascontiguousarray(counts, dtype=np.int64)
    out = np.empty(counts.size, dtype=np.int64)
    _need(library()).ws_forms(_ptr(counts), counts.size, chunk, numel, item, off_bytes, _ptr(out))
    return out


def scatter(dst: np.ndarray, pos: np.ndarray, vals: np.ndarray, byte_base: int) -> tuple[np.ndarray, np.ndarray]:
    """Write ``vals`` at ``pos`` into ``dst`` (flat, contiguous, one integer dtype; every position is
    checked to lie inside ``dst`` before the first write): returns the overwritten values and the int64
    ``[plain, weighted]`` checksum move of the tensor ``dst`` starts ``byte_base`` bytes into
    (``delta_checksum.checksum_change_np``'s numbers)."""
    lib = _need(library())
    if vals.dtype != dst.dtype or vals.size != pos.size:
        # Bytes are written as they are: a dtype conversion here would change values, not move them.
        raise LayoutMismatchError(f"delta scatter: {vals.size} values of {vals.dtype} for {pos.size} positions "
                                  f"of a {dst.dtype} destination")
    pos = np.ascontiguousarray(pos, dtype=np.int64)
    vals = np.ascontiguousarray(vals)
    old = np.empty(pos.size, dtype=dst.dtype)
    sums = np.zeros(2, dtype=np.int64)
    _scatter_checked(lib.ws_scatter(_ptr(dst), dst.size, _ptr(pos), _ptr(vals), pos.size, dst.dtype.itemsize,
                                    byte_base, _ptr(old), _ptr(sums)), dst.dtype.itemsize, dst.size)
    return old, sums


def _scatter_checked(rc: int, item: int, n: int) -> None:
    """Raise for ``ws_scatter``'s error codes (nothing was written then)."""
    if rc == -1:
        raise LayoutMismatchError(f"delta scatter: item size {item} is not 1, 2, 4 or 8 bytes")
    if rc == -2:
        raise LayoutMismatchError(f"delta scatter: a position lies outside the destination's {n} elements")


def scatter_tensors(dst: torch.Tensor, pos: torch.Tensor, vals: torch.Tensor, byte_base: int,
                    arena: HostArena | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`scatter` of CPU tensors (``dst`` flat and contiguous, of an integer dtype; ``pos`` int64;
    ``vals`` of ``dst``'s dtype), returning tensors: the overwritten values (in ``arena`` where one is
    given) and the int64 checksum move. The delta apply's path: it holds tensors, and making numpy
    arrays of them, and reading their addresses through numpy, cost several times the call itself for
    the small tensors of a delta."""
    lib = _need(library())
    if vals.dtype != dst.dtype or vals.numel() != pos.numel() or pos.dtype != torch.int64:
        raise LayoutMismatchError(f"delta scatter: {vals.numel()} values of {vals.dtype} for {pos.numel()} "
                                  f"positions ({pos.dtype}) of a {dst.dtype} destination")
    if not (dst.is_cpu and pos.is_cpu and vals.is_cpu and dst.is_contiguous()) or dst.dim() != 1:
        raise LayoutMismatchError(
            "delta scatter: the destination, positions and values must be CPU tensors and the destination "
            f"flat and contiguous; got a destination of shape {tuple(dst.shape)} on {dst.device}")
    pos, vals = pos.contiguous(), vals.contiguous()
    old = torch.empty_like(vals) if arena is None else torch.from_numpy(arena.take(vals.numel(), vals.numpy().dtype))
    sums = torch.zeros(2, dtype=torch.int64)
    item, n = dst.element_size(), dst.numel()
    _scatter_checked(lib.ws_scatter(dst.data_ptr(), n, pos.data_ptr(), vals.data_ptr(), pos.numel(), item,
                                    byte_base, old.data_ptr(), sums.data_ptr()), item, n)
    return old, sums


def _output(arena: HostArena | None, n: int) -> np.ndarray:
    return np.empty(n, dtype=np.int64) if arena is None else arena.take(n, np.int64)


_OFFSET_ERRORS = {
    -1: "delta payload: an index offset is outside its chunk of {chunk} elements",
    -2: "delta payload: index offsets repeat or are out of order",
    -3: "delta payload: a changed position lies beyond the tensor's {n} elements",
}


def _offsets_error(rc: int, chunk: int, n: int, item: int = 0) -> LayoutMismatchError | None:
    """The error for the index decode's and the offsets scatter's codes (nothing was written then)."""
    if rc in _OFFSET_ERRORS:
        return LayoutMismatchError(_OFFSET_ERRORS[rc].format(chunk=chunk, n=n))
    if rc:
        return LayoutMismatchError(f"delta scatter: item size {item} is not 1, 2, 4 or 8 bytes")
    return None


class OffsetBatch:
    """Index-only encodings (16-bit offsets) bound for one bucket's writes: every one checked in one call
    before any is written, then written on :func:`threads` threads, a run of rows per call (one call per
    tensor cost a Python call and a GIL hand-back each: ~300 per bucket of a 0.6B model). An encoding
    added by :meth:`add_table` is cut into rows of at most :data:`PIECE_CHUNKS` chunks, so that the threads
    share even work where one tensor (an embedding) holds a quarter of the changes."""

    # One row per encoding (or piece of one), as delta.c's ws_*_offsets_many read it: destination
    # address and elements, chunk numbers' address, counts' address, their length, offsets' address,
    # chunk size, values' address, item size, byte base, then the checksum move's two words (written by
    # the scatter).
    _COLS = 12

    def __init__(self) -> None:
        self._blocks: list[np.ndarray] = []
        self._owners: list[np.ndarray] = []  # per row, the encoding it writes (an index into _names)
        self._names: list[str] = []
        self._keep: list[object] = []  # what the rows' addresses point into, alive until the writes end
        self._changes: list[np.ndarray] = []  # per row
        self._jobs: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None  # made at the first use

    def __len__(self) -> int:
        return len(self._names)

    def _append(self, names: list[str], rows: np.ndarray, owner: np.ndarray, changes: np.ndarray,
                keep: list[object]) -> None:
        self._blocks.append(rows)
        self._owners.append(owner + len(self._names))
        self._changes.append(changes)
        self._names += names
        self._keep += keep
        self._jobs = None

    def add(self, name: str, dst: torch.Tensor, chunks: np.ndarray, counts: np.ndarray, offsets: np.ndarray,
            chunk: int, vals: torch.Tensor, byte_base: int) -> None:
        """Queue ``name``'s index-only encoding for ``dst`` (a flat contiguous CPU tensor of ``vals``' integer
        dtype): its index chunks' numbers ``chunks`` (ascending) and ``counts``, their 16-bit ``offsets``
        as the encoding stores them, its new ``vals``, and the byte of the checksummed tensor ``dst``
        starts at."""
        if vals.dtype != dst.dtype or not (dst.is_cpu and vals.is_cpu and dst.is_contiguous()) or dst.dim() != 1:
            raise LayoutMismatchError(f"{name}: delta scatter of {vals.dtype} values into a {dst.dtype} destination "
                                      f"of shape {tuple(dst.shape)} on {dst.device} (expected a flat contiguous CPU "
                                      "tensor of that dtype)")
        chunks = np.ascontiguousarray(chunks, dtype=np.int64)
        counts = np.ascontiguousarray(counts, dtype=np.int64)
        offsets = np.ascontiguousarray(offsets, dtype=np.int16)
        vals = vals.contiguous()
        if int(counts.sum()) != vals.numel() or offsets.size != vals.numel():
            raise LayoutMismatchError(f"{name}: delta payload of {int(counts.sum())} changed positions and "
                                      f"{offsets.size} offsets for {vals.numel()} values")
        row = np.array([[dst.data_ptr(), dst.numel(), _ptr(chunks), _ptr(counts), chunks.size, _ptr(offsets),
                         chunk, vals.data_ptr(), dst.element_size(), byte_base, 0, 0]], dtype=np.int64)
        self._append([name], row, np.zeros(1, np.int64), np.array([vals.numel()]), [dst, chunks, counts, offsets, vals])

    def add_table(self, names: list[str], dst: np.ndarray, dst_numel: np.ndarray, counts: np.ndarray,
                  first_chunk: np.ndarray, nchunks: np.ndarray, chunk: np.ndarray, offsets: np.ndarray,
                  vals: np.ndarray, item: np.ndarray, byte_base: np.ndarray, keep: list[object]) -> None:
        """Queue index-only encodings given as arrays (one entry per encoding): destination addresses and
        elements; encoding ``i``'s changed count of *every* chunk (0 for an unchanged one) at
        ``counts[first_chunk[i] : first_chunk[i] + nchunks[i]]``; chunk sizes; the addresses of its
        offsets and of its values; item size and byte base. The caller checked each table (counts >= 0,
        summing to the offsets and values its encoding holds) and keeps the memory the addresses point
        into alive with ``keep``."""
        n = len(names)
        if not n:
            return
        counts = np.ascontiguousarray(counts, dtype=np.int64)
        pieces = np.maximum(1, -(-nchunks // PIECE_CHUNKS))
        owner = np.repeat(np.arange(n), pieces)
        first = (np.arange(owner.size) - np.concatenate([[0], np.cumsum(pieces)])[owner]) * PIECE_CHUNKS
        length = np.minimum(PIECE_CHUNKS, nchunks[owner] - first).clip(min=0)
        done = np.concatenate([[0], np.cumsum(counts)])  # changes before each chunk of the table
        at = first_chunk[owner] + first  # each row's first chunk in the table
        before = done[at] - done[first_chunk[owner]]  # its encoding's changes before that chunk
        numbers = np.arange(int(nchunks.max(initial=0)) + 1, dtype=np.int64)  # chunks[c] = c for every row
        rows = np.zeros((owner.size, self._COLS), dtype=np.int64)
        rows[:, 0], rows[:, 1] = dst[owner], dst_numel[owner]
        rows[:, 2] = _ptr(numbers) + 8 * first
        rows[:, 3] = _ptr(counts) + 8 * at
        rows[:, 4], rows[:, 6], rows[:, 8], rows[:, 9] = length, chunk[owner], item[owner], byte_base[owner]
        rows[:, 5] = offsets[owner] + 2 * before
        rows[:, 7] = vals[owner] + item[owner] * before
        self._append(list(names), rows, owner, done[at + length] - done[at], [*keep, counts, numbers])

    def _table(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if self._jobs is None:
            self._jobs = (np.concatenate(self._blocks), np.concatenate(self._owners), np.concatenate(self._changes))
        return self._jobs

    def _refused(self, rc: int, row: int) -> LayoutMismatchError:
        table, owner, _ = self._table()
        r = table[row]
        return LayoutMismatchError(f"{self._names[owner[row]]}: {_offsets_error(rc, int(r[6]), int(r[1]), int(r[8]))}")

    def check(self) -> None:
        """Raise :class:`LayoutMismatchError`, naming the first encoding whose offsets leave their chunk,
        repeat, go back or reach beyond its destination (nothing is written here)."""
        if not self._names:
            return
        table = self._table()[0]
        which = ctypes.c_int64(-1)
        rc = _need(library()).ws_check_offsets_many(_ptr(table), len(table), ctypes.byref(which))
        if rc:
            raise self._refused(rc, which.value)

    def scatter(self) -> list[torch.Tensor | Exception]:
        """Write every encoding; per encoding its int64 ``[plain, weighted]`` checksum move, or the error
        that refused it (each row is checked again as it is written: a refused row writes nothing, every
        other row is written, so an encoding cut into pieces may be written in part: its layer is then
        torn). The overwritten values are not kept."""
        lib = _need(library())
        if not self._names:
            return []
        table, owner, changes = self._table()
        lines = 64 * int(changes.sum())  # a change touches one 64-byte line at most
        workers = min(threads(), len(table)) if lines >= PARALLEL_MIN_BYTES else 1
        # Runs of rows of about equal numbers of changes, a few per thread.
        spans = _spans(changes, 1 if workers < 2 else 4 * workers)
        errors: dict[int, Exception] = {}

        def run(span: tuple[int, int]) -> None:
            lo, hi = span
            which = ctypes.c_int64(-1)
            while lo < hi:
                rc = lib.ws_scatter_offsets_many(_ptr(table), lo, hi, ctypes.byref(which))
                if not rc:
                    return
                errors.setdefault(int(owner[which.value]), self._refused(rc, which.value))
                lo = which.value + 1

        parallel_map(run, spans, lines)
        moves = np.zeros((len(self._names), 2), dtype=np.int64)
        np.add.at(moves, owner, table[:, 10:12])
        out = torch.from_numpy(moves)
        return [errors.get(i, out[i]) for i in range(len(self._names))]


def index_positions(chunks: np.ndarray, counts: np.ndarray, offsets: np.ndarray, off_bytes: int,
                    chunk: int, arena: HostArena | None = None) -> np.ndarray:
    """The flat positions of an encoding's index chunks (``chunks`` ascending, ``counts`` offsets each,
    ``offsets`` the raw region), refusing an offset outside its chunk or positions that repeat. The
    positions are written into ``arena`` where one is given."""
    lib = _need(library())
    chunks = np.ascontiguousarray(chunks, dtype=np.int64)
    counts = np.ascontiguousarray(counts, dtype=np.int64)
    out = _output(arena, offsets.size // off_bytes)
    n = np.iinfo(np.int64).max  # the caller checks the positions against its tensor
    error = _offsets_error(lib.ws_index_positions(_ptr(chunks), _ptr(counts), chunks.size,
                                                  _ptr(np.ascontiguousarray(offsets)), off_bytes, chunk, _ptr(out)),
                           chunk, n)
    if error is not None:
        raise error
    return out


def bitmask_positions(bits: np.ndarray, chunks: np.ndarray, chunk: int, want: int,
                      arena: HostArena | None = None) -> np.ndarray:
    """The flat positions of an encoding's bitmask chunks (``bits``: their concatenated masks, ``chunks``
    their numbers ascending), refusing masks that set other than the ``want`` bits their table counts.
    The positions are written into ``arena`` where one is given."""
    lib = _need(library())
    chunks = np.ascontiguousarray(chunks, dtype=np.int64)
    out = _output(arena, want + 8)
    k = lib.ws_bitmask_positions(_ptr(np.ascontiguousarray(bits)), bits.size, _ptr(chunks), chunk, _ptr(out),
                                 out.size)
    if k != want:
        raise LayoutMismatchError(f"delta payload: {k} changed positions but {want} values in the bitmask chunks")
    return out[:want]
