"""``setdiff-lm-eval``: lm-evaluation-harness's own command line with our model registered.

    setdiff-lm-eval --model setdiff --model_args checkpoint=runs/tiny-cpu,window=4 \\
        --tasks arc_easy --output_path results/ [any other lm_eval argument]

lm-eval (0.4) finds a model class by name only among its own modules and the classes already
imported: an installed package cannot register one for ``lm_eval --model setdiff`` (lm-eval
has no plug-in entry point for models). This command imports our class
(:class:`setdiff_dist.eval.harness.SetdiffLM`, registered as ``setdiff``) and then runs
``lm_eval``'s command line as is, with all its arguments, outputs and tooling (``--device``
defaults to a GPU when there is one, else the CPU, where lm-eval's is ``cuda:0``); lm-eval's own
models (``--model hf``, ``local-completions``, ...) stay available. ``--model_args
pretrained=DIR`` names the checkpoint as lm-eval's models do (``checkpoint=DIR`` too).

With ``--model setdiff``, what the user can get wrong is said in one line
(``setdiff-lm-eval: error: ...``, exit code 2) rather than as a traceback: the model arguments
(:data:`setdiff_dist.eval.harness.MODEL_ARGS` and the decoding settings), ``dtype``,
``tensor_parallel``, ``--batch_size`` and the checkpoint's directory before lm-eval starts;
a damaged checkpoint, or anything else our model refuses, when lm-eval builds it.
"""

from __future__ import annotations

import sys

from setdiff_dist.cli import command


@command("setdiff-lm-eval", process_group=True)
def main(argv=None) -> int:
    from lm_eval._cli.harness import HarnessCLI
    from lm_eval.utils import setup_logging

    from setdiff_dist.eval import harness  # (registers the model "setdiff")

    args = list(sys.argv[1:] if argv is None else argv)
    if not any(a == "--device" or a.startswith("--device=") for a in args):
        import torch  # (lm-eval's default is cuda:0; ours, as for every command: a GPU if any)

        args += ["--device", "cuda" if torch.cuda.is_available() else "cpu"]
    # lm_eval.__main__.cli_evaluate, with our model's arguments checked between the parse and
    # the run (its parser reads sys.argv)
    saved, sys.argv = sys.argv, ["setdiff-lm-eval", *args]
    try:
        setup_logging()
        cli = HarnessCLI()
        ns = cli.parse_args()
    finally:
        sys.argv = saved
    if getattr(ns, "command", None) == "run" and getattr(ns, "model", None) != "setdiff":
        # lm-eval loads its own models only while its registry is empty, and ours is in it:
        # load them as it would have (--model hf, vllm, local-completions, ...)
        import lm_eval.models  # noqa: F401
    if getattr(ns, "command", None) == "run" and getattr(ns, "model", None) == "setdiff":
        harness.batch_rows(getattr(ns, "batch_size", None), getattr(ns, "max_batch_size", None))
        harness.check_model_args(dict(getattr(ns, "model_args", None) or {}),
                                 need_checkpoint=getattr(ns, "config", None) is None)
    cli.execute(ns)
    return 0


if __name__ == "__main__":
    sys.exit(main())
