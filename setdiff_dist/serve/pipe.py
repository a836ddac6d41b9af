"""The pipe between the decoding process and the HTTP process (:mod:`.http_process`), and its
two ends: :class:`EngineHost` on rank 0, beside the
:class:`~setdiff_dist.serve.scheduler.Scheduler`, and :class:`EngineClient` in the HTTP
process, which the routes call as they would the scheduler.

Over one ``multiprocessing.Pipe`` go the classes of :mod:`.messages`, each end dispatching on
the class of what it receives (its ``_handlers`` table):

- HTTP -> engine: :class:`Submit` (answered :class:`Reply`, with ``error`` when the queue is
  full: a 429), :class:`Cancel`, :class:`Count` (a request the HTTP side answered itself, for
  the metrics), :class:`Status`, :class:`Score` (echo / logprobs), :class:`Exposition`;
- engine -> HTTP: :class:`Events`, one message per decoding step (what
  :attr:`Scheduler.deliver` hands over: token ids, made text here by each request's
  :class:`~setdiff_dist.serve.text.Detokenizer`), :class:`Reply`, :class:`Fatal`.

Either side that finds the pipe closed knows the other is gone: the HTTP process then fails
what is in flight and stops (exit 1); rank 0 ends its scheduler.
"""

from __future__ import annotations

import itertools
import threading
from typing import Callable, Optional

from .messages import (
    Cancel,
    Count,
    Events,
    Exposition,
    Failed,
    Fatal,
    Health,
    Reply,
    Score,
    Status,
    Submit,
)
from .scheduler import QueueFull
from .text import Detokenizer, TextStream

REPLY_TIMEOUT_S = 60.0  # a submit or metrics query the decoding process never answers
STATUS_TIMEOUT_S = 5.0  # GET /health: an engine that does not answer this fast is unhealthy


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
    thread) and sends it each step's events; the metrics are the scheduler's."""

    def __init__(self, scheduler, conn):
        super().__init__(conn)
        self.scheduler, self.metrics = scheduler, scheduler.metrics
        scheduler.deliver = self._deliver
        self._handlers = {Submit: self._submit, Cancel: self._cancel, Count: self._count,
                          Status: self._status, Score: self._score,
                          Exposition: self._exposition}

    def _deliver(self, outbox: list) -> None:
        self.send(Events([(listener.key, event) for listener, event in outbox]))

    def serve(self) -> None:
        """Answer the HTTP process until it closes the pipe."""
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                return
            self._handlers[type(message)](message)

    def _submit(self, m: Submit) -> None:
        try:
            self.scheduler.submit(m.spec, Remote(m.spec.id), m.streamed)
            self.send(Reply(m.n))
        except QueueFull as exc:
            self.send(Reply(m.n, error=str(exc)))

    def _cancel(self, m: Cancel) -> None:
        self.scheduler.cancel(m.id, m.outcome)

    def _count(self, m: Count) -> None:
        self.metrics.count(m.outcome)

    def _status(self, m: Status) -> None:
        self.send(Reply(m.n, self.scheduler.status()))

    def _score(self, m: Score) -> None:
        self.scheduler.score(m.seqs, m.k,
                             lambda value, error: self.send(Reply(m.n, value, error)))

    def _exposition(self, m: Exposition) -> None:
        self.send(Reply(m.n, self.metrics.exposition()))


class EngineClient(_PipeEnd):
    """The scheduler as the HTTP process sees it (what :class:`~setdiff_dist.serve.app.Service`
    calls): :meth:`submit` raises :class:`QueueFull` as the scheduler does; each step's events
    reach the listeners in the event loop, one call per step, detokenized on the way (with
    ``tokenizer``). Every round trip to the decoding process (:meth:`submit`, :meth:`status`,
    :meth:`exposition`) is awaited: the event loop goes on serving while the engine is slow or
    stopped."""

    def __init__(self, conn, tokenizer):
        super().__init__(conn)
        self.tokenizer = tokenizer
        self._numbers = itertools.count()
        self._replies: dict = {}  # number -> the asyncio future of its answer
        self._listeners: dict = {}  # request id -> its Detokenizer
        self.loop = None
        self.fatal: Optional[str] = None
        self.on_fatal: Optional[Callable[[str], None]] = None
        self._handlers = {Events: self._events, Reply: self._reply, Fatal: self._fatal}

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
        self._listeners[spec.id] = Detokenizer(
            TextStream(self.tokenizer, spec.stop), listener,
            on_failed=lambda why: self._failed(spec.id), request_id=spec.id)
        try:
            refused = (await self._call(lambda n: Submit(n, spec, streamed))).error
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
        self.send(Cancel(request_id))

    def _failed(self, request_id: str) -> None:
        """Its text could not be made (:class:`Detokenizer`): its row leaves, counted failed."""
        self._listeners.pop(request_id, None)
        self.send(Cancel(request_id, "failed"))

    def count(self, outcome: str) -> None:
        self.send(Count(outcome))

    async def status(self) -> Health:
        if self.fatal:
            return Health(alive=False, fatal=self.fatal, running=0, waiting=0)
        return (await self._call(Status, timeout=STATUS_TIMEOUT_S)).value

    async def exposition(self) -> tuple:
        return (await self._call(Exposition)).value

    async def score(self, seqs: list, k: int) -> list:
        """Token log-probabilities of each sequence of ids (:meth:`Scheduler.score`), computed
        on the decoding thread between steps; raises ``RuntimeError`` with why it could not."""
        reply = await self._call(lambda n: Score(n, seqs, k))
        if reply.error:
            raise RuntimeError(reply.error)
        return reply.value

    # -- the pipe ---------------------------------------------------------------------------------
    async def _call(self, message: Callable[[int], object], timeout: float = REPLY_TIMEOUT_S
                    ) -> Reply:
        """Send ``message(n)``, a request numbered ``n``, and await its :class:`Reply`."""
        import asyncio

        n = next(self._numbers)
        answer = self.loop.create_future()
        self._replies[n] = answer
        self.send(message(n))
        try:
            return await asyncio.wait_for(answer, timeout)
        except asyncio.TimeoutError:
            raise RuntimeError(f"the decoding process did not answer in {timeout:g} s") \
                from None
        finally:
            self._replies.pop(n, None)

    def _read(self) -> None:
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                self._lost(self.fatal or "the decoding process ended")
                return
            self._handlers[type(message)](message)

    # (on the reading thread: what touches the listeners and futures runs in the event loop)
    def _events(self, m: Events) -> None:
        self.loop.call_soon_threadsafe(self._dispatch, m.items)

    def _reply(self, m: Reply) -> None:
        self.loop.call_soon_threadsafe(self._answer, m)

    def _fatal(self, m: Fatal) -> None:
        self.fatal = m.why

    def _answer(self, reply: Reply) -> None:
        answer = self._replies.pop(reply.n, None)
        if answer is not None and not answer.done():
            answer.set_result(reply)

    def _dispatch(self, events: list) -> None:
        for key, event in events:
            listener = (self._listeners.pop(key, None) if event.done
                        else self._listeners.get(key))
            if listener is not None:
                listener(event)

    def _lost(self, why: str) -> None:
        self.fatal = why

        def fail_all():
            for answer in list(self._replies.values()):
                if not answer.done():
                    answer.set_exception(RuntimeError(f"the decoding process ended: {why}"))
            self._dispatch([(key, Failed(why)) for key in list(self._listeners)])
        if self.loop is not None:
            self.loop.call_soon_threadsafe(fail_all)
        if self.on_fatal is not None:
            self.on_fatal(why)
