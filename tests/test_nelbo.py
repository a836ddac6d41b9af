"""The NELBO: docs/method.md §4, on the pure-torch reference transformer."""

import math

import pytest
import torch

from setdiff_dist.diffusion import (
    OrderSample,
    from_reveal_order,
    make_schedule,
    nelbo,
    permuted_singleton_mask,
    perplexity_bound,
    sample_orders,
    set_causal_mask,
    to_reveal_order,
    token_nll,
    two_copy_inputs,
)
from setdiff_dist.model.reference import ReferenceTransformer, sequential_ar_nll

V = 23


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    # a larger init than training uses, so that predictions depend strongly on the context
    return ReferenceTransformer(V, hidden_size=32, num_layers=2, num_heads=4, init_std=0.3).eval()


def vectorized_nll(model, x, o):
    """The training forward: one pass over [clean ; noisy] with the set-causal mask."""
    L = x.shape[1]
    tokens, positions = two_copy_inputs(x, o, model.mask_id)
    logits = model(tokens, positions, set_causal_mask(o.set_ids))
    return token_nll(logits[:, L:], x)


def test_autoregressive_order_nelbo_equals_sequential_exact_nll(model):
    B, L = 3, 14
    x = torch.randint(0, V, (B, L), generator=torch.Generator().manual_seed(1))
    o = sample_orders(make_schedule("autoregressive", L), L, range(B), seed=0)
    with torch.no_grad():
        vec = vectorized_nll(model, x, o)
        seq = sequential_ar_nll(model, x)
    assert torch.allclose(vec.double(), seq, atol=1e-5, rtol=1e-5)
    bound = nelbo(vec, o)
    assert bound.tokens == B * L
    assert bound.total.item() == pytest.approx(seq.sum().item(), rel=1e-6)
    # a meaningful identity: the model is far from uniform and the context matters
    assert abs(seq.mean().item() - math.log(V)) > 0.1
    assert (seq[:, 1:] - seq[:, :1]).abs().max() > 0.5


def test_autoregressive_identity_excludes_the_prompt(model):
    B, L, P = 2, 10, 4
    x = torch.randint(0, V, (B, L), generator=torch.Generator().manual_seed(2))
    context = torch.arange(L).expand(B, L) < P
    o = sample_orders(make_schedule("autoregressive", L), L, range(B), 0, context=context)
    with torch.no_grad():
        vec = vectorized_nll(model, x, o)
        seq = sequential_ar_nll(model, x)
    bound = nelbo(vec, o)
    assert bound.tokens == B * (L - P)
    assert bound.total.item() == pytest.approx(seq[:, P:].sum().item(), rel=1e-5)


def test_masked_schedule_loss_equals_the_mdlm_formula_by_hand():
    # L = 3 tokens, vocabulary of 3; tokens 0 and 2 masked at t = 0.25
    x = torch.tensor([[2, 0, 1]])
    o = OrderSample(reveal_times=torch.tensor([[0.1, 0.7, 0.2]], dtype=torch.float64),
                    order=torch.tensor([[1, 2, 0]]), set_ids=torch.zeros(1, 3, dtype=torch.long),
                    noisy=torch.tensor([[True, False, True]]),
                    targets=torch.ones(1, 3, dtype=torch.bool),
                    set_time=torch.full((1, 3), 0.25),
                    loss_weight=torch.tensor([[4.0, 0.0, 4.0]]))
    logits = torch.tensor([[[1.0, 0.0, 2.0], [0.0, 0.0, 0.0], [0.5, 1.5, -1.0]]])
    # MDLM: NELBO = 1/t * sum over masked l of -log softmax(logits_l)[x_l]
    lse0 = math.log(math.e ** 1.0 + 1.0 + math.e ** 2.0)
    lse2 = math.log(math.e ** 0.5 + math.e ** 1.5 + math.e ** -1.0)
    by_hand = 4.0 * ((lse0 - 2.0) + (lse2 - 1.5))
    got = nelbo(token_nll(logits, x), o)
    assert got.total.item() == pytest.approx(by_hand, rel=1e-6)
    assert got.tokens.item() == 3
    assert got.per_token.item() == pytest.approx(by_hand / 3, rel=1e-6)


def test_masked_schedule_samples_weight_masked_tokens_by_one_over_t():
    L = 16
    o = sample_orders(make_schedule("masked", L), L, range(8), seed=5)
    nll = torch.rand(8, L, generator=torch.Generator().manual_seed(0))
    t = o.set_time[:, 0:1].double()
    mdlm = (o.noisy.double() * nll.double() / t).sum()
    assert nelbo(nll, o).total.item() == pytest.approx(mdlm.item(), rel=1e-6)


def test_unpredicted_tokens_cannot_poison_the_loss():
    L = 6
    o = sample_orders(make_schedule("block", L, block_size=3), L, [0], 0,
                      context=torch.arange(L)[None] < 2)
    nll = torch.full((1, L), 1.0)
    nll[~o.noisy] = float("inf")
    assert math.isfinite(nelbo(nll, o).total.item())


def test_perplexity_bound():
    assert perplexity_bound(0.0, 10) == 1.0
    assert perplexity_bound(10 * math.log(7.0), 10) == pytest.approx(7.0)


@pytest.mark.parametrize("kind", ["autoregressive", "staggered"])
def test_permuted_form_gives_the_same_per_token_losses(model, kind):
    B, L = 2, 12
    x = torch.randint(0, V, (B, L), generator=torch.Generator().manual_seed(3))
    pad = torch.arange(L).expand(B, L) >= torch.tensor([[12], [9]])
    o = sample_orders(make_schedule(kind, L, mean_set_size=3), L, range(B), 4, padding=pad)
    tokens, positions = two_copy_inputs(x, o, model.mask_id)
    with torch.no_grad():
        dense = token_nll(model(tokens, positions, set_causal_mask(o.set_ids))[:, L:], x)
        # both halves gathered into reveal order; one static mask; rotary on original positions
        perm = torch.cat([o.order, o.order + L], dim=1)
        logits = model(tokens.gather(1, perm), positions.gather(1, perm),
                       permuted_singleton_mask(L))
        permuted = from_reveal_order(token_nll(logits[:, L:], to_reveal_order(x, o.order)), o.order)
    keep = o.targets
    assert torch.allclose(dense[keep], permuted[keep], atol=1e-5)


def test_clean_half_never_depends_on_the_noisy_half(model):
    B, L = 2, 10
    x = torch.randint(0, V, (B, L), generator=torch.Generator().manual_seed(4))
    o = sample_orders(make_schedule("block", L, block_size=5), L, range(B), 0)
    tokens, positions = two_copy_inputs(x, o, model.mask_id)
    mask = set_causal_mask(o.set_ids)
    changed = tokens.clone()
    changed[:, L:] = torch.randint(0, V, (B, L))
    with torch.no_grad():
        a, b = model(tokens, positions, mask), model(changed, positions, mask)
    assert torch.equal(a[:, :L], b[:, :L])
    assert not torch.allclose(a[:, L:], b[:, L:])


@pytest.mark.parametrize("kind", ["masked", "block"])
def test_the_masked_mean_training_loss_is_the_references_mdlm_loss(kind):
    """order.training_loss=masked_mean: per sequence, the unweighted mean -log p over its
    masked tokens (0 for a sequence with none), averaged over the sequences, as the
    reference's MDLM._compute_loss trains MDLM and BD3LM; the trainer's normalizer counts
    sequences; evaluation keeps the NELBO."""
    from types import SimpleNamespace

    from setdiff_dist.config import load_config
    from setdiff_dist.objective import Objective, masked_mean_weights

    L, B = 16, 8
    o = sample_orders(make_schedule(kind, L), L, range(B), seed=5)
    nll = torch.rand(B, L, generator=torch.Generator().manual_seed(0))
    masked = o.loss_weight > 0
    by_hand = sum((nll[b][masked[b]].mean() if masked[b].any() else torch.tensor(0.0))
                  for b in range(B))
    got = nelbo(nll, masked_mean_weights(o))
    assert got.total.item() == pytest.approx(float(by_hand), rel=1e-6)
    assert not torch.equal(masked, o.targets)  # (the revealed tokens are not counted)
    cfg = load_config(None, [f"order.kind={kind}", "order.training_loss=masked_mean",
                             f"data.seq_len={L}"])
    batch = SimpleNamespace(padding=torch.zeros(B, L, dtype=torch.bool),
                            context=torch.zeros(B, L, dtype=torch.bool))
    assert Objective(cfg, seed=0).target_mask(batch).sum() == B
    assert Objective(cfg, seed=0, evaluation=True).target_mask(batch).sum() == B * (L - 1)
    from setdiff_dist.config import ConfigError

    with pytest.raises(ConfigError, match="masked_mean is the masked-diffusion loss"):
        load_config(None, ["order.kind=staggered", "order.training_loss=masked_mean"])


def test_every_report_bounds_perplexity_alike():
    """One policy (``perplexity_bound``): a per-token loss past 50 nats reports exp(50), not an
    overflow; nan stays nan; and no report computes its own ``exp`` of a loss."""
    from setdiff_dist.diffusion.nelbo import MAX_LOG_PPL

    assert perplexity_bound(2.0) == pytest.approx(math.exp(2.0))
    assert perplexity_bound(1e4) == perplexity_bound(math.inf) == math.exp(MAX_LOG_PPL)
    assert math.isnan(perplexity_bound(math.nan))
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parents[1] / "setdiff_dist"
    own = [f"{p.relative_to(root)}:{i}" for p in sorted(root.rglob("*.py"))
           for i, line in enumerate(p.read_text().splitlines(), 1)
           if re.search(r"math\.exp\(.*(loss|per_token|nelbo)", line)
           and p.name != "nelbo.py"]
    assert own == [], own
