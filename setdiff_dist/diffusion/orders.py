"""Order schedules (docs/method.md §2): reveal times, the order they induce, and set ids.

Every position ``l`` of a sample gets a reveal time ``R_l`` in [0, 1] (larger = revealed
earlier). Sorting by decreasing ``R`` gives the order; tokens revealed together form a set.
Context (prompt) tokens get ``R = +inf`` and come first, in position order; padding gets
``R = -inf`` and comes last. Each context and padding token is a set of its own.

All randomness of a sample (its reveal times and, for in-set diffusion, the per-set time and
the masking draws) comes from a generator seeded by ``(seed, stream, global sample index)``, so
a sample's order does not depend on the rank that reads it, nor on the batch it lands in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from .schedule import OrderSchedule

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def sample_seed(seed: int, index: int, stream: int = 0) -> int:
    """A 63-bit seed mixed from (seed, stream, index); nearby inputs give unrelated seeds."""
    h = _splitmix64(seed & _MASK64)
    h = _splitmix64(h ^ (stream & _MASK64))
    h = _splitmix64(h ^ (index & _MASK64))
    return h >> 1


def sample_generator(seed: int, index: int, stream: int = 0) -> torch.Generator:
    """The CPU generator of one sample: every random draw of that sample comes from it."""
    g = torch.Generator(device="cpu")
    g.manual_seed(sample_seed(seed, index, stream))
    return g


def staggered_parameters(seq_len: int, mean_set_size: float,
                         max_set_size: Optional[float] = None) -> tuple[float, float]:
    """Window width ``w`` and shape ``k`` of the staggered sliding-window schedule.

    ``S_max = max_set_size`` (default ``2 D``), ``w = S_max / (L + S_max - 1)`` and ``k`` solves
    ``k / (k + 1) * w = D / (2 L)``. For ``D = 1`` or ``D = S_max`` the windows are uniform
    (``k = 1``) with ``w = D / L``; ``D = 1`` is then exactly autoregressive."""
    L, D = int(seq_len), float(mean_set_size)
    s_max = 2.0 * D if max_set_size is None else float(max_set_size)
    if L < 2:
        raise ValueError(f"seq_len must be at least 2, got {seq_len}")
    if not 1.0 <= D <= L:
        raise ValueError(f"mean_set_size must lie in [1, seq_len={L}], got {mean_set_size}")
    if s_max < D:
        raise ValueError(f"max_set_size={s_max} is below mean_set_size={D}")
    if D == 1.0 or D == s_max:
        return D / L, 1.0
    w = s_max / (L + s_max - 1.0)
    target = D / (2.0 * L)
    return w, target / (w - target)


class AutoregressiveSchedule(OrderSchedule):
    """Deterministic left-to-right reveal: singleton sets, ``s_l = l``."""

    name = "autoregressive"

    def draw(self, seq_len, gen):
        pos = torch.arange(seq_len, dtype=torch.float64)
        return 1.0 - (pos + 0.5) / seq_len, torch.arange(seq_len), None, None


class StaggeredSchedule(OrderSchedule):
    """SetDLM's sliding windows: position ``l`` is revealed inside
    ``[a_l, a_l + w]``, ``a_l = (1 - w)(1 - l / (L - 1))``, with survival ``(1 - u)^k``."""

    name = "staggered"

    def __init__(self, window: float, shape: float):
        if not 0.0 < window <= 1.0:
            raise ValueError(f"window must be in (0, 1], got {window}")
        if shape <= 0.0:
            raise ValueError(f"shape must be positive, got {shape}")
        self.window, self.shape = float(window), float(shape)

    @classmethod
    def from_mean_set_size(cls, seq_len: int, mean_set_size: float,
                           max_set_size: Optional[float] = None) -> "StaggeredSchedule":
        return cls(*staggered_parameters(seq_len, mean_set_size, max_set_size))

    def offsets(self, seq_len: int) -> torch.Tensor:
        pos = torch.arange(seq_len, dtype=torch.float64)
        return (1.0 - self.window) * (1.0 - pos / (seq_len - 1))

    def survival(self, t: torch.Tensor, seq_len: int) -> torch.Tensor:
        """``alpha^l_t = P(R_l > t)`` for every position: ``[..., L]`` for ``t`` of shape
        ``[...]``."""
        u = (t.to(torch.float64)[..., None] - self.offsets(seq_len)) / self.window
        return (1.0 - u.clamp(0.0, 1.0)) ** self.shape

    def draw(self, seq_len, gen):
        U = torch.rand(seq_len, generator=gen, dtype=torch.float64)
        R = self.offsets(seq_len) + self.window * (1.0 - U ** (1.0 / self.shape))
        return R, torch.arange(seq_len), None, None

    def __repr__(self) -> str:
        return f"StaggeredSchedule(window={self.window:.6g}, shape={self.shape:.6g})"


T_EPS = 1e-3  # the floor of in-set diffusion times (the 1/t weight's variance is unbounded at 0)


class BlockSchedule(OrderSchedule):
    """BD3LM: blocks of ``B`` positions revealed left to right; inside block ``b`` every token is
    masked with probability ``t_b ~ U(max(t_min, T_EPS), t_max]``, its own time (the reference
    code's floor :data:`T_EPS`; ``t_min`` / ``t_max`` clip it further for training only)."""

    name = "block"
    singleton = False

    def __init__(self, block_size: int, t_min: float = 0.0, t_max: float = 1.0):
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if not 0.0 <= t_min < t_max <= 1.0:
            raise ValueError(f"need 0 <= t_min < t_max <= 1, got [{t_min}, {t_max}]")
        self.block_size, self.t_min, self.t_max = int(block_size), float(t_min), float(t_max)

    def size(self, seq_len: int) -> int:
        """Tokens per set for a sequence of ``seq_len``."""
        return self.block_size

    def draw(self, seq_len, gen, stratum: Optional[tuple[int, int]] = None):
        """``stratum = (j, G)``: this is sample ``j`` of ``G`` in a batch whose times are
        stratified (:func:`sample_orders`): block ``b`` draws its time inside stratum
        ``j * blocks + b`` of ``G * blocks`` equal parts of the range."""
        group = torch.arange(seq_len) // self.size(seq_len)
        n_blocks = int(group[-1]) + 1
        u = torch.rand(seq_len, generator=gen, dtype=torch.float64)
        # 1 - U lies in (0, 1]; the floor keeps the 1/t weight's variance bounded
        lo = max(self.t_min, T_EPS)
        w = 1.0 - torch.rand(n_blocks, generator=gen, dtype=torch.float64)
        if stratum is not None:
            j, strata = stratum
            w = (j * n_blocks + torch.arange(n_blocks, dtype=torch.float64) + w) / \
                (strata * n_blocks)
        t = lo + (self.t_max - lo) * w
        R = (n_blocks - 1 - group.to(torch.float64) + u) / n_blocks
        return R, group, u, t

    def __repr__(self) -> str:
        return f"BlockSchedule(block_size={self.block_size}, t=({self.t_min}, {self.t_max}])"


class MaskedSchedule(BlockSchedule):
    """MDLM: the whole sequence is one set noised at a single ``t`` (linear ``alpha_t = 1 - t``)."""

    name = "masked"

    def __init__(self, t_min: float = 0.0, t_max: float = 1.0):
        super().__init__(1, t_min, t_max)

    def size(self, seq_len: int) -> int:
        return seq_len

    def __repr__(self) -> str:
        return f"MaskedSchedule(t=({self.t_min}, {self.t_max}])"


def make_schedule(kind: str, seq_len: int, *, mean_set_size: float = 4.0,
                  max_set_size: Optional[float] = None, block_size: int = 4,
                  t_min: float = 0.0, t_max: float = 1.0) -> OrderSchedule:
    """The schedule of the order named ``kind`` (:mod:`setdiff_dist.diffusion.kinds`) with
    these settings (those of ``OrderConfig``)."""
    from types import SimpleNamespace

    from .kinds import order_of

    settings = SimpleNamespace(kind=kind, mean_set_size=mean_set_size,
                               max_set_size=max_set_size, block_size=block_size, t_min=t_min,
                               t_max=t_max)
    return order_of(kind).schedule(settings, seq_len)


def schedule_from_config(order_cfg, seq_len: int, evaluation: bool = False) -> OrderSchedule:
    """Build the schedule of a :class:`setdiff_dist.config.OrderConfig`. ``evaluation``: the
    likelihood bound's schedule, with the unclipped time range (a range clipped for training
    is not a valid ELBO)."""
    from .kinds import order_of

    return order_of(order_cfg).schedule(order_cfg, seq_len, evaluation=evaluation)


@dataclass
class OrderSample:
    """Orders, sets and noise of a batch. All tensors are ``[B, L]``."""

    reveal_times: torch.Tensor  # float64; +inf context, -inf padding
    order: torch.Tensor         # long; positions sorted by decreasing reveal time
    set_ids: torch.Tensor       # long; 0 = first revealed set
    noisy: torch.Tensor         # bool; [MASK] in the noisy copy
    targets: torch.Tensor       # bool; counted in the NELBO (neither context nor padding)
    set_time: torch.Tensor      # float32; diffusion time of the token's set (1 for singletons)
    loss_weight: torch.Tensor   # float32; weight of the token's -log p (0 if not predicted)

    def to(self, device) -> "OrderSample":
        return OrderSample(**{k: v.to(device) for k, v in self.__dict__.items()})

    @property
    def seq_len(self) -> int:
        return self.set_ids.shape[1]


def sample_orders(schedule: OrderSchedule, seq_len: int, indices: Sequence[int] | torch.Tensor,
                  seed: int, *, context: Optional[torch.Tensor] = None,
                  padding: Optional[torch.Tensor] = None, stream: int = 0,
                  strata: Optional[int] = None) -> OrderSample:
    """Draw the orders (and in-set noise) of the samples with global indices ``indices``.

    ``context`` and ``padding`` are optional ``[B, L]`` boolean masks: context tokens (a prompt,
    or the left and right context of an infill) are revealed first in position order and are
    never predicted; padding is revealed last and excluded from the loss.

    ``strata`` (the global batch size ``G``, for schedules with diffusion times): stratified
    times, MDLM's and BD3LM's antithetic sampling. The sample at stream position ``i`` is
    sample ``i mod G`` of its step's batch and draws inside its own strata, so the ``G``
    samples of a step cover the time range evenly whatever the data-parallel layout (each
    time is still uniform over the step's samples: the loss keeps its expectation)."""
    indices = [int(i) for i in (indices.tolist() if torch.is_tensor(indices) else indices)]
    B, L = len(indices), int(seq_len)
    R = torch.empty(B, L, dtype=torch.float64)
    group = torch.empty(B, L, dtype=torch.long)
    u = torch.zeros(B, L, dtype=torch.float64)
    t_tok = torch.ones(B, L, dtype=torch.float64)
    stratify = bool(strata) and not schedule.singleton
    for b, idx in enumerate(indices):
        kw = {"stratum": (idx % strata, strata)} if stratify else {}
        r, g, ub, tg = schedule.draw(L, sample_generator(seed, idx, stream), **kw)
        R[b], group[b] = r, g
        if ub is not None:
            u[b], t_tok[b] = ub, tg[g]

    ctx = torch.zeros(B, L, dtype=torch.bool) if context is None else context.to("cpu", torch.bool)
    pad = torch.zeros(B, L, dtype=torch.bool) if padding is None else padding.to("cpu", torch.bool)
    if ctx.shape != (B, L) or pad.shape != (B, L):
        raise ValueError(f"context and padding must have shape {(B, L)}, got "
                         f"{tuple(ctx.shape)} and {tuple(pad.shape)}")
    if (ctx & pad).any():
        raise ValueError("a position cannot be both context and padding")
    R = R.masked_fill(ctx, math.inf).masked_fill(pad, -math.inf)
    special = ctx | pad
    targets = ~special

    # stable sort: ties (context, padding) keep position order
    order = torch.sort(-R, dim=1, stable=True).indices
    g_ord = torch.gather(group, 1, order)
    sp_ord = torch.gather(special, 1, order)
    new_set = torch.ones(B, L, dtype=torch.bool)
    new_set[:, 1:] = sp_ord[:, 1:] | sp_ord[:, :-1] | (g_ord[:, 1:] != g_ord[:, :-1])
    set_in_order = torch.cumsum(new_set.long(), dim=1) - 1
    set_ids = torch.empty_like(set_in_order).scatter_(1, order, set_in_order)

    if schedule.singleton:
        noisy = targets.clone()
        weight = targets.to(torch.float32)
        set_time = torch.ones(B, L, dtype=torch.float32)
    else:
        noisy = targets & (u < t_tok)
        weight = torch.where(noisy, 1.0 / t_tok, 0.0).to(torch.float32)
        set_time = t_tok.to(torch.float32)
    return OrderSample(reveal_times=R, order=order, set_ids=set_ids, noisy=noisy,
                       targets=targets, set_time=set_time, loss_weight=weight)
