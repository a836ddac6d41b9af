"""Long sequences: time and peak memory of the set-diffusion training step (2L tokens) over the
plain causal-LM step (L tokens), per attention backend, side by side in one run.

Same megatron-core model, same batch. For each L: one step of each path under torch's memory
profiler (the peak of live tensors during forward and backward: what a GPU allocator must
hold; allocator caching and RSS are left out), then timed steps interleaved over the repeats
(causal, then each backend, repeated) so machine noise hits all of them alike; medians.
Prints each path's time and memory as a ratio to the causal LM's at the same L, the FLOP floor
(~2x, setdiff_dist.model.flops), and draws both curves (``--plot``).

    python benchmarks/long_context.py                         # L = 512 ... 4096, CPU backends
    python benchmarks/long_context.py --seq-len 256 512 --repeats 2 --plot lc.png
    python benchmarks/long_context.py --backends sdpa flex permuted_causal   # on a GPU

Backends here: ``sdpa`` (the dense [b, 1, 2L, 2L] boolean mask, one per micro-batch) and
``permuted_causal`` (causal kernels on the reveal order, no mask; singleton orders); ``flex``
(a compiled block mask) on a GPU. The order is staggered (SetDLM), mean set size 4.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def peak_live_bytes(fn, device) -> float:
    """The peak of live tensor bytes while ``fn()`` runs, above what was live before."""
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    from torch.profiler import profile
    from torch.profiler._memory_profiler import MemoryProfileTimeline

    with profile(profile_memory=True, record_shapes=True, with_stack=True) as prof:
        fn()
    _, sizes = MemoryProfileTimeline(prof._memory_profile())._coalesce_timeline(
        torch.device("cpu"))
    return float(max(sum(s) for s in sizes) - sum(sizes[0]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-len", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--backends", nargs="+", default=None,
                    help="default: sdpa and permuted_causal (flex too on a GPU)")
    ap.add_argument("--plot", help="draw time and memory ratios against L into this PNG")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--from-json", help="only draw --plot from a --json of an earlier run")
    args = ap.parse_args()
    if args.from_json:
        with open(args.from_json) as fh:
            saved = json.load(fh)
        results = {int(k): v for k, v in saved["results"].items()}
        seq_lens = sorted(results)
        backends = [k for k in results[seq_lens[0]] if k != "causal"]
        draw(results, seq_lens, backends, args.plot or "long_context.png", saved["device"])
        return

    from setdiff_dist.quiet import quiet

    quiet()  # (the libraries' known notices on a CPU)
    from setdiff_dist.config import load_config
    from setdiff_dist.diffusion import make_schedule, sample_orders
    from setdiff_dist.model.flops import training_flops_per_token
    from setdiff_dist.model.forward import causal_lm_inputs, causal_lm_nll
    from setdiff_dist.model.transformer import build_model, transformer_config
    from setdiff_dist.objective import nelbo_step
    from setdiff_dist.parallel import initialize_model_parallel

    device = "cuda" if torch.cuda.is_available() else "cpu"
    backends = args.backends or (["sdpa", "flex", "permuted_causal"] if device == "cuda"
                                 else ["sdpa", "permuted_causal"])
    initialize_model_parallel(seed=0)
    print(f"device {device}, threads {torch.get_num_threads()}, batch {args.batch}, "
          f"{args.layers} layers x {args.hidden} hidden, {args.heads} heads, vocab {args.vocab}, "
          f"fp32, staggered order; times: median of {args.repeats}, interleaved; memory: peak "
          "live tensors of one step", flush=True)
    results = {}
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
                loss = causal_lm_nll(model(inp.tokens, inp.positions, None), x, inp).mean()
            else:  # the training objective's own step (setdiff_dist.objective)
                out, terms = nelbo_step(model, x, sample, kind)
                total, tokens = terms(out)
                loss = total / tokens
            loss.backward()
            model.zero_grad(set_to_none=True)
            if device == "cuda":
                torch.cuda.synchronize()

        for k in models:  # warm-up (kernel selection, compilation, allocator)
            step(k)
        memory = {k: peak_live_bytes(lambda k=k: step(k), device) for k in models}
        times = {k: [] for k in models}
        for _ in range(args.repeats):
            for k in models:
                t = time.perf_counter()
                step(k)
                times[k].append(time.perf_counter() - t)
        med = {k: statistics.median(v) for k, v in times.items()}
        flops = training_flops_per_token(m, L) / training_flops_per_token(m, L, causal_lm=True)
        results[L] = {k: {"seconds": med[k], "peak_bytes": memory[k],
                          "time_ratio": med[k] / med["causal"],
                          "memory_ratio": memory[k] / memory["causal"]} for k in models}
        print(f"L = {L}: causal LM step {med['causal'] * 1e3:9.1f} ms, peak "
              f"{memory['causal'] / 2**20:8.1f} MiB   (FLOP ratio of set diffusion {flops:.2f}x)",
              flush=True)
        for k in backends:
            r = results[L][k]
            print(f"    {k:<16} {r['seconds'] * 1e3:9.1f} ms ({r['time_ratio']:4.2f}x)  peak "
                  f"{r['peak_bytes'] / 2**20:8.1f} MiB ({r['memory_ratio']:4.2f}x)", flush=True)
        del models
    L = max(args.seq_len)
    best = min(backends, key=lambda k: results[L][k]["time_ratio"])
    print(f"best backend at L = {L}: {best}, {results[L][best]['time_ratio']:.2f}x the causal "
          f"step's time, {results[L][best]['memory_ratio']:.2f}x its peak memory")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "device": device, "results": results}, fh, indent=2)
    if args.plot:
        draw(results, args.seq_len, backends, args.plot, device)


def draw(results: dict, seq_lens: list, backends: list, path: str, device: str) -> None:
    """Time and peak-memory ratios to the causal LM against L, one curve per backend."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, title in ((axes[0], "time_ratio", "step time / causal-LM step"),
                           (axes[1], "memory_ratio", "peak live memory / causal-LM step")):
        for k in backends:
            ax.plot(seq_lens, [results[n][k][key] for n in seq_lens], "o-", label=k)
        ax.axhline(2.0, color="grey", lw=0.8, ls="--", label="2x (2L tokens)")
        ax.set(xscale="log", xlabel="L (data tokens)", title=f"{title} ({device})")
        ax.minorticks_off()
        ax.set_xticks(seq_lens, [str(n) for n in seq_lens])
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
