"""Doorbells: the control link between the sender and each colocated (shm / ipc) receiver.

The shared-buffer backends move no data over the network: per bucket only two small records travel,
READY(k) (sender -> receiver: bucket k is in buffer k % n) and RELEASE(k) (receiver -> sender: buffer
k % n may be overwritten, plus a failure flag). They used to be gloo collectives, two per bucket with
every rank in lockstep, ~100 us each on loopback plus polling. A Unix stream socket per receiver:

- delivers a 64-byte record in a few microseconds and wakes a blocked reader from the kernel (no
  polling, no sleep granularity);
- orders memory: everything the writer stored before ``send`` (a packed shm buffer) is visible to the
  reader after ``recv`` on any CPU architecture (the kernel's socket locks are the barrier; a flag word
  in shared memory would need explicit fences on weakly ordered CPUs);
- turns a dead peer into an immediate EOF instead of a timeout;
- lets records queue: neither side waits for the other except where a buffer must be reused.

Each receiver opens a second link, its *control* link (hello ``role: "control"``): after the connect
exchange the control messages of every update (start and call headers, status exchanges) travel there
as length-prefixed messages instead of gloo collectives (``Channel.use_links``), with the same wake-up,
ordering and EOF properties; two sockets rather than one keep each reader's stream to one kind of
message.

Setup (once per connection): the sender listens on a socket file with a random name in its shm
directory (mode 0600) and publishes the path and a random token in the rendezvous store; each receiver
connects twice and sends a JSON hello on each (rank, token, role, the outcome of its own connect); the
sender checks the peer's uid (SO_PEERCRED) and the token, then unlinks the file. Records are fixed int64
words, messages raw bytes (JSON headers and status records, parsed as the gloo path parses them), the
hello JSON: nothing is pickled.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import select
import socket
import struct
import tempfile
import uuid
from pathlib import Path
from typing import Any

from weight_sync.errors import TransportError, TransportTimeout
from weight_sync.transport.group import Deadline
from weight_sync.transport.wire import RECORD_WORDS, decode_json

__all__ = ["CONTROL", "DOORBELL", "DoorbellServer", "Link", "connect_doorbell"]

log = logging.getLogger(__name__)

RECORD = struct.Struct(f"<{RECORD_WORDS}q")
_LENGTH = struct.Struct("<q")
_MAX_HELLO_BYTES = 1 << 20
_MAX_MESSAGE_BYTES = 1 << 31
#: Link roles a receiver opens: the data plane's records (READY / RELEASE) and the control messages.
DOORBELL, CONTROL = "doorbell", "control"
_NAME = re.compile(r"^weight_sync-[0-9a-f]{16}\.sock$")
_SUN_PATH_MAX = 107


class Link:
    """One end of a doorbell: fixed 64-byte records and (at connect) length-prefixed JSON.

    The socket is non-blocking; every wait is a ``select`` with a deadline. Failures raise
    ``TransportError`` (EOF: the peer exited or closed) or ``TransportTimeout`` naming ``peer``.
    """

    def __init__(self, sock: socket.socket, peer: str) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.peer = peer
        self._buf = bytearray(RECORD.size)
        self._have = 0
        self.closed = False

    def fileno(self) -> int:
        return self.sock.fileno()

    # ------------------------------------------------------------------ raw bytes
    def _send(self, data: bytes, deadline: Deadline, phase: str) -> None:
        view = memoryview(data)
        while view:
            try:
                n = self.sock.send(view)
                view = view[n:]
                continue
            except BlockingIOError:
                pass
            except OSError as e:
                raise TransportError(f"{phase}: the link to {self.peer} is gone: {e}") from e
            if not select.select([], [self.sock], [], deadline.remaining())[1]:
                raise TransportTimeout(f"{phase}: {self.peer} did not read its link within {deadline.timeout_s:.1f} s")

    def _fill(self, buf: bytearray, have: int, block: bool, deadline: Deadline | None, phase: str) -> int:
        """Read into ``buf[have:]`` until it is full (block) or nothing more is available (not block)."""
        view = memoryview(buf)
        while have < len(buf):
            try:
                n = self.sock.recv_into(view[have:], len(buf) - have)
            except BlockingIOError:
                if not block:
                    return have
                assert deadline is not None
                if not select.select([self.sock], [], [], deadline.remaining())[0] and deadline.expired():
                    raise TransportTimeout(
                        f"{phase}: no record from {self.peer} within {deadline.timeout_s:.1f} s"
                    ) from None
                continue
            except OSError as e:
                raise TransportError(f"{phase}: the link to {self.peer} is gone: {e}") from e
            if n == 0:
                raise TransportError(f"{phase}: {self.peer} closed its link (it exited or closed the transport)")
            have += n
        return have

    # ------------------------------------------------------------------ records
    def send(self, words: tuple[int, ...], deadline: Deadline, phase: str) -> None:
        self._send(RECORD.pack(*words), deadline, phase)

    def try_recv(self, phase: str) -> tuple[int, ...] | None:
        """A complete record if one has arrived, else None (never blocks)."""
        self._have = self._fill(self._buf, self._have, False, None, phase)
        if self._have < len(self._buf):
            return None
        self._have = 0
        return RECORD.unpack(self._buf)

    def recv(self, deadline: Deadline, phase: str) -> tuple[int, ...]:
        self._have = self._fill(self._buf, self._have, True, deadline, phase)
        self._have = 0
        return RECORD.unpack(self._buf)

    def readable(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for bytes (or EOF) on the link."""
        return bool(select.select([self.sock], [], [], timeout_s)[0])

    # ------------------------------------------------------------------ messages (control links)
    def send_bytes(self, data: bytes, deadline: Deadline, phase: str) -> None:
        """One length-prefixed message (a control header or status record)."""
        self._send(_LENGTH.pack(len(data)) + data, deadline, phase)

    def recv_bytes(self, deadline: Deadline, phase: str) -> bytes:
        """The next length-prefixed message (:meth:`send_bytes`)."""
        head = bytearray(_LENGTH.size)
        self._fill(head, 0, True, deadline, phase)
        (n,) = _LENGTH.unpack(head)
        if not 0 <= n <= _MAX_MESSAGE_BYTES:
            raise TransportError(f"{phase}: {self.peer} announced a {n}-byte message")
        body = bytearray(n)
        if n:
            self._fill(body, 0, True, deadline, phase)
        return bytes(body)

    # ------------------------------------------------------------------ JSON (connect only)
    def send_json(self, d: dict[str, Any], deadline: Deadline, phase: str) -> None:
        body = json.dumps(d).encode()
        self._send(_LENGTH.pack(len(body)) + body, deadline, phase)

    def recv_json(self, deadline: Deadline, phase: str) -> dict[str, Any]:
        head = bytearray(_LENGTH.size)
        self._fill(head, 0, True, deadline, phase)
        (n,) = _LENGTH.unpack(head)
        if not 0 < n <= _MAX_HELLO_BYTES:
            raise TransportError(f"{phase}: {self.peer} announced a {n}-byte message")
        body = bytearray(n)
        self._fill(body, 0, True, deadline, phase)
        return decode_json(bytes(body), f"{phase} from {self.peer}")

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_RDWR)
            self.sock.close()


def _socket_path(directory: str) -> Path:
    """A fresh socket path in ``directory``, else (missing, or too long for a Unix socket address) in
    /dev/shm or the temporary directory: the peers only need to share the directory, as for shm files."""
    name = f"weight_sync-{uuid.uuid4().hex[:16]}.sock"
    for d in (directory, "/dev/shm", tempfile.gettempdir()):
        p = Path(d)
        if p.is_dir() and len(os.fsencode(p.resolve() / name)) <= _SUN_PATH_MAX:
            return p.resolve() / name
    raise TransportError(f"no directory for a doorbell socket: {directory!r} is missing or its path is too long")


class DoorbellServer:
    """The sender's listening socket, alive from connect until every receiver's link is accepted."""

    def __init__(self, directory: str, backlog: int) -> None:
        self.token = uuid.uuid4().hex  # 128 random bits a receiver reads from the rendezvous store
        self.path = _socket_path(directory)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.sock.bind(str(self.path))
            os.chmod(self.path, 0o600)  # only this user may connect (the token and uid check follow)
            self.sock.listen(backlog)
        except OSError as e:
            self.close()
            raise TransportError(f"cannot listen on a doorbell socket at {self.path}: {e}") from e
        self.sock.setblocking(False)

    def info(self) -> dict[str, str]:
        return {"path": str(self.path), "token": self.token}

    def accept(self, ranks: list[int], timeout_s: float) -> tuple[dict[int, Link], dict[int, dict[str, Any]]]:
        """Accept one link per rank in ``ranks``; returns the links and the hellos, by rank."""
        links, hellos = self.accept_roles(ranks, (DOORBELL,), timeout_s)
        return links[DOORBELL], hellos

    def accept_roles(self, ranks: list[int], roles: tuple[str, ...], timeout_s: float
                     ) -> tuple[dict[str, dict[int, Link]], dict[int, dict[str, Any]]]:
        """Accept one link per rank in ``ranks`` and role in ``roles`` (the hello's ``role``, default the
        doorbell's); returns the links by role and rank, and the hellos of the first role, by rank."""
        deadline = Deadline(timeout_s)
        by_role: dict[str, dict[int, Link]] = {role: {} for role in roles}
        hellos: dict[int, dict[str, Any]] = {}
        want = len(ranks) * len(roles)

        def count() -> int:
            return sum(len(v) for v in by_role.values())

        try:
            while count() < want:
                if not select.select([self.sock], [], [], deadline.remaining())[0]:
                    if deadline.expired():
                        missing = sorted({r for role in roles for r in ranks if r not in by_role[role]})
                        raise TransportTimeout(
                            f"connect: receivers {missing} did not open their doorbell link within {timeout_s:.1f} s"
                        )
                    continue
                try:
                    conn, _ = self.sock.accept()
                except BlockingIOError:
                    continue
                link = Link(conn, "a connecting receiver")
                uid = _peer_uid(conn)
                if uid is not None and uid != os.getuid():
                    log.warning("doorbell: refused a connection from uid %d", uid)
                    link.close()
                    continue
                try:
                    hello = link.recv_json(deadline, "connect: doorbell hello")
                except TransportError as e:
                    log.warning("doorbell: a connection sent no valid hello: %s", e)
                    link.close()
                    continue
                rank, role = hello.get("rank"), hello.get("role", DOORBELL)
                links = by_role.get(role)
                if hello.get("token") != self.token or rank not in ranks or links is None or rank in links:
                    log.warning("doorbell: refused a hello for rank %r, role %r (bad token, unknown or repeated "
                                "rank or role)", rank, role)
                    link.close()
                    continue
                link.peer = f"receiver rank {rank}"
                links[rank] = link
                if role == roles[0]:
                    hellos[rank] = hello
        except BaseException:
            for links in by_role.values():
                for link in links.values():
                    link.close()
            raise
        return by_role, hellos

    def close(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        self.sock.close()


def _peer_uid(conn: socket.socket) -> int | None:
    opt = getattr(socket, "SO_PEERCRED", None)
    if opt is None:
        return None
    creds = conn.getsockopt(socket.SOL_SOCKET, opt, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return int(uid)


def connect_doorbell(info: dict[str, Any], rank: int, hello: dict[str, Any], timeout_s: float) -> Link:
    """Open a receiver's link to the sender's doorbell and send its hello."""
    path = info.get("path")
    if not isinstance(path, str) or not os.path.isabs(path) or not _NAME.match(os.path.basename(path)):
        raise TransportError(f"doorbell path {path!r} is not a weight_sync socket path")
    deadline = Deadline(timeout_s)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    try:
        sock.connect(path)
    except OSError as e:
        sock.close()
        raise TransportError(f"cannot connect to the sender's doorbell {path}: {e}") from e
    link = Link(sock, "the sender (rank 0)")
    link.send_json({"rank": rank, "token": info.get("token"), **hello}, deadline, "connect: doorbell hello")
    return link

