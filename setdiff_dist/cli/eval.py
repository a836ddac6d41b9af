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
import math
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


@command("setdiff-eval", process_group=True)
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="setdiff-eval", description=__doc__,
                                 formatter_class=HelpFormatter)
    ap.add_argument("--checkpoint", required=True,
                    help="a training run directory, a checkpoint directory, or an export")
    ap.add_argument("--task", required=True,
                    choices=("ppl", "infill", "gsm", "summarize", "genppl", "throughput",
                             "choice", "harness"),
                    help="what to measure (the examples above show each)")
    ap.add_argument("--shards", help="ppl: a shard directory with a valid split")
    ap.add_argument("--data", help="infill / gsm: a .jsonl from setdiff-tasks; choice: "
                                   "records {context, choices, gold}; summarize: records "
                                   "{article, highlights} (CNN/DailyMail)")
    ap.add_argument("--scorer", metavar="HF_DIR",
                    help="genppl: a local Hugging Face causal LM that scores the samples (GPT-2 "
                         "Large in the paper) and featurizes them for MAUVE")
    ap.add_argument("--samples", type=count(), default=None,
                    help="genppl: unconditional samples of --max-new-tokens each (default 64); "
                         "throughput: measured generations per setting, the prompts in turn "
                         "(default: one per prompt; the paper: 200)")
    ap.add_argument("--references", metavar="FILE",
                    help="genppl: human texts for MAUVE (JSONL of {text} or blank-line-"
                         "separated paragraphs); none = no MAUVE. MAUVE as the paper measures "
                         "it: --mauve-subsets subsets of --mauve-subset-size texts drawn from "
                         "this pool, each against the first generations, mean and std")
    ap.add_argument("--variable-length", action="store_true",
                    help="genppl: the paper's variable-length samples: each ends at its first "
                         "end-of-text after 32 tokens, or where the last 128 tokens' unigram "
                         "entropy drops below 4 nats; a degenerate sample (unigram entropy "
                         "below 4 nats, 50 tokens or fewer) is drawn again (default: every "
                         "sample --max-new-tokens long)")
    ap.add_argument("--mauve-subsets", type=count(), default=5, metavar="K",
                    help="genppl: reference subsets MAUVE is averaged over (the paper: 5)")
    ap.add_argument("--mauve-subset-size", type=count(), default=1000,
                    metavar="N", help="genppl: human texts per subset, drawn without "
                    "replacement (the paper: 1000; --references must hold at least N)")
    ap.add_argument("--template", default=None,
                    help="summarize: the prompt around {article} (default: the article, a "
                         "blank line, 'TL;DR:' and a newline)")
    ap.add_argument("--harness-tasks", help="harness: lm-eval task names, comma-separated")
    ap.add_argument("--include-path", help="harness: a directory of task YAMLs of your own")
    ap.add_argument("--num-fewshot", type=count(0), help="harness: few-shot examples per prompt")
    ap.add_argument("--log-samples", action="store_true",
                    help="harness: every request's arguments and answers in the results")
    ap.add_argument("--gen-kwargs", metavar="K=V,...",
                    help="harness: generation settings over every task's own, as lm-eval's "
                         "--gen_kwargs (max_gen_toks, until, do_sample, temperature, top_p)")
    ap.add_argument("--output-path", metavar="DIR",
                    help="harness: also write each task's results and samples in lm-eval's "
                         "own layout here (what its tooling reads)")
    ap.add_argument("--bos-eos", action="store_true",
                    help="summarize: frame the article (with the template's text before the "
                         "cue) as [BOS] ... [EOS] before the cue, as setdiff-prep --bos-eos "
                         "frames the training prompts (the reference's CNN/DailyMail)")
    ap.add_argument("--max-prompt-tokens", type=count(), default=None, metavar="N",
                    help="summarize: the framed article keeps at most N tokens (the reference: "
                         "512), its text cut, never the frame or the cue")
    ap.add_argument("--rouge-stemmer", action="store_true",
                    help="summarize: ROUGE with the Porter stemmer (the paper's reference scores "
                         "without it, as evaluate's ROUGE does by default)")
    ap.add_argument("--limit", type=count(), default=None,
                    help="the first N records (default: all of them, the whole test set, as the "
                         "paper scores it; harness: per task)")
    ap.add_argument("--batches", type=count(), default=16, help="ppl: validation batches")
    ap.add_argument("--batch-size", type=count(), default=8,
                    help="ppl / choice / genppl / harness: sequences per forward")
    add_decode_arguments(ap)
    ap.add_argument("--prompt", action="append", default=None, help="throughput prompts")
    ap.add_argument("--unconditional", action="store_true",
                    help="throughput: generate from the end-of-text token, no prompt (the "
                         "paper's OWT and LM1B throughput)")
    ap.add_argument("--warmup", type=count(0), default=1,
                    help="throughput: generations per setting before the measured ones (the "
                         "paper: 50)")
    ap.add_argument("--context", type=count(), default=None,
                    help="decode with a context of this many tokens (default: the checkpoint's "
                         "data.seq_len; e.g. a fine-tune shorter than its pretraining may "
                         "decode at the pretrained length)")
    ap.add_argument("--mdlm-block", type=count(), default=None, metavar="B",
                    help="gsm / summarize / throughput / genppl with an MDLM (order.kind="
                         "masked) checkpoint: decode semi-autoregressively in blocks of B "
                         "positions on the grid [kB, (k+1)B), left to right, stopping after the "
                         "block a stop falls in (the paper's CNN/DailyMail and GSM8K MDLM rows: "
                         "32; default: the whole span at once)")
    ap.add_argument("--thresholds", metavar="TAU,...", default=None,
                    help="gsm / throughput: sweep these thresholds (e.g. 0.5,0.7,0.9,inf): per "
                         "tau, accuracy (gsm), tokens/step and tokens/s, as the paper's tau "
                         "sweep; paper: the reference runner's 10 points, inf, 0.99, 0.95, "
                         "0.9, 0.85, ..., 0.6")
    ap.add_argument("--tensor-parallel", type=count(), default=1,
                    help="shard the model over this many ranks (under torchrun)")
    add_dtype_argument(ap)
    add_weights_argument(ap)
    ap.add_argument("--out", help="write the results here as JSON")
    args = ap.parse_args(argv)

    from setdiff_dist.api import load
    from setdiff_dist.checkpoint.weights import provenance
    from setdiff_dist.eval import tasks
    from setdiff_dist.inference.decoder import DecodeError, check_text
    from setdiff_dist.inference.settings import decode_settings, sampling_of

    # everything that can be checked before a model load is
    check_decode_flags(args)
    thresholds = parse_thresholds(args.thresholds) if args.thresholds else None
    if thresholds and args.task not in ("gsm", "throughput"):
        raise tasks.EvalError(f"--thresholds sweeps --task gsm or throughput, not --task "
                              f"{args.task}")
    if thresholds and args.threshold is not None:
        raise tasks.EvalError("give --threshold or --thresholds, not both")
    for text in args.prompt or []:
        check_text("--prompt", text)
    limit = args.limit  # (None: every record)
    harness_flags = [f for f, v in (("--harness-tasks", args.harness_tasks),
                                    ("--gen-kwargs", args.gen_kwargs),
                                    ("--output-path", args.output_path),
                                    ("--include-path", args.include_path),
                                    ("--num-fewshot", args.num_fewshot),
                                    ("--log-samples", args.log_samples)) if v not in (None, False)]
    if harness_flags and args.task != "harness":
        raise tasks.EvalError(f"{', '.join(harness_flags)} go with --task harness, not --task "
                              f"{args.task}: remove them, or run --task harness")
    if args.template is not None and args.task != "summarize":
        raise tasks.EvalError("--template goes with --task summarize")
    summarize_flags = [f for f, v in (("--rouge-stemmer", args.rouge_stemmer),
                                      ("--bos-eos", args.bos_eos),
                                      ("--max-prompt-tokens", args.max_prompt_tokens))
                       if v not in (None, False)]
    if summarize_flags and args.task != "summarize":
        raise tasks.EvalError(f"{', '.join(summarize_flags)} go with --task summarize")
    throughput_flags = [f for f, given in (
        ("--unconditional", args.unconditional), ("--warmup", args.warmup != 1),
        ("--samples", args.samples is not None and args.task != "genppl")) if given]
    if args.task == "genppl" and args.samples is None:
        args.samples = 64
    if throughput_flags and args.task != "throughput":
        raise tasks.EvalError(f"{', '.join(throughput_flags)} "
                              f"{'goes' if len(throughput_flags) == 1 else 'go'} with --task "
                              "throughput")
    if args.unconditional and args.prompt:
        raise tasks.EvalError("give --prompt or --unconditional, not both")
    if args.task == "summarize":
        tasks.rouge_scorer()  # (installed: said before the model loads)
    genppl_flags = [f for f, v in (("--scorer", args.scorer),
                                   ("--references", args.references)) if v is not None] + \
        [f for f, v, default in (("--mauve-subsets", args.mauve_subsets, 5),
                                 ("--mauve-subset-size", args.mauve_subset_size, 1000))
         if v != default] + (["--variable-length"] if args.variable_length else [])
    if genppl_flags and args.task != "genppl":
        raise tasks.EvalError(f"{', '.join(genppl_flags)} go with --task genppl")
    if args.task == "genppl":
        if not args.scorer:
            raise tasks.EvalError("--task genppl needs --scorer HF_DIR (a local Hugging Face "
                                  "causal LM: GPT-2 Large in the paper)")
        references = tasks.read_texts(args.references, None) if args.references else None
        if references and len(references) < args.mauve_subset_size:
            raise tasks.EvalError(
                f"--references {args.references}: {len(references)} texts, but MAUVE draws "
                f"subsets of {args.mauve_subset_size} (--mauve-subset-size; the paper: 1000)")
        scorer = tasks.HFScorer(args.scorer)
    if args.task in ("infill", "gsm", "choice", "summarize"):
        if not args.data:
            raise tasks.EvalError(f"--task {args.task} needs --data FILE.jsonl "
                                  f"({tasks.TASK_MAKE[args.task]})")
        tasks.check_task_file(args.data, args.task, limit)
    if args.task == "harness":
        harness_tasks = [t for t in (args.harness_tasks or "").split(",") if t.strip()]
        if not harness_tasks:
            raise tasks.EvalError("--task harness needs --harness-tasks T1[,T2...] (lm-eval "
                                  "task names; tasks of your own: --include-path DIR)")
        if args.include_path and not os.path.isdir(args.include_path):
            raise tasks.EvalError(f"--include-path {args.include_path}: no such directory")
        try:
            from setdiff_dist.eval import harness
        except ImportError as exc:
            raise tasks.EvalError(f"lm-evaluation-harness is not installed ({exc}); install it "
                                  "with: pip install 'setdiff-dist[eval]'") from None
        harness_names = [t.strip() for t in harness_tasks]
        manager = harness.task_manager(harness_names, args.include_path)
        # their datasets, and every generation task's settings, before the model is loaded
        harness_tasks, leaves = harness.load_tasks(harness_names, manager)
        harness.check_generation(leaves, harness.parse_gen_kwargs(args.gen_kwargs))
    if args.out:  # where the result goes is checked before the evaluation, not after it
        parent = os.path.dirname(os.path.abspath(args.out))
        if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
            raise tasks.EvalError(f"--out {args.out}: {parent} is not a writable directory; "
                                  "create it first")
    loaded = load(args.checkpoint, tensor_parallel=args.tensor_parallel, dtype=args.dtype,
                  raw_weights=args.raw_weights)  # (the Python API's model)
    model, cfg, tok, decoder = loaded.module, loaded.config, loaded.tokenizer, loaded.decoder
    mode = decoder.decoding
    if args.context is not None:
        decoder.context = args.context
    if args.mdlm_block is not None:  # MDLM's semi-autoregressive blocks, on generate()
        if args.task not in ("gsm", "summarize", "throughput", "genppl"):
            raise tasks.EvalError(f"--mdlm-block goes with --task gsm, summarize, throughput "
                                  f"or genppl (what an MDLM generates), not --task {args.task}")
        if mode != "mdlm":
            raise tasks.EvalError(f"--mdlm-block {args.mdlm_block}: this checkpoint "
                                  f"(order.kind={cfg.order.kind}) decodes as '{mode}', not with "
                                  "MDLM's sampler; the flag is for a masked (MDLM) checkpoint: "
                                  "drop it")
        decoder.block_size = args.mdlm_block
    left_only = False
    if args.task == "infill":  # a model that cannot see a right context (AR, BD3LM) infills
        try:                   # from the left one, as the reference scores those rows
            decoder.check_infill()
        except DecodeError as exc:
            left_only = True
            print(f"setdiff-eval: {exc}; it infills from the left context only, as the "
                  "paper's AR and BD3LM rows are scored", file=sys.stderr)
    # each task's operating point from the paper, unless --preset says otherwise; evaluation
    # decodes greedily unless --no-greedy (reproducible numbers)
    # (genppl samples: the paper's unconditional samples are drawn, not greedy)
    flags = dict(decode_flags(args), greedy=(args.task != "genppl") if args.greedy is None
                 else args.greedy)
    d = decode_settings(cfg, args.preset or {"gsm": "gsm", "infill": "infill"}.get(args.task),
                        **flags)
    sampling = sampling_of(d)
    if args.task == "harness":
        lm = harness.SetdiffLM(loaded=(model, cfg, tok), batch_size=args.batch_size,
                               preset=args.preset, **flags)
        # each finished task's results on disk before the next starts
        result = harness.run(lm, manager, harness_tasks, limit, args.num_fewshot,
                             args.log_samples, gen_kwargs=args.gen_kwargs,
                             output_path=args.output_path, names=harness_names,
                             on_result=lambda r: write_result(args, {
                                 "task": "harness", **provenance(args.checkpoint,
                                                                 args.raw_weights), **r}))
    elif args.task == "choice":
        from setdiff_dist.eval.likelihood import Scorer

        result = tasks.multiple_choice(Scorer(model, cfg, tok, args.batch_size), args.data,
                                       limit)
    elif args.task == "ppl":
        shards = args.shards or cfg.data.valid_shards or cfg.data.train_shards
        result = tasks.perplexity(model, cfg, shards, args.batches, args.batch_size)
    elif args.task == "infill":
        result = tasks.infilling(decoder, tok, args.data, limit, d["window"],
                                 d["threshold"], sampling, left_only)
    elif args.task == "genppl":
        result = tasks.generative_perplexity(decoder, tok, scorer, args.samples,
                                             d["max_new_tokens"], d["window"], d["threshold"],
                                             sampling, args.batch_size, references,
                                             mauve_protocol={"subsets": args.mauve_subsets,
                                                             "size": args.mauve_subset_size},
                                             variable=args.variable_length)
        result["scorer"] = args.scorer
    elif args.task == "summarize":
        result = tasks.summarize(decoder, tok, args.data, limit, d["max_new_tokens"],
                                 d["window"], d["threshold"], sampling,
                                 args.template or tasks.SUMMARY_TEMPLATE, args.rouge_stemmer,
                                 args.bos_eos, args.max_prompt_tokens)
    elif args.task == "gsm" and thresholds:
        result = tasks.gsm_sweep(decoder, tok, args.data, limit, d["max_new_tokens"],
                                 d["window"], thresholds, sampling)
    elif args.task == "gsm":
        result = tasks.gsm(decoder, tok, args.data, limit, d["max_new_tokens"],
                           d["window"], d["threshold"], sampling)
    else:
        prompts = [None] if args.unconditional else \
            args.prompt or ["Shall I compare thee", "In the beginning", "O Romeo"]
        w = d["window"]
        if thresholds or args.threshold is not None:  # the thresholds asked for, at W
            settings = [(w, tau) for tau in thresholds or [d["threshold"]]]
        else:
            settings = {"set": [(1, math.inf), (w, math.inf), (w, 0.9), (w, 0.5)],
                        "causal": [(1, math.inf)]}.get(mode, [(w, math.inf), (w, 0.9),
                                                              (w, 0.5)])
        result = tasks.throughput(decoder, tok, prompts, d["max_new_tokens"], settings,
                                  sampling, args.warmup, args.samples)
    import torch.distributed as dist

    if dist.get_rank() != 0:
        return 0

    result = {"task": args.task, **provenance(args.checkpoint, args.raw_weights), **result}
    if args.task not in ("ppl", "choice", "harness"):
        result["decode"] = {k: d[k] for k in ("window", "threshold", "greedy", "temperature",
                                              "top_p", "top_k", "repetition_penalty",
                                              "max_new_tokens")}
        if args.mdlm_block is not None:
            result["decode"]["mdlm_block"] = args.mdlm_block
    # (harness: each task's requests carry their own max_gen_toks and until; the results'
    # "generation" lists what the requests decoded with)
    print(write_result(args, result))
    skipped = max([result.get("skipped_too_long", 0)]
                  + [r.get("skipped_too_long", 0) for r in result.get("sweep", [])])
    if skipped:  # (scored without them: say so where a person sees it, not only in the JSON)
        print(f"setdiff-eval: {skipped} record(s) did not fit the context with "
              f"--max-new-tokens {d['max_new_tokens']} and were not scored "
              "(skipped_too_long); give a smaller --max-new-tokens or a longer --context",
              file=sys.stderr)
    return 0


def parse_thresholds(text: str, flag: str = "--thresholds") -> list[float]:
    """``--thresholds 0.5,0.9,inf`` as floats (each a confidence in [0, 1], or inf); ``paper``
    stands for the reference runner's GSM8K grid (:data:`setdiff_dist.eval.tasks.PAPER_TAUS`)."""
    from setdiff_dist.eval.tasks import PAPER_TAUS, EvalError

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


def write_result(args, result: dict) -> str:
    """``result`` as JSON text, written (atomically) to ``--out`` when given."""
    text = json_text(result, indent=2)
    if args.out:
        from setdiff_dist.checkpoint.files import write_atomic

        write_atomic(args.out, text + "\n")
    return text



if __name__ == "__main__":
    sys.exit(main())
