"""The kit's tile helpers: a tile's multiply-accumulate whose operand precision the launcher picks
from the operands (what the GEMM-shaped kernels of the library share).

- fp32 operands are multiplied in full fp32 ("ieee"), as torch.matmul does by default, not in
  TF32;
- bf16 and fp16 operands on tensor cores, products exact in the fp32 accumulator;
- interpreted (CPU tensors), bf16 operands go through fp32 products: Triton's interpreter
  multiplies bfloat16 dot operands as their raw 16 bits (triton-lang/triton#11584).

    acc = mma(a, b, acc, PRECISION)          # in a kernel; PRECISION: tl.constexpr
    kernel[grid](..., PRECISION=mma_precision(x))
"""

import torch
import triton
import triton.language as tl

__all__ = ["mma", "mma_precision"]


def mma_precision(x: torch.Tensor) -> str:
    """The precision `mma` multiplies operands of x's dtype and device in."""
    if x.dtype == torch.float32:
        return "ieee"
    return "via_fp32" if x.device.type != "cuda" else "tf32"


@triton.jit
def mma(a, b, acc, PRECISION: tl.constexpr):
    """acc + a @ b (a tile's multiply-accumulate), operands multiplied as mma_precision chose."""
    if PRECISION == "via_fp32":
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc, input_precision=PRECISION)
