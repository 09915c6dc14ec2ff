"""Make the Triton interpreter (``TRITON_INTERPRET=1``) run the kernel's libdevice calls and bf16 dots.

Helion lowers ``torch.exp`` and friends through inductor to ``libdevice.*``. On a GPU those resolve
to CUDA's libdevice at compile time; the interpreter (triton 3.9) has no implementation and the
stubs return ``None``. When the interpreter is on, this rebinds the few libdevice functions the
kernel uses to the interpreter's own ``tl.math`` builtins (numpy underneath).

The interpreter also stores bf16 tensors as their raw ``uint16`` bits and its ``tl.dot`` multiplies
those bits as integers (it converts only fp8 operands); the shim widens bf16 operands to fp32 first
(exact), which is what the GPU's bf16 MMA with fp32 accumulation computes. GPU runs are untouched.
"""

from __future__ import annotations

import os

_applied = False


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def install_libdevice_shim() -> None:
    """Idempotent; a no-op unless ``TRITON_INTERPRET=1``."""
    global _applied
    if _applied or not interpreter_enabled():
        return
    import numpy as np
    import triton.language as tl
    import triton.language.extra.libdevice as libdevice
    from triton.runtime import interpreter
    from triton.runtime.interpreter import TensorHandle

    def unary(np_fn):  # noqa: ANN001, ANN202 - wraps a numpy ufunc as an interpreter builtin
        def fn(x):  # noqa: ANN001, ANN202
            data = np_fn(x.handle.data).astype(x.handle.data.dtype)
            return tl.tensor(TensorHandle(data, x.handle.dtype.scalar), x.type)

        return fn

    replacements = {
        "exp": np.exp, "exp2": np.exp2, "log": np.log, "log2": np.log2, "sqrt": np.sqrt,
        "rsqrt": lambda d: 1.0 / np.sqrt(d), "abs": np.abs, "floor": np.floor, "ceil": np.ceil,
        "log1p": np.log1p, "expm1": np.expm1, "tanh": np.tanh,
    }
    for name, np_fn in replacements.items():
        setattr(libdevice, name, unary(np_fn))

    builder_dot = interpreter.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):  # noqa: ANN001, ANN202
        def widened(x):  # noqa: ANN001, ANN202 - bf16 bits -> fp32 values (exact)
            if x.dtype.scalar != tl.bfloat16:
                return x
            data = interpreter._convert_float(x.data, tl.bfloat16, tl.float32, None).view(np.float32)
            return TensorHandle(data, tl.float32)

        return builder_dot(self, widened(a), widened(b), d, input_precision, max_num_imprecise_acc)

    interpreter.InterpreterBuilder.create_dot = create_dot
    _applied = True
