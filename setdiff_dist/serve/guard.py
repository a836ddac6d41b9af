"""What keeps ``setdiff-serve`` safe to expose, at the HTTP boundary, before any request reaches
the routes of :mod:`setdiff_dist.serve.app`:

- :class:`Guard`, an ASGI middleware: the API key (OpenAI's ``Authorization: Bearer`` header)
  on every ``/v1`` route, and a request body of at most ``max_body_bytes`` that arrives with
  no pause longer than ``idle_s`` (413 and 408 otherwise, with OpenAI's error body). The body
  is read here, so a route never sees more than the limit.
- :func:`guarded_protocol`: uvicorn's HTTP protocol with a deadline for a request's headers
  (a connection that sends them slower is closed: a slowloris client cannot hold the server's
  file descriptors) and a cap on open connections (past it, a new one is closed at once).
- :func:`raise_open_files_limit`: the soft limit of open files raised to the hard one.

uvicorn's own limits are used beside these: ``timeout_keep_alive`` (an idle kept-alive
connection), ``limit_concurrency`` (503 past it) and ``timeout_graceful_shutdown`` (the drain's
deadline).
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
from typing import Optional

log = logging.getLogger("uvicorn.error")


def error_body(message: str, type_: str = "invalid_request_error", param=None, code=None):
    """OpenAI's error body."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


async def send_error(send, status: int, message: str, type_: str = "invalid_request_error",
                     code=None, headers=()) -> None:
    """Answer an ASGI request with OpenAI's error body (the request's body unread)."""
    body = json.dumps(error_body(message, type_, code=code)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close"), *headers]})
    await send({"type": "http.response.body", "body": body})


class Guard:
    """The API key and the body's size and pace (the module's doc), around ``app``."""

    def __init__(self, app, *, api_key: Optional[str] = None, max_body_bytes: int = 4 << 20,
                 idle_s: float = 30.0, on_refused=None):
        self.app, self.api_key = app, api_key
        self.max_body_bytes, self.idle_s = max_body_bytes, idle_s
        self.on_refused = on_refused or (lambda outcome: None)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.api_key is not None and scope["path"].startswith("/v1"):
            given = headers.get(b"authorization", b"").decode("latin-1")
            scheme, _, key = given.partition(" ")
            if scheme.lower() != "bearer" or not secrets.compare_digest(
                    key.strip().encode(), self.api_key.encode()):
                self.on_refused("unauthorized")
                return await send_error(
                    send, 401, "no valid API key: send the server's key (--api-key or "
                    "SETDIFF_API_KEY) as 'Authorization: Bearer KEY' (OpenAI clients: "
                    "api_key=KEY)", code="invalid_api_key",
                    headers=[(b"www-authenticate", b"Bearer")])
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            return await self._too_large(send)
        body, more = bytearray(), True
        while more:
            try:
                message = await asyncio.wait_for(receive(), self.idle_s)
            except asyncio.TimeoutError:
                self.on_refused("bad_request")
                return await send_error(send, 408, f"the request's body stalled for "
                                        f"{self.idle_s:g} s: send it whole",
                                        code="request_timeout")
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_body_bytes:
                return await self._too_large(send)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()  # (a disconnect, later)

        await self.app(scope, replay, send)

    async def _too_large(self, send):
        self.on_refused("bad_request")
        await send_error(send, 413, f"the request's body is larger than this server takes "
                         f"({self.max_body_bytes:,} bytes, --max-body-bytes): send fewer or "
                         "shorter prompts", code="request_too_large")


def guarded_protocol(base, header_timeout_s: float, max_connections: Optional[int]):
    """uvicorn's HTTP protocol class ``base`` with a deadline for each request's headers and a
    cap on open connections (the module's doc)."""

    class Guarded(base):
        _timer = None
        _waiting_on = None  # the request cycle that was current when the deadline was set

        def connection_made(self, transport):
            super().connection_made(transport)
            if max_connections is not None and len(self.connections) > max_connections:
                log.warning("refused a connection: %d are open (--max-connections)",
                            len(self.connections) - 1)
                transport.close()
                return
            self._arm()

        def data_received(self, data):
            if self._timer is None and (self.cycle is None or self.cycle.response_complete):
                self._arm()  # (the next request on a kept-alive connection)
            super().data_received(data)
            if self._timer is not None and self.cycle is not self._waiting_on:
                self._disarm()  # (its headers are complete: the request runs)

        def connection_lost(self, exc):
            self._disarm()
            super().connection_lost(exc)

        def _arm(self):
            self._disarm()
            self._waiting_on = self.cycle
            self._timer = self.loop.call_later(header_timeout_s, self._expired)

        def _disarm(self):
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def _expired(self):
            self._timer = None
            if self.cycle is self._waiting_on and not self.transport.is_closing():
                log.warning("closed a connection whose request headers took over %g s "
                            "(--timeout-header)", header_timeout_s)
                self.transport.close()

    Guarded.__name__ = f"Guarded{base.__name__}"
    return Guarded


def raise_open_files_limit() -> int:
    """Raise this process's soft limit of open files to its hard limit (each connection is a
    file); returns the limit now in force."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        want = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 16)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError):
            pass
    return soft
