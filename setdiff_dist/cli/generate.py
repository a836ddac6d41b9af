"""``setdiff-generate``: KV-cached set decoding from a checkpoint or an export.

    setdiff-generate --checkpoint runs/tiny-cpu --prompt "Shall I compare thee" \\
        --max-new-tokens 64 --window 8 --threshold 0.9 [--greedy] [--json]
    setdiff-generate --checkpoint DIR --infill-left "..." --infill-right "..." --infill-length 12
    setdiff-generate --checkpoint DIR                      # unconditional (from end-of-text)

The generated text goes to standard output and the statistics (tokens/s, tokens/step, steps) to
standard error; ``--json`` prints one JSON object instead. Under torchrun with
``--tensor-parallel N`` the model is sharded over N ranks (rank 0 prints).
"""

from __future__ import annotations

import argparse
import math
import sys

from setdiff_dist.cli import add_dtype_argument, command, count, inference_dtype, json_text


@command("setdiff-generate", process_group=True)
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="setdiff-generate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True,
                    help="a training run directory, a checkpoint directory, or an export")
    ap.add_argument("--prompt", action="append", default=None,
                    help="prompt text (repeat for a batch); none = unconditional")
    ap.add_argument("--max-new-tokens", type=count(), default=128)
    ap.add_argument("--window", type=count(), default=16, help="candidate window W")
    ap.add_argument("--threshold", type=float, default=math.inf,
                    help="confidence threshold tau ('inf' = one token per step)")
    ap.add_argument("--greedy", action="store_true")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--repetition-penalty", type=float, default=1.0)
    ap.add_argument("--stop", action="append", default=[],
                    help="stop string (prefix 're:' for a regex); repeatable")
    ap.add_argument("--max-repeat-run", type=count(), default=None)
    ap.add_argument("--no-eos-stop", action="store_true", help="do not stop at end-of-text")
    ap.add_argument("--infill-left", default=None)
    ap.add_argument("--infill-right", default=None)
    ap.add_argument("--infill-length", type=count(), default=None, help="tokens to fill")
    ap.add_argument("--tensor-parallel", type=count(), default=1)
    add_dtype_argument(ap)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)

    from setdiff_dist.inference.decoder import (DecodeError, Sampling, SetDecoder, StopCriteria,
                                                check_text, check_threshold)
    from setdiff_dist.inference.weights import build_inference_model

    # the flags first: a bad one costs no model load
    sampling = Sampling(greedy=args.greedy, temperature=args.temperature, top_p=args.top_p,
                        repetition_penalty=args.repetition_penalty, seed=args.seed)
    check_threshold(args.threshold)
    for flag in ("prompt", "infill_left", "infill_right", "stop"):
        for text in (lambda v: v if isinstance(v, list) else [v])(getattr(args, flag) or []):
            check_text(f"--{flag.replace('_', '-')}", text)
    stop = StopCriteria(eos_id=None, stop=args.stop, max_repeat_run=args.max_repeat_run)
    if (args.infill_left is not None or args.infill_right is not None) and \
            args.infill_length is None:
        raise DecodeError("infilling needs --infill-length")
    model, cfg, tok = build_inference_model(args.checkpoint, tensor=args.tensor_parallel,
                                            dtype=inference_dtype(args.dtype))
    mode = "causal" if cfg.order.kind == "causal" else "set"
    decoder = SetDecoder(model, tok, context=cfg.data.seq_len, mode=mode)
    if args.infill_left is not None or args.infill_right is not None:
        results = decoder.infill([tok.encode(args.infill_left or "")],
                                 [tok.encode(args.infill_right or "")], [args.infill_length],
                                 window=min(args.window, args.infill_length),
                                 threshold=args.threshold, sampling=sampling)
        prompts = [args.infill_left or ""]
    else:
        prompts = args.prompt if args.prompt is not None else [None]
        ids = [tok.encode(p) if p is not None else [tok.eos_id] for p in prompts]
        stop.eos_id = None if args.no_eos_stop else tok.eos_id
        results = decoder.generate(ids, args.max_new_tokens, window=args.window,
                                   threshold=args.threshold, sampling=sampling, stop=stop)
    import torch.distributed as dist

    if dist.get_rank() != 0:
        return 0
    seconds = results[0].seconds
    new_tokens = sum(len(r.tokens) for r in results)
    stats = {"tokens_per_s": new_tokens / max(seconds, 1e-9),
             "tokens_per_step": [r.tokens_per_step for r in results],
             "steps": [r.steps for r in results], "seconds": seconds,
             "window": args.window, "threshold": args.threshold, "mode": mode}
    if args.json:
        print(json_text({"prompts": prompts, "texts": [r.text for r in results],
                         "tokens": [r.tokens for r in results], **stats}))
    else:
        for r in results:
            print(r.text)
        print(f"{new_tokens} tokens in {seconds:.2f} s: {stats['tokens_per_s']:.1f} tokens/s, "
              f"{sum(r.steps for r in results)} steps, "
              f"{new_tokens / max(sum(r.steps for r in results), 1):.2f} tokens/step",
              file=sys.stderr)
    return 0



if __name__ == "__main__":
    sys.exit(main())
