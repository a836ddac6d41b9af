"""The decoding thread of the server: a bounded queue of requests in front of the
:class:`~setdiff_dist.serve.batch.ContinuousBatch`, and the loop that admits, cancels and steps.

Between two steps the loop takes what the queue holds (up to the free rows of the batch) and
the cancellations that came in, makes them one :class:`Plan`, and applies it; under tensor
parallelism rank 0 first broadcasts the plan (:class:`PlanChannel`) and every other rank applies
the same plan to its own shard (:func:`follow`), so all ranks step the same batch. Each row's
new tokens and its end go back to the request that asked through the ``listener`` it gave, as
the events of :mod:`.messages` (token ids: the text is made where it goes out, :mod:`.text`);
what the metrics measure goes to a sink with :class:`~setdiff_dist.serve.metrics.Metrics`'s
calls (:class:`~setdiff_dist.serve.metrics.NoMetrics` when nothing measures).
"""

from __future__ import annotations

import collections
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable, Optional

from setdiff_dist.errors import collective_failed

from .batch import ContinuousBatch, Spec
from .messages import Failed, Finished, Health, Tokens
from .metrics import NoMetrics

HEARTBEAT_S = 1.0  # an idle rank 0 tells the other ranks it is alive this often


def rank_lost(exc: BaseException) -> str:
    """Why decoding (or scoring) cannot go on: another tensor-parallel rank's collective
    failed with ``exc``."""
    return f"a tensor-parallel rank failed or cannot be reached ({type(exc).__name__}: {exc})"


class QueueFull(Exception):
    """The queue of waiting requests is full (HTTP 429)."""


@dataclass
class Plan:
    """What every rank does before the next step: score these sequences (echo / logprobs),
    admit these specs, cancel these ids; or ``stop`` (the server is done)."""

    admit: list = field(default_factory=list)
    cancel: list = field(default_factory=list)
    stop: bool = False
    reset: bool = False  # a step failed on rank 0: every rank empties its batch first
    score: list = field(default_factory=list)  # [(sequences of token ids, k)]


class PlanChannel:
    """Rank 0's plans to the other tensor-parallel ranks, over a gloo group of its own (plans
    are small Python objects; this keeps them off NCCL and the model's streams)."""

    def __init__(self):
        import torch.distributed as dist

        self.dist = dist
        self.group = dist.new_group(backend="gloo")

    def send(self, plan: Plan) -> None:
        self.dist.broadcast_object_list([plan], src=0, group=self.group)

    def recv(self) -> Plan:
        box = [None]
        self.dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]


@dataclass
class Ticket:
    """A request waiting or running: its spec and who to tell."""

    spec: Spec
    listener: Callable[[object], None]
    streamed: bool = True  # told of new tokens every step (else only of the outcome)
    arrived: float = field(default_factory=time.monotonic)


class Scheduler:
    """The bounded queue and the decoding loop (:meth:`run`, in a thread of its own);
    ``metrics``: where what is measured goes (default: nowhere)."""

    def __init__(self, decoder, *, max_batch: int, max_queue: int, metrics=None,
                 channel: Optional[PlanChannel] = None):
        self.batch = ContinuousBatch(decoder)
        self.decoder, self.max_batch, self.max_queue = decoder, max_batch, max_queue
        self.metrics = metrics if metrics is not None else NoMetrics()
        self.channel = channel
        self._cond = threading.Condition()
        self._queue: collections.deque = collections.deque()
        self._cancels: set = set()
        self._tickets: dict = {}
        # scoring asked for (echo / logprobs): (seqs, k, on_done(result, error)), run by every
        # rank between two steps (it is a forward of the model each rank holds a shard of)
        self._scores: collections.deque = collections.deque()
        self._stopping = False
        self._reset = False
        self.thread: Optional[threading.Thread] = None
        self.fatal: Optional[str] = None  # why decoding stopped for good (a broken TP group)
        self.on_fatal: Optional[Callable[[str], None]] = None
        #: how a step's ``[(listener, event)]`` reach the listeners (default: called here)
        self.deliver: Callable[[list], None] = deliver_now

    # -- the HTTP side ----------------------------------------------------------------------------
    def submit(self, spec: Spec, listener: Callable[[object], None],
               streamed: bool = True) -> None:
        """Queue a request; raise :class:`QueueFull` if the queue holds ``max_queue`` already.
        ``listener`` gets :class:`~.messages.Tokens` after each step that adds to its committed
        prefix (when ``streamed``), and at the end :class:`~.messages.Finished` or
        :class:`~.messages.Failed`; through :attr:`deliver`, which hands each step's events
        over at once (the server's: one message to the HTTP process per step)."""
        with self._cond:
            if self._stopping or self.fatal:
                raise QueueFull(f"the server is stopping ({self.fatal or 'shutting down'})")
            if len(self._queue) >= self.max_queue:
                raise QueueFull(f"{len(self._queue)} requests are waiting (--max-queue "
                                f"{self.max_queue})")
            ticket = Ticket(spec, listener, streamed)
            self._queue.append(ticket)
            self._tickets[spec.id] = ticket
            self._gauges()
            self._cond.notify()

    def cancel(self, request_id: str, outcome: str = "cancelled") -> None:
        """The client went away (or its text could not be made: ``outcome`` "failed"): free its
        row (or its place in the queue) before the next step."""
        with self._cond:
            waiting = [t for t in self._queue if t.spec.id == request_id]
            if waiting:
                self._queue.remove(waiting[0])
                self._tickets.pop(request_id, None)
                self.metrics.count(outcome)
            elif request_id in self._tickets:
                self._cancels.add(request_id)
                if outcome != "cancelled":  # (its end is now: its row then leaves uncounted)
                    self._tickets.pop(request_id, None)
                    self.metrics.count(outcome)
            self._gauges()
            self._cond.notify()

    def score(self, seqs: list, k: int,
              on_done: Callable[[Optional[list], Optional[str]], None]) -> None:
        """Score each sequence of token ids between two steps (:func:`score_sequences`, on
        every tensor-parallel rank: the next plan carries it), then ``on_done(scores, None)``,
        or ``on_done(None, why)`` if it could not be done."""
        with self._cond:
            if self.fatal:
                on_done(None, self.fatal)
                return
            self._scores.append((seqs, k, on_done))
            self._cond.notify()

    def start(self) -> None:
        self.thread = threading.Thread(target=self.run, name="setdiff-decode", daemon=True)
        self.thread.start()

    def stop(self, timeout: Optional[float] = None) -> None:
        """Finish what is queued and running, then end the loop (and the other ranks')."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self.thread is not None:
            self.thread.join(timeout)

    def abandon(self) -> int:
        """Nobody can be told any more (the HTTP process is gone): cancel every request queued
        or running, before :meth:`stop`; returns how many there were."""
        with self._cond:
            waiting, self._queue = list(self._queue), collections.deque()
            for ticket in waiting:
                self._tickets.pop(ticket.spec.id, None)
            running = [row.spec.id for row in self.batch.rows]
            self._cancels.update(running)
            self._gauges()
            self._cond.notify()
        return len(waiting) + len(running)

    @property
    def waiting(self) -> int:
        return len(self._queue)

    def status(self) -> Health:
        """What ``GET /health`` reports."""
        return Health(self.alive, self.fatal, len(self.batch), self.waiting)

    # -- the decoding thread ----------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return self.fatal is None and (self.thread is None or self.thread.is_alive())

    def run(self) -> None:
        while True:
            plan, answers = self._next_plan()
            if plan is None:
                continue
            if self.channel is not None:
                try:
                    self.channel.send(plan)
                except Exception as exc:  # another rank died: nothing can decode any more
                    self._die(rank_lost(exc))
                    return
            if plan.stop:
                return
            try:
                self._score(plan, answers)
                self._apply(plan)
            except Exception as exc:
                if self.channel is not None and collective_failed(exc):
                    self._die(rank_lost(exc))
                    return
                # a failed step: fail the batch, keep serving
                traceback.print_exc(file=sys.stderr)
                self._fail_all(f"decoding failed: {type(exc).__name__}: {exc}")

    def _die(self, why: str) -> None:
        """Decoding cannot go on: fail what is queued and running, and tell the server."""
        print(f"setdiff-serve: {why}", file=sys.stderr, flush=True)
        with self._cond:
            self.fatal = why
            waiting, self._queue = list(self._queue), collections.deque()
            scores, self._scores = list(self._scores), collections.deque()
        for _, _, on_done in scores:
            on_done(None, why)
        self._fail_all(why)
        for ticket in waiting:
            self._tickets.pop(ticket.spec.id, None)
        self.deliver([(t.listener, Failed(why)) for t in waiting])
        if self.on_fatal is not None:
            self.on_fatal(why)

    def _next_plan(self) -> Optional[Plan]:
        with self._cond:
            idle = lambda: not (self._queue or self._cancels or len(self.batch)  # noqa: E731
                                or self._stopping or self._scores)
            if idle():
                self._cond.wait(HEARTBEAT_S if self.channel is not None else None)
                if idle():  # (a heartbeat for the other ranks, or a spurious wake-up)
                    return (Plan() if self.channel is not None else None), []
            scores, self._scores = list(self._scores), collections.deque()
            if self._stopping and not self._queue and not len(self.batch) and not scores:
                return Plan(stop=True), []
            room = self.max_batch - (len(self.batch) - len(self._cancels))
            admit = [self._queue.popleft().spec for _ in range(min(max(room, 0),
                                                                     len(self._queue)))]
            cancel, self._cancels = sorted(self._cancels), set()
            reset, self._reset = self._reset, False
            return Plan(admit=admit, cancel=cancel, reset=reset,
                        score=[(seqs, k) for seqs, k, _ in scores]), \
                [on_done for _, _, on_done in scores]

    def _score(self, plan: Plan, answers: list) -> None:
        """The plan's scoring, answered; a sequence that cannot be scored fails its request
        alone (a broken tensor-parallel group raises: nothing can go on)."""
        for i, ((seqs, k), on_done) in enumerate(zip(plan.score, answers)):
            try:
                result = score_sequences(self.decoder, seqs, k)
            except Exception as exc:
                why = f"{type(exc).__name__}: {exc}"
                if self.channel is not None and collective_failed(exc):
                    for unanswered in answers[i:]:
                        unanswered(None, rank_lost(exc))
                    raise
                on_done(None, why)
                continue
            on_done(result, None)

    def _apply(self, plan: Plan) -> None:
        for row in self.batch.cancel(plan.cancel):
            if self._tickets.pop(row.spec.id, None) is not None:  # (not one failed alone)
                self.metrics.count("cancelled")
        rows, refused = self.batch.admit(plan.admit)
        for row in rows:
            ticket = self._tickets.get(row.spec.id)
            if ticket is not None:
                self.metrics.queued(row.joined - ticket.arrived)
        self._fail(refused)
        self._gauges()
        if not len(self.batch):
            return
        start = time.perf_counter()
        running = list(self.batch.rows)
        finished = self.batch.step()  # (raising: its forward is every row's, run fails all)
        self.metrics.step(len(running), time.perf_counter() - start)
        outbox = []
        for row in running:
            ticket = self._tickets.get(row.spec.id)
            if ticket is None or not (ticket.streamed or row in finished):
                continue  # (nothing is sent for a request that is not streamed, until done)
            why, event = row.sample.error, None  # (a row the decoder failed has finished)
            if why is None:
                try:
                    if row in finished:
                        event = self._outcome(row, ticket)
                    elif ids := row.new_prefix():
                        event = Tokens(tuple(ids))
                except Exception as exc:  # noqa: BLE001 (this row's failure: the others go on)
                    traceback.print_exc(file=sys.stderr)
                    why = f"{type(exc).__name__}: {exc}"
                    if row not in finished:  # (it leaves the batch before the next step)
                        with self._cond:
                            self._cancels.add(row.spec.id)
            if why is not None:
                event = self._failed(row.spec.id, f"decoding failed: {why}")
            if event is None:
                continue
            if event.done:
                self._tickets.pop(row.spec.id, None)
            outbox.append((ticket.listener, event))
        if outbox:
            self.deliver(outbox)
        self._gauges()

    def _fail(self, refused: list) -> None:
        """Requests that could not join the batch: each gets its error; nothing else does."""
        outbox = []
        for spec, why in refused:
            ticket = self._tickets.pop(spec.id, None)
            event = self._failed(spec.id, why, count=ticket is not None)
            if ticket is not None:
                outbox.append((ticket.listener, event))
        if outbox:
            self.deliver(outbox)

    def _failed(self, request_id: str, why: str, count: bool = True) -> Failed:
        """The end of a request that failed alone: said in the log, counted (``count``: it
        still has a client), its event."""
        print(f"setdiff-serve: request {request_id} failed alone: {why}", file=sys.stderr,
              flush=True)
        if count:
            self.metrics.count("failed")
        return Failed(why)

    def _outcome(self, row, ticket: Ticket) -> Finished:
        now = time.monotonic()
        out = Finished(finish_reason=row.finish_reason, tokens=row.sample.output(),
                       prompt_tokens=len(row.spec.prompt), steps=row.sample.steps,
                       largest_batch=row.largest_batch, seconds=now - ticket.arrived,
                       time_to_first_token=(row.first_token or now) - ticket.arrived)
        self.metrics.finished(out)
        return out

    def _fail_all(self, message: str) -> None:
        rows, self.batch = self.batch.rows, ContinuousBatch(self.decoder)
        self._reset = True  # (the other ranks empty theirs with the next plan)
        tickets = [self._tickets.pop(row.spec.id, None) for row in rows]
        self.deliver([(t.listener, Failed(message)) for t in tickets if t is not None])
        self._gauges()

    def _gauges(self) -> None:
        self.metrics.rows(len(self.batch), len(self._queue))


def deliver_now(outbox: list) -> None:
    for listener, event in outbox:
        listener(event)


def follow(decoder, channel: PlanChannel) -> None:
    """A tensor-parallel rank other than 0: apply rank 0's plans to this rank's shard until it
    says stop."""
    batch = ContinuousBatch(decoder)
    while True:
        plan = channel.recv()
        if plan.stop:
            return
        if plan.reset:
            batch = ContinuousBatch(decoder)
        for seqs, k in plan.score:  # (rank 0 answers; a failure is its request's, said there)
            try:
                score_sequences(decoder, seqs, k)
            except Exception as exc:
                if collective_failed(exc):
                    raise
        batch.cancel(plan.cancel)
        batch.admit(plan.admit)  # (a request refused here is refused on rank 0 alike)
        try:
            batch.step()
        except Exception as exc:
            if collective_failed(exc):
                raise
            traceback.print_exc(file=sys.stderr)  # (rank 0 failed the same step: a reset comes)


def score_sequences(decoder, seqs: list, k: int) -> list:
    """For each sequence of token ids, each position's ``(log p, top k [(id, log p)])`` after
    the first (:func:`setdiff_dist.objective.token_logprobs`; a causal checkpoint's decoder
    scores as the causal LM)."""
    from setdiff_dist.objective import token_logprobs

    return [token_logprobs(decoder.model, decoder.causal_lm, list(ids), k,
                           decoder.tok.vocab_size) for ids in seqs]
