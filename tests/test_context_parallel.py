"""Context parallelism: a sequence split over 2 ranks (zigzag) gives the losses and gradients of
the unsplit sequence, for the autoregressive and staggered orders with the dense-mask and the
permuted backends and for the in-set orders (block, masked) with the dense mask, on gloo."""

import pytest
import torch
from mp_harness import spawn

L, B, V = 16, 2, 128
# (GQA for the staggered cases, one key/value head per query head for the others: the
# gathered keys' gradient arrives strided without GQA's repeat)
CASES = [(kind, backend) for kind in ("autoregressive", "staggered")
         for backend in ("sdpa", "permuted_causal")] + [("block", "sdpa"), ("masked", "sdpa")]


def _step(kind, backend):
    """Loss sum, target tokens and full gradients of one NELBO step; under CP the sums and the
    gradients are summed over the context-parallel group."""
    from megatron.core import parallel_state as ps

    from setdiff_dist.config import load_config
    from setdiff_dist.diffusion import make_schedule, sample_orders
    from setdiff_dist.model.transformer import build_model, global_name, transformer_config
    from setdiff_dist.objective import nelbo_step

    groups = 2 if kind == "staggered" else 4
    cfg = load_config(None, ["model.num_layers=2", "model.hidden_size=32",
                             "model.num_attention_heads=4", f"model.num_query_groups={groups}",
                             "model.ffn_hidden_size=64", f"model.vocab_size={V}",
                             f"model.attention_backend={backend}", f"order.kind={kind}"]).model
    model = build_model(cfg, transformer_config(cfg), seed=11)
    x = torch.randint(0, V, (B, L), generator=torch.Generator().manual_seed(0))
    pad = torch.arange(L).expand(B, L) >= torch.tensor([[L], [L - 5]])
    context = torch.arange(L).expand(B, L) < 3
    sample = sample_orders(make_schedule(kind, L, mean_set_size=3), L, range(B), 2,
                           context=context, padding=pad)
    out, terms = nelbo_step(model, x, sample, backend)
    total, tokens = terms(out)
    sums = torch.stack([total.detach(), tokens.detach()])
    group = ps.get_context_parallel_group()
    torch.distributed.all_reduce(sums, group=group)
    (total / sums[1]).backward()
    grads = {}
    for n, p in model.named_parameters():
        g = p.grad.clone()
        torch.distributed.all_reduce(g, group=group)
        grads[global_name(model, n)] = g
    return sums, grads


def _measure(rank, out):
    from setdiff_dist.parallel import initialize_model_parallel

    res = {}
    for context in (1, 2):
        initialize_model_parallel(seed=0, context=context)
        for kind, backend in CASES:
            res[context, kind, backend] = _step(kind, backend)
    if rank == 0:
        torch.save(res, out / "cp.pt")


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    out = tmp_path_factory.mktemp("cp")
    spawn(_measure, 2, out)
    return torch.load(out / "cp.pt")


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind,backend", CASES)
def test_context_parallel_equals_one_rank_in_loss_and_gradients(measured, kind, backend):
    (one, g1), (two, g2) = measured[1, kind, backend], measured[2, kind, backend]
    assert two[1] == one[1] and one[1] > 0  # the same target tokens, split
    assert two[0] == pytest.approx(one[0].item(), rel=1e-5)
    assert g1.keys() == g2.keys()
    for name in g1:
        assert torch.allclose(g2[name], g1[name], rtol=1e-4, atol=1e-6), name


def test_the_zigzag_split_balances_causal_work():
    from setdiff_dist.model.context import zigzag

    parts = [zigzag(16, 2, r) for r in range(2)]
    assert parts[0].tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert parts[1].tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    # causal work (keys before each query) is equal
    assert sum(int(i) + 1 for i in parts[0]) == sum(int(i) + 1 for i in parts[1])
    with pytest.raises(ValueError, match="cannot be split"):
        zigzag(10, 2, 0)


# -- setdiff-train with parallel.context ---------------------------------------------------------

@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    from helpers import sonnet_shards

    return sonnet_shards(tmp_path_factory.mktemp("cp-shards"), "bpe:300")


def _train(run_dir, shards, nproc, *overrides):
    from helpers import run_train

    return run_train(run_dir, shards, "train.log_interval=1", *overrides, nproc=nproc, steps=4,
                     vocab=300, global_batch=4, micro_batch=2)


@pytest.fixture(scope="module")
def one_rank(shards, tmp_path_factory):
    from helpers import losses

    run = tmp_path_factory.mktemp("cp1") / "run"
    res = _train(run, shards, 1)
    assert res.returncode == 0, res.stderr[-3000:]
    return losses(run)


@pytest.mark.multiprocess
def test_training_with_context_parallel_2_equals_one_rank_and_resumes_exactly(
        shards, one_rank, tmp_path):
    from helpers import losses

    whole = _train(tmp_path / "whole", shards, 2, "parallel.context=2")
    assert whole.returncode == 0, whole.stderr[-3000:]
    got = losses(tmp_path / "whole")
    assert list(got) == list(one_rank) == [1, 2, 3, 4]
    for step in got:
        assert got[step] == pytest.approx(one_rank[step], rel=1e-6), step
    # stopped after step 2 (a checkpoint), then resumed: the same steps 3 and 4
    split = tmp_path / "split"
    first = _train(split, shards, 2, "parallel.context=2", "train.exit_at_step=2")
    assert first.returncode == 0, first.stderr[-3000:]
    second = _train(split, shards, 2, "parallel.context=2")
    assert second.returncode == 0 and "resumed from" in second.stdout, second.stderr[-3000:]
    again = losses(split)
    assert [again[s] for s in (3, 4)] == [got[s] for s in (3, 4)]
    # a checkpoint resumes at its own context-parallel size, and says how to go on otherwise
    other = _train(split, shards, 1, "train.steps=6")
    assert other.returncode == 2 and "parallel.context: checkpoint 2, this run 1" in other.stderr


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", [["parallel.tensor=2"], ["parallel.pipeline=2"]],
                         ids=["tp2", "pp2"])
def test_context_parallel_composes_with_tensor_and_pipeline_parallelism(shards, one_rank,
                                                                        tmp_path, layout):
    from helpers import losses

    res = _train(tmp_path / "run", shards, 4, "parallel.context=2", *layout)
    assert res.returncode == 0, res.stderr[-3000:]
    got = losses(tmp_path / "run")
    for step in got:  # (float reordering over 4 ranks)
        assert got[step] == pytest.approx(one_rank[step], rel=1e-4), step


def test_context_parallel_configs_that_cannot_run_are_refused(shards, tmp_path):
    cases = [(2, ["parallel.context=4"], "not divisible by parallel.tensor=1 x "
                                         "parallel.pipeline=1 x parallel.context=4"),
             (2, ["parallel.context=2", "data.seq_len=30"], "must be a multiple of 4"),
             (2, ["parallel.context=2", "order.kind=causal"], "train the causal baseline"),
             (2, ["parallel.context=2", "model.attention_backend=flex", "order.kind=block"],
              "context parallelism runs on sdpa or permuted_causal")]
    for nproc, overrides, message in cases:
        res = _train(tmp_path / "bad", shards, nproc, *overrides)
        assert res.returncode == 2 and message in res.stderr, (overrides, res.stderr[-2000:])
        assert "Traceback" not in res.stderr
