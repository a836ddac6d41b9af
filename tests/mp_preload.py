"""Imported first by mp_harness's fork server: what a training rank imports, the libraries'
known notices filtered before (setdiff-train's rank server's own preload)."""

from setdiff_dist.rank_server import preload

preload()
