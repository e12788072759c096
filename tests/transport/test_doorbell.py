"""Doorbell links (shm / ipc control): fixed records both ways, a dead peer is an immediate error, a
silent one a timeout, and only this user's receivers holding the token get a link."""

from __future__ import annotations

import socket
import threading
from pathlib import Path

import pytest

from weight_sync.errors import TransportError, TransportTimeout
from weight_sync.transport.doorbell import DoorbellServer, connect_doorbell
from weight_sync.transport.group import Deadline


def _pair(tmp_path: Path, ranks: list[int]) -> tuple[dict, dict, list]:
    server = DoorbellServer(str(tmp_path), backlog=len(ranks))
    assert server.path.exists()
    receivers: list = []

    def connect(rank: int) -> None:
        receivers.append(connect_doorbell(server.info(), rank, {"ok": True}, 5.0))

    threads = [threading.Thread(target=connect, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    try:
        links, hellos = server.accept(ranks, 5.0)
    finally:
        for t in threads:
            t.join()
        server.close()
    assert not server.path.exists(), "the socket file is unlinked once every receiver is connected"
    return links, hellos, receivers


def test_records_travel_both_ways_in_order(tmp_path: Path) -> None:
    links, hellos, (receiver,) = _pair(tmp_path, [1])
    assert hellos[1]["ok"] is True
    deadline = Deadline(5.0)
    for k in range(3):
        links[1].send((1, 2, 3, k, 0, 0, 0, 0), deadline, "test")
    assert [receiver.recv(deadline, "test")[3] for _ in range(3)] == [0, 1, 2]
    assert receiver.try_recv("test") is None
    receiver.send((7, 0, 0, 0, 1, 0, 0, 0), deadline, "test")
    assert links[1].recv(deadline, "test")[0] == 7


def test_a_closed_peer_is_an_immediate_error_naming_it(tmp_path: Path) -> None:
    links, _, (receiver,) = _pair(tmp_path, [1])
    receiver.close()
    with pytest.raises(TransportError, match="receiver rank 1 closed its link"):
        links[1].recv(Deadline(30.0), "update_weights: RELEASE of bucket 0")


def test_a_silent_peer_times_out(tmp_path: Path) -> None:
    links, _, (receiver,) = _pair(tmp_path, [1])
    with pytest.raises(TransportTimeout, match="no record from the sender"):
        receiver.recv(Deadline(0.2), "update_weights: READY of bucket 0")
    links[1].close()


def test_a_connection_without_the_token_is_refused_and_the_real_receiver_still_gets_in(tmp_path: Path) -> None:
    server = DoorbellServer(str(tmp_path), backlog=2)
    info = server.info()
    intruder = connect_doorbell({**info, "token": "0" * 32}, 1, {"ok": True}, 5.0)
    result: list = []
    t = threading.Thread(target=lambda: result.append(connect_doorbell(info, 1, {"ok": True}, 5.0)))
    t.start()
    try:
        links, _ = server.accept([1], 5.0)
    finally:
        t.join()
        server.close()
    with pytest.raises(TransportError, match="closed its link"):
        intruder.recv(Deadline(5.0), "test")
    links[1].send((1,) * 8, Deadline(5.0), "test")
    assert result[0].recv(Deadline(5.0), "test") == (1,) * 8


def test_a_receiver_that_never_connects_times_the_accept_out_naming_it(tmp_path: Path) -> None:
    server = DoorbellServer(str(tmp_path), backlog=1)
    try:
        with pytest.raises(TransportTimeout, match=r"receivers \[1\] did not open"):
            server.accept([1], 0.2)
    finally:
        server.close()


def test_a_directory_too_long_for_a_socket_address_falls_back_to_a_shorter_one(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 100)
    deep.mkdir()
    server = DoorbellServer(str(deep), backlog=1)
    try:
        assert len(str(server.path)) <= 107 and server.path.parent != deep
    finally:
        server.close()


def test_a_path_outside_the_naming_scheme_is_refused() -> None:
    with pytest.raises(TransportError, match="not a weight_sync socket path"):
        connect_doorbell({"path": "/tmp/../etc/x.sock", "token": "t"}, 1, {}, 1.0)
    assert socket.AF_UNIX  # Unix sockets are what the shm/ipc backends need


def test_each_receiver_opens_a_doorbell_and_a_control_link_in_any_order(tmp_path: Path) -> None:
    from weight_sync.transport.doorbell import CONTROL, DOORBELL

    server = DoorbellServer(str(tmp_path), backlog=4)
    opened: dict = {}

    def connect(rank: int, roles: tuple[str, ...]) -> None:
        for role in roles:
            hello = {"ok": True} if role == DOORBELL else {"role": CONTROL}
            opened[(rank, role)] = connect_doorbell(server.info(), rank, hello, 5.0)

    threads = [threading.Thread(target=connect, args=(1, (DOORBELL, CONTROL))),
               threading.Thread(target=connect, args=(2, (CONTROL, DOORBELL)))]
    for t in threads:
        t.start()
    try:
        by_role, hellos = server.accept_roles([1, 2], (DOORBELL, CONTROL), 5.0)
    finally:
        for t in threads:
            t.join()
        server.close()
    assert sorted(hellos) == [1, 2] and all(h["ok"] for h in hellos.values())  # the doorbell's hellos
    deadline = Deadline(5.0)
    for rank in (1, 2):
        by_role[CONTROL][rank].send_bytes(b"header %d" % rank, deadline, "test")
        assert opened[(rank, CONTROL)].recv_bytes(deadline, "test") == b"header %d" % rank
        opened[(rank, CONTROL)].send_bytes(b"", deadline, "test")
        assert by_role[CONTROL][rank].recv_bytes(deadline, "test") == b""
        by_role[DOORBELL][rank].send((rank,) * 8, deadline, "test")
        assert opened[(rank, DOORBELL)].recv(deadline, "test") == (rank,) * 8
