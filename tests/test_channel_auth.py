"""Handshake channel authentication and the NIXL metadata name reader.

No NIXL here: the channel is plain TCP on loopback, and the metadata reader works on
bytes (their layout is nixl 1.5.1's; test_nixl*.py load real metadata).
"""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Iterator

import pytest

from kvproto.nixl.agent import MAX_AGENT_NAME_BYTES, metadata_agent_name
from kvproto.nixl.channel import (
    FRAME,
    MAC_BYTES,
    NONCE_BYTES,
    SECRET_ENV,
    ST_AUTH,
    ST_CHALLENGE,
    ST_OK,
    Client,
    Server,
    frame,
    request_mac,
    secret_from_env,
)

SECRET = b"shared-secret"


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[bytes, bool]] = []

    def __call__(self, conn: int, payload: bytes, authed: bool) -> tuple[bytes, str]:
        self.calls.append((payload, authed))
        return frame(ST_OK, b"reply:" + payload), "peer"


@pytest.fixture(params=[False, True], ids=["polled", "threaded"])
def server(request: pytest.FixtureRequest) -> Iterator[tuple[Server, Recorder]]:
    """The listener served by ``poll`` from the caller's thread, or by its own thread
    (``poll`` then does nothing): the exchanges are the same."""
    rec = Recorder()
    s = Server(rec, secret=SECRET, threaded=request.param)
    yield s, rec
    s.close()


def exchange(srv: Server, client: Client) -> tuple[str, bytes | str]:
    end = time.monotonic() + 10
    while time.monotonic() < end:
        srv.poll(time.monotonic())
        r = client.poll()
        if r is not None:
            return r
        time.sleep(0.001)
    raise AssertionError("no reply")


def test_authenticated_request_and_reply(server: tuple[Server, Recorder]) -> None:
    srv, rec = server
    c = Client(srv.host, srv.port, b"hello", secret=SECRET)
    assert exchange(srv, c) == ("ok", b"reply:hello")
    assert rec.calls == [(b"hello", True)]
    c.close()


@pytest.mark.parametrize("secret", [None, b"wrong-secret"])
def test_unauthenticated_or_wrong_secret_reaches_the_handler_as_unauthenticated(
        server: tuple[Server, Recorder], secret: bytes | None) -> None:
    srv, rec = server
    c = Client(srv.host, srv.port, b"hello", secret=secret)
    status, _ = exchange(srv, c)
    assert rec.calls == [(b"hello", False)]
    # Without the secret the reply is not authenticated: the client with a wrong secret
    # refuses it; the one without a secret takes it (the handler decides, see producer).
    assert status == ("ok" if secret is None else "error")
    c.close()


def _raw_connect(srv: Server) -> tuple[socket.socket, bytes]:
    s = socket.create_connection((srv.host, srv.port), timeout=5)
    s.setblocking(False)
    buf = bytearray()
    end = time.monotonic() + 5
    while len(buf) < FRAME.size + NONCE_BYTES and time.monotonic() < end:
        srv.poll(time.monotonic())
        try:
            buf += s.recv(4096)
        except BlockingIOError:
            time.sleep(0.001)
    n, st = FRAME.unpack_from(buf, 0)
    assert (n, st) == (NONCE_BYTES, ST_CHALLENGE)
    return s, bytes(buf[FRAME.size:FRAME.size + NONCE_BYTES])


def test_a_recorded_authenticated_request_cannot_be_replayed(
        server: tuple[Server, Recorder]) -> None:
    srv, rec = server
    s1, challenge1 = _raw_connect(srv)
    nonce = b"n" * NONCE_BYTES
    request = frame(ST_AUTH, nonce + request_mac(SECRET, challenge1, nonce, b"hs") + b"hs")
    s1.sendall(request)
    s2, challenge2 = _raw_connect(srv)
    assert challenge2 != challenge1  # fresh per connection
    s2.sendall(request)  # the attacker replays the recorded frame on a new connection
    end = time.monotonic() + 5
    while len(rec.calls) < 2 and time.monotonic() < end:
        srv.poll(time.monotonic())
        time.sleep(0.001)
    assert rec.calls == [(b"hs", True), (b"hs", False)]
    s1.close()
    s2.close()


def test_a_truncated_auth_frame_is_dropped(server: tuple[Server, Recorder]) -> None:
    srv, rec = server
    s, _ = _raw_connect(srv)
    s.sendall(frame(ST_AUTH, b"x" * (NONCE_BYTES + MAC_BYTES - 1)))
    end = time.monotonic() + 5
    while srv.conns and time.monotonic() < end:
        srv.poll(time.monotonic())
        time.sleep(0.001)
    assert not srv.conns and rec.calls == []
    s.close()


def test_secret_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SECRET_ENV, raising=False)
    assert secret_from_env() is None
    monkeypatch.setenv(SECRET_ENV, "")
    assert secret_from_env() is None
    monkeypatch.setenv(SECRET_ENV, "abc")
    assert secret_from_env() == b"abc"


def _md(name: bytes, length: int | None = None, sep: bytes = b"|") -> bytes:
    n = len(name) if length is None else length
    return b"nixlSerDes|Agent" + struct.pack("<Q", n) + name + sep + b"Conns" + b"\x00" * 16


def test_metadata_agent_name_reads_the_name_without_loading() -> None:
    assert metadata_agent_name(_md(b"D-1")) == "D-1"
    assert metadata_agent_name(_md("dé|x".encode())) == "dé|x"
    for bad in (b"", b"garbage", _md(b"D-1", length=2), _md(b"D-1", length=10**9),
                _md(b"D-1", sep=b"#"), _md(b""), _md(b"\xff\xfe"),
                _md(b"a" * (MAX_AGENT_NAME_BYTES + 1)), _md(b"D-1")[:20]):
        assert metadata_agent_name(bad) is None, bad


def test_threaded_listener_answers_without_poll_and_drops_on_request() -> None:
    """With its own thread the listener answers while nobody polls; ``drop`` from
    another thread closes a connection (the client sees its peer gone) and ``on_close``
    reports it, on the listener's thread."""
    import threading

    closed: list[tuple[str, str]] = []
    rec = Recorder()
    srv = Server(rec, threaded=True,
                 on_close=lambda peer: closed.append((peer, threading.current_thread().name)))
    c = Client(srv.host, srv.port, b"hi")
    try:
        end = time.monotonic() + 10
        r = None
        while r is None and time.monotonic() < end:  # this thread never calls srv.poll
            r = c.poll()
            time.sleep(0.001)
        assert r == ("ok", b"reply:hi") and c.alive()
        (cid,) = srv._open
        assert srv.is_open(cid)
        srv.drop(cid)
        while (c.alive() or not closed) and time.monotonic() < end:
            time.sleep(0.001)
        assert not c.alive() and not srv.is_open(cid)
        assert closed == [("peer", f"kvproto-handshake-{srv.port}")]
    finally:
        c.close()
        srv.close()
    assert not any(t.name == f"kvproto-handshake-{srv.port}" for t in threading.enumerate())
