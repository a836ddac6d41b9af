"""The set-causal mask: docs/method.md §3, checked with property-based tests."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.attention.flex_attention import create_mask

from setdiff_dist.diffusion import (
    from_reveal_order,
    make_schedule,
    permuted_singleton_mask,
    permuted_singleton_mask_mod,
    sample_orders,
    set_causal_mask,
    set_causal_mask_mod,
    to_reveal_order,
)

KINDS = ["autoregressive", "staggered", "block", "masked"]


@st.composite
def batches(draw, kinds=KINDS):
    """A random schedule and batch, with random context and padding lengths."""
    kind = draw(st.sampled_from(kinds))
    block = draw(st.sampled_from([1, 2, 4]))
    L = block * draw(st.integers(1, 8)) if kind == "block" else draw(st.integers(2, 24))
    D = draw(st.floats(1.0, float(L)))
    B = draw(st.integers(1, 3))
    ctx_len = torch.tensor(draw(st.lists(st.integers(0, L // 2), min_size=B, max_size=B)))
    pad_len = torch.tensor(draw(st.lists(st.integers(0, L // 3), min_size=B, max_size=B)))
    pos = torch.arange(L).expand(B, L)
    context = pos < ctx_len[:, None]
    padding = (pos >= (L - pad_len)[:, None]) & ~context
    sched = make_schedule(kind, L, mean_set_size=D, block_size=block)
    seed = draw(st.integers(0, 2**31))
    first = draw(st.integers(0, 10**6))
    return sched, sample_orders(sched, L, range(first, first + B), seed, context=context,
                                padding=padding)


def test_autoregressive_schedule_gives_the_causal_pattern():
    L = 9
    o = sample_orders(make_schedule("autoregressive", L), L, [0], seed=0)
    m = set_causal_mask(o.set_ids)[0]
    tril = torch.ones(L, L, dtype=torch.bool).tril()
    assert torch.equal(m[:L, :L], tril)                       # clean: causal
    assert torch.equal(m[L:, :L], tril.tril(-1))              # noisy -> strictly earlier clean
    assert torch.equal(m[L:, L:], torch.eye(L, dtype=torch.bool))  # noisy -> itself only
    assert not m[:L, L:].any()


def bd3lm_mask(L: int, B: int) -> torch.Tensor:
    """BD3LM's vectorized mask as its paper defines it, over [x_t ; x_0] (noisy first):
    M_BD (block-diagonal, x_t -> x_t), M_OBC (offset block-causal, x_t -> earlier x_0 blocks),
    M_BC (block-causal, x_0 -> x_0)."""
    q = torch.arange(2 * L)[:, None]
    k = torch.arange(2 * L)[None, :]
    q_x0, k_x0 = q >= L, k >= L
    bq, bk = (q % L) // B, (k % L) // B
    m_bd = ~q_x0 & ~k_x0 & (bq == bk)
    m_obc = ~q_x0 & k_x0 & (bk < bq)
    m_bc = q_x0 & k_x0 & (bk <= bq)
    return m_bd | m_obc | m_bc


def test_block_schedule_gives_exactly_bd3lms_three_part_mask():
    for L, B in [(16, 4), (12, 3), (8, 1), (8, 8)]:
        o = sample_orders(make_schedule("block", L, block_size=B), L, [0, 1], seed=0)
        ours = set_causal_mask(o.set_ids)
        theirs = bd3lm_mask(L, B)
        # ours is [clean ; noisy]: swap both axes' halves to BD3LM's [x_t ; x_0]
        swap = torch.cat([torch.arange(L, 2 * L), torch.arange(L)])
        for b in range(2):
            assert torch.equal(ours[b][swap][:, swap], theirs), (L, B)


@settings(max_examples=150, deadline=None)
@given(batches())
def test_no_clean_query_ever_sees_a_noisy_key(case):
    _, o = case
    L = o.seq_len
    m = set_causal_mask(o.set_ids)
    assert not m[:, :L, L:].any()
    # and every query attends at least one key (no empty softmax rows)
    assert m.any(dim=2).all()
    # a noisy query sees its own noisy copy; a clean query sees its own clean copy
    assert m[:, torch.arange(L, 2 * L), torch.arange(L, 2 * L)].all()
    assert m[:, torch.arange(L), torch.arange(L)].all()


@settings(max_examples=150, deadline=None)
@given(batches(kinds=["autoregressive", "staggered"]))
def test_permuted_static_form_allows_the_same_pairs_as_the_per_sample_form(case):
    _, o = case
    L = o.seq_len
    dense = set_causal_mask(o.set_ids)
    static = permuted_singleton_mask(L)
    # independent statement of the static form (docs/method.md §3)
    i = torch.arange(L)
    assert torch.equal(static[:L, :L], i[None] <= i[:, None])
    assert torch.equal(static[L:, :L], i[None] < i[:, None])
    assert torch.equal(static[L:, L:], i[None] == i[:, None])
    assert not static[:L, L:].any()
    for b in range(o.set_ids.shape[0]):
        perm = torch.cat([o.order[b], o.order[b] + L])  # reveal-order row -> original index
        assert torch.equal(dense[b][perm][:, perm], static)
    # gathering set ids into reveal order yields 0..L-1, and the inverse undoes it
    s = to_reveal_order(o.set_ids, o.order)
    assert (s == torch.arange(L)).all()
    assert torch.equal(from_reveal_order(s, o.order), o.set_ids)


@settings(max_examples=40, deadline=None)
@given(batches())
def test_flex_attention_mask_mod_equals_the_dense_mask(case):
    _, o = case
    B, L = o.set_ids.shape
    flex = create_mask(set_causal_mask_mod(o.set_ids), B, 1, 2 * L, 2 * L, device="cpu")
    assert torch.equal(flex[:, 0], set_causal_mask(o.set_ids))


def test_permuted_mask_mod_equals_the_static_mask():
    L = 13
    flex = create_mask(permuted_singleton_mask_mod(L), 1, 1, 2 * L, 2 * L, device="cpu")
    assert torch.equal(flex[0, 0], permuted_singleton_mask(L))


def test_to_reveal_order_handles_feature_dimensions():
    x = torch.randn(2, 5, 3)
    order = torch.stack([torch.randperm(5) for _ in range(2)])
    y = to_reveal_order(x, order)
    assert torch.equal(y[1, 2], x[1, order[1, 2]])
    assert torch.equal(from_reveal_order(y, order), x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_causal_attention_with_lse_has_exact_gradients(dtype):
    """permuted_causal's building block: causal attention returning its log-sum-exp, both
    differentiable (one fused backward on the CPU), against autograd through a dense float64
    attention."""
    from setdiff_dist.model.attention import _CausalWithLSE

    torch.manual_seed(0)
    b, n, s, d = 2, 3, 37, 16
    q, k, v = (torch.randn(b, n, s, d, dtype=torch.float64, requires_grad=True)
               for _ in range(3))
    g_out, g_lse = torch.randn(b, n, s, d, dtype=torch.float64), torch.randn(b, n, s,
                                                                             dtype=torch.float64)
    scores = (q @ k.transpose(-1, -2)) * d ** -0.5
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    out, lse = torch.softmax(scores, -1) @ v, torch.logsumexp(scores, -1)
    want = torch.autograd.grad((out * g_out).sum() + (lse * g_lse).sum(), (q, k, v))
    low = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    out2, lse2 = _CausalWithLSE.apply(*low, None)
    got = torch.autograd.grad((out2 * g_out.to(dtype)).sum() + (lse2 * g_lse.to(dtype)).sum(),
                              low)
    tol = 1e-5 if dtype == torch.float32 else 5e-2
    assert torch.allclose(out2.double(), out, atol=tol) and torch.allclose(lse2.double(), lse,
                                                                            atol=tol)
    for a, w in zip(got, want):
        assert torch.allclose(a.double(), w, atol=tol * 4, rtol=tol), float((a.double() - w)
                                                                             .abs().max())


def test_a_decoding_steps_mask_is_the_training_masks_rule():
    """The decoders' per-step mask (step_mask) is the training mask restricted to the step's
    tokens: any clean and noisy tokens of any sets, taken from [clean ; noisy]."""
    from setdiff_dist.diffusion.masks import step_mask

    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        L = 12
        set_ids = torch.sort(torch.randint(0, 6, (L,), generator=g)).values
        set_ids = set_ids[torch.randperm(L, generator=g)]
        full = set_causal_mask(set_ids[None])[0]
        index = torch.randperm(2 * L, generator=g)[:9]  # (a step's tokens, from both halves)
        noisy = index >= L
        got = step_mask(set_ids[index % L], noisy)
        assert torch.equal(got, full[index][:, index])
