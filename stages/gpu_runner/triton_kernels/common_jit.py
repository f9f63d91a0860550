"""Triton helpers shared by the kernels: rounding to the output dtype and the tile dot product."""
import triton
import triton.language as tl


@triton.jit
def round_to(x, DTYPE: tl.constexpr):
    """float32 x -> DTYPE, rounded to nearest even.

    bfloat16 is rounded by hand on the bits: Triton's CPU interpreter truncates a float32 ->
    bfloat16 cast, and the same code on both devices keeps the interpreted tests meaningful.
    """
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(DTYPE)


@triton.jit
def dot(a, b, DOT_FP32: tl.constexpr):
    """a @ b accumulated in float32. DOT_FP32 multiplies float32 copies exactly (IEEE, no TF32):
    for float32 inputs, and in the interpreter, whose dot cannot read bfloat16. The products of
    bf16/fp16 values are exact in float32 either way, so only the summation order differs."""
    if DOT_FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


# Triton's own @jit library functions (tl.sum, tl.max, tl.zeros, tl.cdiv) are decorated once, in
# the mode of the process's first `import triton`, and a compiled one cannot run inside an
# interpreted kernel. The kernels use builtins only, plus these reductions: tl.reduce with the
# library's combine functions, which the interpreter recognises by identity (numpy fast path)
# and never calls.
@triton.jit
def sum_over(x, AXIS: tl.constexpr):
    return tl.reduce(x, AXIS, tl.standard._sum_combine)


@triton.jit
def max_over(x, AXIS: tl.constexpr):
    return tl.reduce(x, AXIS, tl.standard._elementwise_max)
