"""The handshake side channel: length-prefixed frames over non-blocking TCP on loopback.

Both ends are non-blocking and polled from the adapters' step loops, so nothing here can
block an engine; P's listener can instead run on a thread of its own (``threaded=True``),
so that handshakes are answered while the engine thread is busy (a long forward pass):
its handler then runs on that thread and must touch no state of the engine thread's
(P's answers from data fixed at start-up and queues the rest). A frame is ``length u32 | status u8 | payload``; status 0 carries a
``wire.Handshake`` JSON payload, status 1 a JSON ``{"reason", "detail"}`` refusal. The
connection stays open after the exchange: its close is how a crashed peer is noticed
promptly on the same host (lease expiry and ack silence cover the rest).

Authentication (spec/PROTOCOL.md, "Handshake authentication"). On accept P sends a
challenge frame (status 2: 16 random bytes). D answers with its handshake, either plain
(status 0) or, when it has the shared secret, authenticated (status 3:
``nonce(16) | mac(32) | payload``, mac = HMAC-SHA256(secret, "kvproto-hs1 D>P" |
challenge | nonce | payload)). P's accepted reply to an authenticated request is
authenticated the same way (status 3: ``mac(32) | payload``, mac over "kvproto-hs1 P>D" |
nonce | challenge | payload). The challenge and nonce are fresh per connection, so a
recorded exchange cannot be replayed. The server only verifies; what to do with an
unauthenticated request is the handler's decision (P refuses it when it has a secret).
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import itertools
import json
import logging
import os
import secrets
import select
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvproto.errors import RemoteInputError
from kvproto.wire import MAX_HANDSHAKE_BYTES

log = logging.getLogger(__name__)

FRAME = struct.Struct(">IB")
ST_OK = 0
ST_REFUSED = 1
ST_CHALLENGE = 2
ST_AUTH = 3
_STATUSES = (ST_OK, ST_REFUSED, ST_CHALLENGE, ST_AUTH)
MAX_CONNS = 512
SERVE_WAIT_S = 0.1  # the listener thread's longest sleep (request timeouts, stop)
NONCE_BYTES = 16
MAC_BYTES = 32
SECRET_ENV = "KVPROTO_HANDSHAKE_SECRET"
_TAG_REQUEST = b"kvproto-hs1 D>P"
_TAG_REPLY = b"kvproto-hs1 P>D"


def secret_from_env() -> bytes | None:
    """The shared handshake secret from ``KVPROTO_HANDSHAKE_SECRET`` (None when unset or
    empty). The adapters use it unless given one explicitly."""
    v = os.environ.get(SECRET_ENV)
    return v.encode("utf-8", errors="surrogateescape") if v else None


def request_mac(secret: bytes, challenge: bytes, nonce: bytes, payload: bytes) -> bytes:
    return hmac.new(secret, _TAG_REQUEST + challenge + nonce + payload, hashlib.sha256).digest()


def reply_mac(secret: bytes, challenge: bytes, nonce: bytes, payload: bytes) -> bytes:
    return hmac.new(secret, _TAG_REPLY + nonce + challenge + payload, hashlib.sha256).digest()


def frame(status: int, payload: bytes) -> bytes:
    return FRAME.pack(len(payload), status) + payload


def refusal(reason: str, detail: str) -> bytes:
    return frame(ST_REFUSED, json.dumps({"reason": reason, "detail": detail}).encode())


def parse_refusal(payload: bytes) -> tuple[str, str]:
    try:
        d = json.loads(payload.decode("utf-8"))
        return str(d["reason"])[:64], str(d.get("detail", ""))[:512]
    except Exception:
        return "malformed_refusal", payload[:64].hex()


class FrameError(RemoteInputError):
    """A handshake frame from a peer that breaks the framing rules (caught here, the
    connection is dropped)."""


def _take_frame(buf: bytearray) -> tuple[int, bytes] | None:
    if len(buf) < FRAME.size:
        return None
    n, st = FRAME.unpack_from(buf, 0)
    if n > MAX_HANDSHAKE_BYTES:
        raise FrameError(f"frame of {n} bytes exceeds {MAX_HANDSHAKE_BYTES}")
    if st not in _STATUSES:
        raise FrameError(f"unknown frame status {st}")
    if len(buf) < FRAME.size + n:
        return None
    payload = bytes(buf[FRAME.size:FRAME.size + n])
    del buf[:FRAME.size + n]
    return st, payload


@dataclass
class _Conn:
    sock: socket.socket
    since: float
    cid: int  # connection id, never reused (file descriptors are)
    challenge: bytes = b""
    inbuf: bytearray = field(default_factory=bytearray)
    outbuf: bytearray = field(default_factory=bytearray)
    answered: bool = False
    peer: str = ""  # set by the handler once the peer named itself


Handler = Callable[[int, bytes, bool], tuple[bytes, str]]


class Server:
    """P's handshake listener. ``handler(conn_id, payload, authenticated) ->
    (reply_frame, peer_name)``; ``authenticated`` is True only when the request carried a
    valid MAC under ``secret``. ``is_open(conn_id)`` says whether that peer's connection
    is still up.

    With ``threaded`` a daemon thread serves the listener (``poll`` does nothing) and
    calls ``handler`` and ``on_close`` on that thread; ``is_open`` and ``drop`` may be
    called from any thread. Otherwise ``poll`` serves it on the caller's thread."""

    def __init__(self, handler: Handler, *,
                 host: str = "127.0.0.1", port: int = 0, request_timeout: float = 5.0,
                 on_close: Callable[[str], None] | None = None,
                 secret: bytes | None = None, threaded: bool = False) -> None:
        self.handler = handler
        self.on_close = on_close
        self.request_timeout = request_timeout
        self.secret = secret
        self._ids = itertools.count(1)
        # Connection ids open now: written by the serving thread only; a membership test
        # from another thread is one atomic set look-up.
        self._open: set[int] = set()
        self._to_drop: deque[int] = deque()  # ids to close, from any thread (<= MAX_CONNS)
        self.lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.lsock.bind((host, port))
        self.lsock.listen(64)
        self.lsock.setblocking(False)
        self.host, self.port = self.lsock.getsockname()[:2]
        self.conns: dict[int, _Conn] = {}
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        if threaded:
            self._wake_r, self._wake_w = socket.socketpair()
            self._wake_r.setblocking(False)
            self._wake_w.setblocking(False)
            self._thread = threading.Thread(target=self._serve_forever, daemon=True,
                                            name=f"kvproto-handshake-{self.port}")
            self._thread.start()

    @property
    def threaded(self) -> bool:
        return self._thread is not None

    def poll(self, now: float) -> None:
        """Serve pending connections once (nothing when the listener has its thread)."""
        if self._thread is None:
            self._serve(now)

    def drop(self, cid: int) -> None:
        """Close connection ``cid`` (the peer sees its handshake channel close): at once,
        or by the listener thread when it has one."""
        if cid in self._open:
            self._to_drop.append(cid)
            if self._thread is not None:
                self._wake()
            else:
                self._drop_queued()

    def _drop_queued(self) -> None:
        while self._to_drop:
            cid = self._to_drop.popleft()
            for fd, c in list(self.conns.items()):
                if c.cid == cid:
                    self._drop(fd, c)

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except OSError:  # a full wake-up buffer already wakes the thread
            pass

    def _serve_forever(self) -> None:
        while not self._stop.is_set():
            p = select.poll()
            p.register(self.lsock, select.POLLIN)
            p.register(self._wake_r, select.POLLIN)
            for fd, c in self.conns.items():
                p.register(fd, select.POLLIN | (select.POLLOUT if c.outbuf else 0))
            try:
                p.poll(SERVE_WAIT_S * 1000)
                while self._wake_r.recv(4096):
                    pass
            except (BlockingIOError, InterruptedError):
                pass
            except OSError:  # pragma: no cover - the wake-up pair is gone: closing
                return
            if self._stop.is_set():
                return
            try:
                self._serve(time.monotonic())
            except Exception:  # a bug must not end the listener: logged, served on
                log.exception("handshake listener failed; serving on")

    def _serve(self, now: float) -> None:
        if self._to_drop:
            self._drop_queued()
        for _ in range(64):
            try:
                s, _addr = self.lsock.accept()
            except (BlockingIOError, InterruptedError):
                break
            except OSError as e:  # pragma: no cover - resource exhaustion
                log.warning("handshake accept failed: %s", e)
                break
            if len(self.conns) >= MAX_CONNS:
                s.close()
                continue
            s.setblocking(False)
            c = _Conn(s, now, next(self._ids), secrets.token_bytes(NONCE_BYTES))
            c.outbuf += frame(ST_CHALLENGE, c.challenge)
            self.conns[s.fileno()] = c
            self._open.add(c.cid)
        for fd, c in list(self.conns.items()):
            if not self._service(fd, c, now):
                self._drop(fd, c)

    def _service(self, fd: int, c: _Conn, now: float) -> bool:
        try:
            while True:
                data = c.sock.recv(65536)
                if not data:
                    return False  # peer closed
                if c.answered:
                    continue  # nothing more is expected; ignore
                c.inbuf += data
                if len(c.inbuf) > MAX_HANDSHAKE_BYTES + FRAME.size:
                    return False
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            return False
        if not c.answered:
            try:
                got = _take_frame(c.inbuf)
            except FrameError as e:
                log.warning("handshake frame rejected: %s", e)
                return False
            if got is not None:
                st, payload = got
                nonce = b""
                authed = False
                if st == ST_AUTH:
                    if len(payload) < NONCE_BYTES + MAC_BYTES:
                        return False
                    nonce = payload[:NONCE_BYTES]
                    mac = payload[NONCE_BYTES:NONCE_BYTES + MAC_BYTES]
                    payload = payload[NONCE_BYTES + MAC_BYTES:]
                    authed = self.secret is not None and hmac.compare_digest(
                        mac, request_mac(self.secret, c.challenge, nonce, payload))
                elif st != ST_OK:
                    return False
                try:
                    reply, c.peer = self.handler(c.cid, payload, authed)
                except Exception:  # a bug or unforeseen input must not stop the engine
                    log.exception("handshake handler failed; connection dropped")
                    return False
                if authed and self.secret is not None and reply[FRAME.size - 1] == ST_OK:
                    body = reply[FRAME.size:]
                    reply = frame(ST_AUTH, reply_mac(self.secret, c.challenge, nonce, body)
                                  + body)
                c.outbuf += reply
                c.answered = True
            elif now - c.since > self.request_timeout:
                return False
        if c.outbuf:
            try:
                n = c.sock.send(c.outbuf)
                del c.outbuf[:n]
            except (BlockingIOError, InterruptedError):
                pass
            except OSError:
                return False
        return True

    def is_open(self, cid: int) -> bool:
        return cid in self._open

    def _drop(self, fd: int, c: _Conn) -> None:
        del self.conns[fd]
        self._open.discard(c.cid)
        try:
            c.sock.close()
        except OSError:  # pragma: no cover
            pass
        if c.peer and self.on_close is not None:
            self.on_close(c.peer)

    def close(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._wake()
            self._thread.join(5.0)
            self._wake_r.close()
            self._wake_w.close()
        for fd, c in list(self.conns.items()):
            del self.conns[fd]
            c.sock.close()
        self._open.clear()
        self.lsock.close()


class Client:
    """D's end of one handshake: connect, wait for P's challenge, send, receive one
    frame, then stay open.

    ``poll`` returns ``None`` while in progress, ``("ok", payload)``,
    ``("refused", payload)`` or ``("error", detail)``; after the reply, ``alive``
    reports whether the peer still holds the connection. With ``secret`` the request is
    authenticated and an "ok" reply must be too (else "error").
    """

    def __init__(self, host: str, port: int, request: bytes, *,
                 secret: bytes | None = None) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setblocking(False)
        self.request = request
        self.secret = secret
        self.challenge: bytes | None = None
        self.nonce = secrets.token_bytes(NONCE_BYTES)
        self.out = bytearray()
        self.inbuf = bytearray()
        self.connected = False
        self.done = False
        rc = self.sock.connect_ex((host, port))
        if rc not in (0, errno.EINPROGRESS, errno.EWOULDBLOCK, errno.EAGAIN):
            self.error: str | None = f"connect: {errno.errorcode.get(rc, rc)}"
        else:
            self.error = None

    def poll(self) -> tuple[str, bytes | str] | None:
        if self.error is not None:
            return ("error", self.error)
        if not self.connected:
            rc = self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if rc != 0:
                self.error = f"connect: {errno.errorcode.get(rc, rc)}"
                return ("error", self.error)
            try:
                self.sock.getpeername()
            except OSError:
                return None  # still connecting
            self.connected = True
        if self.out:
            try:
                n = self.sock.send(self.out)
                del self.out[:n]
            except (BlockingIOError, InterruptedError):
                return None
            except OSError as e:
                self.error = f"send: {e}"
                return ("error", self.error)
        try:
            while True:
                data = self.sock.recv(65536)
                if not data:
                    self.error = "closed by peer before replying"
                    return ("error", self.error)
                self.inbuf += data
                if len(self.inbuf) > MAX_HANDSHAKE_BYTES + FRAME.size:
                    self.error = "reply too large"
                    return ("error", self.error)
        except (BlockingIOError, InterruptedError):
            pass
        except OSError as e:
            self.error = f"recv: {e}"
            return ("error", self.error)
        try:
            got = _take_frame(self.inbuf)
            if got is not None and self.challenge is None:
                st, payload = got
                if st != ST_CHALLENGE or len(payload) != NONCE_BYTES:
                    raise FrameError("the peer did not start with a challenge")
                self.challenge = payload
                if self.secret is not None:
                    mac = request_mac(self.secret, payload, self.nonce, self.request)
                    self.out += frame(ST_AUTH, self.nonce + mac + self.request)
                else:
                    self.out += frame(ST_OK, self.request)
                return self.poll()
        except FrameError as e:
            self.error = str(e)
            return ("error", self.error)
        if got is None:
            return None
        self.done = True
        st, payload = got
        if st == ST_AUTH:
            body = payload[MAC_BYTES:]
            if self.secret is None or self.challenge is None or len(payload) < MAC_BYTES \
                    or not hmac.compare_digest(payload[:MAC_BYTES], reply_mac(
                        self.secret, self.challenge, self.nonce, body)):
                self.error = "reply fails authentication"
                return ("error", self.error)
            return ("ok", body)
        if st == ST_OK and self.secret is not None:
            self.error = "unauthenticated reply (this side has a handshake secret)"
            return ("error", self.error)
        if st not in (ST_OK, ST_REFUSED):
            self.error = f"unexpected frame status {st}"
            return ("error", self.error)
        return ("ok" if st == ST_OK else "refused", payload)

    def alive(self) -> bool:
        """After the exchange: False once the peer closed the connection (it died)."""
        try:
            data = self.sock.recv(4096, socket.MSG_PEEK)
        except (BlockingIOError, InterruptedError):
            return True
        except OSError:
            return False
        if not data:
            return False
        self.sock.recv(len(data))  # discard unexpected bytes
        return True

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:  # pragma: no cover
            pass
