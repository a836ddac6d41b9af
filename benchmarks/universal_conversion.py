"""The wall time of the conversion to DeepSpeed's universal form that a resume in another
layout runs, on 4 ranks: rank 0 alone against the work shared by the 4.

    python benchmarks/universal_conversion.py [--model 110m] [--rounds 3] [--precision bf16]

Trains one step of ``--model`` on 4 CPU ranks (DP=4, ZeRO-1, saving at the end) with the real
``setdiff-train``, then times, alternating ``--rounds`` times (this machine is noisy):

- ``before``: as until now, rank 0 ran DeepSpeed's converter in a subprocess
  (``python -m setdiff_dist.train.universal``, which converts in one process) while the other
  ranks waited at a barrier: the subprocess's wall time, from its start;
- ``rank 0 alone``: the same conversion in a process of the 4-rank job (the start-up and the
  imports already paid), the other 3 waiting: what the split is measured against;
- ``split over 4``: :func:`setdiff_dist.train.universal.convert` on the 4 ranks, each its share
  (the partition files, then the parameters, largest first).

Prints the medians and the ratios. On this 2-core machine the 4 ranks share 2 cores and one
disk, so the split can gain at most about 2x here; a node of a GPU cluster has a core or more
per rank.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

WORLD = 4


def train_checkpoint(args, tmp: str) -> str:
    from train_throughput import synthetic_shards

    shards = synthetic_shards(tmp, args.seq_len)
    run_dir = os.path.join(tmp, "run")
    cmd = [sys.executable, "-m", "setdiff_dist.cli.train", "--nproc-per-node", str(WORLD),
           "--config", os.path.join(ROOT, "configs", "models", f"{args.model}.yaml"),
           f"run_dir={run_dir}", f"data.train_shards={shards}", f"data.seq_len={args.seq_len}",
           "data.micro_batch_size=1", f"data.global_batch_size={WORLD}", "train.steps=1",
           "train.eval_batches=1", f"train.precision={args.precision}",
           "checkpoint.save_at_end=true", "train.tensorboard=false", "resume=never",
           "optimizer.warmup_steps=0"]
    print(f"training one step of {args.model} on {WORLD} ranks for a checkpoint ...",
          file=sys.stderr, flush=True)
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode:
        raise SystemExit(f"setdiff-train failed (exit {res.returncode}):\n{res.stderr[-3000:]}")
    step = os.path.join(run_dir, "checkpoints", "step_0000001")
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(step) for f in fs)
    print(f"checkpoint {step}: {size / 2**30:.2f} GiB", file=sys.stderr, flush=True)
    return step


def _rank(rank: int, port: int, step: str, out: str, rounds: int, result: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    from setdiff_dist.quiet import quiet

    quiet()
    import torch
    import torch.distributed as dist

    from setdiff_dist.train.universal import convert, dist_agree

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    agree = dist_agree()
    times = {"rank 0 alone": [], f"split over {WORLD}": []}
    for i in range(rounds):
        for mode in times:
            target = os.path.join(out, f"{i}-{mode.replace(' ', '_')}")
            dist.barrier()
            t = time.perf_counter()
            if mode == "rank 0 alone":
                if rank == 0:
                    convert(step, target)
            else:
                convert(step, target, rank, WORLD, agree)
            dist.barrier()
            times[mode].append(time.perf_counter() - t)
            if rank == 0:
                shutil.rmtree(target)
                print(f"round {i + 1}/{rounds}: {mode} {times[mode][-1]:.1f} s",
                      file=sys.stderr, flush=True)
    if rank == 0:
        torch.save(times, result)
    dist.barrier()
    dist.destroy_process_group()


def before(step: str, out: str) -> float:
    """Rank 0's subprocess, as until now."""
    target = os.path.join(out, "before")
    t = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "setdiff_dist.train.universal",
                          "--input_folder", step, "--output_folder", target],
                         capture_output=True, text=True,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    took = time.perf_counter() - t
    if res.returncode:
        raise SystemExit(f"the converter failed:\n{res.stderr[-3000:]}")
    shutil.rmtree(target)
    return took


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="110m")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    import torch
    import torch.multiprocessing as mp

    from setdiff_dist.processes import free_port

    with tempfile.TemporaryDirectory() as tmp:
        step = train_checkpoint(args, tmp)
        for d, _, fs in os.walk(step):  # (each setting reads it from the page cache)
            for f in fs:
                with open(os.path.join(d, f), "rb") as fh:
                    while fh.read(1 << 24):
                        pass
        out = os.path.join(tmp, "converted")
        os.makedirs(out)
        result = os.path.join(tmp, "times.pt")
        found = {"before": []}
        for i in range(args.rounds):  # (the subprocess first and last, the others between)
            found["before"].append(before(step, out))
            print(f"round {i + 1}/{args.rounds}: before {found['before'][-1]:.1f} s",
                  file=sys.stderr, flush=True)
        mp.spawn(_rank, args=(free_port(), step, out, args.rounds, result), nprocs=WORLD,
                 join=True)
        found.update(torch.load(result))
    alone = statistics.median(found["rank 0 alone"])
    print(f"{args.model}, {args.precision}, a DP={WORLD} ZeRO-1 checkpoint converted to "
          f"DeepSpeed's universal form, {args.rounds} rounds, median wall seconds:")
    for name, times in found.items():
        med = statistics.median(times)
        print(f"  {name:<16} {med:7.1f} s   {med / alone:5.2f}x rank 0 alone")
    return 0


if __name__ == "__main__":
    sys.exit(main())
