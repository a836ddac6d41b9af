"""``any_order``: any-order autoregression (sigma-GPT, AO-ARMs): singleton sets revealed in a
uniformly random order, each sample its own permutation. The model learns every conditional
``p(x_l | x_S)`` a left-to-right model learns and more; its NELBO is the expectation over
orders of their log-likelihoods, a bound (exact only in a single order). It decodes through the
set decoder, one token per set by default (W = 1: left to right); a wider window lets the
decoder pick among several positions the most confident one, which this order trains for.

This file is the whole kind: the config, the trainer, evaluation and decoding find it through
:func:`setdiff_dist.diffusion.kinds.order_of`."""

from ..schedule import OrderSchedule
from . import Order, register


class AnyOrderSchedule(OrderSchedule):
    """Reveal times drawn i.i.d. uniform: the order they sort into is a uniformly random
    permutation, one token per set."""

    name = "any_order"

    def draw(self, seq_len, gen):
        import torch

        R = torch.rand(seq_len, generator=gen, dtype=torch.float64)
        return R, torch.arange(seq_len), None, None


@register
class AnyOrder(Order):
    name = "any_order"
    help = "any-order autoregression: one token per set, a uniformly random order"

    def schedule(self, order_cfg, seq_len, evaluation=False):
        return AnyOrderSchedule()
