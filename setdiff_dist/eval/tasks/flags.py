"""The flags several tasks take, declared once; a task lists them in its ``flags`` beside its
own. ``--limit``, ``--data``, ``--batch-size`` and ``--prompt`` are not exclusive: the tasks that
do not read them have always let them be."""

from __future__ import annotations

import math
from typing import Optional

from setdiff_dist.eval.tasks import EvalError, Flag

DATA = Flag("--data", "infill / gsm: a .jsonl from setdiff-tasks; choice: records {context, "
                      "choices, gold}; summarize: records {article, highlights} (CNN/DailyMail)",
            exclusive=False)
LIMIT = Flag("--limit", "the first N records (default: all of them, the whole test set, as the "
                        "paper scores it; harness: per task)", count=1, exclusive=False)
BATCH_SIZE = Flag("--batch-size", "ppl / choice / genppl / harness: sequences per forward",
                  count=1, default=8, exclusive=False)
SAMPLES = Flag("--samples", "genppl: unconditional samples of --max-new-tokens each (default "
                            "64); throughput: measured generations per setting, the prompts in "
                            "turn (default: one per prompt; the paper: 200)", count=1)
MDLM_BLOCK = Flag(
    "--mdlm-block", "gsm / summarize / throughput / genppl with an MDLM (order.kind=masked) "
                    "checkpoint: decode semi-autoregressively in blocks of B positions on the "
                    "grid [kB, (k+1)B), left to right, stopping after the block a stop falls in "
                    "(the paper's CNN/DailyMail and GSM8K MDLM rows: 32; default: the whole "
                    "span at once)", count=1, metavar="B",
    refusal="{flag} goes with --task {tasks} (what an MDLM generates), not --task {task}")
THRESHOLDS = Flag(
    "--thresholds", "gsm / throughput: sweep these thresholds (e.g. 0.5,0.7,0.9,inf): per tau, "
                    "accuracy (gsm), tokens/step and tokens/s, as the paper's tau sweep; paper: "
                    "the reference runner's 10 points, inf, 0.99, 0.95, 0.9, 0.85, ..., 0.6",
    metavar="TAU,...", refusal="{flag} sweeps --task {tasks}, not --task {task}")

# the GSM8K tau grid of the paper's reference runner (scripts/eval/repro_suite_runner.py: 1e6 is
# its one-token-a-step point): ``setdiff-eval --task gsm --thresholds paper``
PAPER_TAUS = [math.inf, 0.99, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6]


def parse_thresholds(text: str, flag: str = "--thresholds") -> list[float]:
    """``--thresholds 0.5,0.9,inf`` as floats (each a confidence in [0, 1], or inf); ``paper``
    stands for the reference runner's GSM8K grid (:data:`PAPER_TAUS`)."""
    out = []
    for part in text.split(","):
        if part.strip() == "paper":
            out += PAPER_TAUS
            continue
        try:
            tau = float(part)
        except ValueError:
            raise EvalError(f"{flag} {text}: {part!r} is not a number (give e.g. "
                            "0.5,0.7,0.9,inf, or paper)") from None
        if math.isnan(tau) or tau < 0:
            raise EvalError(f"{flag} {text}: {part} is not a confidence in [0, 1] or inf")
        out.append(tau)
    return out


def thresholds(args) -> Optional[list[float]]:
    """The thresholds ``--thresholds`` sweeps (None: no sweep), refused beside
    ``--threshold``."""
    if not args.thresholds:
        return None
    out = parse_thresholds(args.thresholds)
    if out and args.threshold is not None:
        raise EvalError("give --threshold or --thresholds, not both")
    return out
