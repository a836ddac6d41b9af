"""What a user sees of a run: ``metrics.jsonl``, tensorboard, and a progress line with an ETA.

Only global rank 0 writes. Every logged step appends one JSON object to
``<run_dir>/metrics.jsonl`` (``step``, ``loss``, ``lr``, ``grad_norm``, ``tokens_per_s``,
``samples_seen``, the phase timers' ``time_<phase>`` seconds per step and the ranks' step times
``step_time_min`` / ``_median`` / ``_max`` with the ``slowest_rank``, and more); tensorboard gets
the same scalars plus the perplexity bound, MFU and memory. tokens/s and MFU count training
time only (:mod:`setdiff_dist.train.timers`).
"""

from __future__ import annotations

import json
import math
import os
import resource
import time
from typing import Optional

import torch

# dense bf16 peak FLOP/s of common accelerators, for MFU
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "A100": 312e12, "A800": 312e12,
              "L40S": 362e12, "B200": 2250e12}


def device_peak_flops() -> Optional[float]:
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_FLOPS.items() if k in name), None)


def memory_gb() -> float:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


class MetricsLogger:
    def __init__(self, run_dir: str, enabled: bool, total_steps: int, flops_per_token: float,
                 world_size: int, tensorboard: bool = True, start_step: int = 0,
                 peak_tflops: Optional[float] = None):
        self.enabled, self.total, self.flops_per_token = enabled, total_steps, flops_per_token
        self.world_size = world_size
        self.peak = peak_tflops * 1e12 if peak_tflops else device_peak_flops()
        self._t0, self._step0 = time.perf_counter(), start_step
        self.writer = None
        if enabled:
            os.makedirs(run_dir, exist_ok=True)
            self.path = os.path.join(run_dir, "metrics.jsonl")
            if tensorboard:
                from torch.utils.tensorboard import SummaryWriter

                self.writer = SummaryWriter(os.path.join(run_dir, "tensorboard"),
                                            purge_step=start_step + 1)

    def log(self, record: dict, tokens_since_last: int, train_seconds: float) -> None:
        """One line for ``record``; tokens/s (and MFU) over ``train_seconds``, the steps' own
        time since the last line (without evaluation and checkpoints)."""
        now = time.perf_counter()
        tps = tokens_since_last / max(train_seconds, 1e-9)
        record["tokens_per_s"] = tps
        if not self.enabled:
            return
        step = record["step"]
        record["memory_gb"] = memory_gb()
        if self.peak:
            record["mfu"] = tps * self.flops_per_token / (self.peak * self.world_size)
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(record) + "\n")
        if self.writer:
            for k, v in record.items():
                if isinstance(v, (int, float)) and k != "step":
                    self.writer.add_scalar(f"train/{k}", v, step)
            if math.isfinite(record["loss"]) and record["loss"] < 50:
                self.writer.add_scalar("train/ppl_bound", math.exp(record["loss"]), step)
            self.writer.flush()
        done = step - self._step0
        eta = (now - self._t0) / max(done, 1) * (self.total - step)
        mfu = f"  mfu {record['mfu'] * 100:4.1f}%" if "mfu" in record else ""
        print(f"step {step:>6}/{self.total}  loss {record['loss']:.4f}  lr {record['lr']:.2e}  "
              f"grad {record['grad_norm']:.3f}  {tps:9.0f} tok/s{mfu}  "
              f"eta {_hms(eta)}{_times(record)}", flush=True)

    def log_eval(self, step: int, values: dict) -> None:
        if not self.enabled:
            return
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps({"step": step, **values}) + "\n")
        if self.writer:
            for k, v in values.items():
                self.writer.add_scalar(f"valid/{k}", v, step)
            self.writer.flush()
        print(f"step {step:>6}  validation: " + "  ".join(f"{k} {v:.4f}" for k, v in
                                                        values.items()), flush=True)

    def close(self) -> None:
        if self.writer:
            self.writer.close()


# the phases of the progress line, by their short names
_SHORT = {"data_wait": "data", "forward": "fwd", "backward": "bwd", "grad_reduce": "reduce",
          "optimizer": "opt", "param_gather": "gather"}


def _times(record: dict) -> str:
    """``  step 0.52s [data 1% fwd 38% bwd 50% reduce 3% opt 7% gather 1%] max 0.60s rank 3``
    from the phase timers' fields of ``record`` (nothing without them)."""
    step = record.get("step_time")
    if not step:
        return ""
    shares = " ".join(f"{short} {record[f'time_{name}'] / step * 100:.0f}%"
                      for name, short in _SHORT.items())
    return (f"  step {step:.3g}s [{shares}] max {record['step_time_max']:.3g}s rank "
            f"{record['slowest_rank']}")


def _hms(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600:d}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"
