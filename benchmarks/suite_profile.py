"""Where the test suite's time goes: a pytest plugin that records, per test, its wall time, the
machine's busy CPU-seconds meanwhile (``/proc/stat``: every process, the test's children and
spawned ranks included) and the processes started; and a summary of the records by file.

A test whose wall time is well above half its busy CPU-seconds (2 cores) waits: on a
subprocess, Slurm, a timeout. That time another session can fill, which is why ``.ci/run`` runs
the two tiers side by side. Numbers are machine-wide: read them from a run that is alone on
the machine.

    PYTHONPATH=benchmarks PYTEST_ADDOPTS="-p suite_profile" SUITE_PROFILE=/tmp/prof.tsv \\
        bash scripts/test.sh
    python benchmarks/suite_profile.py /tmp/prof.tsv [--top 20]
"""

from __future__ import annotations

import argparse
import os
import time

HZ = os.sysconf("SC_CLK_TCK")
_started: dict = {}


def _machine() -> tuple[float, int]:
    """(busy CPU-seconds of every core since boot, processes started since boot)."""
    busy, procs = 0.0, 0
    with open("/proc/stat") as fh:
        for line in fh:
            if line.startswith("cpu "):
                ticks = [int(x) for x in line.split()[1:]]
                busy = (sum(ticks) - ticks[3] - ticks[4]) / HZ  # (less idle and iowait)
            elif line.startswith("processes "):
                procs = int(line.split()[1])
    return busy, procs


def _out() -> str:
    return os.environ.get("SUITE_PROFILE", f"suite-profile-{os.getpid()}.tsv")


def pytest_runtest_logstart(nodeid, location):
    _started[nodeid] = (time.monotonic(), *_machine())


def pytest_runtest_logfinish(nodeid, location):
    t0, busy0, procs0 = _started.pop(nodeid)
    busy, procs = _machine()
    with open(_out(), "a") as fh:
        fh.write(f"{nodeid}\t{time.monotonic() - t0:.2f}\t{busy - busy0:.2f}\t"
                 f"{procs - procs0}\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("records", help="the plugin's file (nodeid, wall s, busy CPU-s, processes)")
    ap.add_argument("--cores", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--top", type=int, default=15, help="files to list, most waiting first")
    args = ap.parse_args(argv)
    files: dict = {}
    for line in open(args.records):
        nodeid, wall, busy, procs = line.rstrip("\n").split("\t")
        f = files.setdefault(nodeid.split("::")[0], [0.0, 0.0, 0])
        f[0] += float(wall)
        f[1] += float(busy)
        f[2] += int(procs)
    wall = sum(f[0] for f in files.values())
    busy = sum(f[1] for f in files.values())
    print(f"{wall:.0f} s wall, {busy:.0f} busy CPU-s: {busy / (args.cores * wall):.0%} of "
          f"{args.cores} cores; waiting (wall - busy / cores) by file:")
    for name, (w, b, p) in sorted(files.items(), key=lambda kv: kv[1][1] / args.cores -
                                  kv[1][0])[:args.top]:
        print(f"  {name:45s} wall {w:7.1f}  busy {b:7.1f}  waiting {w - b / args.cores:6.1f}"
              f"  processes {p}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
