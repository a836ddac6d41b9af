"""``setdiff-config``: resolve and validate a configuration, or list every key.

    setdiff-config --config configs/tiny-cpu.yaml order.kind=block order.block_size=8
    setdiff-config --keys
    setdiff-config --config configs/tiny-cpu.yaml --get run_dir     # one resolved value
    setdiff-config --config configs/tiny-cpu.yaml --get order       # a section, as YAML

Prints the resolved YAML (what a run would use) or every problem, and exits 2 on problems.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from setdiff_dist.cli import HelpFormatter, Once, command
from setdiff_dist.config import describe, load_config
from setdiff_dist.errors import EXIT_USAGE


@command("setdiff-config")
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="setdiff-config", description=__doc__,
                                 formatter_class=HelpFormatter)
    ap.add_argument("--config", action=Once, help="YAML file (may include others)")
    ap.add_argument("--keys", action="store_true", help="list every key with its help")
    ap.add_argument("--get", metavar="KEY", help="print only this resolved value (e.g. run_dir, "
                    "parallel.tensor: for job scripts), or a section's keys as YAML (order)")
    ap.add_argument("overrides", nargs="*", help="section.key=value")
    args = ap.parse_args(argv)
    if args.keys:
        print(describe())
        return 0
    cfg = load_config(args.config, args.overrides)
    if args.get:
        value = cfg
        for part in args.get.split("."):
            if not hasattr(value, part):
                print(f"setdiff-config: no key {args.get!r} (see setdiff-config --keys)",
                      file=sys.stderr)
                return EXIT_USAGE
            value = getattr(value, part)
        import yaml

        if dataclasses.is_dataclass(value):  # a section: its keys as YAML, as the file has it
            print(yaml.safe_dump(dataclasses.asdict(value), sort_keys=False), end="")
        elif isinstance(value, (list, dict, bool)) or value is None:  # (YAML's spelling)
            print(yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("..."
                                                                                   ).strip())
        else:
            print(value)
        return 0
    print(cfg.to_yaml(), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
