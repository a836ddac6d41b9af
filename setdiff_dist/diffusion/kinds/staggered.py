"""``staggered``: SetDLM's sliding-window schedule (docs/method.md §2): sets of mean size
``order.mean_set_size`` (D) and at most ``order.max_set_size`` (S_max, 2D by default), from
autoregression (D = 1) towards masked diffusion."""

from . import Order, register


@register
class Staggered(Order):
    name = "staggered"
    help = "SetDLM's sliding windows (order.mean_set_size, order.max_set_size)"

    def schedule(self, order_cfg, seq_len, evaluation=False):
        from ..orders import StaggeredSchedule

        return StaggeredSchedule.from_mean_set_size(seq_len, order_cfg.mean_set_size,
                                                    order_cfg.max_set_size)

    def default_window(self, order_cfg):
        return max(1, round(order_cfg.mean_set_size))  # W = D, the paper's GSM point

    def largest_set(self, order_cfg):
        return order_cfg.max_set_size or 2 * order_cfg.mean_set_size

    def problems(self, cfg) -> list[str]:
        o, L, p = cfg.order, cfg.data.seq_len, []
        if o.mean_set_size > L:
            p.append(f"order.mean_set_size={o.mean_set_size:g} is larger than data.seq_len={L}: "
                     "a set cannot hold more tokens than the sequence")
        if o.max_set_size is not None and o.max_set_size < o.mean_set_size:
            p.append(f"order.max_set_size={o.max_set_size:g} is below "
                     f"order.mean_set_size={o.mean_set_size:g}")
        return p
