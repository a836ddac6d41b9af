"""Quiet by default: the known, harmless notices of the libraries under us, filtered in one
place, and what remains said once, by rank 0.

On a CPU machine megatron-core, DeepSpeed and torch print, once per rank, that Transformer
Engine and apex are missing, that an API they call is deprecated, and which accelerator they
found: dozens of lines that bury the progress, the results and our own messages. Every command
calls :func:`quiet` first. ``SETDIFF_VERBOSE=1`` shows everything again.
"""

from __future__ import annotations

import logging
import os
import warnings

# (message prefix, a regular expression; category): nothing a user can act on
KNOWN_WARNINGS = (
    ("Transformer Engine and Apex are not installed", UserWarning),
    ("Apex is not installed", UserWarning),
    ("full scope is deprecated", UserWarning),
    (r"`torch\.distributed\.\w+` is deprecated", FutureWarning),  # (megatron's calls)
)
# advice that only applies to CUDA: filtered where there is no NVIDIA driver
CUDA_ONLY = (r"When using .* it is recommended to set the environment variable "
             "CUDA_DEVICE_MAX_CONNECTIONS", UserWarning)
KNOWN_LOGS = ("Setting accelerator to CPU",)  # DeepSpeed's accelerator detection


def verbose() -> bool:
    return os.environ.get("SETDIFF_VERBOSE", "") not in ("", "0")


class _DropKnown(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not any(k in record.getMessage() for k in KNOWN_LOGS)


def quiet() -> None:
    """Filter the known notices (before the libraries are imported); on ranks other than 0,
    every Python warning (rank 0 prints what remains, once)."""
    if verbose():
        return
    known = KNOWN_WARNINGS + (() if os.path.exists("/dev/nvidiactl") else (CUDA_ONLY,))
    for message, category in known:
        warnings.filterwarnings("ignore", message=message, category=category)
    if os.environ.get("RANK", "0") != "0":
        warnings.simplefilter("ignore")
    logger = logging.getLogger("DeepSpeed")
    if not any(isinstance(f, _DropKnown) for f in logger.filters):
        logger.addFilter(_DropKnown())
