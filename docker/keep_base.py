"""Print pip constraints that pin the base image's own torch, Transformer Engine and apex."""

import importlib.metadata as md

for dist in ("torch", "transformer_engine", "transformer-engine", "apex", "flash_attn"):
    try:
        print(f"{dist}=={md.version(dist)}")
    except md.PackageNotFoundError:
        pass
