"""Two gaps of Triton 3.6's CPU interpreter, patched for the CPU suite only; the kernels run unchanged.

Imported by conftest.py when TRITON_INTERPRET=1 (no CUDA): our Triton kernels are then tested on the CPU.
"""
from __future__ import annotations


def apply() -> None:
    import numpy as np
    from triton.runtime import interpreter

    _patch_tensor, _dot = interpreter._patch_lang_tensor, interpreter.InterpreterBuilder.create_dot

    def _patch_tensor_index(tensor, scope):
        # Loop bounds come from 1-element arrays through int(array), which numpy >= 2.4 refuses
        # (triton-lang/triton#9171, fixed upstream by reading the element instead).
        _patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    def _dot_bf16_as_fp32(self, a, b, d, input_precision, max_num_imprecise_acc):
        # bf16 is held as raw uint16 bits and np.matmul would multiply the integers; widening to fp32 is
        # exact, so this is a bf16 x bf16 -> fp32 tensor-core dot.
        a, b = (interpreter.TensorHandle((x.data.astype(np.uint32) << 16).view(np.float32), interpreter.tl.float32)
                if x.dtype == interpreter.tl.bfloat16 else x for x in (a, b))
        return _dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    interpreter._patch_lang_tensor = _patch_tensor_index
    interpreter.InterpreterBuilder.create_dot = _dot_bf16_as_fp32
