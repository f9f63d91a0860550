// decoder.c's stack of decoder layers as torch.ops.pipeline.decoder_layers: every argument checked
// (shapes against the model's, block types, dtypes, and every cache slot the step writes or reads)
// before the C function runs, so a bad call raises naming what is wrong.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <vector>

#include "checks.h"
#include "kernels.h"

namespace {

using at::Tensor;
using namespace pipeline_checks;

constexpr int64_t kTensorsPerLayer = 6;  // input norm, qkv, o, post norm, gate_up, down
constexpr int64_t kProductsPerLayer = 4;  // qkv, o, gate_up, down

// kind: 0 quant.c's fused kernel, 1 8-bit activations (quant_x8.c), 2 quant_gemm.c's tiles.
quant_weight weight_of(const Tensor& blocks, int64_t qtype, int64_t kind, int64_t rows, int64_t cols,
                       const char* name) {
  const char* op = "decoder_layers";
  check_blocks(blocks, qtype, cols, op);
  TORCH_CHECK_VALUE(blocks.size(0) == rows, op, ": ", name, " must have ", rows, " rows, not ", blocks.size(0));
  TORCH_CHECK_VALUE(kind >= 0 && kind <= 2, op, ": ", name, "'s kernel must be 0 (fused), 1 (8-bit activations) or ",
                    "2 (tiled), not ", kind);
  TORCH_CHECK_VALUE(kind != 1 || quant_x8_available(static_cast<int>(qtype)), op, ": ", name, "'s block type ",
                    qtype, " has no 8-bit activation kernel on this CPU");
  return quant_weight{blocks.const_data_ptr<uint8_t>(), blocks.size(1), rows, cols, static_cast<int>(qtype),
                      static_cast<int>(kind)};
}

const float* norm_of(const Tensor& weight, int64_t hidden, const char* name) {
  check_dtype(weight, at::kFloat, "decoder_layers", name);
  TORCH_CHECK_VALUE(weight.is_contiguous() && weight.numel() == hidden, "decoder_layers: ", name,
                    " must be contiguous float32 [", hidden, "], not of shape ", weight.sizes());
  return weight.const_data_ptr<float>();
}

Tensor decoder_layers_op(const Tensor& x, at::TensorList weights, at::IntArrayRef qtypes, at::IntArrayRef kinds,
                         at::TensorList caches, const Tensor& cos, const Tensor& sin, const Tensor& slot_mapping,
                         const Tensor& key_slots, const Tensor& mask, int64_t queries, int64_t heads, int64_t kv_heads,
                         double scale, double eps, bool unit_offset) {
  const char* op = "decoder_layers";
  check_dtype(x, at::kFloat, op, "x");
  check_dim(x, 2, op, "x", "float32 [tokens, hidden]");
  const int64_t num_layers = static_cast<int64_t>(caches.size());
  TORCH_CHECK_VALUE(num_layers > 0 && static_cast<int64_t>(weights.size()) == num_layers * kTensorsPerLayer &&
                        static_cast<int64_t>(qtypes.size()) == num_layers * kProductsPerLayer &&
                        static_cast<int64_t>(kinds.size()) == num_layers * kProductsPerLayer,
                    op, ": ", num_layers, " caches need ", kTensorsPerLayer, " weights and ", kProductsPerLayer,
                    " block types and kernels a layer, not ", weights.size(), ", ", qtypes.size(), " and ",
                    kinds.size());
  const Tensor& first_cache = caches[0];
  TORCH_CHECK_VALUE(first_cache.dim() >= 4, op, ": a cache must be [2, ..., kv_heads, head_dim], not of shape ",
                    first_cache.sizes());
  const int64_t tokens = x.size(0), hidden = x.size(1), head_dim = first_cache.size(-1);
  TORCH_CHECK_VALUE(tokens > 0 && kv_heads > 0 && heads % kv_heads == 0 && head_dim % 16 == 0 &&
                        first_cache.size(-2) == kv_heads, op, ": ", heads, " query heads over ", kv_heads,
                    " KV heads of size ", head_dim, " and ", tokens, " tokens (caches ", first_cache.sizes(),
                    "; heads a multiple of KV heads, head size a multiple of 16)");
  const int64_t q_size = heads * head_dim, kv_size = kv_heads * head_dim;
  const int64_t num_slots = first_cache.numel() / (2 * kv_size);
  const int kv_bf16 = element_kind(first_cache, op, "a cache");
  const Tensor& gate_up0 = weights[4];
  TORCH_CHECK_VALUE(gate_up0.dim() == 2 && gate_up0.size(0) % 2 == 0, op,
                    ": gate_up must hold [2 intermediate] rows, not of shape ", gate_up0.sizes());
  const int64_t inter = gate_up0.size(0) / 2;

  std::vector<decoder_layer> layers(num_layers);
  for (int64_t i = 0; i < num_layers; i++) {
    const Tensor* w = weights.data() + i * kTensorsPerLayer;
    const int64_t* type = qtypes.data() + i * kProductsPerLayer;
    const int64_t* kind = kinds.data() + i * kProductsPerLayer;
    const Tensor& cache = caches[i];
    TORCH_CHECK_VALUE(cache.sizes() == first_cache.sizes() && cache.scalar_type() == first_cache.scalar_type() &&
                          cache.is_contiguous() && cache.device().is_cpu() && cache.size(0) == 2,
                      op, ": layer ", i, "'s cache must be contiguous [2, ...] like layer 0's ", first_cache.sizes(),
                      " ", dtype_name(first_cache.scalar_type()), ", not ", cache.sizes(), " ",
                      dtype_name(cache.scalar_type()));
    char* keys = static_cast<char*>(cache.data_ptr());
    layers[i] = decoder_layer{norm_of(w[0], hidden, "an input norm"), norm_of(w[3], hidden, "a post-attention norm"),
                              weight_of(w[1], type[0], kind[0], q_size + 2 * kv_size, hidden, "qkv"),
                              weight_of(w[2], type[1], kind[1], hidden, q_size, "o"),
                              weight_of(w[4], type[2], kind[2], 2 * inter, hidden, "gate_up"),
                              weight_of(w[5], type[3], kind[3], hidden, inter, "down"),
                              keys, keys + cache.stride(0) * cache.element_size()};
  }
  for (const Tensor* table : {&cos, &sin}) {
    check_dtype(*table, at::kFloat, op, "cos and sin");
    TORCH_CHECK_VALUE(table->is_contiguous() && table->numel() == tokens * head_dim && table->size(0) == tokens, op,
                      ": cos and sin must be contiguous [", tokens, ", 1, ", head_dim, "], not of shape ",
                      table->sizes());
  }
  check_dtype(slot_mapping, at::kLong, op, "slot_mapping");
  check_dtype(key_slots, at::kLong, op, "key_slots");
  check_dtype(mask, at::kBool, op, "mask");
  TORCH_CHECK_VALUE(queries > 0 && tokens % queries == 0, op, ": ", tokens, " tokens are not rows of ", queries,
                    " queries");
  const int64_t rows = tokens / queries;
  TORCH_CHECK_VALUE(slot_mapping.numel() == tokens && key_slots.dim() == 2 && key_slots.size(0) == rows &&
                        mask.numel() == key_slots.numel() * queries, op, ": slot_mapping ", slot_mapping.sizes(),
                    ", key_slots ", key_slots.sizes(), " and mask ", mask.sizes(), " must be [", tokens, "], [", rows,
                    ", num_keys] and [", rows, ", ", queries, ", num_keys]");
  const Tensor written = slot_mapping.contiguous(), slots = key_slots.contiguous(), seen = mask.contiguous();
  const int64_t num_keys = slots.size(1);
  const int64_t* write_at = written.const_data_ptr<int64_t>();
  const int64_t* read_at = slots.const_data_ptr<int64_t>();
  const bool* sees = seen.const_data_ptr<bool>();
  for (int64_t t = 0; t < tokens; t++)
    TORCH_CHECK_INDEX(write_at[t] >= 0 && write_at[t] < num_slots, op, ": slot_mapping's slot ", write_at[t],
                      " (token ", t, ") is outside the cache's ", num_slots, " slots");
  for (int64_t row = 0; row < rows; row++)  // every slot a token sees is read: each must be in the cache
    for (int64_t i = 0; i < queries; i++)
      for (int64_t j = 0; j < num_keys; j++) {
        const int64_t at = read_at[row * num_keys + j];
        TORCH_CHECK_INDEX(!sees[(row * queries + i) * num_keys + j] || (at >= 0 && at < num_slots), op,
                          ": key slot ", at, " (row ", row, ", key ", j, ") is outside the cache's ", num_slots,
                          " slots");
      }
  const Tensor input = x.contiguous();
  Tensor out = at::empty({tokens, hidden}, input.options());
  const decode_shape shape{tokens, hidden, heads, kv_heads, head_dim, inter, num_keys, queries, static_cast<float>(eps),
                           static_cast<float>(scale), unit_offset ? 1 : 0, kv_bf16, cos.const_data_ptr<float>(),
                           sin.const_data_ptr<float>(), write_at, read_at, reinterpret_cast<const uint8_t*>(sees)};
  const int status = decoder_layers(layers.data(), num_layers, &shape, input.const_data_ptr<float>(),
                                    out.mutable_data_ptr<float>());
  TORCH_CHECK_VALUE(status == 0, op, ": an 8-bit activation kernel is not built for this CPU");
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pipeline, m) {
  m.def("decoder_layers(Tensor x, Tensor[] weights, int[] qtypes, int[] kinds, Tensor(a!)[] caches, Tensor cos, "
        "Tensor sin, Tensor slot_mapping, Tensor key_slots, Tensor mask, int queries, int heads, int kv_heads, "
        "float scale, float eps, bool unit_offset) -> Tensor");
}

TORCH_LIBRARY_IMPL(pipeline, CPU, m) { m.impl("decoder_layers", TORCH_FN(decoder_layers_op)); }
