"""``setdiff-convert``: export a training checkpoint (any TP / PP / ZeRO layout) as one
consolidated ``model.safetensors`` with ``config.yaml``, ``export.json`` and the tokenizer.

    setdiff-convert --checkpoint runs/tiny-cpu --out exports/tiny-cpu
"""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="setdiff-convert", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True,
                    help="a run directory, its checkpoints directory, or a step_* directory")
    ap.add_argument("--out", required=True, help="output directory (new or empty)")
    args = ap.parse_args(argv)
    from setdiff_dist.inference.weights import LoadError, export

    try:
        meta = export(args.checkpoint, args.out)
    except LoadError as exc:
        print(f"setdiff-convert: error: {exc}", file=sys.stderr)
        return 2
    print(f"setdiff-convert: {meta['parameters']:,} parameters from {meta['source']} -> "
          f"{args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
