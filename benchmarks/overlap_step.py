"""Step time with the gradient reduction and the parameter gather overlapped (the default), with
the reduction overlapped only (``zero.overlap_param_gather=false``), and with both after the
backward and the step (``zero.overlap_comm=false``), side by side in one run, from the phase
timers.

    python benchmarks/overlap_step.py [--model 110m] [--nproc 2] [--rounds 2] [--steps 8]

Runs the real ``setdiff-train`` at DP=``--nproc`` (every local GPU, or CPU ranks on gloo), bf16,
ZeRO-1, alternating the three settings ``--rounds`` times (this machine is noisy: A B C A B C), and
prints per setting the median step time and its phases over the steps after ``--warmup``, and
the ratio. On CPU ranks gloo's collectives block the thread that issued them, so the overlapped
reduction cannot hide behind compute there: what the CPU shows is the bytes (a reduce-scatter
instead of an all-reduce), not the overlap, which needs a GPU's separate stream.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from train_throughput import step_rows  # noqa: E402

PHASES = ("data_wait", "forward", "backward", "grad_reduce", "optimizer", "param_gather")
# name -> (zero.overlap_comm, zero.overlap_param_gather)
SETTINGS = {"after the backward": (False, False), "reduce overlapped": (True, False),
            "both (default)": (True, True)}


def run(args, shards, tmp, setting: str, i: int) -> list[dict]:
    run_dir = os.path.join(tmp, f"{setting.split()[0]}-{i}")
    reduce, gather = SETTINGS[setting]
    cmd = [sys.executable, "-m", "setdiff_dist.cli.train", "--nproc-per-node", str(args.nproc),
           "--config", os.path.join(ROOT, "configs", "models", f"{args.model}.yaml"),
           f"run_dir={run_dir}", f"data.train_shards={shards}", f"data.seq_len={args.seq_len}",
           f"data.micro_batch_size={args.micro_batch}",
           f"data.global_batch_size={2 * args.micro_batch * args.nproc}",
           f"train.steps={args.steps}", "train.log_interval=1", "train.precision=bf16",
           "train.eval_batches=1", "zero.stage=1", f"zero.overlap_comm={str(reduce).lower()}",
           f"zero.overlap_param_gather={str(gather).lower()}",
           "checkpoint.save_at_end=false", "checkpoint.save_on_signal=false",
           "train.tensorboard=false", "resume=never", "data.num_workers=1"]
    return step_rows(cmd, run_dir)[args.warmup:]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="110m")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args(argv)
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from train_throughput import synthetic_shards

    rows = {name: [] for name in SETTINGS}
    with tempfile.TemporaryDirectory() as tmp:
        shards = synthetic_shards(tmp, args.seq_len)
        for i in range(args.rounds):
            for name in SETTINGS:
                rows[name] += run(args, shards, tmp, name, i)
    print(f"{args.model}, DP={args.nproc}, bf16 ZeRO-1, L={args.seq_len}, "
          f"{args.micro_batch} x 2 micro-batches per rank; medians over "
          f"{len(rows[name])} steps each (ms)")
    print(f"{'':<20} {'step':>8} " + " ".join(f"{p:>12}" for p in PHASES))
    med = {}
    for name in SETTINGS:
        med[name] = {k: statistics.median(r[k] for r in rows[name])
                     for k in ["step_time"] + [f"time_{p}" for p in PHASES]}
        print(f"{name:<20} {med[name]['step_time'] * 1e3:>8.1f} "
              + " ".join(f"{med[name][f'time_{p}'] * 1e3:>12.1f}" for p in PHASES))
    off = med["after the backward"]
    for name in list(SETTINGS)[1:]:
        on = med[name]
        print(f"{name} / after the backward: step {on['step_time'] / off['step_time']:.2f}x, "
              f"exposed reduction {on['time_grad_reduce'] / off['time_grad_reduce']:.2f}x, "
              f"optimizer + exposed gather "
              f"{(on['time_optimizer'] + on['time_param_gather']) / off['time_optimizer']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
