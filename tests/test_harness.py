"""lm-evaluation-harness through our model class (setdiff-eval --task harness), offline, with the
task YAMLs and JSONL data of tests/harness/: the harness's multiple-choice scores equal our own
scorer's, generation is the same at TP=1 and TP=2, a causal checkpoint exported to Hugging Face
scores the same through lm-eval's own `hf` model, and the autoregressive-order log-likelihood
of a set-diffusion model equals the one computed a token at a time."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from helpers import child_env, process_group, run_cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASKS = os.path.join("tests", "harness")
CHOICE = os.path.join(TASKS, "choice.jsonl")
# no hub: the tasks read local JSONL; the datasets cache stays in the test's directory
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}


@pytest.fixture(scope="module")
def runs(trained, tmp_path_factory):
    """A set-diffusion (staggered) and a causal checkpoint: session reference runs (BPE of 300
    tokens)."""
    return {"staggered": trained(tokenizer="bpe:300"),
            "causal": trained("order.kind=causal", tokenizer="bpe:300"),
            "cache": tmp_path_factory.mktemp("hf-cache")}


def evaluate(runs, checkpoint, *args, tp=1):
    """setdiff-eval: in this process at TP=1 (the session is offline, conftest), under
    torchrun otherwise."""
    if tp == 1:
        return run_cli("setdiff_dist.cli.eval", "--checkpoint", checkpoint, *args)
    cmd = ["-m", "setdiff_dist.cli.eval", "--checkpoint", str(checkpoint), *args]
    if tp > 1:
        from setdiff_dist.parallel import free_port

        cmd = ["-m", "torch.distributed.run", "--nproc-per-node", str(tp), "--master-port",
               str(free_port()), *cmd, "--tensor-parallel", str(tp)]
    env = child_env({**os.environ, **OFFLINE, "HF_HOME": str(runs["cache"])})
    return subprocess.run([sys.executable, *cmd], capture_output=True, text=True, timeout=600,
                          cwd=ROOT, env=env)


def harness(runs, checkpoint, tmp_path, tasks, *args, tp=1):
    out = tmp_path / f"harness-tp{tp}.json"
    res = evaluate(runs, checkpoint, "--task", "harness", "--harness-tasks", tasks,
                   "--include-path", TASKS, "--log-samples", "--out", str(out), *args, tp=tp)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(out.read_text())


def choice_lls(samples):
    """Per document, the log-likelihood of each choice, from the harness's samples."""
    return {s["doc_id"]: [r[0][0] for r in s["resps"]] for s in samples}


def test_multiple_choice_through_the_harness_equals_our_scorer(runs, tmp_path):
    ours = tmp_path / "choice.json"
    res = evaluate(runs, runs["staggered"], "--task", "choice", "--data", CHOICE, "--out", ours)
    assert res.returncode == 0, res.stderr[-3000:]
    ours = json.loads(ours.read_text())
    got = harness(runs, runs["staggered"], tmp_path, "setdiff_choice")
    result = got["results"]["setdiff_choice"]
    assert result["acc,none"] == pytest.approx(ours["acc"])
    assert result["acc_norm,none"] == pytest.approx(ours["acc_norm"])
    lls = choice_lls(got["samples"]["setdiff_choice"])
    assert len(lls) == ours["records"] == 8
    for i, rec in enumerate(ours["scores"]):
        assert lls[i] == pytest.approx(rec["loglikelihoods"], rel=1e-5, abs=1e-5)
        assert all(math.isfinite(x) and x < 0 for x in lls[i])
    # a staggered-order model's scores are the AR order's, and the results say so
    assert got["exact_likelihood"] is False and ours["exact_likelihood"] is False
    assert "autoregressive-order" in got["likelihood"]


@pytest.mark.slow
def test_generation_is_the_same_at_tp1_and_tp2(runs, tmp_path):
    one = harness(runs, runs["staggered"], tmp_path, "setdiff_gen")
    two = harness(runs, runs["staggered"], tmp_path, "setdiff_gen", tp=2)
    texts = [s["resps"][0][0] for s in one["samples"]["setdiff_gen"]]
    assert len(texts) == 5 and all(isinstance(t, str) for t in texts)
    assert texts == [s["resps"][0][0] for s in two["samples"]["setdiff_gen"]]
    # `until` cuts the text (as the harness expects) and max_gen_toks bounds it
    assert not any("\n" in t or "." in t for t in texts)
    # the results report what the requests decoded with: the task's max_gen_toks and until
    assert [{k: g[k] for k in ("max_new_tokens", "until", "greedy", "requests")}
            for g in one["generation"]] == [{"max_new_tokens": 12, "until": ["\n", "."],
                                             "greedy": True, "requests": 5}]


def test_causal_export_scores_the_same_through_lm_evals_hf_model(runs, tmp_path):
    """Our causal checkpoint exported with --to-hf: lm-eval's own `hf` model class on the
    export, our model class on the checkpoint; the same log-likelihoods and rolling
    log-likelihoods (word perplexity)."""
    export = tmp_path / "hf"
    res = run_cli("setdiff_dist.cli.convert", "--checkpoint", runs["causal"], "--to-hf",
                  "--out", export)
    assert res.returncode == 0, res.stderr[-3000:]
    ours = harness(runs, runs["causal"], tmp_path, "setdiff_choice,setdiff_rolling")
    assert ours["exact_likelihood"] is True
    import lm_eval
    from lm_eval.models.huggingface import HFLM

    from setdiff_dist.eval.harness import task_manager

    # (the index setdiff-eval built above, from the same task files: lm-eval's own class)
    lm = HFLM(pretrained=str(export), device="cpu", dtype="float32", batch_size=4)
    manager = task_manager(["setdiff_choice", "setdiff_rolling"], TASKS)
    assert task_manager(["setdiff_choice"], TASKS) is manager  # (built once in a process)
    out = lm_eval.simple_evaluate(model=lm, tasks=["setdiff_choice", "setdiff_rolling"],
                                  task_manager=manager, log_samples=True)
    hf = {"results": out["results"], "samples": {
        t: [{"doc_id": s["doc_id"], "resps": s["resps"]} for s in v]
        for t, v in out["samples"].items()}}
    ours_lls = choice_lls(ours["samples"]["setdiff_choice"])
    hf_lls = choice_lls(hf["samples"]["setdiff_choice"])
    assert sorted(ours_lls) == sorted(hf_lls) == list(range(8))
    for i in hf_lls:
        assert ours_lls[i] == pytest.approx(hf_lls[i], rel=1e-4, abs=1e-4)
    for metric in ("acc,none", "acc_norm,none"):
        assert ours["results"]["setdiff_choice"][metric] == hf["results"]["setdiff_choice"][metric]
    rolling = {k: ours["results"]["setdiff_rolling"][k] for k in ("word_perplexity,none",
                                                                   "bits_per_byte,none")}
    for k, v in rolling.items():
        assert v == pytest.approx(hf["results"]["setdiff_rolling"][k], rel=1e-4)
    # lm-eval's own models stay available through setdiff-lm-eval (ours registered beside them)
    res = run_cli("setdiff_dist.cli.lm_eval", "--model", "hf", "--model_args",
                  f"pretrained={export},dtype=float32", "--tasks", "setdiff_choice",
                  "--include_path", TASKS, "--batch_size", "4", "--output_path",
                  tmp_path / "hf-out")
    assert res.returncode == 0, res.stderr[-3000:]
    files = [p for p in (tmp_path / "hf-out").rglob("results_*.json")]
    got = json.loads(files[0].read_text())["results"]["setdiff_choice"]
    assert got["acc,none"] == hf["results"]["setdiff_choice"]["acc,none"]


def test_set_model_ar_loglikelihood_equals_one_token_at_a_time(runs):
    """The one-pass scores of a set-diffusion model (lm-eval's loglikelihood and rolling) equal
    its [MASK] query at each position over the clean prefix, one forward per token."""
    from setdiff_dist.eval.likelihood import Scorer
    from setdiff_dist.inference.weights import build_inference_model

    with process_group("gloo"):
        model, cfg, tok = build_inference_model(str(runs["staggered"]))
        scorer = Scorer(model, cfg, tok, batch_size=3)
        text = "Shall I compare thee to a summer's"
        ids = tok.encode(text)
        assert len(ids) < cfg.data.seq_len  # (one window of the model's context)

        def sequential(prefix, targets):
            total, greedy = 0.0, True
            for x in targets:
                t = torch.tensor([prefix + [model.mask_id]])
                logits = model(t, torch.arange(t.shape[1])[None], None)[-1, 0].double()
                logp = torch.log_softmax(logits, -1)
                total += float(logp[x])
                greedy &= int(logp.argmax()) == x
                prefix = prefix + [x]
            return total, greedy

        pairs = [(ids[:4], ids[4:9]), (ids[:1], ids[1:3]), (ids[:7], ids[7:])]
        got = scorer.loglikelihood_tokens(pairs)
        for (ctx, cont), (ll, greedy) in zip(pairs, got):
            want_ll, want_greedy = sequential(ctx, cont)
            assert ll == pytest.approx(want_ll, rel=1e-5) and greedy == want_greedy
        # the whole text after end-of-text, as loglikelihood_rolling scores it
        assert scorer.rolling([text])[0] == pytest.approx(
            sequential([tok.eos_id], ids)[0], rel=1e-5)


def test_bad_harness_requests_are_one_line_errors(runs, tmp_path):
    def here(*args):  # (each is refused before any model is loaded)
        return evaluate(runs, runs["staggered"], *args)

    res = here("--task", "harness")
    assert res.returncode == 2 and "--harness-tasks" in res.stderr
    res = here("--task", "harness", "--harness-tasks", "nope", "--include-path", TASKS)
    assert res.returncode == 2 and "unknown harness task(s) nope" in res.stderr
    assert "Traceback" not in res.stderr
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"context": "a", "choices": ["b", "c"], "gold": 2}) + "\n")
    res = here("--task", "choice", "--data", str(bad))
    assert res.returncode == 2 and "'gold' must be the index" in res.stderr
    # a hub task whose dataset is not here (offline): one line, before any model is loaded
    res = evaluate(runs, runs["staggered"], "--task", "harness", "--harness-tasks", "hellaswag")
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert "harness task(s) hellaswag: the dataset could not be loaded" in res.stderr


def test_lm_evals_own_command_line_runs_our_model_and_its_tooling_reads_the_output(runs,
                                                                                   tmp_path):
    """``setdiff-lm-eval --model setdiff ...`` is lm-eval's command line with our model class
    registered (an installed package cannot register one for plain ``lm_eval``): its results
    and per-task samples files, in lm-eval's layout, read by lm-eval's own helpers, with the
    few-shot count; the scores are those of setdiff-eval --task harness."""
    from lm_eval.utils import (
        get_latest_filename,
        get_results_filenames,
        get_sample_results_filenames,
        make_table,
    )

    out = tmp_path / "lm-eval"
    env = child_env({**os.environ, **OFFLINE, "HF_HOME": str(runs["cache"])})
    res = subprocess.run([sys.executable, "-m", "setdiff_dist.cli.lm_eval", "--model",
                          "setdiff", "--model_args", f"pretrained={runs['staggered']}",
                          "--tasks", "setdiff_choice", "--include_path", TASKS,
                          "--num_fewshot", "0", "--output_path", str(out), "--log_samples"],
                         capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    files = [str(p) for p in out.rglob("*") if p.is_file()]
    # (pretrained=, lm-eval's name for the model, names the run's directory as for its models)
    assert all(os.path.basename(str(runs["staggered"])) in os.path.relpath(f, out)
               for f in files), files
    results = json.loads(open(get_latest_filename(get_results_filenames(files))).read())
    assert "setdiff_choice" in make_table(results)
    assert results["n-shot"]["setdiff_choice"] == 0
    samples = get_sample_results_filenames(files)
    assert len(samples) == 1 and "setdiff_choice" in samples[0]
    ours = harness(runs, runs["staggered"], tmp_path, "setdiff_choice")
    for metric in ("acc,none", "acc_norm,none"):
        assert results["results"]["setdiff_choice"][metric] == \
            ours["results"]["setdiff_choice"][metric]


def test_long_five_shot_prompts_are_cut_as_lm_evals_hf_cuts_them(runs, tmp_path):
    """A generation task in GSM8K's schema and format, 5-shot, whose prompts are several times
    the context: our class on the causal checkpoint and lm-eval's own ``hf`` model on its
    ``--to-hf`` export are given the same prompts (the same shots) and keep the same last
    tokens of each (saying so) and generate the same text. The results record the few-shot
    count and go to lm-eval's own layout too, which its helpers read."""
    from lm_eval.utils import get_latest_filename, get_results_filenames, make_table

    export = tmp_path / "hf"
    res = run_cli("setdiff_dist.cli.convert", "--checkpoint", runs["causal"], "--to-hf",
                  "--out", export)
    assert res.returncode == 0, res.stderr[-3000:]
    layout = tmp_path / "lm-eval-layout"
    out = tmp_path / "long.json"
    res = evaluate(runs, runs["causal"], "--task", "harness", "--harness-tasks",
                   "setdiff_gsm_long", "--include-path", TASKS, "--log-samples", "--out",
                   str(out), "--output-path", str(layout))
    assert res.returncode == 0, res.stderr[-3000:]
    assert "prompts are longer than the 16 tokens left of the context (32)" in res.stderr
    ours = json.loads(out.read_text())
    assert ours["n-shot"]["setdiff_gsm_long"] == 5
    import lm_eval
    from lm_eval.models.huggingface import HFLM

    from setdiff_dist.eval.harness import task_manager

    lm = HFLM(pretrained=str(export), device="cpu", dtype="float32", batch_size=4)
    hf = lm_eval.simple_evaluate(model=lm, tasks=["setdiff_gsm_long"],
                                 task_manager=task_manager(["setdiff_gsm_long"], TASKS),
                                 log_samples=True)
    theirs = {s["doc_id"]: s["resps"][0][0] for s in hf["samples"]["setdiff_gsm_long"]}
    mine = {s["doc_id"]: s["resps"][0][0] for s in ours["samples"]["setdiff_gsm_long"]}
    assert sorted(mine) == sorted(theirs) == list(range(10))
    assert mine == theirs
    # the same prompts, byte for byte: the same five shots, drawn with lm-eval's own seeds
    # (0 / 1234 / 1234 / 1234), not ours
    def context(sample):  # (lm-eval's "arguments": {"gen_args_0": {"arg_0": ...}} or tuples)
        args = sample["arguments"]
        return next(iter(args.values()))["arg_0"] if isinstance(args, dict) else args[0][0]

    prompts = {s["doc_id"]: context(s) for s in ours["samples"]["setdiff_gsm_long"]}
    assert prompts == {s["doc_id"]: context(s) for s in hf["samples"]["setdiff_gsm_long"]}
    assert all(p.count("Question:") == 6 for p in prompts.values()), prompts[0]  # (5 shots)
    files = [str(p) for p in layout.rglob("*") if p.is_file()]
    written = json.loads(open(get_latest_filename(get_results_filenames(files))).read())
    assert written["n-shot"]["setdiff_gsm_long"] == 5 and "setdiff_gsm_long" in \
        make_table(written)


def test_a_failing_task_keeps_the_finished_ones_and_bad_settings_compute_nothing(runs,
                                                                                 tmp_path):
    """Tasks run one at a time and each finished one is written at once: when the second
    fails (it asks for more tokens than the context holds), the first one's results are on
    disk. A generation setting set decoding cannot honour is refused before anything is
    computed, whichever task it is in."""
    out = tmp_path / "two.json"
    res = evaluate(runs, runs["staggered"], "--task", "harness", "--harness-tasks",
                   "setdiff_choice,setdiff_gen_toolong", "--include-path", TASKS, "--out",
                   str(out))
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-3000:]
    assert "max_gen_toks=500 leaves no room for a prompt" in res.stderr
    kept = json.loads(out.read_text())
    assert list(kept["results"]) == ["setdiff_choice"]
    assert 0 <= kept["results"]["setdiff_choice"]["acc,none"] <= 1
    out = tmp_path / "beams.json"
    res = evaluate(runs, runs["staggered"], "--task", "harness", "--harness-tasks",
                   "setdiff_choice,setdiff_gen", "--include-path", TASKS, "--gen-kwargs",
                   "num_beams=4", "--out", str(out))
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-3000:]
    assert "harness task setdiff_gen: generation setting(s) num_beams=4 are not supported" in \
        res.stderr
    assert not out.exists()


# ------------------------------------------------------------ setdiff-lm-eval: what users get wrong
# Each: one line `setdiff-lm-eval: error: ...` saying what is wrong and what to give, exit code 2,
# no traceback; in this process (each is refused before lm-eval loads a task or a model).

LM_EVAL_ERRORS = [
    ("a missing checkpoint", ["--model_args", "checkpoint={missing}"],
     ["--model_args checkpoint={missing}: no such directory; give a training run directory"]),
    ("no checkpoint", ["--model_args", "window=4"], ["--model_args: give checkpoint=DIR"]),
    ("dtype=fp16", ["--model_args", "checkpoint={missing},dtype=fp16"],
     ["--model_args dtype=fp16: float16 is not supported", "float32 (fp32) or bfloat16 (bf16)"]),
    ("dtype=fp8", ["--model_args", "checkpoint={missing}", "dtype=fp8"],
     ["--model_args dtype=fp8: unknown dtype; give auto"]),
    ("an unknown key", ["--model_args", "checkpoint={missing},windw=4,beams=2"],
     ["unknown model argument(s) beams, windw of --model setdiff: windw (did you mean window?)",
      "Its model arguments are checkpoint, tensor_parallel, dtype"]),
    ("hf's pretrained=, a missing one", ["--model_args", "pretrained={missing}"],
     ["--model_args pretrained={missing}: no such directory"]),
    ("checkpoint and pretrained both", ["--model_args", "checkpoint={missing},pretrained=x"],
     ["name two models; give one"]),
    ("lm-eval's own flag as a model argument", ["--model_args", "checkpoint={missing},device=cpu"],
     ["--model_args device: lm-eval sets this with its own flag: give --device ... instead"]),
    ("tensor_parallel=0", ["--model_args", "checkpoint={missing},tensor_parallel=0"],
     ["--model_args tensor_parallel=0: the tensor-parallel size must be an integer of 1 or more"]),
    ("--batch_size 0", ["--model_args", "checkpoint={missing}", "--batch_size", "0"],
     ["--batch_size 0: give how many requests are scored at once, an integer of 1 or more"]),
    ("--batch_size x", ["--model_args", "checkpoint={missing}", "--batch_size", "x"],
     ["--batch_size x:"]),
]


@pytest.mark.parametrize("args,words", [c[1:] for c in LM_EVAL_ERRORS],
                         ids=[c[0] for c in LM_EVAL_ERRORS])
def test_lm_eval_user_errors_are_one_line_and_exit_code_2(tmp_path, args, words):
    missing = tmp_path / "no-such-run"
    res = run_cli("setdiff_dist.cli.lm_eval", "--model", "setdiff",
                  *[a.format(missing=missing) for a in args], "--tasks", "setdiff_choice",
                  "--include_path", TASKS)
    assert res.returncode == 2, res.stderr[-3000:]
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    errors = [line for line in res.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith("setdiff-lm-eval: error: "), res.stderr
    for w in words:
        assert w.format(missing=missing) in errors[0], errors[0]


def test_lm_eval_on_a_damaged_checkpoint_is_one_line_and_exit_code_2(trained, tmp_path):
    """The checkpoint's files are checked when lm-eval builds our model (after its own start):
    a truncated weights file is our one line, naming the file, not lm-eval's traceback."""
    from helpers import copy_run

    run = copy_run(trained(), tmp_path)
    weights = sorted(run.glob("checkpoints/step_*/weights/*.safetensors"))[-1]
    os.truncate(weights, os.path.getsize(weights) // 2)
    res = run_cli("setdiff_dist.cli.lm_eval", "--model", "setdiff", "--model_args",
                  f"checkpoint={run}", "--tasks", "setdiff_choice", "--include_path", TASKS)
    assert res.returncode == 2, res.stderr[-3000:]
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    errors = [line for line in res.stderr.splitlines() if "error:" in line]
    assert errors and errors[0].startswith("setdiff-lm-eval: error: "), res.stderr[-3000:]
    assert weights.name in res.stderr and "(truncated)" in res.stderr, res.stderr[-3000:]


def test_the_task_index_is_built_again_when_a_task_file_changes(tmp_path):
    """setdiff-eval keeps lm-eval's task index (10-20 s to build) for the process, keyed by the
    task files of --include-path: an edited, added or removed file gives another key."""
    import shutil

    from setdiff_dist.eval.harness import _index_key

    tasks = tmp_path / "tasks"
    shutil.copytree(TASKS, tasks)
    key = _index_key(str(tasks))
    assert _index_key(str(tasks)) == key and _index_key(None) == (None,)
    yaml = next(tasks.glob("*.yaml"))
    yaml.write_text(yaml.read_text() + "\n# edited\n")
    edited = _index_key(str(tasks))
    assert edited != key
    (tasks / "sub").mkdir()
    shutil.copy(yaml, tasks / "sub" / "more.yaml")
    assert _index_key(str(tasks)) != edited
    (tasks / "sub" / "more.yaml").unlink()
    assert _index_key(str(tasks)) == edited
    (tasks / "notes.txt").write_text("not a task")  # (not a task file)
    assert _index_key(str(tasks)) == edited
