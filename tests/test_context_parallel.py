"""Context parallelism: a sequence split over 2 ranks (zigzag) gives the losses and gradients of
the unsplit sequence, for the autoregressive and staggered orders with the dense-mask and the
permuted backends, for the in-set orders (block, masked) with the dense mask and for the plain
causal LM, on gloo."""

import pytest
import torch
from mp_harness import spawn

L, B, V = 16, 2, 128
# (GQA for the staggered cases, one key/value head per query head for the others: the
# gathered keys' gradient arrives strided without GQA's repeat)
CASES = [(kind, backend) for kind in ("autoregressive", "staggered")
         for backend in ("sdpa", "permuted_causal")] + [("block", "sdpa"), ("masked", "sdpa"),
                                                          ("causal", "sdpa")]


def _step(kind, backend):
    """Loss sum, target tokens and full gradients of one NELBO step; under CP the sums and the
    gradients are summed over the context-parallel group."""
    from megatron.core import parallel_state as ps

    from setdiff_dist.config import load_config
    from setdiff_dist.diffusion import make_schedule, sample_orders
    from setdiff_dist.model.transformer import build_model, global_name, transformer_config
    from setdiff_dist.objective import causal_lm_step, first_clean, nelbo_step

    groups = 2 if kind == "staggered" else 4
    cfg = load_config(None, ["model.num_layers=2", "model.hidden_size=32",
                             "model.num_attention_heads=4", f"model.num_query_groups={groups}",
                             "model.ffn_hidden_size=64", f"model.vocab_size={V}",
                             f"model.attention_backend={backend}", f"order.kind={kind}"]).model
    model = build_model(cfg, transformer_config(cfg), seed=11)
    x = torch.randint(0, V, (B, L), generator=torch.Generator().manual_seed(0))
    pad = torch.arange(L).expand(B, L) >= torch.tensor([[L], [L - 5]])
    context = torch.arange(L).expand(B, L) < 3
    if kind == "causal":  # (the plain causal LM: next-token loss on the unpadded targets)
        out, terms = causal_lm_step(model, x, ~(pad | first_clean(context))[:, 1:])
    else:
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

@pytest.mark.multiprocess
def test_training_with_context_parallel_2_equals_one_rank_and_resumes_exactly(
        trained, layouts, sonnets, tmp_path):
    """setdiff-train at CP=2 (the session's reference run with parallel.context=2) follows the
    one-rank curve (conftest.layouts' dp1); rewound to its step-3 checkpoint and resumed, the
    same steps 4-6; and resumed at CP=1, the same steps within fp32 rounding."""
    from helpers import REFERENCE, REFERENCE_STEPS, losses, rewound, run_train

    ref = trained("parallel.context=2")
    got = losses(ref)
    one_rank = layouts[0]["dp1"][0]
    assert list(got) == list(range(1, REFERENCE_STEPS + 1))
    for step in got:
        assert got[step] == pytest.approx(one_rank[step - 1], rel=1e-6), step
    run = rewound(ref, tmp_path)
    res = run_train(run, sonnets, *REFERENCE, "parallel.context=2", steps=REFERENCE_STEPS)
    assert res.returncode == 0 and "resumed from" in res.stdout, res.stderr[-3000:]
    assert losses(run) == got
    # and at CP=1 on one rank: the optimizer state's ZeRO partitions (over data x context-
    # parallel ranks) are re-partitioned through the universal form
    run = rewound(ref, tmp_path / "cp1")
    res = run_train(run, sonnets, *REFERENCE, steps=REFERENCE_STEPS, nproc=1)
    assert res.returncode == 0 and "resumed from" in res.stdout, res.stderr[-3000:]
    assert "universal form" in res.stdout
    resumed = losses(run)
    assert sorted(resumed) == sorted(got)
    for step in got:
        assert resumed[step] == pytest.approx(got[step], abs=1e-5), step


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout,reference", [("cp2-tp2", "dp1"), ("cp2-pp2", "dp1"),
                                              ("causal-cp2-pp2", "causal-dp1")])
def test_context_parallel_composes_with_tensor_and_pipeline_parallelism(layouts, layout,
                                                                        reference):
    """(conftest.layouts: trained in-process on four ranks; the causal LM's against its own
    one-rank curve.)"""
    got, one_rank = layouts[0][layout][0], layouts[0][reference][0]
    assert len(got) == len(one_rank)
    # float reordering over 4 ranks (the pipeline accumulates its micro-batches in another
    # order), amplified by Adam over the steps, as in test_train
    for a, b in zip(got, one_rank):
        assert a == pytest.approx(b, rel=2e-4)


@pytest.mark.multiprocess
def test_the_causal_baseline_trains_with_context_parallel_2_as_on_one_rank(layouts):
    """(conftest.layouts.) The plain causal LM at CP=2 follows its one-rank curve, training and
    validation (Megatron users train their GPT baselines at long context this way)."""
    (got, valid), (one_rank, valid_one) = layouts[0]["causal-cp2"], layouts[0]["causal-dp1"]
    assert len(got) == len(one_rank) > 0 and len(valid) == len(valid_one) > 0
    assert got == pytest.approx(one_rank, rel=1e-6)
    assert [v["valid_loss"] for v in valid] == pytest.approx(
        [v["valid_loss"] for v in valid_one], rel=1e-6)
    assert [v["valid_tokens"] for v in valid] == [v["valid_tokens"] for v in valid_one]
    # and it is the causal LM's curve, not the set-diffusion one's
    assert got[0] != pytest.approx(layouts[0]["dp1"][0][0], rel=1e-3)


@pytest.mark.parametrize("overrides,message", [
    (["parallel.context=4"], "not divisible by parallel.tensor=1 x parallel.pipeline=1 x "
                             "parallel.context=4"),
    (["parallel.context=2", "data.seq_len=30"], "must be a multiple of 4"),
    (["parallel.context=2", "model.attention_backend=flex", "order.kind=block"],
     "context parallelism runs on sdpa or permuted_causal")],
    ids=["world", "seq_len", "flex"])
def test_context_parallel_configs_that_cannot_run_are_refused(sonnets, tmp_path, capsys,
                                                              overrides, message):
    """setdiff-train --nproc-per-node 2, in this process: refused before any rank starts."""
    from helpers import cli, train_command

    code, err = cli("setdiff_dist.cli.train",
                    train_command(tmp_path, sonnets, *overrides, nproc=2)[3:], capsys)
    assert code == 2 and message in err, (overrides, err)
    assert "Traceback" not in err
