// The C kernels (kernels.h) as torch operators, torch.ops.pipeline.<name>: each checks its
// arguments (device, dtype, shape, layout, and every index it will follow) with TORCH_CHECK, so a
// bad call raises a Python exception naming the argument instead of reading out of bounds, then
// calls the C function on the tensors' memory. The kernels' OpenMP loops run on torch's own
// OpenMP runtime (build.py links the one torch has loaded), so at::set_num_threads governs them.
//
// Adding an operator: the C function declared in kernels.h (its .c file beside this one is built
// with the others), a function `<name>_op` below that checks its arguments and calls it, and one
// line in PIPELINE_OPS (its schema); the Python wrapper calls torch.ops.pipeline.<name>.
// Headers: torch/library.h and the two ATen operators used, not torch/extension.h, so that the
// one C++ file compiles in seconds.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "checks.h"
#include "kernels.h"

namespace {

using at::Tensor;
using namespace pipeline_checks;

void check_same_dtype(const Tensor& a, const Tensor& b, const char* op, const char* name) {
  check_cpu(b, op, name);
  TORCH_CHECK_VALUE(b.scalar_type() == a.scalar_type(), op, ": ", name, " must be ", dtype_name(a.scalar_type()),
                    " like x, not ", dtype_name(b.scalar_type()));
}

Tensor paged_attention_op(const Tensor& query, const Tensor& cache, const Tensor& slots, const Tensor& mask,
                          double scale) {
  const char* op = "paged_attention";
  const int bf16 = element_kind(query, op, "query");
  check_dim(query, 4, op, "query", "[rows, queries, heads, head_dim]");
  check_dim(cache, 4, op, "the cache", "[2, slots, kv_heads, head_dim]");
  const int kv_bf16 = element_kind(cache, op, "the cache");  // its own dtype: kv_cache_dtype
  TORCH_CHECK_VALUE(cache.is_contiguous() && cache.size(0) == 2, op,
                    ": the cache must be contiguous [2, slots, kv_heads, head_dim], not of shape ", cache.sizes(),
                    " strides ", cache.strides());
  const int64_t rows = query.size(0), queries = query.size(1), heads = query.size(2), head_dim = query.size(3);
  const int64_t num_slots = cache.size(1), kv_heads = cache.size(2);
  TORCH_CHECK_VALUE(cache.size(3) == head_dim && head_dim % 16 == 0 && kv_heads > 0 && heads % kv_heads == 0, op,
                    ": ", heads, " query heads of size ", head_dim, " over ", kv_heads, " KV heads of size ",
                    cache.size(3), " (sizes must match, a multiple of 16; heads a multiple of KV heads)");
  check_dtype(slots, at::kLong, op, "slots");
  check_dim(slots, 2, op, "slots", "[rows, num_keys]");
  check_dtype(mask, at::kBool, op, "mask");
  const int64_t num_keys = slots.size(1);
  TORCH_CHECK_VALUE(slots.size(0) == rows && mask.dim() == 3 && mask.size(0) == rows && mask.size(1) == queries &&
                        mask.size(2) == num_keys, op, ": slots ", slots.sizes(), " and mask ", mask.sizes(),
                    " must be [", rows, ", num_keys] and [", rows, ", ", queries, ", num_keys]");
  const Tensor q = query.contiguous(), s = slots.contiguous(), m = mask.contiguous();
  const int64_t* slot = s.const_data_ptr<int64_t>();
  const bool* seen = m.const_data_ptr<bool>();
  for (int64_t row = 0; row < rows; row++)  // every slot a query sees is read: each must be in the cache
    for (int64_t i = 0; i < queries; i++)
      for (int64_t j = 0; j < num_keys; j++) {
        const int64_t at = slot[row * num_keys + j];
        TORCH_CHECK_INDEX(!seen[(row * queries + i) * num_keys + j] || (at >= 0 && at < num_slots), op, ": slot ",
                          at, " (row ", row, ", key ", j, ") is outside the cache's ", num_slots, " slots");
      }
  Tensor out = at::empty(q.sizes(), q.options());
  const char* keys = static_cast<const char*>(cache.const_data_ptr());
  paged_attention(q.const_data_ptr(), keys, keys + cache.stride(0) * cache.element_size(), slot,
                  reinterpret_cast<const uint8_t*>(seen), out.mutable_data_ptr(), rows, queries, num_keys, heads,
                  kv_heads, head_dim, static_cast<float>(scale), bf16, kv_bf16);
  return out;
}

Tensor sample_logits_op(const Tensor& logits, const Tensor& inverse_temperature, const Tensor& points) {
  const char* op = "sample_logits";
  check_dtype(logits, at::kFloat, op, "logits");
  check_dim(logits, 2, op, "logits", "float32 [rows, vocab]");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK_VALUE(vocab > 0, op, ": logits need at least one token, not shape ", logits.sizes());
  check_dtype(inverse_temperature, at::kFloat, op, "inverse_temperature");
  check_dtype(points, at::kDouble, op, "points");
  TORCH_CHECK_VALUE(inverse_temperature.numel() == rows && points.numel() == rows, op, ": ", rows,
                    " rows need as many temperatures and points, not ", inverse_temperature.numel(), " and ",
                    points.numel());
  const Tensor l = logits.contiguous(), t = inverse_temperature.contiguous(), p = points.contiguous();
  Tensor tokens = at::empty({rows}, l.options().dtype(at::kLong));
  sample_logits(l.const_data_ptr<float>(), t.const_data_ptr<float>(), p.const_data_ptr<double>(),
                tokens.mutable_data_ptr<int64_t>(), rows, vocab);
  return tokens;
}

// x as [rows, hidden] with its last dimension contiguous (a view where one exists).
Tensor as_rows(const Tensor& x) {
  const Tensor rows = x.reshape({-1, x.size(-1)});
  return rows.stride(-1) == 1 ? rows : rows.contiguous();
}

Tensor norm(const Tensor& x, const std::optional<Tensor>& residual, const Tensor& weight, double eps,
            bool unit_offset, Tensor* residual_out) {
  const char* op = "rms_norm";
  const int bf16 = element_kind(x, op, "x");
  TORCH_CHECK_VALUE(x.dim() >= 1 && x.numel() > 0, op, ": x must be [..., hidden], not of shape ", x.sizes());
  check_same_dtype(x, weight, op, "weight");
  const int64_t hidden = x.size(-1);
  TORCH_CHECK_VALUE(weight.numel() == hidden, op, ": weight must hold ", hidden, " values, not shape ",
                    weight.sizes());
  const Tensor rows = as_rows(x), w = weight.contiguous();
  Tensor res;
  if (residual.has_value()) {
    check_same_dtype(x, *residual, op, "residual");
    TORCH_CHECK_VALUE(residual->sizes() == x.sizes(), op, ": residual ", residual->sizes(), " must be shaped like x ",
                      x.sizes());
    res = residual->contiguous();
    *residual_out = at::empty(x.sizes(), x.options());
  }
  Tensor out = at::empty(x.sizes(), x.options());
  rms_norm(rows.const_data_ptr(), rows.stride(0), res.defined() ? res.const_data_ptr() : nullptr,
           res.defined() ? residual_out->mutable_data_ptr() : nullptr, w.const_data_ptr(), out.mutable_data_ptr(),
           rows.size(0), hidden, static_cast<float>(eps), unit_offset, bf16);
  return out;
}

Tensor rms_norm_op(const Tensor& x, const Tensor& weight, double eps, bool unit_offset) {
  return norm(x, std::nullopt, weight, eps, unit_offset, nullptr);
}

std::tuple<Tensor, Tensor> add_rms_norm_op(const Tensor& x, const Tensor& residual, const Tensor& weight, double eps,
                                           bool unit_offset) {
  Tensor sum;
  Tensor out = norm(x, residual, weight, eps, unit_offset, &sum);
  return {out, sum};
}

Tensor silu_and_mul_op(const Tensor& gate, const Tensor& up) {
  const char* op = "silu_and_mul";
  const int bf16 = element_kind(gate, op, "gate");
  check_same_dtype(gate, up, op, "up");
  check_dim(gate, 2, op, "gate", "[tokens, width]");
  TORCH_CHECK_VALUE(up.sizes() == gate.sizes(), op, ": up ", up.sizes(), " must be shaped like gate ", gate.sizes());
  // Views of one merged projection share their row stride; anything else is copied contiguous.
  const bool shared = gate.strides() == up.strides() && gate.stride(1) == 1;
  const Tensor g = shared ? gate : gate.contiguous(), u = shared ? up : up.contiguous();
  Tensor out = at::empty(gate.sizes(), gate.options());
  silu_and_mul(g.const_data_ptr(), u.const_data_ptr(), g.stride(0), out.mutable_data_ptr(), g.size(0), g.size(1),
               bf16);
  return out;
}

Tensor rotary_op(const Tensor& x, const Tensor& cos, const Tensor& sin) {
  const char* op = "rotary";
  const int bf16 = element_kind(x, op, "x");
  check_dim(x, 3, op, "x", "[tokens, heads, head_dim]");
  check_same_dtype(x, cos, op, "cos");
  check_same_dtype(x, sin, op, "sin");
  const int64_t tokens = x.size(0), heads = x.size(1), head_dim = x.size(2);
  TORCH_CHECK_VALUE(head_dim % 2 == 0, op, ": head_dim must be even, not ", head_dim);
  for (const Tensor* table : {&cos, &sin})
    TORCH_CHECK_VALUE(table->dim() >= 2 && table->size(0) == tokens && table->size(-1) == head_dim &&
                          table->numel() == tokens * head_dim, op, ": cos and sin must be [", tokens, ", 1, ",
                      head_dim, "], not of shape ", table->sizes());
  const Tensor v = x.stride(2) == 1 && x.stride(1) == head_dim ? x : x.contiguous();
  const Tensor c = cos.contiguous(), s = sin.contiguous();
  Tensor out = at::empty(x.sizes(), x.options());
  rotary(v.const_data_ptr(), v.stride(0), c.const_data_ptr(), s.const_data_ptr(), out.mutable_data_ptr(), tokens,
         heads, head_dim, bf16);
  return out;
}

int64_t quant_block_bytes_op(int64_t qtype) { return quant_block_bytes(static_cast<int>(qtype)); }

Tensor quant_dequantize_rows_op(const Tensor& blocks, int64_t qtype, int64_t cols, const std::optional<Tensor>& ids,
                                int64_t start, int64_t count) {
  const char* op = "dequantize_rows";
  check_blocks(blocks, qtype, cols, op);
  const int64_t rows = blocks.size(0);
  Tensor picked;
  if (ids.has_value()) {
    check_dtype(*ids, at::kLong, op, "row ids");
    picked = ids->reshape({-1}).contiguous();
    count = picked.numel();
    const int64_t* id = picked.const_data_ptr<int64_t>();
    for (int64_t i = 0; i < count; i++)
      TORCH_CHECK_INDEX(id[i] >= 0 && id[i] < rows, op, ": row ids must be in [0, ", rows, "), got ", id[i],
                        " at position ", i);
  } else {
    TORCH_CHECK_INDEX(start >= 0 && count >= 0 && start + count <= rows, op, ": rows ", start, " + ", count,
                      " out of [0, ", rows, ")");
  }
  Tensor out = at::empty({count, cols}, blocks.options().dtype(at::kFloat));
  quant_dequantize_rows(blocks.const_data_ptr<uint8_t>(), static_cast<int>(qtype), blocks.size(1), cols,
                        picked.defined() ? picked.const_data_ptr<int64_t>() : nullptr, start, count,
                        out.mutable_data_ptr<float>());
  return out;
}

// Checks activations: CPU float32 [n, cols].
Tensor activations(const Tensor& x, int64_t cols, const char* op) {
  check_cpu(x, op, "activations");
  TORCH_CHECK_VALUE(x.dim() == 2 && x.size(1) == cols && x.scalar_type() == at::kFloat, op,
                    ": activations must be CPU float32 [n, ", cols, "], not ", dtype_name(x.scalar_type()), " ", x.sizes());
  return x.contiguous();
}

Tensor quant_matmul_op(const Tensor& x, const Tensor& blocks, int64_t qtype, int64_t cols) {
  const char* op = "quant matmul";
  check_blocks(blocks, qtype, cols, op);
  const Tensor a = activations(x, cols, op);
  Tensor out = at::empty({a.size(0), blocks.size(0)}, a.options());
  quant_matmul(blocks.const_data_ptr<uint8_t>(), static_cast<int>(qtype), blocks.size(1), blocks.size(0), cols,
               a.const_data_ptr<float>(), a.size(0), out.mutable_data_ptr<float>());
  return out;
}

// quant_matmul with the activations quantized to 8 bits a block (quant_x8.c): AVX-512 VNNI or AVX2 CPUs.
Tensor quant_matmul_x8_op(const Tensor& x, const Tensor& blocks, int64_t qtype, int64_t cols) {
  const char* op = "quant matmul_x8";
  check_blocks(blocks, qtype, cols, op);
  TORCH_CHECK_VALUE(quant_x8_available(static_cast<int>(qtype)), op, ": block type ", qtype,
                    " has no 8-bit activation kernel on this CPU (it needs AVX-512 VNNI or AVX2)");
  const Tensor a = activations(x, cols, op);
  Tensor out = at::empty({a.size(0), blocks.size(0)}, a.options());
  quant_matmul_x8(blocks.const_data_ptr<uint8_t>(), static_cast<int>(qtype), blocks.size(1), blocks.size(0), cols,
                  a.const_data_ptr<float>(), a.size(0), out.mutable_data_ptr<float>());
  return out;
}

int64_t quant_x8_available_op(int64_t qtype) { return quant_x8_available(static_cast<int>(qtype)); }

Tensor quant_matmul_tiled_op(const Tensor& x, const Tensor& blocks, int64_t qtype, int64_t cols, int64_t tile_rows) {
  const char* op = "quant matmul";
  check_blocks(blocks, qtype, cols, op);
  TORCH_CHECK_VALUE(tile_rows >= 0, op, ": tile_rows must be >= 0 (0: the default), not ", tile_rows);
  const Tensor a = activations(x, cols, op);
  Tensor out = at::empty({a.size(0), blocks.size(0)}, a.options());
  quant_matmul_tiled(blocks.const_data_ptr<uint8_t>(), static_cast<int>(qtype), blocks.size(1), blocks.size(0), cols,
                     a.const_data_ptr<float>(), a.size(0), out.mutable_data_ptr<float>(), tile_rows);
  return out;
}

// Q8_0 and Q4_0: the block types quant_encode.c makes.
Tensor quant_quantize_rows_op(const Tensor& weight, int64_t qtype) {
  const char* op = "quantize_rows";
  TORCH_CHECK_VALUE(qtype == 8 || qtype == 2, op, ": block type ", qtype, " is not one of Q8_0 (8), Q4_0 (2)");
  check_cpu(weight, op, "the weight");
  TORCH_CHECK_VALUE(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.size(1) % 32 == 0, op,
                    ": the weight must be CPU float32 [rows, cols], cols a multiple of 32, not ",
                    dtype_name(weight.scalar_type()), " ", weight.sizes());
  const Tensor w = weight.contiguous();
  const int64_t rows = w.size(0), cols = w.size(1);
  Tensor out = at::empty({rows, cols / 32 * quant_block_bytes(static_cast<int>(qtype))}, w.options().dtype(at::kByte));
  const int status = quant_quantize_rows(w.const_data_ptr<float>(), static_cast<int>(qtype), rows, cols,
                                         out.mutable_data_ptr<uint8_t>());
  TORCH_CHECK_VALUE(status == 0, op, ": block type ", qtype, " is not made here");
  return out;
}

}  // namespace

// name, schema: one line an operator on tensors (CPU kernels), then the operators on numbers only
// (kernels for any dispatch key: there is no tensor to dispatch on).
#define PIPELINE_OPS(X)                                                                                         \
  X(paged_attention, "(Tensor query, Tensor cache, Tensor slots, Tensor mask, float scale) -> Tensor")           \
  X(sample_logits, "(Tensor logits, Tensor inverse_temperature, Tensor points) -> Tensor")                        \
  X(rms_norm, "(Tensor x, Tensor weight, float eps, bool unit_offset) -> Tensor")                                 \
  X(add_rms_norm, "(Tensor x, Tensor residual, Tensor weight, float eps, bool unit_offset) -> (Tensor, Tensor)")  \
  X(silu_and_mul, "(Tensor gate, Tensor up) -> Tensor")                                                           \
  X(rotary, "(Tensor x, Tensor cos, Tensor sin) -> Tensor")                                                       \
  X(quant_dequantize_rows, "(Tensor blocks, int qtype, int cols, Tensor? ids, int start, int count) -> Tensor")  \
  X(quant_matmul, "(Tensor x, Tensor blocks, int qtype, int cols) -> Tensor")                                    \
  X(quant_matmul_x8, "(Tensor x, Tensor blocks, int qtype, int cols) -> Tensor")                                 \
  X(quant_matmul_tiled, "(Tensor x, Tensor blocks, int qtype, int cols, int tile_rows) -> Tensor")               \
  X(quant_quantize_rows, "(Tensor weight, int qtype) -> Tensor")

#define PIPELINE_SCALAR_OPS(X)                 \
  X(quant_block_bytes, "(int qtype) -> int") \
  X(quant_x8_available, "(int qtype) -> int")

#define PIPELINE_DEFINE(name, schema) m.def(#name schema);
#define PIPELINE_DEFINE_WITH_KERNEL(name, schema) m.def(#name schema, TORCH_FN(name##_op));
#define PIPELINE_IMPLEMENT(name, schema) m.impl(#name, TORCH_FN(name##_op));

TORCH_LIBRARY(pipeline, m) {
  PIPELINE_OPS(PIPELINE_DEFINE)
  PIPELINE_SCALAR_OPS(PIPELINE_DEFINE_WITH_KERNEL)
}

TORCH_LIBRARY_IMPL(pipeline, CPU, m) { PIPELINE_OPS(PIPELINE_IMPLEMENT) }
