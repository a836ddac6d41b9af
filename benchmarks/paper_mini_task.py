"""The paper's GSM8K recipe in miniature, on this machine's CPUs: more than one token per step at
near-AR accuracy, and faster than AR?

    python benchmarks/paper_mini_task.py [--out runs/paper-mini-task]      # the study (~1 h)
    python benchmarks/paper_mini_task.py --quick --out /tmp/task-quick      # the pipeline, ~1 min

The paper fine-tunes one pretrained causal LM (Qwen3-1.7B) three ways on GSM8K solutions and
sweeps the confidence threshold tau. Here, at a size a CPU trains:

1. **pretrain** one causal model (``configs/paper-mini/base.yaml``'s 4.2M-parameter shape) on the
   offline corpus (KJV + Shakespeare, BPE-4096: the data of ``paper_mini.py``);
2. **task**: chain sums from reasoning-gym's arithmetic family (``setdiff-tasks chain``: 2 to 5
   one-digit operands, a running-total worked solution ending in ``#### N``); training and test
   problems come from different seeds, and every test problem whose question is in the training
   set is dropped (held out);
3. **fine-tune** the pretrained weights three ways with one budget (steps, batch, LR schedule,
   seed): the causal LM (AR), SetDLM (staggered order, D = 4, S <= 8) and BD3LM (block 4); the
   prompt is context, the loss is on the solution (``setdiff-prep --mode padded``);
4. **evaluate** on the held-out problems through the library's decoders: greedy, stopped only
   once the answer ``#### N`` is complete (``setdiff_dist.eval.tasks.GSM_STOP``) or at
   end-of-text; accuracy = the number after ``####`` equals the answer. AR: cached decoding.
   SetDLM: W = D = 4; BD3LM: block 4 (blocks on the training grid); both over tau in
   {inf, 0.99, 0.95, 0.9, 0.8, 0.7, 0.6}. Batch 1: the mean of per-sample tokens/s after a
   warm-up sample (the paper's measure) and tokens per step; batch 8: generated tokens / wall
   seconds of whole batches (prompts of different lengths in one batch; a batch runs until
   its last problem stops).

Every setting is fixed before the run (nothing is tuned on the test problems). Outputs in
``--out``: ``results.json``, ``report.md`` (tables, each claim's verdict computed from the
numbers), ``pareto.png`` (accuracy vs tokens/s) and ``steps.png`` (tokens/step vs tau).
Finished stages are reused on a rerun (``--redo`` starts over).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import paper_mini as pm  # noqa: E402  (the open-text study: data, training, helpers)

TAUS = pm.TAUS
TEST_SEED = 1_000_000
SEEDS = {"corpus split": "every 20th document held out", "training": 20261130,
         "task train problems": 1, "task test problems": TEST_SEED, "decoding": "greedy"}
COLORS = {"ar": "#444444", "setdlm-d4": "tab:orange", "bd3lm-4": "tab:green"}
MODELS = [pm.Model("ar", "causal.yaml", "AR (causal LM)", "causal"),
          pm.Model("setdlm-d4", "setdlm-d4.yaml", "SetDLM D=4 (S<=8)", "set", 4),
          pm.Model("bd3lm-4", "bd3lm-4.yaml", "BD3LM (block 4)", "block", 4)]


@dataclass
class TaskBudget:
    corpus: pm.Budget
    pretrain_steps: int = 600
    finetune_steps: int = 1200
    train_problems: int = 40000
    test_problems: int = 200
    seq_len: int = 64
    finetune: list = field(default_factory=lambda: [
        "optimizer.lr=5.0e-4", "optimizer.warmup_steps=50", "optimizer.min_lr=5.0e-5",
        "train.log_interval=50"])
    batch: int = 8


FULL = TaskBudget(corpus=pm.FULL)
QUICK = TaskBudget(corpus=pm.QUICK, pretrain_steps=4, finetune_steps=4, train_problems=200,
                   test_problems=8, finetune=["train.log_interval=1"], batch=4)


def log(msg: str) -> None:
    print(f"[paper-mini-task {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# -- data ------------------------------------------------------------------------------------------

def prepare_data(out: str, budget: TaskBudget) -> dict:
    """One BPE tokenizer trained on the corpus and the training problems (as a pretrained LM's
    tokenizer covers digits and operators: " 8", " +" are tokens), corpus shards (L = 128, every
    20th document held out) for pretraining, and chain-sum problems: training shards (padded,
    the prompt as context) and held-out test problems."""
    from data_prep.prep import prepare
    from data_prep.tasks import chain
    from setdiff_dist.data.tokenizers import train_bpe

    d = os.path.join(out, "data")
    done = os.path.join(d, "data.json")
    if os.path.exists(done):
        return json.load(open(done))
    os.makedirs(d, exist_ok=True)
    t0 = time.perf_counter()
    docs, corpus = pm.write_corpus(d, budget.corpus)
    train = chain(budget.train_problems, seed=1)
    seen = {r["prompt"] for r in train}
    # reasoning-gym seeds item i with seed + i: the test seed lies far beyond the training items
    candidates = chain(budget.test_problems * 20, seed=TEST_SEED)
    test = [r for r in candidates if r["prompt"] not in seen][:budget.test_problems]
    if len(test) < budget.test_problems:
        raise SystemExit(f"only {len(test)} held-out test problems: raise the candidates")
    paths = {}
    for name, rows in (("train", train), ("test", test)):
        paths[name] = os.path.join(d, f"task-{name}.jsonl")
        with open(paths[name], "w") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in rows)
    tok = train_bpe([doc["text"] for doc in docs] + [r["prompt"] + r["completion"]
                                                     for r in train], budget.corpus.vocab)
    tok.save(d)
    spec = os.path.join(d, "tokenizer.json")
    corpus_manifest = prepare([corpus], spec, 128, os.path.join(d, "corpus-shards"),
                              valid_every=20, workers=2, overwrite=True, progress=False)
    manifest = prepare([paths["train"]], spec, budget.seq_len, os.path.join(d, "task-shards"),
                       mode="padded", text_field="completion", prompt_field="prompt",
                       valid_every=50, workers=2, overwrite=True, progress=False)
    lengths = [len(tok.encode(r["completion"])) + 1 for r in train]  # + end-of-text
    info = {"corpus_shards": os.path.join(d, "corpus-shards"),
            "task_shards": os.path.join(d, "task-shards"), "test": paths["test"],
            "documents": len(docs),
            "corpus_train_tokens": corpus_manifest["splits"]["train"]["tokens"],
            "train_problems": len(train), "test_problems": len(test),
            "test_candidates": len(candidates),
            "task_train_sequences": manifest["splits"]["train"]["samples"],
            "solution_tokens_max": max(lengths),
            "solution_tokens_mean": sum(lengths) / len(lengths),
            "example": train[0],
            "example_tokens": [tok.decode([i]) for i in tok.encode(train[0]["prompt"]
                                                                   + train[0]["completion"])],
            "seconds": time.perf_counter() - t0}
    pm._save(done, info)
    return info


# -- training --------------------------------------------------------------------------------------

def pretrain(out: str, data: dict, budget: TaskBudget) -> dict:
    m = pm.Model("pretrain", "causal.yaml", "pretrained causal LM", "causal")
    return pm.train(out, m, {"shards": data["corpus_shards"]}, budget.corpus,
                    (f"train.steps={budget.pretrain_steps}",))


def finetune(out: str, m: pm.Model, task: dict, budget: TaskBudget) -> dict:
    ft = pm.Model(f"ft-{m.name}", m.config, m.label, m.decoder, m.window)
    extra = (f"checkpoint.init_from={os.path.join(out, 'runs', 'pretrain')}",
             f"data.seq_len={budget.seq_len}", f"train.steps={budget.finetune_steps}",
             *budget.finetune)
    return pm.train(out, ft, {"shards": task["task_shards"]}, budget.corpus, extra)


# -- evaluation ------------------------------------------------------------------------------------

def _generate(dec, m: pm.Model, prompts, n, tau, stop):
    from setdiff_dist.inference.decoder import Sampling

    greedy = Sampling(greedy=True)
    if m.decoder == "block":
        return dec.blocks(prompts, n, block_size=m.window, threshold=tau, sampling=greedy,
                          stop=stop)
    return dec.generate(prompts, n, window=m.window, threshold=tau, sampling=greedy, stop=stop)


def sweep_command(out: str, m: pm.Model, task: dict, budget: TaskBudget) -> list[str]:
    """The ``setdiff-eval`` command whose tau sweep is this study's batch-1 numbers (the same
    function, :func:`setdiff_dist.eval.tasks.gsm`, on the same problems and settings)."""
    taus = [math.inf] if m.decoder == "causal" else TAUS
    return ["setdiff-eval", "--checkpoint", os.path.join(out, "runs", f"ft-{m.name}"),
            "--task", "gsm", "--data", task["test"], "--limit", str(task["test_problems"]),
            "--max-new-tokens", str(task["solution_tokens_max"] + 8), "--window", str(m.window),
            "--context", str(2 * budget.seq_len),
            "--thresholds", ",".join("inf" if t == math.inf else f"{t:g}" for t in taus)]


def evaluate(out: str, m: pm.Model, task: dict, budget: TaskBudget) -> dict:
    """Batch 1: ``setdiff-eval --task gsm --thresholds`` (:func:`sweep_command`), in this
    process: greedy, stopped only once the answer is complete, a warm-up problem per tau, the
    mean of per-problem tokens/s. Batch 8: whole batches of problems of different lengths.
    Decoding runs at 2L, the pretrained length (the fine-tunes train at L)."""
    from setdiff_dist.api import load
    from setdiff_dist.eval.tasks import _answer, gsm, gsm_stop
    from setdiff_dist.inference.decoder import Sampling

    path = os.path.join(out, "runs", f"ft-{m.name}.eval.json")
    if os.path.exists(path):
        return json.load(open(path))
    t0 = time.perf_counter()
    loaded = load(os.path.join(out, "runs", f"ft-{m.name}"))
    tok, dec = loaded.tokenizer, loaded.decoder
    dec.context = 2 * budget.seq_len  # (setdiff-eval --context)
    stop = gsm_stop(tok)
    problems = [json.loads(x) for x in open(task["test"])]
    prompts = [tok.encode(p["prompt"]) for p in problems]
    answers = [p["answer"] for p in problems]
    n_new = task["solution_tokens_max"] + 8

    def score(results):
        return [int(_answer(r.text) == a) for r, a in zip(results, answers)]

    rows = []
    for tau in ([math.inf] if m.decoder == "causal" else TAUS):
        b1 = gsm(dec, tok, task["test"], len(problems), n_new, m.window, tau,
                 Sampling(greedy=True), warmup=1)
        row = {"tau": tau, **{k: b1[k] for k in ("accuracy", "tokens_per_s",
                                                  "tokens_per_step", "tokens")},
               "examples": [{k: e[k] for k in ("prompt", "output", "answer")}
                            for e in b1["examples"][:2]]}
        B = budget.batch
        _generate(dec, m, prompts[:B], n_new, tau, stop)  # warm-up
        b8, secs = [], 0.0
        for i in range(0, len(prompts), B):
            t = time.perf_counter()
            b8 += _generate(dec, m, prompts[i:i + B], n_new, tau, stop)
            secs += time.perf_counter() - t
        row.update(batch_accuracy=sum(score(b8)) / len(b8),
                   batch_tokens_per_s=sum(len(r.tokens) for r in b8) / secs)
        rows.append(row)
        log(f"{m.name}: tau={tau:g}: accuracy {row['accuracy']:.3f}, "
            f"{row['tokens_per_step']:.2f} tok/step, {row['tokens_per_s']:.0f} tok/s (b1), "
            f"{row['batch_tokens_per_s']:.0f} tok/s (b{budget.batch})")
    res = {"sweep": rows, "problems": len(problems), "max_new_tokens": n_new,
           "command": " ".join(sweep_command(out, m, task, budget)),
           "seconds": time.perf_counter() - t0}
    pm._save(path, res)
    return res


def breakdown(out: str, task: dict, budget: TaskBudget) -> dict:
    """Where the models fail: accuracy by operand count and the first wrong solution line, for
    AR, SetDLM (tau = inf and 0.9) and BD3LM (tau = inf). Greedy decoding is deterministic, so
    these are the study's outputs (the totals equal its accuracies); batch 8."""
    from setdiff_dist.eval.tasks import _answer, gsm_stop
    from setdiff_dist.inference.weights import build_inference_model

    problems = [json.loads(x) for x in open(task["test"])]
    res = {}
    for m, tau in ((MODELS[0], math.inf), (MODELS[1], math.inf), (MODELS[1], 0.9),
                   (MODELS[2], math.inf)):
        model, _, tok = build_inference_model(os.path.join(out, "runs", f"ft-{m.name}"))
        dec = pm._decoders(model, tok, m, context=2 * budget.seq_len)
        stop = gsm_stop(tok)
        prompts = [tok.encode(p["prompt"]) for p in problems]
        outs = []
        for i in range(0, len(prompts), budget.batch):
            outs += _generate(dec, m, prompts[i:i + budget.batch],
                              task["solution_tokens_max"] + 8, tau, stop)
        by, first = {}, {}
        for p, r in zip(problems, outs):
            ref, got = p["completion"].split("\n"), r.text.split("\n")
            ok = _answer(r.text) == p["answer"]
            n = str(len(ref))  # operands (one line per operation, and the answer line)
            by.setdefault(n, [0, 0])[0] += ok
            by[n][1] += 1
            if not ok:
                k = next((j for j, (a, b) in enumerate(zip(ref, got)) if a != b), len(ref) - 1)
                key = "answer line" if k >= len(ref) - 1 else f"operation {k + 1}"
                first[key] = first.get(key, 0) + 1
        res[f"{m.name} tau={tau:g}"] = {"correct_by_operands": by, "first_wrong_line": first}
        log(f"breakdown {m.name} tau={tau:g}: {by} {first}")
    pm._save(os.path.join(out, "breakdown.json"), res)
    return res


# -- verdicts, plots, report -----------------------------------------------------------------------

def frontier(points: list[tuple[float, float]], x: float) -> float:
    """The Pareto frontier of (tokens/s, accuracy) points at speed ``x``: the best accuracy of
    any setting at least that fast."""
    return max((a for s, a in points if s >= x), default=-math.inf)


def claims(ev: dict) -> list[dict]:
    out = []

    def add(claim, held, measured):
        out.append({"claim": claim, "held": None if held is None else bool(held),
                    "measured": measured})

    sd, bd, ar = ev["setdlm-d4"]["sweep"], ev["bd3lm-4"]["sweep"], ev["ar"]["sweep"][0]
    at = {r["tau"]: r for r in sd}
    s9, sinf = at[0.9], at[math.inf]
    drop = 100 * (sinf["accuracy"] - s9["accuracy"])  # points below tau = inf
    add("SetDLM at tau = 0.9: at least 1.5 tokens/step, accuracy at most 3 points below its "
        "own tau = inf",
        s9["tokens_per_step"] >= 1.5 and drop <= 3.0,
        f"{s9['tokens_per_step']:.2f} tokens/step; accuracy {100 * s9['accuracy']:.1f}% vs "
        f"{100 * sinf['accuracy']:.1f}% at tau = inf ({drop:.1f} points "
        f"{'below' if drop >= 0 else 'above'} it)")
    ratio = s9["tokens_per_s"] / ar["tokens_per_s"]
    add("SetDLM's batch-1 tokens/s at tau = 0.9 is at least 1.3x AR's cached decoding",
        ratio >= 1.3, f"{s9['tokens_per_s']:.0f} vs {ar['tokens_per_s']:.0f} tokens/s "
        f"({ratio:.2f}x)")
    ps = [(r["tokens_per_s"], r["accuracy"]) for r in sd]
    pb = [(r["tokens_per_s"], r["accuracy"]) for r in bd]
    lo, hi = max(min(s for s, _ in ps), min(s for s, _ in pb)), \
        min(max(s for s, _ in ps), max(s for s, _ in pb))
    xs = sorted({s for s, _ in ps + pb if lo <= s <= hi})
    gaps = [(x, frontier(ps, x) - frontier(pb, x)) for x in xs]
    add("SetDLM's accuracy-speed frontier is above BD3LM's at every tokens/s where both have "
        "points", bool(gaps) and all(g > 0 for _, g in gaps) if gaps else None,
        (f"at the {len(gaps)} speeds of either curve in {lo:.0f}-{hi:.0f} tokens/s, SetDLM's "
         f"frontier minus BD3LM's is {100 * min(g for _, g in gaps):+.1f} to "
         f"{100 * max(g for _, g in gaps):+.1f} points") if gaps
        else "the two frontiers do not overlap in tokens/s")
    best = max(r["accuracy"] for r in sd + bd)
    add("AR is the most accurate (the paper: 80.2% vs 66.4% SetDLM, 63.5% BD3LM)",
        ar["accuracy"] >= best,
        f"AR {100 * ar['accuracy']:.1f}%, SetDLM at tau = inf {100 * sinf['accuracy']:.1f}%, "
        f"BD3LM at tau = inf {100 * bd[0]['accuracy']:.1f}%, best diffusion setting "
        f"{100 * best:.1f}%")
    return out


def plots(out: str, ev: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = {m.name: m.label for m in MODELS}
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for n, e in ev.items():
        sw = e["sweep"]
        xs, ys = [r["tokens_per_s"] for r in sw], [100 * r["accuracy"] for r in sw]
        ax.plot(xs, ys, "o-" if len(sw) > 1 else "s", label=labels[n], ms=5, color=COLORS[n])
        for r, x, y in zip(sw, xs, ys):
            if len(sw) > 1:
                ax.annotate("inf" if r["tau"] == math.inf else f"{r['tau']:g}", (x, y),
                            fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("tokens/s, batch 1 (mean of per-sample rates)")
    ax.set_ylabel("accuracy on held-out problems (%)")
    ax.set_title("chain sums: accuracy vs speed as tau falls (labels: tau)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "pareto.png"), dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ticks = ["inf" if t == math.inf else f"{t:g}" for t in TAUS]
    for n, e in ev.items():
        if len(e["sweep"]) > 1:
            ax.plot(ticks, [r["tokens_per_step"] for r in e["sweep"]], "o-", label=labels[n],
                    color=COLORS[n])
    ax.axhline(1.0, color="gray", ls=":", label="AR (1 token per step)")
    ax.set_xlabel("confidence threshold tau")
    ax.set_ylabel("tokens per step")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "steps.png"), dpi=120)
    plt.close(fig)


def report(out: str, results: dict) -> str:
    ev, tr, task = results["eval"], results["train"], results["task"]
    labels = {m.name: m.label for m in MODELS}
    labels["pretrain"] = "pretrain (causal, corpus)"
    lines = ["# Chain sums (the GSM8K recipe in miniature): results", "",
             f"Machine: {results['machine']}. Mode: {results['mode']}.", "",
             "## Claims", "", "| claim | held? | measured |", "| --- | --- | --- |"]
    for c in results["claims"]:
        verdict = "not tested" if c["held"] is None else ("yes" if c["held"] else "NO")
        lines.append(f"| {c['claim']} | {verdict} | {c['measured']} |")
    lines += ["", f"## Accuracy and speed ({task['test_problems']} held-out problems)", "",
              "| model | tau | accuracy % | tokens/step | tokens/s (b1) | tokens/s "
              f"(b{results['budget']['batch']}) | accuracy % (b{results['budget']['batch']}) |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    for n, e in ev.items():
        for r in e["sweep"]:
            lines.append(
                f"| {labels[n]} | {r['tau']:g} | {100 * r['accuracy']:.1f} | "
                f"{r['tokens_per_step']:.2f} | {r['tokens_per_s']:.0f} | "
                f"{r['batch_tokens_per_s']:.0f} | {100 * r['batch_accuracy']:.1f} |")
    lines += ["", "The batch-1 columns are these commands' tau sweeps (accuracy and tokens/step "
              "exactly; tokens/s as timed then):", ""]
    lines += [f"- {labels[n]}: `{e['command']}`" for n, e in ev.items() if "command" in e]
    lines += ["", "## Training", "", "| run | steps | final train loss | tokens/s | minutes |",
              "| --- | --- | --- | --- | --- |"]
    for n, t in tr.items():
        lines.append(f"| {labels.get(n.removeprefix('ft-'), n)}"
                     f"{' (fine-tune)' if n.startswith('ft-') else ''} | {t['steps']} | "
                     f"{t['final_train_loss']:.3f} | {t['tokens_per_s']:.0f} | "
                     f"{t['seconds'] / 60:.1f} |")
    ex = task["example"]
    lines += ["", "## Data, seeds and time", "",
              f"- task: {task['train_problems']} training problems, {task['test_problems']} "
              f"held-out test problems (of {task['test_candidates']} candidates, those whose "
              f"question is not in the training set); solutions up to "
              f"{task['solution_tokens_max']} tokens (mean {task['solution_tokens_mean']:.1f}).",
              f"- example: `{json.dumps(ex['prompt'] + ex['completion'])}`",
              f"- seeds: {json.dumps(SEEDS)}",
              "- time (s): " + ", ".join(f"{k} {v:.0f}" for k, v in results["timings"].items()),
              "", "![accuracy vs speed](pareto.png)", "", "![tokens per step](steps.png)", ""]
    text = "\n".join(lines)
    with open(os.path.join(out, "report.md"), "w") as fh:
        fh.write(text)
    return text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--breakdown", action="store_true",
                    help="also: accuracy by operand count and the first wrong line")
    args, out = pm.study_dir(ap, argv, "paper-mini-task")
    budget = QUICK if args.quick else FULL
    start, timings = time.perf_counter(), {}
    log(f"{'quick' if args.quick else 'full'} study into {out}")
    task = prepare_data(out, budget)
    timings["data"] = task["seconds"]
    log(f"task: {task['train_problems']} training, {task['test_problems']} test problems; "
        f"solutions up to {task['solution_tokens_max']} tokens")
    trained = {"pretrain": pretrain(out, task, budget)}
    for m in MODELS:
        trained[f"ft-{m.name}"] = finetune(out, m, task, budget)
    for n, t in trained.items():
        timings[f"train {n}"] = t["seconds"]
        log(f"{n}: trained in {t['seconds']:.0f} s")

    from setdiff_dist.parallel import destroy_model_parallel, initialize_model_parallel

    initialize_model_parallel(seed=0)
    evaluated = {}
    for m in MODELS:
        evaluated[m.name] = evaluate(out, m, task, budget)
        timings[f"eval {m.name}"] = evaluated[m.name]["seconds"]
    if args.breakdown:
        breakdown(out, task, budget)
    destroy_model_parallel()
    results = {"mode": "quick" if args.quick else "full", "machine": pm.machine(),
               "budget": asdict(budget), "task": task, "train": trained, "eval": evaluated,
               "timings": timings, "seeds": SEEDS}
    results["claims"] = claims(evaluated)
    results["seconds"] = time.perf_counter() - start
    pm._save(os.path.join(out, "results.json"), results)
    plots(out, evaluated)
    text = report(out, results)
    print(text[:text.index("## Training")])
    log(f"done in {results['seconds'] / 60:.1f} min: {out}/report.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
