"""Command-line entry points.

Every command is wrapped in :func:`command`: a :class:`~setdiff_dist.errors.SetdiffError`
(anything the user can fix) becomes one line on standard error and exit code 2, Ctrl-C a line
and exit code 130; anything else is a bug and keeps its traceback (exit code 1).
"""

from __future__ import annotations

import argparse
import faulthandler
import functools
import sys

from setdiff_dist.errors import EXIT_BROKEN_PIPE, EXIT_INTERRUPTED, SetdiffError, report


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Every command's ``--help``: the module's text as written, and each option's default
    (when it has one to show: not None, not a flag's False)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" not in text and action.option_strings and \
                action.default not in (None, False, [], argparse.SUPPRESS):
            text += " (default: %(default)s)"
        return text


class Once(argparse.Action):
    """An option that may be given once: a second one is an error, not silently the winner
    (``--config a.yaml --config b.yaml`` kept only b)."""

    def __call__(self, parser, namespace, values, option_string=None):
        before = getattr(namespace, self.dest, None)
        if before is not None and before != self.default:
            parser.error(f"{option_string} given twice ({before}, {values}): give it once (a "
                         "config file may include others; key=value overrides follow it)")
        setattr(namespace, self.dest, values)


_RUNNING: list = []  # the commands running in this process (their prog), innermost last


def running():
    """The command (its prog) running in this process, or None: a Python caller's. What an
    error names differs: a command's user gave a flag (``--checkpoint``), a Python caller an
    argument (``load(path=...)``)."""
    return _RUNNING[-1] if _RUNNING else None


def command(prog: str, process_group: bool = False):
    """Decorate a ``main(argv) -> int`` into its console-script entry (see the module doc).
    ``process_group``: the command may join a process group; take it down cleanly at the end
    (a gloo group left to the interpreter's exit can abort the process in its destructor)."""

    def wrap(main):
        @functools.wraps(main)
        def entry(argv=None) -> int:
            from setdiff_dist.quiet import quiet

            quiet()  # (before the libraries are imported: their notices are filtered)
            # a crash in native code (a segfault in a library) prints every thread's Python
            # stack to stderr before the process dies: on a cluster, the only trace there is
            if not faulthandler.is_enabled():
                faulthandler.enable(all_threads=True)
            _RUNNING.append(prog)
            try:
                return main(argv)
            except SetdiffError as exc:
                report(prog, exc)
                return exc.exit_code
            except KeyboardInterrupt:
                print(f"\n{prog}: interrupted", file=sys.stderr)
                return EXIT_INTERRUPTED
            except BrokenPipeError:
                # the reader of our output closed it: stop quietly, as a killed `cat` would
                # (what is still buffered would fail again at exit: send it nowhere)
                import os

                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
                return EXIT_BROKEN_PIPE
            finally:
                _RUNNING.pop()
                if process_group and "torch.distributed" in sys.modules:
                    from setdiff_dist.parallel import destroy_model_parallel

                    destroy_model_parallel()

        return entry

    return wrap


def json_text(value, **kw) -> str:
    """``json.dumps`` of ``value`` with every non-finite float as a string ("inf", "nan"):
    valid JSON, which has no Infinity or NaN."""
    import json
    import math

    def finite(v):
        if isinstance(v, float) and not math.isfinite(v):
            return str(v)
        if isinstance(v, dict):
            return {k: finite(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [finite(x) for x in v]
        return v

    return json.dumps(finite(value), allow_nan=False, **kw)


def count(minimum: int = 1):
    """An argparse type: an integer of at least ``minimum`` (a count: ranks, tokens, records)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be {minimum} or more, got {value}")
        return value

    parse.__name__ = "count"  # (argparse names the type in its message)
    return parse


def add_decode_arguments(ap) -> None:
    """The decoding flags: each defaults to the checkpoint's ``decode`` section (then
    ``--preset``), see :func:`setdiff_dist.inference.settings.decode_settings`."""
    from setdiff_dist.inference.settings import PRESETS

    ap.add_argument("--preset", choices=sorted(PRESETS),
                    help="the paper's operating point: gsm (W = D, greedy), infill (W = 32, "
                         "greedy, repetition penalty 1.2)")
    ap.add_argument("--window", type=count(), help="candidate window W: masked positions in "
                    "[f, f + W), f the leftmost (default: the checkpoint's decode.window, else "
                    "the order's mean set size D)")
    ap.add_argument("--threshold", type=float,
                    help="confidence threshold tau ('inf' = one token per step)")
    ap.add_argument("--greedy", action=argparse.BooleanOptionalAction, default=None,
                    help="argmax (--no-greedy: sample)")
    ap.add_argument("--temperature", type=float,
                    help="sampling temperature (with --no-greedy; 0 = greedy)")
    ap.add_argument("--top-p", type=float, help="nucleus sampling: keep the smallest set of "
                    "tokens whose probabilities add up to p (1 = all)")
    ap.add_argument("--top-k", type=count(0), help="sample from the k most likely tokens "
                    "only, before --top-p (0 = all)")
    ap.add_argument("--repetition-penalty", type=float,
                    help="penalize the tokens the sample already holds (CTRL's rule: a "
                         "positive logit divided by it, a negative one multiplied; 1 = none)")
    ap.add_argument("--max-new-tokens", type=count(), help="tokens to generate at most")
    ap.add_argument("--length-penalty", type=float, metavar="FACTOR",
                    help="raise end-of-text's logit e by |e| (FACTOR^(n - start) - 1) once n "
                         "> --length-penalty-start tokens are generated before a position "
                         "(transformers' exponential decay length penalty; 1 = off)")
    ap.add_argument("--length-penalty-start", type=count(0), metavar="N",
                    help="generated tokens after which --length-penalty acts")
    ap.add_argument("--max-repeat-run", type=count(),
                    help="stop a sample after this many repeats of one token (a degenerate "
                         "sample)")


def decode_flags(args) -> dict:
    """The decoding flags given on the command line (None: not given)."""
    from setdiff_dist.inference.settings import DECODE_KEYS

    return {k: getattr(args, k) for k in DECODE_KEYS}


def check_decode_flags(args) -> None:
    """Refuse bad decoding flags before any model is loaded."""
    from setdiff_dist.inference.decoder import Sampling, check_threshold

    Sampling(**{k: v for k, v in (("temperature", args.temperature), ("top_p", args.top_p),
                                  ("top_k", args.top_k),
                                  ("repetition_penalty", args.repetition_penalty),
                                  ("length_penalty", args.length_penalty))
                if v is not None})
    if args.threshold is not None:
        check_threshold(args.threshold)


def add_weights_argument(ap) -> None:
    """``--raw-weights``: a checkpoint's raw weights instead of their EMA (``train.ema_decay``),
    which commands read by default when the run kept one."""
    ap.add_argument("--raw-weights", action="store_true",
                    help="read the raw weights, not their exponential moving average (the "
                         "default when the run kept one: train.ema_decay)")


def add_dtype_argument(ap) -> None:
    """``--dtype``, for the commands that load a model for inference."""
    ap.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                    help="the weights' and activations' dtype: auto = bfloat16 on a GPU, "
                         "float32 on the CPU")



