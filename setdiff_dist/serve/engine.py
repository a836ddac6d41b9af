"""The decoding and the HTTP server in two processes, as a production server splits them (vLLM's
engine core): rank 0 decodes (the :class:`~setdiff_dist.serve.scheduler.Scheduler`'s thread),
and a process it spawns runs uvicorn. In one process they would share one GIL: at 16 streaming
clients on 2 CPUs the event loop's work stalled the decoding thread, which then reached about
75% of what the engine decodes alone.

Over one pipe (``multiprocessing.Pipe``):

- HTTP -> engine: ``("submit", n, spec, streamed)`` (answered ``("reply", n, None)``, or the
  :class:`QueueFull` message: a 429), ``("cancel", id)``, ``("count", outcome)`` (a request the
  HTTP side answered itself, for the metrics), ``("status", n)``, ``("metrics", n)``;
- engine -> HTTP: ``("events", [(id, event), ...])``, one message per decoding step (what
  :attr:`Scheduler.deliver` hands over), ``("reply", n, value)``, ``("fatal", why)``.

Either side that finds the pipe closed knows the other is gone: the HTTP process then fails
what is in flight and stops (exit 1); rank 0 ends its scheduler.
"""

from __future__ import annotations

import itertools
import os
import signal
import sys
import threading
from typing import Callable, Optional

from .scheduler import QueueFull

REPLY_TIMEOUT_S = 60.0  # a submit or metrics query the decoding process never answers
STATUS_TIMEOUT_S = 5.0  # GET /health: an engine that does not answer this fast is unhealthy


class ModelView:
    """What the HTTP process needs of the model (no weights): its config, tokenizer, how it
    decodes and its context; :meth:`settings` as :meth:`setdiff_dist.api.Model.settings`."""

    def __init__(self, model):
        self.config, self.tokenizer = model.config, model.tokenizer
        self.decoding, self.context = model.decoding, model.context

    def settings(self, preset: Optional[str] = None, **flags) -> dict:
        from setdiff_dist.inference.settings import decode_settings

        return decode_settings(self.config, preset, **flags)


class Remote:
    """A listener that lives in the HTTP process: the engine sends its events there by id."""

    __slots__ = ("key",)

    def __init__(self, key: str):
        self.key = key


class _PipeEnd:
    """One end of the pipe: :meth:`send` from any thread; a send to a process that is gone is
    dropped (the reader of this end finds the pipe closed and ends what depends on it)."""

    def __init__(self, conn):
        self.conn = conn
        self._lock = threading.Lock()

    def send(self, message) -> None:
        with self._lock:
            try:
                self.conn.send(message)
            except (OSError, EOFError, BrokenPipeError):
                pass


class EngineHost(_PipeEnd):
    """Rank 0's side of the pipe: serves the HTTP process's requests from :meth:`serve` (a
    thread) and sends it each step's events."""

    def __init__(self, scheduler, conn, metrics=None):
        super().__init__(conn)
        self.scheduler, self.metrics = scheduler, metrics
        scheduler.deliver = self._deliver

    def _deliver(self, outbox: list) -> None:
        self.send(("events", [(listener.key, event) for listener, event in outbox]))

    def serve(self) -> None:
        """Answer the HTTP process until it closes the pipe."""
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                return
            kind = message[0]
            if kind == "submit":
                _, n, spec, streamed = message
                try:
                    self.scheduler.submit(spec, Remote(spec.id), streamed)
                    self.send(("reply", n, None))
                except QueueFull as exc:
                    self.send(("reply", n, str(exc)))
            elif kind == "cancel":
                self.scheduler.cancel(message[1])
            elif kind == "count":
                if self.metrics is not None:
                    self.metrics.count(message[1])
            elif kind == "status":
                self.send(("reply", message[1], self.scheduler.status()))
            elif kind == "score":  # (echo / logprobs: token log-probabilities of sequences)
                _, n, seqs, k = message
                self.scheduler.call(
                    lambda seqs=seqs, k=k: self.scheduler.score(seqs, k),
                    lambda value, error, n=n: self.send(
                        ("reply", n, {"error": error} if error else {"scores": value})))
            elif kind == "metrics":
                self.send(("reply", message[1], self.metrics.exposition()))


class EngineClient(_PipeEnd):
    """The scheduler as the HTTP process sees it (what :class:`~setdiff_dist.serve.app.Service`
    calls): :meth:`submit` raises :class:`QueueFull` as the scheduler does; each step's events
    reach the listeners in the event loop, one call per step. Every round trip to the decoding
    process (:meth:`submit`, :meth:`status`, :meth:`exposition`) is awaited: the event loop
    goes on serving while the engine is slow or stopped."""

    def __init__(self, conn):
        super().__init__(conn)
        self._numbers = itertools.count()
        self._replies: dict = {}  # number -> the asyncio future of its answer
        self._listeners: dict = {}
        self.loop = None
        self.fatal: Optional[str] = None
        self.on_fatal: Optional[Callable[[str], None]] = None

    @property
    def alive(self) -> bool:
        return self.fatal is None

    def attach(self, loop) -> None:
        """Start reading the engine's messages; events go to listeners in ``loop``."""
        self.loop = loop
        threading.Thread(target=self._read, name="setdiff-engine-link", daemon=True).start()

    # -- the Service's calls (in the event loop) --------------------------------------------------
    async def submit(self, spec, listener, streamed: bool = True) -> None:
        if self.fatal:
            raise QueueFull(f"the server cannot decode: {self.fatal}")
        self._listeners[spec.id] = listener
        try:
            refused = await self._call("submit", spec, streamed)
        except RuntimeError as exc:
            refused = str(exc)
        except BaseException:
            self._listeners.pop(spec.id, None)
            raise
        if refused is not None:
            self._listeners.pop(spec.id, None)
            raise QueueFull(refused)

    def cancel(self, request_id: str) -> None:
        self._listeners.pop(request_id, None)
        self.send(("cancel", request_id))

    def count(self, outcome: str) -> None:
        self.send(("count", outcome))

    async def status(self) -> dict:
        if self.fatal:
            return {"alive": False, "fatal": self.fatal, "running": 0, "waiting": 0}
        return await self._call("status", timeout=STATUS_TIMEOUT_S)

    async def exposition(self) -> tuple:
        return await self._call("metrics")

    async def score(self, seqs: list, k: int) -> list:
        """Token log-probabilities of each sequence of ids (:meth:`Scheduler.score`), computed
        on the decoding thread between steps; raises ``RuntimeError`` with why it could not."""
        out = await self._call("score", seqs, k)
        if "error" in out:
            raise RuntimeError(out["error"])
        return out["scores"]

    # -- the pipe ---------------------------------------------------------------------------------
    async def _call(self, kind: str, *args, timeout: float = REPLY_TIMEOUT_S):
        import asyncio

        n = next(self._numbers)
        answer = self.loop.create_future()
        self._replies[n] = answer
        self.send((kind, n, *args))
        try:
            return await asyncio.wait_for(answer, timeout)
        except asyncio.TimeoutError:
            raise RuntimeError(f"the decoding process did not answer in {timeout:g} s") \
                from None
        finally:
            self._replies.pop(n, None)

    def _answer(self, n, value) -> None:
        answer = self._replies.pop(n, None)
        if answer is not None and not answer.done():
            answer.set_result(value)

    def _read(self) -> None:
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                self._lost(self.fatal or "the decoding process ended")
                return
            kind = message[0]
            if kind == "events":
                self.loop.call_soon_threadsafe(self._dispatch, message[1])
            elif kind == "reply":
                self.loop.call_soon_threadsafe(self._answer, message[1], message[2])
            elif kind == "fatal":
                self.fatal = message[1]

    def _dispatch(self, events: list) -> None:
        for key, event in events:
            listener = (self._listeners.pop(key, None) if event.get("done")
                        else self._listeners.get(key))
            if listener is not None:
                listener(event)

    def _lost(self, why: str) -> None:
        self.fatal = why

        def fail_all():
            for answer in list(self._replies.values()):
                if not answer.done():
                    answer.set_exception(RuntimeError(f"the decoding process ended: {why}"))
            self._dispatch([(key, {"done": True, "error": why}) for key in list(self._listeners)])
        if self.loop is not None:
            self.loop.call_soon_threadsafe(fail_all)
        if self.on_fatal is not None:
            self.on_fatal(why)


def http_main(conn, view: ModelView, name: str, options: dict) -> None:
    """The HTTP process: uvicorn serving :func:`~setdiff_dist.serve.app.create_app` against
    the decoding process at the other end of ``conn``, behind :mod:`.guard`. Exits 0 after a
    drain (SIGTERM or SIGINT: stop taking connections, finish every request taken, for at most
    ``options["shutdown_timeout"]`` seconds: then what is left is cancelled), 1 when the
    decoding process is gone, 2 when it cannot listen."""
    import contextlib

    import uvicorn
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    from setdiff_dist.processes import die_with_parent

    from .app import Limits, Service, create_app
    from .guard import Guard, guarded_protocol, raise_open_files_limit

    os.setsid()  # (a terminal's Ctrl-C goes to rank 0 alone, which passes it on once)
    die_with_parent()
    raise_open_files_limit()
    client = EngineClient(conn)
    service = Service(view, name, client, client,
                      Limits(options["max_tokens"], options["max_prompts"]),
                      chat_template=options.get("chat_template"))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        import asyncio

        client.attach(asyncio.get_running_loop())
        yield

    app = Guard(create_app(service, lifespan=lifespan, strict=options.get("strict", False)),
                api_key=options["api_key"],
                max_body_bytes=options["max_body_bytes"], idle_s=options["timeout_idle"],
                on_refused=client.count)
    config = uvicorn.Config(app, host=options["host"], port=options["port"],
                            log_level=options["log_level"], lifespan="on",
                            http=guarded_protocol(AutoHTTPProtocol, options["timeout_header"],
                                                  options["max_connections"]),
                            timeout_keep_alive=options["timeout_keep_alive"],
                            timeout_graceful_shutdown=options["shutdown_timeout"])
    server = uvicorn.Server(config)

    def stop(why: str) -> None:
        server.should_exit = True

    client.on_fatal = stop
    _announce_when_ready(server, options.get("ready_file"))
    # uvicorn drains on either signal, then raises it again under the handler it found: these
    # no-ops, so that a drained server exits 0
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    signal.signal(signal.SIGINT, lambda signum, frame: None)
    server.run()
    conn.close()
    sys.exit(2 if not server.started else 1 if client.fatal else 0)


def _announce_when_ready(server, path: Optional[str]) -> None:
    """Once uvicorn listens: say where, with the port it bound (``--port 0`` takes any free
    one: the command line's 0 is not where to connect), and write ``host:port`` to ``path``
    when given (``--ready-file``, for tests and scripts)."""
    import time

    def watch():
        while not server.started and not server.should_exit:
            time.sleep(0.05)
        if server.started:
            sock = server.servers[0].sockets[0].getsockname()
            print(f"setdiff-serve: listening on http://{sock[0]}:{sock[1]}/v1", file=sys.stderr,
                  flush=True)
            if path:
                tmp = f"{path}.tmp"
                with open(tmp, "w") as f:
                    f.write(f"{sock[0]}:{sock[1]}\n")
                os.replace(tmp, path)

    threading.Thread(target=watch, daemon=True).start()
