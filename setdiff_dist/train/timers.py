"""Where a training step's time goes: phase timers, per-rank step times, and profiler traces.

A step is split into exclusive phases, each timed on every rank (a phase nested in another is
taken out of its parent, so the phases of a step add up to its time):

- ``data_wait``: waiting for the next batch, moving it to the device, and counting its target
  tokens over the data-parallel ranks;
- ``forward``, ``backward``: the micro-batches' forward and backward passes (under pipeline
  parallelism megatron's schedule interleaves them: ``backward`` is the rest of the schedule,
  with its point-to-point waits and bubble);
- ``grad_reduce``: the exposed gradient reduction, the time the host spends in DeepSpeed's
  reduction calls (the buckets reduced from the backward hooks and what is left after the
  backward); on a GPU with ``zero.overlap_comm`` a bucket's reduction runs on a side stream, so
  only what the last bucket keeps waiting shows;
- ``optimizer``: the optimizer step (with ZeRO's parameter all-gather where it is not
  overlapped), and the weights' EMA;
- ``param_gather``: the exposed part of the overlapped parameter gather
  (``zero.overlap_param_gather``, :mod:`setdiff_dist.train.param_gather`): the forward's waits
  for buckets still on the wire;
- ``checkpoint`` and ``eval``: between steps, not part of any step's time.

Stragglers (:class:`Stragglers`): a rank whose forward time per step is above its pipeline
stage's median by more than ``train.straggler_margin`` for ``train.straggler_intervals`` log
intervals in a row is named. The forward is the phase to compare: every rank of a stage does the
same work there and, without tensor parallelism, waits on no other rank (the data-parallel
collectives, where a fast rank waits for a slow one, lie in the other phases, which are equal on
every rank of a synchronous step: step times cannot tell the slow rank from the waiting ones).

The timers never synchronize the device inside a step (a synchronize at a phase boundary would
make the optimizer phase wait for the parameter broadcasts it has just launched, which the next
forward is meant to overlap). On a GPU each boundary records a CUDA event on the current stream
(:class:`DeviceClock`), and the events are read only when the timers report, at a log
interval, after one wait for the last of them; on the CPU the host's clock is read
(:class:`WallClock`). A phase's time is thus the device's time between its boundaries on the
compute stream: work that overlaps on another stream shows only where the compute stream
waits for it. Training time, for tokens/s and MFU, is the sum of the steps' times: evaluation
and checkpoints are left out.
"""

from __future__ import annotations

import contextlib
import os
import socket
import statistics
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist

from setdiff_dist.checkpoint.format import PROFILE, trace_file
from setdiff_dist.progress import progress

STEP_PHASES = ("data_wait", "forward", "backward", "grad_reduce", "optimizer", "param_gather")
PHASES = STEP_PHASES + ("checkpoint", "eval")


class Stragglers:
    """The straggler watch over the log intervals (see the module's docstring). ``floor_s``:
    a forward slower than the median by less than this per step is never named (timer noise on
    tiny models)."""

    def __init__(self, margin: float = 0.3, intervals: int = 3, floor_s: float = 0.005):
        self.margin, self.intervals, self.floor = margin, intervals, floor_s
        self.count: dict[int, int] = {}  # rank -> intervals in a row over the margin
        self.named: set[int] = set()

    def update(self, forward: list[float], stage: list[int]) -> dict:
        """One interval's forward time per step of each rank and each rank's pipeline stage:
        the record fields (``forward_ratio_max``, its rank, ``stragglers``) and the ranks named
        (``new``) and cleared (``cleared``) with this interval."""
        ratios = []
        for r, t in enumerate(forward):
            peers = [forward[q] for q in range(len(forward)) if stage[q] == stage[r]]
            median = statistics.median(peers)
            ratios.append(t / median if median > 0 else 1.0)
            over = t > median * (1 + self.margin) and t - median > self.floor
            self.count[r] = self.count.get(r, 0) + 1 if over else 0
        now = {r for r, c in self.count.items() if c >= self.intervals}
        new, cleared = sorted(now - self.named), sorted(self.named - now)
        self.named = now
        worst = max(range(len(ratios)), key=ratios.__getitem__)
        return {"forward_ratio_max": ratios[worst], "forward_slowest_rank": worst,
                "stragglers": sorted(now), "new": new, "cleared": cleared, "ratios": ratios}


class WallClock:
    """The host's clock: a mark is ``time.perf_counter()``, read at once."""

    def mark(self):
        return time.perf_counter()

    def settle(self, last) -> None:
        """Wait until every mark up to ``last`` can be read (nothing to wait for here)."""

    @staticmethod
    def seconds(a, b) -> float:
        return b - a


class DeviceClock:
    """The device's clock: a mark is a CUDA event recorded on the current stream (no wait); the
    marks are read after :meth:`settle` has waited for the last one, which the timers do only
    when they report. ``event`` and ``synchronize`` are torch's (tests give their own to see
    where the clock waits)."""

    def __init__(self, event=None, synchronize=None):
        self.event = event or (lambda: torch.cuda.Event(enable_timing=True))
        self.synchronize = synchronize or (lambda ev: ev.synchronize())

    def mark(self):
        ev = self.event()
        ev.record()
        return ev

    def settle(self, last) -> None:
        self.synchronize(last)

    @staticmethod
    def seconds(a, b) -> float:
        return a.elapsed_time(b) / 1000.0


class PhaseTimers:
    """The phase and step timers (the module's doc); ``clock``: :class:`DeviceClock` on a GPU,
    else :class:`WallClock`. Each phase leaves a span of two marks (and the span it is nested
    in); the spans are turned into seconds when the timers report."""

    def __init__(self, stragglers: Optional[Stragglers] = None, clock=None):
        self.stragglers = stragglers or Stragglers()
        self.hosts: Optional[list] = None  # every rank's host, gathered at the first report
        self.clock = clock or (DeviceClock() if torch.cuda.is_available() else WallClock())
        self._spans: list = []  # [name, start mark, end mark, the enclosing span's index]
        self._steps: list = []  # [start mark, end mark]
        self._done = dict.fromkeys(PHASES, 0.0)  # seconds of the spans already read
        self._stack: list[list] = []  # [name, the span's index] of the phases open now
        self._step_start = None

    @contextlib.contextmanager
    def phase(self, name: str):
        """Time ``name`` (exclusive of the phases nested in it), labelled in profiler traces."""
        progress(name)  # (the hang watch's heartbeat: train/watchdog.py)
        index = len(self._spans)
        self._spans.append([name, self.clock.mark(), None,
                            self._stack[-1][1] if self._stack else None])
        self._stack.append([name, index])
        try:
            with torch.profiler.record_function(f"setdiff/{name}"):
                yield
        finally:
            self._spans[index][2] = self.clock.mark()
            self._stack.pop()
            progress()

    def timed(self, name: str, fn):
        """``fn`` wrapped in :meth:`phase` ``name``."""

        def wrapper(*args, **kwargs):
            with self.phase(name):
                return fn(*args, **kwargs)

        wrapper.__wrapped__ = fn
        return wrapper

    def start_step(self) -> None:
        """A step starts (before its batch is waited for); a step started already goes on."""
        if self._step_start is None:
            self._step_start = self.clock.mark()

    def end_step(self) -> None:
        self._steps.append((self._step_start, self.clock.mark()))
        self._step_start = None

    @property
    def totals(self) -> dict:
        """Each phase's seconds since the last report (reading them waits for the device)."""
        self._read()
        return dict(self._done)

    def _read(self) -> None:
        """Turn the finished spans into seconds (each exclusive of the spans nested in it);
        spans still open stay (a report inside a phase: the final checkpoint's)."""
        closed = [i for i, span in enumerate(self._spans) if span[2] is not None]
        if not closed:
            return
        self.clock.settle(self._spans[closed[-1]][2])
        took = {i: self.clock.seconds(self._spans[i][1], self._spans[i][2]) for i in closed}
        nested = dict.fromkeys(closed, 0.0)
        for i in closed:
            parent = self._spans[i][3]
            if parent in nested:
                nested[parent] += took[i]
        for i in closed:
            self._done[self._spans[i][0]] += took[i] - nested[i]
        keep = {i for i, span in enumerate(self._spans) if span[2] is None}
        renumber = {old: new for new, old in enumerate(sorted(keep))}
        self._spans = [[name, start, end, renumber.get(parent)]
                       for i, (name, start, end, parent) in enumerate(self._spans) if i in keep]
        for entry in self._stack:
            entry[1] = renumber[entry[1]]

    def report(self, device, stage: int = 0) -> dict:
        """The phases' seconds per step (``checkpoint`` and ``eval``: in all) since the last
        report, this rank's mean step time, and over all ranks (a collective: every rank
        calls it) the min / median / max of their step times, the slowest rank, and the
        stragglers (``stage``: this rank's pipeline stage, whose ranks it is compared with);
        then starts over. A newly named straggler, or one back within the margin, gets a
        line of its own (rank 0). Called between steps: the one place the timers wait for
        the device."""
        if self._steps:
            self.clock.settle(self._steps[-1][1])
        step_times = [self.clock.seconds(a, b) for a, b in self._steps]
        totals = self.totals
        steps = max(len(step_times), 1)
        mine = sum(step_times)
        out = {f"time_{k}": totals[k] / (steps if k in STEP_PHASES else 1) for k in PHASES}
        out["step_time"] = mine / steps
        out["train_seconds"] = mine
        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if world > 1 else 0
        every = torch.zeros(world, 3, dtype=torch.float64, device=device)
        every[rank] = torch.tensor([mine / steps, out["time_forward"], float(stage)])
        if world > 1:
            dist.all_reduce(every)
        step_times, forward, stages = (every.T.tolist())
        out["step_time_min"] = min(step_times)
        out["step_time_median"] = statistics.median(step_times)
        out["step_time_max"] = max(step_times)
        out["slowest_rank"] = max(range(world), key=step_times.__getitem__)
        found = self.stragglers.update(forward, [int(s) for s in stages])
        out.update({k: found[k] for k in ("forward_ratio_max", "forward_slowest_rank",
                                          "stragglers")})
        if found["new"] or found["cleared"]:
            if self.hosts is None:
                self.hosts = [None] * world
                if world > 1:
                    dist.all_gather_object(self.hosts, socket.gethostname())
                else:
                    self.hosts = [socket.gethostname()]
            if rank == 0:
                s = self.stragglers
                for r in found["new"]:
                    print(f"straggler: rank {r} on {self.hosts[r]}: its forward took "
                          f"{found['ratios'][r]:.2f}x its pipeline stage's median, over "
                          f"{1 + s.margin:.2f}x for {s.intervals} log intervals in a row "
                          "(train.straggler_margin / train.straggler_intervals)", flush=True)
                for r in found["cleared"]:
                    print(f"straggler: rank {r} on {self.hosts[r]} is back within the margin "
                          f"({found['ratios'][r]:.2f}x)", flush=True)
        self._done = dict.fromkeys(PHASES, 0.0)
        self._steps = []
        return out


class Profile:
    """``train.profile_steps: [a, b]``: a torch.profiler trace of steps a to b (inclusive) on
    every rank, written to ``<run_dir>/profile/rank<R>.pt.trace.json`` (Chrome trace format:
    open it in Perfetto, or in tensorboard with the PyTorch profiler plugin).

    ``quiesce`` is called before the profiler starts and before it stops: it waits for the
    collectives still running in the background (the parameter all-gather prefetched for the
    next step). The profiler installs and removes its observers for every thread, and a gloo
    worker thread running an op at that moment can crash the process (a SIGSEGV seen once in
    the suite, on a PP2 x DP2 rank at the profiler's stop)."""

    def __init__(self, steps, run_dir: str, rank: int,
                 quiesce: Optional[Callable[[], None]] = None):
        self.first, self.last = steps if steps else (None, None)
        self.path = os.path.join(run_dir, PROFILE, trace_file(rank))
        self._prof = None
        self._quiesce = quiesce or (lambda: None)

    def before(self, step: int) -> None:
        """Before step ``step`` (1-based, as logged) runs."""
        if self.first is not None and step == self.first and self._prof is None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._prof = torch.profiler.profile(activities=activities)
            self._quiesce()
            self._prof.__enter__()

    def after(self, step: int, last: bool = False) -> Optional[str]:
        """After step ``step``: the trace's path once written (at step b, or at ``last``, the
        run's final step before b)."""
        if self._prof is None or (step < self.last and not last):
            return None
        self._quiesce()
        self._prof.__exit__(None, None, None)
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        self._prof.export_chrome_trace(self.path)
        self._prof = None
        return self.path
