"""What a rank's start costs, forked by the rank server or executed: ``setdiff-train
--nproc-per-node N`` on the tiny model for ``--steps`` steps on the built-in sonnets (gloo, the
CPU), side by side in one run, alternated after one warm-up launch: ``forked``
(``SETDIFF_WARM_START=1``, the CPU default) and ``executed`` (``=0``, one interpreter per rank,
as under torchrun).

    python benchmarks/rank_start.py [--ranks 2 4] [--steps 6] [--repeats 2]

For each launch: the CPU-seconds of the whole launch (the launcher, the server and every rank:
``RUSAGE_CHILDREN`` of this process, which the launcher's waits carry up), the wall time to the
first logged step and to the end. Results go to ``benchmarks/results/rank_start.json``.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from startup_groups import ROOT, alternated, means, shards, write_results  # noqa: E402

VARIANTS = {"forked": "1", "executed": "0"}


def cpu_of_children() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def launch(variant: str, ranks: int, steps: int, data: Path, work: Path) -> dict:
    run_dir = work / f"run-{variant}-{ranks}-{time.monotonic_ns()}"
    cmd = [sys.executable, "-m", "setdiff_dist.cli.train", "--nproc-per-node", str(ranks),
           "--config", "configs/tiny-cpu.yaml", f"run_dir={run_dir}", f"data.train_shards={data}",
           "data.seq_len=32", "model.vocab_size=257", f"train.steps={steps}",
           "train.log_interval=1", f"data.global_batch_size={2 * ranks}",
           "data.micro_batch_size=2", "train.tensorboard=false", "checkpoint.save_at_end=false"]
    env = dict(os.environ, SETDIFF_WARM_START=VARIANTS[variant])
    cpu, start = cpu_of_children(), time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    first, metrics = None, run_dir / "metrics.jsonl"
    while proc.poll() is None:
        if first is None and metrics.exists() and metrics.stat().st_size:
            first = time.monotonic() - start
        time.sleep(0.05)
    if proc.returncode != 0:
        sys.exit(f"{variant}: setdiff-train failed:\n{proc.stderr.read()[-3000:]}")
    return {"cpu_s": cpu_of_children() - cpu, "seconds_to_first_step": first,
            "seconds_total": time.monotonic() - start}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=2, help="launches of each variant, alternated")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="rank-start-"))
    data = shards(work / "data")
    launch("forked", args.ranks[0], 1, data, work)  # (fills the caches: neither variant pays it)
    out = {"steps": args.steps}
    for ranks in args.ranks:
        rows = out[f"ranks{ranks}"] = alternated(
            tuple(VARIANTS), args.repeats,
            lambda variant, _, ranks=ranks: launch(variant, ranks, args.steps, data, work))
        mean = means(rows)
        f, e = mean["forked"], mean["executed"]
        print(f"{ranks} ranks, {args.steps} steps: CPU {f['cpu_s']:.1f} s forked vs "
              f"{e['cpu_s']:.1f} s executed ({e['cpu_s'] / f['cpu_s']:.2f}x); first step at "
              f"{f['seconds_to_first_step']:.1f} vs {e['seconds_to_first_step']:.1f} s; "
              f"end at {f['seconds_total']:.1f} vs {e['seconds_total']:.1f} s", flush=True)
    write_results("rank_start", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
