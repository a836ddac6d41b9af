"""setdiff-dist: distributed pretraining of set-diffusion language models."""

from setdiff_dist import _lazy_jit

__version__ = "0.1.0"

_lazy_jit.install()  # (before megatron-core is imported: see _lazy_jit)


def load(path: str, **kwargs):
    """A trained model for inference: ``setdiff_dist.load("runs/tiny-cpu").generate("...")``
    (see :mod:`setdiff_dist.api`; imported on first use, so ``import setdiff_dist`` stays
    light)."""
    from setdiff_dist.api import load as _load

    return _load(path, **kwargs)
