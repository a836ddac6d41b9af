"""Throughput of setdiff-prep (tokens/s) and of the training reader (tokens/s, 0 vs 2 workers).

    python benchmarks/data_throughput.py [--seq-len 1024] [--tokenizer gpt2]

Builds the offline corpus (Shakespeare + KJV, cached), prepares it, then reads the training split
through TokenLoader as training would; prints both numbers and the 2-worker / in-process ratio.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

from data_prep import corpus
from data_prep.prep import prepare
from setdiff_dist.data.loader import TokenLoader
from setdiff_dist.data.shards import ShardSet


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--tokenizer", default="gpt2")
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=300)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        raw = os.path.join(tmp, "raw")
        corpus.build(raw, ["shakespeare", "kjv"])
        out = os.path.join(tmp, "shards")
        t = time.perf_counter()
        m = prepare([raw], args.tokenizer, args.seq_len, out, workers=os.cpu_count(),
                    progress=False)
        wall = time.perf_counter() - t
        print(f"prep: {m['input_tokens']} tokens ({args.tokenizer}, L={args.seq_len}) in "
              f"{wall:.1f} s = {m['input_tokens'] / wall:,.0f} tokens/s end to end "
              f"({m['throughput_tokens_per_s']:,.0f} tokens/s tokenizing + writing), "
              f"{os.cpu_count()} workers")
        shards = ShardSet(out, "train", verify="eager")
        rates = {}
        for workers in (0, 2):
            loader = TokenLoader(shards, global_batch=args.micro_batch,
                                 micro_batch=args.micro_batch, num_workers=workers, seed=0)
            it = iter(loader)
            next(it)  # start-up (worker processes) is not throughput
            t = time.perf_counter()
            for _ in range(args.steps):
                next(it)
            rates[workers] = args.steps * args.micro_batch * args.seq_len / (
                time.perf_counter() - t)
            print(f"reader, {workers} workers: {rates[workers]:,.0f} tokens/s "
                  f"({args.steps} micro-batches of {args.micro_batch} x {args.seq_len})")
        print(f"reader ratio, 2 workers / in-process: {rates[2] / rates[0]:.2f}x")


if __name__ == "__main__":
    main()
