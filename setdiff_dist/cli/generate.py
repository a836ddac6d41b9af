"""``setdiff-generate``: KV-cached set decoding from a checkpoint or an export.

    setdiff-generate --checkpoint runs/tiny-cpu --prompt "Shall I compare thee" \\
        --max-new-tokens 64 --window 8 --threshold 0.9 [--greedy] [--json]
    setdiff-generate --checkpoint DIR --infill-left "..." --infill-right "..." --infill-length 12
    setdiff-generate --checkpoint DIR                      # unconditional (from end-of-text)

A checkpoint decodes as its order trained (``inference.decoder.decoder_for``): set decoding,
cached AR for ``order.kind=causal``, blocks of ``order.block_size`` on the training grid for
``block`` (BD3LM, which cannot infill), MDLM's sampler for ``masked`` (no window).

Decoding settings default to the checkpoint's ``decode`` section (its window, when unset, to the
order's mean set size D); ``--preset gsm|infill`` applies the paper's operating points on top,
and each flag overrides both.

The generated text goes to standard output and the statistics (tokens/s, tokens/step, steps) to
standard error; ``--json`` prints one JSON object instead. Under torchrun with
``--tensor-parallel N`` the model is sharded over N ranks (rank 0 prints).
"""

from __future__ import annotations

import argparse
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


@command("setdiff-generate", process_group=True)
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="setdiff-generate", description=__doc__,
                                 formatter_class=HelpFormatter)
    ap.add_argument("--checkpoint", required=True,
                    help="a training run directory, a checkpoint directory, or an export")
    ap.add_argument("--prompt", action="append", default=None,
                    help="prompt text (repeat for a batch); none = unconditional")
    add_decode_arguments(ap)
    ap.add_argument("--stop", action="append", default=[],
                    help="stop string (prefix 're:' for a regex); repeatable, added to the "
                         "checkpoint's decode.stop")
    ap.add_argument("--no-eos-stop", action="store_true", help="do not stop at end-of-text")
    ap.add_argument("--infill-left", default=None,
                    help="infilling: the text before the span (with --infill-length)")
    ap.add_argument("--infill-right", default=None,
                    help="infilling: the text after the span (set-diffusion models only)")
    ap.add_argument("--infill-length", type=count(), default=None, help="tokens to fill")
    ap.add_argument("--tensor-parallel", type=count(), default=1,
                    help="shard the model over this many ranks (under torchrun)")
    add_dtype_argument(ap)
    add_weights_argument(ap)
    ap.add_argument("--seed", type=int, default=0, help="sampling seed")
    ap.add_argument("--json", action="store_true",
                    help="print one JSON object (with each result's decoding trace: per forward "
                         "step, the absolute positions committed in it, the prompt from 0)")
    ap.add_argument("--trace-png", metavar="FILE",
                    help="draw the decoding trace: position x step, coloured by confidence")
    args = ap.parse_args(argv)

    from setdiff_dist.api import load
    from setdiff_dist.inference.decoder import DecodeError, StopCriteria, check_text

    # the flags first: a bad one costs no model load
    check_decode_flags(args)
    for flag in ("prompt", "infill_left", "infill_right", "stop"):
        for text in (lambda v: v if isinstance(v, list) else [v])(getattr(args, flag) or []):
            check_text(f"--{flag.replace('_', '-')}", text)
    StopCriteria(stop=args.stop)
    if (args.infill_left is not None or args.infill_right is not None) and \
            args.infill_length is None:
        raise DecodeError("infilling needs --infill-length")
    model = load(args.checkpoint, tensor_parallel=args.tensor_parallel, dtype=args.dtype,
                 raw_weights=args.raw_weights)
    flags = decode_flags(args)
    d = model.settings(args.preset, stop=args.stop, **flags)  # (what the results report)
    mode = model.decoding
    if args.infill_left is not None or args.infill_right is not None:
        results = model.infill([args.infill_left or ""], [args.infill_right or ""],
                               [args.infill_length], seed=args.seed, preset=args.preset,
                               **{k: flags[k] for k in ("window", "threshold", "greedy",
                                                        "temperature", "top_p", "top_k",
                                                        "repetition_penalty")})
        prompts = [args.infill_left or ""]
    else:
        prompts = args.prompt if args.prompt is not None else [None]
        results = model.generate(prompts, stop=args.stop, eos_stop=not args.no_eos_stop,
                                 seed=args.seed, preset=args.preset, **flags)
    import torch.distributed as dist

    if dist.get_rank() != 0:
        return 0
    seconds = results[0].seconds
    new_tokens = sum(len(r.tokens) for r in results)
    stats = {"tokens_per_s": new_tokens / max(seconds, 1e-9),
             "tokens_per_step": [r.tokens_per_step for r in results],
             "steps": [r.steps for r in results], "seconds": seconds,
             "window": d.window, "threshold": d.threshold, "greedy": d.greedy,
             "mode": mode}
    if args.trace_png:
        draw_trace(results, prompts, args.trace_png, d.window, d.threshold)
    if args.json:
        print(json_text({"prompts": prompts, "texts": [r.text for r in results],
                         "tokens": [r.tokens for r in results],
                         "trace": [r.trace for r in results], **stats}))
    else:
        for r in results:
            print(r.text)
        print(f"{new_tokens} tokens in {seconds:.2f} s: {stats['tokens_per_s']:.1f} tokens/s, "
              f"{sum(r.steps for r in results)} steps, "
              f"{new_tokens / max(sum(r.steps for r in results), 1):.2f} tokens/step",
              file=sys.stderr)
    return 0



def draw_trace(results, prompts, path: str, window: int, threshold: float) -> None:
    """One panel per result (at most four): a dot per committed token at (position, forward
    step), coloured by its confidence; the prompt is the grey band at the left."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = results[:4]
    fig, axes = plt.subplots(len(shown), 1, figsize=(9, 2.6 * len(shown)), squeeze=False)
    for ax, r, prompt in zip(axes[:, 0], shown, prompts):
        xs = [p for step in r.trace for p in step]
        ys = [i for i, step in enumerate(r.trace) for _ in step]
        cs = [c for step in r.trace_confidence for c in step]
        first = min(xs) if xs else 0
        ax.axvspan(-0.5, first - 0.5, color="0.9", label="prompt")
        dots = ax.scatter(xs, ys, c=cs, cmap="viridis", vmin=0, vmax=1, s=14)
        ax.invert_yaxis()
        ax.set_xlabel("position")
        ax.set_ylabel("forward step")
        per = len(xs) / max(len(r.trace), 1)
        ax.set_title(f"{len(xs)} tokens in {len(r.trace)} steps ({per:.2f} per step), "
                     f"W={window}, tau={threshold:g}: {(prompt or '')[:40]!r}", fontsize=9)
        fig.colorbar(dots, ax=ax, label="confidence")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"setdiff-generate: trace -> {path}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
