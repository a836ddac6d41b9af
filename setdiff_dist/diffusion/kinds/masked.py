"""``masked``: MDLM (docs/method.md §2): the whole sequence is one set, masked at a single time
(clipped to ``[order.t_min, order.t_max]`` for training); decoded by MDLM's sampler, which has
no window."""

from . import Order, register
from .block import time_range_problems


@register
class Masked(Order):
    name = "masked"
    help = "MDLM: one set, masked diffusion"
    singleton = False
    decoder = "mdlm"
    fixed_window = True

    def schedule(self, order_cfg, seq_len, evaluation=False):
        from ..orders import MaskedSchedule

        t_min, t_max = (0.0, 1.0) if evaluation else (order_cfg.t_min, order_cfg.t_max)
        return MaskedSchedule(t_min, t_max)

    def default_window(self, order_cfg):
        return None  # every masked position is a candidate at every step

    def window_problem(self, order_cfg, asked):
        return (f"--window {asked}: an MDLM (order.kind=masked) checkpoint has no window (every "
                "masked position is a candidate at every step); drop --window")

    def problems(self, cfg) -> list[str]:
        return time_range_problems(cfg)
