"""``setdiff-lm-eval``: lm-evaluation-harness's own command line with our model registered.

    setdiff-lm-eval --model setdiff --model_args checkpoint=runs/tiny-cpu,window=4 \\
        --tasks arc_easy --output_path results/ [any other lm_eval argument]

lm-eval (0.4) finds a model class by name only among its own modules and the classes already
imported: an installed package cannot register one for ``lm_eval --model setdiff`` (lm-eval
has no plug-in entry point for models). This command imports our class
(:class:`setdiff_dist.eval.harness.SetdiffLM`, registered as ``setdiff``) and then runs
``lm_eval``'s command line as is, with all its arguments, outputs and tooling (``--device``
defaults to a GPU when there is one, else the CPU, where lm-eval's is ``cuda:0``).
"""

from __future__ import annotations

import sys


def main(argv=None) -> int:
    from setdiff_dist.quiet import quiet

    quiet()
    from lm_eval.__main__ import cli_evaluate

    import setdiff_dist.eval.harness  # noqa: F401 (registers the model "setdiff")

    args = list(sys.argv[1:] if argv is None else argv)
    if not any(a == "--device" or a.startswith("--device=") for a in args):
        import torch  # (lm-eval's default is cuda:0; ours, as for every command: a GPU if any)

        args += ["--device", "cuda" if torch.cuda.is_available() else "cpu"]
    sys.argv = ["setdiff-lm-eval", *args]
    cli_evaluate()
    return 0


if __name__ == "__main__":
    sys.exit(main())
