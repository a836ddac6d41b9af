"""A miniature reproduction of the set-diffusion paper's claims, on this machine's CPUs.

    python benchmarks/paper_mini.py [--out runs/paper-mini]          # the study (~1.7 h, 2 cores)
    python benchmarks/paper_mini.py --quick --out /tmp/paper-quick    # the same pipeline, minutes

Every model has the shape of ``configs/paper-mini/base.yaml`` and is trained by the real
``setdiff-train`` (2 ranks, gloo) on the same shards, seed, steps and LR schedule; only the
objective differs: the causal LM (AR), SetDLM (staggered, D = 4, S <= 8), BD3LM (block 4), MDLM,
and SetDLM D = 8. Then, with one evaluation code path for all of them:

- **likelihood**: the validation NELBO bound over fixed seeded orders (exact for AR);
- **infilling**: held-out KJV windows of 5 clauses (sentence-sized; from chapters that are not
  in the training split) with the middle 1 or 3 masked, the oracle length given; greedy
  decoding; ROUGE-1/2/L F1 and tokens/s.
  SetDLM and MDLM see both contexts; BD3LM and AR only the left one (as those models must);
- **speed and quality**: continuations of validation prompts, nucleus sampling (top-p 0.9,
  the same seeds for every model) with tau in {inf, .99, .95, .9, .8, .7, .6}, window W = D for
  SetDLM and block 4 for BD3LM; tokens per step, batch-1 tokens/s, the generative perplexity of
  the samples under the AR model, and distinct-2/3; AR's cached decoding as the reference.

Outputs in ``--out``: ``results.json``, ``report.md`` (tables and each claim's verdict),
``ppl.png``, ``pareto.png``, ``infill.png``, and per-model logs. Stages already done are
skipped on a rerun (``--redo`` forces them), so an interrupted study continues.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

TAUS = [math.inf, 0.99, 0.95, 0.9, 0.8, 0.7, 0.6]
PARALLEL_STEPS = 1.2  # "more than one token per step": at least this many at the lowest tau
SEEDS = {"corpus split": "every 20th document held out", "training": 20261130,
         "evaluation orders": "order.eval_seed (20260707)", "infill windows": 0,
         "sampling": "prompt index i -> seed i"}


@dataclass
class Model:
    name: str
    config: str        # under configs/paper-mini/
    label: str
    decoder: str       # how it decodes: causal, set, block, mdlm
    window: int = 1    # W for set decoding, the block size for block decoding


MODELS = [Model("ar", "causal.yaml", "AR (causal LM)", "causal"),
          Model("setdlm-d4", "setdlm-d4.yaml", "SetDLM D=4 (S<=8)", "set", 4),
          Model("bd3lm-4", "bd3lm-4.yaml", "BD3LM (block 4)", "block", 4),
          Model("mdlm", "mdlm.yaml", "MDLM", "mdlm"),
          Model("setdlm-d8", "setdlm-d8.yaml", "SetDLM D=8 (S<=16)", "set", 8)]


@dataclass
class Budget:
    corpus_docs: int | None          # documents per source (None: all)
    vocab: int
    train: list = field(default_factory=list)    # extra overrides of every training run
    ppl_batches: int = 64
    ppl_batch_size: int = 8
    infill_windows: int = 100
    sweep_prompts: int = 24
    prompt_tokens: int = 16
    new_tokens: int = 64


FULL = Budget(corpus_docs=None, vocab=4096)
QUICK = Budget(corpus_docs=60, vocab=1024,
               train=["train.steps=4", "model.num_layers=1", "model.hidden_size=32",
                      "model.num_attention_heads=2", "model.ffn_hidden_size=64",
                      "data.global_batch_size=4", "data.micro_batch_size=2",
                      "optimizer.warmup_steps=1", "train.log_interval=1", "train.eval_batches=1"],
               ppl_batches=2, ppl_batch_size=4, infill_windows=3, sweep_prompts=2,
               prompt_tokens=8, new_tokens=8)


def log(msg: str) -> None:
    print(f"[paper-mini {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _save(path: str, obj) -> None:
    with open(path + ".tmp", "w") as fh:
        json.dump(obj, fh, indent=1, default=lambda x: None)
    os.replace(path + ".tmp", path)


# -- data ------------------------------------------------------------------------------------------

def write_corpus(d: str, budget: Budget) -> tuple[list[dict], str]:
    """The offline corpus (KJV chapters, then Shakespeare) as ``d/corpus.jsonl``."""
    from data_prep.corpus import kjv, shakespeare

    docs = []
    for reader in (kjv, shakespeare):
        part = [doc for doc in reader() if doc["text"].strip()]
        docs += part[:budget.corpus_docs] if budget.corpus_docs else part
    corpus = os.path.join(d, "corpus.jsonl")
    with open(corpus, "w", encoding="utf-8") as fh:
        for doc in docs:
            fh.write(json.dumps(doc, ensure_ascii=False) + "\n")
    return docs, corpus


def prepare_data(out: str, budget: Budget) -> dict:
    """The corpus with every 20th document held out, BPE shards (L = 128) and held-out infilling
    windows that fit the context."""
    from data_prep.prep import prepare
    from data_prep.tasks import infill
    from setdiff_dist.data.tokenizers import load_tokenizer
    from setdiff_dist.eval.tasks import infill_window

    d = os.path.join(out, "data")
    done = os.path.join(d, "data.json")
    if os.path.exists(done):
        return json.load(open(done))
    os.makedirs(d, exist_ok=True)
    t0 = time.perf_counter()
    docs, corpus = write_corpus(d, budget)
    shards = os.path.join(d, "shards")
    # setdiff-prep sends document i to the validation split when i % 20 == 19
    manifest = prepare([corpus], f"bpe:{budget.vocab}", 128, shards, valid_every=20, workers=2,
                       overwrite=True, progress=False)
    assert manifest["documents"] == len(docs), "the held-out documents would be misidentified"
    held_out = {doc["source"] for i, doc in enumerate(docs) if i % 20 == 19}
    tok = load_tokenizer(os.path.join(shards, "tokenizer.json"))
    windows, kept = infill(10 ** 9, seed=0, chapters=held_out, unit="clause"), []
    for w in windows:
        if sum(len(ids) for ids in infill_window(tok, w)) <= 128:
            kept.append(w)
        if len(kept) == budget.infill_windows:
            break
    if not kept:
        raise SystemExit(f"none of the {len(windows)} held-out infilling windows fits L = 128")
    with open(os.path.join(d, "infill.jsonl"), "w", encoding="utf-8") as fh:
        for w in kept:
            fh.write(json.dumps(w, ensure_ascii=False) + "\n")
    info = {"shards": shards, "infill": os.path.join(d, "infill.jsonl"),
            "documents": len(docs), "held_out_documents": len(held_out),
            "train_tokens": manifest["splits"]["train"]["tokens"],
            "valid_tokens": manifest["splits"]["valid"]["tokens"],
            "infill_windows": len(kept), "infill_candidates": len(windows),
            "seconds": time.perf_counter() - t0}
    _save(done, info)
    return info


# -- training --------------------------------------------------------------------------------------

def train(out: str, m: Model, data: dict, budget: Budget, extra: tuple = ()) -> dict:
    """Train ``m`` with ``setdiff-train`` (2 ranks) on ``data['shards']``; ``extra``: more
    overrides, after the budget's. A completed run is reused."""
    run_dir = os.path.join(out, "runs", m.name)
    status = os.path.join(run_dir, "exit_status.json")
    if os.path.exists(status) and json.load(open(status))["outcome"] == "completed":
        return json.load(open(os.path.join(out, "runs", f"{m.name}.train.json")))
    cmd = [sys.executable, "-m", "setdiff_dist.cli.train", "--nproc-per-node", "2", "--config",
           os.path.join(ROOT, "configs", "paper-mini", m.config), f"run_dir={run_dir}",
           f"data.train_shards={data['shards']}", f"data.valid_shards={data['shards']}",
           f"model.vocab_size={budget.vocab}", "train.tensorboard=true", *budget.train, *extra]
    os.makedirs(run_dir, exist_ok=True)
    t0 = time.perf_counter()
    with open(os.path.join(out, "runs", f"{m.name}.log"), "w") as logf:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=logf, text=True, cwd=ROOT)
        for line in proc.stdout:
            logf.write(line)
            if line.startswith("step"):
                log(f"{m.name}: {line.strip()}")
        code = proc.wait()
    if code != 0:
        raise SystemExit(f"training {m.name} failed (exit {code}); see "
                         f"{os.path.join(out, 'runs', m.name + '.log')}")
    rows = [json.loads(x) for x in open(os.path.join(run_dir, "metrics.jsonl"))]
    losses = [r for r in rows if "loss" in r]
    info = {"seconds": time.perf_counter() - t0, "steps": losses[-1]["step"],
            "final_train_loss": losses[-1]["loss"],
            "tokens_per_s": sum(r.get("tokens_per_s", 0) for r in losses[1:]) / max(
                len(losses) - 1, 1),
            "curve": [(r["step"], r["loss"]) for r in losses]}
    _save(os.path.join(out, "runs", f"{m.name}.train.json"), info)
    return info


# -- evaluation ------------------------------------------------------------------------------------

class Scorer:
    """Generative perplexity: ``-log p`` of continuations under the AR model."""

    def __init__(self, model):
        self.model = model

    def nll(self, prompt: list[int], continuation: list[int]) -> tuple[float, int]:
        import torch

        ids = torch.tensor([prompt + continuation])
        pos = torch.arange(ids.shape[1])[None]
        with torch.no_grad():
            logits = self.model(ids, pos, None)[:, 0].float()  # [s, V]
        logp = torch.log_softmax(logits, dim=-1)
        targets = ids[0, len(prompt):]
        picked = logp[len(prompt) - 1:-1].gather(1, targets[:, None])
        return float(-picked.sum()), len(continuation)


def distinct(samples: list[list[int]], n: int) -> float:
    grams = Counter(tuple(s[i:i + n]) for s in samples for i in range(len(s) - n + 1))
    return len(grams) / max(sum(grams.values()), 1)


def _decoders(model, tok, m: Model, context: int = 128):
    from setdiff_dist.inference.decoder import BlockDecoder, CausalDecoder, MDLMDecoder, SetDecoder

    if m.decoder == "causal":
        return CausalDecoder(model, tok, context=context)
    if m.decoder == "block":
        return BlockDecoder(model, tok, context=context, block_size=m.window)
    if m.decoder == "mdlm":
        return MDLMDecoder(model, tok, context=context)
    return SetDecoder(model, tok, context=context)


def _decode(dec, m: Model, prompt, n, tau, sampling, right=None):
    if m.decoder == "causal":
        return dec.generate([prompt], n, window=1, sampling=sampling)[0]
    if m.decoder == "block":
        return dec.block(prompt, n, block_size=m.window, threshold=tau, sampling=sampling)
    if m.decoder == "mdlm":
        return dec.mdlm(prompt, n, threshold=tau, sampling=sampling, right=right)
    if right is not None:
        return dec.infill([prompt], [right], [n], window=min(m.window, n), threshold=tau,
                          sampling=sampling)[0]
    return dec.generate([prompt], n, window=m.window, threshold=tau, sampling=sampling)[0]


def evaluate(out: str, m: Model, data: dict, budget: Budget, scorer: Scorer) -> dict:
    import numpy as np

    from setdiff_dist.eval.tasks import infill_window, perplexity, rouge
    from setdiff_dist.inference.decoder import Sampling
    from setdiff_dist.inference.weights import build_inference_model

    path = os.path.join(out, "runs", f"{m.name}.eval.json")
    if os.path.exists(path):
        return json.load(open(path))
    t0 = time.perf_counter()
    model, cfg, tok = build_inference_model(os.path.join(out, "runs", m.name))
    res = {"ppl": perplexity(model, cfg, data["shards"], budget.ppl_batches,
                             budget.ppl_batch_size)}
    log(f"{m.name}: PPL {'=' if res['ppl']['exact'] else '<='} {res['ppl']['ppl_bound']:.2f}")
    dec = _decoders(model, tok, m)
    greedy = Sampling(greedy=True)
    _decode(dec, m, tok.encode("In the beginning"), 4, math.inf, greedy)  # warm-up

    # infilling: oracle length, greedy; AR and BD3LM cannot use the right context
    rows = []
    for w in (json.loads(x) for x in open(data["infill"])):
        left, middle, right = infill_window(tok, w)
        r = _decode(dec, m, left, len(middle), math.inf, greedy,
                    right=right if m.decoder in ("set", "mdlm") else None)
        rows.append({**rouge(r.text, w["middle"]), "n_middle": w["n_middle"],
                     "tokens": len(r.tokens), "seconds": r.seconds, "text": r.text})
    res["infill"] = {k: float(np.mean([r[k] for r in rows])) for k in ("rouge1", "rouge2",
                                                                       "rougeL")}
    res["infill"].update(
        count=len(rows), tokens_per_s=sum(r["tokens"] for r in rows) / sum(
            r["seconds"] for r in rows),
        rougeL_by_middle={str(k): float(np.mean([r["rougeL"] for r in rows
                                                 if r["n_middle"] == k] or [float("nan")]))
                          for k in (1, 3)},
        uses_right_context=m.decoder in ("set", "mdlm"), examples=rows[:3])
    log(f"{m.name}: infill ROUGE-L {res['infill']['rougeL']:.3f}")

    # speed and quality: continuations of validation prompts
    prompts = [ids[:budget.prompt_tokens] for ids in sweep_sequences(data, budget)]
    taus = [math.inf] if m.decoder in ("causal", "mdlm") else TAUS
    res["sweep"] = []
    for tau in taus:
        samples, rates, per_step, per_pass, nll, count = [], [], [], [], 0.0, 0
        for i, p in enumerate(prompts):
            r = _decode(dec, m, p, budget.new_tokens, tau, Sampling(top_p=0.9, seed=i))
            samples.append(r.tokens)
            rates.append(len(r.tokens) / r.seconds)
            per_step.append(r.tokens_per_step)
            per_pass.append(r.tokens_per_step)
            s, c = scorer.nll(p, r.tokens)
            nll, count = nll + s, count + c
        res["sweep"].append({
            "tau": tau, "tokens_per_step": float(np.mean(per_step)),
            "tokens_per_forward": float(np.mean(per_pass)),
            "tokens_per_s": float(np.median(rates)), "gen_ppl": math.exp(nll / max(count, 1)),
            "distinct2": distinct(samples, 2), "distinct3": distinct(samples, 3),
            "example": tok.decode(samples[0])})
        row = res["sweep"][-1]
        log(f"{m.name}: tau={tau}: {row['tokens_per_step']:.2f} tok/step, "
            f"{row['tokens_per_s']:.0f} tok/s, gen PPL {row['gen_ppl']:.1f}")
    res["seconds"] = time.perf_counter() - t0
    _save(path, res)
    return res


def sweep_sequences(data: dict, budget: Budget) -> list[list[int]]:
    """``budget.sweep_prompts`` validation sequences spread evenly over the split: their first
    ``prompt_tokens`` are the sweep's prompts, the rest the real continuations."""
    from setdiff_dist.data.shards import ShardSet

    valid = ShardSet(data["shards"], "valid", seq_len=128)
    stride = max(len(valid) // budget.sweep_prompts, 1)
    return [[int(t) for t in valid[i * stride][0]] for i in range(budget.sweep_prompts)]


def reference_quality(data: dict, budget: Budget, scorer: Scorer) -> dict:
    """The same measures on the real continuations of the same prompts (what text scores)."""
    nll = count = 0
    samples = []
    for ids in sweep_sequences(data, budget):
        p = ids[:budget.prompt_tokens]
        cont = ids[budget.prompt_tokens:budget.prompt_tokens + budget.new_tokens]
        s, c = scorer.nll(p, cont)
        nll, count = nll + s, count + c
        samples.append(cont)
    return {"gen_ppl": math.exp(nll / max(count, 1)), "distinct2": distinct(samples, 2),
            "distinct3": distinct(samples, 3)}


# -- report ----------------------------------------------------------------------------------------

def _fmt(x, digits=2):
    return "-" if x is None else (f"{x:.{digits}f}" if isinstance(x, float) else str(x))



def _label_taus(ax, sweep, xs, ys, spans, apart: float = 0.06):
    """Label a sweep's points with their tau, leaving out a label that would sit within
    ``apart`` of the axes' span of one already written (close points' labels overlapped)."""
    placed = []
    for r, x, y in zip(sweep, xs, ys):
        if any(abs(x - px) < apart * spans[0] and abs(y - py) < apart * spans[1]
               for px, py in placed):
            continue
        placed.append((x, y))
        ax.annotate("inf" if r["tau"] == math.inf else f"{r['tau']:g}", (x, y), fontsize=7,
                    xytext=(3, 4), textcoords="offset points")

def claims(results: dict) -> list[dict]:
    ev = results["eval"]
    ppl = {k: v["ppl"]["ppl_bound"] for k, v in ev.items()}
    rl = {k: v["infill"]["rougeL"] for k, v in ev.items()}
    out = []

    def add(claim, held, measured):
        out.append({"claim": claim, "held": None if held is None else bool(held),
                    "measured": measured})

    if {"setdlm-d4", "bd3lm-4", "mdlm", "ar"} <= ppl.keys():
        add("SetDLM's bound is tighter than BD3LM's and MDLM's",
            ppl["setdlm-d4"] < ppl["bd3lm-4"] and ppl["setdlm-d4"] < ppl["mdlm"],
            f"SetDLM <= {ppl['setdlm-d4']:.2f}, BD3LM <= {ppl['bd3lm-4']:.2f}, "
            f"MDLM <= {ppl['mdlm']:.2f}")
        add("AR is the limit: its exact perplexity is below every diffusion bound",
            all(ppl["ar"] <= v for k, v in ppl.items() if k != "ar"),
            f"AR = {ppl['ar']:.2f}, best diffusion bound "
            f"{min(v for k, v in ppl.items() if k != 'ar'):.2f}")
    if {"setdlm-d4", "bd3lm-4"} <= rl.keys():
        add("SetDLM infills better than BD3LM (which cannot see the right context)",
            rl["setdlm-d4"] > rl["bd3lm-4"],
            f"ROUGE-L SetDLM {rl['setdlm-d4']:.3f} vs BD3LM {rl['bd3lm-4']:.3f}")
    if "setdlm-d4" in ev:
        sw = ev["setdlm-d4"]["sweep"]
        steps = [r["tokens_per_step"] for r in sw]
        ppls = [r["gen_ppl"] for r in sw]
        faster = steps[-1] >= PARALLEL_STEPS
        add(f"Lowering tau gives more than one token per step (at least {PARALLEL_STEPS} at "
            "tau = 0.6), rising smoothly",
            faster and all(b >= a - 0.02 for a, b in zip(steps, steps[1:])),
            "tokens/step " + " -> ".join(f"{s:.2f}" for s in steps))
        # the price in quality is only measurable where there was a speed-up to pay for
        add("... at a smooth cost in quality (generative PPL rises gradually as tau falls)",
            (ppls[-1] >= ppls[0]) if faster else None,
            "gen PPL " + " -> ".join(f"{p:.1f}" for p in ppls)
            + ("" if faster else " (no speed-up, so nothing was traded)"))
    return out


def plots(out: str, results: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ev = results["eval"]
    names = [m.name for m in MODELS if m.name in ev]
    labels = {m.name: m.label for m in MODELS}

    fig, ax = plt.subplots(figsize=(6, 3.5))
    vals = [ev[n]["ppl"]["ppl_bound"] for n in names]
    bars = ax.bar([labels[n] for n in names], vals, color=["#555"] + ["#4c72b0"] * (len(names) - 1))
    for b, v in zip(bars, vals):
        ax.text(b.get_x() + b.get_width() / 2, v, f"{v:.1f}", ha="center", va="bottom")
    ax.set_ylabel("validation perplexity (AR exact, others: bound)")
    ax.tick_params(axis="x", rotation=20)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "ppl.png"), dpi=120)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for ax, key in zip(axes, ("tokens_per_step", "tokens_per_s")):
        every = [(r[key], r["gen_ppl"]) for n in names for r in ev[n]["sweep"]]
        spans = [max(v) - min(v) or 1.0 for v in zip(*every)]
        for n in names:
            sw = ev[n]["sweep"]
            xs, ys = [r[key] for r in sw], [r["gen_ppl"] for r in sw]
            ax.plot(xs, ys, "o-" if len(sw) > 1 else "s", label=labels[n])
            if len(sw) > 1:
                _label_taus(ax, sw, xs, ys, spans)
    ref = results.get("reference")
    for ax, xl in zip(axes, ("tokens per denoising step", "tokens/s (batch 1)")):
        if ref:
            ax.axhline(ref["gen_ppl"], color="gray", ls=":", label="real text")
        ax.set_xlabel(xl)
        ax.set_ylabel("generative PPL (AR judge)")
    axes[0].legend(fontsize=8)
    fig.suptitle("speed vs quality as the confidence threshold tau falls (labels: tau; "
                 "lower PPL is better)")
    fig.tight_layout()
    fig.savefig(os.path.join(out, "pareto.png"), dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 3.5))
    width = 0.8 / 3
    for j, key in enumerate(("rouge1", "rouge2", "rougeL")):
        ax.bar([i + j * width for i in range(len(names))],
               [ev[n]["infill"][key] for n in names], width, label=key)
    ax.set_xticks([i + width for i in range(len(names))])
    ax.set_xticklabels([labels[n] for n in names], rotation=20)
    ax.set_ylabel("F1 against the held-out middle")
    ax.legend()
    ax.set_title("infilling (oracle length; AR and BD3LM see only the left context)")
    fig.tight_layout()
    fig.savefig(os.path.join(out, "infill.png"), dpi=120)
    plt.close(fig)


def report(out: str, results: dict) -> str:
    ev, tr = results["eval"], results["train"]
    labels = {m.name: m.label for m in MODELS}
    lines = ["# Miniature reproduction: results", "",
             f"Machine: {results['machine']}. Mode: {results['mode']}. "
             f"Time of all stages {sum(results['timings'].values()) / 60:.1f} min (this "
             f"invocation {results['seconds'] / 60:.1f} min; finished stages are reused).", "",
             "## Headline", "",
             "| model | PPL (bound) | infill ROUGE-L | tokens/step at tau=0.9 "
             "| gen PPL at tau=0.9 |",
             "| --- | --- | --- | --- | --- |"]
    for n, e in ev.items():
        row = next((r for r in e["sweep"] if r["tau"] == 0.9), e["sweep"][0])
        sign = "=" if e["ppl"]["exact"] else "<="
        lines.append(f"| {labels[n]} | {sign} {e['ppl']['ppl_bound']:.2f} | "
                     f"{e['infill']['rougeL']:.3f} | {row['tokens_per_step']:.2f} | "
                     f"{row['gen_ppl']:.1f} |")
    lines += ["", "## Claims", "", "| claim | held? | measured |", "| --- | --- | --- |"]
    for c in results["claims"]:
        verdict = "not tested" if c["held"] is None else ("yes" if c["held"] else "NO")
        lines.append(f"| {c['claim']} | {verdict} | {c['measured']} |")
    lines += ["", "## Training", "", "| model | steps | final train loss | tokens/s | minutes |",
              "| --- | --- | --- | --- | --- |"]
    for n, t in tr.items():
        lines.append(f"| {labels[n]} | {t['steps']} | {t['final_train_loss']:.3f} | "
                     f"{t['tokens_per_s']:.0f} | {t['seconds'] / 60:.1f} |")
    lines += ["", "## Infilling", "",
              "| model | sees right context | ROUGE-1 | ROUGE-2 | ROUGE-L | ROUGE-L (1 / 3 "
              "clauses) | tokens/s |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for n, e in ev.items():
        i = e["infill"]
        lines.append(f"| {labels[n]} | {'yes' if i['uses_right_context'] else 'no'} | "
                     f"{i['rouge1']:.3f} | {i['rouge2']:.3f} | {i['rougeL']:.3f} | "
                     f"{i['rougeL_by_middle']['1']:.3f} / {i['rougeL_by_middle']['3']:.3f} | "
                     f"{i['tokens_per_s']:.0f} |")
    lines += ["", "## Speed and quality", "",
              "| model | tau | tokens/step | tokens/forward | tokens/s | gen PPL | distinct-2 | "
              "distinct-3 |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for n, e in ev.items():
        for r in e["sweep"]:
            lines.append(f"| {labels[n]} | {r['tau']:g} | {r['tokens_per_step']:.2f} | "
                         f"{r['tokens_per_forward']:.2f} | {r['tokens_per_s']:.0f} | "
                         f"{r['gen_ppl']:.1f} | {r['distinct2']:.3f} | {r['distinct3']:.3f} |")
    ref = results.get("reference")
    if ref:
        lines.append(f"| real text | - | - | - | - | {ref['gen_ppl']:.1f} | "
                     f"{ref['distinct2']:.3f} | {ref['distinct3']:.3f} |")
    lines += ["", "## Data, seeds and time", "",
              f"- data: {results['data']['documents']} documents, "
              f"{results['data']['train_tokens']} training and {results['data']['valid_tokens']}"
              f" validation tokens; {results['data']['infill_windows']} held-out infilling "
              f"windows that fit L = 128 (of {results['data']['infill_candidates']}).",
              f"- seeds: {json.dumps(SEEDS)}",
              "- time (s): " + ", ".join(f"{k} {v:.0f}" for k, v in results["timings"].items()),
              "", "![perplexity](ppl.png)", "", "![speed and quality](pareto.png)", "",
              "![infilling](infill.png)", ""]
    text = "\n".join(lines)
    with open(os.path.join(out, "report.md"), "w") as fh:
        fh.write(text)
    return text


def machine() -> str:
    import torch

    cpu = platform.processor() or "cpu"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}, "
            f"torch {torch.__version__}, no GPU")


def study_dir(ap: argparse.ArgumentParser, argv, name: str):
    """Parse a study's command line (``--out``, ``--quick``, ``--redo`` and what ``ap`` has)
    and make its output directory; ``--redo`` empties it first."""
    ap.add_argument("--out", default=os.path.join(ROOT, "runs", name))
    ap.add_argument("--quick", action="store_true", help="a trivial budget, same pipeline")
    ap.add_argument("--redo", action="store_true", help="ignore finished stages")
    args = ap.parse_args(argv)
    out = os.path.abspath(args.out)
    if args.redo and os.path.isdir(out):
        import shutil

        shutil.rmtree(out)
    os.makedirs(os.path.join(out, "runs"), exist_ok=True)
    return args, out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=[m.name for m in MODELS],
                    choices=[m.name for m in MODELS])
    args, out = study_dir(ap, argv, "paper-mini")
    budget = QUICK if args.quick else FULL
    models = [m for m in MODELS if m.name in args.models]
    if "ar" not in args.models:
        raise SystemExit("the AR model is needed: it scores every model's samples")
    start, timings = time.perf_counter(), {}
    log(f"{'quick' if args.quick else 'full'} study into {out}")
    data = prepare_data(out, budget)
    timings["data"] = data["seconds"]
    log(f"data: {data['train_tokens']} training tokens, {data['infill_windows']} infill windows")
    trained = {}
    for m in models:
        trained[m.name] = train(out, m, data, budget)
        timings[f"train {m.name}"] = trained[m.name]["seconds"]
        log(f"{m.name}: trained in {trained[m.name]['seconds']:.0f} s")

    from setdiff_dist.inference.weights import build_inference_model
    from setdiff_dist.parallel import destroy_model_parallel, initialize_model_parallel

    initialize_model_parallel(seed=0)
    scorer = Scorer(build_inference_model(os.path.join(out, "runs", "ar"))[0])
    evaluated = {}
    for m in models:
        evaluated[m.name] = evaluate(out, m, data, budget, scorer)
        timings[f"eval {m.name}"] = evaluated[m.name]["seconds"]
    results = {"mode": "quick" if args.quick else "full", "machine": machine(),
               "budget": asdict(budget), "data": data, "train": trained, "eval": evaluated,
               "reference": reference_quality(data, budget, scorer), "timings": timings,
               "seeds": SEEDS}
    results["claims"] = claims(results)
    results["seconds"] = time.perf_counter() - start
    _save(os.path.join(out, "results.json"), results)
    plots(out, results)
    text = report(out, results)
    destroy_model_parallel()
    print(text[:text.index("## Training")])
    log(f"done in {results['seconds'] / 60:.1f} min: {out}/report.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
