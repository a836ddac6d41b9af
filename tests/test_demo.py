"""The CPU demo (the README's main job) runs end to end on a few steps."""

import json

import pytest
from helpers import sonnet_shards

from setdiff_dist.cli.demo import main


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return sonnet_shards(tmp_path_factory.mktemp("demo"), "bpe:300", valid_every=3)


def test_demo_trains_reports_the_bound_and_checks_the_ar_identity(tmp_path, shards, capsys):
    rc = main(["--config", "configs/tiny-cpu.yaml", f"run_dir={tmp_path}", "train.steps=30",
               "train.log_interval=10", "optimizer.warmup_steps=5", f"data.train_shards={shards}",
               "data.seq_len=32", "model.vocab_size=300", "data.micro_batch_size=4",
               "data.global_batch_size=8"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "PPL <=" in out and "AR identity" in out
    # the reference model needs no process group: nothing of one is left in this process (a
    # leaked MASTER_PORT made later commands collide with its still-open store)
    import os

    import torch.distributed as dist
    assert not dist.is_initialized() and "MASTER_PORT" not in os.environ
    assert (tmp_path / "demo" / "orders.png").stat().st_size > 10_000
    lines = (tmp_path / "demo" / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["step"] for r in records] == [10, 20, 30]
    assert {"step", "loss", "lr", "grad_norm", "tokens_per_s", "samples_seen"} <= set(records[0])
    assert records[-1]["samples_seen"] == 240
    result = json.loads((tmp_path / "demo" / "demo_result.json").read_text())
    assert result["ar_identity_max_gap"] < 1e-4
    # training made progress from the uniform bound (log 300 = 5.7 nats per token)
    assert records[-1]["loss"] < 5.0 and result["valid_ppl_bound"] < 250


def test_demo_reports_problems_and_exits(tmp_path, shards, capsys):
    assert main(["--config", "configs/tiny-cpu.yaml", "order.knd=block"]) == 2
    assert "did you mean 'order.kind'" in capsys.readouterr().err
    assert main(["--config", "configs/tiny-cpu.yaml", f"run_dir={tmp_path}",
                 f"data.train_shards={shards}", "data.seq_len=32", "model.vocab_size=256"]) == 2
    assert "set model.vocab_size=300" in capsys.readouterr().err
    assert main(["--config", "configs/tiny-cpu.yaml", f"run_dir={tmp_path}",
                 f"data.train_shards={shards}", "data.seq_len=64"]) == 2
    assert "data.seq_len=64" in capsys.readouterr().err


def test_the_main_job_prints_progress_bound_and_text_and_no_warnings(tmp_path):
    """scripts/main.sh, the README's main job, with its default settings (a few steps, the
    task stage small): the progress, the validation bound and the generated text, the task
    table of AR next to SetDLM on held-out chain sums (printed, and as task_summary.json), and
    not one library warning."""
    import os
    import re
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    from helpers import child_env

    env = child_env()
    env.pop("SETDIFF_VERBOSE", None)
    env.update(TASK_STEPS="4", TASK_TRAIN="300", TASK_TEST="6")
    res = subprocess.run(["bash", "scripts/main.sh", "train.steps=6", "train.log_interval=2",
                          "optimizer.warmup_steps=2", "train.eval_interval=3",
                          f"run_dir={tmp_path / 'run'}"],
                         capture_output=True, text=True, cwd=root, env=env, timeout=900)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-3000:]
    warning = re.compile(r"Warning|warnings\.warn|\[WARNING\]|^WARNING|^W\d{4} ", re.M)
    assert not warning.search(out), [line for line in out.splitlines() if warning.search(line)]
    assert re.search(r"^step +6/6 +loss \d", out, re.M)
    assert re.search(r"validation: valid_loss \S+ +valid_ppl_bound \d", out)
    # one validation at the interval, one at the end: not two when the interval divides the
    # steps
    pretraining = out.split("checkpoint ", 1)[0]
    assert [int(m) for m in re.findall(r"^step +(\d+) +validation:", pretraining, re.M)] \
        == [3, 6]
    assert re.search(r"^48 tokens in .* tokens/s", out, re.M)
    text = out.split("checkpoint ", 1)[1].splitlines()[1]  # the line after the checkpoint's
    assert len(text.split()) >= 5
    # the task stage: both models trained (4 steps), the table printed and written
    import json

    assert re.search(r"^\| ar \| causal \(W=1\) \| - \| [\d.]+% \|", out, re.M), out[-3000:]
    assert re.search(r"^\| setdlm \| set \(W=4\) \| 0\.9 \| [\d.]+% \|", out, re.M)
    assert "held out: none of their questions is among the" in out
    assert re.search(r"^  step  1: ", out, re.M)  # (the set-by-set trace, no colour in a pipe)
    rows = json.loads((tmp_path / "run" / "task_summary.json").read_text())
    assert [(r["model"], r["tau"]) for r in rows] == [("ar", None), ("setdlm", "inf"),
                                                      ("setdlm", 0.9)]
    for r in rows:
        assert 0 <= r["accuracy"] <= 1 and r["problems"] == 6, r
        assert r["tokens_per_step"] > 0 and r["tokens_per_s"] > 0, r
    test = [json.loads(line)["prompt"] for line in
            open(os.path.join(root, "data", "chain-300", "test-6.jsonl"))]
    train = {json.loads(line)["prompt"] for line in
             open(os.path.join(root, "data", "chain-300", "train.jsonl"))}
    assert len(test) == len(set(test)) == 6 and not set(test) & train
