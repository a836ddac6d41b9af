"""The miniature reproduction (benchmarks/paper_mini.py) end to end in its --quick mode: the
same data preparation, five real setdiff-train runs, evaluation, plots and report, on a trivial
budget. The numbers mean nothing at this size; the test checks that every part runs and that
the identities the study relies on hold."""

import json
import math
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_quick_study_runs_end_to_end(tmp_path):
    res = subprocess.run([sys.executable, "benchmarks/paper_mini.py", "--quick", "--out",
                          str(tmp_path)], capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    ev = results["eval"]
    assert set(ev) == {"ar", "setdlm-d4", "bd3lm-4", "mdlm", "setdlm-d8"}
    assert ev["ar"]["ppl"]["exact"] and not ev["setdlm-d4"]["ppl"]["exact"]
    for name, e in ev.items():
        assert math.isfinite(e["ppl"]["ppl_bound"]) and e["infill"]["count"] >= 1
        assert e["infill"]["uses_right_context"] == (name in ("setdlm-d4", "setdlm-d8", "mdlm"))
        taus = [r["tau"] for r in e["sweep"]]
        assert taus == ([math.inf] if name in ("ar", "mdlm") else
                        [math.inf, 0.99, 0.95, 0.9, 0.8, 0.7, 0.6])
        for r in e["sweep"]:
            assert math.isfinite(r["gen_ppl"]) and 0 < r["distinct2"] <= 1
    # tau = inf decodes one token per step (set) or per denoising step (block)
    for name in ("setdlm-d4", "bd3lm-4", "ar"):
        assert ev[name]["sweep"][0]["tokens_per_step"] == pytest.approx(1.0)
    # every model saw the same number of steps
    assert len({t["steps"] for t in results["train"].values()}) == 1
    assert {c["claim"][:20] for c in results["claims"]} and len(results["claims"]) == 5
    for png in ("ppl.png", "pareto.png", "infill.png"):
        assert (tmp_path / png).read_bytes()[:4] == b"\x89PNG"
    report = (tmp_path / "report.md").read_text()
    assert "## Claims" in report and "| SetDLM D=4 (S<=8) |" in report
    # a rerun finds every stage done and only redoes the report
    again = subprocess.run([sys.executable, "benchmarks/paper_mini.py", "--quick", "--out",
                            str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "trained in" in again.stdout
    assert json.loads((tmp_path / "results.json").read_text())["eval"] == ev


def test_quick_task_study_runs_end_to_end(tmp_path):
    """benchmarks/paper_mini_task.py --quick: one pretraining run, three fine-tunes from it,
    the tau sweep on held-out problems, the verdicts, plots and report."""
    res = subprocess.run([sys.executable, "benchmarks/paper_mini_task.py", "--quick",
                          "--breakdown", "--out", str(tmp_path)], capture_output=True, text=True,
                         timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert set(results["train"]) == {"pretrain", "ft-ar", "ft-setdlm-d4", "ft-bd3lm-4"}
    # the three fine-tunes had one budget and started from the pretrained weights
    ft = [t for n, t in results["train"].items() if n.startswith("ft-")]
    assert len({t["steps"] for t in ft}) == 1
    for name in ("ar", "setdlm-d4", "bd3lm-4"):
        log = (tmp_path / "runs" / f"ft-{name}.log").read_text()
        assert "runs/pretrain" in log, log[-2000:]
    # held-out problems: none of the test questions is a training question
    data = tmp_path / "data"
    train = (data / "task-train.jsonl").read_text().splitlines()
    seen = {json.loads(x)["prompt"] for x in train}
    test = [json.loads(x) for x in (data / "task-test.jsonl").read_text().splitlines()]
    assert test and not seen & {r["prompt"] for r in test}
    ev = results["eval"]
    assert [r["tau"] for r in ev["ar"]["sweep"]] == [math.inf]
    for name in ("setdlm-d4", "bd3lm-4"):
        assert [r["tau"] for r in ev[name]["sweep"]] == [math.inf, 0.99, 0.95, 0.9, 0.8, 0.7,
                                                         0.6]
        assert ev[name]["sweep"][0]["tokens_per_step"] <= 1.0 + 1e-9
    for e in ev.values():
        for r in e["sweep"]:
            assert 0 <= r["accuracy"] <= 1 and r["tokens_per_s"] > 0
            assert 0 <= r["batch_accuracy"] <= 1 and r["batch_tokens_per_s"] > 0
    assert len(results["claims"]) == 4
    for png in ("pareto.png", "steps.png"):
        assert (tmp_path / png).read_bytes()[:4] == b"\x89PNG"
    assert "## Claims" in (tmp_path / "report.md").read_text()
    # one setdiff-eval command gives each model's tau sweep: the study's numbers
    from helpers import run_cli

    for name in ("ar", "setdlm-d4", "bd3lm-4"):
        argv = ev[name]["command"].split()[1:] + ["--out", str(tmp_path / f"{name}.json")]
        res = run_cli("setdiff_dist.cli.eval", *argv)
        assert res.returncode == 0, res.stderr[-3000:]
        rows = json.loads((tmp_path / f"{name}.json").read_text())["sweep"]
        assert [(float(r["threshold"]), r["accuracy"], r["tokens_per_step"]) for r in rows] == [
            (r["tau"], r["accuracy"], r["tokens_per_step"]) for r in ev[name]["sweep"]]
    # the breakdown counts the same greedy outputs: its totals are the sweep's accuracies
    parts = json.loads((tmp_path / "breakdown.json").read_text())
    for key, name, i in (("ar tau=inf", "ar", 0), ("setdlm-d4 tau=0.9", "setdlm-d4", 3),
                         ("bd3lm-4 tau=inf", "bd3lm-4", 0)):
        by = parts[key]["correct_by_operands"].values()
        assert sum(n for n, _ in by) / sum(t for _, t in by) == ev[name]["sweep"][i]["accuracy"]


def test_the_frontier_compares_best_accuracy_at_least_as_fast():
    sys.path.insert(0, "benchmarks")
    import paper_mini_task as t

    pts = [(10.0, 0.9), (20.0, 0.8), (30.0, 0.5)]
    assert t.frontier(pts, 5) == 0.9 and t.frontier(pts, 15) == 0.8
    assert t.frontier(pts, 30) == 0.5 and t.frontier(pts, 31) == -math.inf
