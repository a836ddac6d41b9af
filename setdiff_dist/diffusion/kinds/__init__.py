"""Order kinds: each value of ``order.kind`` is an :class:`Order`, described once in a module of
this package and found by its name. The rest of the package asks the order what it needs (its
schedule, whether it is the plain causal LM, the model's sequence length, its decoder and
default window, whether its bound is exact, what it requires of the config) and never compares
its name.

A new kind is one module here defining a subclass of :class:`Order` decorated with
:func:`register`, and its test: :func:`order_of` and :func:`order_kinds` import every module
of the package on first use, and nothing else needs an edit. Nothing here imports torch at
import time (the config module reads the kinds, and ``--help`` loads it without torch): a
module imports torch inside the functions that draw."""

from __future__ import annotations

from typing import Optional

from setdiff_dist.registry import Registry

_KINDS = Registry(__name__, "order kind", instance=True,
                  first=("causal", "autoregressive", "masked", "block", "staggered"))


class Order:
    """What an order kind is, for every module that needs to know. Subclasses set the class
    attributes and override the methods that differ."""

    name: str = ""
    help: str = ""  # a few words for ``setdiff-config --keys``
    causal_lm: bool = False  # the plain causal LM: L tokens, next-token loss, no schedule
    singleton: bool = True  # one token per set (the any-order AR loss, permuted-causal kernels)
    exact_likelihood: bool = False  # the evaluation bound is the exact log-likelihood
    # how a checkpoint of this kind decodes (inference.decoder.decoder_for): "causal" (cached
    # AR), "set" (the set decoder), "block" (BD3LM's blocks) or "mdlm" (MDLM's sampler)
    decoder: str = "set"
    fixed_window: bool = False  # the decoder's window is the order's own (no --window)

    def model_len(self, seq_len: int) -> int:
        """Tokens per sequence in the model: ``[clean ; noisy]`` (2L) for set diffusion."""
        return seq_len if self.causal_lm else 2 * seq_len

    def schedule(self, order_cfg, seq_len: int, evaluation: bool = False):
        """The :class:`~setdiff_dist.diffusion.orders.OrderSchedule` of ``order_cfg`` for
        sequences of ``seq_len``; ``evaluation``: the likelihood bound's (an unclipped diffusion
        time range)."""
        raise ValueError(f"order.kind={self.name} has no order schedule")

    def default_window(self, order_cfg) -> Optional[int]:
        """The decoding window W when neither the config nor a flag sets one (None: the
        decoder has none)."""
        return 1

    def largest_set(self, order_cfg) -> Optional[float]:
        """The largest set the order trains on, when it is bounded below the sequence (a
        window past it is noted at decode time)."""
        return None

    def window_problem(self, order_cfg, asked: int) -> Optional[str]:
        """Why ``--window asked`` cannot decode this order (None: it can)."""
        return None

    def problems(self, cfg) -> list[str]:
        """What this order requires of the rest of the config, as lines of a refusal."""
        return []

    def __repr__(self) -> str:
        return f"<order {self.name}>"


#: class decorator: make ``cls`` (a subclass of :class:`Order`) the order named ``cls.name``
register = _KINDS.register


def order_kinds() -> tuple[str, ...]:
    """Every registered kind's name (the choices of ``order.kind``), the built-in ones first in
    the order the docs list them."""
    return _KINDS.names()


def order_of(kind) -> Order:
    """The :class:`Order` named ``kind`` (a name, or an order config with a ``kind``)."""
    return _KINDS.get(getattr(kind, "kind", kind), ValueError)
