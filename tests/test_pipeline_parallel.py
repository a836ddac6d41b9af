"""Pipeline parallelism through megatron-core's schedules, on gloo.

PP=2 (1F1B, two micro-batches, tied embeddings across the stages) must give the losses and
gradients of PP=1; TP=2 x PP=2 on four ranks runs a training step.
"""

import pytest
import torch
from mp_harness import spawn

L, B, V, MICRO = 10, 2, 100, 2


def model_cfg():
    from setdiff_dist.config import load_config

    return load_config(None, ["model.num_layers=4", "model.hidden_size=32",
                              "model.num_attention_heads=4", "model.ffn_hidden_size=64",
                              f"model.vocab_size={V}", "model.attention_backend=sdpa"]).model


def microbatches():
    from setdiff_dist.diffusion import make_schedule, sample_orders

    sched = make_schedule("staggered", L, mean_set_size=2)
    g = torch.Generator().manual_seed(0)
    return [(torch.randint(0, V, (B, L), generator=g),
             sample_orders(sched, L, range(i * B, (i + 1) * B), seed=3)) for i in range(MICRO)]


def train_step(tp, pp, out, tag):
    from megatron.core import parallel_state as ps

    from setdiff_dist.model.pipeline import forward_backward  # (megatron's schedules)
    from setdiff_dist.model.transformer import build_model, global_name, transformer_config, unshard
    from setdiff_dist.objective import nelbo_step
    from setdiff_dist.parallel import initialize_model_parallel

    initialize_model_parallel(tensor=tp, pipeline=pp, seed=1)
    cfg = model_cfg()
    model = build_model(cfg, transformer_config(cfg, tensor=tp, pipeline=pp), seed=7)
    # megatron's schedule over (tokens, orders) micro-batches, the NELBO per target token the
    # loss step it is given (as megatron's forward_step_func)
    stats = forward_backward(model, microbatches(), 2 * L, B,
                             lambda module, mb: nelbo_step(module, mb[0], mb[1], "sdpa"))
    grads = {global_name(model, n): unshard(p.grad, p)[: V + 1]
             if "embedding" in global_name(model, n) else unshard(p.grad, p)
             for n, p in model.named_parameters()}
    # one optimizer step, to show the whole step runs in this layout
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt.step()
    if ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0:
        torch.save({"stats": stats, "grads": grads},
                   out / f"{tag}_stage{ps.get_pipeline_model_parallel_rank()}.pt")


def run_pp(rank, out):
    train_step(1, 1, out, "pp1")
    train_step(1, 2, out, "pp2")


def run_tp_pp(rank, out):
    train_step(2, 2, out, "tp2pp2")


def merged(out, tag, stages):
    grads, stats = {}, []
    for s in range(stages):
        r = torch.load(out / f"{tag}_stage{s}.pt")
        for name, g in r["grads"].items():
            assert name not in grads or torch.allclose(grads[name], g), name  # tied copies agree
            grads[name] = g
        stats += r["stats"]
    return grads, stats


@pytest.fixture(scope="module")
def pp_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("pp")
    spawn(run_pp, 2, out)
    return out


def test_pipeline_parallel_equals_a_single_stage(pp_dir):
    g1, s1 = merged(pp_dir, "pp1", 1)
    g2, s2 = merged(pp_dir, "pp2", 2)
    assert len(s1) == len(s2) == MICRO
    for a, b in zip(s1, s2):
        assert torch.allclose(a["nll_sum"], b["nll_sum"], rtol=1e-6)
        assert a["tokens"] == b["tokens"] == B * L
    assert g1.keys() == g2.keys()
    for name in g1:
        assert torch.allclose(g1[name], g2[name], atol=1e-6, rtol=1e-4), name


def test_tensor_and_pipeline_parallel_on_four_ranks_runs_a_training_step(tmp_path, pp_dir):
    spawn(run_tp_pp, 4, tmp_path)
    g4, s4 = merged(tmp_path, "tp2pp2", 2)
    g1, s1 = merged(pp_dir, "pp1", 1)
    assert len(s4) == MICRO and all(torch.isfinite(s["nll_sum"]) for s in s4)
    for a, b in zip(s1, s4):
        assert torch.allclose(a["nll_sum"], b["nll_sum"], rtol=1e-5)
    for name in g1:
        assert torch.allclose(g1[name], g4[name], atol=1e-6, rtol=1e-4), name
