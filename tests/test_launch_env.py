"""Where a rank's rendezvous comes from (torchrun, srun alone, nothing), and a GPU job that finds
no GPU: a clear error at start, never a silent fall-back to gloo on the CPUs."""

import pytest

from setdiff_dist.parallel import first_host, launch_env

LAUNCH_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID",
               "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_JOB_NODELIST", "SLURM_STEP_NODELIST",
               "SLURM_JOB_ID")


@pytest.fixture
def clean_env(monkeypatch):
    for key in LAUNCH_KEYS:
        monkeypatch.delenv(key, raising=False)
    return monkeypatch


@pytest.mark.parametrize("nodelist,host", [
    ("n1", "n1"), ("n1,n2", "n1"), ("gpu[03-05,07]", "gpu03"), ("gpu[7],cpu[1-2]", "gpu7"),
    ("dgx-a100-[012-015]", "dgx-a100-012"),
])
def test_first_host_of_a_slurm_node_list(nodelist, host):
    assert first_host(nodelist) == host


def test_srun_alone_derives_the_rendezvous_from_the_allocation(clean_env):
    clean_env.setenv("SLURM_PROCID", "5")
    clean_env.setenv("SLURM_NTASKS", "16")
    clean_env.setenv("SLURM_LOCALID", "1")
    clean_env.setenv("SLURM_JOB_NODELIST", "gpu[12-15]")
    clean_env.setenv("SLURM_JOB_ID", "4242")
    le = launch_env()
    assert (le.rank, le.world_size, le.local_rank) == (5, 16, 1)
    assert (le.master_addr, le.master_port) == ("gpu12", 20000 + 4242 % 9400)
    clean_env.setenv("MASTER_ADDR", "10.1.2.3")  # an explicit choice still wins
    clean_env.setenv("MASTER_PORT", "29511")
    le = launch_env()
    assert (le.master_addr, le.master_port) == ("10.1.2.3", 29511)


def test_torchrun_and_a_world_of_one(clean_env):
    clean_env.setenv("RANK", "1")
    clean_env.setenv("WORLD_SIZE", "2")
    clean_env.setenv("MASTER_ADDR", "host-a")
    clean_env.setenv("MASTER_PORT", "1234")
    le = launch_env()
    assert (le.rank, le.world_size, le.local_rank, le.master_addr, le.master_port) == \
        (1, 2, 0, "host-a", 1234)
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        clean_env.delenv(key)
    le = launch_env()
    assert (le.rank, le.world_size, le.master_addr) == (0, 1, "127.0.0.1")


def test_a_gpu_job_without_a_usable_gpu_fails_clearly(clean_env):
    """What a rank of setdiff-train does first (init_distributed), in this process."""
    import os

    import torch
    import torch.distributed as dist

    from setdiff_dist.parallel import destroy_model_parallel, free_port, init_distributed
    from setdiff_dist.parallel.state import LaunchError

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    saved = dict(os.environ)  # (init_distributed sets RANK, MASTER_PORT...: none may stay set)
    try:
        clean_env.setenv("SLURM_GPUS_ON_NODE", "8")
        with pytest.raises(LaunchError) as err:
            init_distributed("auto")
        assert "this job was given GPUs (SLURM_GPUS_ON_NODE=8) but torch" in str(err.value)
        assert "parallel.backend=gloo" in str(err.value) and not dist.is_initialized()
        # gloo on purpose is still allowed
        os.environ["MASTER_PORT"] = str(free_port())
        init_distributed("gloo")
        assert dist.get_backend() == "gloo"
    finally:
        destroy_model_parallel()
        os.environ.clear()
        os.environ.update(saved)


def test_local_ranks_share_the_cpus_out_instead_of_each_taking_them_all(monkeypatch):
    """``setdiff-train --nproc-per-node N`` gives each rank its share of the CPUs (torch's
    default, every core in every rank, oversubscribes them N times over)."""
    import os

    from setdiff_dist.processes import threads_per_rank

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    assert [threads_per_rank(n) for n in (1, 2, 3, 4, 16, 32)] == [16, 8, 5, 4, 1, 1]



def test_a_rendezvous_port_is_drawn_where_the_kernel_hands_out_no_port_of_its_own(monkeypatch):
    """A port the kernel may give to another process's outgoing connection between the probe
    and rank 0's bind is EADDRINUSE at start (CI, two sessions of ranks side by side): the
    launcher's rendezvous port is drawn below the ephemeral range, bindable, at random; with
    no room below the range, the kernel's own pick."""
    import random
    import socket

    from setdiff_dist import processes

    lo, _ = processes._ephemeral_ports()
    ports = {processes.free_port() for _ in range(20)}
    assert len(ports) > 1 and all(10000 <= p < lo and p not in range(29400, 29600)
                                  for p in ports), ports
    taken, free = sorted(ports)[:2]
    with socket.socket() as s:  # a port in use is never drawn
        s.bind(("", taken))
        draws = iter([taken, taken, free])
        monkeypatch.setattr(random.SystemRandom, "choice", lambda self, pool: next(draws))
        assert processes.free_port() == free
    monkeypatch.undo()
    monkeypatch.setattr(processes, "_ephemeral_ports", lambda: (10010, 60999))
    assert processes.free_port() >= 1024  # (no room below the range: the kernel's pick)
