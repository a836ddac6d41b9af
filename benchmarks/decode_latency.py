"""Decoding speed, side by side in one run for one model (batch 1, greedy):

- per-step latency of KV-cached set decoding (one [MASK] query and one committed token per
  step), of causal-LM KV-cached decoding, and of MDLM decoding without a cache;
- tokens/s and tokens/step of set decoding at several (window W, threshold tau).

    python benchmarks/decode_latency.py --checkpoint runs/tiny-cpu [--max-new-tokens 64]

The latencies need only the architecture, so the three modes run the same weights; the (W, tau)
sweep is meaningful with a trained set-diffusion checkpoint (scripts/main.sh makes one).
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default="runs/tiny-cpu")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompt", default="Shall I compare thee to a summer's day?")
    args = ap.parse_args()

    from setdiff_dist.inference.decoder import CausalDecoder, MDLMDecoder, Sampling, SetDecoder
    from setdiff_dist.inference.weights import build_inference_model

    model, cfg, tok = build_inference_model(args.checkpoint)
    greedy = Sampling(greedy=True)
    prompt = tok.encode(args.prompt)
    N = min(args.max_new_tokens, cfg.data.seq_len - len(prompt) - 1)
    set_dec = SetDecoder(model, tok, context=cfg.data.seq_len)
    causal = CausalDecoder(model, tok, context=cfg.data.seq_len)
    base = MDLMDecoder(model, tok, context=cfg.data.seq_len)
    runs = {
        "set decoding (W=1, tau=inf, KV cache)":
            lambda: set_dec.generate([prompt], N, window=1, sampling=greedy)[0],
        "causal-LM decoding (KV cache)":
            lambda: causal.generate([prompt], N, window=1, sampling=greedy)[0],
        "MDLM decoding (no cache, 1 token/step)":
            lambda: base.mdlm(prompt, N, sampling=greedy),
    }
    print(f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'}, "
          f"{torch.get_num_threads()} threads; checkpoint {args.checkpoint} "
          f"({cfg.model.num_layers} layers x {cfg.model.hidden_size}), prompt {len(prompt)} "
          f"tokens, {N} new tokens, batch 1, greedy, median of {args.repeats}")
    latency = {}
    for name, fn in runs.items():
        fn()  # warm-up
        times = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            r = fn()
            times.append((time.perf_counter() - t) / r.steps)
        latency[name] = statistics.median(times)
    ref = latency["causal-LM decoding (KV cache)"]
    for name, t in latency.items():
        print(f"  per-step latency  {name:<42} {t * 1e3:7.2f} ms   {t / ref:5.2f}x causal")
    print("  set decoding sweep (tokens/s, tokens/step):")
    for window, tau in [(1, math.inf), (4, math.inf), (4, 0.9), (8, 0.9), (8, 0.5), (16, 0.5),
                        (16, 0.1)]:
        rates, per_step = [], []
        for _ in range(args.repeats):
            t = time.perf_counter()
            r = set_dec.generate([prompt], N, window=window, threshold=tau, sampling=greedy)[0]
            rates.append(len(r.tokens) / (time.perf_counter() - t))
            per_step.append(r.tokens_per_step)
        print(f"    W={window:<3} tau={tau:<4}  {statistics.median(rates):8.1f} tokens/s  "
              f"{statistics.median(per_step):5.2f} tokens/step")


if __name__ == "__main__":
    main()
