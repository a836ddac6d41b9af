"""``block``: BD3LM (docs/method.md §2): blocks of ``order.block_size`` positions left to right,
masked diffusion inside each block at its own time (clipped to ``[order.t_min, order.t_max]``
for training); decoded block by block on the training grid."""

from . import Order, register


def time_range_problems(cfg) -> list[str]:
    """The in-set diffusion time range of the block and masked orders."""
    if cfg.order.t_min >= cfg.order.t_max:
        return [f"order.t_min={cfg.order.t_min} must be below order.t_max={cfg.order.t_max}"]
    return []


@register
class Block(Order):
    name = "block"
    help = "BD3LM's blocks (order.block_size), masked diffusion inside each"
    singleton = False
    decoder = "block"
    fixed_window = True

    def schedule(self, order_cfg, seq_len, evaluation=False):
        from ..orders import BlockSchedule

        if seq_len % order_cfg.block_size:
            raise ValueError(f"block_size={order_cfg.block_size} must divide "
                             f"seq_len={seq_len}")
        t_min, t_max = (0.0, 1.0) if evaluation else (order_cfg.t_min, order_cfg.t_max)
        return BlockSchedule(order_cfg.block_size, t_min, t_max)

    def default_window(self, order_cfg):
        return order_cfg.block_size

    def window_problem(self, order_cfg, asked):
        if asked != order_cfg.block_size:
            return (f"--window {asked}: a block-diffusion (BD3LM) checkpoint decodes its own "
                    f"blocks of order.block_size = {order_cfg.block_size}; drop --window")
        return None

    def problems(self, cfg) -> list[str]:
        L, B = cfg.data.seq_len, cfg.order.block_size
        p = [f"order.block_size={B} must divide data.seq_len={L}"] if B > L or L % B else []
        return p + time_range_problems(cfg)
