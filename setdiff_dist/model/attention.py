"""Attention backends: megatron-core ``core_attention`` modules behind one interface.

megatron's ``SelfAttention`` projects q, k, v (column-parallel), applies rotary embeddings, and
calls ``core_attention(q [s,b,np,hn], k [s,b,ng,hn], v [s,b,ng,hn], attention_mask, ...)``, which
returns ``[s, b, np*hn]`` for the row-parallel output projection. Every backend here has that
contract; the layer spec picks one (``model.attention_backend``):

- ``sdpa``: torch SDPA with the dense boolean mask as SDPA takes it (True = may attend; one
  tensor per micro-batch, shared by the layers), or causal when no mask is given. The CPU path
  and the reference.
- ``flex``: FlexAttention with a block mask (GPU; forward also runs on CPU for tests).
- ``permuted_causal``: the permuted singleton form on causal kernels. Inputs are in reveal order,
  ``[clean ; noisy]``; clean queries run a causal attention, noisy queries a strictly causal one
  over the clean keys merged with their own noisy key by log-sum-exp. No mask is needed.
- ``te``: Transformer Engine's DotProductAttention with an arbitrary mask (GPU, FP8), from
  megatron's TE extension.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.module import MegatronModule

from .context import ContextMask


def _heads_first(q, k, v):
    """[s, b, n, d] -> [b, n, s, d], with k/v groups expanded to the query heads (GQA)."""
    rep = q.size(2) // k.size(2)
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    return tuple(t.permute(1, 2, 0, 3) for t in (q, k, v))


def _seq_first(o):
    """[b, n, s, d] -> [s, b, n*d]."""
    b, n, s, d = o.shape
    return o.permute(2, 0, 1, 3).reshape(s, b, n * d)


class _CoreAttention(MegatronModule):
    """The constructor megatron's Attention calls, shared by the backends."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, cp_comm_type=None,
                 softmax_scale=None, pg_collection=None):
        super().__init__(config)
        if config.context_parallel_size > 1:
            raise NotImplementedError(f"{type(self).__name__} has no context parallelism")
        self.layer_number = layer_number
        self.softmax_scale = softmax_scale  # None = 1/sqrt(head_dim)
        self.dropout_p = config.attention_dropout

    def _dropout(self):
        return self.dropout_p if self.training else 0.0

    def _context_parallel(self, query, key, value, attention_mask):
        """Under context parallelism (``attention_mask`` a
        :class:`~setdiff_dist.model.context.ContextMask`): this rank's queries over the
        gathered keys and values, under its rows of the mask."""
        from .context import attend

        with tensor_parallel.get_cuda_rng_tracker().fork():
            o = attend(query, key, value, attention_mask, self.softmax_scale, self._dropout())
        return _seq_first(o)


class SDPAAttention(_CoreAttention):
    """torch SDPA with a dense boolean mask ``[b, 1, s, s]`` (True = may attend)."""

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        if isinstance(attention_mask, ContextMask):
            return self._context_parallel(query, key, value, attention_mask)
        q, k, v = _heads_first(query, key, value)
        with tensor_parallel.get_cuda_rng_tracker().fork():  # per-TP-rank dropout streams
            o = F.scaled_dot_product_attention(
                q, k, v, attn_mask=attention_mask, is_causal=attention_mask is None,
                dropout_p=self._dropout(),
                scale=self.softmax_scale)
        return _seq_first(o)


@functools.cache
def compiled_once(func, **options):
    """``torch.compile(func, **options)``, made once per process for each function and options
    (FlexAttention's kernel here, its block-mask builder in :mod:`.forward`)."""
    return torch.compile(func, **options)


def _flex():
    """``flex_attention`` compiled (once per process): the fused kernel that skips masked
    blocks. Uncompiled, torch runs a reference that materialises every score; that path is
    kept for the CPU, where the compiled kernel has no backward (torch 2.13) and only tests run
    flex, forward only."""
    from torch.nn.attention.flex_attention import flex_attention

    return compiled_once(flex_attention, dynamic=False)


class FlexAttention(_CoreAttention):
    """FlexAttention, compiled on a GPU. ``attention_mask`` is a ``BlockMask`` (built once per
    micro-batch from the set ids and shared by the layers, see
    :func:`setdiff_dist.model.forward.set_diffusion_inputs`) or a dense mask."""

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        from torch.nn.attention.flex_attention import BlockMask, flex_attention

        if self._dropout() > 0:
            raise NotImplementedError("model.attention_backend=flex has no attention dropout")
        if query.device.type == "cpu" and torch.is_grad_enabled() and query.requires_grad:
            raise RuntimeError("model.attention_backend=flex cannot train on a CPU (torch's "
                               "FlexAttention has no CPU backward): use sdpa or permuted_causal, "
                               "or run flex on a GPU")
        q, k, v = _heads_first(query, key, value)
        if isinstance(attention_mask, BlockMask):
            kernel = _flex() if query.is_cuda else flex_attention
            o = kernel(q, k, v, block_mask=attention_mask, scale=self.softmax_scale)
        else:
            allowed = attention_mask  # (the dense form: True = may attend)
            o = flex_attention(q, k, v, scale=self.softmax_scale, score_mod=lambda s, b, h, qi, ki:
                               torch.where(allowed[b, 0, qi, ki], s, -float("inf")))
        return _seq_first(o)


class _CausalWithLSE(torch.autograd.Function):
    """Causal attention returning ``(out, logsumexp)``, both differentiable.

    The fused kernels return the log-sum-exp without a gradient. With one, the score gradient of
    attention becomes ``dS_ij = p_ij (dO_i . v_j - D_i + g_i)`` (``D_i = dO_i . O_i``, ``g`` the
    gradient of ``lse``; ``d lse_i / d s_ij = p_ij``): the plain backward with ``D_i - g_i`` in
    place of ``D_i``. On the CPU one call of the fused backward computes it, on head dimensions
    padded with zero columns (scores and values unchanged) where the padded output carries a 1
    and the padded output gradient ``-g``: ``D'_i = D_i - g_i``. Elsewhere the gradient is
    assembled from attention calls: ``d lse_i / d q_i = scale * sum_j p_ij k_j`` (attention with
    values = keys) and ``d lse_i / d k_j = scale * p_ij q_i`` (the value-gradient of an
    attention whose upstream gradient is ``g_lse * q``)."""

    @staticmethod
    def forward(ctx, q, k, v, scale):
        if q.device.type == "cpu":
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q, k, v, 0.0, True, scale=scale)
        else:
            out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
                q, k, v, None, True, 0.0, True, scale=scale)
            lse = lse[..., : q.size(2)]  # the CUDA kernel pads the sequence axis
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale = scale
        return out, lse

    @staticmethod
    def backward(ctx, g_out, g_lse):
        q, k, v, out, lse = ctx.saved_tensors
        scale = ctx.scale if ctx.scale is not None else q.size(-1) ** -0.5
        if q.device.type == "cpu":
            d, pad = q.size(-1), 8  # (8 zero columns: the kernel's vector width)
            g = F.pad(g_out.contiguous(), (0, pad))
            o = F.pad(out, (0, pad))
            o[..., d] = 1
            if g_lse is not None:
                g[..., d] = -g_lse.to(g.dtype)
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                g, *(F.pad(t, (0, pad)) for t in (q, k, v)), o, lse, 0.0, True, scale=scale)
            return dq[..., :d], dk[..., :d], dv[..., :d], None
        with torch.enable_grad():
            qd, kd, vd = (t.detach().requires_grad_() for t in (q, k, v))
            out = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=ctx.scale)
            dq, dk, dv = torch.autograd.grad(out, (qd, kd, vd), g_out)
            if g_lse is not None:
                g = g_lse.unsqueeze(-1).to(q.dtype)
                kv = kd.detach().requires_grad_()
                pk = F.scaled_dot_product_attention(qd.detach(), kd.detach(), kv, is_causal=True,
                                                    scale=ctx.scale)
                dk_lse, = torch.autograd.grad(pk, kv, scale * g * q)
                dq = dq + scale * g * pk.detach()
                dk = dk + dk_lse
        return dq, dk, dv, None


class PermutedCausalAttention(_CoreAttention):
    """The permuted singleton form on causal kernels (no mask): the sequence is
    ``[clean ; noisy]`` in reveal order, ``L`` tokens each."""

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        if self._dropout() > 0:
            raise NotImplementedError("model.attention_backend=permuted_causal has no attention "
                                      "dropout")
        if isinstance(attention_mask, ContextMask):  # (rows of the reveal order's mask)
            return self._context_parallel(query, key, value, attention_mask)
        q, k, v = _heads_first(query, key, value)
        L = q.size(2) // 2
        qc, qn = q[:, :, :L], q[:, :, L:]
        kc, kn = k[:, :, :L], k[:, :, L:]
        vc, vn = v[:, :, :L], v[:, :, L:]
        scale = self.softmax_scale if self.softmax_scale is not None else q.size(-1) ** -0.5
        clean = F.scaled_dot_product_attention(qc, kc, vc, is_causal=True, scale=scale)
        # noisy query i: clean keys j < i (a causal attention shifted by one) and its own key
        o_prev, lse_prev = _CausalWithLSE.apply(qn[:, :, 1:], kc[:, :, :-1], vc[:, :, :-1], scale)
        s_self = (qn * kn).sum(-1) * scale                       # [b, n, L]
        m = torch.maximum(lse_prev, s_self[:, :, 1:])
        w_prev = torch.exp(lse_prev - m).unsqueeze(-1)
        w_self = torch.exp(s_self[:, :, 1:] - m).unsqueeze(-1)
        # (the merge runs in the log-sum-exp's fp32; the result in the activations' dtype)
        noisy_rest = ((o_prev * w_prev + vn[:, :, 1:] * w_self) / (w_prev + w_self)).to(q.dtype)
        noisy = torch.cat([vn[:, :, :1], noisy_rest], dim=2)     # query 0 sees only itself
        return _seq_first(torch.cat([clean, noisy], dim=2))


def te_attention_class():
    """Transformer Engine's core attention, imported only when asked for."""
    try:
        from megatron.core.extensions.transformer_engine import TEDotProductAttention
    except Exception as exc:  # ImportError, or TE failing to load its CUDA libraries
        raise RuntimeError("model.attention_backend=te needs Transformer Engine on a CUDA machine "
                           "(pip install '.[gpu]', or the docker image); on CPUs use sdpa") from exc
    return TEDotProductAttention


def core_attention_class(backend: str):
    """The core attention module of ``model.attention_backend``."""
    if backend == "sdpa":
        return SDPAAttention
    if backend == "flex":
        return FlexAttention
    if backend == "permuted_causal":
        return PermutedCausalAttention
    if backend == "te":
        return te_attention_class()
    if backend == "auto":
        raise ValueError("model.attention_backend=auto is resolved by the order when the config "
                         "is loaded (setdiff_dist.config.resolve_attention_backend); this model "
                         "config was built without it")
    raise ValueError(f"unknown attention backend {backend!r}")
