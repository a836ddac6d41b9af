"""Load on ``setdiff-serve``: requests streamed from 127.0.0.1 at concurrency 1, 4 and 16 (OpenAI's
wire format, httpx on one event loop), for a set-diffusion checkpoint and a causal checkpoint,
side by side in one run.

    python benchmarks/serve_load.py                      # the main job's task checkpoints
    python benchmarks/serve_load.py --checkpoint RUN --causal-checkpoint RUN [--workload text]

By default it serves the two checkpoints the main job trains on chain sums
(``runs/tiny-cpu/task/setdlm`` and ``task/ar``, from ``scripts/main.sh``) with the main job's
held-out problems as requests (``--workload task``: the question as prompt, up to 40 new tokens,
ended by the model's end-of-text as a client would let it); set serving runs at the
checkpoint's own threshold (``decode.threshold``: 0.9) unless ``--threshold`` is given.
``--workload text``: 64 requests of 4-40 corpus words and 16-96 new tokens (seeded), decoded to
their length (``ignore_eos``); without checkpoints and without the main job's task runs, both
are trained on the main job's corpus shards (``data/tiny-cpu``) with ``configs/tiny-cpu.yaml``,
the causal one with ``order.kind=causal``.

Each request streams, so the time to its first token is measured where a client sees it. Per
model and concurrency: output tokens/s over the whole level, p50 / p99 latency and time to
first token, tokens per forward step; the ratio of tokens/s to concurrency 1, and set serving's
tokens/s over causal serving's at each concurrency. Every level is bounded in time
(``--level-seconds``): requests not started by then are counted as skipped. Results go to
``benchmarks/results/serve_load.json`` and a plot to ``serve_load.png`` (throughput, latency,
tokens per step).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
TASK_RUNS = ROOT / "runs" / "tiny-cpu" / "task"  # (scripts/main.sh, step 5)
TASK_TEST = ROOT / "data" / "chain-20000" / "test-200.jsonl"


def train(run_dir: Path, steps: int, *overrides) -> Path:
    if (run_dir / "latest").exists():
        return run_dir
    data = ROOT / "data" / "tiny-cpu"
    if not (data / "manifest.json").exists():
        sys.exit(f"no {data}: run scripts/main.sh once (it prepares the data), or give "
                 "--checkpoint and --causal-checkpoint")
    print(f"training {run_dir.name} ({steps} steps) ...", file=sys.stderr, flush=True)
    cmd = [sys.executable, "-m", "setdiff_dist.cli.train", "--nproc-per-node", "2", "--config",
           str(ROOT / "configs" / "tiny-cpu.yaml"), f"run_dir={run_dir}",
           f"data.train_shards={data}", f"train.steps={steps}", *overrides]
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    return run_dir


class Server:
    def __init__(self, checkpoint: Path, max_batch: int, log: Path):
        ready = Path(tempfile.mkdtemp()) / "ready"
        self.log = open(log, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "setdiff_dist.cli.serve", "--checkpoint", str(checkpoint),
             "--port", "0", "--ready-file", str(ready), "--served-model-name", "bench",
             "--max-batch-size", str(max_batch), "--max-queue", "256", "--log-level",
             "warning"], stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT)
        deadline = time.monotonic() + 300
        while not ready.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                sys.exit(f"setdiff-serve did not start: see {log}")
            time.sleep(0.1)
        self.url = f"http://{ready.read_text().strip()}/v1"

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout=120)
        self.log.close()
        return code


def workload(n: int, seed: int, context: int, text: str) -> list:
    """``n`` requests: a prompt of 4-40 words from the corpus and 16-96 new tokens each."""
    rng = random.Random(seed)
    words = text.split()
    out = []
    for _ in range(n):
        k = rng.randint(4, 40)
        start = rng.randrange(0, len(words) - k)
        out.append({"prompt": " ".join(words[start:start + k]),
                    "max_tokens": rng.choice([16, 32, 48, 64, 96]), "seed": rng.randrange(1000)})
    return out


def task_workload(path: Path, n: int) -> list:
    """The first ``n`` held-out problems of ``path``: the question as the prompt, up to 40 new
    tokens, ended at end-of-text (a worked solution is 8-40 tokens)."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()][:n]
    return [{"prompt": r["prompt"], "max_tokens": 40, "seed": 0, "ignore_eos": False,
             "temperature": 0.0} for r in rows]  # (greedy, as setdiff-compare decodes)


def run_level(url: str, requests: list, concurrency: int, seconds: float,
              extra: dict = None) -> dict:
    """Send ``requests`` with ``concurrency`` clients at a time (one asyncio loop and httpx, as
    load generators do: a client per thread would spend the 2 cores on parsing); per request
    its latency, time to first token and tokens."""
    return asyncio.run(_level(url, requests, concurrency, seconds, extra or {}))


async def _level(url, requests, concurrency, seconds, extra):
    import httpx

    todo = list(enumerate(requests))
    results, skipped = [], []
    start = time.perf_counter()

    async def one(client, req):
        t0 = time.perf_counter()
        first, usage, steps = None, None, None
        body = {"model": "bench", "prompt": req["prompt"], "max_tokens": req["max_tokens"],
                "seed": req["seed"], "stream": True, "stream_options": {"include_usage": True},
                "ignore_eos": req.get("ignore_eos", True), **extra}
        if "temperature" in req:
            body["temperature"] = req["temperature"]
        async with client.stream("POST", f"{url}/completions", json=body) as res:
            if res.status_code != 200:
                raise RuntimeError(f"{res.status_code}: {(await res.aread())[:300]!r}")
            async for line in res.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                choices = chunk.get("choices") or []
                if choices and choices[0]["text"] and first is None:
                    first = time.perf_counter() - t0
                if choices and choices[0]["finish_reason"]:
                    steps = choices[0]["forward_steps"]
                if chunk.get("usage"):
                    usage = chunk["usage"]
        results.append({"latency": time.perf_counter() - t0, "ttft": first or 0.0,
                        "tokens": usage["completion_tokens"], "steps": steps})

    async def worker(client):
        while todo:
            i, req = todo.pop(0)
            if time.perf_counter() - start > seconds:
                skipped.append(i)
                continue
            await one(client, req)

    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    wall = time.perf_counter() - start
    tokens = sum(r["tokens"] for r in results)
    lat = sorted(r["latency"] for r in results)
    ttft = sorted(r["ttft"] for r in results)
    pct = lambda xs, q: xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")  # noqa
    return {"concurrency": concurrency, "done": len(results), "skipped": len(skipped),
            "seconds": wall, "tokens": tokens, "tokens_per_s": tokens / wall,
            "latency_p50": statistics.median(lat), "latency_p99": pct(lat, 0.99),
            "ttft_p50": statistics.median(ttft), "ttft_p99": pct(ttft, 0.99),
            "tokens_per_step": tokens / max(sum(r["steps"] or 0 for r in results), 1)}


def plot(table: dict, path: Path, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b, t) = plt.subplots(1, 3, figsize=(14, 3.8))
    for name, rows in table.items():
        c = [r["concurrency"] for r in rows]
        line, = a.plot(c, [r["tokens_per_s"] for r in rows], "o-", label=name)
        b.plot(c, [r["latency_p50"] for r in rows], "o-", color=line.get_color(),
               label=f"{name} latency p50")
        b.plot(c, [r["ttft_p50"] for r in rows], "x--", color=line.get_color(),
               label=f"{name} TTFT p50")
        t.plot(c, [r["tokens_per_step"] for r in rows], "o-", color=line.get_color(),
               label=name)
    t.axhline(1.0, color="grey", lw=0.8, ls=":")
    t.set_title("tokens per forward step")
    for ax, label in ((a, "output tokens/s"), (b, "seconds"), (t, "tokens / step")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    a.set_title("throughput")
    b.set_title("latency and time to first token")
    if title:  # (which checkpoints, which requests: a PNG travels without its JSON)
        fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default=None,
                    help="a set-diffusion run or checkpoint (default: the main job's "
                         "runs/tiny-cpu/task/setdlm when it exists)")
    ap.add_argument("--causal-checkpoint", default=None,
                    help="a causal one (default: the main job's runs/tiny-cpu/task/ar)")
    ap.add_argument("--workload", choices=["task", "text"], default=None,
                    help="task: the main job's held-out chain sums (--task-data); text: "
                         "corpus prompts decoded to a fixed length (default: task when the "
                         "main job's task checkpoints are served)")
    ap.add_argument("--task-data", default=str(TASK_TEST),
                    help="the task workload's problems (a setdiff-tasks gsm / chain file)")
    ap.add_argument("--work", default=str(ROOT / "runs" / "serve_load"),
                    help="where trained checkpoints and server logs go")
    ap.add_argument("--train-steps", type=int, default=300)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--max-batch-size", type=int, default=16)
    ap.add_argument("--level-seconds", type=float, default=240.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threshold", type=float, default=None,
                    help="set decoding's threshold (default: the checkpoint's decode section)")
    ap.add_argument("--out", default=str(RESULTS / "serve_load.json"))
    ap.add_argument("--only", choices=["set", "causal"], default=None,
                    help="measure one of the two checkpoints")
    args = ap.parse_args()

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    task_runs = all((TASK_RUNS / m / "checkpoints" / "latest").exists() for m in ("setdlm", "ar"))
    if args.checkpoint is None and args.causal_checkpoint is None and task_runs:
        args.checkpoint, args.causal_checkpoint = TASK_RUNS / "setdlm", TASK_RUNS / "ar"
        args.workload = args.workload or "task"
    args.workload = args.workload or "text"
    models = {
        "set": Path(args.checkpoint) if args.checkpoint else
        train(work / "set", args.train_steps),
        "causal": Path(args.causal_checkpoint) if args.causal_checkpoint else
        train(work / "causal", args.train_steps, "order.kind=causal"),
    }
    from setdiff_dist.data import sample_text

    if args.workload == "task":
        if not Path(args.task_data).exists():
            sys.exit(f"--task-data {args.task_data}: no such file (scripts/main.sh makes it)")
        requests = task_workload(Path(args.task_data), args.requests)
        what = f"{len(requests)} held-out problems of {args.task_data}, up to 40 new tokens"
    else:
        requests = workload(args.requests, args.seed, 128, sample_text())
        what = f"{args.requests} requests (prompts of 4-40 words, 16-96 new tokens, seed " \
               f"{args.seed})"
    print(f"{what}; set: {models['set']}, causal: {models['causal']}; --max-batch-size "
          f"{args.max_batch_size}, {os.cpu_count()} CPUs", flush=True)
    table = {}
    for name, ckpt in models.items():
        if args.only and name != args.only:
            continue
        server = Server(ckpt, args.max_batch_size, work / f"serve-{name}.log")
        try:
            extra = {"threshold": args.threshold} if name == "set" and args.threshold else {}
            run_level(server.url, requests[:4], 2, 60, extra)  # (warm-up)
            rows = []
            for c in args.concurrency:
                r = run_level(server.url, requests, c, args.level_seconds, extra)
                rows.append(r)
                r["vs_c1"] = r["tokens_per_s"] / rows[0]["tokens_per_s"]
                print(f"  {name:<7} c={c:<3} {r['done']:>3} done {r['skipped']:>3} skipped  "
                      f"{r['tokens_per_s']:8.1f} tok/s ({r['vs_c1']:.2f}x c=1)  "
                      f"latency p50 {r['latency_p50']:.2f} s p99 {r['latency_p99']:.2f} s  "
                      f"TTFT p50 {r['ttft_p50']:.3f} s p99 {r['ttft_p99']:.3f} s  "
                      f"{r['tokens_per_step']:.2f} tok/step", flush=True)
            table[name] = rows
        finally:
            code = server.stop()
        print(f"  ({name}: the server drained and exited {code})")
    ratios = {}
    if "set" in table and "causal" in table:
        for s_row, c_row in zip(table["set"], table["causal"]):
            ratios[s_row["concurrency"]] = s_row["tokens_per_s"] / c_row["tokens_per_s"]
            print(f"  set / causal tokens/s at c={s_row['concurrency']}: "
                  f"{ratios[s_row['concurrency']]:.2f}x")
    RESULTS.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"requests": len(requests), "seed": args.seed,
                                          "workload": args.workload,
                                          "checkpoints": {k: str(v) for k, v in models.items()},
                                          "threshold": args.threshold, "table": table,
                                          "set_vs_causal": ratios}, indent=1))
    plot(table, Path(args.out).with_suffix(".png"),
         f"set: {models['set']}   causal: {models['causal']}\n{what}")
    print(f"-> {args.out}, {Path(args.out).with_suffix('.png')}")


if __name__ == "__main__":
    main()
