"""``setdiff-eval``: evaluate a checkpoint or an export; results also go to a JSON file.

    setdiff-eval --checkpoint runs/tiny-cpu --task ppl [--shards data/tiny-cpu]
    setdiff-eval --checkpoint DIR --task infill --data infill.jsonl [--limit 100] [--window 4]
    setdiff-eval --checkpoint DIR --task gsm --data gsm.jsonl [--max-new-tokens 256]
                 [--thresholds paper]            # the paper's tau sweep (10 points)
    setdiff-eval --checkpoint DIR --task summarize --data cnn_dm.jsonl  # ROUGE (rouge-score)
    setdiff-eval --checkpoint DIR --task genppl --scorer gpt2-large/ [--references owt.jsonl]
    setdiff-eval --checkpoint DIR --task throughput [--prompt TEXT ...] [--threshold T]
    setdiff-eval --checkpoint DIR --task choice --data choice.jsonl
    setdiff-eval --checkpoint DIR --task harness --harness-tasks T1,T2 [--include-path DIR]
                 [--num-fewshot K] [--log-samples]
    ... [--out results.json] [--tensor-parallel N under torchrun]

``ppl`` is the NELBO bound over fixed seeded orders of the model's own schedule (the exact
perplexity for ``causal`` and ``autoregressive``); the shards default to the training config's.
``choice`` scores multiple-choice records ``{"context", "choices", "gold"}`` by log-likelihood
(accuracy, and per character of the choice). ``harness`` runs lm-evaluation-harness tasks
(``pip install 'setdiff-dist[eval]'``) through our lm_eval model class; its log-likelihoods are
exact for causal LMs and, for set-diffusion models, the autoregressive order's (exact for W = 1
decoding, a bound otherwise: the results say which); generation uses the decode flags.
Generation decodes as the checkpoint's order trained: set decoding for staggered and
autoregressive orders, cached AR for ``causal``, blocks of ``order.block_size`` on the training
grid for ``block`` (BD3LM; it cannot infill) and MDLM's sampler for ``masked``.
"""

from __future__ import annotations

import argparse
import os
import sys

from setdiff_dist.cli import (
    HelpFormatter,
    add_decode_arguments,
    add_dtype_argument,
    add_weights_argument,
    check_decode_flags,
    command,
    count,
    decode_flags,
    json_text,
)
from setdiff_dist.eval.tasks.flags import parse_thresholds  # noqa: F401  (setdiff-compare's too)


@command("setdiff-eval", process_group=True)
def main(argv=None) -> int:
    from setdiff_dist.eval.tasks import EvalError, check_flags, task_of

    args = parser().parse_args(argv)
    # everything that can be checked before a model load is: the flags, then the task's input
    check_decode_flags(args)
    check_flags(args)
    task = task_of(args.task)(args)
    task.check()
    if args.out:  # where the result goes is checked before the evaluation, not after it
        parent = os.path.dirname(os.path.abspath(args.out))
        if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
            raise EvalError(f"--out {args.out}: {parent} is not a writable directory; "
                            "create it first")

    from setdiff_dist.api import load
    from setdiff_dist.checkpoint.weights import provenance
    from setdiff_dist.inference.decoder import DecodeError
    from setdiff_dist.inference.settings import decode_settings

    loaded = load(args.checkpoint, tensor_parallel=args.tensor_parallel, dtype=args.dtype,
                  raw_weights=args.raw_weights)  # (the Python API's model)
    if args.context is not None:
        loaded.decoder.context = args.context
    if args.mdlm_block is not None:  # MDLM's semi-autoregressive blocks, on generate()
        try:
            loaded.decoder.use_blocks(args.mdlm_block)
        except DecodeError as exc:
            raise EvalError(f"--mdlm-block {args.mdlm_block} (order.kind="
                            f"{loaded.config.order.kind}): {exc}: drop the flag") from None
    # the task's operating point from the paper, unless --preset says otherwise
    flags = dict(decode_flags(args), greedy=task.greedy if args.greedy is None else args.greedy)
    d = decode_settings(loaded.config, args.preset or task.preset, **flags)

    def head() -> dict:  # (read when a result is written: rank 0's, or a task's partial one)
        return {"task": task.name, **provenance(args.checkpoint, args.raw_weights)}

    result = task.run(loaded, d, flags, publish=lambda r: write_result(args, {**head(), **r}))
    import torch.distributed as dist

    if dist.get_rank() != 0:
        return 0

    result = {**head(), **result}
    if task.generates:
        result["decode"] = d.as_dict(("window", "threshold", "greedy", "temperature", "top_p",
                                      "top_k", "repetition_penalty", "max_new_tokens",
                                      "length_penalty", "length_penalty_start"))
        if args.mdlm_block is not None:
            result["decode"]["mdlm_block"] = args.mdlm_block
    print(write_result(args, result))
    skipped = max([result.get("skipped_too_long", 0)]
                  + [r.get("skipped_too_long", 0) for r in result.get("sweep", [])])
    if skipped:  # (scored without them: say so where a person sees it, not only in the JSON)
        print(f"setdiff-eval: {skipped} record(s) did not fit the context with "
              f"--max-new-tokens {d.max_new_tokens} and were not scored "
              "(skipped_too_long); give a smaller --max-new-tokens or a longer --context",
              file=sys.stderr)
    return 0


def parser() -> argparse.ArgumentParser:
    """The command's own flags, the decode flags, then every task's (each
    :class:`~setdiff_dist.eval.tasks.Flag` once), so that ``--help`` lists what each task
    takes."""
    from setdiff_dist.eval.tasks import task_flags, task_names

    ap = argparse.ArgumentParser(prog="setdiff-eval", description=__doc__,
                                 formatter_class=HelpFormatter)
    ap.add_argument("--checkpoint", required=True,
                    help="a training run directory, a checkpoint directory, or an export")
    ap.add_argument("--task", required=True, choices=task_names(),
                    help="what to measure (the examples above show each)")
    add_decode_arguments(ap)
    ap.add_argument("--context", type=count(), default=None,
                    help="decode with a context of this many tokens (default: the checkpoint's "
                         "data.seq_len; e.g. a fine-tune shorter than its pretraining may "
                         "decode at the pretrained length)")
    ap.add_argument("--tensor-parallel", type=count(), default=1,
                    help="shard the model over this many ranks (under torchrun)")
    add_dtype_argument(ap)
    add_weights_argument(ap)
    ap.add_argument("--out", help="write the results here as JSON")
    # a group per task of the flags it alone takes, after those several tasks share
    shared = ap.add_argument_group("flags of several tasks")
    groups = {name: ap.add_argument_group(f"--task {name}") for name in task_names()}
    for flag, takers in task_flags().items():
        typed = {"type": count(flag.count)} if flag.count is not None else {}
        group = groups[takers[0]] if len(takers) == 1 else shared
        group.add_argument(flag.name, help=flag.help, **typed, **flag.options)
    return ap


def write_result(args, result: dict) -> str:
    """``result`` as JSON text, written (atomically) to ``--out`` when given."""
    text = json_text(result, indent=2)
    if args.out:
        from setdiff_dist.checkpoint.files import write_atomic

        write_atomic(args.out, text + "\n")
    return text

if __name__ == "__main__":
    sys.exit(main())
