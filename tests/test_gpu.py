"""GPU-only paths (skipped without CUDA): FlexAttention with backward, Transformer Engine.

Run on a GPU machine with ``bash scripts/test.sh -m gpu`` (or inside the docker image)."""

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

L, B, V = 64, 2, 512


def _model(backend, layer_spec="local"):
    from setdiff_dist.config import load_config
    from setdiff_dist.model.transformer import build_model, transformer_config

    cfg = load_config(None, ["model.num_layers=2", "model.hidden_size=64",
                             "model.num_attention_heads=4", f"model.vocab_size={V}",
                             f"model.attention_backend={backend}",
                             f"model.layer_spec={layer_spec}"]).model
    return build_model(cfg, transformer_config(cfg), seed=3).cuda()


def _loss_and_grads(backend, layer_spec="local"):
    from setdiff_dist.diffusion import make_schedule, nelbo, sample_orders
    from setdiff_dist.model.forward import set_diffusion_inputs, set_diffusion_nll

    model = _model(backend, layer_spec)
    x = torch.randint(0, V, (B, L), generator=torch.Generator().manual_seed(0)).cuda()
    o = sample_orders(make_schedule("staggered", L, mean_set_size=4), L, range(B), 0)
    inp = set_diffusion_inputs(x, o, model.mask_id, backend)
    nll = set_diffusion_nll(model(inp.tokens, inp.positions, inp.attention_mask,
                                  inp.logits_from), x, inp)
    nelbo(nll, o.to("cuda")).per_token.backward()
    return nll.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.fixture(scope="module", autouse=True)
def _parallel_state():
    from setdiff_dist.parallel import destroy_model_parallel, initialize_model_parallel

    initialize_model_parallel(seed=0, backend="nccl")
    yield
    destroy_model_parallel()


@pytest.mark.parametrize("backend", ["flex", "permuted_causal"])
def test_gpu_backends_match_the_dense_mask_with_gradients(backend):
    ref_nll, ref_grads = _loss_and_grads("sdpa")
    nll, grads = _loss_and_grads(backend)
    assert torch.allclose(nll, ref_nll, atol=1e-4)
    for name, g in ref_grads.items():
        assert torch.allclose(grads[name], g, atol=1e-5, rtol=1e-3), name


def test_transformer_engine_attention_matches_sdpa():
    pytest.importorskip("transformer_engine")
    ref_nll, _ = _loss_and_grads("sdpa")
    nll, _ = _loss_and_grads("te", layer_spec="te")
    assert torch.allclose(nll, ref_nll, atol=1e-3)
