"""Imported first by mp_harness's fork server, before the libraries it preloads: their known
notices filtered as setdiff-train filters them (setdiff_dist.quiet) before its imports."""

from setdiff_dist.quiet import quiet

quiet()
