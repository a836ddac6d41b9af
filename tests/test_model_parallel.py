"""The megatron-core model: tensor parallelism, attention backends and the AR identity, on gloo.

One launch of 2 processes checks several claims (process start-up dominates on 2 CPU cores);
rank 0 saves what it measured and the assertions run in the parent.
"""

import pytest
import torch
from mp_harness import results_at_tp1_and_tp2

L, B, V = 12, 2, 256


def model_config(backend="sdpa", *extra):
    from setdiff_dist.config import load_config

    return load_config(None, ["model.num_layers=2", "model.hidden_size=64",
                              "model.num_attention_heads=4", "model.num_query_groups=2",
                              "model.ffn_hidden_size=96", f"model.vocab_size={V}",
                              f"model.attention_backend={backend}", *extra]).model


def full_logits(logits):
    """Gather vocab-parallel logits [s, b, V/TP] into [s, b, V]."""
    from megatron.core import parallel_state as ps

    parts = [torch.empty_like(logits) for _ in range(ps.get_tensor_model_parallel_world_size())]
    torch.distributed.all_gather(parts, logits.contiguous(),
                                 group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1)[..., :V]


def full_grads(model):
    from setdiff_dist.model.transformer import global_name, unshard

    grads = {global_name(model, n): unshard(p.grad, p) for n, p in model.named_parameters()}
    # the vocabulary is padded per TP size: compare the real rows (tokens and [MASK])
    return {n: g[:V + 1] if n in ("embedding.weight", "output_layer.weight") else g
            for n, g in grads.items()}


def measure(tp, out):
    """Everything rank 0 reports for one tensor-parallel size."""
    from setdiff_dist.diffusion import make_schedule, nelbo, sample_orders
    from setdiff_dist.model.forward import (
        causal_lm_inputs,
        causal_lm_nll,
        set_diffusion_inputs,
        set_diffusion_nll,
        vocab_parallel_nll,
    )
    from setdiff_dist.model.transformer import build_model, transformer_config
    from setdiff_dist.parallel import initialize_model_parallel

    initialize_model_parallel(tensor=tp, seed=5)
    x = torch.randint(0, V, (B, L), generator=torch.Generator().manual_seed(0))
    pad = torch.arange(L).expand(B, L) >= torch.tensor([[L], [L - 3]])
    stag = sample_orders(make_schedule("staggered", L, mean_set_size=3), L, range(B), 1,
                         padding=pad)
    res = {}
    for backend in ("sdpa", "permuted_causal"):
        cfg = model_config(backend)
        model = build_model(cfg, transformer_config(cfg, tensor=tp), seed=11)
        inp = set_diffusion_inputs(x, stag, model.mask_id, backend)
        logits = model(inp.tokens, inp.positions, inp.attention_mask, inp.logits_from)
        nll = set_diffusion_nll(logits, x, inp)
        nelbo(nll, stag).per_token.backward()
        res[backend] = {"nll": nll.detach(), "grads": full_grads(model)}
        if backend == "sdpa":
            res["logits"] = full_logits(logits.detach())
            sdpa_model = model
    model = sdpa_model
    with torch.no_grad():
        # the other layer variant: LayerNorm, GELU, untied output projection
        cfg = model_config("sdpa", "model.normalization=layernorm", "model.activation=gelu",
                           "model.tie_embeddings=false")
        gelu = build_model(cfg, transformer_config(cfg, tensor=tp), seed=11)
        inp = set_diffusion_inputs(x, stag, model.mask_id, "sdpa")
        res["gelu_logits"] = full_logits(gelu(inp.tokens, inp.positions, inp.attention_mask,
                                              inp.logits_from))
        # FlexAttention: forward only on CPU (no backward kernel there)
        cfg = model_config("flex")
        flex_model = build_model(cfg, transformer_config(cfg, tensor=tp), seed=11)
        inp = set_diffusion_inputs(x, stag, model.mask_id, "flex")
        res["flex_nll"] = set_diffusion_nll(flex_model(inp.tokens, inp.positions,
                                                       inp.attention_mask, inp.logits_from), x, inp)
        # the clean half never sees the noisy half
        inp = set_diffusion_inputs(x, stag, model.mask_id, "sdpa")
        changed = inp.tokens.clone()
        changed[:, L:] = torch.randint(0, V, (B, L), generator=torch.Generator().manual_seed(9))
        a = model(inp.tokens, inp.positions, inp.attention_mask)
        b = model(changed, inp.positions, inp.attention_mask)
        res["clean_change"] = (a[:L] - b[:L]).abs().max().item()
        res["noisy_change"] = (a[L:] - b[L:]).abs().max().item()
        # the AR identity: the autoregressive order's vectorized NELBO equals one forward per
        # position over the clean prefix plus a [MASK] query there
        ar = sample_orders(make_schedule("autoregressive", L), L, range(B), 0)
        inp = set_diffusion_inputs(x, ar, model.mask_id, "sdpa")
        vec = set_diffusion_nll(model(inp.tokens, inp.positions, inp.attention_mask,
                                      inp.logits_from), x, inp)
        seq = torch.empty(B, L)
        for l in range(L):
            t = torch.cat([x[:, :l], torch.full((B, 1), model.mask_id)], dim=1)
            pos = torch.arange(l + 1).expand(B, l + 1)
            seq[:, l] = vocab_parallel_nll(model(t, pos, None, logits_from=l), x[:, l:l + 1])[:, 0]
        res["ar_vectorized"], res["ar_sequential"] = vec, seq
        res["ar_nelbo"] = nelbo(vec, ar).total.item()
        # the plain causal LM mode of the same weights
        inp = causal_lm_inputs(x)
        res["causal_nll"] = causal_lm_nll(model(inp.tokens, inp.positions, None), x, inp)
    # backends that cannot run here say so
    errors = []
    try:
        inp = set_diffusion_inputs(x, stag, model.mask_id, "flex")
        flex_model(inp.tokens, inp.positions, inp.attention_mask, inp.logits_from)
    except RuntimeError as exc:
        errors.append(str(exc))
    try:
        build_model(model_config("te", "model.layer_spec=te"), transformer_config(cfg), seed=1)
    except RuntimeError as exc:
        errors.append(str(exc))
    res["backend_errors"] = errors
    if torch.distributed.get_rank() == 0:
        torch.save(res, out / f"tp{tp}.pt")


@pytest.fixture(scope="module")
def tp_results(tmp_path_factory):
    return results_at_tp1_and_tp2(measure, tmp_path_factory.mktemp("tp"))


def test_tensor_parallel_logits_and_gradients_equal_a_single_rank(tp_results):
    one, two = tp_results[1], tp_results[2]
    assert torch.allclose(one["logits"], two["logits"], atol=2e-5)
    assert torch.allclose(one["gelu_logits"], two["gelu_logits"], atol=2e-5)
    for backend in ("sdpa", "permuted_causal"):
        g1, g2 = one[backend]["grads"], two[backend]["grads"]
        assert g1.keys() == g2.keys()
        for name in g1:
            assert torch.allclose(g1[name], g2[name], atol=1e-6, rtol=1e-4), (backend, name)
        assert any(g.abs().sum() > 0 for g in g1.values())


@pytest.mark.parametrize("tp", [1, 2])
def test_autoregressive_order_nelbo_equals_the_sequential_nll(tp_results, tp):
    r = tp_results[tp]
    assert torch.allclose(r["ar_vectorized"], r["ar_sequential"], atol=1e-5)
    assert r["ar_nelbo"] == pytest.approx(r["ar_sequential"].sum().item(), rel=1e-6)


@pytest.mark.parametrize("tp", [1, 2])
def test_permuted_and_flex_paths_give_the_dense_per_token_losses(tp_results, tp):
    r = tp_results[tp]
    dense, keep = r["sdpa"]["nll"], torch.ones(B, L, dtype=torch.bool)
    keep[1, L - 3:] = False  # padding is never predicted
    assert torch.allclose(r["permuted_causal"]["nll"][keep], dense[keep], atol=2e-5)
    assert torch.allclose(r["flex_nll"][keep], dense[keep], atol=2e-5)


def test_permuted_causal_gradients_equal_the_dense_mask_gradients(tp_results):
    r = tp_results[1]
    assert r["sdpa"]["grads"] and r["sdpa"]["grads"].keys() == r["permuted_causal"]["grads"].keys()
    for name, g in r["sdpa"]["grads"].items():
        assert torch.allclose(r["permuted_causal"]["grads"][name], g, atol=1e-6, rtol=1e-4), name


@pytest.mark.parametrize("tp", [1, 2])
def test_clean_half_never_sees_the_noisy_half(tp_results, tp):
    assert tp_results[tp]["clean_change"] == 0.0
    assert tp_results[tp]["noisy_change"] > 1e-3


def test_causal_lm_mode_runs_on_the_same_weights(tp_results):
    one, two = tp_results[1]["causal_nll"], tp_results[2]["causal_nll"]
    assert one.shape == (B, L - 1) and torch.isfinite(one).all()
    assert torch.allclose(one, two, atol=1e-5)


def test_backends_that_cannot_run_here_say_so(tp_results):
    if torch.cuda.is_available():
        pytest.skip("a GPU runs these backends")
    flex, te = tp_results[1]["backend_errors"]
    assert "flex cannot train on a CPU" in flex
    assert "needs Transformer Engine on a CUDA machine" in te
