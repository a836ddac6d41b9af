"""The overlapped, sharded gradient reduction and parameter gather of DeepSpeed's ZeRO path
(``zero.implementation=deepspeed``: ZeRO-2 and offload run it; ZeRO-1's default, megatron's
distributed optimizer, is tests/test_data_parallel.py's), and the phase timers and traces that
show where a step's time goes, on 4 gloo ranks with torch.distributed's collectives wrapped by a
recorder (tests/comm_record.py).

One spawn trains every case: DP4, TP2 x DP2 and PP2 x DP2, each with ``zero.overlap_comm`` on
(the default) and off (the reduction after the backward, as before), in fp32 and bf16, and in
bf16 with the overlap but without ``zero.overlap_param_gather`` (DeepSpeed's all-gather at the
end of the step), for 8 of the 12 steps. Recorded calls are tagged with the trainer's phase (its
timers) at the time of the call."""

import json
import time

import pytest
import torch
from helpers import curve, mark_steps, train_config

# (the slow tier: 15 runs on 4 ranks; the default tier trains the overlapped default on every
# layout, test_train and test_precision)
pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

STEPS = {"fp32": 6, "bf16": 12}  # fp32 must match exactly: a few steps show it
LAYOUTS = {"dp4": [], "tp2xdp2": ["parallel.tensor=2"], "pp2xdp2": ["parallel.pipeline=2"]}
# a bucket of a sixth of the tiny model, as a 40M-element bucket is of a 1.3B model's 240M
# parameters per stage: the reduction starts while the backward still runs
BUCKET = "zero.reduce_bucket_size=20000"
DEEPSPEED = "zero.implementation=deepspeed"
GATHER_OFF_STEPS = 8  # (of the 12: the schedule is the 12-step run's)
PROFILED_RUN, PROFILED = "pp2xdp2-bf16-overlap_true", (2, 3)  # (a trace of steps 2-3)


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
                extra = [f"train.profile_steps={list(PROFILED)}"] if name == PROFILED_RUN \
                    else []
                cfg = train_config(f"{root}/{name}", shards, "checkpoint.save_at_end=false",
                                   f"train.precision={precision}", f"zero.overlap_comm={overlap}",
                                   BUCKET, DEEPSPEED, *overrides, *extra,
                                   steps=STEPS[precision])
                t = Trainer(cfg)
                found[name] = _observe(t, recorder, ps)
                found[name]["curve"] = curve(cfg.run_dir) if rank == 0 else None
        name = f"{layout}-bf16-gather_false"
        cfg = train_config(f"{root}/{name}", shards, "train.precision=bf16",
                           "zero.overlap_param_gather=false", BUCKET, DEEPSPEED, *overrides,
                           f"train.exit_at_step={GATHER_OFF_STEPS}", steps=STEPS["bf16"])
        t = Trainer(cfg)
        found[name] = _observe(t, recorder, ps)
        found[name]["curve"] = curve(cfg.run_dir) if rank == 0 else None
    torch.save(found, out / f"rank{rank}.pt")


def _observe(t, recorder, ps):
    """Train ``t`` with the recorder on; each call tagged with the trainer's phase, and the end
    of the first (local) layer's backward in each micro-batch timed from its weights'
    gradients."""
    import torch.distributed as dist
    from comm_record import RecordingDevice

    layer = t.engine.module.decoder.layers[0]
    ends, starts = [], []
    for p in layer.parameters():
        p.register_post_accumulate_grad_hook(lambda _: ends.append(time.perf_counter()))
    # the parameter buckets not yet waited for when the first layer's forward starts (after
    # the prefetch's own hook) and when the model's forward ends
    pending = (lambda: t.prefetch.pending) if t.prefetch else (lambda: None)
    layer.register_forward_pre_hook(lambda *_: starts.append((time.perf_counter(), pending())))
    forward_ends = []
    t.engine.module.register_forward_hook(
        lambda *_: forward_ends.append((time.perf_counter(), pending())))
    dp = tuple(dist.get_process_group_ranks(ps.get_data_parallel_group(with_context_parallel=True)))
    # the timers on a stand-in device clock, whose waits for the device are recorded: where a
    # GPU's would be (the CPU's clock never waits)
    device = RecordingDevice(lambda: t.timers._step_start is not None)
    t.timers.clock = device.clock()
    step_starts = mark_steps(t)
    first = len(recorder.calls)
    recorder.tag = lambda: t.timers._stack[-1][0] if t.timers._stack else None
    t0 = time.perf_counter()
    t.fit()
    wall = time.perf_counter() - t0
    recorder.tag = None
    calls = recorder.calls[first:]
    return {"calls": [(c.t, c.kind, c.ranks == dp, c.wire, c.tag) for c in calls],
            "ends": ends, "step_starts": step_starts, "wall": wall, "layer_starts": starts,
            "forward_ends": forward_ends, "device_waits": device.waits,
            "buckets": len(t.prefetch.buckets) if t.prefetch else 0,
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
    12 steps (the same fp32 accumulation and reduction, in another order)."""
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
            gathered = sum(c[3] for c in calls if c[1] in ("all_gather", "broadcast") and c[2]
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
    assert [r["step"] for r in rows] == list(range(1, STEPS["bf16"] + 1))
    for r in rows:
        phases = sum(r[f"time_{k}"] for k in ("data_wait", "forward", "backward", "grad_reduce",
                                             "optimizer", "param_gather"))
        assert phases == pytest.approx(r["step_time"], rel=0.05), r
        assert r["time_forward"] > 0 and r["time_backward"] > 0 and r["time_optimizer"] > 0
        assert r["step_time_min"] <= r["step_time_median"] <= r["step_time_max"]
        assert r["slowest_rank"] in range(4)
        assert r["tokens_per_s"] == pytest.approx(8 * 32 / r["step_time"], rel=1e-6)
    assert sum(r["step_time"] for r in rows) < found[0]["pp2xdp2-bf16-overlap_true"]["wall"]
    # with the timers on, on every run and rank: waits for the device at the log intervals
    # only, never inside a step (on a GPU one would serialize the overlapped gather)
    for rank in found:
        for name, info in rank.items():
            assert info["device_waits"] and not any(info["device_waits"]), name


def test_profile_steps_leaves_one_trace_per_rank(runs):
    out, _ = runs
    for rank in range(4):
        path = out / "runs" / "pp2xdp2-bf16-overlap_true" / "profile" / f"rank{rank}.pt.trace.json"
        trace = json.load(open(path))
        names = {e.get("name") for e in trace["traceEvents"]}
        assert {"setdiff/forward", "setdiff/backward", "setdiff/optimizer"} <= names, rank


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_the_parameter_gather_overlaps_the_next_forward_and_changes_no_bit(runs, layout):
    """The default gathers the updated bf16 parameters during the next step's forward: every
    bucket is broadcast by its owner from inside the optimizer step, asynchronously, with the
    all-gather's bytes (2 x parameters x (DP-1)/DP); when the first layer's forward starts,
    later buckets are still unawaited, and by the end of the first micro-batch's forward all
    are in. The losses are those of DeepSpeed's all-gather at the end of the step, bit for bit,
    over 8 steps (and without the prefetch, no broadcast is sent)."""
    found = runs[1]
    for info in (r[f"{layout}-bf16-overlap_true"] for r in found):
        dp, params = info["dp"], info["params"]
        assert info["buckets"] > 2 * dp  # (small buckets: several per owner)
        for step, (calls, _) in enumerate(_steps(info)[:-1], 1):
            sent = [c for c in calls if c[1] == "broadcast" and c[2]]
            assert len(sent) == info["buckets"] and {c[4] for c in sent} == {"optimizer"}
            assert sum(c[3] for c in sent) == pytest.approx(params * 2 * (dp - 1) / dp,
                                                            rel=0.01), (layout, step)
            assert not [c for c in calls if c[1] == "all_gather" and c[2]
                        and c[4] == "optimizer"]
        # the forwards after a step: the first one's first layer starts with buckets pending
        # (but for the steps the profiler starts before and stops after: it waits for them)
        quiet = {PROFILED[0], PROFILED[1] + 1} if f"{layout}-bf16-overlap_true" == PROFILED_RUN \
            else set()
        firsts = [_first_in(info["layer_starts"], t)
                  for step, t in enumerate(info["step_starts"][1:], 2) if step not in quiet]
        assert firsts and all(pending > 0 for _, pending in firsts), (layout, firsts)
        ends = [_first_in(info["forward_ends"], t) for t in info["step_starts"][1:]]
        assert all(pending == 0 for _, pending in ends), (layout, ends)
    for rank, r in enumerate(found):
        off, on = r[f"{layout}-bf16-gather_false"], r[f"{layout}-bf16-overlap_true"]
        assert off["buckets"] == 0
        assert not [c for c in off["calls"] if c[1] == "broadcast" and c[2]
                    and c[4] == "optimizer"]
        if rank == 0:
            got, _ = on["curve"]
            want, _ = off["curve"]
            assert len(want) == GATHER_OFF_STEPS and got[:GATHER_OFF_STEPS] == want, layout


def _first_in(events, after):
    """The first of ``events`` ``(t, x)`` at or after time ``after``."""
    return next(e for e in events if e[0] >= after)
