"""``--task harness``: lm-evaluation-harness tasks (``pip install 'setdiff-dist[eval]'``) through
our lm_eval model class (:mod:`setdiff_dist.eval.harness`); its log-likelihoods are exact for
causal LMs and, for set-diffusion models, the autoregressive order's (exact for W = 1 decoding,
a bound otherwise: the results say which); generation uses the decode flags."""

from __future__ import annotations

import os

from setdiff_dist.eval.tasks import EvalError, Flag, Task, register
from setdiff_dist.eval.tasks.flags import BATCH_SIZE, LIMIT

TASKS = Flag("--harness-tasks", "harness: lm-eval task names, comma-separated")
GEN_KWARGS = Flag("--gen-kwargs", "harness: generation settings over every task's own, as "
                                  "lm-eval's --gen_kwargs (max_gen_toks, until, do_sample, "
                                  "temperature, top_p)", metavar="K=V,...")
OUTPUT_PATH = Flag("--output-path", "harness: also write each task's results and samples in "
                                    "lm-eval's own layout here (what its tooling reads)",
                   metavar="DIR")
INCLUDE_PATH = Flag("--include-path", "harness: a directory of task YAMLs of your own")
NUM_FEWSHOT = Flag("--num-fewshot", "harness: few-shot examples per prompt", count=0)
LOG_SAMPLES = Flag("--log-samples", "harness: every request's arguments and answers in the "
                                    "results", action="store_true")


@register
class Harness(Task):
    name = "harness"
    flags = (TASKS, GEN_KWARGS, OUTPUT_PATH, INCLUDE_PATH, NUM_FEWSHOT, LOG_SAMPLES, LIMIT,
             BATCH_SIZE)
    # (it generates, but each request carries its own max_gen_toks and until: the results'
    # "generation" lists what the requests decoded with)
    generates = False

    @classmethod
    def refuse(cls, flags: list[str], task: str) -> str:
        return f"{', '.join(flags)} go with --task harness, not --task {task}: remove them, " \
            "or run --task harness"

    def check(self) -> None:
        """The task names, lm-eval itself, the tasks' datasets and every generation task's
        settings, before the model is loaded."""
        args = self.args
        names = [t for t in (args.harness_tasks or "").split(",") if t.strip()]
        if not names:
            raise EvalError("--task harness needs --harness-tasks T1[,T2...] (lm-eval task "
                            "names; tasks of your own: --include-path DIR)")
        if args.include_path and not os.path.isdir(args.include_path):
            raise EvalError(f"--include-path {args.include_path}: no such directory")
        try:
            from setdiff_dist.eval import harness
        except ImportError as exc:
            raise EvalError(f"lm-evaluation-harness is not installed ({exc}); install it "
                            "with: pip install 'setdiff-dist[eval]'") from None
        self.names = [t.strip() for t in names]
        self.manager = harness.task_manager(self.names, args.include_path)
        self.tasks, leaves = harness.load_tasks(self.names, self.manager)
        harness.check_generation(leaves, harness.parse_gen_kwargs(args.gen_kwargs))

    def run(self, loaded, decode, flags, publish) -> dict:
        from setdiff_dist.eval import harness

        args = self.args
        lm = harness.SetdiffLM(loaded=(loaded.module, loaded.config, loaded.tokenizer),
                               batch_size=args.batch_size, preset=args.preset, **flags)
        # each finished task's results on disk before the next starts
        return harness.run(lm, self.manager, self.tasks, args.limit, args.num_fewshot,
                           args.log_samples, gen_kwargs=args.gen_kwargs,
                           output_path=args.output_path, names=self.names, on_result=publish)
