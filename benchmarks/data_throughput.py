"""Throughput of setdiff-prep (tokens/s) and of the training reader (tokens/s, 0 vs 2 workers),
and how the reader scales with the number of shards.

    python benchmarks/data_throughput.py [--seq-len 1024] [--tokenizer gpt2] [--only-shards]

Part 1 builds the offline corpus (Shakespeare + KJV, cached), prepares it, then reads the
training split through TokenLoader as training would; prints both numbers and the 2-worker /
in-process ratio.

Part 2 prepares one text twice, as 6 shards and as 2,000 shards, and reads the same shuffled
samples from each with the reader's default settings (``verify="size"``: sizes checked, at most
32 shards open) and as the reader used to work (``verify="full"``, every shard open for good:
each shard hashed in full by each process on first touch); per setting it prints tokens/s,
bytes read per sample (``rchar`` of /proc/self/io) and the most files open at once. Part 3
times the start of an epoch's shuffle: ``torch.randperm(n)`` (the old order) against
:class:`~setdiff_dist.data.permutation.Permutation`.
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


def _rchar() -> int:
    with open("/proc/self/io") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("rchar:"))


def _open_files() -> int:
    return len(os.listdir("/proc/self/fd"))


def shard_scaling(seq_len: int, samples: int) -> None:
    from setdiff_dist.data import sample_text

    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "text.txt")
        with open(src, "w") as fh:  # numbered copies of the sonnets: ~2,000 samples of L bytes
            for c in range(samples * seq_len // len(sample_text()) + 1):
                fh.write(f"{c}\n\n".join(sample_text().split("\n\n")) + "\n\n")
        dirs = {}
        for shards in (6, 2000):
            dirs[shards] = os.path.join(tmp, f"s{shards}")
            m = prepare([src], "bytes", seq_len, dirs[shards], valid_every=0, workers=1,
                        samples_per_shard=max(1, -(-samples // shards)), progress=False)
            dirs[shards] = (dirs[shards], len(m["splits"]["train"]["shards"]))
        reads = 1000
        print(f"\nreader over {reads} shuffled samples of {seq_len} tokens (in-process):")
        print("| shards | reader | tokens/s | bytes read / sample | files open |")
        print("| --- | --- | --- | --- | --- |")
        rates = {}
        for shards, (directory, n) in dirs.items():
            for name, kw in (("before: full hash on first touch, all kept open",
                              {"verify": "full", "max_open": 10 ** 9}),
                             ("now: sizes checked, 32 open at most", {"verify": "size"})):
                s = ShardSet(directory, "train", **kw)
                loader = TokenLoader(s, global_batch=8, micro_batch=8, num_workers=0, seed=0)
                it, base_files = iter(loader), _open_files()
                r0, t0, most = _rchar(), time.perf_counter(), 0
                for _ in range(reads // 8):
                    next(it)
                    most = max(most, _open_files() - base_files)
                dt, nbytes = time.perf_counter() - t0, _rchar() - r0
                rates[shards, name[:3]] = reads * seq_len / dt
                print(f"| {n} | {name} | {reads * seq_len / dt:,.0f} | {nbytes / reads:,.0f} | "
                      f"{most} |")
                s.close()
        for shards, (_, n) in dirs.items():
            print(f"{n} shards: now / before = "
                  f"{rates[shards, 'now'] / rates[shards, 'bef']:.2f}x tokens/s")


def shuffle_start(n: int) -> None:
    import torch

    from setdiff_dist.data.permutation import Permutation

    t = time.perf_counter()
    perm = torch.randperm(n)
    old = time.perf_counter() - t
    t = time.perf_counter()
    p = Permutation(n, seed=0, epoch=0)
    p[0]
    new = time.perf_counter() - t
    print(f"\nshuffle of n = {n:,}: torch.randperm {old:.3f} s and {perm.numel() * 8 / 2**20:,.0f} "
          f"MiB per process; Permutation {new * 1e3:.3f} ms and O(1) memory "
          f"({old / new:,.0f}x faster to start)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--tokenizer", default="gpt2")
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--only-shards", action="store_true",
                    help="parts 2 and 3 only (no corpus download, no tokenizer)")
    args = ap.parse_args()
    if not args.only_shards:
        prep_and_read(args)
    shard_scaling(args.seq_len, 2000)
    shuffle_start(10 ** 8)


def prep_and_read(args) -> None:
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
