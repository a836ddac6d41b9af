"""setdiff-generate and setdiff-convert on a real checkpoint: a model trained at TP=2 / ZeRO-3
decodes the same greedy text loaded at TP=1, at TP=2 (torchrun), and after export."""

import json
import math
import os
import shutil
import subprocess
import sys

import pytest
from helpers import child_env, losses, run_cli


@pytest.fixture(scope="module")
def run(trained):
    """A session reference run trained at TP=2 under ZeRO-3 (BPE of 300 tokens)."""
    return trained("parallel.tensor=2", "zero.stage=3", tokenizer="bpe:300")


def generate(checkpoint, *extra, tp=1):
    args = ["--checkpoint", str(checkpoint), "--prompt", "Shall I compare thee",
            "--max-new-tokens", "12", "--window", "4", "--threshold", "0.2", "--greedy",
            "--json", "--no-eos-stop", *extra]
    if tp == 1:  # (in this process)
        return run_cli("setdiff_dist.cli.generate", *args)
    from setdiff_dist.parallel import free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(tp),
           "--master-port", str(free_port()), "-m", "setdiff_dist.cli.generate", *args,
           "--tensor-parallel", str(tp)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=child_env())


def test_same_greedy_output_at_any_tp_and_after_export(run, tmp_path):
    one = generate(run, "--trace-png", str(tmp_path / "trace.png"))
    assert one.returncode == 0, one.stderr[-3000:]
    out = json.loads(one.stdout.strip().splitlines()[-1])
    assert len(out["tokens"][0]) == 12 and out["tokens_per_s"] > 0
    # the trace: per step the positions committed, the prompt from 0; every new one once
    first = min(p for step in out["trace"][0] for p in step)  # (the prompt's length)
    assert first > 0 and sorted(p for step in out["trace"][0] for p in step) == \
        list(range(first, first + 12))
    assert len(out["trace"][0]) == out["steps"][0] and (tmp_path / "trace.png").stat().st_size
    two = generate(run, tp=2)
    assert two.returncode == 0, two.stderr[-3000:]
    assert json.loads(two.stdout.strip().splitlines()[-1])["tokens"] == out["tokens"]
    export = tmp_path / "export"
    res = run_cli("setdiff_dist.cli.convert", "--checkpoint", run, "--out", export)
    assert res.returncode == 0, res.stderr[-3000:]
    assert sorted(os.listdir(export)) == ["config.yaml", "export.json", "model.safetensors",
                                          "tokenizer.json"]
    again = generate(export)
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads(again.stdout.strip().splitlines()[-1])["tokens"] == out["tokens"]
    # loaded straight into bf16 (the GPU default), tensor by tensor: it decodes
    half = generate(export, "--dtype", "bfloat16")
    assert half.returncode == 0, half.stderr[-3000:]
    assert len(json.loads(half.stdout.strip().splitlines()[-1])["tokens"][0]) == 12
    # plain-text mode: the text on stdout, the statistics on stderr
    plain = run_cli("setdiff_dist.cli.generate", "--checkpoint", export, "--prompt", "Love",
                    "--max-new-tokens", "5", "--greedy", "--no-eos-stop")
    assert plain.returncode == 0 and "tokens/s" in plain.stderr and "tokens/step" in plain.stderr
    assert "tokens/s" not in plain.stdout
    # a checkpoint decodes as its order trained: the same weights labelled a block model
    # (order.kind=block, B = 4) decode blocks on the training grid, [4k, 4k + 4)
    import yaml

    block = tmp_path / "as-block"
    shutil.copytree(export, block)
    cfg = yaml.safe_load((block / "config.yaml").read_text())
    cfg["order"].update(kind="block", block_size=4)
    (block / "config.yaml").write_text(yaml.safe_dump(cfg))
    res = run_cli("setdiff_dist.cli.generate", "--checkpoint", block, "--prompt",
                  "Shall I compare thee", "--max-new-tokens", "12", "--threshold", "0.2",
                  "--greedy", "--json", "--no-eos-stop")
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["mode"] == "block" and out["window"] == 4 and len(out["tokens"][0]) == 12
    assert all(len({p // 4 for p in step}) == 1 for step in out["trace"][0])
    res = run_cli("setdiff_dist.cli.generate", "--checkpoint", block, "--prompt", "Love",
                  "--window", "2")
    assert res.returncode == 2 and "its own blocks of order.block_size = 4" in res.stderr
    assert "Traceback" not in res.stderr


def test_generation_at_tp1_imports_neither_megatron_nor_deepspeed(run):
    """The decode-time engine is plain torch: setdiff-generate at TP=1 (a checkpoint trained at
    TP=2 under ZeRO-3) never imports megatron-core or DeepSpeed, whose imports were most of its
    start-up."""
    code = ("import runpy, sys\n"
            "sys.argv = ['setdiff-generate'] + sys.argv[1:]\n"
            "try:\n"
            "    runpy.run_module('setdiff_dist.cli.generate', run_name='__main__')\n"
            "except SystemExit as exc:\n"
            "    assert not exc.code, exc.code\n"
            # (setdiff_dist registers its own lazy megatron.core.jit, without megatron)
            "print(sorted({'megatron', 'megatron.core', 'deepspeed', 'transformer_engine',\n"
            "              'apex'} & set(sys.modules)))\n")
    res = subprocess.run([sys.executable, "-c", code, "--checkpoint", str(run), "--prompt",
                          "Shall I", "--max-new-tokens", "2", "--greedy"],
                         capture_output=True, text=True, timeout=300, env=child_env())
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip().splitlines()[-1] == "[]", res.stdout


def test_bad_checkpoints_are_named(run, tmp_path):
    broken = tmp_path / "no-tokenizer"
    shutil.copytree(run / "checkpoints" / "step_0000006", broken)
    (broken / "tokenizer.json").unlink()
    res = generate(broken)
    assert res.returncode == 2 and "has no tokenizer: tokenizer.json" in res.stderr
    res = generate(tmp_path / "nowhere")
    assert res.returncode == 2 and "no such directory" in res.stderr
    long_prompt = generate(run, "--prompt", "x " * 40)
    assert long_prompt.returncode == 2 and "does not fit the model's context" in long_prompt.stderr


def test_truncated_or_incomplete_weight_files_are_named_before_loading(run, tmp_path):
    from safetensors.torch import load_file, save_file

    step = run / "checkpoints" / "step_0000006"
    truncated = tmp_path / "truncated"
    shutil.copytree(step, truncated)
    target = truncated / "weights" / "tp01_pp00.safetensors"
    os.truncate(target, os.path.getsize(target) - 100)
    lacking = tmp_path / "lacking"
    shutil.copytree(step, lacking)
    target = lacking / "weights" / "tp00_pp00.safetensors"
    tensors = load_file(target)
    dropped = sorted(tensors)[-1]
    del tensors[dropped]
    save_file(tensors, target)
    # (without the manifest's file sizes, as before it listed them: the tensor lists decide)
    manifest = json.loads((lacking / "manifest.json").read_text())
    del manifest["files"]
    (lacking / "manifest.json").write_text(json.dumps(manifest))
    for broken, words in ((truncated, ["weights/tp01_pp00.safetensors has",
                                       "(truncated)", "checkpoint", "is damaged"]),
                          (lacking, ["tp00_pp00.safetensors lacks tensor", dropped])):
        for res in (generate(broken),
                    run_cli("setdiff_dist.cli.convert", "--checkpoint", broken, "--out",
                            tmp_path / "x")):
            assert res.returncode == 2, res.stderr[-2000:]
            assert all(w in res.stderr for w in words), res.stderr[-2000:]
            assert "Traceback" not in res.stderr
        assert not (tmp_path / "x").exists()


def test_rouge_by_hand():
    from setdiff_dist.eval.tasks import rouge

    r = rouge("the cat sat on the mat", "the cat is on the mat")
    # unigrams: 5 of 6 overlap; bigrams: "the cat", "on the", "the mat" = 3 of 5; LCS = 5
    assert r["rouge1"] == pytest.approx(5 / 6)
    assert r["rouge2"] == pytest.approx(3 / 5)
    assert r["rougeL"] == pytest.approx(5 / 6)
    assert rouge("", "anything")["rougeL"] == 0.0


def test_summarization_rouge_is_rouge_scores():
    """--task summarize scores with Google's rouge-score without the stemmer, as the paper's
    reference does through evaluate's ROUGE (its default): its README's example pair gives its
    published unstemmed F1, and a multi-sentence pair what the library gives directly, with and
    without the stemmer (--rouge-stemmer); "arrested" / "arrest" count only when stemmed."""
    from rouge_score import rouge_scorer

    from setdiff_dist.eval.tasks import rouge_f1
    from setdiff_dist.eval.tasks import rouge_scorer as ours

    got = rouge_f1(ours(), "The quick brown dog jumps on the log.",
                   "The quick brown fox jumps over the lazy dog")
    assert round(got["rouge1"], 4) == 0.7059 and round(got["rougeL"], 4) == 0.5882
    pred = "Police arrest two men.\nThe market rallied"
    ref = "Two men were arrested.\nMarkets rally"
    for stem in (False, True):
        direct = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeLsum"],
                                          use_stemmer=stem).score(ref, pred)
        mine = rouge_f1(ours(stem=stem), pred, ref)
        for key in ("rouge1", "rouge2", "rougeLsum"):
            assert mine[key] == direct[key].fmeasure, (stem, key)
    assert rouge_f1(ours(), pred, ref)["rouge1"] < rouge_f1(ours(stem=True), pred, ref)["rouge1"]


def test_bleu_is_the_references_sacrebleu_corpus_score():
    """BLEU as the reference's evaluate.load("sacrebleu") scores summaries and infills: corpus
    BLEU over one reference each, 13a tokens, exponential smoothing. "a b c d" against
    "a b c e" by hand: 1- to 3-gram precisions 3/4, 2/3, 1/2, no 4-gram match (smoothed to
    1 / (2 x 1)), no brevity penalty: (0.75 x 0.6667 x 0.5 x 0.5)^(1/4) = 59.46."""
    from setdiff_dist.eval.tasks.rouge_metric import bleu

    assert round(bleu(["a b c d"], ["a b c e"]), 2) == 59.46
    assert round(bleu(["the cat sat on the mat"], ["the cat sat on the mat"]), 6) == 100
    # a corpus score, not a mean of sentence scores (those would give (59.46 + 100) / 2)
    both = bleu(["a b c d", "the cat sat on the mat"], ["a b c e", "the cat sat on the mat"])
    assert round(both, 2) == 83.76


def test_eval_tasks(run, tmp_path):
    infill = tmp_path / "infill.jsonl"
    infill.write_text(json.dumps({"left": "Shall I", "middle": "compare thee", "right": "to a",
                                  "n_middle": 1, "source": "x"}) + "\n")
    gsm = tmp_path / "gsm.jsonl"
    gsm.write_text(json.dumps({"prompt": "Question: 2+2?\nAnswer: ", "completion": "#### 4",
                               "answer": "4"}) + "\n")
    cnn = tmp_path / "cnn_dm.jsonl"  # CNN/DailyMail's schema
    cnn.write_text("".join(json.dumps({"article": a, "highlights": h, "id": str(i)}) + "\n"
                           for i, (a, h) in enumerate([
                               ("Shall I compare thee to a summer's day? " * 40,
                                "A summer's day.\nThou art more lovely."),
                               ("Thou art.",
                                "Thou art.")])))
    out = {}
    for task, extra in (("ppl", []), ("infill", ["--data", str(infill)]),
                        ("gsm", ["--data", str(gsm), "--max-new-tokens", "8"]),
                        ("throughput", ["--max-new-tokens", "8", "--window", "4"]),
                        ("gsm:sweep", ["--data", str(gsm), "--max-new-tokens", "8",
                                       "--thresholds", "0.5,inf"]),
                        ("throughput:tau", ["--max-new-tokens", "8", "--window", "4",
                                            "--threshold", "0.5"]),
                        ("summarize", ["--data", str(cnn), "--max-new-tokens", "8", "--window",
                                       "4"])):
        path = tmp_path / f"{task}.json"
        res = run_cli("setdiff_dist.cli.eval", "--checkpoint", run, "--task",
                      task.split(":")[0], "--out", path, *extra)
        assert res.returncode == 0, res.stderr[-3000:]
        out[task] = json.loads(path.read_text())
    # the tau sweep from one command: a row per tau; its tau = inf row is plain --task gsm
    # (the checkpoint's threshold)
    sweep = out.pop("gsm:sweep")["sweep"]
    assert [r["threshold"] for r in sweep] == [0.5, "inf"]
    assert {k: sweep[1][k] for k in ("accuracy", "tokens_per_step", "count")} == \
        {k: out["gsm"][k] for k in ("accuracy", "tokens_per_step", "count")}
    assert all(r["tokens_per_s"] > 0 and r["tokens_per_step"] >= 1 for r in sweep)
    # summaries: rouge-score's F1 of each, the long article cut to fit the context of 32
    summ = out.pop("summarize")
    assert summ["count"] == 2 and summ["articles_cut"] == 1 and summ["tokens_per_step"] >= 1
    from setdiff_dist.eval.tasks import rouge_f1, rouge_scorer

    for ex in summ["examples"]:
        assert {k: ex[k] for k in ("rouge1", "rouge2", "rougeL", "rougeLsum")} == \
            rouge_f1(rouge_scorer(), ex["summary"].strip(), ex["highlights"])
    assert summ["rouge1"] == sum(ex["rouge1"] for ex in summ["examples"]) / 2
    # --threshold is what --task throughput measures (it used to be ignored)
    assert [(r["window"], r["threshold"]) for r in out.pop("throughput:tau")["settings"]] == \
        [(4, 0.5)]
    for bad, said in ((["--task", "ppl", "--thresholds", "0.5"], "sweeps --task gsm"),
                      (["--task", "throughput", "--thresholds", "0.5,x"], "not a number")):
        res = run_cli("setdiff_dist.cli.eval", "--checkpoint", run, *bad)
        assert res.returncode == 2 and said in res.stderr, res.stderr
    # what 6 steps learned: the bound is below the loss of step 1 (the weights as drawn)
    first_loss = losses(run)[1]
    assert 1 < out["ppl"]["ppl_bound"] < math.exp(first_loss) and out["ppl"]["exact"] is False
    assert out["infill"]["count"] == 1 and 0 <= out["infill"]["rougeL"] <= 1
    assert out["gsm"]["count"] == 1 and out["gsm"]["accuracy"] in (0.0, 1.0)
    rows = out["throughput"]["settings"]
    # valid JSON: no Infinity literal, an infinite threshold is the string "inf"
    assert [(r["window"], r["threshold"]) for r in rows][:2] == [(1, "inf"), (4, "inf")]
    assert "Infinity" not in (tmp_path / "throughput.json").read_text()
    assert all(r["tokens_per_s"] > 0 and r["tokens_per_step"] >= 1 for r in rows)
    # the paper's measure, said in the file: the mean of per-sample rates after warm-up samples
    assert "mean over the prompts" in out["throughput"]["method"]
    assert out["throughput"]["warmup_samples"] == 1
    # results say what they measured: the checkpoint, its step, the decoding settings
    assert all(out[t]["step"] == 6 and out[t]["checkpoint"].endswith("step_0000006")
               for t in out)
    assert out["gsm"]["decode"]["greedy"] is True and out["infill"]["decode"]["window"] == 32
    assert out["infill"]["decode"]["repetition_penalty"] == 1.2
    res = run_cli("setdiff_dist.cli.eval", "--checkpoint", run, "--task", "infill")
    assert res.returncode == 2 and "needs --data" in res.stderr


def test_generative_perplexity_is_the_scorers_own_loss_and_mauve_runs(run, trained, tmp_path):
    """--task genppl: unconditional samples scored by a Hugging Face causal LM (here our
    causal checkpoint exported with --to-hf, standing in for GPT-2 Large): the perplexity is
    transformers' own loss on the same texts; MAUVE is the reference's protocol
    (scripts/eval/robust_mauve_bootstrap.py: seeded subsets of the human texts, each against
    the generations, mauve-text featurizing the texts with the scorer) to the last digit."""
    import mauve
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = tmp_path / "gpt2-scorer"  # (mauve-text featurizes only with a model named gpt2 / bert)
    res = run_cli("setdiff_dist.cli.convert", "--checkpoint",
                  trained("order.kind=causal", tokenizer="bpe:300"), "--to-hf", "--out", hf)
    assert res.returncode == 0, res.stderr[-3000:]
    refs = tmp_path / "refs.txt"
    refs.write_text("\n\n".join(["Shall I compare thee to a summer's day?",
                                  "Thou art more lovely and more temperate.",
                                  "Rough winds do shake the darling buds of May.",
                                  "And summer's lease hath all too short a date."]))
    out = tmp_path / "genppl.json"
    res = run_cli("setdiff_dist.cli.eval", "--checkpoint", run, "--task", "genppl", "--scorer",
                  hf, "--samples", "3", "--max-new-tokens", "12", "--window", "4",
                  "--references", refs, "--mauve-subsets", "2", "--mauve-subset-size", "3",
                  "--out", out)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(out.read_text())
    texts = got["examples"]
    assert len(texts) == 3 and len(set(texts)) > 1  # (sampled, not greedy)
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(hf)
    bos = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
    total, count = 0.0, 0
    with torch.no_grad():
        for text in texts:
            ids = torch.tensor([[bos] + tok.encode(text, add_special_tokens=False)])
            total += model(ids, labels=ids).loss.item() * (ids.shape[1] - 1)
            count += ids.shape[1] - 1
    assert got["scored_tokens"] == count
    assert math.isclose(got["gen_ppl"], math.exp(total / count), rel_tol=1e-6)
    assert got["mauve_references"] == 4 and got["scorer_dtype"] == "float32"
    humans = [p for p in refs.read_text().split("\n\n")]
    rng, theirs = np.random.default_rng(20260701), []
    for k in range(2):
        pick = rng.choice(4, size=3, replace=False)
        theirs.append(mauve.compute_mauve(p_text=[humans[i] for i in pick], q_text=texts,
                                          featurize_model_name=str(hf), device_id=-1,
                                          seed=1234 + k, verbose=False).mauve)
    assert np.allclose(got["mauve_per_subset"], theirs, rtol=1e-9, atol=1e-12), \
        (got["mauve_per_subset"], theirs)
    assert math.isclose(got["mauve"], float(np.mean(theirs)), rel_tol=1e-9)
    assert math.isclose(got["mauve_std"], float(np.std(theirs)), rel_tol=1e-9, abs_tol=1e-12)
    res = run_cli("setdiff_dist.cli.eval", "--checkpoint", run, "--task", "genppl", "--scorer",
                  hf, "--samples", "3", "--references", refs)
    assert res.returncode == 2 and "subsets of 1000" in res.stderr
    res = run_cli("setdiff_dist.cli.eval", "--checkpoint", run, "--task", "genppl")
    assert res.returncode == 2 and "needs --scorer" in res.stderr


def test_the_python_api_from_a_fresh_interpreter(run):
    """``setdiff_dist.load(path).generate(...)`` in a new interpreter: the tokens of
    setdiff-generate with the same settings; log-likelihoods and scores as setdiff-eval's
    scorer gives them; and at TP=1 neither megatron-core nor DeepSpeed is imported."""
    code = ("import json, sys, time\n"
            "t0 = time.perf_counter()\n"
            "import setdiff_dist\n"
            "model = setdiff_dist.load(sys.argv[1])\n"
            "first = model.generate('Shall I compare thee', max_new_tokens=1, greedy=True)\n"
            "t1 = time.perf_counter()\n"
            "out = model.generate(['Shall I compare thee'], max_new_tokens=12, window=4,\n"
            "                     threshold=0.2, greedy=True, eos_stop=False)\n"
            "one = model.generate('Shall I compare thee', max_new_tokens=12, window=4,\n"
            "                     threshold=0.2, greedy=True, eos_stop=False)\n"
            "ll = model.loglikelihood([('Shall I compare thee', ' to a'), ('', 'Love')])\n"
            "empty = [model.generate(p, max_new_tokens=6, greedy=True, eos_stop=False).tokens\n"
            "         for p in ('', None)]\n"
            "sampled = [model.generate('Shall I', max_new_tokens=8, greedy=False,\n"
            "                          eos_stop=False) for _ in range(4)]\n"
            "again = model.generate('Shall I', max_new_tokens=8, greedy=False, eos_stop=False,\n"
            "                       seed=sampled[1].seed)\n"
            "cut = model.generate('Shall I compare thee', max_new_tokens=12, window=4,\n"
            "    threshold=0.2, greedy=True, eos_stop=False, stop=[one.text[:1]])\n"
            "k1 = model.generate('Shall I', max_new_tokens=8, window=1, greedy=False, top_k=1,\n"
            "                    eos_stop=False)\n"
            "g1 = model.generate('Shall I', max_new_tokens=8, window=1, greedy=True,\n"
            "                    eos_stop=False)\n"
            "three = model.generate('Shall I', max_new_tokens=8, greedy=False, eos_stop=False,\n"
            "                       seed=sampled[0].seed, n=3)\n"
            "streams = [model.generate('Shall I compare thee', max_new_tokens=12, window=4,\n"
            "    threshold=0.2, greedy=True, eos_stop=False, stop=stop, stream=True)\n"
            "    for stop in ([], [one.text[:1]])]\n"
            "streamed = [[list(s), s.generation.tokens, s.generation.finish_reason]\n"
            "            for s in streams]\n"
            "drawn = model.generate('Shall I', max_new_tokens=8, greedy=False, eos_stop=False,\n"
            "                       seed=sampled[1].seed, stream=True)\n"
            "drawn = [''.join(drawn), drawn.generation.tokens, drawn.seed]\n"
            "kw = dict(max_new_tokens=8, window=1, greedy=True, eos_stop=False, logprobs=2)\n"
            "lp = model.generate('Shall I', **kw)\n"
            "slp = model.generate('Shall I', stream=True, **kw)\n"
            "list(slp)\n"
            "scored = [lp.tokens, lp.logprobs, slp.generation.logprobs]\n"
            "print(json.dumps({'tokens': [g.tokens for g in out], 'one': one.tokens,\n"
            "    'text': one.text, 'steps': one.steps, 'trace': one.trace, 'll': ll,\n"
            "    'score': model.score(['Shall I compare thee', 'Love']),\n"
            "    'score1': model.score('Love'), 'exact': model.exact, 'repr': repr(model),\n"
            "    'empty': empty, 'sampled': [[g.tokens, g.seed] for g in sampled],\n"
            "    'again': [again.tokens, again.seed],\n"
            "    'finish': [one.finish_reason, cut.finish_reason, cut.text],\n"
            "    'top_k': [k1.tokens, g1.tokens],\n"
            "    'n': [[g.tokens, g.seed] for g in three],\n"
            "    'streamed': streamed, 'drawn': drawn, 'cut': cut.tokens, 'scored': scored,\n"
            "    'first_token_s': t1 - t0, 'modules': sorted({'megatron', 'megatron.core',\n"
            "    'deepspeed', 'transformer_engine', 'apex'} & set(sys.modules))}))\n")
    res = subprocess.run([sys.executable, "-c", code, str(run)], capture_output=True,
                         text=True, timeout=300, env=child_env())
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    print(f"import -> first generated token: {got['first_token_s']:.2f} s")
    assert got["modules"] == []
    cli = generate(run)  # (the same prompt and settings)
    assert cli.returncode == 0, cli.stderr[-3000:]
    want = json.loads(cli.stdout.strip().splitlines()[-1])
    assert got["tokens"] == want["tokens"] and got["one"] == want["tokens"][0]
    assert got["text"] == want["texts"][0] and got["trace"] == want["trace"][0]
    assert got["steps"] == want["steps"][0]
    # an empty prompt is unconditional, as None is (and as setdiff-serve takes it)
    assert got["empty"][0] == got["empty"][1] and len(got["empty"][0]) == 6
    # unseeded sampled calls are four samples (they were seed 0: one text), each with the seed
    # it ran with, which repeats it
    tokens, seeds = zip(*got["sampled"])
    assert len({tuple(t) for t in tokens}) > 1 and len(set(seeds)) == 4
    assert got["again"] == [tokens[1], seeds[1]]
    # finish_reason as OpenAI and transformers say it; top_k=1 samples the argmax
    assert got["finish"][:2] == ["length", "stop"] and len(got["finish"][2]) < len(got["text"])
    assert got["top_k"][0] == got["top_k"][1]
    # n completions: the k-th sampled with seed + k (the first is the seeded call's own)
    assert len(got["n"]) == 3 and got["n"][0] == list(got["sampled"][0])
    assert [s for _, s in got["n"]] == [(seeds[0] + k) % 2 ** 63 for k in range(3)]
    # stream=True: the text committed step by step, in pieces that add up to the text of the
    # same call without it (a stop included), and the same Generation at the end
    (pieces, toks, why), (cut_pieces, cut_toks, cut_why) = got["streamed"]
    assert len(pieces) > 1 and "".join(pieces) == got["text"] and toks == got["one"]
    assert why == "length" and cut_why == "stop" and cut_toks == got["cut"]
    assert "".join(cut_pieces) == got["finish"][2]
    assert got["drawn"][1:] == [tokens[1], seeds[1]]
    # logprobs=2: each generated token's log p and the 2 most likely at its place (the same
    # streamed); greedy one token a step, each token is the scorer's most likely there
    toks, per, streamed_per = got["scored"]
    assert toks == got["top_k"][1] and len(per) == len(toks) and streamed_per == per
    for (own, top), t in zip(per, toks):
        assert len(top) == 2 and top[0][1] >= top[1][1] and own <= 0
        assert top[0][0] == t and top[0][1] == pytest.approx(own, abs=1e-5)
    # scoring: what setdiff-eval's scorer answers (one and the same code), in nats; the
    # process group this sets up (as at TP=1: no megatron) ends with the test, as do the
    # variables it sets: none may stay in this process
    from setdiff_dist.eval.likelihood import Scorer
    from setdiff_dist.inference.weights import build_inference_model
    from setdiff_dist.parallel import destroy_model_parallel

    saved = dict(os.environ)
    try:
        scorer = Scorer(*build_inference_model(str(run)))
        want_ll = scorer.loglikelihood([("Shall I compare thee", " to a"), ("", "Love")])
        want_score = scorer.rolling(["Shall I compare thee", "Love"])
    finally:
        destroy_model_parallel()
        os.environ.clear()
        os.environ.update(saved)
    assert [tuple(x) for x in got["ll"]] == [tuple(x) for x in want_ll]
    assert got["score"] == want_score
    assert got["score1"] == got["score"][1] and all(s < 0 for s in got["score"])
    assert got["exact"] is False and "staggered" in got["repr"]


def test_a_set_diffusion_checkpoint_is_exported_to_hf_only_as_a_causal_lm_on_request(
        run, tmp_path):
    """--to-hf of a staggered checkpoint: exit 2 with the reason, nothing written; with
    --as-causal-lm it writes, says so, and config.json records what the weights are."""
    res = run_cli("setdiff_dist.cli.convert", "--checkpoint", run, "--to-hf", "--out",
                  tmp_path / "hf")
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert "is a set-diffusion model (order.kind=staggered)" in res.stderr
    assert "--as-causal-lm" in res.stderr and not (tmp_path / "hf").exists()
    res = run_cli("setdiff_dist.cli.convert", "--checkpoint", run, "--to-hf", "--as-causal-lm",
                  "--out", tmp_path / "hf")
    assert res.returncode == 0, res.stderr[-2000:]
    assert "exported as a causal LM on request" in res.stderr
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["setdiff_trained_as"].startswith("set diffusion, order.kind=staggered")


def test_an_infill_record_longer_than_the_context_keeps_the_context_nearest_the_middle():
    """setdiff-tasks infill records (five KJV verses) are longer than a tiny model's context:
    the evaluation keeps each side's tokens nearest the middle instead of skipping them, and
    skips only a middle that does not fit alone."""
    from setdiff_dist.eval.tasks import fit_context

    left, right = list(range(100)), list(range(200, 260))
    assert fit_context(left[:10], 5, right[:10], 32) == (left[:10], right[:10])
    got_left, got_right = fit_context(left, 20, right, 64)
    assert len(got_left) + 20 + len(got_right) == 64 and len(got_left) == len(got_right) == 22
    assert got_left == left[-22:] and got_right == right[:22]  # (the tokens next to the middle)
    assert fit_context(left, 20, right[:5], 64) == (left[-39:], right[:5])  # (right needs less)
    assert fit_context(left, 65, right, 64) is None


def test_a_causal_checkpoint_infills_from_the_left_context_as_the_reference_scores_it(
        trained, tmp_path):
    """AR (and BD3LM) rows of the infilling table: the model cannot see the right context,
    so the left context is its prompt and it writes as many tokens as the middle has; the
    result says so, with tokens/s and tokens/step."""
    run = trained("order.kind=causal", tokenizer="bpe:300")
    data = tmp_path / "roc.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in (
        {"left": "Shall I compare", "middle": "thee to a", "right": "summer's day"},
        {"left": "Thou art", "middle": "more lovely", "right": "and more temperate"})))
    res = run_cli("setdiff_dist.cli.eval", "--checkpoint", run, "--task", "infill", "--data",
                  data)
    assert res.returncode == 0, res.stderr[-4000:] + res.stdout[-2000:]
    assert "infills from the left context only" in res.stderr
    out = json.loads(res.stdout[res.stdout.index("{"):])
    assert out["conditioning"] == "left" and out["count"] == 2
    assert out["tokens_per_step"] == 1.0 and out["tokens_per_s"] > 0
    assert all(0 <= out[k] <= 1 for k in ("rouge1", "rouge2", "rougeL"))


def test_records_that_do_not_fit_the_context_are_said_on_stderr(run, tmp_path):
    """--task gsm scores without the problems whose prompt and --max-new-tokens do not fit the
    context: it counted them in the JSON only (skipped_too_long); now stderr says so too."""
    data = tmp_path / "gsm.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in (
        {"prompt": "Question: " + "1 + " * 60 + "1 =\nAnswer: ", "answer": "61"},
        {"prompt": "Question: 1 + 1 =\nAnswer: ", "answer": "2"})))
    res = run_cli("setdiff_dist.cli.eval", "--checkpoint", run, "--task", "gsm", "--data", data,
                  "--max-new-tokens", "8")
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout[res.stdout.index("{"):])
    assert out["skipped_too_long"] == 1 and out["count"] == 1
    assert "1 record(s) did not fit the context" in res.stderr
