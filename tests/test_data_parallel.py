"""Collectives per training step as DP grows, on gloo with torch.distributed's collectives
recorded (tests/comm_record.py): DeepSpeed's ZeRO-1 (a reduce per bucket and owner, a
broadcast per owner and bucket: the count grows with DP) and megatron-core's distributed
optimizer (``zero.implementation=megatron``: one reduce-scatter and one all-gather per bucket,
the same count at every DP), at DP 2, 4 and 8 and PP2 x DP 2 and 4 with a fixed bucket size,
counts and bytes together; and ZeRO-2 on torch's FSDP2 (``zero.implementation=fsdp``, what
``auto`` runs at ZeRO-2: one all-gather per layer a step, one reduce-scatter per layer and
micro-batch, whatever DP is). The same spawns check that the megatron and FSDP paths follow
DeepSpeed's fp32 losses (1e-6) on DP and TP x DP (megatron's also PP x DP) and resume
bit-exactly."""

import pytest
import torch
from helpers import curve, mark_steps, train_config

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

# a sixth of the tiny model, not grown with DP (megatron's floor of 1M elements per rank would
# make the tiny model one bucket)
BUCKET = ("zero.reduce_bucket_size=20000", "zero.min_bucket_per_rank=0")
STEPS = 3  # (the second step is measured: the first sets up, the last ends the run)
# the timers' phases of a step (what the trainer does between steps, logging, is not the step's)
PHASES = ("data_wait", "forward", "backward", "grad_reduce", "optimizer", "param_gather")


def _record(t, recorder):
    """Train ``t``; per step after the first: {kind: calls} and bytes sent on the DP group."""
    import torch.distributed as dist
    from comm_record import RecordingDevice
    from megatron.core import parallel_state as ps

    dp = tuple(dist.get_process_group_ranks(ps.get_data_parallel_group(with_context_parallel=True)))
    # the timers on a stand-in device clock that records each wait for the device and whether a
    # step was running then (a GPU's synchronize would serialize the overlapped collectives)
    device = RecordingDevice(lambda: t.timers._step_start is not None)
    t.timers.clock = device.clock()
    starts = mark_steps(t)
    first = len(recorder.calls)
    recorder.tag = lambda: t.timers._stack[-1][0] if t.timers._stack else None
    t.fit()
    recorder.tag = None
    calls = recorder.calls[first:]
    bounds = starts + [float("inf")]
    steps = []
    # (not the first step, which sets up what persists, nor the last, with the end's work)
    for a, b in list(zip(bounds, bounds[1:]))[1:-1]:
        mine = [c for c in calls if a <= c.t < b and c.ranks == dp and c.tag in PHASES]
        kinds = {}
        for c in mine:
            kinds[c.kind] = kinds.get(c.kind, 0) + 1
        sent = {k: sum(c.wire for c in mine if c.kind == k) for k in kinds}
        steps.append((kinds, sent, sorted({(c.kind, c.tag) for c in mine})))
    return {"steps": steps, "dp": len(dp), "stage": ps.get_pipeline_model_parallel_rank(),
            "device_waits": device.waits,
            "params": sum(p.numel() for p in t.engine.module.parameters())}


def _train(rank, shards, root, out, world):
    from comm_record import CommRecorder

    recorder = CommRecorder().__enter__()  # before DeepSpeed and megatron start

    from setdiff_dist.quiet import quiet

    quiet()
    from setdiff_dist.train.loop import Trainer

    found = {}
    # (bf16 at DP 2 and 4: its collectives are fp32's with other bytes)
    precisions = ("fp32", "bf16") if world < 8 else ("fp32",)
    runs = {f"dp-{impl}-{precision}": [f"zero.implementation={impl}",
                                       f"train.precision={precision}"]
            for impl in ("deepspeed", "megatron") for precision in precisions}
    runs.update({f"dp-fsdp-{precision}": ["zero.stage=2", f"train.precision={precision}"]
                 for precision in precisions})
    if world >= 4:  # PP2 x DP2, PP2 x DP4
        runs.update({f"pp2-{impl}-fp32": [f"zero.implementation={impl}", "train.precision=fp32",
                                          "parallel.pipeline=2"]
                     for impl in ("deepspeed", "megatron")})
    if world == 2:  # a checkpoint at step 2, resumed below
        runs.update({f"{impl}-saved": [f"zero.implementation={impl}", "train.precision=fp32",
                                       "checkpoint.interval=2"] + (["zero.stage=2"] if impl ==
                                                                   "fsdp" else [])
                     for impl in ("megatron", "fsdp")})
    if world == 4:
        runs.update({f"tp2-{impl}": [f"zero.implementation={impl}", "parallel.tensor=2"]
                     for impl in ("deepspeed", "megatron")})
        runs["tp2-fsdp"] = ["zero.stage=2", "parallel.tensor=2"]
    for name, overrides in runs.items():
        cfg = train_config(f"{root}/{name}", shards, *BUCKET, "train.tensorboard=false",
                           *overrides, steps=STEPS, global_batch=16, micro_batch=1)
        found[name] = _record(Trainer(cfg), recorder)
        found[name]["curve"] = curve(cfg.run_dir)[0] if rank == 0 else None
    for impl in ("megatron", "fsdp") if world == 2 else ():
        first = f"{root}/{impl}-saved"
        cfg = train_config(f"{root}/{impl}-resumed", shards, *BUCKET, "train.tensorboard=false",
                           f"zero.implementation={impl}", "train.precision=fp32",
                           *(["zero.stage=2"] if impl == "fsdp" else []),
                           f"resume={first}/checkpoints/step_0000002", steps=STEPS,
                           global_batch=16, micro_batch=1)
        t = Trainer(cfg)
        t.fit()
        found[f"{impl}-resumed"] = {"curve": curve(cfg.run_dir)[0] if rank == 0 else None}
    torch.save(found, out / f"w{world}-rank{rank}.pt")


@pytest.fixture(scope="module")
def runs(sonnets, tmp_path_factory):
    from mp_harness import spawn

    out = tmp_path_factory.mktemp("dp")
    found = {}
    for world in (2, 4, 8):
        spawn(_train, world, str(sonnets), str(out / f"w{world}"), out, world)
        found[world] = [torch.load(out / f"w{world}-rank{r}.pt") for r in range(world)]
    return found


@pytest.mark.parametrize("layout,precision", [("dp", "fp32"), ("dp", "bf16"), ("pp2", "fp32")])
def test_megatron_sends_the_same_collectives_at_every_dp_at_the_byte_bound(runs, layout,
                                                                           precision):
    """megatron: per step on the DP group, one reduce-scatter per bucket launched inside the
    backward and one all-gather per bucket inside the next forward (the same number at DP 2, 4
    and 8; with PP2 at DP 2 and 4, on each stage) and a few scalar
    all-reduces (tokens, loss, norm); their bytes within the reduce-scatter (fp32 gradients) +
    all-gather (the weights) bound. DeepSpeed's reduces and broadcasts grow with DP, at the
    same bytes."""
    e = 2 if precision == "bf16" else 4
    counts = {"megatron": {}, "deepspeed": {}}
    worlds = ((2, 4, 8) if precision == "fp32" else (2, 4)) if layout == "dp" else (4, 8)
    for world in worlds:
        for impl in counts:
            for found in runs[world]:
                info = found[f"{layout}-{impl}-{precision}"]
                dp, params = info["dp"], info["params"]
                assert dp == world // (1 if layout == "dp" else 2)
                bound = params * (4 + e) * (dp - 1) / dp
                if impl == "megatron":  # the timers read the device at log time only
                    assert info["device_waits"] and not any(info["device_waits"]), world
                for kinds, sent, tags in info["steps"]:
                    bulk = {k: n for k, n in kinds.items() if k != "all_reduce"}
                    counts[impl].setdefault((info["stage"], dp), set()).add(
                        tuple(sorted(bulk.items())))
                    moved = sum(v for k, v in sent.items() if k != "all_reduce")
                    assert bound * 0.999 <= moved <= bound * 1.01, (impl, world, sent, bound)
                    # (the scalars: tokens, loss, norm, overflow flags)
                    assert sent.get("all_reduce", 0) <= 64 * kinds.get("all_reduce", 0), sent
                    if impl == "megatron":  # launched inside the backward / the next forward
                        assert {t for k, t in tags if k == "reduce_scatter"} == {"backward"}
                        assert {t for k, t in tags if k == "all_gather"} <= {"forward",
                                                                             "param_gather"}
    print(f"\n{layout} {precision} collectives per step on the DP group (stage, DP): {counts}")
    for stage in {s for s, _ in counts["megatron"]}:
        mega = {dp: v for (s, dp), v in counts["megatron"].items() if s == stage}
        assert len({frozenset(v) for v in mega.values()}) == 1, mega  # the same at every DP
        (only,) = next(iter(mega.values()))
        kinds = dict(only)
        assert set(kinds) == {"reduce_scatter", "all_gather"}
        assert kinds["reduce_scatter"] == kinds["all_gather"] >= 1
        ds = {dp: sum(n for _, n in next(iter(v)))
              for (s, dp), v in counts["deepspeed"].items() if s == stage}
        low, high = min(ds), max(ds)
        assert ds[low] < ds[high], ds
    if layout == "dp":  # several buckets each way on the one stage
        assert dict(next(iter(counts["megatron"][0, 2])))["reduce_scatter"] >= 2


def test_megatron_follows_deepspeeds_fp32_losses_and_resumes_exactly(runs):
    for world, layout in ((2, "dp"), (4, "dp"), (8, "dp"), (4, "pp2"), (8, "pp2")):
        ds = runs[world][0][f"{layout}-deepspeed-fp32"]["curve"]
        mg = runs[world][0][f"{layout}-megatron-fp32"]["curve"]
        assert len(mg) == STEPS and mg == pytest.approx(ds, rel=1e-6, abs=1e-6), (world, ds, mg)
    tp_ds, tp_mg = runs[4][0]["tp2-deepspeed"]["curve"], runs[4][0]["tp2-megatron"]["curve"]
    assert tp_mg == pytest.approx(tp_ds, rel=1e-6, abs=1e-6)
    # bf16: the same fp32 accumulation and reduction, in another order
    for world in (2, 4):
        assert runs[world][0]["dp-megatron-bf16"]["curve"] == pytest.approx(
            runs[world][0]["dp-deepspeed-bf16"]["curve"], rel=0.02)
    resumed = runs[2][0]["megatron-resumed"]["curve"]
    assert resumed == runs[2][0]["megatron-saved"]["curve"][2:]


def test_fsdp_sends_the_same_collectives_at_every_dp_at_the_byte_bound(runs):
    """FSDP (ZeRO-2): per step on the DP group, one all-gather per unit (each decoder layer and
    the rest of the model) in the step's first forward and one reduce-scatter per unit and
    micro-batch in the backward, whatever DP is (the micro-batches of a fixed global batch fall
    as DP grows, as DeepSpeed's ZeRO-2 reduces every micro-batch too); their bytes within the
    bound: the weights gathered once (in the compute dtype), the fp32 gradients reduce-scattered
    per micro-batch. The timers never wait for the device inside a step."""
    for precision, e in (("fp32", 4), ("bf16", 2)):
        per_unit = set()
        for world in (2, 4, 8) if precision == "fp32" else (2, 4):
            micro = 16 // world
            for found in runs[world]:
                info = found[f"dp-fsdp-{precision}"]
                dp, params = info["dp"], info["params"]
                assert dp == world
                assert info["device_waits"] and not any(info["device_waits"]), world
                bound = params * (4 * micro + e) * (dp - 1) / dp
                for kinds, sent, tags in info["steps"]:
                    bulk = {k: n for k, n in kinds.items() if k != "all_reduce"}
                    assert set(bulk) == {"reduce_scatter", "all_gather"}, kinds
                    assert bulk["reduce_scatter"] == bulk["all_gather"] * micro, (world, kinds)
                    per_unit.add(bulk["all_gather"])
                    moved = sum(v for k, v in sent.items() if k != "all_reduce")
                    # (the last ranks' shards are padded to equal sizes: a few rows more)
                    assert bound * 0.999 <= moved <= bound * 1.05, (world, sent, bound)
                    assert sent.get("all_reduce", 0) <= 64 * kinds.get("all_reduce", 0), sent
                    assert {t for k, t in tags if k == "reduce_scatter"} == {"backward"}
                    assert {t for k, t in tags if k == "all_gather"} == {"forward"}
        print(f"\nfsdp {precision}: {per_unit} all-gathers per step at DP 2, 4, 8")
        assert len(per_unit) == 1 and next(iter(per_unit)) >= 3  # (2 layers and the rest)


def test_fsdp_follows_deepspeeds_fp32_losses_and_resumes_exactly(runs):
    """FSDP's ZeRO-2 and DeepSpeed's ZeRO-1 run the same fp32 AdamW: the same losses (1e-6) on
    DP 2, 4, 8 and TP2 x DP2; bf16 within 2% (DP 2 and 4); a resume at step 2 continues
    bit-exactly."""
    for world in (2, 4, 8):
        ds = runs[world][0]["dp-deepspeed-fp32"]["curve"]
        fs = runs[world][0]["dp-fsdp-fp32"]["curve"]
        assert len(fs) == STEPS and fs == pytest.approx(ds, rel=1e-6, abs=1e-6), (world, ds, fs)
        if world < 8:
            assert runs[world][0]["dp-fsdp-bf16"]["curve"] == pytest.approx(
                runs[world][0]["dp-deepspeed-bf16"]["curve"], rel=0.02)
    assert runs[4][0]["tp2-fsdp"]["curve"] == pytest.approx(runs[4][0]["tp2-deepspeed"]["curve"],
                                                            rel=1e-6, abs=1e-6)
    assert runs[2][0]["fsdp-resumed"]["curve"] == runs[2][0]["fsdp-saved"]["curve"][2:]
