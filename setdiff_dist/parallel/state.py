"""Process groups: torch.distributed from the torchrun / Slurm environment, then megatron-core's
``parallel_state`` (tensor, pipeline and data-parallel groups) on top of it.

The launcher's environment decides the world: torchrun sets ``RANK``/``WORLD_SIZE``/
``LOCAL_RANK``/``MASTER_ADDR``/``MASTER_PORT``; under ``srun`` alone the ``SLURM_*`` variables are
read; with neither, the process is a world of one. The backend is NCCL with GPUs, gloo without.
"""

from __future__ import annotations

import datetime
import os
import re
import sys
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from setdiff_dist.errors import SetdiffError
from setdiff_dist.processes import free_port  # noqa: F401 (re-exported)

from . import cpu_compat


@dataclass(frozen=True)
class LaunchEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int


class LaunchError(SetdiffError, RuntimeError):
    """The launch environment cannot work (a GPU job without a usable GPU, ...); the message
    says why and what to do."""


def first_host(nodelist: str) -> str:
    """The first host of a Slurm node list (``scontrol show hostnames`` without scontrol):
    ``"gpu[03-05,07],cpu1"`` -> ``"gpu03"``."""
    head = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist.strip())
    if head is None:
        raise LaunchError(f"cannot read the Slurm node list {nodelist!r}; set MASTER_ADDR")
    prefix, _, ranges = head.groups()
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def launch_env() -> LaunchEnv:
    """Rank and rendezvous of this process, from torchrun, Slurm, or nothing (a world of one).
    Under ``srun`` alone (one task per rank, no torchrun) the rendezvous is the allocation's
    first node and port ``20000 + job id mod 9400`` (the Slurm launchers' rule: below torch's
    defaults and the kernel's ephemeral ports, which an outgoing connection may hold), unless
    ``MASTER_ADDR`` / ``MASTER_PORT`` say otherwise."""
    env = os.environ
    slurm = False
    if "RANK" in env and "WORLD_SIZE" in env:
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        local = int(env.get("LOCAL_RANK", 0))
    elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        rank, world = int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"])
        local = int(env.get("SLURM_LOCALID", 0))
        slurm = world > 1
    else:
        rank, world, local = 0, 1, 0
    nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
    if "MASTER_ADDR" in env:
        addr = env["MASTER_ADDR"]
    elif slurm and nodes:
        addr = first_host(nodes)
    else:
        addr = "127.0.0.1"
    if "MASTER_PORT" in env:
        port = int(env["MASTER_PORT"])
    elif slurm and "SLURM_JOB_ID" in env:
        port = 20000 + int(env["SLURM_JOB_ID"]) % 9400
    else:
        port = free_port() if world == 1 else 29500
    return LaunchEnv(rank, world, local, addr, port)


def gpus_promised() -> str | None:
    """Which Slurm variable says this job has GPUs, if any (``SLURM_GPUS_ON_NODE=8``)."""
    for key in ("SLURM_GPUS_ON_NODE", "SLURM_STEP_GPUS", "SLURM_JOB_GPUS"):
        value = os.environ.get(key, "").strip()
        if value and value not in ("0", "(null)"):
            return f"{key}={value}"
    return None


def megatron_groups():
    """megatron's ``parallel_state`` when megatron is imported and its groups are set up (a
    training run, inference at TP > 1), else None, without importing it: inference at TP=1
    never imports megatron-core."""
    ps = sys.modules.get("megatron.core.parallel_state")
    return ps if ps is not None and ps.model_parallel_is_initialized() else None


NCCL_TRACE = "nccl_trace"  # (run_dir/nccl_trace/: NCCL's flight-recorder dumps)


def flight_recorder_env(run_dir: str) -> dict[str, str]:
    """The variables that turn on NCCL's flight recorder (torch's ring buffer of each rank's
    last collectives: which one each rank was in, its sizes and state) and have it dumped, per
    rank, to ``run_dir/nccl_trace/rank<R>`` when a collective times out: with every rank's
    entry side by side, the one that never entered a collective is the hung one, also where a
    stuck kernel leaves every process alive. Read by torch's NCCL process group as it is
    made; a value already set (the user's) wins."""
    return {"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
            "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": os.path.join(run_dir, NCCL_TRACE, "rank")}


def init_distributed(backend: str = "auto", timeout_s: float = 1800.0,
                     run_dir: Optional[str] = None) -> LaunchEnv:
    """Initialize the default process group once (idempotent); a collective fails after
    ``timeout_s`` seconds of waiting (``train.collective_timeout_s``). With ``run_dir``, an
    NCCL group records its collectives (:func:`flight_recorder_env`)."""
    le = launch_env()
    if dist.is_initialized():
        return le
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and \
            int(os.environ.get("TORCHELASTIC_MAX_RESTARTS") or 0) > 0:
        # the agents' shared store outlives a restart with the last attempt's keys in it: the
        # restarted ranks read their peers' old addresses and fail to connect
        # (pytorch/pytorch#135712); launchers/local.sh and launchers/slurm set this for torchrun
        raise LaunchError(
            "torchrun --max-restarts with the rendezvous store shared with the ranks: a "
            "restart would fail to connect on the previous attempt's keys; export "
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 before torchrun (the launchers in launchers/ "
            "do), or use setdiff-train --nproc-per-node with train.max_restarts")
    # DeepSpeed and megatron read these; under plain python or srun they are ours to set
    for key, value in (("RANK", le.rank), ("WORLD_SIZE", le.world_size),
                       ("LOCAL_RANK", le.local_rank), ("MASTER_ADDR", le.master_addr),
                       ("MASTER_PORT", le.master_port)):
        os.environ.setdefault(key, str(value))
    if backend == "auto":
        promised = gpus_promised()
        if promised and not torch.cuda.is_available():
            # never train a GPU job on its CPUs by accident
            raise LaunchError(
                f"this job was given GPUs ({promised}) but torch {torch.__version__} sees none "
                f"(CUDA build: {torch.version.cuda}); install a CUDA build of torch or check "
                "the driver, or set parallel.backend=gloo to run on the CPUs on purpose")
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise LaunchError("parallel.backend=nccl needs CUDA GPUs; use gloo (or auto) on CPUs")
        if le.local_rank >= torch.cuda.device_count():
            raise LaunchError(f"local rank {le.local_rank} has no GPU: this node shows "
                              f"{torch.cuda.device_count()}; launch at most that many ranks per "
                              "node (--nproc-per-node / NPROC_PER_NODE)")
        torch.cuda.set_device(le.local_rank)
        if run_dir:
            os.makedirs(os.path.join(run_dir, NCCL_TRACE), exist_ok=True)
            for key, value in flight_recorder_env(run_dir).items():
                os.environ.setdefault(key, value)
    # env:// reads the variables set above (and reuses torchrun's store when it offers one)
    dist.init_process_group(backend=backend, init_method="env://", rank=le.rank,
                            world_size=le.world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    return le


def _this_command() -> str:
    """How torchrun would start this command again: ``-m module`` or the script."""
    import __main__

    spec = getattr(__main__, "__spec__", None)
    if spec is not None:
        return f"-m {spec.name}"
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "SCRIPT"
    if name.startswith("setdiff-"):  # a console script: its module
        return f"-m setdiff_dist.cli.{name[len('setdiff-'):]}"
    return name


def initialize_model_parallel(tensor: int = 1, pipeline: int = 1,
                              virtual_pipeline: int | None = None, seed: int = 1234,
                              backend: str = "auto", context: int = 1) -> None:
    """torch.distributed, then megatron's groups (order tp-cp-ep-dp-pp), then the RNG tracker.
    ``context``: the context-parallel size (each sequence split over that many ranks, see
    :mod:`setdiff_dist.model.context`)."""
    init_distributed(backend)
    world = dist.get_world_size()
    if world % (tensor * pipeline * context):
        n = tensor * pipeline * context
        how = (f"start {n} ranks: torchrun --nproc-per-node {n} {_this_command()} ..."
               if world == 1 else f"launch a multiple of {n} ranks")
        cp = f" x context-parallel {context}" if context > 1 else ""
        raise LaunchError(f"{world} rank(s) cannot be split into tensor-parallel {tensor} x "
                          f"pipeline-parallel {pipeline}{cp} groups: {how}")
    from megatron.core import parallel_state as ps

    cpu_compat.apply()
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    # (no gloo copies of the data-parallel groups: nothing here uses them - DeepSpeed reduces
    # and gathers on the groups themselves - and at N ranks each is one more world-wide
    # rendezvous at start-up)
    ps.initialize_model_parallel(tensor_model_parallel_size=tensor,
                                 pipeline_model_parallel_size=pipeline,
                                 virtual_pipeline_model_parallel_size=virtual_pipeline,
                                 context_parallel_size=context,
                                 create_gloo_process_groups=False)
    cpu_compat.seed_model_parallel_rng(seed)


def destroy_model_parallel() -> None:
    if "megatron.core.parallel_state" in sys.modules:  # (a megatron-free command skips it)
        from megatron.core import parallel_state as ps

        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
