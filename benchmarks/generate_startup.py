"""Start-up of ``setdiff-generate``: the whole command as a user runs it (a new interpreter, the
imports, the checkpoint's checks and load, one new token), timed end to end.

    python benchmarks/generate_startup.py --checkpoint RUN_DIR [--rounds 7]
        [--against OTHER_CHECKOUT]

With ``--against`` (another checkout of this repository, e.g. ``git worktree add /tmp/before
HEAD~3``) the two are run alternately, round by round, with that checkout first on
``PYTHONPATH``, so that both see the same machine; the medians and their ratio are printed. Each
run also says whether megatron-core or DeepSpeed were imported. Bytecode caching is on, as for
an installed package (a first, untimed run of each writes the caches).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROBE = ("import runpy, sys\n"
         "sys.argv = ['setdiff-generate'] + sys.argv[1:]\n"
         "try:\n"
         "    runpy.run_module('setdiff_dist.cli.generate', run_name='__main__')\n"
         "except SystemExit as exc:\n"
         "    code = exc.code\n"
         "print('heavy:', ','.join(m for m in ('megatron', 'deepspeed') if m in sys.modules)\n"
         "      or 'none', file=sys.stderr)\n")


def once(checkpoint: str, checkout: str) -> tuple[float, str]:
    env = dict(os.environ, PYTHONPATH=checkout, SETDIFF_VERBOSE="0")
    # as an installed package runs: Python's bytecode cache in use (written by the untimed
    # first run), whatever this shell says
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    start = time.perf_counter()
    res = subprocess.run([sys.executable, "-c", PROBE, "--checkpoint", checkpoint, "--prompt",
                          "Shall I compare thee", "--max-new-tokens", "1"],
                         capture_output=True, text=True, env=env, cwd="/")
    seconds = time.perf_counter() - start
    if res.returncode:
        sys.exit(f"{checkout}: setdiff-generate failed:\n{res.stderr[-2000:]}")
    heavy = [line for line in res.stderr.splitlines() if line.startswith("heavy:")]
    return seconds, heavy[-1].split(":", 1)[1].strip() if heavy else "?"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--against", help="another checkout, timed alternately with this one")
    args = ap.parse_args()
    checkouts = {"this": ROOT}
    if args.against:
        checkouts["against"] = os.path.abspath(args.against)
    times = {k: [] for k in checkouts}
    heavy = {}
    for name, where in checkouts.items():  # (a first run each, not timed: the page cache)
        heavy[name] = once(args.checkpoint, where)[1]
    for r in range(args.rounds):
        for name, where in checkouts.items():
            times[name].append(once(args.checkpoint, where)[0])
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(
            f"{n} {t[-1]:.2f} s" for n, t in times.items()), file=sys.stderr, flush=True)
    for name, t in times.items():
        print(f"{name:8s} {checkouts[name]}: median {statistics.median(t):.2f} s "
              f"(min {min(t):.2f}, max {max(t):.2f}); imports megatron/DeepSpeed: {heavy[name]}")
    if args.against:
        ratio = statistics.median(times["this"]) / statistics.median(times["against"])
        print(f"this / against: {ratio:.2f}")


if __name__ == "__main__":
    main()
