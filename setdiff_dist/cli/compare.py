"""``setdiff-compare``: causal and set-diffusion checkpoints side by side on problems with answers.

    setdiff-compare --data test.jsonl --train train.jsonl \\
        --model ar=runs/chain/ar --model setdlm=runs/chain/setdlm --out runs/chain

What the paper's GSM8K table measures, on any ``setdiff-tasks gsm`` / ``chain`` file: for each
checkpoint, greedy decoding at batch 1 (``setdiff-eval --task gsm``: stopped once ``#### N`` is
complete; accuracy = the number after ``####`` equals the answer), tokens per forward step and
tokens/s (the mean of per-problem rates after a warm-up problem). A causal checkpoint decodes once
(its KV-cached decoder: one token a step); a set checkpoint at each ``--thresholds`` value (by
default tau = inf, one token a step in the model's own order, and the checkpoint's
``decode.threshold``), with its window.

``--train``: the training problems; every question of ``--data`` must be absent from it (a
held-out set: ``setdiff-tasks ... --exclude TRAIN``), and the table says so. Prints the table,
then one problem decoded set by set by each set checkpoint at its own threshold (each token
coloured by the step that committed it, on a terminal; ``NO_COLOR`` turns colour off). With
``--out DIR``: ``DIR/task_summary.json`` (a list of rows: ``model``, ``tau`` (null for a causal
model, "inf", or a number), ``accuracy`` (0-1), ``tokens_per_step``, ``tokens_per_s``, and the
rest of the row) and ``DIR/task_summary.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

from setdiff_dist.cli import HelpFormatter, command, count
from setdiff_dist.errors import SetdiffError


class CompareError(SetdiffError):
    """A bad argument or a test set that is not held out."""


def _model_arg(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"{text!r}: give NAME=PATH, e.g. setdlm=runs/chain")
    return name, path


def _thresholds(text: str) -> list:
    """``--thresholds``: setdiff-eval's form (numbers, inf, ``paper``) plus ``ckpt``, the
    checkpoint's own decode.threshold (None here)."""
    from setdiff_dist.cli.eval import parse_thresholds

    out = []
    for part in text.split(","):
        if part.strip() == "ckpt":
            out.append(None)
            continue
        try:
            out += parse_thresholds(part.strip())
        except SetdiffError as exc:
            raise argparse.ArgumentTypeError(f"{part!r}: a threshold is a number in (0, 1], "
                                             f"inf, paper or ckpt ({exc})") from None
    for tau in out:
        if tau is not None and not (tau == math.inf or 0 < tau <= 1):
            raise argparse.ArgumentTypeError(f"{tau}: a threshold is in (0, 1], or inf")
    return out


def _questions(path: str) -> list[str]:
    try:
        with open(path, encoding="utf-8") as fh:
            return [json.loads(line)["prompt"] for line in fh if line.strip()]
    except OSError as exc:
        raise CompareError(f"--train {path}: {exc.strerror}") from None
    except (ValueError, KeyError, TypeError):
        raise CompareError(f"--train {path}: not a gsm / chain task file (one JSON object "
                           "with a \"prompt\" per line)") from None


def test_set_line(data: str, problems: list[dict], train: str | None) -> str:
    """What the test set is, in one line (checked held out when the training file is given)."""
    what = f"{len(problems)} problems of {data}"
    if train is None:
        return what + " (not checked against the training problems: give --train)"
    seen = set(_questions(train))
    inside = [p["prompt"] for p in problems if p["prompt"] in seen]
    if inside:
        raise CompareError(f"--data {data}: {len(inside)} of its {len(problems)} questions are "
                           f"training questions of --train {train} (the first: "
                           f"{inside[0]!r}): make a held-out set with setdiff-tasks ... "
                           f"--exclude {train}")
    return (f"{what}, held out: none of their questions is among the {len(seen)} distinct "
            f"training questions of {train}")


def _tau_value(tau):
    return None if tau is None else ("inf" if tau == math.inf else tau)


def _tau_text(tau) -> str:
    return "-" if tau is None else ("inf" if tau == math.inf else f"{tau:g}")


def evaluate(name: str, path: str, args, data: str) -> tuple[list[dict], object]:
    from setdiff_dist.api import load
    from setdiff_dist.eval.tasks import gsm
    from setdiff_dist.inference.decoder import Sampling

    model = load(path)
    settings = model.settings(window=args.window)
    causal = model.decoder.causal_lm
    taus = [None] if causal else [settings.threshold if t is None else t
                                  for t in args.thresholds]
    rows = []
    for tau in taus:
        window = 1 if causal else settings.window
        r = gsm(model.decoder, model.tokenizer, data, args.limit, args.max_new_tokens, window,
                math.inf if tau is None else tau, Sampling(greedy=True), warmup=1)
        rows.append({"model": name, "tau": _tau_value(tau), "accuracy": r["accuracy"],
                     "tokens_per_step": r["tokens_per_step"], "tokens_per_s": r["tokens_per_s"],
                     "decoding": model.decoding, "window": window,
                     "tokens": r["tokens"], "problems": r["count"],
                     "skipped_too_long": r["skipped_too_long"], "checkpoint": path})
        print(f"setdiff-compare: {name} tau={_tau_text(tau)}: accuracy {r['accuracy']:.3f}, "
              f"{r['tokens_per_step']:.2f} tokens/step, {r['tokens_per_s']:.0f} tokens/s",
              file=sys.stderr, flush=True)
    return rows, model


def table(rows: list[dict], test_set: str) -> str:
    """The rows as a Markdown table, with tokens/s relative to the first causal row."""
    base = next((r["tokens_per_s"] for r in rows if r["tau"] is None), None)
    lines = ["| model | decoding | tau | accuracy | tokens/step | tokens/s | vs AR |",
             "|---|---|---|---:|---:|---:|---:|"]
    for r in rows:
        rel = f"{r['tokens_per_s'] / base:.2f}x" if base else "-"
        lines.append(f"| {r['model']} | {r['decoding']} (W={r['window']}) | "
                     f"{_tau_text(math.inf if r['tau'] == 'inf' else r['tau'])} | "
                     f"{100 * r['accuracy']:.1f}% | {r['tokens_per_step']:.2f} | "
                     f"{r['tokens_per_s']:.0f} | {rel} |")
    skipped = sum(r["skipped_too_long"] for r in rows)
    note = (f"Test set: {test_set}. Greedy, batch 1; tokens/step counts every forward pass "
            "(the prefill's too); tokens/s is the mean of per-problem rates after a warm-up.")
    if skipped:
        note += f" {skipped} problem decodings did not fit the context and were skipped."
    return "\n".join(lines) + "\n\n" + note + "\n"


PALETTE = (31, 32, 33, 34, 35, 36)  # ANSI foreground colours, one per step, cycled


def set_trace(model, problem: dict, window: int, tau: float, max_new_tokens: int,
              colour: bool) -> str:
    """One problem decoded by a set checkpoint: the committed sets, step by step, and the text
    with each token coloured by its step (colour) or the steps listed (no colour)."""
    from setdiff_dist.eval.tasks import gsm_stop
    from setdiff_dist.inference.decoder import Sampling

    tok = model.tokenizer
    prompt = tok.encode(problem["prompt"])
    r = model.decoder.generate([prompt], max_new_tokens, window=window, threshold=tau,
                               sampling=Sampling(greedy=True), stop=gsm_stop(tok))[0]
    ids = prompt + list(r.tokens)
    step_of = {}
    for k, positions in enumerate(r.trace, 1):
        for p in positions:
            if p < len(ids):
                step_of[p] = k
    head = (f"{model.path} (W={window}, tau={_tau_text(tau)}): {len(r.tokens)} tokens in "
            f"{r.steps} steps ({r.tokens_per_step:.2f} per step)\n"
            f"  question: {problem['prompt'].strip()!r}  (answer {problem['answer']})\n")
    if colour:
        text = "".join(f"\033[{PALETTE[(step_of[p] - 1) % len(PALETTE)]}m{tok.decode([ids[p]])}"
                       f"\033[0m" for p in range(len(prompt), len(ids)))
        return head + "  " + text.replace("\n", "\n  ") + "\n  (each colour: one step)\n"
    lines = []
    for k, positions in enumerate(r.trace, 1):
        shown = [tok.decode([ids[p]]) for p in sorted(positions) if p < len(ids)]
        if shown:
            lines.append(f"  step {k:2d}: " + " | ".join(repr(s)[1:-1] for s in shown))
    return head + "\n".join(lines) + "\n"


@command("setdiff-compare", process_group=True)
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="setdiff-compare", description=__doc__,
                                 formatter_class=HelpFormatter)
    ap.add_argument("--model", type=_model_arg, action="append", required=True,
                    metavar="NAME=PATH",
                    help="a checkpoint (run directory, checkpoint or export) and its name in "
                         "the table (repeatable)")
    ap.add_argument("--data", required=True,
                    help="the test problems: a setdiff-tasks gsm / chain .jsonl")
    ap.add_argument("--train", default=None,
                    help="the training problems: the test questions must not be among them")
    ap.add_argument("--limit", type=count(), default=None,
                    help="the first N test problems (default: all)")
    ap.add_argument("--max-new-tokens", type=count(), default=64,
                    help="tokens a solution may take")
    ap.add_argument("--thresholds", type=_thresholds, default=[math.inf, None],
                    metavar="TAU,...",
                    help="a set checkpoint's thresholds: numbers in (0, 1], inf (one token a "
                         "step), paper (the reference's 10-point GSM8K grid) or ckpt (the "
                         "checkpoint's decode.threshold) (default: inf,ckpt)")
    ap.add_argument("--window", type=count(), default=None,
                    help="a set checkpoint's window (default: its decode.window)")
    ap.add_argument("--out", metavar="DIR",
                    help="write task_summary.json and task_summary.md here")
    args = ap.parse_args(argv)

    from setdiff_dist.eval.tasks import _records

    problems = _records(args.data, args.limit, "gsm")
    test_set = test_set_line(args.data, problems, args.train)
    rows, traces = [], []
    for name, path in args.model:
        got, model = evaluate(name, path, args, args.data)
        rows += got
        if not model.decoder.causal_lm:
            traces.append((model, model.settings(window=args.window)))
    text = table(rows, test_set)
    print(text)
    colour = sys.stdout.isatty() and not os.environ.get("NO_COLOR")
    for model, d in traces:  # (at the checkpoint's threshold, the table's window)
        print(set_trace(model, problems[0], d.window, d.threshold, args.max_new_tokens,
                        colour))
    if args.out:
        from setdiff_dist.checkpoint.files import write_atomic

        os.makedirs(args.out, exist_ok=True)
        write_atomic(os.path.join(args.out, "task_summary.json"), json.dumps(rows, indent=2) + "\n")
        write_atomic(os.path.join(args.out, "task_summary.md"), text)
        print(f"setdiff-compare: {os.path.join(args.out, 'task_summary.json')}",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
