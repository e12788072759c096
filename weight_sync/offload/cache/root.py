"""The cache root on disk: its directory layout, permissions and filesystem checks.

::

    ROOT/                 0700, owned by the current user
      entries/<key>/      published entries: manifest.json + shard-NNNNN-of-NNNNN.safetensors (read-only)
      locks/<key>.lock    per-layout publisher locks (never deleted)
      tmp/<key>.<pid>.<token>/   an entry being written; renamed into entries/ when complete
      trash/<key>.<token>/       an entry being removed (renamed out of entries/ first, then deleted)

``tmp/`` and ``trash/`` live under the root so that the renames into and out of ``entries/`` stay on one
filesystem and are atomic. Every path below the root is built from a validated 64-hex-digit key or from
a fixed name pattern, never from text read out of a manifest.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path

from weight_sync.errors import CacheError

__all__ = [
    "CacheRoot",
    "filesystem_type",
    "free_bytes",
    "fsync_dir",
    "validate_key",
]

logger = logging.getLogger(__name__)

_KEY_RE = re.compile(r"[0-9a-f]{64}")
_TEMP_RE = re.compile(r"([0-9a-f]{64})\.(\d+)\.([0-9a-f]{16})")

# Where mount points and filesystem types are read from; a module attribute so tests can point it at a
# fake table.
MOUNTS_PATH = Path("/proc/mounts")

_MEMORY_FILESYSTEMS = frozenset({"tmpfs", "ramfs", "devtmpfs", "hugetlbfs"})
_NETWORK_FILESYSTEMS = frozenset(
    {
        "nfs",
        "nfs4",
        "cifs",
        "smb3",
        "smbfs",
        "ncpfs",
        "9p",
        "afs",
        "ceph",
        "glusterfs",
        "fuse.glusterfs",
        "fuse.sshfs",
        "fuse.s3fs",
        "fuse.gcsfuse",
        "fuse.juicefs",
        "lustre",
        "gpfs",
        "beegfs",
        "orangefs",
        "pvfs2",
        "ocfs2",
        "gfs2",
        "davfs",
        "fuse.davfs2",
    }
)

# Root paths already checked in this process: the filesystem warning is logged once per root.
_WARNED_ROOTS: set[str] = set()


def validate_key(key: str) -> str:
    """Return ``key`` if it is a 64-hex-digit digest, else raise: keys become directory names."""
    if not isinstance(key, str) or not _KEY_RE.fullmatch(key):
        raise CacheError(f"cache key must be 64 lowercase hex digits, got: {key!r}")
    return key


def _unescape_mount(field: str) -> str:
    # /proc/mounts escapes space, tab, newline and backslash as octal (\040 ...).
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def filesystem_type(path: Path) -> str | None:
    """The filesystem type of the mount holding ``path`` (longest matching mount point), or None."""
    try:
        table = MOUNTS_PATH.read_text()
    except OSError:
        return None
    target = os.path.realpath(path)
    best: tuple[int, str] | None = None
    for line in table.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        mount_point, fstype = _unescape_mount(fields[1]), fields[2]
        prefix = mount_point.rstrip("/") + "/"
        if (target == mount_point or target.startswith(prefix) or mount_point == "/") and (
            best is None or len(mount_point) >= best[0]
        ):
            best = (len(mount_point), fstype)
    return best[1] if best else None


def free_bytes(path: Path) -> int:
    """Bytes an unprivileged writer may still use on the filesystem holding ``path`` (statvfs)."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def fsync_dir(path: Path) -> None:
    """fsync a directory so that entries created or renamed in it survive a power loss."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _make_private_dir(path: Path) -> None:
    # mkdir's mode is filtered by the umask; chmod afterwards makes 0700 exact.
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        return
    os.chmod(path, 0o700)


@dataclass(frozen=True, slots=True)
class CacheRoot:
    """A cache root directory; :meth:`ensure` creates and checks it before any use."""

    path: Path

    @classmethod
    def at(cls, path: str | os.PathLike) -> CacheRoot:
        return cls(Path(os.path.abspath(os.path.expanduser(os.fspath(path)))))

    @property
    def entries(self) -> Path:
        return self.path / "entries"

    @property
    def locks(self) -> Path:
        return self.path / "locks"

    @property
    def tmp(self) -> Path:
        return self.path / "tmp"

    @property
    def trash(self) -> Path:
        return self.path / "trash"

    def entry_dir(self, key: str) -> Path:
        return self.entries / validate_key(key)

    def lock_path(self, key: str) -> Path:
        return self.locks / f"{validate_key(key)}.lock"

    def ensure(self) -> None:
        """Create the root (0700) and its subdirectories, or check an existing one is safe to use.

        Raises :class:`CacheError` if the root is not a directory, belongs to another user, or is writable
        by group or others (anyone who can write there could plant an entry). Logs a warning once if the
        root is on a memory-backed or network filesystem.
        """
        if not self.path.exists():
            self.path.parent.mkdir(parents=True, exist_ok=True)
            _make_private_dir(self.path)
        st = os.lstat(self.path)
        if not stat.S_ISDIR(st.st_mode):
            raise CacheError(
                f"cache root {self.path} must be a directory, found mode {st.st_mode:o}"
            )
        if st.st_uid != os.geteuid():
            raise CacheError(
                f"cache root {self.path} must be owned by uid {os.geteuid()}, found uid {st.st_uid}"
            )
        if st.st_mode & 0o022:
            raise CacheError(
                f"cache root {self.path} must not be writable by group or others (expected 0700), "
                f"found {stat.S_IMODE(st.st_mode):04o}"
            )
        for sub in (self.entries, self.locks, self.tmp, self.trash):
            _make_private_dir(sub)
        devices = {os.stat(p).st_dev for p in (self.entries, self.tmp, self.trash)}
        if len(devices) != 1:
            raise CacheError(
                f"cache root {self.path}: entries/, tmp/ and trash/ must be on one filesystem so that "
                f"publication is an atomic rename, found {len(devices)} filesystems"
            )
        self._warn_about_filesystem()

    def _warn_about_filesystem(self) -> None:
        key = str(self.path)
        if key in _WARNED_ROOTS:
            return
        _WARNED_ROOTS.add(key)
        fstype = filesystem_type(self.path)
        if fstype in _MEMORY_FILESYSTEMS:
            logger.warning(
                "runtime cache root %s is on %s (memory-backed): cached weights occupy RAM as well as "
                "every mapping of them, so the cache cannot lower host memory; use a local disk",
                self.path,
                fstype,
            )
        elif fstype in _NETWORK_FILESYSTEMS or (fstype or "").startswith("nfs"):
            logger.warning(
                "runtime cache root %s is on %s (network filesystem): file locks and atomic renames "
                "are not reliable across nodes and page sharing is node-local; use a local disk",
                self.path,
                fstype,
            )

    def new_temp_dir(self, key: str) -> Path:
        """Create ``tmp/<key>.<pid>.<token>`` (0700) for one publication attempt."""
        path = self.tmp / f"{validate_key(key)}.{os.getpid()}.{secrets.token_hex(8)}"
        path.mkdir(mode=0o700)
        return path

    def temp_dirs(self, key: str | None = None) -> list[Path]:
        """Temp dirs of ``key`` (or of every key); names that do not match the pattern are ignored."""
        try:
            names = os.listdir(self.tmp)
        except FileNotFoundError:
            return []
        out = []
        for name in sorted(names):
            m = _TEMP_RE.fullmatch(name)
            if m and (key is None or m.group(1) == key):
                out.append(self.tmp / name)
        return out

    def remove_stale_temp_dirs(self, key: str) -> int:
        """Delete ``key``'s temp dirs. Call only while holding ``key``'s publisher lock.

        Every publisher of ``key`` holds that lock for as long as its temp dir exists, so while we hold it
        any temp dir of ``key`` belongs to a writer that died; other keys' temp dirs are left alone.
        """
        stale = self.temp_dirs(validate_key(key))
        for path in stale:
            logger.warning("removing stale runtime-cache temp dir %s (its writer died)", path)
            shutil.rmtree(path)
        return len(stale)

    def discard(self, entry: Path) -> None:
        """Atomically hide ``entry`` from readers (rename into trash/), then delete it."""
        target = self.trash / f"{entry.name}.{secrets.token_hex(8)}"
        os.rename(entry, target)
        fsync_dir(self.entries)
        shutil.rmtree(target)

    def entry_keys(self) -> list[str]:
        """Keys of the published entries (directory names that are not keys are ignored)."""
        try:
            names = os.listdir(self.entries)
        except FileNotFoundError:
            return []
        return sorted(n for n in names if _KEY_RE.fullmatch(n))
