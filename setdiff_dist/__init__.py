"""setdiff-dist: distributed pretraining of set-diffusion language models."""

__version__ = "0.1.0"
