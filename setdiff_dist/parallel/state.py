"""Process groups: torch.distributed from the torchrun / Slurm environment, then megatron-core's
``parallel_state`` (tensor, pipeline and data-parallel groups) on top of it.

The launcher's environment decides the world: torchrun sets ``RANK``/``WORLD_SIZE``/
``LOCAL_RANK``/``MASTER_ADDR``/``MASTER_PORT``; under ``srun`` alone the ``SLURM_*`` variables are
read; with neither, the process is a world of one. The backend is NCCL with GPUs, gloo without.
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import cpu_compat


@dataclass(frozen=True)
class LaunchEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_env() -> LaunchEnv:
    """Rank and rendezvous of this process, from torchrun, Slurm, or nothing (a world of one)."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        local = int(env.get("LOCAL_RANK", 0))
    elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        rank, world = int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"])
        local = int(env.get("SLURM_LOCALID", 0))
    else:
        rank, world, local = 0, 1, 0
    addr = env.get("MASTER_ADDR", "127.0.0.1")
    port = int(env["MASTER_PORT"]) if "MASTER_PORT" in env else (free_port() if world == 1 else 29500)
    return LaunchEnv(rank, world, local, addr, port)


def init_distributed(backend: str = "auto", timeout_minutes: int = 30) -> LaunchEnv:
    """Initialize the default process group once (idempotent)."""
    le = launch_env()
    if dist.is_initialized():
        return le
    # DeepSpeed and megatron read these; under plain python or srun they are ours to set
    for key, value in (("RANK", le.rank), ("WORLD_SIZE", le.world_size),
                       ("LOCAL_RANK", le.local_rank), ("MASTER_ADDR", le.master_addr),
                       ("MASTER_PORT", le.master_port)):
        os.environ.setdefault(key, str(value))
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise RuntimeError("parallel.backend=nccl needs CUDA GPUs; use gloo (or auto) on CPUs")
        torch.cuda.set_device(le.local_rank)
    # env:// reads the variables set above (and reuses torchrun's store when it offers one)
    dist.init_process_group(backend=backend, init_method="env://", rank=le.rank,
                            world_size=le.world_size,
                            timeout=datetime.timedelta(minutes=timeout_minutes))
    return le


def initialize_model_parallel(tensor: int = 1, pipeline: int = 1,
                              virtual_pipeline: int | None = None, seed: int = 1234,
                              backend: str = "auto") -> None:
    """torch.distributed, then megatron's groups (order tp-cp-ep-dp-pp), then the RNG tracker."""
    init_distributed(backend)
    world = dist.get_world_size()
    if world % (tensor * pipeline):
        raise ValueError(f"world size {world} is not divisible by parallel.tensor={tensor} x "
                         f"parallel.pipeline={pipeline}")
    from megatron.core import parallel_state as ps

    cpu_compat.apply()
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tensor,
                                 pipeline_model_parallel_size=pipeline,
                                 virtual_pipeline_model_parallel_size=virtual_pipeline)
    cpu_compat.seed_model_parallel_rng(seed)


def destroy_model_parallel() -> None:
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
