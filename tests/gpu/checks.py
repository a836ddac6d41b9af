"""The GPU machine's checks, one per call, each ending in one ``RESULT:`` line that
tests/gpu/run.sh copies into summary.txt. run.sh runs them in this order, the most valuable
first, since a lease may end before the last:

    python tests/gpu/checks.py step-1.3b          # a 1.3B training step: peak memory against
                                                  # the dry run's plan, and its MFU
    python tests/gpu/checks.py permuted-bf16      # permuted_causal in bf16 at head_dim 128 with
                                                  # GQA against sdpa: values and time
    python tests/gpu/checks.py flex-bf16          # compiled flex in bf16, block and masked
                                                  # orders: values, and dynamo's recompiles
    python tests/gpu/checks.py recompute-dropout  # recompute=full with dropout: megatron's CUDA
                                                  # RNG tracker replays the masks
    python tests/gpu/checks.py zero23             # one CUDA run each of ZeRO-2 (overlapped)
                                                  # and ZeRO-3 against ZeRO-1

``--device cpu`` (the CPU rehearsal) runs each on tiny shapes, so that an API they use that the
machine's torch lacks fails there first; what needs a GPU (memory, MFU, compiled kernels, times)
is left out of its verdict and said so. Exit codes: 0 ok, 1 a check failed (or crashed),
3 not run here (a run.sh budget skip, never a failure).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [os.path.dirname(HERE), os.path.join(ROOT, "benchmarks"), ROOT]


class CheckFailed(AssertionError):
    pass


def expect(ok: bool, why: str) -> None:
    if not ok:
        raise CheckFailed(why)


# ---------------------------------------------------------------------------------------------
# step-1.3b


def step_13b(device: str) -> str:
    """setdiff-train on configs/models/1.3b.yaml (staggered order, bf16, ZeRO-1, the backend
    training picks) for a few steps on one GPU; its peak ``max_memory_allocated`` against the
    dry run's plan of the same config, and its MFU. The check fails if the plan underestimates
    the peak by more than 10%: a layout the dry run calls fitting could then run out of
    memory."""
    from train_throughput import run_overrides, step_rows, synthetic_shards

    from setdiff_dist.config import load_config
    from setdiff_dist.train.plan import plan

    gpu = device == "cuda"
    model = "1.3b" if gpu else "tiny"
    seq_len, micro, steps, warmup = (1024, 8, 6, 3) if gpu else (64, 2, 2, 0)
    with tempfile.TemporaryDirectory() as tmp:
        shards = synthetic_shards(tmp, seq_len)
        run_dir = os.path.join(tmp, "run")
        overrides = run_overrides(run_dir, shards, seq_len=seq_len, micro_batch=micro, nproc=1,
                                  steps=steps, precision="bf16", kind="staggered",
                                  backend="auto")
        if not gpu:
            overrides.append("parallel.backend=gloo")
        config = os.path.join(ROOT, "configs", "models", f"{model}.yaml")
        planned = plan(load_config(config, overrides), 1).stages[0]
        try:
            rows = step_rows([sys.executable, "-m", "setdiff_dist.cli.train",
                              "--nproc-per-node", "1", "--config", config, *overrides], run_dir)
        except SystemExit as exc:  # (a failed run: its exit code and error)
            raise CheckFailed(str(exc)) from None
    rows = [r for r in rows if "tokens_per_s" in r][warmup:]
    expect(bool(rows), "no logged step")
    peak = max(r["memory_gb"] for r in rows) * 2**30
    tps = statistics.median(r["tokens_per_s"] for r in rows)
    plan_gib = planned.total / 2**30
    line = (f"{model} staggered bf16 L={seq_len} micro-batch {micro}: {tps:,.0f} tokens/s")
    if not gpu:  # (RSS is not the device's allocator peak; no peak FLOPs for a CPU)
        return line + f", plan {plan_gib:.2f} GiB (memory and MFU not compared on the CPU)"
    mfu = statistics.median(r["mfu"] for r in rows) if "mfu" in rows[0] else None
    ratio = peak / planned.total
    line += (f", MFU {mfu * 100:.1f}%" if mfu is not None else ", MFU unknown (no peak FLOPs "
             "for this GPU in train/metrics.py)")
    line += f"; peak {peak / 2**30:.1f} GiB vs plan {plan_gib:.1f} GiB ({ratio:.2f}x)"
    line += "; " + _predicted_beside(load_config(config, overrides), tps)
    expect(ratio <= 1.10, line + ": the plan underestimates the peak by more than 10%")
    return line


def _predicted_beside(cfg, tokens_per_s: float) -> str:
    """The scale model's step for this config on this GPU next to the measured one, and the
    GEMM efficiency that would make them agree, written to $OUT/efficiency.json (the file
    ``SETDIFF_EFFICIENCY`` points the planner at)."""
    import json

    import torch

    from setdiff_dist.train.plan import plan
    from setdiff_dist.train.scale import CONSTANTS

    name = torch.cuda.get_device_name().lower()
    hardware = "b200" if "b200" in name else "h200" if "h200" in name else "h100"
    predicted = plan(cfg, 1, hardware).predict(cfg, hardware)
    measured = cfg.data.global_batch_size * cfg.data.seq_len / tokens_per_s
    e0 = CONSTANTS["gemm.efficiency"].value
    gemm = predicted.breakdown["gemm"]
    rest = predicted.step - gemm
    fitted = e0 * gemm / (measured - rest) if measured > rest else None
    out = os.environ.get("OUT", os.path.join(ROOT, "gpu-results"))
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "efficiency.json"), "w") as fh:
        json.dump({"hardware": hardware, "measured_step_s": measured,
                   "predicted_step_s": predicted.step, "breakdown": predicted.breakdown,
                   "constants": {"gemm.efficiency": fitted} if fitted else {}}, fh, indent=1)
    return (f"step {measured * 1e3:,.0f} ms measured vs {predicted.step * 1e3:,.0f} ms "
            f"predicted on {hardware} (MFU {predicted.mfu * 100:.1f}% predicted); GEMM "
            f"efficiency fitted {fitted if fitted is None else round(fitted, 3)} (was {e0})")


# ---------------------------------------------------------------------------------------------
# permuted-bf16, flex-bf16: one model, several backends, the same batch


def _model(device, dtype, backend, dims, seed=3, overrides=()):
    from setdiff_dist.config import load_config
    from setdiff_dist.model.transformer import build_model, transformer_config

    layers, hidden, heads, groups, vocab = dims
    cfg = load_config(None, [f"model.num_layers={layers}", f"model.hidden_size={hidden}",
                             f"model.num_attention_heads={heads}",
                             f"model.num_query_groups={groups}", f"model.vocab_size={vocab}",
                             f"model.attention_backend={backend}", *overrides]).model
    model = build_model(cfg, transformer_config(cfg, compute_dtype=dtype), seed=seed)
    return model.to(device=device, dtype=dtype), cfg


def _nll(model, backend, x, orders):
    """The per-token NLL ``[b, L]`` of the training forward of ``x`` under ``orders``."""
    from setdiff_dist.model.forward import set_diffusion_inputs, set_diffusion_nll

    inp = set_diffusion_inputs(x, orders, model.mask_id, backend)
    return set_diffusion_nll(model(inp.tokens, inp.positions, inp.attention_mask,
                                   inp.logits_from), x, inp)


def _nelbo_pass(model, backend, x, orders, timed=0):
    """NLL [b, L] and {name: grad} of one forward and backward of the NELBO; with ``timed``,
    also the median time of that many more passes (after one more warm-up)."""
    from setdiff_dist.diffusion import nelbo

    def once():
        model.zero_grad(set_to_none=True)
        nll = _nll(model, backend, x, orders)
        nelbo(nll, orders.to(x.device)).per_token.backward()
        return nll.detach().float()

    nll = once()
    grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters()}
    times = []
    if timed:
        once()
        for _ in range(timed):
            sync(x.device)
            t0 = time.perf_counter()
            once()
            sync(x.device)
            times.append(time.perf_counter() - t0)
    return nll, grads, (statistics.median(times) if times else None)


def sync(device):
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def _flat(grads):
    import torch

    return torch.cat([g.flatten() for _, g in sorted(grads.items())])


def _errors(ref, got):
    """(max |NLL error|, 1 - cosine of the gradients) of ``got`` against ``ref``."""
    import torch

    dn = (got[0] - ref[0]).abs().max().item()
    cos = torch.nn.functional.cosine_similarity(_flat(got[1]), _flat(ref[1]), dim=0).item()
    return dn, 1 - cos


def compare_backends(device, backends, kind, dims, L, B, repeats, batches=1, start=0):
    """Each backend in bf16 and sdpa in fp32 (the reference) on the same weights and orders:
    {backend: (nll error, 1 - grad cosine, time)} against the fp32 reference."""
    import torch

    from setdiff_dist.diffusion import make_schedule, sample_orders

    out = {}
    dev = torch.device(device)
    vocab = dims[-1]
    ref_model = _model(dev, torch.float32, "sdpa", dims)[0]
    models = {backend: _model(dev, torch.bfloat16, backend, dims)[0] for backend in backends}
    for batch in range(start, start + batches):
        x = torch.randint(0, vocab, (B, L), generator=torch.Generator().manual_seed(batch)).to(dev)
        orders = sample_orders(make_schedule(kind, L, mean_set_size=4), L, range(B), batch)
        ref = _nelbo_pass(ref_model, "sdpa", x, orders)
        for backend, model in models.items():
            got = _nelbo_pass(model, backend, x, orders, timed=repeats)
            dn, dg = _errors(ref, got)
            prev = out.get(backend, (0.0, 0.0, 0.0))
            out[backend] = (max(prev[0], dn), max(prev[1], dg), got[2])
    return out


def _judge(found, against="sdpa"):
    """bf16 error of each backend against the fp32 reference, next to sdpa's own bf16 error:
    a backend may be at most 2x sdpa's (plus a floor of bf16's rounding), or it is wrong."""
    base_n, base_g, _ = found[against]
    for backend, (dn, dg, _) in found.items():
        expect(dn <= 2 * base_n + 0.02 and dg <= 2 * base_g + 1e-3,
               f"{backend} in bf16 is off the fp32 reference by NLL {dn:.4f} / 1-cos {dg:.2e}, "
               f"sdpa in bf16 by {base_n:.4f} / {base_g:.2e}")


def _fmt(found, gpu):
    parts = []
    for backend, (dn, dg, t) in found.items():
        timing = f", {t * 1e3:.1f} ms" if gpu and t is not None else ""
        parts.append(f"{backend} |dNLL| {dn:.4f} 1-cos {dg:.1e}{timing}")
    return "; ".join(parts)


def permuted_bf16(device: str) -> str:
    """permuted_causal (the staggered order's backend: causal kernels on the reveal order) in
    bf16 at head_dim 128 with GQA (4 query heads per key-value head), against sdpa with the
    dense set-causal mask: both against an fp32 sdpa reference, and timed forward+backward."""

    from helpers import process_group

    from setdiff_dist.parallel import cpu_compat

    gpu = device == "cuda"
    # (layers, hidden, heads, query groups, vocab): head_dim 128 either way
    dims, L, B = ((2, 1024, 8, 2, 8192), 1024, 4) if gpu else ((1, 256, 2, 1, 512), 64, 2)
    with process_group("nccl" if gpu else "gloo"):
        cpu_compat.seed_model_parallel_rng(0)
        found = compare_backends(device, ("sdpa", "permuted_causal"), "staggered", dims, L, B,
                                 repeats=5 if gpu else 0)
    _judge(found)
    line = (f"head_dim {dims[1] // dims[2]}, GQA {dims[2] // dims[3]}:1, L={L}, B={B}, bf16 vs "
            f"fp32 sdpa: {_fmt(found, gpu)}")
    if gpu:
        line += (f"; permuted_causal {found['sdpa'][2] / found['permuted_causal'][2]:.2f}x "
                 "sdpa's speed")
    return line


def flex_bf16(device: str) -> str:
    """Compiled FlexAttention in bf16 for the in-set orders (block and masked), three micro-
    batches each with fresh orders (fresh block masks), against sdpa: values as above, and the
    graphs dynamo compiled after the first micro-batch, which must be none (a recompile per
    batch would cost seconds every step). The CPU runs flex's uncompiled forward only."""
    from helpers import process_group
    from torch._dynamo.utils import counters

    from setdiff_dist.parallel import cpu_compat

    gpu = device == "cuda"
    if not gpu:
        return _flex_forward_cpu()
    dims, L, B = (2, 1024, 8, 2, 8192), 1024, 4
    parts, recompiled = [], 0
    with process_group("nccl"):
        cpu_compat.seed_model_parallel_rng(0)
        for kind in ("block", "masked"):
            first = compare_backends(device, ("sdpa", "flex"), kind, dims, L, B, repeats=0)
            graphs = counters["stats"]["unique_graphs"]
            found = compare_backends(device, ("sdpa", "flex"), kind, dims, L, B, repeats=5,
                                     batches=2, start=1)
            new = counters["stats"]["unique_graphs"] - graphs
            recompiled += new
            for b in found:
                found[b] = tuple(max(u, v) for u, v in zip(first[b][:2], found[b][:2])) + \
                    (found[b][2],)
            _judge(found)
            parts.append(f"{kind}: {_fmt(found, gpu)}, {new} graphs compiled after the first "
                         "micro-batch")
    expect(recompiled == 0, "dynamo compiled again for new orders of the same shape: "
           + "; ".join(parts))
    return f"L={L}, B={B}, bf16 vs fp32 sdpa; " + "; ".join(parts)


def _flex_forward_cpu() -> str:
    import torch
    from helpers import process_group

    from setdiff_dist.diffusion import make_schedule, sample_orders
    from setdiff_dist.parallel import cpu_compat

    dims, L, B = (1, 128, 1, 1, 256), 32, 2
    out = []
    with process_group("gloo"), torch.no_grad():
        cpu_compat.seed_model_parallel_rng(0)
        for kind in ("block", "masked"):
            x = torch.randint(0, 256, (B, L), generator=torch.Generator().manual_seed(0))
            o = sample_orders(make_schedule(kind, L, mean_set_size=4), L, range(B), 0)
            nll = {backend: _nll(_model("cpu", torch.float32, backend, dims)[0], backend, x, o)
                   for backend in ("sdpa", "flex")}
            d = (nll["flex"] - nll["sdpa"]).abs().max().item()
            expect(d < 1e-4, f"{kind}: flex's forward is off sdpa's by {d}")
            out.append(f"{kind} |dNLL| {d:.1e}")
    return ("fp32 forward, uncompiled (the CPU has no compiled flex backward): "
            + ", ".join(out))


# ---------------------------------------------------------------------------------------------
# recompute-dropout


def recompute_dropout(device: str) -> str:
    """train.recompute=full (one and two layers per chunk) and selective with hidden and
    attention dropout: the recomputed forward must replay the dropout masks through megatron's
    (CUDA) RNG tracker, so the loss equals the no-recompute run's and the gradients agree; a
    second seed shows dropout was on."""
    import torch
    from helpers import process_group, tiny_nelbo_step

    from setdiff_dist.parallel import cpu_compat

    gpu = device == "cuda"
    dropout = ["model.hidden_dropout=0.1", "model.attention_dropout=0.1"]
    found = {}
    with process_group("nccl" if gpu else "gloo"):
        for seed, mode, layers in ((7, "none", 1), (7, "full", 1), (7, "full", 2),
                                   (7, "selective", 1), (8, "none", 1)):
            torch.manual_seed(seed)
            cpu_compat.seed_model_parallel_rng(seed)
            nll, grads = tiny_nelbo_step("sdpa", device=device, overrides=dropout,
                                         recompute=mode, recompute_num_layers=layers)
            found[seed, mode, layers] = (nll.float().cpu(),
                                         {n: g.float().cpu() for n, g in grads.items()})
    ref_nll, ref_grads = found.pop((7, "none", 1))
    other = found.pop((8, "none", 1))[0]
    worst = 0.0
    for (_, mode, layers), (nll, grads) in found.items():
        expect(torch.equal(nll, ref_nll), f"recompute={mode}/{layers}: the loss changed "
               f"({(nll - ref_nll).abs().max().item():.2e})")
        for name, g in ref_grads.items():
            err = ((grads[name] - g).abs().max() / g.abs().max().clamp_min(1e-12)).item()
            worst = max(worst, err)
            expect(err < 1e-4, f"recompute={mode}/{layers}: gradient of {name} off by {err:.2e}"
                   " of its largest entry")
    shift = (other - ref_nll).abs().max().item()
    expect(shift > 1e-3, "another seed gave the same loss: dropout was not on")
    return (f"full x1, full x2, selective with dropout 0.1: losses equal, gradients within "
            f"{worst:.1e} (relative), another seed moves the loss by {shift:.3f}")


# ---------------------------------------------------------------------------------------------
# zero23


def zero23(device: str) -> str:
    """One short run each of ZeRO-1 (the reference), DeepSpeed's ZeRO-2 with the gradient
    reduction overlapped with the backward, and ZeRO-3, on one GPU in bf16: every loss finite
    and each curve within 2% of ZeRO-1's (one rank: the same weights, drawn on the CPU whatever
    the engine builds on, sharded three ways)."""
    from helpers import losses, run_train, sonnet_shards

    gpu = device == "cuda"
    curves = {}
    with tempfile.TemporaryDirectory() as tmp:
        shards = sonnet_shards(os.path.join(tmp, "shards"), seq_len=64)
        for name, extra in (("zero1", ["zero.stage=1"]),
                            # (named: at ZeRO-2 the default engine is torch's FSDP2)
                            ("zero2-overlap", ["zero.stage=2", "zero.overlap_comm=true",
                                               "zero.implementation=deepspeed"]),
                            ("zero3", ["zero.stage=3"])):
            run = os.path.join(tmp, name)
            res = run_train(run, shards, "train.precision=bf16", *extra,
                            f"parallel.backend={'nccl' if gpu else 'gloo'}",
                            nproc=1, steps=3, seq_len=64, global_batch=2)
            print(name, res.stdout[-1500:], res.stderr[-3000:], sep="\n")
            expect(res.returncode == 0, f"{name}: setdiff-train exit {res.returncode}: "
                   + (res.stderr.strip().splitlines() or ["no output"])[-1])
            curves[name] = list(losses(run).values())
    ref = curves.pop("zero1")
    expect(len(ref) == 3 and all(math.isfinite(v) for v in ref), f"zero1 losses {ref}")
    for name, c in curves.items():
        expect(len(c) == len(ref) and all(math.isfinite(v) for v in c), f"{name} losses {c}")
        worst = max(abs(a - b) / abs(b) for a, b in zip(c, ref))
        expect(worst <= 0.02, f"{name} is off ZeRO-1 by {worst:.1%}: {c} vs {ref}")
    return ("3 bf16 steps, losses " + " / ".join(f"{v:.3f}" for v in ref) + " (ZeRO-1); "
            + ", ".join(f"{n} within {max(abs(a - b) / abs(b) for a, b in zip(c, ref)):.2%}"
                        for n, c in curves.items()))


CHECKS = {"step-1.3b": step_13b, "permuted-bf16": permuted_bf16, "flex-bf16": flex_bf16,
          "recompute-dropout": recompute_dropout, "zero23": zero23}


def main(argv=None) -> int:
    import torch

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("check", choices=list(CHECKS))
    ap.add_argument("--device", choices=("cuda", "cpu"),
                    default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"RESULT: failed: torch {torch.__version__} sees no CUDA device")
        return 1
    os.chdir(ROOT)  # (the checks' configs are named from the repository root)
    t0 = time.monotonic()
    try:
        line = CHECKS[args.check](args.device)
    except CheckFailed as exc:
        print(f"RESULT: failed after {time.monotonic() - t0:.0f} s: {exc}")
        return 1
    print(f"RESULT: {line} ({time.monotonic() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
