"""What a background save's write costs the training thread: a thread of the training process
(the write of ``checkpoint.async_save`` before the writer process) against the writer process
(:mod:`setdiff_dist.train.writer`), side by side in one run.

    python benchmarks/background_writer.py [--mb 400] [--steps 15] [--rounds 2]

A training loop (a 4-layer transformer encoder of width 256 on one CPU thread, AdamW) is timed
while nothing else runs, while a thread of this process writes and hashes a host copy of
``--mb`` MB again and again (torch.save to /dev/shm, then SHA-256, as a save does), and while
the writer process writes the same state from the staging buffers (the thread that waits for it
only sleeps on its pipe). Prints the median step time of each, over the quiet one. On 2 cores
the writer has a core of its own in either case, so the difference is the interpreter lock.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from setdiff_dist.paths import sha256_file  # noqa: E402
from setdiff_dist.train.async_save import host_copy  # noqa: E402
from setdiff_dist.train.writer import Staging, WriterProcess  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=int, default=400)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(256, 4, 1024, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, 4, enable_nested_tensor=False)
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(8, 128, 256)

    def steps(k):
        times = []
        for _ in range(k):
            t = time.perf_counter()
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            times.append(time.perf_counter() - t)
        return times

    k = 200
    state = {f"t{i}": torch.randn(args.mb * 2**20 // 4 // k) for i in range(k)}
    path = f"/dev/shm/background_writer_{os.getpid()}.pt"
    staging = Staging()
    writer = WriterProcess(staging)
    writer.start()
    staged = host_copy(state, staging.copy)
    writes = [(torch.save, (staged, path), {}), (sha256_file, (path,), {})]
    writer.run(writes, lambda: None)  # (the writer's start-up, out of the timing)

    def in_thread(stop):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        while not stop.is_set():
            torch.save(state, path)
            sha256_file(path)

    def in_process(stop):
        while not stop.is_set():
            writer.run(writes, lambda: None)

    steps(3)
    found = {}
    for _ in range(args.rounds):
        for name, body in (("quiet", None), ("thread", in_thread), ("writer process", in_process)):
            stop = threading.Event()
            bg = threading.Thread(target=body, args=(stop,)) if body else None
            if bg:
                bg.start()
                time.sleep(0.5)
            found.setdefault(name, []).extend(steps(args.steps))
            stop.set()
            if bg:
                bg.join()
    writer.close()
    staging.close()
    os.remove(path)
    quiet = statistics.median(found["quiet"])
    print(f"training step while a background save writes {args.mb} MB (median of "
          f"{args.rounds} x {args.steps} steps):")
    for name, times in found.items():
        med = statistics.median(times)
        print(f"  {name:15s} {med * 1e3:7.1f} ms  {med / quiet:.3f}x")


if __name__ == "__main__":
    main()
