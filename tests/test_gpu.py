"""GPU-only paths (skipped without CUDA): FlexAttention with backward, Transformer Engine.

Run on a GPU machine with ``bash scripts/test.sh -m gpu`` (or inside the docker image)."""

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _loss_and_grads(backend, layer_spec="local"):
    from helpers import tiny_nelbo_step

    return tiny_nelbo_step(backend, layer_spec, device="cuda")


@pytest.fixture(scope="module")
def _parallel_state():
    from helpers import process_group

    with process_group("nccl"):
        yield


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
