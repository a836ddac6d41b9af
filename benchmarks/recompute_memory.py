"""Peak activation memory and step time of one training forward/backward with and without
activation recompute (``train.recompute``), side by side in one run.

    python benchmarks/recompute_memory.py --model 110m --seq-len 1024 [--backend sdpa]

Each mode runs in its own process (peak RSS is per process): the megatron-core model of the
config (fp32, one rank, gloo), its gradients allocated up front, then one staggered-NELBO
forward and backward at ``2L`` tokens. The activation peak is the process's peak RSS during
that step minus its resident memory just before it (model, gradients and imports). It prints
each mode's peak and time as a ratio to no recompute.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _rss_gb() -> float:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30


def measure(model: str, seq_len: int, batch: int, backend: str, mode: str) -> dict:
    import ctypes

    import torch

    from setdiff_dist.config import load_config
    from setdiff_dist.diffusion import make_schedule, nelbo, sample_orders
    from setdiff_dist.model.forward import set_diffusion_inputs, set_diffusion_nll
    from setdiff_dist.model.transformer import build_model, transformer_config
    from setdiff_dist.parallel import initialize_model_parallel

    initialize_model_parallel(seed=0, backend="gloo")
    cfg = load_config(os.path.join(ROOT, "configs", "models", f"{model}.yaml"),
                      [f"model.attention_backend={backend}", "model.hidden_dropout=0.0"]).model
    net = build_model(cfg, transformer_config(cfg, recompute=mode), seed=0)
    for p in net.parameters():
        p.grad = torch.zeros_like(p)
    x = torch.randint(0, cfg.vocab_size, (batch, seq_len),
                      generator=torch.Generator().manual_seed(0))
    o = sample_orders(make_schedule("staggered", seq_len, mean_set_size=4), seq_len,
                      range(batch), 0)
    inp = set_diffusion_inputs(x, o, net.mask_id, backend)
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    before = _rss_gb()
    start = time.perf_counter()
    nll = set_diffusion_nll(net(inp.tokens, inp.positions, inp.attention_mask, inp.logits_from),
                            x, inp)
    nelbo(nll, o).per_token.backward()
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return {"mode": mode, "activation_peak_gb": peak - before, "seconds": seconds,
            "resident_before_gb": before}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="110m")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--backend", default="sdpa")
    ap.add_argument("--modes", nargs="+", default=["none", "selective", "full"])
    ap.add_argument("--one", help=argparse.SUPPRESS)  # a child measuring one mode
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    if args.one:
        print(json.dumps(measure(args.model, args.seq_len, args.batch, args.backend, args.one)))
        return 0
    results = []
    for mode in args.modes:
        res = subprocess.run([sys.executable, __file__, "--one", mode, "--model", args.model,
                              "--seq-len", str(args.seq_len), "--batch", str(args.batch),
                              "--backend", args.backend], capture_output=True, text=True)
        if res.returncode:
            print(f"{mode}: failed\n{res.stderr[-2000:]}")
            return 1
        results.append(json.loads(res.stdout.strip().splitlines()[-1]))
    base = results[0]
    print(f"{args.model}, L={args.seq_len} ({2 * args.seq_len} tokens in the model), batch "
          f"{args.batch}, {args.backend}, fp32, one CPU rank")
    print(f"{'recompute':<10} {'activation peak':>16} {'ratio':>6} {'fwd+bwd':>9} {'ratio':>6}")
    for r in results:
        print(f"{r['mode']:<10} {r['activation_peak_gb']:13.2f} GB "
              f"{r['activation_peak_gb'] / base['activation_peak_gb']:6.2f} "
              f"{r['seconds']:8.1f}s {r['seconds'] / base['seconds']:6.2f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "results": results}, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
