"""The scale model's table: exposed communication and predicted MFU of the 1.3B and 8B models
at 8 / 64 / 256 / 1024 GPUs, before the overlap (``zero.overlap_comm=false``: DeepSpeed's
BF16_Optimizer all-reduces the gradients after the backward and all-gathers the parameters after
the step), with the gradient reduction overlapped (a reduce-scatter from the last micro-batch's
backward; ``zero.overlap_param_gather=false``), and the default, which also gathers the
parameters during the next forward.

    python benchmarks/scale_model.py [--hardware h100] [--seq-len 2048] [--tokens 1048576]

Each row is ``setdiff-train --dry-run --world-size N --hardware H`` of the config: bf16,
ZeRO-1, one sequence per micro-batch, a global batch of ``--tokens`` tokens (more where the
data-parallel size needs more sequences: one per rank). The 1.3B model runs TP 1; the 8B model
TP 4 with sequence parallelism (its ZeRO-1 state does not fit 80 GB per GPU at TP 1 on 8 GPUs).
Nothing runs on a GPU: these are predictions (setdiff_dist.train.scale), with its stated peaks
and efficiencies.
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

MODELS = {"1.3b": [], "8b": ["parallel.tensor=4", "parallel.sequence_parallel=true"]}
WORLDS = (8, 64, 256, 1024)


# (zero.overlap_comm, zero.overlap_param_gather) of the three columns
SETTINGS = {"before": (False, False), "reduce": (True, False), "after": (True, True)}


def row(model, world, setting, args):
    from setdiff_dist.config import load_config
    from setdiff_dist.train.plan import plan

    tp = 4 if model == "8b" else 1
    seqs = max(args.tokens // args.seq_len, world // tp)
    cfg = load_config(os.path.join(ROOT, "configs", "models", f"{model}.yaml"), [
        f"data.seq_len={args.seq_len}", "data.micro_batch_size=1",
        f"data.global_batch_size={seqs}", "train.precision=bf16", "zero.stage=1",
        f"zero.overlap_comm={str(SETTINGS[setting][0]).lower()}",
        f"zero.overlap_param_gather={str(SETTINGS[setting][1]).lower()}", *MODELS[model]])
    p = plan(cfg, world)
    return p, p.predict(cfg, args.hardware)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hardware", default="h100")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--tokens", type=int, default=1 << 20)
    args = ap.parse_args(argv)
    from setdiff_dist.quiet import quiet

    quiet()
    print("exposed communication per step and MFU: before the overlap / gradient reduction "
          "overlapped / and the parameter gather (the default)")
    print(f"{'model':>5} {'GPUs':>5} {'layout':>15} {'tokens':>6} {'compute':>8} "
          f"{'exposed ms':>18} {'MFU %':>18} {'memory':>7}")
    for model in MODELS:
        for world in WORLDS:
            got = {s: row(model, world, s, args) for s in SETTINGS}
            p, after = got["after"]
            exposed = " / ".join(f"{got[s][1].exposed * 1e3:.0f}" for s in SETTINGS)
            mfu = " / ".join(f"{got[s][1].mfu * 100:.1f}" for s in SETTINGS)
            layout = f"TP{p.tensor} DP{p.data} x{p.micro_batches}"
            print(f"{model:>5} {world:>5} {layout:>15} {after.tokens / 2**20:>5.1f}M "
                  f"{after.compute * 1e3:>6.0f}ms {exposed:>18} {mfu:>18} "
                  f"{max(s.total for s in p.stages) / 2**30:>6.1f}G")
    print(f"(x N: micro-batches per rank per step; {after.hardware.source})")


if __name__ == "__main__":
    main()
