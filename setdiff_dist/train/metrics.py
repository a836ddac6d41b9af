"""What a user sees of a run: ``metrics.jsonl``, tensorboard, and a progress line with an ETA.

Only global rank 0 writes. Every logged step appends one JSON object to
``<run_dir>/metrics.jsonl`` (``step``, ``loss``, ``lr``, ``grad_norm``, ``tokens_per_s``,
``samples_seen``, the phase timers' ``time_<phase>`` seconds per step and the ranks' step times
``step_time_min`` / ``_median`` / ``_max`` with the ``slowest_rank``, and more); a run that
resumes first drops the lines past its checkpoint's step. Tensorboard gets the same scalars
plus the perplexity bound, MFU and memory, and so does Weights & Biases with
``logging.wandb`` (:class:`WandbLogger`). tokens/s and MFU count training time only
(:mod:`setdiff_dist.train.timers`).
"""

from __future__ import annotations

import json
import math
import os
import resource
import time
from typing import Optional

import torch

from setdiff_dist.checkpoint.format import METRICS, TENSORBOARD, WANDB_ID
from setdiff_dist.diffusion import perplexity_bound

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


def check_loggers(cfg) -> None:
    """Refuse, at start, a logger that cannot run here (never a silent fallback)."""
    if cfg.logging.wandb:
        try:
            import wandb

            wandb.init  # noqa: B018 (loads it: setdiff_dist._lazy makes the import itself lazy)
        except ImportError:
            from setdiff_dist.errors import TrainingError

            raise TrainingError("logging.wandb=true needs Weights & Biases, which is not "
                                "installed: pip install 'setdiff-dist[wandb]' (or set "
                                "logging.wandb=false)") from None


class WandbLogger:
    """The scalars tensorboard gets, under the same names (``train/loss``, ``valid/...``), in
    a W&B run in ``run_dir/wandb``; its id is kept in ``run_dir/wandb_id`` so that a resumed
    run (and a restart) continues the same W&B run."""

    def __init__(self, run_dir: str, cfg):
        import wandb

        lc = cfg.logging
        id_file = os.path.join(run_dir, WANDB_ID)
        if os.path.isfile(id_file):
            run_id = open(id_file).read().strip()
        else:
            import uuid

            run_id = uuid.uuid4().hex[:12]
            with open(id_file, "w") as fh:
                fh.write(run_id + "\n")
        self.run = wandb.init(project=lc.wandb_project, id=run_id, resume="allow",
                              name=lc.wandb_run_name or os.path.basename(
                                  os.path.normpath(run_dir)),
                              dir=run_dir, mode=lc.wandb_mode, config=cfg.to_dict())
        self.run.define_metric("*", step_metric="step")

    def log(self, step: int, values: dict) -> None:
        self.run.log({"step": step, **values})

    def close(self) -> None:
        import wandb

        self.run.finish()
        # and stop W&B's service process, which writes the run's file: the run is on disk
        # when training returns (an offline run's file was found incomplete right after finish)
        wandb.teardown()


def keep_until(path: str, step: int) -> None:
    """Drop the lines of ``metrics.jsonl`` past ``step`` (the step this run starts from: a
    restart from an earlier checkpoint logs those steps again), and a torn last line, so that
    each step appears once, as tensorboard's ``purge_step`` does for its events."""
    try:
        with open(path, encoding="utf-8") as fh:
            lines = fh.readlines()
    except FileNotFoundError:
        return
    kept = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue  # (a line cut short by a crash)
        if not isinstance(record, dict):
            continue
        at = record.get("step", 0)
        if not isinstance(at, (int, float)) or at <= step:
            kept.append(line if line.endswith("\n") else line + "\n")
    if kept != lines:
        from setdiff_dist.checkpoint.files import write_atomic

        write_atomic(path, "".join(kept))


class MetricsLogger:
    def __init__(self, run_dir: str, enabled: bool, total_steps: int, flops_per_token: float,
                 world_size: int, tensorboard: bool = True, start_step: int = 0,
                 peak_tflops: Optional[float] = None, cfg=None):
        self.enabled, self.total, self.flops_per_token = enabled, total_steps, flops_per_token
        self.world_size = world_size
        self.peak = peak_tflops * 1e12 if peak_tflops else device_peak_flops()
        self._t0, self._step0 = time.perf_counter(), start_step
        self.writer = self.wandb = None
        if enabled:
            os.makedirs(run_dir, exist_ok=True)
            self.path = os.path.join(run_dir, METRICS)
            keep_until(self.path, start_step)
            if tensorboard:
                from torch.utils.tensorboard import SummaryWriter

                self.writer = SummaryWriter(os.path.join(run_dir, TENSORBOARD),
                                            purge_step=start_step + 1)
            if cfg is not None and cfg.logging.wandb:
                self.wandb = WandbLogger(run_dir, cfg)

    def _scalars(self, step: int, values: dict) -> None:
        """The scalars of one line to tensorboard and W&B, under the same names."""
        if self.writer:
            for k, v in values.items():
                self.writer.add_scalar(k, v, step)
            self.writer.flush()
        if self.wandb:
            self.wandb.log(step, values)

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
        scalars = {f"train/{k}": v for k, v in record.items()
                   if isinstance(v, (int, float)) and k != "step"}
        if math.isfinite(record["loss"]):
            scalars["train/ppl_bound"] = perplexity_bound(record["loss"])
        self._scalars(step, scalars)
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
        self._scalars(step, {f"valid/{k}": v for k, v in values.items()})
        print(f"step {step:>6}  validation: " + "  ".join(f"{k} {v:.4f}" for k, v in
                                                        values.items()), flush=True)

    def close(self) -> None:
        if self.writer:
            self.writer.close()
        if self.wandb:
            self.wandb.close()


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
