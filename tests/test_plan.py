"""``setdiff-train --dry-run``: megatron's layout of a large world on the meta device under a
fake process group, checked without a GPU (the memory figures against a real run are in
benchmarks/plan_vs_measured.py)."""

import time

import pytest


def test_a_64_rank_8b_layout_is_planned_in_seconds_and_its_stages_sum_to_the_model():
    from setdiff_dist.config import load_config
    from setdiff_dist.train.plan import plan

    cfg = load_config("configs/models/8b.yaml", [
        "parallel.tensor=8", "parallel.pipeline=4", "train.precision=bf16", "data.seq_len=2048",
        "data.micro_batch_size=1", "data.global_batch_size=64"])
    start = time.perf_counter()
    p = plan(cfg, 64)
    assert time.perf_counter() - start < 60
    assert (p.tensor, p.pipeline, p.data, p.micro_batches) == (8, 4, 2, 32)
    assert [s.layers for s in p.stages] == [8, 8, 8, 8]
    assert sum(s.model_params for s in p.stages) == p.model_params
    assert 8.0e9 < p.model_params < 8.1e9  # Llama-3-8B's 8.03B
    # the first stage holds the embedding, the last the output layer: both bigger than the middle
    first, middle, _, last = p.stages
    assert first.params > middle.params and last.params > middle.params
    # a TP rank holds an eighth of its stage (the norms are replicated: a little more)
    assert middle.params * 8 == pytest.approx(middle.model_params, rel=1e-3)
    # ZeRO-1 shards the optimizer state over the 2 data-parallel ranks; 1F1B keeps more
    # micro-batches in flight on the first stage than on the last
    assert middle.optimizer == pytest.approx(12 * middle.params / 2)
    assert first.activations > last.activations


def test_a_dp_change_moves_optimizer_memory_and_zero3_shards_the_weights():
    from setdiff_dist.config import load_config
    from setdiff_dist.train.plan import plan

    cfg = load_config("configs/models/1.3b.yaml", ["zero.stage=3", "data.global_batch_size=8",
                                                    "data.micro_batch_size=1"])
    one, eight = plan(cfg, 1).stages[0], plan(cfg, 8).stages[0]
    assert eight.weights == pytest.approx(one.weights / 8)
    assert eight.optimizer == pytest.approx(one.optimizer / 8)


def _dry_run(*args):
    """setdiff-train --dry-run, in this process (it builds its own fake process group)."""
    from helpers import run_cli

    return run_cli("setdiff_dist.cli.train", "--dry-run", *args)


def test_the_dry_run_flags_what_does_not_fit_and_layouts_that_cannot_run():
    res = _dry_run("--world-size", "4", "--device-memory", "0.5", "--config",
                   "configs/models/110m.yaml", "parallel.tensor=2", "data.global_batch_size=16")
    assert res.returncode == 2, res.stderr[-2000:]
    assert "OUT OF MEMORY" in res.stdout and "stages over the 0.5 GiB per device: 0" in res.stdout
    assert "TP 2 x PP 1 x DP 2" in res.stdout
    res = _dry_run("--world-size", "6", "--config", "configs/models/110m.yaml",
                   "parallel.tensor=4", "data.global_batch_size=48")
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "world size 6 is not divisible by parallel.tensor=4" in res.stderr
    assert "parallel.tensor=4 must divide model.num_attention_heads=12" not in res.stderr
    res = _dry_run("--world-size", "8", "--config", "configs/models/110m.yaml",
                   "parallel.tensor=5")
    assert res.returncode == 2 and "parallel.tensor=5 must divide" in res.stderr


# -- the activation plan against the tensors real layers save ---------------------------------

# backend x precision x recompute x GQA, and the causal LM (each under CP2, on two ranks)
SAVED_CASES = [
    [f"model.attention_backend={backend}", f"train.precision={precision}",
     f"train.recompute={recompute}", f"model.num_query_groups={groups}"]
    for backend in ("sdpa", "permuted_causal") for precision in ("fp32", "bf16")
    for recompute in ("none", "selective", "full") for groups in (4, 2)] + [
    # the plain causal LM (SDPA's causal kernel; under CP2 its rows of the causal mask)
    ["order.kind=causal", "model.attention_backend=sdpa", f"train.precision={precision}",
     f"train.recompute={recompute}"]
    for precision in ("fp32", "bf16") for recompute in ("none", "selective")]


def saved_per_layer(overrides, backward: bool = False):
    """``(planned, measured)`` bytes one layer saves for its backward: the middle layer of a
    3-layer model, one micro-batch of the staggered NELBO, every tensor autograd saves during
    its forward (by storage, parameters left out), in this process's group. ``backward``:
    instead, the loss and the gradients of that step, ``{name: tensor}``."""
    import torch

    from setdiff_dist.config import load_config
    from setdiff_dist.data.loader import Batch
    from setdiff_dist.model.transformer import build_model, transformer_config
    from setdiff_dist.objective import Objective
    from setdiff_dist.train.plan import layer_bytes

    cfg = load_config("configs/tiny-cpu.yaml", [
        "model.num_layers=3", "data.seq_len=64", "data.micro_batch_size=2",
        "model.hidden_size=64", "model.num_attention_heads=4", "model.ffn_hidden_size=192",
        *overrides])
    dtype = torch.bfloat16 if cfg.train.precision == "bf16" else torch.float32
    config = transformer_config(cfg.model, compute_dtype=dtype, recompute=cfg.train.recompute,
                                recompute_num_layers=1, tensor=cfg.parallel.tensor)
    model = build_model(cfg.model, config, seed=0).to(dtype)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    B, L = cfg.data.micro_batch_size, cfg.data.seq_len
    tokens = torch.randint(0, 200, (B, L), generator=torch.Generator().manual_seed(0))
    batch = Batch(tokens=tokens, indices=torch.arange(B),
                  context=torch.zeros(B, L, dtype=torch.bool),
                  padding=torch.zeros(B, L, dtype=torch.bool))
    inside, saved, shared = [False], {}, set()
    scopes = [model.decoder.layers[1]]
    if cfg.train.recompute == "full":
        # the checkpointed chunks save their inputs outside the layers' own forward: all the
        # decoder saves, but for its final norm and the inputs every chunk shares (the mask
        # and the rotary table, made before it), over its layers
        def shared_inputs(module, args, kwargs):
            shared.update(t.untyped_storage().data_ptr() for t in kwargs.values()
                          if isinstance(t, torch.Tensor))

        model.decoder.register_forward_pre_hook(shared_inputs, with_kwargs=True)
        scopes = [model.decoder]
        norm = model.decoder.final_layernorm
        norm.register_forward_pre_hook(lambda *_: inside.__setitem__(0, False))
        norm.register_forward_hook(lambda *_: inside.__setitem__(0, True))
    for scope in scopes:
        scope.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True))
        scope.register_forward_hook(lambda *_: inside.__setitem__(0, False))

    def pack(t):
        storage = t.untyped_storage()
        if inside[0] and storage.data_ptr() not in params | shared:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    if backward:
        out, terms = Objective(cfg, seed=0).step(model, batch)
        loss = terms(out)[0]
        loss.backward()
        return {"loss": loss.detach(), **{n: p.grad for n, p in model.named_parameters()}}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        Objective(cfg, seed=0).step(model, batch)
    per = len(model.decoder.layers) if cfg.train.recompute == "full" else 1
    return layer_bytes(cfg), sum(saved.values()) / per


def test_the_plan_of_a_layers_saved_tensors_is_within_10_percent_of_real_layers():
    from helpers import process_group

    with process_group("gloo"):
        found = {" ".join(case): saved_per_layer(case) for case in SAVED_CASES}
    for case, (planned, measured) in found.items():
        assert planned == pytest.approx(measured, rel=0.10), (case, planned, measured)


def _saved_with_context_parallel(rank, out):
    import torch

    from setdiff_dist.parallel import initialize_model_parallel

    initialize_model_parallel(1, 1, None, seed=0, backend="gloo", context=2)
    found = {}
    for case in SAVED_CASES:
        found[" ".join(case)] = saved_per_layer([*case, "parallel.context=2"])
    # recompute under CP (the layers' mask is a tensor megatron's checkpoint can save): the
    # same loss and gradients as without
    grads = {mode: saved_per_layer(["parallel.context=2", f"train.recompute={mode}"],
                                   backward=True)
             for mode in ("none", "selective", "full")}
    torch.save((found, grads), out / f"rank{rank}.pt")


@pytest.mark.multiprocess
def test_the_layer_plan_holds_under_context_parallelism(tmp_path):
    """CP2: each rank's layer keeps the whole sequence's keys and values and its rows of the
    mask; the plan is within 10% of what the layers save, on both ranks."""
    import torch
    from mp_harness import spawn

    spawn(_saved_with_context_parallel, 2, tmp_path)
    for rank in (0, 1):
        found, grads = torch.load(tmp_path / f"rank{rank}.pt")
        for case, (planned, measured) in found.items():
            assert planned == pytest.approx(measured, rel=0.10), (rank, case, planned, measured)
        for mode in ("selective", "full"):
            for name, g in grads["none"].items():
                assert torch.equal(grads[mode][name], g), (rank, mode, name)


def test_every_paper_row_fits_the_papers_gpus():
    """configs/paper/: each table row (model x order) plans at 8 GPUs of 80 GB (the 110M
    recipes' global batch of 512, CNN/DailyMail's of 128, at their micro-batch) with room to
    spare."""
    from pathlib import Path

    from setdiff_dist.config import load_config
    from setdiff_dist.train.plan import GiB, plan

    rows = sorted(p for p in Path("configs/paper").glob("*-*-*.yaml"))
    assert len(rows) >= 10
    for path in rows:
        cfg = load_config(str(path))
        p = plan(cfg, 8)
        assert p.data == 8 and max(s.total for s in p.stages) < 80 * GiB, path
        batch = 128 if path.name.startswith("cnndm-") else 512
        assert cfg.data.global_batch_size == batch and cfg.optimizer.lr == 3e-4, path
