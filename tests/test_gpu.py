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


@pytest.fixture(scope="module")
def _parallel_state():
    from setdiff_dist.parallel import destroy_model_parallel, initialize_model_parallel

    initialize_model_parallel(seed=0, backend="nccl")
    yield
    destroy_model_parallel()


@pytest.mark.parametrize("backend", ["flex", "permuted_causal"])
def test_gpu_backends_match_the_dense_mask_with_gradients(_parallel_state, backend):
    ref_nll, ref_grads = _loss_and_grads("sdpa")
    nll, grads = _loss_and_grads(backend)
    assert torch.allclose(nll, ref_nll, atol=1e-4)
    for name, g in ref_grads.items():
        assert torch.allclose(grads[name], g, atol=1e-5, rtol=1e-3), name


def test_transformer_engine_attention_matches_sdpa(_parallel_state):
    pytest.importorskip("transformer_engine")
    ref_nll, _ = _loss_and_grads("sdpa")
    nll, _ = _loss_and_grads("te", layer_spec="te")
    assert torch.allclose(nll, ref_nll, atol=1e-3)


@pytest.fixture(scope="module")
def byte_shards(tmp_path_factory):
    from helpers import sonnet_shards

    return sonnet_shards(tmp_path_factory.mktemp("gpu-shards"), seq_len=64)


def _train(run_dir, shards, nproc, *overrides):
    from helpers import run_train

    return run_train(run_dir, shards, *overrides, nproc=nproc, seq_len=64,
                     global_batch=2 * nproc)


def _losses(run_dir):
    from helpers import losses

    return list(losses(run_dir).values())


def test_nccl_training_run(byte_shards, tmp_path):
    n = torch.cuda.device_count()
    res = _train(tmp_path, byte_shards, n, "parallel.backend=nccl", "train.precision=bf16",
                 f"zero.stage={2 if n > 1 else 1}")
    assert res.returncode == 0, res.stderr[-3000:]
    losses = _losses(tmp_path)
    assert len(losses) == 4 and all(l == l for l in losses) and losses[-1] < losses[0]


def test_fp8_training_step_with_transformer_engine(byte_shards, tmp_path):
    pytest.importorskip("transformer_engine")
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs sm_89 or newer")
    res = _train(tmp_path, byte_shards, 1, "train.precision=fp8", "model.layer_spec=te",
                 "parallel.backend=nccl")
    assert res.returncode == 0, res.stderr[-3000:]
    assert all(l == l for l in _losses(tmp_path))
