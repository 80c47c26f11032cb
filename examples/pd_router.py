"""A prefill/decode router in front of two vLLM OpenAI servers joined by a KV connector.

    python examples/pd_router.py --prefill http://127.0.0.1:8100 \\
        --decode http://127.0.0.1:8200 --port 8000

Clients talk to the router as to one OpenAI-compatible server (``/v1/completions``,
``/v1/chat/completions``, ``/v1/models``, ``/health``). For each completion request:

1. **prefill** -- the router sends the request to a prefill server (P) with
   ``max_tokens`` 1, ``stream`` false, ``n`` 1 and ``kv_transfer_params``
   ``{"do_remote_decode": true}``. P computes the prompt's KV, keeps the blocks for a
   decode server and answers with the ``kv_transfer_params`` that name them.
2. **handoff** -- the router takes P's ``kv_transfer_params`` unchanged.
3. **decode** -- it sends the client's request, unchanged but for those params, to a
   decode server (D), which pulls the KV from P and generates.
4. **stream** -- D's answer goes back to the client as it comes: server-sent events for
   ``stream: true``, one JSON body otherwise.

Rules the router keeps:

* A client's own ``kv_transfer_params`` are never forwarded: P gets exactly
  ``{"do_remote_decode": true}`` and D exactly what P returned, so a client cannot point
  D at KV blocks of another request.
* A client that disconnects cancels the upstream request in flight (to P while the
  prefill runs, to D afterwards); the server sees the connection close and its engine
  aborts the request. A client that leaves after P answered and before D was asked
  leaves P's blocks to P's lease: nothing can hand them back sooner.
* An unreachable upstream is a ``502`` with one line naming it; an upstream's own error
  answer (a ``400`` for a bad request, say) goes back to the client unchanged.
* One prompt per request: P returns one set of transfer params per request.
* The router keeps idle upstream connections shorter (``--keepalive``) than the servers
  do (uvicorn's 5 s), so it never sends a request on a connection the server is closing.

``GET /router/status`` reports the requests in flight by phase and the router's
counters (disconnects by phase, upstream errors). ``--test-hooks`` (TEST ONLY) honours
an ``X-Router-Test-Hold: <seconds>`` request header: the request waits that long in the
handoff phase, so that tests can disconnect a client between P and D.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import logging
import re
import sys
import time
import uuid
from collections import Counter
from typing import Any

from aiohttp import ClientError, ClientSession, ClientTimeout, TCPConnector, web

log = logging.getLogger("pd_router")

COMPLETION_PATHS = ("/v1/completions", "/v1/chat/completions")
PHASES = ("prefill", "handoff", "decode", "stream")
# Fields of the client's request that P does not get: P generates one token that nobody
# reads, so sampling, streaming and output options are D's alone.
DECODE_ONLY = ("stream", "stream_options", "n", "best_of", "min_tokens", "logprobs",
               "top_logprobs", "echo", "max_tokens", "max_completion_tokens",
               "use_beam_search", "kv_transfer_params")
MAX_ID = 128            # characters of a client's X-Request-Id kept
MAX_TEST_HOLD_S = 60.0  # the longest X-Router-Test-Hold honoured
_ID_OK = re.compile(r"[^A-Za-z0-9._:-]")
# How the router's aiohttp server runs. handler_cancellation: a client that disconnects
# cancels its handler, and with it the upstream request in flight.
SERVER_OPTIONS: dict[str, Any] = {"handler_cancellation": True, "access_log": None}


class RouterError(Exception):
    """An answer the router gives itself: an HTTP status and one line."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class ClientGone(Exception):
    """The client disconnected while the answer streamed; ``response`` is the started
    answer (the handler returns it, nothing more can be sent)."""

    def __init__(self, response: web.StreamResponse) -> None:
        super().__init__("client gone")
        self.response = response


def error_json(status: int, message: str) -> dict[str, Any]:
    """The OpenAI error object (what vLLM's servers answer too)."""
    kind = "invalid_request_error" if status < 500 else "upstream_error"
    return {"error": {"object": "error", "message": message, "type": kind,
                      "param": None, "code": status}}


def error_response(status: int, message: str) -> web.Response:
    return web.json_response(error_json(status, message), status=status)


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """What P gets: the client's request without D's options, one token, no stream, and
    ``do_remote_decode`` (the only transfer parameter the router sends P)."""
    out = {k: v for k, v in body.items() if k not in DECODE_ONLY}
    out.update(max_tokens=1, stream=False, n=1,
               kv_transfer_params={"do_remote_decode": True})
    if "messages" in body:
        out["max_completion_tokens"] = 1
    return out


def decode_body(body: dict[str, Any], kv_transfer_params: dict[str, Any]) -> dict[str, Any]:
    """What D gets: the client's request with P's transfer params, unchanged."""
    return {**body, "kv_transfer_params": kv_transfer_params}


def single_prompt_error(path: str, body: dict[str, Any]) -> str | None:
    """None when the request carries one prompt (or chat); otherwise why not."""
    if path.endswith("/chat/completions"):
        return None if isinstance(body.get("messages"), list) else "messages must be a list"
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return None
    if isinstance(prompt, list) and prompt:
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return None  # one prompt of token ids
        if len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            return None
        return (f"the router forwards one prompt per request; got a batch of {len(prompt)} "
                "(send them as separate requests)")
    return "prompt must be a string or a list of token ids"


class Router:
    """The routing state: upstream URLs, the client session, requests in flight."""

    def __init__(self, prefill: list[str], decode: list[str], *, connect_timeout: float,
                 read_timeout: float | None, keepalive: float, max_in_flight: int,
                 test_hooks: bool) -> None:
        self.prefill = [u.rstrip("/") for u in prefill]
        self.decode = [u.rstrip("/") for u in decode]
        self._next_p = itertools.cycle(range(len(self.prefill)))
        self._next_d = itertools.cycle(range(len(self.decode)))
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.keepalive = keepalive
        self.max_in_flight = max_in_flight
        self.test_hooks = test_hooks
        # request id -> phase; at most max_in_flight entries (more are refused with 503)
        self.in_flight: dict[str, str] = {}
        self.counters: Counter[str] = Counter()
        self._session: ClientSession | None = None

    # -- lifecycle
    async def start(self, app: web.Application) -> None:
        self._session = ClientSession(
            connector=TCPConnector(limit=0, keepalive_timeout=self.keepalive),
            timeout=ClientTimeout(total=None, connect=self.connect_timeout,
                                  sock_read=self.read_timeout))

    async def stop(self, app: web.Application) -> None:
        if self._session is not None:
            await self._session.close()

    @property
    def session(self) -> ClientSession:
        assert self._session is not None, "router not started"
        return self._session

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20)
        for path in COMPLETION_PATHS:
            app.router.add_post(path, self.complete)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/router/status", self.status)
        app.on_startup.append(self.start)
        app.on_cleanup.append(self.stop)
        return app

    # -- helpers
    def _request_id(self, header: str | None) -> str:
        rid = _ID_OK.sub("", header or "")[:MAX_ID] or f"rtr-{uuid.uuid4().hex}"
        if rid in self.in_flight:
            rid = f"{rid[:MAX_ID - 9]}-{uuid.uuid4().hex[:8]}"
        return rid

    def _hold(self, request: web.Request) -> float:
        if not self.test_hooks:
            return 0.0
        try:
            return min(MAX_TEST_HOLD_S, max(0.0, float(request.headers.get(
                "X-Router-Test-Hold", "0"))))
        except ValueError:
            return 0.0

    async def _prefill(self, url: str, path: str, rid: str, body: dict[str, Any]
                       ) -> dict[str, Any] | web.Response:
        """P's answer: its JSON body, or a response to give the client as it is."""
        try:
            async with self.session.post(url + path, json=prefill_body(body),
                                         headers={"X-Request-Id": rid}) as up:
                raw = await up.read()
                if up.status != 200:
                    self.counters["prefill_refused"] += 1
                    log.warning("%s: prefill server %s answered %d", rid, url, up.status)
                    return web.Response(status=up.status, body=raw,
                                        content_type=up.content_type)
        except (ClientError, OSError, asyncio.TimeoutError) as e:
            self.counters["prefill_unreachable"] += 1
            raise RouterError(502, f"router: prefill server {url} unreachable: "
                                   f"{type(e).__name__}: {e}") from None
        try:
            answer = json.loads(raw)
        except ValueError:
            answer = None
        if not isinstance(answer, dict) or not isinstance(answer.get("kv_transfer_params"),
                                                           dict):
            self.counters["prefill_no_params"] += 1
            raise RouterError(502, f"router: prefill server {url} returned no "
                                   "kv_transfer_params (does it run a KV connector with "
                                   "kv_role kv_producer or kv_both?)")
        return answer

    # -- endpoints
    async def complete(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except ValueError:
            return error_response(400, "router: the request body is not JSON")
        if not isinstance(body, dict):
            return error_response(400, "router: the request body is not a JSON object")
        why = single_prompt_error(request.path, body)
        if why is not None:
            return error_response(400, f"router: {why}")
        if len(self.in_flight) >= self.max_in_flight:
            self.counters["refused_busy"] += 1
            return error_response(503, f"router: {self.max_in_flight} requests in flight "
                                       "already")
        rid = self._request_id(request.headers.get("X-Request-Id"))
        self.in_flight[rid] = "prefill"
        self.counters["requests"] += 1
        t0 = time.monotonic()
        try:
            p_url = self.prefill[next(self._next_p)]
            answer = await self._prefill(p_url, request.path, rid, body)
            if isinstance(answer, web.Response):
                return answer
            t_p = time.monotonic()
            self.in_flight[rid] = "handoff"
            hold = self._hold(request)
            if hold:
                await asyncio.sleep(hold)
            self.in_flight[rid] = "decode"
            d_url = self.decode[next(self._next_d)]
            out = await self._decode(request, rid, d_url,
                                     decode_body(body, answer["kv_transfer_params"]))
            log.info("%s: done (prefill %.0f ms on %s, total %.0f ms on %s)", rid,
                     (t_p - t0) * 1e3, p_url, (time.monotonic() - t0) * 1e3, d_url)
            return out
        except RouterError as e:
            log.warning("%s: %s", rid, e.message)
            return error_response(e.status, e.message)
        except (asyncio.CancelledError, ClientGone) as e:
            phase = self.in_flight.get(rid, "?")
            self.counters[f"disconnect_{phase}"] += 1
            log.info("%s: client disconnected during %s after %.0f ms; upstream request "
                     "cancelled", rid, phase, (time.monotonic() - t0) * 1e3)
            if isinstance(e, ClientGone):
                return e.response
            raise
        finally:
            self.in_flight.pop(rid, None)

    async def _decode(self, request: web.Request, rid: str, url: str,
                      body: dict[str, Any]) -> web.StreamResponse:
        stream = bool(body.get("stream"))
        out: web.StreamResponse | None = None
        try:
            async with self.session.post(url + request.path, json=body,
                                         headers={"X-Request-Id": rid}) as up:
                try:
                    if up.status != 200 or not stream:
                        raw = await up.read()
                        if up.status != 200:
                            self.counters["decode_refused"] += 1
                            log.warning("%s: decode server %s answered %d", rid, url,
                                        up.status)
                        else:
                            self.counters["completed"] += 1
                        return web.Response(status=up.status, body=raw,
                                            content_type=up.content_type)
                    out = web.StreamResponse(status=200, headers={
                        "Content-Type": up.headers.get("Content-Type", "text/event-stream"),
                        "Cache-Control": "no-cache"})
                    await out.prepare(request)
                    async for chunk in up.content.iter_any():
                        self.in_flight[rid] = "stream"
                        try:
                            await out.write(chunk)
                        except ConnectionResetError:
                            raise ClientGone(out) from None
                    await out.write_eof()
                    self.counters["completed"] += 1
                    return out
                except BaseException:
                    up.close()  # drop the upstream connection: its server aborts the request
                    raise
        except (ClientError, asyncio.TimeoutError) as e:
            self.counters["decode_unreachable" if out is None else "decode_lost"] += 1
            msg = f"router: decode server {url} unreachable: {type(e).__name__}: {e}" \
                if out is None else f"router: decode server {url} failed mid-stream: " \
                                    f"{type(e).__name__}: {e}"
            if out is None:
                raise RouterError(502, msg) from None
            log.warning("%s: %s", rid, msg)
            # the answer has started: end the event stream with an error event
            event = "data: " + json.dumps(error_json(502, msg)) + "\n\n"
            with contextlib.suppress(ConnectionResetError):  # the client may be gone too
                await out.write(event.encode())
                await out.write_eof()
            return out

    async def models(self, request: web.Request) -> web.StreamResponse:
        url = self.decode[0]
        try:
            async with self.session.get(url + "/v1/models") as up:
                return web.Response(status=up.status, body=await up.read(),
                                    content_type=up.content_type)
        except (ClientError, OSError, asyncio.TimeoutError) as e:
            return error_response(502, f"router: decode server {url} unreachable: "
                                       f"{type(e).__name__}: {e}")

    async def _ping(self, url: str) -> str | None:
        try:
            async with self.session.get(url + "/health",
                                        timeout=ClientTimeout(total=5.0)) as up:
                await up.read()
                return None if up.status == 200 else f"{url} answered {up.status}"
        except (ClientError, OSError, asyncio.TimeoutError) as e:
            return f"{url} unreachable: {type(e).__name__}"

    async def health(self, request: web.Request) -> web.StreamResponse:
        urls = [*self.prefill, *self.decode]
        problems = [p for p in await asyncio.gather(*(self._ping(u) for u in urls)) if p]
        if problems:
            return error_response(503, "router: " + "; ".join(problems))
        return web.json_response({"status": "ok", "prefill": self.prefill,
                                  "decode": self.decode})

    async def status(self, request: web.Request) -> web.StreamResponse:
        phases = Counter(self.in_flight.values())
        return web.json_response({"in_flight": dict(self.in_flight),
                                  "phases": {p: phases.get(p, 0) for p in PHASES},
                                  "counters": dict(self.counters)})


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    doc = (__doc__ or "").strip().splitlines()
    ap = argparse.ArgumentParser(
        description=doc[0], epilog="\n".join(doc[1:]),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1)")
    ap.add_argument("--port", type=int, default=8000, help="port to listen on (8000)")
    ap.add_argument("--prefill", action="append", required=True, metavar="URL",
                    help="a prefill server's base URL, e.g. http://127.0.0.1:8100 "
                         "(repeat for several; used in turn)")
    ap.add_argument("--decode", action="append", required=True, metavar="URL",
                    help="a decode server's base URL, e.g. http://127.0.0.1:8200 "
                         "(repeat for several; used in turn)")
    ap.add_argument("--connect-timeout", type=float, default=5.0, metavar="S",
                    help="seconds to connect to an upstream before a 502 (5)")
    ap.add_argument("--read-timeout", type=float, default=600.0, metavar="S",
                    help="seconds an upstream may stay silent (600; 0: no limit)")
    ap.add_argument("--keepalive", type=float, default=2.0, metavar="S",
                    help="seconds an idle upstream connection is kept; keep it below the "
                         "servers' keep-alive (uvicorn: 5) (2)")
    ap.add_argument("--max-in-flight", type=int, default=1024, metavar="N",
                    help="requests in flight at once; more are refused with 503 (1024)")
    ap.add_argument("--log-level", default="info",
                    choices=("debug", "info", "warning", "error"), help="(info)")
    ap.add_argument("--test-hooks", action="store_true",
                    help="TEST ONLY: honour the X-Router-Test-Hold header")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    router = Router(args.prefill, args.decode, connect_timeout=args.connect_timeout,
                    read_timeout=args.read_timeout or None, keepalive=args.keepalive,
                    max_in_flight=args.max_in_flight, test_hooks=args.test_hooks)
    log.info("routing %s:%d: prefill %s, decode %s%s", args.host, args.port,
             " ".join(router.prefill), " ".join(router.decode),
             " (test hooks on)" if args.test_hooks else "")
    web.run_app(router.app(), host=args.host, port=args.port, print=None, **SERVER_OPTIONS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
