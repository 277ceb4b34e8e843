"""``compiled_on_gpu``: a function of many small whole-array operations, run compiled where its tensors are on a GPU.

The books of the host-cached tables are dozens of small operations each (sorts, prefix sums, scatters). Eagerly, each is
a kernel launch and its host work, and in a training step the host launching them, not the device running them, sets the
pace. ``torch.compile`` fuses the element-wise ones into a few kernels, which the host launches in a fraction of the
time, from C++ where the machine builds Inductor's C++ wrapper (``cpp_wrapper``, which cuts the host's time a call
further: docs/BENCHMARKS.md, "Tables larger than the device"), else from Inductor's Python wrapper. On the CPU, on a GPU
that Triton cannot compile for, and where both compilations fail (a warning says why, once), the function runs eagerly:
the same operations, the same values.

Example::

    @compiled_on_gpu(lambda cache: cache.order)        # the tensor whose device decides
    def place(self, rows): ...
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable

import torch

_WRAPPERS = ({"cpp_wrapper": True}, {})
"""Inductor's options, tried in turn: the kernels launched from C++, else from Python."""


def compiled_on_gpu(tensor_of: Callable[[object], torch.Tensor]):
    """Run the decorated function compiled (one compilation shared by every call, recompiled as ``torch.compile``
    recompiles) where ``tensor_of(first argument)`` is on a GPU that Triton can compile for, eagerly elsewhere."""

    def wrap(function):
        compiled, tried = None, 0

        @functools.wraps(function)
        def run(first, *args):
            nonlocal compiled, tried
            if not (tensor_of(first).is_cuda and _triton_usable()):
                return function(first, *args)
            while True:
                if compiled is None:
                    compiled = torch.compile(function, options=_WRAPPERS[tried])
                try:
                    return compiled(first, *args)
                except Exception as err:
                    from torch._dynamo.exc import BackendCompilerFailed  # (torch._dynamo takes a second to import)

                    if not isinstance(err, BackendCompilerFailed):
                        raise
                    # it failed before the graph ran: nothing changed yet
                    tried += 1
                    if tried < len(_WRAPPERS):
                        compiled = None
                        continue
                    compiled = function
                    reason = _reason(getattr(err, "inner_exception", None) or err)
                    print(f"warning: {function.__qualname__} runs eagerly, torch.compile could not compile it: "
                          f"{reason}", file=sys.stderr)
                    return function(first, *args)

        return run

    return wrap


@functools.cache
def _triton_usable() -> bool:
    from torch.utils._triton import has_triton

    return has_triton()


def _reason(error: BaseException) -> str:
    """One line of ``error``'s message that says what failed: a compiler's message may first give the place in the
    generated source ("at 43:12:") and the source itself, and name the error last."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    if not lines:
        return type(error).__name__
    return next((line for line in reversed(lines) if "Error" in line), lines[0])
