"""A short request beside a very long one on ``setdiff-serve``: does the long one slow it down?

    python benchmarks/serve_neighbour.py --checkpoint runs/tiny-cpu [--tokens 64]

One server, with ``--max-completion-tokens`` raised to ``--long`` (10,000,000 by default: the
default cap, the model's context, refuses such a request with a 400, which this shows first on
the same server by asking for one more). Measured side by side in one run, greedy, one token a
step (window 1, end-of-text ignored, so every request runs to its length):

- ``alone``: a ``--tokens``-token request with nothing else running (median of ``--repeats``);
- ``beside``: the same request while a ``--long``-token request decodes in the same batch
  (streamed; it is cancelled at the end by closing its stream).

The ratio ``beside / alone`` is what the long neighbour costs the short request. Before the
per-step work was bounded by each row's window (issue 49), a 10^7-token neighbour made a
64-token request take 14.9 s against 0.15 s alone; the target is at most 2x. Results go to
``benchmarks/results/serve_neighbour.json``.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def main() -> int:
    import httpx

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", default=str(ROOT / "runs" / "tiny-cpu"))
    ap.add_argument("--tokens", type=int, default=64, help="the short request's length")
    ap.add_argument("--long", type=int, default=10_000_000, help="the long request's length")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    if not Path(args.checkpoint).exists():
        sys.exit(f"no {args.checkpoint}: run scripts/main.sh once, or give --checkpoint")

    ready = Path(tempfile.mkdtemp()) / "ready"
    log = open(RESULTS / "serve_neighbour.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "setdiff_dist.cli.serve", "--checkpoint", args.checkpoint,
         "--port", "0", "--ready-file", str(ready), "--served-model-name", "bench",
         "--max-completion-tokens", str(args.long), "--log-level", "warning"],
        stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        deadline = time.monotonic() + 300
        while not ready.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                sys.exit(f"the server did not start: see {log.name}")
            time.sleep(0.1)
        url = f"http://{ready.read_text().strip()}/v1/completions"
        body = {"model": "bench", "prompt": "Shall I compare thee", "temperature": 0,
                "window": 1, "ignore_eos": True}

        def short() -> float:
            start = time.perf_counter()
            res = httpx.post(url, json={**body, "max_tokens": args.tokens}, timeout=600)
            res.raise_for_status()
            assert res.json()["usage"]["completion_tokens"] == args.tokens
            return time.perf_counter() - start

        over = httpx.post(url, json={**body, "max_tokens": args.long + 1}, timeout=60)
        print(f"max_tokens={args.long + 1:,} (over the cap): HTTP {over.status_code}: "
              f"{over.json()['error']['message'][:100]}", flush=True)
        short()  # (warm-up)
        alone = [short() for _ in range(args.repeats)]
        stop = threading.Event()

        def neighbour():
            with httpx.stream("POST", url, json={**body, "max_tokens": args.long,
                                                 "stream": True}, timeout=600) as res:
                for _ in res.iter_lines():
                    if stop.is_set():
                        return  # (closing the stream cancels it)

        t = threading.Thread(target=neighbour, daemon=True)
        t.start()
        time.sleep(2.0)  # (it runs: thousands of steps in)
        beside = [short() for _ in range(args.repeats)]
        stop.set()
        t.join(timeout=60)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    a, b = statistics.median(alone), statistics.median(beside)
    out = {"checkpoint": args.checkpoint, "tokens": args.tokens, "long": args.long,
           "over_cap_status": over.status_code, "alone_s": alone, "beside_s": beside,
           "alone_median_s": a, "beside_median_s": b, "ratio": b / a}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "serve_neighbour.json").write_text(json.dumps(out, indent=2) + "\n")
    print(f"{args.tokens}-token request: alone {a:.3f} s, beside a {args.long:,}-token one "
          f"{b:.3f} s: {b / a:.2f}x (target at most 2x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
