"""setdiff-dist: distributed pretraining of set-diffusion language models."""

from setdiff_dist import _lazy

__version__ = "0.1.0"

_lazy.install()  # (before megatron-core is imported: see _lazy)


def load(path, tensor_parallel: int = 1, dtype="auto", device=None, raw_weights: bool = False):
    """A trained model for inference: ``setdiff_dist.load("runs/tiny-cpu").generate("...")``.

    ``path``: a training run directory, a checkpoint directory or a ``setdiff-convert``
    export; ``tensor_parallel``: the tensor-parallel size (an integer of 1 or more; N > 1 under
    ``torchrun --nproc-per-node N``); ``dtype``: "auto", "float32" ("fp32") or "bfloat16"
    ("bf16"); ``device``: default a GPU when there is one; ``raw_weights``: the raw weights, not
    their EMA. :func:`setdiff_dist.api.load` says more (imported on first use, so ``import
    setdiff_dist`` stays light)."""
    from setdiff_dist.api import load as _load

    return _load(path, tensor_parallel=tensor_parallel, dtype=dtype, device=device,
                 raw_weights=raw_weights)
