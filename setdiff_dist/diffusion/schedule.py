"""The base of every order schedule (torch-free, so that an order kind can define its schedule
where it is described: :mod:`setdiff_dist.diffusion.kinds`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

class OrderSchedule:
    """Base class. ``singleton`` schedules reveal one token per set and train with the
    unweighted any-order AR loss; the others diffuse inside each set with weight 1/t."""

    name: str = ""
    singleton: bool = True

    def draw(self, seq_len: int, gen: torch.Generator):
        """One sample's body draws: ``(R [L] float64, group [L] long, u [L] or None,
        t_group [G] or None)``. ``group`` labels the set of each position (the sets are then
        numbered in reveal order); ``u`` are the within-set uniforms (a token is masked in the
        noisy copy when ``u < t`` of its set)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
