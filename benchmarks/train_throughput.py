"""Training throughput and MFU of setdiff-train, set diffusion next to the causal LM.

    python benchmarks/train_throughput.py --models 110m 1.3b --precision bf16 --steps 30

For each model config it runs the real ``setdiff-train`` (DeepSpeed ZeRO-1 over the
megatron-core model, on every local GPU, or the CPU) for a few steps on synthetic shards, and
reads ``tokens_per_s`` and ``mfu`` from ``metrics.jsonl`` (median over the steps after warm-up).
It prints a table and the set-diffusion / causal ratios measured in the same run.

Runs write no checkpoint (``checkpoint.save_at_end=false``) and each run directory is deleted
once read (a 1.3B checkpoint is ~21 GB). ``--budget-s`` skips the runs that would start after
that many seconds. The exit code is 1 if any run failed, else 3 if a run was skipped for the
budget (tests/gpu/run.sh reports "skipped (budget)", not a failure), else 0.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def synthetic_shards(directory: str, seq_len: int) -> str:
    """Byte-tokenized shards of real text, enough sequences for any number of steps."""
    from data_prep.prep import prepare
    from setdiff_dist.data import sample_text

    src = os.path.join(directory, "text.txt")
    with open(src, "w") as fh:
        fh.write("\n\n".join([sample_text()] * 64))
    out = os.path.join(directory, f"shards-{seq_len}")
    prepare([src], "bytes", seq_len, out, valid_every=0, split_paragraphs=True, progress=False)
    return out


def step_rows(cmd: list[str], run_dir: str) -> list[dict]:
    """Run ``cmd`` (a ``setdiff-train`` into ``run_dir``) and return its metrics.jsonl lines
    that carry step times; the run directory is removed after. A failed run ends the
    benchmark with its error."""
    import json
    import shutil
    import subprocess

    try:
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode:
            raise SystemExit(f"setdiff-train failed (exit {res.returncode}):\n{res.stderr[-2000:]}")
        with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
            rows = [json.loads(line) for line in fh]
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    return [r for r in rows if "step_time" in r]


def run_overrides(run_dir: str, shards: str, *, seq_len: int, micro_batch: int, nproc: int,
                  steps: int, precision: str, kind: str, backend: str) -> list[str]:
    """The ``setdiff-train`` overrides of one benchmark run (tests/gpu/checks.py plans and runs
    the same): no checkpoint, a step logged each step, ZeRO-1, no accumulation."""
    return [f"run_dir={run_dir}", f"data.train_shards={shards}", f"data.seq_len={seq_len}",
            f"data.micro_batch_size={micro_batch}",
            f"data.global_batch_size={micro_batch * nproc}", f"train.steps={steps}",
            "train.log_interval=1", f"train.precision={precision}", "train.eval_batches=1",
            "zero.stage=1", "optimizer.warmup_steps=0", "checkpoint.save_on_signal=false",
            "checkpoint.save_at_end=false", "train.tensorboard=false", f"order.kind={kind}",
            "order.mean_set_size=4", f"model.attention_backend={backend}", "resume=never",
            "data.num_workers=2"]


def run(model: str, kind: str, args, shards: str, tmp: str) -> dict:
    nproc = max(1, torch.cuda.device_count())
    run_dir = os.path.join(tmp, f"{model}-{kind}")
    cmd = [sys.executable, "-m", "setdiff_dist.cli.train", "--nproc-per-node", str(nproc),
           "--config", os.path.join(ROOT, "configs", "models", f"{model}.yaml"),
           *run_overrides(run_dir, shards, seq_len=args.seq_len, micro_batch=args.micro_batch,
                          nproc=nproc, steps=args.steps, precision=args.precision, kind=kind,
                          backend=args.backend)]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode:
            lines = res.stderr.strip().splitlines()
            return {"error": f"exit {res.returncode}: " + (lines[-1] if lines else "no output")}
        with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
            rows = [json.loads(line) for line in fh]
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    steps = [r for r in rows if "tokens_per_s" in r][args.warmup:]
    if not steps:
        return {"error": f"no step after {args.warmup} warm-up steps: raise --steps"}
    out = {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in steps),
           "memory_gb": max(r["memory_gb"] for r in steps)}
    if "mfu" in steps[0]:
        out["mfu"] = statistics.median(r["mfu"] for r in steps)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["110m", "1.3b"])
    ap.add_argument("--precision", default="bf16", choices=("fp32", "bf16", "fp8"))
    ap.add_argument("--backend", default="auto",
                    help="model.attention_backend (auto: what training picks for the order, "
                         "permuted_causal for the staggered one)")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--budget-s", type=float, default=None,
                    help="skip the runs that would start after this many seconds")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    start = time.monotonic()
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"{device} x {max(1, torch.cuda.device_count())}, {args.precision}, L={args.seq_len}, "
          f"micro-batch {args.micro_batch}, backend {args.backend}")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        shards = synthetic_shards(tmp, args.seq_len)
        for model in args.models:
            for kind in ("causal", "staggered"):
                if args.budget_s is not None and time.monotonic() - start > args.budget_s:
                    r = results[f"{model}/{kind}"] = {
                        "skipped": f"past the {args.budget_s:.0f} s budget"}
                    print(f"{model:>6} {kind:<10} skipped (budget): {r['skipped']}")
                    continue
                else:
                    r = results[f"{model}/{kind}"] = run(model, kind, args, shards, tmp)
                if "error" in r:
                    print(f"{model:>6} {kind:<10} error: {r['error']}")
                    continue
                mfu = f"  MFU {r['mfu'] * 100:5.1f}%" if "mfu" in r else ""
                print(f"{model:>6} {kind:<10} {r['tokens_per_s']:12,.0f} tokens/s{mfu}  "
                      f"peak memory {r['memory_gb']:.1f} GB", flush=True)
            c, s = results[f"{model}/causal"], results[f"{model}/staggered"]
            if "tokens_per_s" in c and "tokens_per_s" in s:
                print(f"{model:>6} set diffusion / causal: step-time ratio "
                      f"{c['tokens_per_s'] / s['tokens_per_s']:.2f}x")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": device, "args": vars(args), "results": results}, fh, indent=2)
    failed = [k for k, r in results.items() if "error" in r]
    skipped = [k for k, r in results.items() if "skipped" in r]
    if failed:
        print(f"failed: {', '.join(failed)}")
    if skipped:
        print(f"skipped (budget): {', '.join(skipped)}")
    return 1 if failed else 3 if skipped else 0


if __name__ == "__main__":
    sys.exit(main())
