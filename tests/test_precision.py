"""The precision x layout matrix on gloo ranks: bf16 trains on every layout and follows the
single-rank bf16 curve; gradients accumulate and reduce in fp32 under bf16, on the DeepSpeed
path and on megatron's pipeline schedule alike; what cannot work is refused at start.

(fp32 curves across layouts, which must match to the last bits, are in test_train.py.)"""

import os

import pytest
import torch
from helpers import REFERENCE_STEPS, cli, train_command

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def shards(sonnets):
    return sonnets


BF16 = {"dp2-zero1": "bf16", "dp2-zero2": "bf16-zero2", "dp2-zero3": "bf16-zero3",
        "tp2": "bf16-tp2", "pp2": "bf16-pp2",  # PP2: crashed at step 1 once
        "tp2xpp2": "bf16-tp2xpp2", "tp2xpp2-sp": "bf16-tp2xpp2-sp", "cp2": "bf16-cp2"}


@pytest.mark.parametrize("layout", sorted(BF16))
def test_bf16_follows_the_single_rank_curve_on_every_layout(layouts, layout):
    """(conftest.layouts: every layout trained in-process, one spawn per world size.)"""
    losses, _ = layouts[0][BF16[layout]]
    single_rank_bf16, _ = layouts[0]["bf16-dp1"]
    assert len(losses) == REFERENCE_STEPS and all(map(torch.isfinite, torch.tensor(losses)))
    assert losses == pytest.approx(single_rank_bf16, rel=0.02)
    assert losses[-1] < losses[0] - 0.5  # it learns


def _trainer(shards, run_dir, *overrides):
    """A Trainer of the tiny model on the sonnet shards, inside a spawned rank."""
    from setdiff_dist.config import load_config
    from setdiff_dist.train.loop import Trainer

    return Trainer(load_config("configs/tiny-cpu.yaml", [
        f"run_dir={run_dir}", "resume=never", f"data.train_shards={shards}", "data.seq_len=32",
        "model.vocab_size=257", "data.global_batch_size=8", "data.micro_batch_size=2",
        "train.tensorboard=false", "optimizer.warmup_steps=0", *overrides]))


def _accumulators(rank, shards, run_root, out):
    """Build bf16 trainers at ZeRO 1/2/3 (DP2) and PP2, DeepSpeed's with the overlapped
    reduction and without, and megatron's (the ZeRO-1 default), and report where gradients
    accumulate."""
    from megatron.core import parallel_state as ps

    from setdiff_dist.model.pipeline import forward_backward
    from setdiff_dist.train.engine import GradientSync

    found = {}
    no_overlap = "zero.overlap_comm=false"
    ds = "zero.implementation=deepspeed"
    for name, overrides in (("zero1", ["zero.stage=1", ds]), ("zero1-after", [no_overlap, ds]),
                            ("zero2", ["zero.stage=2", ds]), ("zero3", ["zero.stage=3"]),
                            # the default at ZeRO-2: torch's FSDP2
                            ("fsdp", ["zero.stage=2"]),
                            ("pp2", ["parallel.pipeline=2", ds]),
                            ("pp2-after", ["parallel.pipeline=2", no_overlap, ds]),
                            # the default at ZeRO-1: megatron-core's DDP + distributed optimizer
                            ("megatron", []), ("megatron-pp2", ["parallel.pipeline=2"])):
        t = _trainer(shards, f"{run_root}/{name}", "train.precision=bf16", *overrides)
        cfg = t.cfg
        opt = t.engine.optimizer
        weights = {p.dtype for p in t.engine.module.parameters()}
        info = {"optimizer": type(opt).__name__}
        if name == "fsdp":  # fp32 shards (the master weights), computed in bf16, reduced in fp32
            policy = t.engine.mp_policy
            info.update(accumulator={str(policy.reduce_dtype)},
                        communication=str(policy.reduce_dtype), masters={str(d) for d in weights})
            weights = {policy.param_dtype}
        elif name.startswith("megatron"):
            ddp = t.engine.ddp
            info.update(accumulator={str(p.main_grad.dtype)
                                     for p in t.engine.module.parameters()},
                        communication="torch.float32" if ddp.ddp_config.grad_reduce_in_fp32
                        else "torch.bfloat16", overlap=ddp.ddp_config.overlap_grad_reduce)
        elif info["optimizer"] == "BF16_Optimizer":
            info.update(accumulator={str(g.dtype) for g in opt.fp32_groups_gradients_flat},
                        immediate=opt.immediate_grad_update)
        elif name != "zero3":
            info.update(accumulator={str(opt.gradient_accumulation_dtype)},
                        communication=str(opt.communication_data_type),
                        grad_accum=opt.use_grad_accum_attribute, overlap=opt.overlap_comm)
        else:
            info["accumulator"] = {str(opt.grad_partitions_flat_buffer.dtype)}
        info["weights"] = {str(d) for d in weights}
        if name.endswith(("pp2", "pp2-after")):
            # megatron's 1F1B schedule runs the backward itself (not engine.backward): the bf16
            # gradients must still land in fp32, micro-batch by micro-batch, and (overlapped)
            # be reduced once, from the last micro-batch's backward and the tied embedding's
            batches = [b.to(t.device) for b in next(iter(t.loader(0)))]
            forward_backward(t.engine.module, batches, t.objective.model_seq_len,
                             cfg.data.micro_batch_size, t.objective.step, loss_scale=1.0,
                             sync=GradientSync(t.engine))
            t.engine.allreduce_gradients()
            info["bf16_grads_left"] = sum(p.grad is not None
                                          for p in t.engine.module.parameters())
            if name.startswith("megatron"):
                t.engine.ddp.finish_grad_sync()  # (the reduce-scatters the backward started)
                fp32 = [p.main_grad for p in t.engine.module.parameters()]
            else:
                fp32 = opt.fp32_groups_gradients_flat if name == "pp2-after" else \
                    [g.flat_partition for g in opt.averaged_gradients.values()]
            info["fp32_dtypes"] = {str(g.dtype) for g in fp32}
            info["fp32_grad_norm"] = float(torch.stack([g.norm() for g in fp32]).norm())
            info["stage"] = ps.get_pipeline_model_parallel_rank()
        found[name] = info
    torch.save(found, out / f"rank{rank}.pt")


def _probes(rank, shards, run_root, out):
    """The two probes of trainers on two ranks, in one spawn."""
    _accumulators(rank, shards, run_root, out)
    _first_microbatch_events(rank, shards, run_root, out)


@pytest.fixture(scope="module")
def probes(shards, tmp_path_factory):
    from mp_harness import spawn

    out = tmp_path_factory.mktemp("probes")
    spawn(_probes, 2, str(shards), str(out / "runs"), out)
    return out


def test_bf16_gradients_accumulate_in_fp32_on_every_path(probes):
    for rank in (0, 1):
        found = torch.load(probes / f"rank{rank}.pt")
        for name, info in found.items():
            assert info["weights"] == {"torch.bfloat16"}, (name, info)  # bf16 compute
            assert info["accumulator"] == {"torch.float32"}, (name, info)
        after = found["zero1-after"]
        assert after["optimizer"] == "BF16_Optimizer" and after["immediate"]
        for name in ("zero1", "zero2", "pp2"):  # the ZeRO optimizer, overlapped
            assert found[name]["optimizer"] == "DeepSpeedZeroOptimizer", name
            assert found[name]["communication"] == "torch.float32" and found[name]["overlap"]
        assert found["zero1"]["grad_accum"]  # (stage 2 accumulates in its fp32 partitions)
        fsdp = found["fsdp"]
        assert fsdp["optimizer"] == "AdamW" and fsdp["masters"] == {"torch.float32"}
        assert fsdp["communication"] == "torch.float32"
        for name in ("megatron", "megatron-pp2"):  # fp32 main_grad buffers, reduced in fp32
            assert found[name]["optimizer"] == "ChainedOptimizer", name
            assert found[name]["communication"] == "torch.float32" and found[name]["overlap"]
        for name in ("pp2", "pp2-after", "megatron-pp2"):
            assert found[name]["bf16_grads_left"] == 0, name
            assert found[name]["fp32_dtypes"] == {"torch.float32"}, name
            assert found[name]["fp32_grad_norm"] > 0, name


@pytest.mark.parametrize("overrides,message", [
    (["train.precision=bf16", "zero.stage=0"], "use zero.stage=1"),
    (["parallel.pipeline=2", "parallel.virtual_pipeline=2"],
     "parallel.virtual_pipeline=2: the interleaved 1F1B schedule is not wired"),
    (["parallel.sequence_parallel=true"], "parallel.sequence_parallel=true needs parallel.tensor"),
    (["parallel.tensor=2", "parallel.sequence_parallel=true", "data.seq_len=31",
      "order.kind=causal"], "it must divide it"),
], ids=["bf16-zero0", "virtual-pipeline", "sequence-parallel-tp1", "sequence-parallel-odd"])
def test_what_cannot_work_is_refused_at_start(shards, tmp_path, overrides, message, capsys):
    """setdiff-train --nproc-per-node 2, in this process: refused before any rank starts."""
    code, err = cli("setdiff_dist.cli.train",
                    train_command(tmp_path, shards, *overrides, nproc=2, steps=2)[3:], capsys)
    assert code == 2, err
    assert message in err and "Traceback" not in err
    assert not os.path.exists(tmp_path / "metrics.jsonl")


def _recompute(rank, out):
    from helpers import tiny_nelbo_step

    from setdiff_dist.parallel import cpu_compat, initialize_model_parallel

    initialize_model_parallel(seed=0, backend="gloo")
    found = {}
    for backend in ("sdpa", "permuted_causal"):
        for mode, layers in (("none", 1), ("selective", 1), ("full", 1), ("full", 2)):
            # dropout on: a recomputed forward must replay the same masks
            torch.manual_seed(7)
            cpu_compat.seed_model_parallel_rng(7)
            dropout = ["model.hidden_dropout=0.1"] + (
                ["model.attention_dropout=0.1"] if backend == "sdpa" else [])
            found[backend, mode, layers] = tiny_nelbo_step(
                backend, device="cpu", overrides=dropout, recompute=mode,
                recompute_num_layers=layers)
    torch.manual_seed(8)
    cpu_compat.seed_model_parallel_rng(8)
    found["other seed"] = tiny_nelbo_step("sdpa", device="cpu", overrides=[
        "model.hidden_dropout=0.1", "model.attention_dropout=0.1"])
    torch.save(found, out / "recompute.pt")
    # megatron's fused SwiGLU (the default: it keeps fc1's output only) against autograd's
    torch.save({fused: tiny_nelbo_step("sdpa", device="cpu", fused_activation=fused)
                for fused in (True, False)}, out / "swiglu.pt")


def test_activation_recompute_gives_identical_gradients(tmp_path):
    from mp_harness import spawn

    spawn(_recompute, 1, tmp_path)
    found = torch.load(tmp_path / "recompute.pt")
    other_seed = found.pop("other seed")[0]
    for (backend, mode, layers), (nll, grads) in found.items():
        ref_nll, ref_grads = found[backend, "none", 1]
        assert torch.equal(nll, ref_nll), (backend, mode, layers)
        for name, g in ref_grads.items():
            assert torch.equal(grads[name], g), (backend, mode, layers, name)
    # dropout was on (another seed gives another loss): the recomputed forwards replayed it
    assert not torch.equal(other_seed, found["sdpa", "none", 1][0])
    (fused_nll, fused), (nll, unfused) = torch.load(tmp_path / "swiglu.pt").values()
    assert torch.equal(fused_nll, nll)  # the same forward
    for name, g in unfused.items():  # the backward: the analytic derivative, fp32 rounding
        assert torch.allclose(fused[name], g, rtol=1e-5, atol=1e-7), name


def _first_microbatch_events(rank, shards, run_root, out):
    """Record, as TE's layers would see it, when set_is_first_microbatch is called relative to
    the forwards of each step, on the plain and the pipeline path."""
    found = {}
    for name, overrides in (("dp2", []), ("pp2", ["parallel.pipeline=2"])):
        t = _trainer(shards, f"{run_root}/events-{name}", "train.eval_batches=1", *overrides)
        events = []
        module = t.engine.module
        module.set_is_first_microbatch = lambda events=events: events.append("first")
        module.register_forward_pre_hook(lambda *_, events=events: events.append("forward"))
        for _, batches in zip(range(2), t.loader(0)):
            events.append("step")
            t.train_step(batches)
        events.append("eval")
        t.evaluate()
        found[name] = events
    torch.save(found, out / f"events{rank}.pt")


def test_transformer_engine_first_microbatch_flag_is_set_once_per_step(probes):
    """TE casts its FP8 weight copies on a step's first micro-batch only; without the flag it
    would reuse step 1's forever (a recording stand-in: TE itself needs a GPU)."""
    events = torch.load(probes / "events0.pt")
    # DP2: 2 micro-batches per rank and step, each step starts with the flag; validation (one
    # global batch: 2 micro-batches per rank) starts with it too
    assert events["dp2"] == ["step", "first", "forward", "forward"] * 2 + \
        ["eval", "first", "forward", "forward"]
    # PP2: megatron's 1F1B sets it before the first of the 4 micro-batches of each step
    pp = events["pp2"]
    steps = " ".join(pp).split("step ")[1:]
    assert all(s.split()[0] == "first" and s.split().count("first") == 1 for s in steps[:-1])
    assert pp[pp.index("eval") + 1] == "first"


def test_transformer_engine_names_map_to_the_layout_free_names():
    """Checkpoints, exports, --to-hf, init_from_hf and the seeded init all go through one name
    map; TE's fused norm weights take the local spec's names there."""
    from setdiff_dist.model.transformer import layout_free_name

    te = {"decoder.layers.0.self_attention.linear_qkv.layer_norm_weight":
          "decoder.layers.4.input_layernorm.weight",
          "decoder.layers.0.self_attention.linear_qkv.layer_norm_bias":
          "decoder.layers.4.input_layernorm.bias",
          "decoder.layers.0.mlp.linear_fc1.layer_norm_weight":
          "decoder.layers.4.pre_mlp_layernorm.weight",
          "decoder.layers.0.mlp.linear_fc1.weight": "decoder.layers.4.mlp.linear_fc1.weight",
          "decoder.layers.0.self_attention.q_layernorm.weight":
          "decoder.layers.4.self_attention.q_layernorm.weight"}
    for local, expected in te.items():
        assert layout_free_name(local, global_layer=4) == expected
    assert layout_free_name("output_layer.weight", tied=True) == "embedding.weight"
    assert layout_free_name("output_layer.weight") == "output_layer.weight"


def _te_style_tp_attributes(rank, out):
    """A stand-in with TE's ``parallel_mode`` attribute gets megatron's TP attributes, a gated
    fc1 with stride 2, so its shards merge as [gate ; up]."""
    from setdiff_dist.model import transformer as T
    from setdiff_dist.parallel import initialize_model_parallel

    initialize_model_parallel(tensor=2, seed=0, backend="gloo")

    class TELikeLinear(torch.nn.Module):
        def __init__(self, mode, rows, cols):
            super().__init__()
            self.parallel_mode = mode
            self.weight = torch.nn.Parameter(torch.zeros(rows, cols))

    class Holder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.config = type("C", (), {"gated_linear_unit": True})()
            self.linear_fc1 = TELikeLinear("column", 8, 4)
            self.linear_fc2 = TELikeLinear("row", 4, 4)

    h = Holder()
    T._mark_tensor_parallel(h)
    w1, w2 = h.linear_fc1.weight, h.linear_fc2.weight
    gate, up = torch.arange(16.).reshape(8, 2), 100 + torch.arange(16.).reshape(8, 2)
    full = torch.cat([gate, up])
    shards = [T.split_shard(full, r, 2, w1.partition_dim, w1.partition_stride) for r in range(2)]
    torch.save({"fc1": (w1.tensor_model_parallel, w1.partition_dim, w1.partition_stride),
                "fc2": (w2.tensor_model_parallel, w2.partition_dim, w2.partition_stride),
                "rank0": shards[0], "merged": T.merge_shards(shards, 0, 2), "full": full},
               out / f"tp{rank}.pt")


def test_te_linears_get_tensor_parallel_attributes(tmp_path):
    from mp_harness import spawn

    spawn(_te_style_tp_attributes, 2, tmp_path)
    found = torch.load(tmp_path / "tp0.pt")
    assert found["fc1"] == (True, 0, 2) and found["fc2"] == (True, 1, 1)
    assert torch.equal(found["rank0"], torch.cat([found["full"][:4], found["full"][8:12]]))
    assert torch.equal(found["merged"], found["full"])


def test_partial_gradients_are_summed_over_tensor_parallel_ranks(layouts):
    """QK-norm weights (each TP rank normalizes its own heads) and, under sequence parallelism,
    every norm (each rank sees its slice of the tokens) get partial gradients per TP rank; they
    are summed over the group, as megatron's finalize_model_grads does (under FSDP's ZeRO-2 once,
    after the reduce-scatter). Without it the TP=2 curves drift from TP=1 in the 6th digit and
    the replicated copies diverge."""
    from safetensors.torch import load_file

    found, _, root = layouts
    names = ("tp2", "tp2-sp", "tp2-sp-fsdp")
    curves = {name: found[f"qk-{name}"][0] for name in ("tp1", *names)}
    for name in names:
        assert curves[name] == pytest.approx(curves["tp1"], rel=2e-6, abs=0), name
    for name in names:
        ckpt = root / f"qk-{name}" / "checkpoints"
        weights = ckpt / (ckpt / "latest").read_text().strip() / "weights"
        a, b = (load_file(weights / f"tp0{r}_pp00.safetensors") for r in (0, 1))
        replicated = [k for k in a if "layernorm" in k]
        assert any("q_layernorm" in k for k in replicated)
        for key in replicated:
            assert torch.equal(a[key], b[key]), (name, key)


def test_a_cast_model_keeps_its_rotary_frequencies_in_float32():
    """``model.to(dtype=torch.bfloat16)`` (the GPU script's backend checks do this) casts the
    weights; the rotary frequencies stay the float32 ones of the config, not bf16 roundings
    that move the angles of far positions by radians."""
    from helpers import process_group

    from setdiff_dist.config import load_config
    from setdiff_dist.model.dims import rotary_inv_freq
    from setdiff_dist.model.transformer import build_model, transformer_config

    cfg = load_config(None, ["model.num_layers=1", "model.hidden_size=64",
                             "model.num_attention_heads=2", "model.num_query_groups=2",
                             "model.vocab_size=64", "model.rotary_base=500000"]).model
    with process_group("gloo"):
        model = build_model(cfg, transformer_config(cfg, compute_dtype=torch.bfloat16), seed=0)
        want = rotary_inv_freq(cfg, 32)
        assert torch.equal(model.inv_freq, want)
        model.to(dtype=torch.bfloat16)
        assert next(model.parameters()).dtype == torch.bfloat16
        assert model.inv_freq.dtype == torch.float32 and torch.equal(model.inv_freq, want)
        assert not torch.equal(want.bfloat16().float(), want)  # (what the cast would have kept)
