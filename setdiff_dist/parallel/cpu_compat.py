"""The one place where megatron-core is taught to run without a GPU.

megatron-core 0.16 assumes CUDA in a few spots that our code paths reach: its RNG tracker keeps
CUDA generator states (and activation recompute saves and restores them), and the pipeline
schedules, p2p communication and the sequence-parallel gathers and scatters allocate their
buffers with ``device="cuda"`` / ``torch.cuda.current_device()`` and call
``torch.cuda.synchronize()``.
:func:`apply` (a no-op when CUDA is available) replaces the tracker with one that keeps CPU
generator states, and gives those two pipeline modules a view of ``torch`` whose CUDA device is the
CPU. Nothing else is patched: the real megatron layers, schedules and p2p code run unchanged.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import types

import torch

_APPLIED = False
# megatron modules that allocate on the CUDA device by name; they get the CPU view of torch
_CUDA_BOUND_MODULES = ("megatron.core.pipeline_parallel.schedules",
                       "megatron.core.pipeline_parallel.p2p_communication",
                       # sequence parallelism: the all-gather / reduce-scatter buffers
                       "megatron.core.tensor_parallel.mappings",
                       "megatron.core.tensor_parallel.layers",
                       "megatron.core.utils")


def _cpu_device(device):
    if device is None:
        return None
    d = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    return torch.device("cpu") if d.type == "cuda" else d


class _CpuCuda(types.SimpleNamespace):
    """What the CUDA-bound modules see as ``torch.cuda``: the CPU is the current device."""

    def __getattr__(self, name):
        return getattr(torch.cuda, name)

    @staticmethod
    def current_device():
        return torch.device("cpu")

    @staticmethod
    def synchronize(device=None):
        return None


class _CpuTorch(types.ModuleType):
    """``torch`` with tensor factories that map a CUDA device to the CPU."""

    def __init__(self):
        super().__init__("torch")
        self.cuda = _CpuCuda()
        for name in ("zeros", "ones", "empty", "full", "tensor", "arange"):
            setattr(self, name, self._factory(getattr(torch, name)))

    @staticmethod
    def _factory(fn):
        def wrapped(*args, device=None, **kwargs):
            return fn(*args, device=_cpu_device(device), **kwargs)
        return wrapped

    def __getattr__(self, name):
        return getattr(torch, name)


def _tracker_class():
    from megatron.core.tensor_parallel import random as mrandom

    class CpuRNGStatesTracker(mrandom.CudaRNGStatesTracker):
        """megatron's RNG tracker over CPU generator states: ``fork()`` swaps the CPU default
        generator's state, so dropout inside forks differs per tensor-parallel rank as on GPUs."""

        def add(self, name, seed):
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            self._is_initialized = True
            self.seeds_.add(seed)
            orig = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)

        @contextlib.contextmanager
        def fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            orig = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(orig)

    return CpuRNGStatesTracker


def apply() -> bool:
    """Make megatron-core usable on a machine without CUDA. Returns whether it patched."""
    global _APPLIED
    if torch.cuda.is_available():
        return False
    if _APPLIED:
        return True
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._CUDA_RNG_STATE_TRACKER = _tracker_class()()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    # activation recompute saves and restores "the CUDA generator" next to the CPU one: on a CPU
    # the CPU generator is the only one (the tracker forks swap it), and it is restored already
    mrandom._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda *args, **kwargs: None
    cpu_torch = _CpuTorch()
    for name in _CUDA_BOUND_MODULES:
        importlib.import_module(name).torch = cpu_torch
    _APPLIED = True
    return True


# megatron-core's DistributedDataParallel and distributed optimizer (zero.implementation=megatron):
# their buffers and scalars are made on torch.cuda.current_device() / device="cuda"
_DISTRIBUTED_OPTIMIZER_MODULES = ("megatron.core.distributed.param_and_grad_buffer",
                                  "megatron.core.distributed.distributed_data_parallel",
                                  "megatron.core.optimizer.optimizer",
                                  "megatron.core.optimizer.distrib_optimizer",
                                  "megatron.core.optimizer.clip_grads")
# ... and check a tensor's type by its CUDA name (param.type() == "torch.cuda.FloatTensor")
_TYPE_NAME_CALLERS = frozenset(("megatron.core.optimizer.optimizer",
                                "megatron.core.optimizer.distrib_optimizer",
                                "megatron.core.optimizer.clip_grads"))
_OPTIMIZER_APPLIED = False


def apply_distributed_optimizer() -> bool:
    """What megatron-core's DDP and distributed optimizer need on a machine without CUDA, on
    top of :func:`apply`: the CPU view of ``torch.cuda`` for their modules, and
    ``Tensor.type()`` answering the CUDA type name of a CPU tensor to those modules only (the
    callers are told apart by the calling frame's module). Returns whether it patched."""
    global _OPTIMIZER_APPLIED
    if not apply():
        return False
    if _OPTIMIZER_APPLIED:
        return True
    cpu_torch = importlib.import_module(_CUDA_BOUND_MODULES[0]).torch
    for name in _DISTRIBUTED_OPTIMIZER_MODULES:
        importlib.import_module(name).torch = cpu_torch
    original = torch.Tensor.type

    def type_name(self, *args, **kwargs):
        name = original(self, *args, **kwargs)
        if not args and not kwargs and isinstance(name, str) and name.startswith("torch.") \
                and not name.startswith("torch.cuda.") \
                and sys._getframe(1).f_globals.get("__name__") in _TYPE_NAME_CALLERS:
            return "torch.cuda." + name[len("torch."):]
        return name

    torch.Tensor.type = type_name
    _OPTIMIZER_APPLIED = True
    return True


def seed_model_parallel_rng(seed: int) -> None:
    """megatron's ``model_parallel_cuda_manual_seed`` for either device: the data-parallel,
    model-parallel (per TP rank) and expert streams of the RNG tracker."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import random as mrandom

    if torch.cuda.is_available():
        mrandom.model_parallel_cuda_manual_seed(seed)
        return
    apply()
    tracker = mrandom.get_cuda_rng_tracker()
    tracker.reset()
    tracker.add(mrandom._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME,
                seed + 2718 + ps.get_tensor_model_parallel_rank())
    tracker.add(mrandom._EXPERT_PARALLEL_RNG_TRACKER_NAME,
                seed + 1024 + 100 * ps.get_expert_model_parallel_rank()
                + ps.get_expert_tensor_parallel_rank())
