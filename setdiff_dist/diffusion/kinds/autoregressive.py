"""``autoregressive``: left-to-right singleton sets (docs/method.md §2) through the set-diffusion
model: the NELBO of this order is the exact log-likelihood."""

from . import Order, register


@register
class Autoregressive(Order):
    name = "autoregressive"
    help = "left to right, one token per set"
    exact_likelihood = True

    def schedule(self, order_cfg, seq_len, evaluation=False):
        from ..orders import AutoregressiveSchedule

        return AutoregressiveSchedule()
