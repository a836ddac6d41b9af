"""Decoding speed against transformers' ``generate`` on the same weights, side by side in one run.

    python benchmarks/decode_vs_hf.py [--shapes small 110m] [--batches 1 8] [--repeats 3]

For each shape a causal model with seeded random weights is built once; its full tensors are
written as a Hugging Face Llama checkpoint (our ``--to-hf`` export path) and loaded by
transformers, and loaded by our engines from the same tensors. Then, interleaved over repeats,
greedy decoding of N new tokens after a 16-token prompt:

- ``hf``: ``AutoModelForCausalLM.generate`` (transformers' KV cache);
- ``causal``: our causal-LM KV-cached decoding (the inference engine,
  :mod:`setdiff_dist.inference.lean`); ``causal packed``: the same with the large weights packed
  for oneDNN (``pack=True``, as setdiff-generate loads set-diffusion models on the CPU:
  cheaper for several rows per step, dearer for one);
- ``set tau=inf``: set decoding with window W=4 and one commit per step (each step: the
  committed token plus 4 [MASK] queries), on the lean engine loaded as setdiff-generate loads a
  set-diffusion model on the CPU (``pack="auto"``: each weight shape packed for oneDNN only where
  that measured faster for the step's 5 rows, on this CPU); ``set tau=0.9`` accepts every
  candidate above 0.9 (random weights are rarely that confident: it measures the step cost).

Steady-state tokens/s = (N_long - N_short) / (t(N_long) - t(N_short)) per sample, so model
loading, the prompt and warm-up are excluded; medians over the repeats. The greedy tokens of
``causal`` must equal transformers' (checked, printed). Shapes: ``small`` = 4 layers x 256
hidden, vocabulary 50,304; ``small-2k`` the same with a vocabulary of 2,048; ``110m`` =
configs/models/110m.yaml as a Llama (RMSNorm, SwiGLU at 2048 wide); ``1.3b`` =
configs/models/1.3b.yaml. fp32 on the CPU by default; on a GPU
(``--device cuda --dtype bfloat16``, as tests/gpu/run.sh runs it) the same comparison in bf16.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = {"small": ["model.num_layers=4", "model.hidden_size=256", "model.num_attention_heads=4",
                    "model.vocab_size=50304"],
          # the shape of issue 32's set-step target: per-step work, not the head, dominates
          "small-2k": ["model.num_layers=4", "model.hidden_size=256",
                       "model.num_attention_heads=4", "model.vocab_size=2048"],
          # the 110m shape as a Llama (transformers has no GPT-2 with our rotary / untied
          # layout): RMSNorm + SwiGLU at 2048 = 8/3 x hidden keeps the parameter count
          "110m": ["model.normalization=rmsnorm", "model.activation=swiglu",
                   "model.ffn_hidden_size=2048"],
          "1.3b": []}


class _NoText:
    """The decoders decode text only for stop strings; none here."""

    def decode(self, ids):
        return ""


def _weights(shape: str):
    """(model config, full tensors by global name) of a seeded random causal model (drawn by
    the training model's initialization)."""
    from setdiff_dist.config import load_config
    from setdiff_dist.model.transformer import build_model, global_name, transformer_config

    path = os.path.join(ROOT, "configs", "models", f"{shape}.yaml") \
        if not shape.startswith("small") else None
    cfg = load_config(path, ["order.kind=causal", *SHAPES[shape]])
    model = build_model(cfg.model, transformer_config(cfg.model), seed=0)
    rows = cfg.model.vocab_size + 1
    state = {}
    for name, p in model.named_parameters():
        g = global_name(model, name)
        state[g] = p.detach()[:rows] if g in ("embedding.weight", "output_layer.weight") \
            else p.detach()
    return cfg.model, state


def _hf_model(model_cfg, state, directory, device, dtype):
    from transformers import AutoModelForCausalLM

    from setdiff_dist.model.hf import hf_config, hf_tensors, write_hf

    out = os.path.join(directory, "hf")
    write_hf(hf_tensors(state, model_cfg), hf_config(model_cfg), out, "float32")
    # loaded in the dtype, not cast after (a cast would round its float32 rotary frequencies);
    # the keyword is torch_dtype before transformers 4.56, and the GPU machine has its own
    import transformers
    from packaging.version import Version

    key = "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"
    return AutoModelForCausalLM.from_pretrained(out, **{key: dtype}).to(device).eval()


def _runners(model_cfg, state, directory, device, dtype):
    from setdiff_dist.inference.decoder import CausalDecoder, Sampling, SetDecoder
    from setdiff_dist.inference.lean import LeanTransformer

    hf = _hf_model(model_cfg, state, directory, device, dtype)
    lean = LeanTransformer.from_state_dict(model_cfg, state, device=device, dtype=dtype).eval()
    # the same weights packed for oneDNN, as setdiff-generate loads a set-diffusion model on the
    # CPU; built on the device in its dtype (off the CPU or fp32 nothing is packed)
    packed = LeanTransformer.from_state_dict(model_cfg, state, pack=True, device=device,
                                             dtype=dtype).eval()
    auto = LeanTransformer.from_state_dict(model_cfg, state, pack="auto", pack_rows=5,
                                           device=device, dtype=dtype).eval()
    print(f"pack='auto' packed: {sorted(k.split('.')[-1] for k in auto._packed) or 'nothing'}",
          flush=True)
    greedy, ctx = Sampling(greedy=True), 4096

    def hf_run(prompts, n):
        with torch.no_grad():
            out = hf.generate(torch.tensor(prompts, device=device), max_new_tokens=n,
                              min_new_tokens=n, do_sample=False, pad_token_id=0)
        return out[:, len(prompts[0]):].tolist()

    def ours(model, mode, window=1, threshold=float("inf")):
        dec = (CausalDecoder if mode == "causal" else SetDecoder)(model, _NoText(), context=ctx)

        def run(prompts, n):
            return [r.tokens for r in dec.generate(prompts, n, window=window,
                                                   threshold=threshold, sampling=greedy)]
        return run

    runners = {"hf": hf_run, "causal": ours(lean, "causal"),
               "causal packed": ours(packed, "causal"),
               "set W=4 tau=inf": ours(auto, "set", 4),
               "set W=4 tau=0.9": ours(auto, "set", 4, 0.9)}
    return runners


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["small", "110m"], choices=list(SHAPES))
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--short", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()

    from setdiff_dist.parallel import initialize_model_parallel

    initialize_model_parallel(seed=0, backend="nccl" if args.device == "cuda" else "gloo")
    results = {}
    for shape in args.shapes:
        model_cfg, state = _weights(shape)
        with tempfile.TemporaryDirectory() as tmp:
            runners = _runners(model_cfg, state, tmp, args.device,
                               getattr(torch, args.dtype))
            gen = torch.Generator().manual_seed(0)
            for batch in args.batches:
                prompts = torch.randint(0, model_cfg.vocab_size, (batch, 16),
                                        generator=gen).tolist()
                ref = runners["hf"](prompts, 32)
                # (bf16 may differ by ties)
                match = all(runners[k](prompts, 32) == ref for k in ("causal", "causal packed"))
                times = {name: [] for name in runners}
                for _ in range(args.repeats):
                    for name, run in runners.items():
                        spans = []
                        for n in (args.short, args.new_tokens):
                            start = time.perf_counter()
                            run(prompts, n)
                            spans.append(time.perf_counter() - start)
                        times[name].append((args.new_tokens - args.short)
                                           / (spans[1] - spans[0]))
                row = {name: statistics.median(v) for name, v in times.items()}
                results[f"{shape}/batch{batch}"] = {"tokens_per_s_per_sample": row,
                                                   "greedy_tokens_equal_hf": match}
                print(f"\n{shape}, batch {batch}: greedy tokens equal transformers': {match}")
                print(f"  {'decoder':<18} {'tokens/s/sample':>16} {'x hf':>6} {'total tok/s':>12}")
                for name, v in row.items():
                    print(f"  {name:<18} {v:16.1f} {v / row['hf']:6.2f} {v * batch:12.1f}")
                best = max(row["causal"], row["causal packed"])
                step = best / row["set W=4 tau=inf"]
                print(f"  a set step (W=4) costs {step:.2f}x a causal step (the faster causal "
                      "row)", flush=True)
    if len(args.batches) > 1 and 1 in args.batches:
        for shape in args.shapes:
            def best(b, shape=shape):
                row = results[f"{shape}/batch{b}"]["tokens_per_s_per_sample"]
                return max(row["causal"], row["causal packed"])
            for b in args.batches:
                if b != 1:
                    print(f"{shape}: batch {b} gives {best(b) * b / best(1):.2f}x the tokens/s "
                          "of batch 1 (causal, the faster row of each)")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "results": results}, fh, indent=2)
    differ = [k for k, r in results.items() if not r["greedy_tokens_equal_hf"]]
    rows = {k: r["tokens_per_s_per_sample"] for k, r in results.items()}
    speed = ", ".join(f"{k} causal {row['causal'] / row['hf']:.2f}x hf" for k, row in rows.items())
    print(f"RESULT: greedy tokens equal transformers' in {len(results) - len(differ)} of "
          f"{len(results)} ({args.dtype}); {speed}")
    # in float32 the tokens must be equal; in bf16 random weights' near-tied logits may break
    # the other way under another kernel's rounding, which is reported, not failed
    return 1 if differ and args.dtype == "float32" else 0


if __name__ == "__main__":
    sys.exit(main())
