"""The scale model (setdiff_dist.train.scale) against what the training path really sends: the
bytes a recording wrapper of torch.distributed counted in each step of the session's layout
runs (conftest.layouts, helpers.fit_layouts), rank by rank, equal the model's prediction for
that rank's pipeline stage within 5%. No training launch of its own."""

import json

import pytest
from helpers import LAYOUTS, REFERENCE_STEPS, train_config

from setdiff_dist.train.scale import HARDWARE, step_flows, wire_bytes

pytestmark = pytest.mark.multiprocess

# DP2, TP2 (with and without sequence parallelism), PP2, CP2 (alone, in bf16, with TP2, with PP2,
# and the causal LM's), TP2 x PP2, ZeRO-2, fp32 and bf16
CHECKED = ("bf16", "tp2", "tp2-sp", "pp2", "bf16-pp2", "cp2", "bf16-cp2", "cp2-tp2", "cp2-pp2",
           "causal-cp2", "zero2", "bf16-tp2xpp2", "bf16-tp2xpp2-sp")
WORLD = {name: world for world, group in LAYOUTS.items() for name, _ in group}
OVERRIDES = {name: o for group in LAYOUTS.values() for name, o in group}


def _predicted(name, shards, tmp_path):
    """{rank: bytes per step} of the scale model for the layout ``name``."""
    from setdiff_dist.train.plan import plan

    world = WORLD[name]
    cfg = train_config(tmp_path / name, shards, *OVERRIDES[name], steps=REFERENCE_STEPS)
    p = plan(cfg, world)
    per_stage = world // cfg.parallel.pipeline  # (megatron's rank order: stages are blocks)
    return {rank: sum(f.wire for f in step_flows(cfg, p, rank // per_stage, "gloo"))
            for rank in range(world)}


@pytest.mark.parametrize("name", CHECKED)
def test_the_bytes_each_rank_sends_per_step_are_the_scale_models(layouts, sonnets, tmp_path,
                                                                  name):
    root = layouts[2]
    predicted = _predicted(name, sonnets, tmp_path)
    for rank, want in predicted.items():
        with open(root / "comm" / f"{name}.rank{rank}.json") as fh:
            steps = json.load(fh)
        assert len(steps) == REFERENCE_STEPS
        # (the first step also sets up what persists; the last one's window has the final
        # validation)
        for step, sent in enumerate(steps[1:-1], 2):
            got = sum(sent.values())
            assert got == pytest.approx(want, rel=0.05), (name, rank, step, sent, want)


def test_wire_bytes_follow_the_ring_algorithms():
    assert wire_bytes("all_reduce", 100, 4) == 150
    assert wire_bytes("reduce_scatter", 100, 4) == wire_bytes("all_gather", 100, 4) == 75
    assert wire_bytes("all_reduce", 100, 1) == 0 and wire_bytes("send", 100, 2) == 100


def test_the_dry_run_predicts_the_overlap_halves_the_exposed_reduction():
    """1.3B at 64 H100s, 1M tokens, DeepSpeed's ZeRO-1: the reduction after the backward sends
    twice the bytes of the overlapped reduce-scatter, all exposed; the parameter gather hides
    partly behind the next forward; the overlap exposes less and so predicts a higher MFU;
    every table row is there."""
    from setdiff_dist.config import load_config
    from setdiff_dist.train.plan import plan

    rows = {}
    for overlap in ("false", "true"):
        cfg = load_config("configs/models/1.3b.yaml", [
            "data.seq_len=2048", "data.micro_batch_size=1", "data.global_batch_size=512",
            "train.precision=bf16", f"zero.overlap_comm={overlap}",
            "zero.implementation=deepspeed"])
        rows[overlap] = plan(cfg, 64).predict(cfg, "h100")
    before, after = rows["false"], rows["true"]
    assert before.comm["gradient all-reduce"][0] == pytest.approx(
        2 * after.comm["gradient reduce-scatter"][0], rel=1e-6)
    # the parameters' gather: the same bytes, in the owners' broadcasts during the next forward
    gather_before, gather_after = before.comm["parameter all-gather"], \
        after.comm["parameter all-gather"]
    assert gather_after[0] == pytest.approx(gather_before[0], rel=1e-6)
    assert gather_before[2] == 0 and 0 < gather_after[2] < gather_after[1]
    assert after.exposed < before.exposed and after.mfu > before.mfu
    assert after.compute == before.compute and 0 < after.mfu < 1
    table = after.table()
    for text in ("64 x H100 SXM", "gradient reduce-scatter", "parameter all-gather", "MFU"):
        assert text in table
    assert set(HARDWARE) == {"h100", "h200", "b200"}
