"""What one set-decoding step costs next to one causal step, on the paths users run:
``setdiff-generate`` (a new process per run, as a user starts it) and the Python API
(``setdiff_dist.load(...).generate``), for a set-diffusion and a causal checkpoint of one shape.

    python benchmarks/set_step_cost.py [--set RUN --causal RUN] [--rounds 5]

Without checkpoints it trains both for 2 steps (the weights' values do not change what a step
costs) at the shape of issue 52's measurement: 4 layers x 256, vocabulary 2,048
(``configs/tiny-cpu.yaml`` with model overrides, on ``data/tiny-cpu``, which scripts/main.sh
makes), the set model with ``decode.window=4``. Each run decodes one prompt greedily to a fixed
length (end-of-text ignored): set decoding with its window (W = 4) at tau = inf (one commit a
step: the committed token and W [MASK] queries), causal decoding with its KV cache. Steady
state: (t(120) - t(20)) / (steps(120) - steps(20)), t being the decoder's own time (model
loading and the process excluded), so the prompt and warm-up cancel out. Rounds alternate the
two models and the two paths; medians. Prints ms per step and the set / causal ratio per path.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPE = ["model.num_layers=4", "model.hidden_size=256", "model.num_attention_heads=4",
         "model.ffn_hidden_size=1024"]
PROMPT = "Shall I compare thee"
SHORT, LONG = 20, 120
# a command of its own, as a user runs it: not this process's group (the API's load joins one)
CHILD_ENV = {k: v for k, v in os.environ.items()
             if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                          "LOCAL_WORLD_SIZE")}


def train(run_dir: str, *overrides) -> str:
    if os.path.exists(os.path.join(run_dir, "checkpoints", "latest")):
        return run_dir
    data = os.path.join(ROOT, "data", "tiny-cpu")
    if not os.path.exists(os.path.join(data, "manifest.json")):
        sys.exit(f"no {data}: run scripts/main.sh once, or give --set and --causal")
    print(f"training {run_dir} (2 steps) ...", file=sys.stderr, flush=True)
    subprocess.run([sys.executable, "-m", "setdiff_dist.cli.train", "--nproc-per-node", "1",
                    "--config", os.path.join(ROOT, "configs", "tiny-cpu.yaml"),
                    f"run_dir={run_dir}", f"data.train_shards={data}", "train.steps=2",
                    "train.eval_batches=1", *SHAPE, *overrides],
                   check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    return run_dir


def cli_run(checkpoint: str, n: int) -> tuple[float, int]:
    """(decoder seconds, forward steps) of one setdiff-generate run."""
    res = subprocess.run([sys.executable, "-m", "setdiff_dist.cli.generate", "--checkpoint",
                          checkpoint, "--prompt", PROMPT, "--max-new-tokens", str(n),
                          "--threshold", "inf", "--greedy", "--no-eos-stop", "--json"],
                         capture_output=True, text=True, cwd=ROOT, env=CHILD_ENV)
    if res.returncode:
        sys.exit(f"setdiff-generate failed:\n{res.stderr[-2000:]}")
    out = json.loads(res.stdout)
    return out["seconds"], out["steps"][0]


def api_runner(checkpoint: str):
    from setdiff_dist import load

    model = load(checkpoint)

    def run(n: int) -> tuple[float, int]:
        g = model.generate(PROMPT, max_new_tokens=n, threshold=float("inf"), greedy=True,
                           eos_stop=False)
        return g.seconds, g.steps
    run(SHORT)  # (warm-up)
    return run


def per_step(run) -> float:
    (t0, s0), (t1, s1) = run(SHORT), run(LONG)
    return (t1 - t0) / max(s1 - s0, 1) * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--set", default=None, help="a set-diffusion run or checkpoint")
    ap.add_argument("--causal", default=None, help="a causal one of the same shape")
    ap.add_argument("--work", default=os.path.join(ROOT, "runs", "set_step_cost"))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    models = {"set": args.set or train(os.path.join(args.work, "set"), "decode.window=4"),
              "causal": args.causal or train(os.path.join(args.work, "causal"),
                                             "order.kind=causal")}
    apis = {name: api_runner(path) for name, path in models.items()}
    ms = {(path, name): [] for path in ("setdiff-generate", "API") for name in models}
    for r in range(args.rounds):
        for name, ckpt in models.items():
            ms[("setdiff-generate", name)].append(per_step(lambda n, c=ckpt: cli_run(c, n)))
            ms[("API", name)].append(per_step(apis[name]))
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(
            f"{p} {n} {v[-1]:.2f} ms" for (p, n), v in ms.items()), file=sys.stderr, flush=True)
    result = {}
    print(f"ms per step (steady state: {LONG} minus {SHORT} new tokens, medians of "
          f"{args.rounds} rounds); set: {models['set']}, causal: {models['causal']}")
    for path in ("setdiff-generate", "API"):
        s, c = (statistics.median(ms[(path, n)]) for n in ("set", "causal"))
        result[path] = {"set_ms": s, "causal_ms": c, "ratio": s / c}
        print(f"  {path:<17} set step {s:6.2f} ms   causal step {c:6.2f} ms   "
              f"a set step costs {s / c:.2f}x a causal step")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"models": models, "rounds": args.rounds, "result": result}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
