"""Two imports that megatron-core makes at its own import, made lazy: its ``jit_fuser`` and
Weights & Biases. Each costs every rank of every launch a share of its start-up whether or not
it is used; made lazy, each is imported where it is first used, and nothing else changes.

**jit_fuser.** megatron-core decorates its fusion functions (bias-GELU, bias-SwiGLU, ...) with
``megatron.core.jit.jit_fuser``, which is ``torch.compile`` on torch >= 2.2. Decorating imports
``torch._dynamo`` and ``torch._inductor`` when megatron-core is imported: about 1.8 s of a rank's
5.5 s of imports on this project's CPUs, whether or not a fused function is ever called (our
model calls none unless a fusion is configured on). Here the module is provided before
megatron-core imports it, with the same four names; a decorated function compiles at its first
call, as ``torch.compile`` itself would, so nothing changes where one is used (a GPU with
``bias_activation_fusion``), only when the compiler is imported.

**wandb.** megatron-core's inference context and timers ``import wandb`` at their import (to
know whether it is there) wherever it is installed: 0.4 s of a rank's start-up on this
project's CPUs (13% of a training rank's imports), for a logger that runs only with
``logging.wandb=true``. Here ``wandb`` is registered as a lazily loaded module
(:class:`LazyModule`): ``import wandb`` finds it, and it loads at the first use of one of its
names (our :class:`~setdiff_dist.train.metrics.WandbLogger`'s
``wandb.init``). Where wandb is not installed nothing is registered, and ``import wandb`` fails
as before.

:func:`install` runs when ``setdiff_dist`` is imported; it leaves alone a module already loaded.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
import types

NAME = "megatron.core.jit"
LAZY_MODULES = ("wandb",)  # imported by megatron-core, used by us only when configured


def noop_decorator(func):
    """No-op decorator (megatron's name)."""
    return func


def lazy_compile(func):
    """``torch.compile(func)``, made at the first call; on a machine without CUDA the function
    itself (inductor's CPU code generation would take longer than these elementwise functions
    ever run in a CPU job: the fusion's gain there is the memory of its autograd function)."""
    compiled = None

    @functools.wraps(func)
    def call(*args, **kwargs):
        nonlocal compiled
        if compiled is None:
            import torch

            compiled = torch.compile(func) if torch.cuda.is_available() else func
        return compiled(*args, **kwargs)

    return call


def install() -> None:
    for name in LAZY_MODULES:
        lazy_module(name)
    install_jit()


def lazy_module(name: str) -> None:
    """Register ``name`` as a module that loads at the first use of a name it defines (nothing
    if it is already imported or not installed)."""
    if name in sys.modules:
        return
    spec = importlib.util.find_spec(name)
    if spec is None:
        return
    sys.modules[name] = LazyModule(spec)


class LazyModule(types.ModuleType):
    """A module's stand-in that imports it at the first look-up of a name the stand-in lacks.

    Unlike :class:`importlib.util.LazyLoader`, whose module loads at the first access of any
    attribute, the import system's own attributes (``__file__``, ``__spec__``, ...) are answered
    without loading, so a scan of ``sys.modules`` (``inspect.getmodule``, run by torch's operator
    registration at import) does not load it. The real module replaces the stand-in in
    ``sys.modules``; names bound to the stand-in (``import wandb`` in megatron-core) reach the real
    module through it."""

    def __init__(self, spec):
        super().__init__(spec.name)
        self.__spec__, self.__loader__ = spec, spec.loader
        self.__file__ = spec.origin
        if spec.submodule_search_locations is not None:
            self.__path__ = list(spec.submodule_search_locations)

    def __getattr__(self, attr):
        name = self.__spec__.name
        if sys.modules.get(name) is self:
            del sys.modules[name]
        return getattr(importlib.import_module(name), attr)


def install_jit() -> None:
    if NAME in sys.modules:
        return
    module = types.ModuleType(NAME, "megatron-core's jit module, compiled lazily (see _lazy)")
    module.noop_decorator = noop_decorator
    module.jit_fuser = lazy_compile

    def enable_jit_fuser():
        """Enable the JIT fuser (megatron's name): ``torch.compile``, at first call."""
        module.jit_fuser = lazy_compile

    def disable_jit_fuser():
        """Disable the JIT fuser (megatron's name)."""
        module.jit_fuser = noop_decorator

    module.enable_jit_fuser, module.disable_jit_fuser = enable_jit_fuser, disable_jit_fuser
    sys.modules[NAME] = module
