"""Per-rank peak memory and time of building (and initializing) a model at TP=1 and TP=2.

    python benchmarks/init_memory.py [--model 1.3b] [--tensor 1 2]

For each TP size, that many gloo processes (one per rank, started by torch.multiprocessing)
each build their shard of the model with :func:`setdiff_dist.model.transformer.build_model`:
megatron allocates the shard, then every rank draws only the blocks of weights it holds. Per
rank it reports the parameters it holds, the time of ``build_model``, and its peak RSS above
its resident memory just before (imports and process group), as a multiple of the shard's fp32
bytes. Drawing a full tensor per rank (the old scheme) shows as a peak well above 1x, and a time
that does not fall with TP.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))


def _rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_bytes() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _rank(rank, tp, model, out):
    import torch

    from setdiff_dist.config import load_config
    from setdiff_dist.model.transformer import build_model, transformer_config
    from setdiff_dist.parallel import initialize_model_parallel

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // tp))
    initialize_model_parallel(tensor=tp, seed=0)
    cfg = load_config(os.path.join(ROOT, "configs", "models", f"{model}.yaml"))
    config = transformer_config(cfg.model, tensor=tp)
    with open("/proc/self/clear_refs", "w") as fh:  # reset the peak (VmHWM) to now
        fh.write("5")
    before = _rss_bytes()
    start = time.perf_counter()
    built = build_model(cfg.model, config, seed=0)
    seconds = time.perf_counter() - start
    params = sum(p.numel() for p in built.parameters())
    with open(os.path.join(out, f"tp{tp}-rank{rank}.txt"), "w") as fh:
        fh.write(f"{params} {seconds} {_peak_bytes() - before}\n")


def main() -> int:
    from mp_harness import spawn

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="1.3b")
    ap.add_argument("--tensor", nargs="+", type=int, default=[1, 2])
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as out:
        for tp in args.tensor:
            spawn(_rank, tp, tp, args.model, out)
            for rank in range(tp):
                with open(os.path.join(out, f"tp{tp}-rank{rank}.txt")) as fh:
                    params, seconds, peak = fh.read().split()
                rows.append((tp, rank, int(params), float(seconds), int(peak)))
    print(f"{args.model}: build_model per rank (torch threads per rank = cores / TP)")
    print(f"{'TP':>3} {'rank':>5} {'params':>10} {'build s':>8} {'peak above start':>17} "
          f"{'/ shard fp32':>13}")
    for tp, rank, params, seconds, peak in rows:
        print(f"{tp:>3} {rank:>5} {params / 1e6:9.1f}M {seconds:8.1f} {peak / 2**30:15.2f} G "
              f"{peak / (4 * params):12.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
