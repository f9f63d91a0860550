// The argument checks every operator makes (ops.cpp, decoder_op.cpp): each raises a Python
// ValueError naming the operator, the argument and what it must be.
#ifndef PIPELINE_CPU_CHECKS_H
#define PIPELINE_CPU_CHECKS_H

#include <ATen/core/Tensor.h>

#include "kernels.h"

namespace pipeline_checks {

using at::Tensor;

// A dtype as Python spells it (torch.float32 is "float32", not c10's "Float").
inline const char* dtype_name(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat: return "float32";
    case at::kBFloat16: return "bfloat16";
    case at::kHalf: return "float16";
    case at::kDouble: return "float64";
    case at::kLong: return "int64";
    case at::kInt: return "int32";
    case at::kByte: return "uint8";
    case at::kChar: return "int8";
    case at::kShort: return "int16";
    case at::kBool: return "bool";
    default: return c10::toString(dtype);
  }
}

inline void check_cpu(const Tensor& t, const char* op, const char* name) {
  TORCH_CHECK_VALUE(t.defined() && t.device().is_cpu(), op, ": ", name, " must be a CPU tensor");
}

inline void check_dtype(const Tensor& t, at::ScalarType dtype, const char* op, const char* name) {
  check_cpu(t, op, name);
  TORCH_CHECK_VALUE(t.scalar_type() == dtype, op, ": ", name, " must be ", dtype_name(dtype), ", not ", dtype_name(t.scalar_type()));
}

inline void check_dim(const Tensor& t, int64_t dim, const char* op, const char* name, const char* layout) {
  TORCH_CHECK_VALUE(t.dim() == dim, op, ": ", name, " must be ", layout, ", not of shape ", t.sizes());
}

// 1 for bfloat16, 0 for float32 (the kernels' element types), checking that `t` is one of them
// and a CPU tensor.
inline int element_kind(const Tensor& t, const char* op, const char* name) {
  check_cpu(t, op, name);
  TORCH_CHECK_VALUE(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, op, ": ", name,
                    " must be float32 or bfloat16, not ", dtype_name(t.scalar_type()));
  return t.scalar_type() == at::kBFloat16;
}

// Checks blocks: contiguous CPU uint8 [rows, cols / values * block_bytes] of a type quant.c decodes.
inline void check_blocks(const Tensor& blocks, int64_t qtype, int64_t cols, const char* op) {
  const int64_t size = quant_block_bytes(static_cast<int>(qtype));
  const int64_t values = qtype >= 10 ? 256 : 32;  // the K types hold 256 values a block
  const bool shaped = size > 0 && cols > 0 && cols % values == 0 && blocks.dim() == 2 &&
                      blocks.size(1) == cols / values * size;
  TORCH_CHECK_VALUE(shaped && blocks.scalar_type() == at::kByte && blocks.is_contiguous() && blocks.device().is_cpu(),
                    op, ": blocks of type ", qtype, " for ", cols, " columns must be contiguous CPU uint8 [rows, ",
                    size > 0 && cols % values == 0 ? cols / values * size : -1, "], not ", dtype_name(blocks.scalar_type()), " ",
                    blocks.sizes(), size > 0 ? "" : " (a type these kernels do not decode)");
}

}  // namespace pipeline_checks

#endif
