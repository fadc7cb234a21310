"""Run SGLang's FLA chunk kernels (and ours, which call them) under the Triton interpreter.

Four gaps of Triton 3.6's interpreter and of SGLang's CPU fallbacks stand between those kernels
and a CPU; this closes them for the test process only:
- ``tl.dot`` on bf16 operands multiplies their raw uint16 storage: widen them to fp32 first
  (exact; a GPU's MMA also multiplies bf16 exactly and accumulates in fp32);
- module-level aliases such as ``exp = tl.exp`` escape the interpreter's patching of
  ``triton.language``: rebind them to late-bound calls;
- an autotuner with several configs benchmarks them on a device: keep the first config;
- FLA's ``input_guard`` enters ``torch.cpu.device``, which does not exist.
"""
import contextlib
import sys

import numpy as np
import triton.language as tl
from triton.runtime import interpreter
from triton.runtime.autotuner import Autotuner

_PREFIX = "sglang.kernels.ops.attention.fla"
_done = False


def _widen_bf16(x):
    if x.dtype.scalar == tl.bfloat16:
        data = interpreter._convert_float(x.data, tl.bfloat16, tl.float32, None).view(np.float32)
        return interpreter.TensorHandle(data, tl.float32)
    return x


def patch() -> None:
    global _done
    if _done:
        return
    _done = True
    import sglang.kernels.ops.attention.fla.chunk  # noqa: F401  (loads the FLA modules)
    import sglang.kernels.ops.attention.fla.utils as fla_utils

    create_dot = interpreter.InterpreterBuilder.create_dot
    interpreter.InterpreterBuilder.create_dot = (
        lambda self, a, b, d, *args: create_dot(self, _widen_bf16(a), _widen_bf16(b), d, *args))
    fla_utils.custom_device_ctx = lambda index: contextlib.nullcontext()
    for name, module in list(sys.modules.items()):
        if not name.startswith(_PREFIX):
            continue
        for attr, value in list(vars(module).items()):
            if attr in ("exp", "exp2", "log", "log2") and tl.core.is_builtin(value):
                setattr(module, attr, _late(value.__name__))
            while value is not None and hasattr(value, "fn"):     # Heuristics -> Autotuner -> fn
                if isinstance(value, Autotuner) and len(value.configs) > 1:
                    value.configs = value.configs[:1]
                value = value.fn


def _late(name):
    source = tl.math if hasattr(tl.math, name) else tl
    return lambda *args, **kwargs: getattr(source, name)(*args, **kwargs)
