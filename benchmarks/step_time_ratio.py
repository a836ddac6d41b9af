"""Training-step time of set diffusion (2L tokens) over the plain causal-LM step (L tokens).

Same megatron-core model, same batch, measured side by side in one process and interleaved
(causal, then each set-diffusion path, repeated), so machine noise hits all of them alike.
Prints the median step times and their ratios to the causal LM; the FLOP floor is ~2x
(setdiff_dist.model.flops), a dense 2L mask pays more.

    python benchmarks/step_time_ratio.py                 # L = 256 and 512, CPU paths
    python benchmarks/step_time_ratio.py --seq-len 1024 --backends sdpa flex permuted_causal
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-len", type=int, nargs="+", default=[256, 512])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--backends", nargs="+", default=None,
                    help="default: sdpa and permuted_causal (flex too on a GPU)")
    args = ap.parse_args()

    from setdiff_dist.config import load_config
    from setdiff_dist.diffusion import make_schedule, nelbo, sample_orders
    from setdiff_dist.model.flops import training_flops_per_token
    from setdiff_dist.model.forward import (
        causal_lm_inputs,
        causal_lm_nll,
        set_diffusion_inputs,
        set_diffusion_nll,
    )
    from setdiff_dist.model.transformer import build_model, transformer_config
    from setdiff_dist.parallel import initialize_model_parallel

    device = "cuda" if torch.cuda.is_available() else "cpu"
    backends = args.backends or (["sdpa", "flex", "permuted_causal"] if device == "cuda"
                                 else ["sdpa", "permuted_causal"])
    initialize_model_parallel(seed=0)
    print(f"device {device}, threads {torch.get_num_threads()}, batch {args.batch}, "
          f"{args.layers} layers x {args.hidden} hidden, {args.heads} heads, vocab {args.vocab}, "
          f"fp32, median of {args.repeats}")
    for L in args.seq_len:
        models = {}
        for kind in ["causal"] + backends:
            m = load_config(None, [f"model.num_layers={args.layers}",
                                   f"model.hidden_size={args.hidden}",
                                   f"model.num_attention_heads={args.heads}",
                                   f"model.vocab_size={args.vocab}",
                                   "model.attention_backend="
                                   f"{'sdpa' if kind == 'causal' else kind}",
                                   f"data.seq_len={L}"]).model
            models[kind] = build_model(m, transformer_config(m), seed=0).to(device)
        x = torch.randint(0, args.vocab, (args.batch, L), device=device)
        sample = sample_orders(make_schedule("staggered", L, mean_set_size=4), L,
                               range(args.batch), 0)

        def step(kind, models=models, x=x, sample=sample):
            model = models[kind]
            if kind == "causal":
                inp = causal_lm_inputs(x)
                loss = causal_lm_nll(model(inp.tokens, inp.positions, None), x).mean()
            else:
                inp = set_diffusion_inputs(x, sample, model.mask_id, kind)
                logits = model(inp.tokens, inp.positions, inp.attention_mask, inp.logits_from)
                loss = nelbo(set_diffusion_nll(logits, x, inp), sample).per_token
            loss.backward()
            model.zero_grad(set_to_none=True)
            if device == "cuda":
                torch.cuda.synchronize()

        times = {k: [] for k in models}
        for k in models:  # warm-up (kernel selection, allocator)
            step(k)
        for _ in range(args.repeats):
            for k in models:
                t = time.perf_counter()
                step(k)
                times[k].append(time.perf_counter() - t)
        base = statistics.median(times["causal"])
        flops = training_flops_per_token(m, L) / training_flops_per_token(m, L, causal_lm=True)
        print(f"L = {L}: causal LM step {base * 1e3:8.1f} ms   (FLOP ratio of set diffusion: "
              f"{flops:.2f}x)")
        for k in backends:
            med = statistics.median(times[k])
            print(f"        set diffusion, {k:<16} {med * 1e3:8.1f} ms   ratio {med / base:5.2f}x")


if __name__ == "__main__":
    main()
