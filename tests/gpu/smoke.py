"""Stage 1 of tests/gpu/run.sh: the installed stack works on this device, in well under a minute.

    python tests/gpu/smoke.py [--device cuda|cpu]

Imports the stack, joins a one-rank process group through setdiff-dist's own initialisation
(NCCL on a GPU, gloo on the CPU) and checks an all-reduce, then runs one forward and backward of
the staggered NELBO on a 2-layer megatron-core model on the device. The last line starts with
``RESULT:``; the exit code is 0 only if everything worked.
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import sys
import time

START = time.monotonic()
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # helpers


def main() -> int:
    import torch

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "cpu"),
                    default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"RESULT: failed: torch {torch.__version__} sees no CUDA device "
              f"(CUDA build: {torch.version.cuda})")
        return 1
    versions = {"torch": torch.__version__}
    for module in ("deepspeed", "megatron.core", "webdataset", "safetensors", "tokenizers",
                   "setdiff_dist"):
        mod = importlib.import_module(module)
        versions[module] = getattr(mod, "__version__", "?")
        print(f"import {module} {versions[module]} from {os.path.dirname(mod.__file__)}")
    imported = time.monotonic() - START

    import torch.distributed as dist
    from helpers import process_group, tiny_nelbo_step

    backend = "nccl" if args.device == "cuda" else "gloo"
    where = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    with process_group(backend):
        one = torch.ones(4, device=args.device)
        dist.all_reduce(one)
        assert one.sum().item() == 4, "all-reduce over a world of one changed the tensor"
        nll, grads = tiny_nelbo_step("sdpa", device=args.device)
        loss = nll.mean().item()
        bad = [n for n, g in grads.items() if g is None or not torch.isfinite(g).all()]
        assert math.isfinite(loss) and not bad, f"non-finite loss {loss} or gradients {bad}"
        assert any(g.abs().sum() > 0 for g in grads.values()), "all gradients are zero"
        if args.device == "cuda":
            torch.cuda.synchronize()
    print(f"RESULT: torch {versions['torch']}, deepspeed {versions['deepspeed']}, "
          f"megatron-core {versions['megatron.core']} on {where}; {backend} init, all-reduce, "
          f"NELBO forward/backward (per-token NLL {loss:.3f}, {len(grads)} gradients); "
          f"imports {imported:.1f} s, total {time.monotonic() - START:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
