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

On a GPU the device is synchronized at the top-level phase boundaries (not inside the backward,
where it would serialize the overlapped reduction). Training time, for tokens/s and MFU, is the
sum of the steps' times: evaluation and checkpoints are left out.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from typing import Optional

import torch
import torch.distributed as dist

STEP_PHASES = ("data_wait", "forward", "backward", "grad_reduce", "optimizer", "param_gather")
PHASES = STEP_PHASES + ("checkpoint", "eval")


class PhaseTimers:
    def __init__(self):
        self.cuda = torch.cuda.is_available()
        self.totals = dict.fromkeys(PHASES, 0.0)
        self.step_times: list[float] = []
        self._stack: list[list] = []  # [name, start, time taken by nested phases]
        self._step_start: Optional[float] = None

    def _sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    @contextlib.contextmanager
    def phase(self, name: str):
        """Time ``name`` (exclusive of the phases nested in it), labelled in profiler traces."""
        top = not self._stack
        if top:
            self._sync()
        entry = [name, time.perf_counter(), 0.0]
        self._stack.append(entry)
        try:
            with torch.profiler.record_function(f"setdiff/{name}"):
                yield
        finally:
            if top:
                self._sync()
            self._stack.pop()
            took = time.perf_counter() - entry[1]
            self.totals[name] += took - entry[2]
            if self._stack:
                self._stack[-1][2] += took

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
            self._sync()
            self._step_start = time.perf_counter()

    def end_step(self) -> None:
        self._sync()
        self.step_times.append(time.perf_counter() - self._step_start)
        self._step_start = None

    def report(self, device) -> dict:
        """The phases' seconds per step (``checkpoint`` and ``eval``: in all) since the last
        report, this rank's mean step time, and over all ranks (a collective: every rank
        calls it) the min / median / max of their step times and the slowest rank; then
        starts over."""
        steps = max(len(self.step_times), 1)
        mine = sum(self.step_times)
        out = {f"time_{k}": self.totals[k] / (steps if k in STEP_PHASES else 1) for k in PHASES}
        out["step_time"] = mine / steps
        out["train_seconds"] = mine
        world = dist.get_world_size() if dist.is_initialized() else 1
        every = torch.zeros(world, dtype=torch.float64, device=device)
        every[dist.get_rank() if world > 1 else 0] = mine / steps
        if world > 1:
            dist.all_reduce(every)
        per_rank = every.tolist()
        out["step_time_min"] = min(per_rank)
        out["step_time_median"] = statistics.median(per_rank)
        out["step_time_max"] = max(per_rank)
        out["slowest_rank"] = max(range(world), key=per_rank.__getitem__)
        self.totals = dict.fromkeys(PHASES, 0.0)
        self.step_times = []
        return out


class Profile:
    """``train.profile_steps: [a, b]``: a torch.profiler trace of steps a to b (inclusive) on
    every rank, written to ``<run_dir>/profile/rank<R>.pt.trace.json`` (Chrome trace format:
    open it in Perfetto, or in tensorboard with the PyTorch profiler plugin)."""

    def __init__(self, steps, run_dir: str, rank: int):
        self.first, self.last = steps if steps else (None, None)
        self.path = os.path.join(run_dir, "profile", f"rank{rank}.pt.trace.json")
        self._prof = None

    def before(self, step: int) -> None:
        """Before step ``step`` (1-based, as logged) runs."""
        if self.first is not None and step == self.first and self._prof is None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._prof = torch.profiler.profile(activities=activities)
            self._prof.__enter__()

    def after(self, step: int, last: bool = False) -> Optional[str]:
        """After step ``step``: the trace's path once written (at step b, or at ``last``, the
        run's final step before b)."""
        if self._prof is None or (step < self.last and not last):
            return None
        self._prof.__exit__(None, None, None)
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        self._prof.export_chrome_trace(self.path)
        self._prof = None
        return self.path
