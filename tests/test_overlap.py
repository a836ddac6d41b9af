"""The overlapped, sharded gradient reduction of the default bf16 path, and the phase timers and
traces that show where a step's time goes, on 4 gloo ranks with torch.distributed's collectives
wrapped by a recorder (tests/comm_record.py).

One spawn trains every case: DP4, TP2 x DP2 and PP2 x DP2, each with ``zero.overlap_comm`` on
(the default) and off (the reduction after the backward, as before), in fp32 and bf16.
Recorded calls are tagged with the trainer's phase (its timers) at the time of the call."""

import json
import time

import pytest
import torch
from helpers import curve, mark_steps, train_config

# (the slow tier: 12 runs on 4 ranks; the default tier trains the overlapped default on every
# layout, test_train and test_precision)
pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

STEPS = {"fp32": 6, "bf16": 20}  # fp32 must match exactly: a few steps show it
LAYOUTS = {"dp4": [], "tp2xdp2": ["parallel.tensor=2"], "pp2xdp2": ["parallel.pipeline=2"]}
# a bucket of a sixth of the tiny model, as a 40M-element bucket is of a 1.3B model's 240M
# parameters per stage: the reduction starts while the backward still runs
BUCKET = "zero.reduce_bucket_size=20000"


def _train(rank, shards, root, out):
    from comm_record import CommRecorder

    recorder = CommRecorder().__enter__()  # before DeepSpeed and megatron start

    from megatron.core import parallel_state as ps

    from setdiff_dist.quiet import quiet

    quiet()
    from setdiff_dist.train.loop import Trainer

    found = {}
    for layout, overrides in LAYOUTS.items():
        for precision in ("fp32", "bf16"):
            for overlap in ("true", "false"):
                name = f"{layout}-{precision}-overlap_{overlap}"
                extra = ["train.profile_steps=[2,3]"] if name == "pp2xdp2-bf16-overlap_true" \
                    else []
                cfg = train_config(f"{root}/{name}", shards, "checkpoint.save_at_end=false",
                                   f"train.precision={precision}", f"zero.overlap_comm={overlap}",
                                   BUCKET, *overrides, *extra, steps=STEPS[precision])
                t = Trainer(cfg)
                found[name] = _observe(t, recorder, ps)
                found[name]["curve"] = curve(cfg.run_dir) if rank == 0 else None
    torch.save(found, out / f"rank{rank}.pt")


def _observe(t, recorder, ps):
    """Train ``t`` with the recorder on; each call tagged with the trainer's phase, and the end
    of the first (local) layer's backward in each micro-batch timed from its weights'
    gradients."""
    import torch.distributed as dist

    layer = t.engine.module.decoder.layers[0]
    ends = []
    for p in layer.parameters():
        p.register_post_accumulate_grad_hook(lambda _: ends.append(time.perf_counter()))
    dp = tuple(dist.get_process_group_ranks(ps.get_data_parallel_group(with_context_parallel=True)))
    step_starts = mark_steps(t)
    first = len(recorder.calls)
    recorder.tag = lambda: t.timers._stack[-1][0] if t.timers._stack else None
    t0 = time.perf_counter()
    t.fit()
    wall = time.perf_counter() - t0
    recorder.tag = None
    calls = recorder.calls[first:]
    return {"calls": [(c.t, c.kind, c.ranks == dp, c.wire, c.tag) for c in calls],
            "ends": ends, "step_starts": step_starts, "wall": wall,
            "params": sum(p.numel() for p in t.engine.module.parameters()),
            "optimizer": type(t.engine.optimizer).__name__, "dp": len(dp),
            "n_layer_params": len(list(layer.parameters())), "micro": t.n_micro}


@pytest.fixture(scope="module")
def runs(sonnets, tmp_path_factory):
    from mp_harness import spawn

    out = tmp_path_factory.mktemp("overlap")
    spawn(_train, 4, str(sonnets), str(out / "runs"), out)
    return out, [torch.load(out / f"rank{r}.pt") for r in range(4)]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_the_overlapped_default_follows_todays_curve(runs, layout):
    """fp32: the same losses as the reduction after the backward (1e-6); bf16: within 2% over
    20 steps (the same fp32 accumulation and reduction, in another order)."""
    found = runs[1][0]
    for precision, tol in (("fp32", 1e-6), ("bf16", 0.02)):
        on, _ = found[f"{layout}-{precision}-overlap_true"]["curve"]
        off, _ = found[f"{layout}-{precision}-overlap_false"]["curve"]
        assert len(on) == STEPS[precision], precision
        assert on == pytest.approx(off, rel=tol), (precision, on, off)
    assert found[f"{layout}-bf16-overlap_true"]["optimizer"] == "DeepSpeedZeroOptimizer"
    assert found[f"{layout}-bf16-overlap_false"]["optimizer"] == "BF16_Optimizer"


def _steps(info):
    """The record cut into steps: [(calls, layer-0 gradient times)] per step."""
    bounds = info["step_starts"] + [float("inf")]
    return [([c for c in info["calls"] if a <= c[0] < b], [e for e in info["ends"] if a <= e < b])
            for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_gradient_reduction_starts_inside_the_backward_and_sends_a_reduce_scatter(runs,
                                                                                  layout):
    """On every rank and step: the first data-parallel gradient reduction starts before the
    last micro-batch's backward reaches the first layer's weights; what the step reduces is
    one reduce-scatter of the fp32 gradients, and with the bf16 parameters' all-gather it stays
    within the reduce-scatter bound 2 x parameters x (DP-1)/DP x 4 bytes. The reduction after
    the backward (overlap off) starts after it and all-reduces: twice the bytes."""
    for info_by_rank in (r[f"{layout}-bf16-overlap_true"] for r in runs[1]):
        info, off = info_by_rank, None
        dp, params = info["dp"], info["params"]
        reduce_scatter = params * 4 * (dp - 1) / dp
        for calls, ends in _steps(info)[1:]:
            grads = [c for c in calls if c[4] == "grad_reduce" and c[2]]
            assert grads, layout
            last_micro = ends[-info["n_layer_params"]:]
            assert grads[0][0] < max(last_micro), layout
            sent = sum(c[3] for c in grads)
            assert sent == pytest.approx(reduce_scatter, rel=0.01), layout
            gathered = sum(c[3] for c in calls if c[1] == "all_gather" and c[2]
                           and c[4] == "optimizer")
            assert sent + gathered <= 2 * params * (dp - 1) / dp * 4 * 1.001
    for r in runs[1]:
        off = r[f"{layout}-bf16-overlap_false"]
        for calls, ends in _steps(off)[1:]:
            grads = [c for c in calls if c[4] == "grad_reduce" and c[2]]
            assert grads[0][0] > max(ends)
            assert sum(c[3] for c in grads) == pytest.approx(
                2 * off["params"] * 4 * (off["dp"] - 1) / off["dp"], rel=0.01)


def test_the_phase_timers_add_up_to_the_step_time(runs):
    """Every logged line: the phases of a step sum to its measured time within 5%; the steps'
    time is inside the run's wall time; tokens/s counts training time only."""
    out, found = runs
    rows = [json.loads(line) for line in
            open(out / "runs" / "pp2xdp2-bf16-overlap_true" / "metrics.jsonl")]
    rows = [r for r in rows if "loss" in r]
    assert [r["step"] for r in rows] == list(range(1, 21))
    for r in rows:
        phases = sum(r[f"time_{k}"] for k in ("data_wait", "forward", "backward", "grad_reduce",
                                             "optimizer"))
        assert phases == pytest.approx(r["step_time"], rel=0.05), r
        assert r["time_forward"] > 0 and r["time_backward"] > 0 and r["time_optimizer"] > 0
        assert r["step_time_min"] <= r["step_time_median"] <= r["step_time_max"]
        assert r["slowest_rank"] in range(4)
        assert r["tokens_per_s"] == pytest.approx(8 * 32 / r["step_time"], rel=1e-6)
    assert sum(r["step_time"] for r in rows) < found[0]["pp2xdp2-bf16-overlap_true"]["wall"]


def test_profile_steps_leaves_one_trace_per_rank(runs):
    out, _ = runs
    for rank in range(4):
        path = out / "runs" / "pp2xdp2-bf16-overlap_true" / "profile" / f"rank{rank}.pt.trace.json"
        trace = json.load(open(path))
        names = {e.get("name") for e in trace["traceEvents"]}
        assert {"setdiff/forward", "setdiff/backward", "setdiff/optimizer"} <= names, rank
