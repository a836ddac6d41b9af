"""setdiff-dist: distributed pretraining of set-diffusion language models."""

from setdiff_dist import _lazy_jit

__version__ = "0.1.0"

_lazy_jit.install()  # (before megatron-core is imported: see _lazy_jit)
