"""megatron-core's ``jit_fuser``, made lazy: the same ``torch.compile`` of each fused function,
done at its first call instead of at the import of the module that defines it.

megatron-core decorates its fusion functions (bias-GELU, bias-SwiGLU, ...) with
``megatron.core.jit.jit_fuser``, which is ``torch.compile`` on torch >= 2.2. Decorating imports
``torch._dynamo`` and ``torch._inductor`` when megatron-core is imported: about 1.8 s of a rank's
5.5 s of imports on this project's CPUs, in every rank of every launch, whether or not a fused
function is ever called (our model calls none unless a fusion is configured on). Here the module
is provided before megatron-core imports it, with the same four names; a decorated function
compiles at its first call, as ``torch.compile`` itself would, so nothing changes where one is
used (a GPU with ``bias_activation_fusion``), only when the compiler is imported.

:func:`install` runs when ``setdiff_dist`` is imported; it does nothing if megatron-core's own
module is already loaded.
"""

from __future__ import annotations

import functools
import sys
import types

NAME = "megatron.core.jit"


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
    if NAME in sys.modules:
        return
    module = types.ModuleType(NAME, __doc__)
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
