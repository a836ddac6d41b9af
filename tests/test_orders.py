"""Order schedules: docs/method.md §2."""


import numpy as np
import pytest
import torch
from scipy import stats

from setdiff_dist.diffusion import (
    AutoregressiveSchedule,
    StaggeredSchedule,
    make_schedule,
    sample_orders,
    staggered_parameters,
)


@pytest.mark.parametrize("L, D, w, k", [(1024, 4, 0.00776, 0.336), (1024, 8, 0.0154, 0.340),
                                        (128, 4, 0.0593, 0.358), (768, 16, 0.0400, 0.352)])
def test_staggered_parameters_reproduce_spec_reference_values(L, D, w, k):
    got_w, got_k = staggered_parameters(L, D)
    # docs/method.md §2.2 quotes three significant figures (768/16 gives w = 0.040050, quoted
    # as 0.0400)
    assert got_w == pytest.approx(w, rel=2e-3)
    assert got_k == pytest.approx(k, rel=2e-3)
    # the defining identity of the shape parameter
    assert got_k / (got_k + 1) * got_w == pytest.approx(D / (2 * L), rel=1e-12)


def _reveal_times(schedule, L, n, seed=0):
    return sample_orders(schedule, L, range(n), seed).reveal_times


def test_staggered_reveal_times_follow_the_survival_function():
    L, D, n = 32, 4, 3000
    sched = StaggeredSchedule.from_mean_set_size(L, D)
    R = _reveal_times(sched, L, n)
    for l in (0, 7, 16, 31):
        def cdf(r, l=l):
            return 1.0 - sched.survival(torch.as_tensor(r), L)[..., l].numpy()
        assert stats.kstest(R[:, l].numpy(), cdf).pvalue > 1e-3, f"position {l}"
        # the same test rejects the uniform-window law (k = 1): it has power
        wrong = StaggeredSchedule(sched.window, 1.0)
        def wrong_cdf(r, l=l, wrong=wrong):
            return 1.0 - wrong.survival(torch.as_tensor(r), L)[..., l].numpy()
        assert stats.kstest(R[:, l].numpy(), wrong_cdf).pvalue < 1e-6


def test_staggered_windows_slide_left_to_right():
    L = 64
    sched = StaggeredSchedule.from_mean_set_size(L, 4)
    a = sched.offsets(L)
    assert a[0] == pytest.approx(1 - sched.window) and a[-1] == 0.0
    R = _reveal_times(sched, L, 200)
    assert (R >= a).all() and (R <= a + sched.window).all()
    # mean reveal rank grows with position
    ranks = torch.argsort(torch.argsort(-R, dim=1), dim=1).double().mean(0)
    assert (ranks[1:] > ranks[:-1] - 2).all() and ranks[-1] > ranks[0] + L / 2


def test_mean_set_size_one_is_the_autoregressive_limit():
    L = 50
    w, k = staggered_parameters(L, 1)
    assert (w, k) == (1 / L, 1.0)
    for sched in (StaggeredSchedule(w, k), AutoregressiveSchedule()):
        o = sample_orders(sched, L, range(64), seed=3)
        assert (o.order == torch.arange(L)).all()
        assert (o.set_ids == torch.arange(L)).all()


def test_unit_window_is_a_uniformly_random_order():
    L, n = 6, 6000
    o = sample_orders(StaggeredSchedule(1.0, 1.0), L, range(n), seed=1)
    first = np.bincount(o.order[:, 0].numpy(), minlength=L)
    assert stats.chisquare(first).pvalue > 1e-3
    before = (o.set_ids[:, 0] < o.set_ids[:, L - 1]).double().mean().item()
    assert before == pytest.approx(0.5, abs=0.03)
    # whereas the D = 2 staggered schedule almost always reveals position 0 before L - 1
    o2 = sample_orders(StaggeredSchedule.from_mean_set_size(L, 2), L, range(500), seed=1)
    assert (o2.set_ids[:, 0] < o2.set_ids[:, L - 1]).all()


@pytest.mark.parametrize("kind", ["autoregressive", "staggered", "block", "masked"])
def test_context_first_in_position_order_and_padding_last(kind):
    L = 16
    sched = make_schedule(kind, L, mean_set_size=2, block_size=4)
    pos = torch.arange(L).expand(3, L)
    context = pos < torch.tensor([[0], [3], [6]])
    padding = pos >= torch.tensor([[16], [13], [10]])
    o = sample_orders(sched, L, [5, 6, 7], seed=0, context=context, padding=padding)
    for b in range(3):
        n_ctx, n_pad = int(context[b].sum()), int(padding[b].sum())
        assert o.order[b, :n_ctx].tolist() == list(range(n_ctx))
        assert o.set_ids[b, :n_ctx].tolist() == list(range(n_ctx))
        assert o.order[b, L - n_pad:].tolist() == list(range(L - n_pad, L))
        if n_pad:
            assert o.set_ids[b, padding[b]].min() > o.set_ids[b, ~padding[b]].max()
    assert not o.targets[context | padding].any() and o.targets[~(context | padding)].all()
    assert not o.noisy[context | padding].any()
    assert (o.loss_weight[context | padding] == 0).all()


@pytest.mark.parametrize("kind", ["autoregressive", "staggered", "block", "masked"])
def test_order_depends_on_global_index_not_on_rank_count(kind):
    L, n = 32, 12
    sched = make_schedule(kind, L, mean_set_size=4, block_size=8)
    whole = sample_orders(sched, L, range(n), seed=7)
    for world in (2, 3, 4):
        for rank in range(world):
            idx = list(range(rank, n, world))
            part = sample_orders(sched, L, idx, seed=7)
            for field in ("reveal_times", "order", "set_ids", "noisy", "loss_weight"):
                assert torch.equal(getattr(part, field), getattr(whole, field)[idx]), field
    if kind != "autoregressive":
        other = sample_orders(sched, L, range(n), seed=8)
        assert not torch.equal(other.reveal_times, whole.reveal_times)


def test_block_sets_are_blocks_and_noise_follows_the_set_time():
    L, B, n = 32, 8, 400
    o = sample_orders(make_schedule("block", L, block_size=B, t_min=0.2, t_max=0.9), L,
                      range(n), seed=0)
    assert (o.set_ids == torch.arange(L) // B).all()
    t = o.set_time
    assert (t > 0.2).all() and (t <= 0.9).all()
    # every token of a block shares its time; different blocks draw their own
    assert (t.view(n, L // B, B) == t.view(n, L // B, B)[..., :1]).all()
    assert t.view(n, L // B, B)[..., 0].std(dim=1).mean() > 0.05
    # P(masked | t) = t: the masked fraction matches the mean time
    assert o.noisy.double().mean().item() == pytest.approx(t.double().mean().item(), abs=0.02)
    assert torch.allclose(o.loss_weight[o.noisy], 1 / t[o.noisy])
    assert (o.loss_weight[~o.noisy] == 0).all()


@pytest.mark.parametrize("kind, most", [("masked", 0.6), ("block", 0.9)])
def test_stratified_times_keep_the_loss_and_lower_its_variance(kind, most):
    """MDLM / BD3LM antithetic sampling: the G samples of a step draw their (block) times one
    per stratum of the range, whatever the layout; the loss estimate of a fixed batch keeps its
    mean and loses variance (most for MDLM's one time per sequence; BD3LM's blocks already
    average several times per sequence)."""
    L, G, bs, steps = 32, 8, 8, 1000
    sched = make_schedule(kind, L, block_size=bs)
    nb = 1 if kind == "masked" else L // bs
    base = 1.0 + torch.rand(G, L, generator=torch.Generator().manual_seed(0))

    def estimates(strata):
        out = []
        for step in range(steps):
            o = sample_orders(sched, L, range(step * G, (step + 1) * G), seed=1, strata=strata)
            # a denoiser's per-token loss grows with how much of its set is masked
            frac = o.noisy.view(G, nb, L // nb).double().mean(-1, keepdim=True)
            nll = base * (1.0 + 4.0 * frac.expand(G, nb, L // nb).reshape(G, L))
            out.append(((o.loss_weight * nll).sum() / o.targets.sum()).item())
        return np.array(out)

    indep, strat = estimates(None), estimates(G)
    assert abs(strat.mean() - indep.mean()) < 4 * np.sqrt((indep.var() + strat.var()) / steps)
    assert strat.var() < most * indep.var(), (strat.var(), indep.var())
    # one time per stratum of [1e-3, 1] in each step; the same draws on any split of the batch
    step = sample_orders(sched, L, range(3 * G, 4 * G), seed=3, strata=G)
    t = step.set_time[:, ::bs if kind == "block" else L].double()
    cells = torch.ceil((t - 1e-3) / (1 - 1e-3) * G * nb - 1e-6) - 1
    assert sorted(cells.flatten().tolist()) == list(range(G * nb))
    part = sample_orders(sched, L, [3 * G + 1, 3 * G + 6], seed=3, strata=G)
    assert torch.equal(part.set_time, step.set_time[[1, 6]])


def test_masked_schedule_is_one_set_at_one_time():
    L = 20
    o = sample_orders(make_schedule("masked", L), L, range(50), seed=0)
    assert (o.set_ids == 0).all()
    assert (o.set_time == o.set_time[:, :1]).all()


def test_schedule_arguments_are_checked():
    with pytest.raises(ValueError, match="mean_set_size"):
        staggered_parameters(16, 17)
    with pytest.raises(ValueError, match="divide"):
        make_schedule("block", 30, block_size=4)
    with pytest.raises(ValueError, match="not a set-diffusion order"):
        make_schedule("causal", 16)
    with pytest.raises(ValueError, match="unknown order kind"):
        make_schedule("stagered", 16)
    with pytest.raises(ValueError, match="both context and padding"):
        both = torch.ones(1, 4, dtype=torch.bool)
        sample_orders(AutoregressiveSchedule(), 4, [0], 0, context=both, padding=both)
