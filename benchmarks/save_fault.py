"""What a failed checkpoint write costs a run, on the user's command: ``setdiff-train
--nproc-per-node 2`` on the tiny model (gloo, the CPU) with background saves
(``checkpoint.async_save``) every ``--interval`` steps, side by side in one run, alternated:

- ``clean``: no fault;
- ``retried``: rank 1's write of step ``--fault`` fails as a full disk does
  (``SETDIFF_FAULT=write_fails:STEP:1``) with ``checkpoint.save_retries=1``: every rank learns
  of it at a step boundary and the ranks save again there;
- ``ended``: the same fault without retries (the default): the job ends at a step boundary
  with exit 2 and ``latest`` at the save before; then the job started again (``resume=auto``,
  as the user or Slurm starts it once the disk has room; time in the queue not counted) goes
  on from there.

    python benchmarks/save_fault.py [--steps 40] [--interval 10] [--fault 20] [--repeats 2]

For each: the wall seconds of its launch(es) and the seconds lost against ``clean`` (issue
51's goodput loss per fault). Results go to ``benchmarks/results/save_fault.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from startup_groups import ROOT, alternated, means, shards, write_results  # noqa: E402

VARIANTS = ("clean", "retried", "ended")


def launch(run_dir: Path, data: Path, args, *overrides: str, fault: bool = False):
    """(wall seconds, exit code) of one ``setdiff-train`` launch."""
    cmd = [sys.executable, "-m", "setdiff_dist.cli.train", "--nproc-per-node", "2",
           "--config", "configs/tiny-cpu.yaml", f"run_dir={run_dir}", f"data.train_shards={data}",
           "data.seq_len=32", "model.vocab_size=257", f"train.steps={args.steps}",
           "train.log_interval=1", "data.global_batch_size=8", "data.micro_batch_size=2",
           "train.tensorboard=false", "checkpoint.async_save=true",
           f"checkpoint.interval={args.interval}", *overrides]
    env = dict(os.environ)
    if fault:
        env["SETDIFF_FAULT"] = f"write_fails:{args.fault}:1"
    start = time.monotonic()
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    return time.monotonic() - start, res


def variant(name: str, work: Path, data: Path, args) -> dict:
    run_dir = work / f"{name}-{time.monotonic_ns()}"
    if name == "clean":
        wall, res = launch(run_dir, data, args)
        launches = [res]
    elif name == "retried":
        wall, res = launch(run_dir, data, args, "checkpoint.save_retries=1", fault=True)
        launches = [res]
    else:
        wall, res = launch(run_dir, data, args, fault=True)
        if res.returncode != 2:
            sys.exit(f"ended: expected exit 2 from the failed save, got {res.returncode}:\n"
                     f"{res.stderr[-3000:]}")
        reached = max(steps_of(run_dir))
        kept = int((run_dir / "checkpoints" / "latest").read_text().strip().split("_")[1])
        again, more = launch(run_dir, data, args)
        wall, launches = wall + again, [more]
    for r in launches:
        if r.returncode != 0:
            sys.exit(f"{name}: setdiff-train failed:\n{r.stderr[-3000:]}")
    if max(steps_of(run_dir)) != args.steps:
        sys.exit(f"{name}: the run did not reach step {args.steps}")
    return {"seconds": wall, "steps_again": reached - kept if name == "ended" else 0}


def steps_of(run_dir: Path) -> list:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text()
            .splitlines() if '"loss"' in line]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--interval", type=int, default=10)
    ap.add_argument("--fault", type=int, default=20, help="the step whose save fails")
    ap.add_argument("--repeats", type=int, default=2, help="runs of each variant, alternated")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="save-fault-"))
    data = shards(work / "data")
    variant("clean", work, data, args)  # (fills the caches: no variant pays it)

    def measure(name, _):
        r = variant(name, work, data, args)
        print(f"{name}: {r}", flush=True)
        return r

    rows = alternated(VARIANTS, args.repeats, measure)
    mean = means(rows)
    clean = mean["clean"]["seconds"]
    for name in VARIANTS:
        m = mean[name]
        print(f"{name:8s} {m['seconds']:6.1f} s, {m['seconds'] - clean:+5.1f} s against clean "
              f"({m['seconds'] / clean:.2f}x), {m['steps_again']:.0f} step(s) trained again",
              flush=True)
    write_results("save_fault", {"args": vars(args), "runs": rows, "mean": mean})
    return 0


if __name__ == "__main__":
    sys.exit(main())
