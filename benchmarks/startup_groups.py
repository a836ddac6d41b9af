"""Start-up at N ranks: the process groups a training job creates and its time to the first step,
side by side in one run: ``before`` (megatron-core's gloo copies of the data-parallel groups,
DeepSpeed's ZeRO-1, the default until issue 50), ``deepspeed`` (no gloo copies, DeepSpeed's
ZeRO-1) and ``after`` (today's default: no gloo copies, megatron-core's distributed optimizer).

    python benchmarks/startup_groups.py [--ranks 8] [--tensor 2] [--pipeline 2]

After one warm-up launch (which fills caches), each variant runs ``--repeats`` times,
alternated, ``setdiff-train --nproc-per-node N`` on the tiny model for one step on the
built-in sonnets (gloo, the CPU). Every rank counts its ``torch.distributed.new_group`` calls
(a ``sitecustomize`` put on the ranks' path wraps it), and the time to the first step is from
the launch to the first line of ``metrics.jsonl``. The "before" variant asks megatron-core for
its gloo groups (``create_gloo_process_groups=True``, through the same wrapper). Results go to
``benchmarks/results/startup_groups.json``.
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

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

SITECUSTOMIZE = '''
import atexit, json, os
import torch.distributed as dist

_count = [0]
_new_group = dist.new_group

def new_group(*args, **kwargs):
    _count[0] += 1
    return _new_group(*args, **kwargs)

dist.new_group = new_group

if os.environ.get("STARTUP_GLOO_GROUPS") == "1":
    import megatron.core.parallel_state as ps
    _init = ps.initialize_model_parallel

    def initialize_model_parallel(*args, **kwargs):
        kwargs["create_gloo_process_groups"] = True
        return _init(*args, **kwargs)

    ps.initialize_model_parallel = initialize_model_parallel

def _write():
    if "RANK" in os.environ and os.environ.get("STARTUP_COUNTS"):
        path = os.path.join(os.environ["STARTUP_COUNTS"], "rank" + os.environ["RANK"] + ".json")
        with open(path, "w") as fh:
            json.dump({"new_group": _count[0]}, fh)

atexit.register(_write)
'''


def alternated(variants, repeats: int, measure) -> dict:
    """``{variant: [measure(variant, round) for each round]}``: every variant ``repeats`` times,
    in the reverse order every other round, so that a drift of the machine falls on each
    alike. The benchmarks' side-by-side runs."""
    rows: dict = {v: [] for v in variants}
    for i in range(repeats):
        for v in variants if i % 2 == 0 else variants[::-1]:
            rows[v].append(measure(v, i))
    return rows


def means(rows: dict) -> dict:
    """``{variant: {key: mean}}`` of :func:`alternated`'s rows of numbers."""
    return {v: {k: sum(r[k] for r in rs) / len(rs) for k in rs[0]} for v, rs in rows.items()}


def write_results(name: str, out: dict) -> None:
    """``out`` as ``benchmarks/results/<name>.json``."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(out, indent=2) + "\n")


def shards(directory: Path) -> Path:
    sys.path.insert(0, str(ROOT / "tests"))
    from helpers import sonnet_shards

    return Path(sonnet_shards(str(directory)))


def run(variant: str, data: Path, work: Path, args) -> dict:
    counts = work / f"counts-{variant}"
    counts.mkdir()
    site = work / "site"
    env = dict(os.environ, PYTHONPATH=f"{site}:{os.environ.get('PYTHONPATH', '')}",
               STARTUP_COUNTS=str(counts),
               STARTUP_GLOO_GROUPS="1" if variant.startswith("before") else "0")
    run_dir = work / f"run-{variant}"
    deepspeed = ["zero.implementation=deepspeed"] if not variant.startswith("after") else []
    cmd = [sys.executable, "-m", "setdiff_dist.cli.train", "--nproc-per-node", str(args.ranks),
           "--config", "configs/tiny-cpu.yaml", f"run_dir={run_dir}", f"data.train_shards={data}",
           "data.seq_len=32", "model.vocab_size=257", "train.steps=1", "train.log_interval=1",
           f"data.global_batch_size={args.ranks}", "data.micro_batch_size=1",
           "train.tensorboard=false", "checkpoint.save_at_end=false",
           f"parallel.tensor={args.tensor}", f"parallel.pipeline={args.pipeline}", *deepspeed]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    first = None
    metrics = run_dir / "metrics.jsonl"
    while proc.poll() is None:
        if first is None and metrics.exists() and metrics.stat().st_size:
            first = time.monotonic() - start
        time.sleep(0.05)
    if proc.returncode != 0:
        sys.exit(f"{variant}: setdiff-train failed:\n{proc.stderr.read()[-3000:]}")
    per_rank = [json.loads((counts / f"rank{r}.json").read_text())["new_group"]
                for r in range(args.ranks)]
    return {"new_group_per_rank": per_rank, "seconds_to_first_step": first,
            "seconds_total": time.monotonic() - start}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--tensor", type=int, default=2)
    ap.add_argument("--pipeline", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2, help="runs of each variant, alternated")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="startup-"))
    (work / "site").mkdir()
    (work / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    data = shards(work / "data")
    out = {"ranks": args.ranks, "tensor": args.tensor, "pipeline": args.pipeline}
    run("warmup", data, work, args)  # (the first launch fills caches: neither variant pays it)

    def measure(variant, i):
        r = run(f"{variant}{i}", data, work, args)
        print(f"{variant:9s}: {max(r['new_group_per_rank'])} process groups created per "
              f"rank, first step at {r['seconds_to_first_step']:.1f} s", flush=True)
        return r

    out.update(alternated(("before", "deepspeed", "after"), args.repeats, measure))
    write_results("startup_groups", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
