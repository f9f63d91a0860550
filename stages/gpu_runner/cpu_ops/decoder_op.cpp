// decoder.c's stack of decoder layers as torch.ops.pipeline.decoder_layers: every argument checked
// (shapes against the model's, block types and kernels, dtypes, and every cache slot the step
// writes or reads) before the C function runs, so a bad call raises naming what is wrong.
//
// A layer is kWeights tensors, absent ones None: input norm, attention-out norm?, MLP norm,
// MLP-out norm?, q norm?, k norm?, qkv (merged, or q, k, v), o, gate_up (merged, or gate, up),
// down; and kLayout numbers: (block type, kernel) of its seven product slots, then its key set and
// rotary table. GeGLU's activation is torch's own gelu (called from here), so that it rounds as the
// layer path's does.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/mul.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <vector>

#include "checks.h"
#include "kernels.h"

namespace {

using at::Tensor;
using namespace pipeline_checks;

constexpr int64_t kWeights = 13;
constexpr int64_t kProducts = 7;                   // qkv, k, v, o, gate_up, up, down: a (type, kernel) pair each
constexpr int64_t kKeySetAt = 2 * kProducts;       // then the layer's key set
constexpr int64_t kRopeAt = kKeySetAt + 1;         // and its rotary table
constexpr int64_t kLayout = kRopeAt + 1;
enum Slot { kInputNorm, kAttentionOutNorm, kMlpNorm, kMlpOutNorm, kQNorm, kKNorm, kQkv, kK, kV, kO, kGateUp, kUp,
            kDown };
const char* kNames[kWeights] = {"input norm", "attention-out norm", "MLP norm", "MLP-out norm", "q norm", "k norm",
                                "qkv", "k", "v", "o", "gate_up", "up", "down"};

// GeGLU's gelu(gate) * up, by torch's operators on the same strides as the layer path's.
void gelu_and_mul(const float* gate, const float* up, int64_t stride, float* out, int64_t rows, int64_t width) {
  const auto options = at::TensorOptions().dtype(at::kFloat);
  const Tensor g = at::from_blob(const_cast<float*>(gate), {rows, width}, {stride, 1}, options);
  const Tensor u = at::from_blob(const_cast<float*>(up), {rows, width}, {stride, 1}, options);
  Tensor o = at::from_blob(out, {rows, width}, options);
  at::mul_out(o, at::gelu(g, "tanh"), u);
}

class Layer {
 public:
  Layer(const c10::List<std::optional<Tensor>>& weights, const int64_t* layout, int64_t index, int64_t hidden,
        int64_t head_dim)
      : weights_(weights), layout_(layout), base_(index * kWeights), index_(index), hidden_(hidden),
        head_dim_(head_dim) {}

  bool has(Slot slot) const {
    const std::optional<Tensor> held = weights_.get(base_ + slot);
    return held.has_value() && held->defined();
  }

  Tensor get(Slot slot) const {
    TORCH_CHECK_VALUE(has(slot), "decoder_layers: layer ", index_, "'s ", kNames[slot], " is missing");
    return *weights_.get(base_ + slot);
  }

  const float* norm(Slot slot, bool optional) const {
    if (optional && !has(slot)) return nullptr;
    const int64_t size = slot == kQNorm || slot == kKNorm ? head_dim_ : hidden_;
    const Tensor weight = get(slot);
    check_dtype(weight, at::kFloat, "decoder_layers", kNames[slot]);
    TORCH_CHECK_VALUE(weight.is_contiguous() && weight.numel() == size, "decoder_layers: layer ", index_, "'s ",
                      kNames[slot], " must be contiguous float32 [", size, "], not of shape ", weight.sizes());
    // The tensor is held by the list the caller passed, alive for the call.
    return weight.const_data_ptr<float>();
  }

  // Product slots in order: qkv, k, v, o, gate_up, up, down (layout pairs 0 .. kProducts - 1).
  quant_weight product(Slot slot, int64_t rows, int64_t cols) const {
    const char* op = "decoder_layers";
    const int64_t pair = slot - kQkv;
    const int64_t qtype = layout_[2 * pair], kind = layout_[2 * pair + 1];
    const Tensor blocks = get(slot);
    check_blocks(blocks, qtype, cols, op);
    TORCH_CHECK_VALUE(blocks.size(0) == rows, op, ": layer ", index_, "'s ", kNames[slot], " must have ", rows,
                      " rows, not ", blocks.size(0));
    TORCH_CHECK_VALUE(kind >= 0 && kind <= 2, op, ": ", kNames[slot], "'s kernel must be 0 (fused), 1 (8-bit ",
                      "activations) or 2 (tiled), not ", kind);
    TORCH_CHECK_VALUE(kind != 1 || quant_x8_available(static_cast<int>(qtype)), op, ": ", kNames[slot],
                      "'s block type ", qtype, " has no 8-bit activation kernel on this CPU");
    return quant_weight{blocks.const_data_ptr<uint8_t>(), blocks.size(1), rows, cols, static_cast<int>(qtype),
                        static_cast<int>(kind)};
  }

  int64_t key_set() const { return layout_[kKeySetAt]; }
  int64_t rope() const { return layout_[kRopeAt]; }

 private:
  const c10::List<std::optional<Tensor>>& weights_;
  const int64_t* layout_;
  int64_t base_, index_, hidden_, head_dim_;
};

// The step's key sets, each checked: no slot written or read below 0; `highest` gets the largest
// slot each set writes or reads, for the layers' caches to hold (which may differ by KV group).
std::vector<key_set> key_sets_of(at::TensorList slot_mappings, at::TensorList key_slots, at::TensorList masks,
                                 at::IntArrayRef queries, int64_t tokens, std::vector<int64_t>& highest,
                                 std::vector<Tensor>& held) {
  const char* op = "decoder_layers";
  const size_t count = slot_mappings.size();
  TORCH_CHECK_VALUE(count > 0 && key_slots.size() == count && masks.size() == count && queries.size() == count, op,
                    ": each key set needs a slot mapping, key slots, a mask and a query count, not ", count, ", ",
                    key_slots.size(), ", ", masks.size(), " and ", queries.size());
  std::vector<key_set> sets;
  for (size_t i = 0; i < count; i++) {
    check_dtype(slot_mappings[i], at::kLong, op, "slot_mapping");
    check_dtype(key_slots[i], at::kLong, op, "key_slots");
    check_dtype(masks[i], at::kBool, op, "mask");
    const int64_t per_row = queries[i];
    TORCH_CHECK_VALUE(per_row > 0 && tokens % per_row == 0, op, ": ", tokens, " tokens are not rows of ", per_row,
                      " queries");
    const int64_t rows = tokens / per_row;
    TORCH_CHECK_VALUE(slot_mappings[i].numel() == tokens && key_slots[i].dim() == 2 && key_slots[i].size(0) == rows &&
                          masks[i].numel() == key_slots[i].numel() * per_row, op, ": slot_mapping ",
                      slot_mappings[i].sizes(), ", key_slots ", key_slots[i].sizes(), " and mask ", masks[i].sizes(),
                      " must be [", tokens, "], [", rows, ", num_keys] and [", rows, ", ", per_row, ", num_keys]");
    const Tensor written = slot_mappings[i].contiguous(), slots = key_slots[i].contiguous();
    const Tensor seen = masks[i].contiguous();
    held.insert(held.end(), {written, slots, seen});
    const int64_t num_keys = slots.size(1);
    const int64_t* write_at = written.const_data_ptr<int64_t>();
    const int64_t* read_at = slots.const_data_ptr<int64_t>();
    const bool* sees = seen.const_data_ptr<bool>();
    int64_t top = 0;
    for (int64_t t = 0; t < tokens; t++) {
      TORCH_CHECK_INDEX(write_at[t] >= 0, op, ": slot_mapping's slot ", write_at[t], " (token ", t, ") is negative");
      top = std::max(top, write_at[t]);
    }
    for (int64_t row = 0; row < rows; row++)  // every slot a token sees is read
      for (int64_t q = 0; q < per_row; q++)
        for (int64_t j = 0; j < num_keys; j++) {
          if (!sees[(row * per_row + q) * num_keys + j]) continue;
          const int64_t at = read_at[row * num_keys + j];
          TORCH_CHECK_INDEX(at >= 0, op, ": key slot ", at, " (row ", row, ", key ", j, ") is negative");
          top = std::max(top, at);
        }
    highest.push_back(top);
    sets.push_back(key_set{write_at, read_at, reinterpret_cast<const uint8_t*>(sees), num_keys, per_row});
  }
  return sets;
}

Tensor decoder_layers_op(const Tensor& x, const c10::List<std::optional<Tensor>>& weights, at::IntArrayRef layout,
                         at::TensorList caches, at::TensorList cos, at::TensorList sin, at::TensorList slot_mappings,
                         at::TensorList key_slots, at::TensorList masks, at::IntArrayRef queries, int64_t heads,
                         int64_t kv_heads, double scale, double eps, bool unit_offset, bool gelu) {
  const char* op = "decoder_layers";
  check_dtype(x, at::kFloat, op, "x");
  check_dim(x, 2, op, "x", "float32 [tokens, hidden]");
  const int64_t num_layers = static_cast<int64_t>(caches.size());
  TORCH_CHECK_VALUE(num_layers > 0 && static_cast<int64_t>(weights.size()) == num_layers * kWeights &&
                        static_cast<int64_t>(layout.size()) == num_layers * kLayout,
                    op, ": ", num_layers, " caches need ", kWeights, " weights and ", kLayout, " numbers a layer, not ",
                    weights.size(), " and ", layout.size());
  const Tensor& first = caches[0];
  TORCH_CHECK_VALUE(first.dim() >= 4 && first.size(0) == 2, op,
                    ": a cache must be [2, ..., kv_heads, head_dim], not of shape ", first.sizes());
  const int64_t tokens = x.size(0), hidden = x.size(1), head_dim = first.size(-1);
  TORCH_CHECK_VALUE(tokens > 0 && kv_heads > 0 && heads % kv_heads == 0 && head_dim % 16 == 0 &&
                        first.size(-2) == kv_heads, op, ": ", heads, " query heads over ", kv_heads,
                    " KV heads of size ", head_dim, " and ", tokens, " tokens (caches ", first.sizes(),
                    "; heads a multiple of KV heads, head size a multiple of 16)");
  const int64_t q_size = heads * head_dim, kv_size = kv_heads * head_dim;
  const int kv_bf16 = element_kind(first, op, "a cache");
  std::vector<const float*> cos_tables, sin_tables;
  TORCH_CHECK_VALUE(!cos.empty() && cos.size() == sin.size(), op, ": as many cos as sin tables, not ", cos.size(),
                    " and ", sin.size());
  for (size_t i = 0; i < cos.size(); i++)
    for (const Tensor* table : {&cos[i], &sin[i]}) {
      check_dtype(*table, at::kFloat, op, "cos and sin");
      TORCH_CHECK_VALUE(table->is_contiguous() && table->numel() == tokens * head_dim && table->size(0) == tokens,
                        op, ": cos and sin must be contiguous [", tokens, ", 1, ", head_dim, "], not of shape ",
                        table->sizes());
      (table == &cos[i] ? cos_tables : sin_tables).push_back(table->const_data_ptr<float>());
    }
  std::vector<Tensor> held;
  std::vector<int64_t> highest;
  const std::vector<key_set> sets = key_sets_of(slot_mappings, key_slots, masks, queries, tokens, highest, held);

  const Layer layer0(weights, layout.data(), 0, hidden, head_dim);
  const int64_t inter = layer0.get(kGateUp).size(0) / (layer0.has(kUp) ? 1 : 2);
  std::vector<decoder_layer> layers(num_layers);
  for (int64_t i = 0; i < num_layers; i++) {
    const Layer w(weights, layout.data() + i * kLayout, i, hidden, head_dim);
    const Tensor& cache = caches[i];
    TORCH_CHECK_VALUE(cache.dim() == first.dim() && cache.size(0) == 2 && cache.size(-1) == head_dim &&
                          cache.size(-2) == kv_heads && cache.scalar_type() == first.scalar_type() &&
                          cache.is_contiguous() && cache.device().is_cpu(),
                      op, ": layer ", i, "'s cache must be contiguous [2, ..., ", kv_heads, ", ", head_dim, "] ",
                      dtype_name(first.scalar_type()), " like layer 0's, not ", cache.sizes(), " ",
                      dtype_name(cache.scalar_type()));
    const int64_t set = w.key_set(), rope = w.rope();
    TORCH_CHECK_INDEX(set >= 0 && set < static_cast<int64_t>(sets.size()) && rope >= 0 &&
                          rope < static_cast<int64_t>(cos_tables.size()), op, ": layer ", i, "'s key set ", set,
                      " and rotary table ", rope, " must be below ", sets.size(), " and ", cos_tables.size());
    const int64_t num_slots = cache.numel() / (2 * kv_size);
    TORCH_CHECK_INDEX(highest[set] < num_slots, op, ": slot ", highest[set], " (key set ", set, ") is outside layer ",
                      i, "'s cache of ", num_slots, " slots");
    TORCH_CHECK_VALUE(w.has(kQNorm) == w.has(kKNorm) && w.has(kK) == w.has(kV) && w.has(kUp) == layer0.has(kUp),
                      op, ": layer ", i, " must hold both per-head norms or neither, k and v parts both or neither, ",
                      "and gate_up as layer 0 does");
    decoder_layer& layer = layers[i];
    char* keys = static_cast<char*>(cache.data_ptr());
    layer.input_norm = w.norm(kInputNorm, false);
    layer.mlp_norm = w.norm(kMlpNorm, false);
    layer.attention_out_norm = w.norm(kAttentionOutNorm, true);
    layer.mlp_out_norm = w.norm(kMlpOutNorm, true);
    layer.q_norm = w.norm(kQNorm, true);
    layer.k_norm = w.norm(kKNorm, true);
    layer.qkv_parts = w.has(kK) ? 3 : 1;
    if (layer.qkv_parts == 1) {
      layer.qkv[0] = w.product(kQkv, q_size + 2 * kv_size, hidden);
    } else {
      layer.qkv[0] = w.product(kQkv, q_size, hidden);
      layer.qkv[1] = w.product(kK, kv_size, hidden);
      layer.qkv[2] = w.product(kV, kv_size, hidden);
    }
    layer.o = w.product(kO, hidden, q_size);
    layer.gate_up_parts = w.has(kUp) ? 2 : 1;
    layer.gate_up[0] = w.product(kGateUp, layer.gate_up_parts == 1 ? 2 * inter : inter, hidden);
    if (layer.gate_up_parts == 2) layer.gate_up[1] = w.product(kUp, inter, hidden);
    layer.down = w.product(kDown, hidden, inter);
    layer.key_set = static_cast<int>(set);
    layer.rope = static_cast<int>(rope);
    layer.keys = keys;
    layer.values = keys + cache.stride(0) * cache.element_size();
  }
  const Tensor input = x.contiguous();
  Tensor out = at::empty({tokens, hidden}, input.options());
  const decode_shape shape{tokens, hidden, heads, kv_heads, head_dim, inter, static_cast<float>(eps),
                           static_cast<float>(scale), unit_offset ? 1 : 0, kv_bf16, cos_tables.data(),
                           sin_tables.data(), sets.data(), gelu ? gelu_and_mul : nullptr};
  const int status = decoder_layers(layers.data(), num_layers, &shape, input.const_data_ptr<float>(),
                                    out.mutable_data_ptr<float>());
  TORCH_CHECK_VALUE(status == 0, op, ": an 8-bit activation kernel is not built for this CPU");
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pipeline, m) {
  m.def("decoder_layers(Tensor x, Tensor?[] weights, int[] layout, Tensor(a!)[] caches, Tensor[] cos, Tensor[] sin, "
        "Tensor[] slot_mappings, Tensor[] key_slots, Tensor[] masks, int[] queries, int heads, int kv_heads, "
        "float scale, float eps, bool unit_offset, bool gelu) -> Tensor");
}

TORCH_LIBRARY_IMPL(pipeline, CPU, m) { m.impl("decoder_layers", TORCH_FN(decoder_layers_op)); }
