"""The serve scheduler in this process, on a fake decoder (no model, no HTTP, no subprocess), as
nanochat tests its engine with a mock model: a full queue refuses, a running request that is
cancelled leaves its row to the next, the plans rank 0 sends make another rank step the same
rows, a step that raises fails its batch and serving goes on (or stops, when a tensor-parallel
rank is gone), an idle rank 0 sends heartbeats; and the typed messages on the way out: the
detokenized stream adds up to the final text, and the pipe's two ends answer by type."""

import asyncio
import multiprocessing
import threading
import time
from types import SimpleNamespace

import pytest

from setdiff_dist.serve import scheduler as scheduler_module
from setdiff_dist.serve.batch import Spec
from setdiff_dist.serve.messages import (
    Cancel,
    Count,
    Failed,
    Finished,
    Health,
    Reply,
    Status,
    Submit,
    Text,
    Tokens,
)
from setdiff_dist.serve.scheduler import Plan, QueueFull, Scheduler, follow
from setdiff_dist.serve.text import Detokenizer, TextStream

POISON = 7  # a prompt that starts with it fails alone in its step (as NaN logits do)


class ByteTokenizer:
    """Token ``t`` is the character ``chr(t)``; ``eos_id`` is never generated here."""

    eos_id, vocab_size = 0, 256

    def decode(self, ids):
        return "".join(chr(t) for t in ids)


class FakeDecoder:
    """What :class:`~setdiff_dist.serve.batch.ContinuousBatch` asks of a decoder, without a
    model: each step commits one token per row, the leftmost masked position, a letter from
    the row's first prompt token and the position (so that a row's tokens do not depend on
    the batch). ``steps`` records each step's rows (their prompts); ``raise_on`` makes a step
    raise; ``delay`` slows each step down (a request that runs long)."""

    decoding, batchable, causal_lm, device = "set", True, False, "cpu"

    def __init__(self, delay=0.0):
        self.model = SimpleNamespace(config=SimpleNamespace(num_layers=1))
        self.tok = ByteTokenizer()
        self.steps, self.delay = [], delay
        self.raise_on = None  # (an exception: the next step raises it, once)

    def generator(self, seed):
        return None

    def step(self, samples, cache, isolate=False):
        assert isolate  # (a server's rows fail alone)
        self.steps.append([tuple(s.tokens[:s.prompt_len]) for s in samples])
        if self.raise_on is not None:
            exc, self.raise_on = self.raise_on, None
            raise exc
        if self.delay:
            time.sleep(self.delay)
        for s in samples:
            if s.done:
                continue
            s.pending = []
            s.steps += 1
            if s.tokens[0] == POISON:
                s.fail("the logits are not a finite number")
                continue
            (pos,) = s.masked(1)
            s.commit([(pos, letter(s.tokens[0], pos))])
            s.done = s.finished()


def letter(first, pos):
    return ord("a") + (first + pos) % 26


def expected(prompt, n):
    return [letter(prompt[0], len(prompt) + j) for j in range(n)]


def spec(i, prompt=(40, 41), max_tokens=5, **kw):
    return Spec(id=str(i), prompt=tuple(prompt), max_tokens=max_tokens, window=4,
                threshold=0.3, greedy=True, temperature=1.0, top_p=1.0,
                repetition_penalty=1.0, seed=i, **kw)


class Recorder:
    """A listener per request id (its events in order) and a metrics sink (its calls)."""

    def __init__(self):
        self.events, self.calls = {}, []
        self.changed = threading.Condition()

    def listener(self, key):
        def got(ev):
            with self.changed:
                self.events.setdefault(key, []).append(ev)
                self.changed.notify_all()
        return got

    def wait(self, what, timeout=5.0):
        with self.changed:
            assert self.changed.wait_for(lambda: what(self.events), timeout), self.events

    def ended(self, *keys):
        return lambda ev: all(ev.get(k) and ev[k][-1].done for k in keys)

    # the metrics sink
    def __getattr__(self, name):
        if name in ("count", "rows", "step", "queued", "finished"):
            return lambda *args: self.calls.append((name, *args))
        raise AttributeError(name)

    def counted(self, name):
        return [c[1:] for c in self.calls if c[0] == name]


class Channel:
    """A :class:`~setdiff_dist.serve.scheduler.PlanChannel` in memory: rank 0's plans are kept
    (``fail``: a send raises it, as a broken gloo group does)."""

    def __init__(self):
        self.plans, self.fail = [], None
        self.sent = threading.Condition()

    def send(self, plan):
        if self.fail is not None:
            raise self.fail
        with self.sent:
            self.plans.append(plan)
            self.sent.notify_all()


@pytest.fixture
def made():
    """Schedulers made by a test, stopped after it (their threads never outlive it)."""
    out = []
    yield out
    for sched in out:
        if sched.thread is not None and sched.thread.is_alive():
            sched.abandon()
            sched.stop(timeout=5)
        assert sched.thread is None or not sched.thread.is_alive()


def make(made, rec, decoder=None, **kw):
    kw = {"max_batch": 4, "max_queue": 8, **kw}
    sched = Scheduler(decoder or FakeDecoder(), metrics=rec, **kw)
    made.append(sched)
    return sched


def test_a_full_queue_refuses_and_what_was_queued_runs(made):
    rec = Recorder()
    sched = make(made, rec, max_batch=1, max_queue=2)
    for i in range(2):
        sched.submit(spec(i), rec.listener(str(i)))
    with pytest.raises(QueueFull, match="2 requests are waiting .--max-queue 2"):
        sched.submit(spec(2), rec.listener("2"))
    assert sched.status() == Health(alive=True, fatal=None, running=0, waiting=2)
    assert rec.counted("rows")[-1] == (0, 2)  # (the gauges follow the queue)
    sched.start()
    rec.wait(rec.ended("0", "1"))
    for i in ("0", "1"):
        last = rec.events[i][-1]
        assert isinstance(last, Finished) and last.tokens == expected((40, 41), 5), last
        assert last.finish_reason == "length" and last.prompt_tokens == 2 and last.steps == 5
        assert last.largest_batch == 1 and last.text == last.full_text == ""  # (not text yet)
    assert "2" not in rec.events
    # (Metrics.finished counts "completed" itself: nothing failed or was cancelled)
    assert rec.counted("count") == [] and len(rec.counted("finished")) == 2
    assert len(rec.counted("queued")) == 2 and len(rec.counted("step")) == 10
    sched.stop(timeout=5)
    with pytest.raises(QueueFull, match="stopping"):
        sched.submit(spec(3), rec.listener("3"))
    with pytest.raises(QueueFull):
        make(made, rec, max_queue=0).submit(spec(4), rec.listener("4"))


def test_a_cancelled_request_leaves_its_row_to_the_next(made):
    rec = Recorder()
    dec = FakeDecoder(delay=0.002)
    sched = make(made, rec, decoder=dec, max_batch=1)
    sched.submit(spec(0, max_tokens=10 ** 6), rec.listener("0"))  # (runs for half an hour)
    sched.submit(spec(1, prompt=(50,)), rec.listener("1"))
    sched.submit(spec(2, prompt=(60,)), rec.listener("2"))
    sched.cancel("2")  # (still queued: it never runs)
    assert sched.waiting == 2 and rec.counted("count") == [("cancelled",)]
    sched.start()
    rec.wait(lambda ev: len(ev.get("0", [])) >= 3)  # (it streams its tokens)
    assert sched.status().running == 1 and sched.waiting == 1
    assert all(isinstance(e, Tokens) for e in rec.events["0"])
    got = [t for e in rec.events["0"] for t in e.ids]
    assert got == expected((40, 41), len(got))
    sched.cancel("0")
    rec.wait(rec.ended("1"))
    assert rec.events["1"][-1].tokens == expected((50,), 5)
    assert not rec.events["0"][-1].done  # (a cancelled request is told nothing more)
    assert "2" not in rec.events and all((60,) not in step for step in dec.steps)
    assert rec.counted("count") == [("cancelled",), ("cancelled",)]
    assert sched.status().running == 0


def test_rank_0s_plans_make_another_rank_step_the_same_rows(made):
    rec, channel = Recorder(), Channel()
    dec = FakeDecoder()
    sched = make(made, rec, decoder=dec, max_batch=2, channel=channel)
    specs = [spec(0, max_tokens=3), spec(1, prompt=(50,), max_tokens=6),
             spec(2, prompt=(60, 61, 62), max_tokens=2)]
    for s in specs:
        sched.submit(s, rec.listener(s.id))
    sched.start()
    rec.wait(rec.ended("0", "1", "2"))
    sched.stop(timeout=5)
    plans = list(channel.plans)
    assert plans[0] == Plan(admit=specs[:2])  # (two rows free: the third waits)
    assert [p.admit for p in plans if p.admit] == [specs[:2], specs[2:]]
    assert plans[-1] == Plan(stop=True) and not any(p.stop for p in plans[:-1])
    p0, p1, p2 = (s.prompt for s in specs)  # (the third joins when the first has left)
    assert dec.steps == [[p0, p1]] * 3 + [[p1, p2]] * 2 + [[p1]]
    # another rank applies the same plans to its shard: the same rows step together
    other = FakeDecoder()
    follow(other, SimpleNamespace(recv=iter(plans).__next__))
    assert other.steps == dec.steps
    for s in specs:
        assert rec.events[s.id][-1].tokens == expected(s.prompt, s.max_tokens)


def test_a_cancel_goes_out_in_the_next_plan(made):
    rec, channel = Recorder(), Channel()
    sched = make(made, rec, decoder=FakeDecoder(delay=0.002), channel=channel)
    sched.submit(spec(0, max_tokens=10 ** 6), rec.listener("0"))
    sched.start()
    rec.wait(lambda ev: "0" in ev)
    sched.cancel("0")
    with channel.sent:
        assert channel.sent.wait_for(lambda: any(p.cancel for p in channel.plans), 5)
    assert [p.cancel for p in channel.plans if p.cancel] == [["0"]]


def test_a_step_that_raises_fails_its_batch_and_serving_goes_on(made):
    rec, channel = Recorder(), Channel()
    dec = FakeDecoder(delay=0.002)
    sched = make(made, rec, decoder=dec, channel=channel)
    sched.submit(spec(0, max_tokens=10 ** 6), rec.listener("0"))
    sched.submit(spec(1, max_tokens=10 ** 6), rec.listener("1"))
    sched.start()
    rec.wait(lambda ev: "0" in ev and "1" in ev)
    dec.raise_on = ValueError("the forward broke")
    rec.wait(rec.ended("0", "1"))
    for i in ("0", "1"):
        assert rec.events[i][-1] == Failed("decoding failed: ValueError: the forward broke")
    # the batch was emptied (the other ranks' too: the next plan resets) and serving goes on
    sched.submit(spec(2, prompt=(50,)), rec.listener("2"))
    sched.submit(spec(3, prompt=(POISON, 50)), rec.listener("3"))  # (fails alone)
    rec.wait(rec.ended("2", "3"))
    assert rec.events["2"][-1].tokens == expected((50,), 5)
    assert rec.events["3"][-1] == Failed("decoding failed: the logits are not a finite number")
    assert sum(p.reset for p in channel.plans) == 1 and sched.status().alive
    assert rec.counted("count").count(("failed",)) == 1  # (3; a failed batch is not "alone")


def test_a_lost_tensor_parallel_rank_stops_decoding_for_good(made):
    rec, channel = Recorder(), Channel()
    dec = FakeDecoder(delay=0.002)
    sched = make(made, rec, decoder=dec, max_batch=1, channel=channel)
    told = []
    sched.on_fatal = told.append
    sched.submit(spec(0, max_tokens=10 ** 6), rec.listener("0"))
    sched.submit(spec(1), rec.listener("1"))  # (queued behind it)
    sched.start()
    rec.wait(lambda ev: "0" in ev)
    dec.raise_on = RuntimeError("[gloo] connection closed by peer")
    rec.wait(rec.ended("0", "1"))
    sched.thread.join(5)
    assert not sched.thread.is_alive()
    assert len(told) == 1 and "tensor-parallel rank failed" in told[0]
    for i in ("0", "1"):
        assert rec.events[i][-1] == Failed(told[0])
    assert sched.status() == Health(alive=False, fatal=told[0], running=0, waiting=0)
    with pytest.raises(QueueFull, match="tensor-parallel rank"):
        sched.submit(spec(2), rec.listener("2"))
    answered = []
    sched.score([[1, 2]], 1, lambda value, why: answered.append((value, why)))
    assert answered == [(None, told[0])]


def test_scoring_rides_the_plans_and_every_rank_scores_between_steps(made, monkeypatch):
    """echo / logprobs scoring is a forward of the model every tensor-parallel rank holds a
    shard of: rank 0 puts it in the next plan, every rank runs it before that plan's step, and
    a sequence that cannot be scored fails its own request while decoding goes on."""
    calls = []

    def fake_score(decoder, seqs, k):
        calls.append((decoder, seqs, k))
        if seqs == [[POISON]]:
            raise ValueError("cannot score this")
        return [[(-0.5, [(t, -0.25)] * k) for t in ids[1:]] for ids in seqs]

    monkeypatch.setattr(scheduler_module, "score_sequences", fake_score)
    rec, channel = Recorder(), Channel()
    dec = FakeDecoder(delay=0.002)
    sched = make(made, rec, decoder=dec, channel=channel)
    sched.submit(spec(0, max_tokens=30), rec.listener("0"))
    sched.start()
    rec.wait(lambda ev: "0" in ev)
    answers = []
    done = threading.Event()

    def answer(value, why):
        answers.append((value, why))
        if len(answers) == 2:
            done.set()

    sched.score([[1, 2, 3]], 2, answer)
    sched.score([[POISON]], 1, answer)
    assert done.wait(5)
    assert answers[0] == ([[(-0.5, [(2, -0.25)] * 2), (-0.5, [(3, -0.25)] * 2)]], None)
    assert answers[1][0] is None and "cannot score this" in answers[1][1]
    rec.wait(rec.ended("0"))  # (the request decoding beside them went on)
    assert rec.events["0"][-1].tokens == expected((40, 41), 30)
    sched.stop(timeout=5)
    plans = list(channel.plans)
    asked = [job for p in plans for job in p.score]
    assert asked == [([[1, 2, 3]], 2), ([[POISON]], 1)]
    assert all(c[0] is dec for c in calls)
    # another rank scores the same sequences between the same steps (its failure said on rank 0)
    calls.clear()
    other = FakeDecoder()
    follow(other, SimpleNamespace(recv=iter(plans).__next__))
    assert [(c[1], c[2]) for c in calls] == asked and all(c[0] is other for c in calls)
    assert other.steps == dec.steps


def test_an_idle_rank_0_sends_heartbeats_and_a_missed_one_stops_it(made, monkeypatch):
    monkeypatch.setattr(scheduler_module, "HEARTBEAT_S", 0.02)
    rec, channel = Recorder(), Channel()
    dec = FakeDecoder()
    sched = make(made, rec, decoder=dec, channel=channel)
    told = []
    sched.on_fatal = told.append
    sched.start()
    with channel.sent:
        assert channel.sent.wait_for(lambda: len(channel.plans) >= 5, 5)
    assert all(p == Plan() for p in channel.plans) and dec.steps == []  # (nothing to step)
    channel.fail = RuntimeError("Connection closed by peer")
    sched.thread.join(5)
    assert not sched.thread.is_alive() and told and "cannot be reached" in told[0]
    assert not sched.status().alive
    # without other ranks, an idle scheduler sends nothing and wakes for a request
    rec2 = Recorder()
    alone = make(made, rec2, decoder=FakeDecoder())
    alone.start()
    time.sleep(0.1)
    alone.submit(spec(0), rec2.listener("0"))
    rec2.wait(rec2.ended("0"))


def test_the_detokenized_stream_adds_up_to_the_final_text():
    """Token events become text where the text goes out: the pieces add up to the final text
    (cut before the stop string), what could start the stop string is held back, and a
    tokenizer that raises fails this request alone."""
    got, failed = [], []
    tok = ByteTokenizer()
    d = Detokenizer(TextStream(tok, stop=("XY",)), got.append, on_failed=failed.append)
    ids = [ord(c) for c in "hello XYZ"]
    d(Tokens(tuple(ids[:4])))
    d(Tokens(tuple(ids[4:6])))
    d(Tokens(tuple(ids[6:7])))  # ("hello X": the X is held back)
    # (each piece with the tokens committed since the last: the text lags what is held back)
    assert got == [Text("hel", tuple(ids[:4])), Text("lo", tuple(ids[4:6])),
                   Text(" ", tuple(ids[6:7]))]
    end = Finished("stop", ids, 2, 9, 1, 0.1, 0.01)
    d(end)
    assert got[-1].full_text == "hello " and got[-1].text == ""
    assert "".join(e.text for e in got) == got[-1].full_text and got[-1].steps == 9
    assert not failed

    class Broken(ByteTokenizer):
        def decode(self, ids):
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")

    got = []
    d = Detokenizer(TextStream(Broken()), got.append, on_failed=failed.append)
    d(Tokens((104,)))
    d(Tokens((105,)))  # (nothing more once it failed)
    assert len(got) == 1 and isinstance(got[0], Failed) and "UnicodeDecodeError" in got[0].error
    assert failed == [got[0].error]
    d(Failed("x"))
    assert len(got) == 1


def test_the_pipe_answers_by_type(made):
    """Both ends of the pipe over a real ``multiprocessing.Pipe`` in this process: a submit is
    answered, refused when the queue is full, its events come back as text, status and counts
    reach the scheduler and its metrics."""
    from setdiff_dist.serve.pipe import EngineClient, EngineHost

    rec = Recorder()
    sched = make(made, rec, max_batch=1, max_queue=1)
    here, there = multiprocessing.Pipe()
    host = EngineHost(sched, here)
    threading.Thread(target=host.serve, daemon=True).start()
    # the host's own answers, one message at a time
    there.send(Submit(0, spec(0), True))
    assert there.recv() == Reply(0)
    there.send(Submit(1, spec(1), True))
    refused = there.recv()
    assert refused.n == 1 and "--max-queue 1" in refused.error
    there.send(Status(2))
    assert there.recv() == Reply(2, Health(alive=True, fatal=None, running=0, waiting=1))
    there.send(Cancel("0"))
    there.send(Count("unauthorized"))
    there.send(Status(3))
    assert there.recv().value.waiting == 0
    assert rec.counted("count") == [("cancelled",), ("unauthorized",)]
    sched.start()
    client = EngineClient(there, ByteTokenizer())

    async def ask():
        client.attach(asyncio.get_running_loop())
        events = asyncio.Queue()
        await client.submit(spec(5, prompt=(50,), max_tokens=4), events.put_nowait)
        out = []
        while not out or not out[-1].done:
            out.append(await asyncio.wait_for(events.get(), 5))
        return out, await client.status()

    out, health = asyncio.run(ask())
    client.loop = None  # (closed: the end of the pipe below fails nothing more)
    there.close()  # (the host's reading ends)
    here.close()
    text = "".join(chr(t) for t in expected((50,), 4))
    assert all(isinstance(e, Text) for e in out[:-1]) and isinstance(out[-1], Finished)
    assert "".join(e.text for e in out) == out[-1].full_text == text
    assert health.alive and health.running == 0
