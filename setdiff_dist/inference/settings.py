"""Decoding settings: the paper's operating points and how a run's settings are resolved from
the checkpoint's ``decode`` section, a preset and the flags. Imports nothing heavy: the command
lines read it for ``--help``."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Sequence

# The paper's operating points (on top of the checkpoint's decode section; flags override).
PRESETS = {
    "gsm": {"window": None, "greedy": True},  # W = D, greedy
    "infill": {"window": 32, "greedy": True, "repetition_penalty": 1.2},  # an S <= 32 model
}
DECODE_KEYS = ("window", "threshold", "greedy", "temperature", "top_p", "top_k",
               "repetition_penalty", "max_new_tokens", "max_repeat_run", "length_penalty",
               "length_penalty_start")
# the settings that say how a token is chosen (:class:`~.decoding.Sampling`'s, less the seed)
SAMPLING_KEYS = ("greedy", "temperature", "top_p", "top_k", "repetition_penalty",
                 "length_penalty", "length_penalty_start")


def sampling_of(settings, seed: int = 0):
    """The :class:`~setdiff_dist.inference.decoding.Sampling` of anything that carries
    :data:`SAMPLING_KEYS` as attributes (a :class:`DecodeSettings`, a server's request): the
    one conversion every caller makes."""
    from setdiff_dist.inference.decoding import Sampling

    return Sampling(greedy=bool(settings.greedy), temperature=settings.temperature,
                    top_p=settings.top_p, top_k=settings.top_k or 0,
                    repetition_penalty=settings.repetition_penalty, seed=seed,
                    length_penalty=settings.length_penalty,
                    length_penalty_start=settings.length_penalty_start)


@dataclass(frozen=True)
class DecodeSettings:
    """A run's resolved decoding settings (:func:`decode_settings`): the fields of a config's
    ``decode`` section, and the two objects a decoder takes, :meth:`sampling` and
    :meth:`stopping`. Frozen: a caller that changes one field makes a copy (:meth:`replace`)."""

    window: Optional[int]
    threshold: float
    greedy: bool
    temperature: float
    top_p: float
    top_k: int
    repetition_penalty: float
    max_new_tokens: int
    max_repeat_run: int
    stop: tuple = ()  # stop strings (``re:`` for a regex)
    length_penalty: float = 1.0
    length_penalty_start: int = 0

    def sampling(self, seed: int = 0):
        """How a token is chosen, drawing from ``seed``."""
        return sampling_of(self, seed)

    def stopping(self, eos_id: Optional[int] = None, extra: Sequence[str] = (),
                 strings: bool = True):
        """The :class:`~setdiff_dist.inference.decoding.StopCriteria`: end-of-text when
        ``eos_id`` is given, the stop strings (unless ``strings`` is False) and ``extra``, and
        the repeated-run stop."""
        from setdiff_dist.inference.decoding import StopCriteria

        return StopCriteria(eos_id=eos_id,
                            stop=tuple(self.stop if strings else ()) + tuple(extra),
                            max_repeat_run=self.max_repeat_run)

    def replace(self, **changes) -> "DecodeSettings":
        return dataclasses.replace(self, **changes)

    def as_dict(self, keys: Sequence[str] = ()) -> dict:
        """The settings as a results file reports them (``keys``: only those)."""
        out = dataclasses.asdict(self)
        out["stop"] = list(self.stop)
        return {k: out[k] for k in keys} if keys else out


def inference_dtype(name: str):
    """The torch dtype of ``--dtype``: ``auto`` is bf16 on a GPU and fp32 on CPUs."""
    import torch

    if name == "auto":
        return torch.bfloat16 if torch.cuda.is_available() else torch.float32
    return getattr(torch, name)


def default_window(order_cfg) -> Optional[int]:
    """W when neither the config nor a flag sets it, as the order says: the mean set size D for
    staggered orders (the paper's GSM point), the block size for block, 1 for AR and causal,
    and None for masked (MDLM's sampler has no window: every masked position is a
    candidate)."""
    from setdiff_dist.diffusion.kinds import order_of

    return order_of(order_cfg).default_window(order_cfg)


def decode_settings(cfg, preset: Optional[str] = None, **flags) -> DecodeSettings:
    """The decoding settings of a run: the checkpoint's ``decode`` section, then ``preset``
    (:data:`PRESETS`), then every flag that is not None; an unset window follows the order
    (:func:`default_window`). A window past the order's S_max is allowed, with a note. A block
    checkpoint's window is its block and an MDLM's is None, whatever the config or a preset
    says (a ``--window`` flag that asks for another is an error)."""
    out = {k: getattr(cfg.decode, k) for k in DECODE_KEYS}
    out["stop"] = list(cfg.decode.stop)
    if preset is not None:
        if preset not in PRESETS:
            from setdiff_dist.inference.decoder import DecodeError

            raise DecodeError(f"unknown preset {preset!r}; expected {', '.join(PRESETS)}")
        out.update(PRESETS[preset])
    for k, v in flags.items():
        if v is not None:
            out[k] = out["stop"] + list(v) if k == "stop" else v
    from setdiff_dist.diffusion.kinds import order_of
    from setdiff_dist.errors import rank_and_world
    from setdiff_dist.inference.decoder import DecodeError, check_threshold

    # block and masked checkpoints decode as they trained (inference.decoder.decoder_for):
    # a block model's window is its block, MDLM has none; only a flag can ask otherwise
    order, asked = order_of(cfg.order), flags.get("window")
    problem = order.window_problem(cfg.order, asked) if asked is not None else None
    if problem:
        raise DecodeError(problem)
    if out["window"] is None or order.fixed_window:
        out["window"] = order.default_window(cfg.order)
    if order.causal_lm and asked is None:  # (one token a step: a config's window is not its)
        out["window"] = 1

    check_threshold(out["threshold"])
    s_max = order.largest_set(cfg.order)
    if s_max is not None and out["window"] > s_max and rank_and_world()[0] == 0:
        import sys

        print(f"note: window {out['window']} is wider than the largest set this model was "
              f"trained on (S_max = {s_max:g}): candidates past it are outside the training "
              f"distribution; the paper decodes with W <= S_max (W = D = "
              f"{default_window(cfg.order)} for GSM)", file=sys.stderr)
    out["stop"] = tuple(out["stop"])
    return DecodeSettings(**out)
