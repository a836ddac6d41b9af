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


def test_compiled_flex_at_8k_tokens_matches_permuted_causal(_parallel_state):
    """Long context (issue 20): L = 8192 (2L = 16384 tokens in the model), compiled
    FlexAttention with a block mask built once per micro-batch against the mask-free permuted
    form; a dense mask would be 268M booleans here."""
    from helpers import tiny_nelbo_step

    ref_nll, ref_grads = tiny_nelbo_step("permuted_causal", device="cuda", L=8192, B=1)
    nll, grads = tiny_nelbo_step("flex", device="cuda", L=8192, B=1)
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


def test_overlapped_bf16_default_step_with_its_timers(byte_shards, tmp_path):
    """The default bf16 path (ZeRO-1, gradient reduction overlapped with the backward, the
    parameter gather with the next forward where more than one GPU shares the optimizer) on NCCL,
    with its phase timers: every logged step's phases add up to its time within 5%, timed by
    CUDA events read at the log intervals (no device synchronize inside a step); the timings are
    printed for the log."""
    import json

    n = torch.cuda.device_count()
    res = _train(tmp_path, byte_shards, n, "parallel.backend=nccl", "train.precision=bf16",
                 "zero.reduce_bucket_size=20000")
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    rows = [r for r in rows if "loss" in r]
    phases = ("data_wait", "forward", "backward", "grad_reduce", "optimizer", "param_gather")
    for r in rows[1:]:  # (the first step warms up the kernels)
        print({k: round(r[k] * 1e3, 2) for k in ["step_time", *(f"time_{p}" for p in phases)]})
        assert sum(r[f"time_{p}"] for p in phases) == pytest.approx(r["step_time"], rel=0.05)
        assert r["time_forward"] > 0 and r["time_backward"] > 0


def _needs_fp8():
    pytest.importorskip("transformer_engine")
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs sm_89 or newer")


def test_fp8_tracks_bf16_for_50_steps(byte_shards, tmp_path):
    """FP8 (TE, delayed scaling) against bf16 on the same data, seed and TE layers, 50 steps.

    Tolerance: the mean loss of the last 10 steps within 3% of bf16's. E4M3 keeps 3 mantissa
    bits (elementwise rounding up to 2^-4), but each GEMM scales per tensor and accumulates in
    fp32, so the rounding averages out over the reduction dimension; published FP8 pretraining
    runs stay within ~1% of bf16's loss, and 3% leaves room for a 50-step run of a tiny model
    (whose step-to-step noise alone is ~1%). A broken FP8 path (stale weight cache, no
    scaling) drifts far more than that or stops learning."""
    _needs_fp8()
    curves = {}
    for precision in ("bf16", "fp8"):
        run = tmp_path / precision
        res = _train(run, byte_shards, 1, f"train.precision={precision}", "model.layer_spec=te",
                     "parallel.backend=nccl", "train.steps=50", "optimizer.warmup_steps=5")
        assert res.returncode == 0, res.stderr[-3000:]
        curves[precision] = _losses(run)
    bf16, fp8 = curves["bf16"], curves["fp8"]
    assert len(fp8) == 50 and all(l == l for l in fp8)
    tail = lambda c: sum(c[-10:]) / 10  # noqa: E731
    assert tail(fp8) == pytest.approx(tail(bf16), rel=0.03), (tail(fp8), tail(bf16))
    assert tail(fp8) < fp8[0] - 0.5  # it learns


def test_te_trained_checkpoint_generates(byte_shards, tmp_path):
    """A checkpoint trained with the TE spec (fused norm names) loads into the inference model
    (local spec) through the layout-free names and decodes."""
    import subprocess
    import sys

    pytest.importorskip("transformer_engine")
    res = _train(tmp_path, byte_shards, 1, "train.precision=bf16", "model.layer_spec=te",
                 "parallel.backend=nccl", "train.steps=20", "optimizer.warmup_steps=2")
    assert res.returncode == 0, res.stderr[-3000:]
    gen = subprocess.run([sys.executable, "-m", "setdiff_dist.cli.generate", "--checkpoint",
                          str(tmp_path), "--prompt", "Shall I", "--max-new-tokens", "16",
                          "--window", "4", "--greedy", "--json"],
                         capture_output=True, text=True, timeout=300)
    assert gen.returncode == 0, gen.stderr[-3000:]
    assert '"texts"' in gen.stdout


def test_bf16_pipeline_parallel_on_nccl(byte_shards, tmp_path):
    """bf16 with PP=2 over NCCL (the stages exchange bf16 activations). NCCL needs one GPU per
    rank, so this runs on machines with two or more."""
    if torch.cuda.device_count() < 2:
        pytest.skip("PP=2 over NCCL needs 2 GPUs (NCCL refuses two ranks on one device)")
    res = _train(tmp_path, byte_shards, 2, "parallel.backend=nccl", "train.precision=bf16",
                 "zero.stage=1", "parallel.pipeline=2", "data.global_batch_size=8",
                 "train.steps=6")
    assert res.returncode == 0, res.stderr[-3000:]
    losses = _losses(tmp_path)
    assert len(losses) == 6 and losses[-1] < losses[0]


def test_context_parallel_on_nccl_follows_one_gpu(byte_shards, tmp_path):
    """parallel.context=2 over NCCL (fp32, the gathered keys' reduce-scatter backward) against
    one GPU; needs two GPUs (NCCL refuses two ranks on one device)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("CP=2 over NCCL needs 2 GPUs (NCCL refuses two ranks on one device)")
    one = _train(tmp_path / "one", byte_shards, 1, "parallel.backend=nccl", "zero.stage=1",
                 "data.global_batch_size=4")
    two = _train(tmp_path / "two", byte_shards, 2, "parallel.backend=nccl", "zero.stage=1",
                 "data.global_batch_size=4", "parallel.context=2")
    assert one.returncode == 0 and two.returncode == 0, (one.stderr + two.stderr)[-3000:]
    assert _losses(tmp_path / "two") == pytest.approx(_losses(tmp_path / "one"), rel=1e-4)


def test_te_sequence_parallel_equals_tensor_parallel(byte_shards, tmp_path):
    """TE layers with sequence parallelism at TP=2 follow TP=2 without it (bf16, within 2%).
    Needs 2 GPUs (TP=2 over NCCL)."""
    pytest.importorskip("transformer_engine")
    if torch.cuda.device_count() < 2:
        pytest.skip("TP=2 over NCCL needs 2 GPUs")
    curves = {}
    for sp in ("false", "true"):
        run = tmp_path / f"sp-{sp}"
        res = _train(run, byte_shards, 2, "parallel.backend=nccl", "train.precision=bf16",
                     "model.layer_spec=te", "parallel.tensor=2",
                     f"parallel.sequence_parallel={sp}", "train.steps=6")
        assert res.returncode == 0, res.stderr[-3000:]
        curves[sp] = _losses(run)
    assert curves["true"] == pytest.approx(curves["false"], rel=0.02)


def test_a_background_save_stages_cuda_tensors_in_pinned_shared_memory(tmp_path):
    """checkpoint.async_save on a GPU: the staging segments are registered with CUDA (pinned),
    a device tensor's copy lands in them, and the writer process writes what torch writes."""
    from setdiff_dist.train.async_save import host_copy
    from setdiff_dist.train.writer import Staging, WriterProcess

    state = {"w": torch.randn(1024, 257, device="cuda"),
             "h": torch.randn(333, device="cuda").half()}
    staging = Staging()
    writer = WriterProcess(staging)
    try:
        writer.start()
        staging.begin()
        staged = host_copy(state, staging.copy)
        assert staging.place(staged["w"]) is not None and staged["w"].is_pinned()
        writer.run([(torch.save, (staged, str(tmp_path / "a.pt")), {})], lambda: None)
        got = torch.load(tmp_path / "a.pt")
        for k, v in state.items():
            assert torch.equal(got[k], v.cpu()), k
    finally:
        writer.close()
        staging.close()
