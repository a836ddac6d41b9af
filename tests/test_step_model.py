"""The step-time model of the dry run (setdiff_dist.train.scale): NCCL's alpha-beta costs, the
collectives each data-parallel scheme issues, the GPU's memory terms, its sourced constants,
and its agreement with the MFU Megatron-LM and torchtitan publish. Pure logic, in-process."""

import json
import os
import sys

import pytest

from setdiff_dist.train import scale
from setdiff_dist.train.scale import HARDWARE, System, collective_seconds

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
H100 = HARDWARE["h100"]


def _cfg(*overrides, model="1.3b"):
    from setdiff_dist.config import load_config

    return load_config(os.path.join(ROOT, "configs", "models", f"{model}.yaml"), [
        "data.seq_len=2048", "data.micro_batch_size=1", "train.precision=bf16",
        "zero.stage=1", *overrides])


def test_a_collective_costs_a_latency_per_hop_and_its_bytes_over_the_bus():
    small, big = 64 * 1024, 1 << 30
    # one node: NVLink; latency grows with the ranks of the ring
    t8, algo = collective_seconds("reduce_scatter", small, 8, 1, H100)
    t1024, _ = collective_seconds("reduce_scatter", small, 1024, 128, H100)
    assert algo.startswith("ring/") and t1024 > 50 * t8
    # large: bandwidth-bound at the bus bandwidth (NVLink x 0.8 inside a node)
    t, algo = collective_seconds("all_gather", big, 8, 1, H100)
    assert algo == "ring/Simple"
    assert t == pytest.approx(7 / 8 * big / (450e9 * 0.8) + (8.4 + 7 * 3.4) * 1e-6, rel=1e-6)
    # small all-reduces over many nodes take the tree (log2 of the nodes, not the ranks)
    assert collective_seconds("all_reduce", 4096, 1024, 128, H100)[1].startswith("tree/")


def test_a_group_across_nodes_gets_a_nic_per_gpu_it_has_in_each_node():
    """TP1: a DP ring's 8 GPUs per node drive 8 NICs in parallel (NVLink-bound); TP8: one."""
    per_gpu = scale._bus_bandwidth(16, 2, H100)
    one_nic = scale._bus_bandwidth(16, 16, H100)
    assert per_gpu == pytest.approx(min(450e9 * 0.8, 8 * 50e9 * 0.9))
    assert one_nic == pytest.approx(50e9 * 0.9)


@pytest.mark.parametrize("zero", ["1", "2"])
def test_per_owner_collectives_grow_with_dp_and_bucket_sharded_ones_do_not(zero):
    """DeepSpeed's ZeRO-1/2 path: a reduce per (bucket, owner) and a broadcast per (owner,
    bucket), so the count grows with DP; the bucket-sharded path issues one reduce-scatter and
    one all-gather per bucket whatever DP is (buckets of 40M elements hold to 40 ranks), with
    the same reduce-scatter + all-gather bytes per rank."""
    from setdiff_dist.train.plan import plan

    counts = {}
    for dp in (8, 16, 32):
        cfg = _cfg(f"zero.stage={zero}", f"data.global_batch_size={dp}")
        p = plan(cfg, dp)
        for scheme in ("per_owner", "bucket_sharded"):
            system = System("t", dp=scheme, bucket=cfg.zero.reduce_bucket_size)
            flows = [f for f in scale.step_flows(cfg, p, 0, system=system) if f.group == "data"]
            params = p.stages[0].params
            bound = (4 + 2) * params * (dp - 1) / dp   # fp32 RS + bf16 AG per rank
            assert sum(f.wire for f in flows) == pytest.approx(bound, rel=1e-6)
            counts[scheme, dp] = sum(f.calls for f in flows)
    assert counts["per_owner", 8] < counts["per_owner", 16] < counts["per_owner", 32]
    assert counts["bucket_sharded", 8] == counts["bucket_sharded", 16] == \
        counts["bucket_sharded", 32] == 2 * 34   # 1.34B / 40M buckets, both ways


def test_at_1024_gpus_deepspeeds_zero1_is_latency_bound_and_the_default_is_not():
    """1.3B on 1024 H100s: DeepSpeed's ZeRO-1 (the default before issue 50) sends ~2,080
    reduces and 2,048 broadcasts per step, seconds of exposed latency; the default now
    (megatron's bucket-sharded distributed optimizer): a handful of collectives."""
    from setdiff_dist.train.plan import plan

    cfg = _cfg("data.global_batch_size=1024", "zero.implementation=deepspeed")
    p = plan(cfg, 1024, "h100")
    before = p.predict(cfg, "h100")
    default = _cfg("data.global_batch_size=1024")
    after = p.predict(default, "h100")
    assert after.system.dp == "bucket_sharded" and after.system.bucket == 40e6
    grads = before.comm["gradient reduce-scatter"]
    assert 2000 <= grads[3] <= 2200 and before.comm["parameter all-gather"][3] == 2048
    assert before.exposed > 1.0 and after.exposed < 0.1 and after.collectives <= 8
    assert after.mfu > 10 * before.mfu
    table = before.table()
    for text in ("collectives per step: 4,1", "start-up:", "process groups", "compute: gemm"):
        assert text in table


def test_every_constant_has_a_source_and_a_measured_file_overrides_the_fitted_ones(
        tmp_path, monkeypatch):
    assert all(c.source and c.unit for c in scale.CONSTANTS.values())
    base = scale.const("gemm.efficiency")
    path = tmp_path / "efficiency.json"
    path.write_text(json.dumps({"constants": {"gemm.efficiency": base / 2}}))
    monkeypatch.setenv("SETDIFF_EFFICIENCY", str(path))
    assert scale.const("gemm.efficiency") == base / 2
    assert "gemm.efficiency" in scale.constants_table()
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"constants": {"gemm.speed": 1}}))
    monkeypatch.setenv("SETDIFF_EFFICIENCY", str(bad))
    with pytest.raises(ValueError, match="unknown constants gemm.speed"):
        scale.const("gemm.efficiency")


def test_a_gpu_plan_adds_the_runtime_and_uses_fused_norms():
    from setdiff_dist.train.plan import plan

    cfg = _cfg("data.global_batch_size=8", "parallel.tensor=2")
    cpu, gpu = plan(cfg, 8).stages[0], plan(cfg, 8, "h100").stages[0]
    assert cpu.runtime == 0 and gpu.runtime > scale.const("memory.cuda_context")
    assert gpu.activations < cpu.activations        # fused norms keep less
    assert gpu.weights == cpu.weights and gpu.optimizer == cpu.optimizer
    assert "runtime" in plan(cfg, 8, "h100").table(80)


def test_the_model_is_within_15_percent_of_every_published_mfu():
    """benchmarks/scale_model.py's published rows: Megatron-LM's H100 table (1.7B-70B) and
    torchtitan's Llama 3 8B FSDP runs, each run's system and FLOP convention."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import scale_model
    finally:
        sys.path.pop(0)
    rows = scale_model.published_rows({})
    assert len(rows) == 7
    for r in rows:
        assert abs(r["error"]) <= 0.15, r
