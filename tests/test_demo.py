"""The CPU demo (the README's main job) runs end to end on a few steps."""

import json
from pathlib import Path

from setdiff_dist.cli.demo import main

CONFIG = str(Path(__file__).resolve().parents[1] / "configs" / "tiny-cpu.yaml")


def test_demo_trains_reports_the_bound_and_checks_the_ar_identity(tmp_path, capsys):
    rc = main(["--config", CONFIG, f"run_dir={tmp_path}", "train.steps=30",
               "train.log_interval=10", "optimizer.warmup_steps=5"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "PPL <=" in out and "AR identity" in out
    assert (tmp_path / "orders.png").stat().st_size > 10_000
    records = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [10, 20, 30]
    assert {"step", "loss", "lr", "grad_norm", "tokens_per_s", "samples_seen"} <= set(records[0])
    result = json.loads((tmp_path / "demo_result.json").read_text())
    assert result["ar_identity_max_gap"] < 1e-4
    # training made progress from the uniform bound (log 256 = 5.5 nats per byte)
    assert records[-1]["loss"] < 4.5 and result["valid_ppl_bound"] < 100


def test_demo_reports_config_problems_and_exits_2(tmp_path, capsys):
    assert main(["--config", CONFIG, "order.knd=block"]) == 2
    assert "did you mean 'order.kind'" in capsys.readouterr().err
