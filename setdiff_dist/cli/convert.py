"""``setdiff-convert``: export a training checkpoint (any TP / PP / ZeRO layout) as one
consolidated ``model.safetensors`` with ``config.yaml``, ``export.json`` and the tokenizer; or
convert between that and a Hugging Face Llama / Qwen3 checkpoint directory.

    setdiff-convert --checkpoint runs/tiny-cpu --out exports/tiny-cpu
    setdiff-convert --from-hf ~/models/Qwen3-1.7B-Base --out exports/qwen3-1.7b   # import
    setdiff-convert --from-hf ~/models/Qwen3-1.7B-Base --print-config             # model keys
    setdiff-convert --checkpoint runs/qwen3-gsm --to-hf --out hf/qwen3-gsm         # export

An import holds the [MASK] row (the mean input embedding) and decodes as a causal LM
(``order.kind=causal``) until fine-tuned; training starts from the HF directory itself
(``checkpoint.init_from_hf``). ``--to-hf`` writes the weights in HF's names and layout without
the [MASK] row; a causal-mode model gives the same logits in transformers.
"""

from __future__ import annotations

import argparse
import sys

from setdiff_dist.cli import HelpFormatter, add_weights_argument, command


@command("setdiff-convert")
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="setdiff-convert", description=__doc__,
                                 formatter_class=HelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint",
                     help="a run directory, its checkpoints directory, a step_* directory or "
                          "an export")
    src.add_argument("--from-hf", metavar="DIR",
                     help="a local Hugging Face Llama / Qwen3 checkpoint (config.json + "
                          "safetensors) to import")
    ap.add_argument("--out", help="output directory (new or empty)")
    ap.add_argument("--to-hf", action="store_true",
                    help="with --checkpoint: write a Hugging Face checkpoint directory")
    ap.add_argument("--print-config", action="store_true",
                    help="with --from-hf: print the model section of a config and exit")
    ap.add_argument("--tokenizer", help="with --from-hf: tokenizer spec (default hf:DIR, the "
                                        "checkpoint's own tokenizer.json)")
    ap.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                    help="with --to-hf: tensor dtype (default: the imported checkpoint's, else "
                         "float32)")
    ap.add_argument("--as-causal-lm", action="store_true",
                    help="with --to-hf: export a set-diffusion checkpoint as a causal LM anyway "
                         "(refused without it: an HF causal LM is another model)")
    ap.add_argument("--hf-config", metavar="DIR",
                    help="with --to-hf: take the config.json fields we do not model from DIR")
    add_weights_argument(ap)
    ap.add_argument("--max-shard-size", type=float, default=5.0, metavar="GB",
                    help="with --to-hf: largest safetensors shard (default 5 GB)")
    args = ap.parse_args(argv)
    if args.to_hf and args.from_hf:
        ap.error("--to-hf exports a --checkpoint; --from-hf imports")
    if args.as_causal_lm and not args.to_hf:
        ap.error("--as-causal-lm goes with --to-hf")
    if args.print_config and not args.from_hf:
        ap.error("--print-config goes with --from-hf")
    if not args.out and not args.print_config:
        ap.error("--out is required")
    if not (args.max_shard_size > 0 and args.max_shard_size < float("inf")):
        ap.error(f"--max-shard-size must be a positive number of GB, got {args.max_shard_size}")
    if args.out:  # before anything is read: a file, or a directory with files, is refused
        from setdiff_dist.checkpoint.weights import check_new_directory

        check_new_directory(args.out)
    if args.from_hf:
        from setdiff_dist.model.hf import HFCheckpoint, import_hf, model_yaml

        if args.print_config:
            print(model_yaml(HFCheckpoint(args.from_hf).model_cfg), end="")
            return 0
        meta = import_hf(args.from_hf, args.out, tokenizer=args.tokenizer)
        print(f"setdiff-convert: {meta['parameters']:,} parameters ({meta['imported_from']}) "
              f"from {meta['source']} -> {args.out}", file=sys.stderr)
        return 0
    if args.to_hf:
        from setdiff_dist.model.hf import export_hf

        meta = export_hf(args.checkpoint, args.out, dtype=args.dtype,
                         template_dir=args.hf_config,
                         max_shard_bytes=int(args.max_shard_size * 2**30),
                         raw=args.raw_weights, as_causal_lm=args.as_causal_lm)
        if meta["trained_as"]:
            print(f"setdiff-convert: note: exported as a causal LM on request; the weights "
                  f"were trained as {meta['trained_as'].split(':')[0]} (config.json: "
                  "setdiff_trained_as)", file=sys.stderr)
        print(f"setdiff-convert: {meta['parameters']:,} parameters from {meta['source']} -> "
              f"{args.out} ({meta['architecture']}, {meta['dtype']})", file=sys.stderr)
        return 0
    from setdiff_dist.inference.weights import export

    meta = export(args.checkpoint, args.out, raw=args.raw_weights)
    print(f"setdiff-convert: {meta['parameters']:,} parameters from {meta['source']} -> "
          f"{args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
