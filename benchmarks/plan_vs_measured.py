"""The dry run's memory figures against a real training run, side by side.

    python benchmarks/plan_vs_measured.py [--model 110m] [--seq-len 128] [--micro-batch 8]
                                          [overrides ...]

Runs ``setdiff-train`` on one CPU rank (fp32, ZeRO-1, two micro-batches per step) for two
optimizer steps (the second is the steady state: the optimizer state exists during its
backward), with each step under torch's memory profiler, and prints the peak of live tensor
bytes (what a GPU's caching allocator must hold) next to the dry run's peak for the same config
(``setdiff_dist.train.plan``). The process's peak RSS is printed too, above a tiny model's run
(imports, data loader): on the CPU it differs from live bytes both ways, since glibc keeps freed
memory and DeepSpeed's ``torch.empty`` reduction bucket is never touched in full.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))


def _settings(model, args, shards, run_dir):
    return ["--config", os.path.join(ROOT, "configs", "models", f"{model}.yaml"),
            f"run_dir={run_dir}", f"data.train_shards={shards}", f"data.seq_len={args.seq_len}",
            f"data.micro_batch_size={args.micro_batch}",
            f"data.global_batch_size={2 * args.micro_batch}", "data.num_workers=0",
            "train.steps=2", "train.eval_batches=1", "train.tensorboard=false",
            "checkpoint.save_at_end=false", "zero.stage=1", *args.overrides]


def _measured_kib(settings) -> int:
    with tempfile.NamedTemporaryFile("r") as out:
        res = subprocess.run(["/usr/bin/time", "-f", "%M", "-o", out.name, sys.executable, "-m",
                              "setdiff_dist.cli.train", *settings],
                             capture_output=True, text=True, cwd=ROOT)
        if res.returncode:
            raise SystemExit(f"training failed:\n{res.stderr[-3000:]}")
        return int(out.read().strip().splitlines()[-1])


def _planned(settings) -> float:
    from setdiff_dist.config import load_config
    from setdiff_dist.train.plan import plan

    cfg = load_config(settings[1], settings[2:])
    return plan(cfg, 1).stages[0].total


def _measured_live(settings) -> float:
    """Peak live tensor bytes of the run's training steps (in a child process)."""
    with tempfile.NamedTemporaryFile("r") as out:
        res = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", out.name,
                              *settings], capture_output=True, text=True, cwd=ROOT)
        if res.returncode:
            raise SystemExit(f"training failed:\n{res.stderr[-3000:]}")
        return float(out.read())


def _child(out: str, settings: list) -> int:
    import torch
    from torch.profiler import profile
    from torch.profiler._memory_profiler import MemoryProfileTimeline

    import setdiff_dist.train.loop as loop
    from setdiff_dist.cli.train import main as train

    peaks = []
    step = loop.Trainer.train_step

    def profiled(self, micro_batches):
        with profile(profile_memory=True, record_shapes=True, with_stack=True) as prof:
            result = step(self, micro_batches)
        timeline = MemoryProfileTimeline(prof._memory_profile())
        _, sizes = timeline._coalesce_timeline(torch.device("cpu"))
        peaks.append(max(sum(s) for s in sizes))
        return result

    loop.Trainer.train_step = profiled
    code = train(settings)
    with open(out, "w") as fh:
        fh.write(str(max(peaks)))
    return code


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        return _child(sys.argv[2], sys.argv[3:])
    from helpers import sonnet_shards

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="110m")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("overrides", nargs="*", help="more section.key=value for both runs")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        shards = sonnet_shards(os.path.join(tmp, "data"), seq_len=args.seq_len)
        big = _settings(args.model, args, shards, os.path.join(tmp, "big"))
        tiny = _settings("tiny", args, shards, os.path.join(tmp, "tiny"))
        live = _measured_live(big)
        rss = (_measured_kib(big) - _measured_kib(tiny)) * 1024
        planned = _planned(big)
    print(f"{args.model}, L={args.seq_len}, micro-batch {args.micro_batch} (2 per step), one CPU "
          "rank, fp32, ZeRO-1, steady state (step 2):")
    print(f"  measured peak of live tensors   {live / 2**30:6.2f} GiB")
    print(f"  dry run (setdiff-train --dry-run) {planned / 2**30:6.2f} GiB  "
          f"({planned / live - 1:+.0%})")
    print(f"  (peak RSS above a tiny model's run: {rss / 2**30:.2f} GiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
