// A pure decode step through a stack of Llama-style decoder layers in one call.
//
// Each layer is the model's own sequence of C++ passes (engine_svc/models/llama.py with the
// kernels on): RMSNorm with the residual add, the fused q/k/v projection, rotary in place on
// q and k, the new K/V written into their cache slots, paged decode attention, the output
// projection, the second norm, gate/up, silu(gate) * up, down. The same operators run on the
// same tensors in the same order (the K/V rows are copied into the cache directly, the same
// bytes index_copy_ writes), so the result is the Python loop's bit for bit; what goes is
// the interpreter between them. In a one-request bfloat16 decode step on the 2-core Xeon
// the Python around the ~14 operators of each layer kept one core busy and the other
// spinning in OpenMP for about a third of the step.
//
// The layers arrive flattened, kTensorsPerLayer tensors, kIntsPerLayer ints and
// kFloatsPerLayer floats each (engine_svc/models/decode_layers.py writes them):
//   tensors: input norm weight, post-attention norm weight, K cache, V cache, then for each
//            projection (qkv, o, gate_up, down): the [out, in] weight of the one-row GEMV
//            (or none), the weight of its main path, the bias (or none);
//   ints:    num_heads, num_kv_heads, head_dim, window (0: none), then for each projection
//            its main path (Path below) and out_features;
//   floats:  the two norms' eps, the attention scale.

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/matmul.h>
#include <torch/library.h>

#include <cstring>
#include <optional>
#include <tuple>

namespace duoserve {
namespace {

constexpr int64_t kProjections = 4;
constexpr int64_t kTensorsPerLayer = 4 + 3 * kProjections;
constexpr int64_t kIntsPerLayer = 4 + 2 * kProjections;
constexpr int64_t kFloatsPerLayer = 3;

// A projection's main path, as Projection.forward takes them and Projection.kernel_args
// numbers them (engine_svc/layers/linear.py).
enum Path : int64_t {
  kOneDnn = 1,   // weight in oneDNN's blocked layout (mkldnn::_linear_pointwise)
  kPacked = 2,   // packed column blocks (duoserve::packed_linear)
  kMatmul = 3,   // [in, out]: x @ w, or addmm with a bias
  kLinear = 4,   // [out, in]: F.linear
  kPairs = 5,    // pairs of k for AVX512-BF16 and AMX (duoserve::bf16_pairs_linear)
  kPairsSiluMul = 6,  // an MLP's gate/up pairs that store silu(gate) * up
};

// The operators, looked up once: the dispatcher's typed handles.
template <typename Signature>
c10::TypedOperatorHandle<Signature> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

struct Ops {
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, double)> rms_norm =
      op<at::Tensor(const at::Tensor&, const at::Tensor&, double)>("duoserve::rms_norm");
  c10::TypedOperatorHandle<std::tuple<at::Tensor, at::Tensor>(
      const at::Tensor&, const at::Tensor&, const at::Tensor&, double)>
      add_rms_norm = op<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                           const at::Tensor&, double)>(
          "duoserve::add_rms_norm");
  c10::TypedOperatorHandle<void(at::Tensor&, const at::Tensor&, const at::Tensor&)> rotary =
      op<void(at::Tensor&, const at::Tensor&, const at::Tensor&)>("duoserve::rotary_inplace");
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&)> silu_and_mul =
      op<at::Tensor(const at::Tensor&)>("duoserve::silu_and_mul");
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                      const at::Tensor&, const at::Tensor&, int64_t, double,
                                      int64_t)>
      attention = op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const at::Tensor&, const at::Tensor&, int64_t, double,
                                int64_t)>("duoserve::paged_decode_attention");
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&,
                                      const std::optional<at::Tensor>&)>
      row_gemv = op<at::Tensor(const at::Tensor&, const at::Tensor&,
                               const std::optional<at::Tensor>&)>("duoserve::row_gemv");
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t,
                                      const std::optional<at::Tensor>&)>
      packed_linear = op<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t,
                                    const std::optional<at::Tensor>&)>("duoserve::packed_linear");
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t,
                                      const std::optional<at::Tensor>&)>
      bf16_pairs_linear =
          op<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t,
                        const std::optional<at::Tensor>&)>("duoserve::bf16_pairs_linear");
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t,
                                      const std::optional<at::Tensor>&)>
      bf16_pairs_silu_mul =
          op<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t,
                        const std::optional<at::Tensor>&)>("duoserve::bf16_pairs_silu_mul");
};

const Ops& ops() {
  static const Ops instance;
  return instance;
}

// mkldnn::_linear_pointwise(x, w, bias, "none", [], None), boxed: its list-of-optional-
// scalars argument has no typed signature ATen promises to keep.
at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& weight,
                         const std::optional<at::Tensor>& bias) {
  static const c10::OperatorHandle handle =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack;
  stack.reserve(6);
  stack.emplace_back(x);
  stack.emplace_back(weight);
  stack.emplace_back(bias);
  stack.emplace_back(std::string("none"));
  stack.emplace_back(c10::List<std::optional<at::Scalar>>());
  stack.emplace_back(std::optional<std::string>(""));
  handle.callBoxed(&stack);
  return stack.back().toTensor();
}

at::Tensor required(const c10::List<std::optional<at::Tensor>>& tensors, int64_t index) {
  std::optional<at::Tensor> tensor = tensors.get(index);
  TORCH_CHECK(tensor.has_value(), "decode_layers: tensor ", index, " is missing");
  return *tensor;
}

// Projection.forward: a single row through the GEMV where the projection keeps its rows,
// else the main path. (kPairsSiluMul is not a projection's output: silu_of_gate_up.)
at::Tensor project(const at::Tensor& x, const c10::List<std::optional<at::Tensor>>& tensors,
                   int64_t first, int64_t path, int64_t out_features) {
  const std::optional<at::Tensor> row_weight = tensors.get(first);
  const at::Tensor weight = required(tensors, first + 1);
  const std::optional<at::Tensor> bias = tensors.get(first + 2);
  if (row_weight.has_value() && x.size(0) == 1) return ops().row_gemv.call(x, *row_weight, bias);
  switch (path) {
    case kOneDnn:
      return onednn_linear(x, weight, bias);
    case kPacked:
      return ops().packed_linear.call(x, weight, out_features, bias);
    case kPairs:
      return ops().bf16_pairs_linear.call(x, weight, out_features, bias);
    case kMatmul:
      return bias.has_value() ? at::addmm(*bias, x, weight) : at::matmul(x, weight);
    case kLinear:
      return at::linear(x, weight, bias);
    default:
      TORCH_CHECK(false, "decode_layers: unknown projection path ", path);
  }
}

// Projection.silu_and_mul: silu(gate) * up of the gate/up projection at `first`, computed
// as its pairs store their sums where it has them, else from its output.
at::Tensor silu_of_gate_up(const at::Tensor& x,
                           const c10::List<std::optional<at::Tensor>>& tensors, int64_t first,
                           int64_t path, int64_t out_features) {
  if (path == kPairsSiluMul) {
    return ops().bf16_pairs_silu_mul.call(x, required(tensors, first + 1), out_features,
                                          tensors.get(first + 2));
  }
  return ops().silu_and_mul.call(project(x, tensors, first, path, out_features));
}

// The new tokens' K (or V) rows, [tokens, kv_size] with rows strided, into their slots of a
// [blocks, block_size, kv_heads, head_dim] cache, as paged_attention's index_copy_ writes
// them: each row copied whole. In place of reshape (a copy of k, whose rows are not
// adjacent in the qkv output) and index_copy_ (TensorIterator's set-up at every call): the
// rows are kv_size elements each, one per token of the step.
void write_cache_rows(const at::Tensor& rows, const at::Tensor& cache, const at::Tensor& slots) {
  TORCH_CHECK(rows.dim() == 2 && rows.stride(1) == 1,
              "decode_layers: K/V rows must be [tokens, kv_size], each row contiguous");
  const int64_t tokens = rows.size(0), width = rows.size(1);
  TORCH_CHECK(cache.dim() == 4 && cache.is_contiguous() && cache.size(2) * cache.size(3) == width,
              "decode_layers: the cache must be contiguous with rows of ", width, " elements");
  TORCH_CHECK(cache.scalar_type() == rows.scalar_type(),
              "decode_layers: the cache and the K/V rows differ in dtype");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == tokens,
              "decode_layers: the slot mapping must be one int64 slot a token");
  const int64_t num_slots = cache.size(0) * cache.size(1);
  const int64_t bytes = width * rows.element_size();
  const int64_t row_stride = rows.stride(0) * rows.element_size();
  const char* src = static_cast<const char*>(rows.const_data_ptr());
  char* dst = static_cast<char*>(cache.mutable_data_ptr());
  const int64_t* slot = slots.const_data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(slot[t] >= 0 && slot[t] < num_slots, "decode_layers: slot ", slot[t],
                " is outside the cache's ", num_slots);
    std::memcpy(dst + slot[t] * bytes, src + t * row_stride, bytes);
  }
}

std::tuple<at::Tensor, at::Tensor> decode_layers(
    const at::Tensor& x_in, const std::optional<at::Tensor>& residual_in, const at::Tensor& cos,
    const at::Tensor& sin, const c10::List<std::optional<at::Tensor>>& tensors,
    at::IntArrayRef ints, at::ArrayRef<double> floats, const at::Tensor& slot_mapping,
    const at::Tensor& block_tables, const at::Tensor& context_lens, int64_t max_context_len) {
  const int64_t num_layers = static_cast<int64_t>(tensors.size()) / kTensorsPerLayer;
  TORCH_CHECK(num_layers > 0, "decode_layers: no layers");
  TORCH_CHECK(static_cast<int64_t>(tensors.size()) == num_layers * kTensorsPerLayer &&
                  static_cast<int64_t>(ints.size()) == num_layers * kIntsPerLayer &&
                  static_cast<int64_t>(floats.size()) == num_layers * kFloatsPerLayer,
              "decode_layers: ", tensors.size(), " tensors, ", ints.size(), " ints and ",
              floats.size(), " floats do not describe whole layers");
  TORCH_CHECK(x_in.dim() == 2, "decode_layers: x must be [tokens, hidden]");
  const Ops& o = ops();
  const int64_t tokens = x_in.size(0);
  at::Tensor x = x_in;
  at::Tensor residual;
  for (int64_t layer = 0; layer < num_layers; ++layer) {
    const int64_t t0 = layer * kTensorsPerLayer;
    const int64_t* in = ints.data() + layer * kIntsPerLayer;
    const double* fl = floats.data() + layer * kFloatsPerLayer;
    const int64_t num_heads = in[0], num_kv_heads = in[1], head_dim = in[2], window = in[3];
    const int64_t* paths = in + 4;  // (path, out_features) per projection

    at::Tensor hidden;
    if (layer == 0 && !residual_in.has_value()) {
      hidden = o.rms_norm.call(x, required(tensors, t0), fl[0]);
      residual = x;
    } else {
      std::tie(residual, hidden) = o.add_rms_norm.call(
          x, layer == 0 ? *residual_in : residual, required(tensors, t0), fl[0]);
    }

    // Attention.forward: q, k and v are column ranges of the one projection's output.
    const at::Tensor qkv = project(hidden, tensors, t0 + 4, paths[0], paths[1]);
    const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
    at::Tensor q = qkv.narrow(1, 0, q_size).view({tokens, num_heads, head_dim});
    at::Tensor k = qkv.narrow(1, q_size, kv_size).view({tokens, num_kv_heads, head_dim});
    const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size);
    o.rotary.call(q, cos, sin);
    o.rotary.call(k, cos, sin);
    const at::Tensor k_cache = required(tensors, t0 + 2);
    const at::Tensor v_cache = required(tensors, t0 + 3);
    write_cache_rows(k.view({tokens, kv_size}), k_cache, slot_mapping);  // rotated in place
    write_cache_rows(v, v_cache, slot_mapping);
    const at::Tensor attn = o.attention.call(q, k_cache, v_cache, block_tables, context_lens,
                                             max_context_len, fl[2], window);
    const at::Tensor attn_out =
        project(attn.flatten(1), tensors, t0 + 4 + 3, paths[2], paths[3]);

    // MLP.forward.
    std::tie(residual, hidden) =
        o.add_rms_norm.call(attn_out, residual, required(tensors, t0 + 1), fl[1]);
    const at::Tensor act = silu_of_gate_up(hidden, tensors, t0 + 4 + 6, paths[4], paths[5]);
    x = project(act, tensors, t0 + 4 + 9, paths[6], paths[7]);
  }
  return {x, residual};
}

}  // namespace

// No Meta kernel: torch.compile cannot trace the op, and nothing here compiles the model.
TORCH_LIBRARY_FRAGMENT(duoserve, m) {
  m.def(
      "decode_layers(Tensor x, Tensor? residual, Tensor cos, Tensor sin, Tensor?[] tensors, "
      "int[] ints, float[] floats, Tensor slot_mapping, Tensor block_tables, "
      "Tensor context_lens, int max_context_len) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(duoserve, CPU, m) { m.impl("decode_layers", &decode_layers); }

// The oneDNN path's weights are tensors of the MkldnnCPU key, which the dispatcher picks
// over CPU when the list holds them.
TORCH_LIBRARY_IMPL(duoserve, MkldnnCPU, m) { m.impl("decode_layers", &decode_layers); }

}  // namespace duoserve
