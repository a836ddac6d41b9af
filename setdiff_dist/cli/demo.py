"""``setdiff-demo``: the set-diffusion core end to end on a CPU, in about a minute.

1. Samples the orders of every schedule for the config's sequence length, prints their
   statistics and draws ``orders.png`` (reveal ranks and the set-causal mask of each).
   Everything goes to ``<run_dir>/demo/``: a training run's own files are never touched.
2. Trains the pure-torch reference transformer with the config's order schedule on the shards
   of ``data.train_shards`` (setdiff-prep's output; scripts/main.sh prepares them from the offline
   corpus): setdiff-train's objective (:mod:`setdiff_dist.objective`, the NELBO on the ``[clean
   ; noisy]`` forward), with progress, ETA and ``metrics.jsonl``.
3. Reports the held-out NELBO perplexity bound over fixed, seeded orders, and checks the AR
   identity of docs/method.md §4 on the trained weights.

setdiff-train runs the same objective on the megatron-core model with DeepSpeed; the config file
is the same one it reads.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from setdiff_dist.cli import HelpFormatter, Once, command
from setdiff_dist.config import ConfigError, load_config
from setdiff_dist.errors import EXIT_FAILED

# torch and the rest are imported where they are used: --help answers without them

def describe_orders(cfg, out_png: str | None) -> None:
    import torch

    from setdiff_dist.diffusion import sample_orders
    from setdiff_dist.diffusion.kinds import order_kinds, order_of

    L = cfg.data.seq_len
    print(f"== order schedules at L={L} ==")
    samples = {}
    for kind in order_kinds():  # (every set-diffusion order, with this config's settings)
        order = order_of(kind)
        if order.causal_lm:
            continue
        problems = order.problems(cfg)
        if problems:
            print(f"  {kind:<15} skipped: {problems[0]}")
            continue
        sched = order.schedule(cfg.order, L)
        o = sample_orders(sched, L, range(64), seed=cfg.train.seed)
        ranks = torch.argsort(o.order, dim=1).double()       # reveal rank of each position
        displacement = (ranks - torch.arange(L)).abs().mean().item()
        n_sets = (o.set_ids.max(dim=1).values + 1).double().mean().item()
        print(f"  {kind:<15} {sched!r:<52} sets/sample {n_sets:6.1f}   "
              f"mean |reveal rank - position| {displacement:6.2f}")
        samples[kind] = o
    if out_png:
        _plot_orders(samples, L, out_png)
        print(f"  figure: {out_png}")


def _plot_orders(samples, L, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import torch

    from setdiff_dist.diffusion import set_causal_mask

    fig, axes = plt.subplots(2, len(samples), figsize=(4 * len(samples), 8))
    for col, (kind, o) in enumerate(samples.items()):
        ranks = torch.argsort(o.order, dim=1)[:16].numpy()
        ax = axes[0, col]
        for r in ranks:
            ax.plot(range(L), r, lw=0.8, alpha=0.6)
        ax.set(title=f"{kind}: reveal rank", xlabel="position", ylabel="reveal rank")
        ax = axes[1, col]
        ax.imshow(set_causal_mask(o.set_ids[:1])[0].numpy(), cmap="Greys", interpolation="nearest")
        ax.axhline(L - 0.5, color="tab:red", lw=0.8)
        ax.axvline(L - 0.5, color="tab:red", lw=0.8)
        ax.set(title="mask [clean ; noisy] (black = attends)", xlabel="key", ylabel="query")
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)


def eval_bound(model, shards, objective, batches: int, batch_size: int) -> float:
    """NELBO PPL bound over the first samples of ``shards`` with fixed, seeded orders (the
    same numbers on every run)."""
    from setdiff_dist.data.loader import TokenLoader
    from setdiff_dist.diffusion import perplexity_bound

    loader = TokenLoader(shards, global_batch=batch_size, micro_batch=batch_size,
                         shuffle=False, num_workers=0)
    n = min(batches, max(1, len(shards) // batch_size))
    total, tokens = objective.evaluate(model, (b for _, (b,) in zip(range(n), loader)), "cpu")
    return perplexity_bound(total, tokens)


def ar_identity_gap(model, x) -> float:
    """max |vectorized - sequential| log-likelihood under the autoregressive order."""
    import torch

    from setdiff_dist.diffusion import (
        make_schedule,
        sample_orders,
        set_causal_mask,
        token_nll,
        two_copy_inputs,
    )
    from setdiff_dist.model.reference import sequential_ar_nll

    B, L = x.shape
    o = sample_orders(make_schedule("autoregressive", L), L, range(B), 0)
    with torch.no_grad():
        tok, pos = two_copy_inputs(x, o, model.mask_id)
        vec = token_nll(model(tok, pos, set_causal_mask(o.set_ids))[:, L:], x)
        return (sequential_ar_nll(model, x) - vec.double()).abs().max().item()


def train(cfg, steps: int) -> dict:
    import torch

    from setdiff_dist.data.blend import Blend
    from setdiff_dist.data.loader import TokenLoader
    from setdiff_dist.data.tokenizers import load_shipped_tokenizer
    from setdiff_dist.model.reference import AsTrainingModel, ReferenceTransformer

    L, m = cfg.data.seq_len, cfg.model
    from setdiff_dist.diffusion import perplexity_bound
    from setdiff_dist.diffusion.kinds import order_of

    if order_of(cfg.order).causal_lm:
        raise ConfigError(["order.kind=causal: setdiff-demo trains set-diffusion orders; the "
                           "causal baseline is setdiff-train's"])
    train_set = Blend.open(cfg.data.train_shards, "train", seq_len=L)
    valid_set = Blend.open(cfg.data.valid_shards or cfg.data.train_shards, "valid", seq_len=L)
    tok = load_shipped_tokenizer(train_set.directory, train_set.manifest["tokenizer"])
    if tok.vocab_size > m.vocab_size:
        raise ConfigError([f"the shards' tokenizer has {tok.vocab_size} tokens but "
                           f"model.vocab_size={m.vocab_size}; set "
                           f"model.vocab_size={tok.vocab_size}"])
    # the objective of setdiff-train, on the reference model (dense masks: sdpa's form)
    from setdiff_dist.objective import Objective

    cfg.model.attention_backend = "sdpa"
    objective = Objective(cfg, seed=cfg.train.seed)
    schedule = objective.schedule
    torch.manual_seed(cfg.train.seed)
    model = ReferenceTransformer(m.vocab_size, m.hidden_size, m.num_layers, m.num_attention_heads,
                                 m.ffn_hidden_size, m.rotary_base, m.norm_epsilon, m.init_std)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.optimizer.lr,
                            betas=tuple(cfg.optimizer.betas), eps=cfg.optimizer.eps,
                            weight_decay=cfg.optimizer.adamw_weight_decay)
    trained = AsTrainingModel(model)  # (called as the objective calls the training model)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"== training the reference transformer ({n_params / 1e3:.0f}k params) with "
          f"{schedule!r} on {train_set.tokens:,} tokens ({len(train_set):,} sequences, "
          f"tokenizer {tok.spec}, vocab {tok.vocab_size}) ==")
    os.makedirs(cfg.run_dir, exist_ok=True)
    loader = TokenLoader(train_set, global_batch=cfg.data.global_batch_size,
                         micro_batch=cfg.data.micro_batch_size, seed=cfg.train.seed,
                         shuffle=cfg.data.shuffle, num_workers=cfg.data.num_workers)
    start, seen = time.perf_counter(), 0
    from setdiff_dist.train.schedule import lr_multiplier  # (the trainer's, clamped)

    schedule = lr_multiplier(cfg.optimizer, steps)
    from setdiff_dist.checkpoint.format import METRICS

    with open(os.path.join(cfg.run_dir, METRICS), "w") as metrics:
        for step, micro_batches in zip(range(steps), loader):
            for group in opt.param_groups:
                group["lr"] = cfg.optimizer.lr * schedule(step)
            opt.zero_grad(set_to_none=True)
            terms = [objective.step(trained, b) for b in micro_batches]
            bounds = [fn(out) for out, fn in terms]
            loss = sum(s for s, _ in bounds) / sum(n for _, n in bounds)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(),
                                                       cfg.optimizer.grad_clip or float("inf"))
            opt.step()
            seen += cfg.data.global_batch_size
            if (step + 1) % cfg.train.log_interval == 0 or step + 1 == steps:
                el = time.perf_counter() - start
                tps = seen * L / el
                rec = {"step": step + 1, "loss": loss.item(), "lr": opt.param_groups[0]["lr"],
                       "grad_norm": grad_norm.item(), "tokens_per_s": tps, "samples_seen": seen}
                metrics.write(json.dumps(rec) + "\n")
                eta = el / (step + 1) * (steps - step - 1)
                print(f"  step {step + 1:>5}/{steps}  loss {rec['loss']:.3f}  "
                      f"ppl<= {perplexity_bound(rec['loss']):8.2f}  lr {rec['lr']:.2e}  "
                      f"{tps:8.0f} tok/s  eta {eta:5.1f}s", flush=True)
    model.eval()
    ev = dict(batches=cfg.train.eval_batches, batch_size=cfg.data.micro_batch_size)
    bound = Objective(cfg, seed=cfg.order.eval_seed, stream=1, evaluation=True)
    result = {"schedule": repr(schedule), "steps": steps,
              "train_ppl_bound": eval_bound(trained, train_set, bound, **ev),
              "valid_ppl_bound": eval_bound(trained, valid_set, bound, **ev),
              "uniform_ppl": float(tok.vocab_size),
              "ar_identity_max_gap": ar_identity_gap(
                  model, torch.from_numpy(valid_set.sets[0][0][0][None].astype("int64")))}
    print(f"== held-out NELBO bound (fixed orders, seed {cfg.order.eval_seed}): "
          f"PPL <= {result['valid_ppl_bound']:.2f} per token "
          f"(train {result['train_ppl_bound']:.2f}, "
          f"uniform {tok.vocab_size}) ==")
    print(f"== AR identity on the trained weights: max |vectorized - sequential| log p = "
          f"{result['ar_identity_max_gap']:.2e} ==")
    with open(os.path.join(cfg.run_dir, "demo_result.json"), "w") as fh:
        json.dump(result, fh, indent=2)
    return result


@command("setdiff-demo")
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="setdiff-demo", description=__doc__,
                                 formatter_class=HelpFormatter)
    ap.add_argument("--config", action=Once, default="configs/tiny-cpu.yaml",
                    help="YAML config (its order schedule, model and data)")
    ap.add_argument("overrides", nargs="*", help="section.key=value")
    args = ap.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    # its own directory: the demo never writes into a training run's files
    cfg.run_dir = os.path.join(cfg.run_dir, "demo")
    describe_orders(cfg, os.path.join(cfg.run_dir, "orders.png"))
    result = train(cfg, cfg.train.steps)
    if result["ar_identity_max_gap"] > 1e-4:
        print("AR identity violated", file=sys.stderr)
        return EXIT_FAILED
    return 0


if __name__ == "__main__":
    sys.exit(main())
