"""What a checkpoint costs the training steps, blocking (the default) against written in the
background (``checkpoint.async_save=true``), on the 110m shape and one rank.

    python benchmarks/checkpoint_cost.py [--model 110m] [--rounds 2] [--steps 11] [--interval 4]

Runs the real ``setdiff-train`` (one CPU rank, or one GPU), alternating the two settings
``--rounds`` times (this machine is noisy), saving every ``--interval`` steps, and prints from
``metrics.jsonl`` (one line per step):

- a normal step: the median of the warm steps before the first save, over both settings;
- ``save step``: the step a save follows plus the time the save held the training thread (the
  ``checkpoint`` phase: the whole write when blocking, the host copy when in the background);
- ``next step`` and ``the one after``: the two steps after it, during which a background write
  runs (at the lowest CPU priority, so it may span both);

each over a normal step, and the extra seconds the three cost together.
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

SETTINGS = {"blocking": "false", "async_save": "true"}


def run(args, shards, tmp, setting: str, i: int) -> list[dict]:
    run_dir = os.path.join(tmp, f"{setting}-{i}")
    cmd = [sys.executable, "-m", "setdiff_dist.cli.train",
           "--config", os.path.join(ROOT, "configs", "models", f"{args.model}.yaml"),
           f"run_dir={run_dir}", f"data.train_shards={shards}", f"data.seq_len={args.seq_len}",
           f"data.micro_batch_size={args.micro_batch}",
           f"data.global_batch_size={args.micro_batch}", f"train.steps={args.steps}",
           "train.log_interval=1", "train.eval_batches=1", f"train.precision={args.precision}",
           f"checkpoint.interval={args.interval}", "checkpoint.keep_last=1",
           f"checkpoint.async_save={SETTINGS[setting]}", "checkpoint.save_at_end=false",
           "train.tensorboard=false", "resume=never", "data.num_workers=1"]
    return step_rows(cmd, run_dir)


def costs(rows: list[dict], interval: int, warmup: int) -> dict:
    """The step times of one run: ``normal`` (the warm steps before the first save, which no
    save has touched), and for each save at step ``s`` with two steps after it: ``save`` (step
    ``s`` plus the time the save held the training thread), ``next`` and ``next2`` (steps
    ``s + 1`` and ``s + 2``, during which a background write runs)."""
    by_step = {r["step"]: r for r in rows}
    saves = [s for s in by_step if s % interval == 0 and s + 2 in by_step]
    # (a save runs after its step's line: its time is in the next line's time_checkpoint)
    return {"normal": [r["step_time"] for s, r in by_step.items() if warmup < s < interval],
            "save": [by_step[s]["step_time"] + by_step[s + 1]["time_checkpoint"] for s in saves],
            "next": [by_step[s + 1]["step_time"] for s in saves],
            "next2": [by_step[s + 2]["step_time"] for s in saves]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="110m")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--steps", type=int, default=11)
    ap.add_argument("--interval", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args(argv)
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from train_throughput import synthetic_shards

    found = {name: {"normal": [], "save": [], "next": [], "next2": []} for name in SETTINGS}
    with tempfile.TemporaryDirectory() as tmp:
        shards = synthetic_shards(tmp, args.seq_len)
        for i in range(args.rounds):
            for name in SETTINGS:
                for k, v in costs(run(args, shards, tmp, name, i), args.interval,
                                  args.warmup).items():
                    found[name][k] += v
                print(f"round {i + 1}/{args.rounds}: {name} done", file=sys.stderr, flush=True)
    normal = statistics.median(t for f in found.values() for t in f["normal"])
    print(f"{args.model}, one rank, {args.precision}, {args.micro_batch} x {args.seq_len} "
          f"tokens a step, a checkpoint every {args.interval} steps, {args.rounds} runs each; "
          f"a normal step (before any save, both settings): {normal:.2f} s")
    print(f"{'':<12} {'save step':>10} {'next step':>10} {'the one after':>14} "
          f"{'extra s per save':>17}")
    for name, f in found.items():
        s, x, y = (statistics.median(f[k]) for k in ("save", "next", "next2"))
        print(f"{name:<12} {s / normal:>9.2f}x {x / normal:>9.2f}x {y / normal:>13.2f}x "
              f"{s + x + y - 3 * normal:>17.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
