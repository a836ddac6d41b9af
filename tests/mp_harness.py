"""Run a function on several gloo processes (torch.multiprocessing), as torchrun would."""

import os
import traceback

import torch.multiprocessing as mp

from setdiff_dist.parallel import free_port


def _entry(rank, world_size, port, fn, args):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        fn(rank, *args)
    except Exception:
        traceback.print_exc()
        raise


def spawn(fn, world_size, *args):
    """Call ``fn(rank, *args)`` on ``world_size`` processes; fails if any of them fails."""
    mp.spawn(_entry, args=(world_size, free_port(), fn, args), nprocs=world_size, join=True)
