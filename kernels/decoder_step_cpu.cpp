// One decoding step of a Llama model with int4 (Q4_1) weights, in one call: its decoder layers, and with
// the step's ends set, the embedding row before them and the final norm and a Q8_0 head after them.
//
// TorchScript's step (semanticache_rag/scripted_step.py) makes ~15 small tensor operations a layer
// around the products: slices, RoPE's gather and multiply-add, the cache writes, SiLU, the residual
// adds. On a 2-core CPU each costs ~5-15 us in the interpreter and the dispatcher, a few milliseconds
// a step, as much as the products read in their time. Here the same arithmetic runs as C++ loops between
// direct calls of the other kernels (cpu_ops.h): the RMS norms, the Q4_1 products, the attention.
//
// Two classes, torch.classes.semanticache.*, made once and kept:
// - Int4Layers: the model's weights (per layer the two norms' weights and the Q4_1 codes, scales and
//   minimums of the fused query/key/value, output, fused gate/up and down products), its shape and
//   whether its products keep fp32 rows (weights="int4-exact"); step() runs every layer for one token.
//   With its ends set (set_ends: the embedding table, the final norm, a Q8_0 head), token_step() runs
//   the whole step from a token id to its logits, so that no Python operation is left between them.
// - StepDocument: one conversation's document layers as the attention kernel takes them (rows or
//   codes, scales, minimums, bits; the log s bias), made once per conversation.
//
// The arithmetic is the scripted step's kernel path, operation for operation: RoPE as torch.addcmul
// computes x * cos + x[swap] * sin (sin carrying rotate_half's sign; the second product fused into the
// add), the query then times the scaling, SiLU by ATen's own, products and norms by the same kernels.
// Where torch's addcmul does not fuse (a CPU without FMA), a rounding may differ; the Q8_0 rounding of
// the next product's row can carry one such difference far, so tests compare the two steps' answers.
//
// Built with the other CPU kernels into one library by kernels/cpu_ops.py.

#include <ATen/core/Tensor.h>
#include <ATen/ops/add.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mean.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/pow.h>
#include <ATen/ops/rsqrt.h>
#include <ATen/ops/silu.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include "cpu_ops.h"

#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

namespace {

constexpr int64_t WEIGHTS_PER_LAYER = 14;  // norm, qkv (codes, scales, minimums), o (3), norm, gate/up (3), down (3)
constexpr int64_t DOCUMENT_PER_LAYER = 7;  // keys, key scales, key minimums, values, ... (3), bias

std::optional<at::Tensor> present(const at::Tensor& t) {
  return t.defined() && t.numel() > 0 ? std::optional<at::Tensor>(t) : std::nullopt;
}

struct StepDocument : torch::CustomClassHolder {
  // per layer: keys, key scales, key minimums, values, value scales, value minimums, bias (empty: none)
  std::vector<at::Tensor> tensors;
  std::vector<int64_t> bits;  // per layer: key bits, value bits (as decode_attention takes them)

  StepDocument(std::vector<at::Tensor> tensors_, std::vector<int64_t> bits_)
      : tensors(std::move(tensors_)), bits(std::move(bits_)) {
    TORCH_CHECK(tensors.size() % DOCUMENT_PER_LAYER == 0 && bits.size() * DOCUMENT_PER_LAYER == 2 * tensors.size(),
                "a document takes ", DOCUMENT_PER_LAYER, " tensors and 2 bit widths a layer, got ", tensors.size(),
                " tensors and ", bits.size(), " widths");
  }

  int64_t layers() const { return static_cast<int64_t>(bits.size()) / 2; }
};

struct Int4Layers : torch::CustomClassHolder {
  std::vector<at::Tensor> weights;  // WEIGHTS_PER_LAYER a layer
  std::vector<double> eps;          // per layer: the two norms' epsilons
  int64_t heads, kv_heads, dim;
  double scaling;
  bool fp32_rows;  // products in fp32 arithmetic (q4_1_product_fp32), not with rows quantised to Q8_0

  Int4Layers(std::vector<at::Tensor> weights_, std::vector<double> eps_, int64_t heads_, int64_t kv_heads_,
             int64_t dim_, double scaling_, bool fp32_rows_)
      : weights(std::move(weights_)), eps(std::move(eps_)), heads(heads_), kv_heads(kv_heads_), dim(dim_),
        scaling(scaling_), fp32_rows(fp32_rows_) {
    TORCH_CHECK(weights.size() % WEIGHTS_PER_LAYER == 0 && eps.size() * WEIGHTS_PER_LAYER == 2 * weights.size(),
                "Int4Layers takes ", WEIGHTS_PER_LAYER, " weights and 2 epsilons a layer, got ", weights.size(),
                " weights and ", eps.size(), " epsilons");
    TORCH_CHECK(heads > 0 && kv_heads > 0 && heads % kv_heads == 0 && dim > 0 && dim % 2 == 0,
                "heads (", heads, ") must be a multiple of kv heads (", kv_heads, "), dim (", dim, ") even");
  }

  int64_t layers() const { return static_cast<int64_t>(eps.size()) / 2; }

  // The step's two ends (set_ends): the embedding table (V, hidden) fp32, the final norm's weight and
  // epsilon, and the output head's Q8_0 codes and scales (undefined: the head is not one, the caller
  // multiplies by it). Shared with the model's modules, like the layers' weights.
  at::Tensor embedding, final_norm, head_codes, head_scales;
  double final_eps = 0.0;

  void set_ends(const at::Tensor& embedding_, const at::Tensor& final_norm_, double final_eps_,
                const at::Tensor& head_codes_, const at::Tensor& head_scales_) {
    TORCH_CHECK(embedding_.scalar_type() == at::kFloat && embedding_.dim() == 2 && embedding_.is_contiguous() &&
                    final_norm_.scalar_type() == at::kFloat && final_norm_.dim() == 1 &&
                    final_norm_.numel() == embedding_.size(1),
                "the embedding must be contiguous float32 (V, hidden) and the final norm's weight float32 (hidden,), got ",
                embedding_.scalar_type(), embedding_.is_contiguous() ? " " : " non-contiguous ", embedding_.sizes(),
                " and ", final_norm_.scalar_type(), " ", final_norm_.sizes());
    TORCH_CHECK(head_codes_.numel() == 0 || head_scales_.scalar_type() == at::kBFloat16 ||
                    head_scales_.scalar_type() == at::kFloat,
                "the head's Q8_0 scales must be bf16 (q8_0_product) or float32 (q8_0_product_fp32), got ",
                head_scales_.scalar_type());
    embedding = embedding_;
    final_norm = final_norm_.contiguous();
    final_eps = final_eps_;
    head_codes = head_codes_.numel() ? head_codes_ : at::Tensor();
    head_scales = head_codes_.numel() ? head_scales_ : at::Tensor();
  }

  bool has_head() const { return head_codes.defined(); }

  // One whole step for token `token`: its embedding row, every layer (step()), the final norm, and with
  // `head` the logits (1, V) by the Q8_0 head (set_ends), otherwise the final hidden state (1, hidden).
  at::Tensor token_step(int64_t token, const at::Tensor& cos, const at::Tensor& sin,
                        const c10::intrusive_ptr<StepDocument>& document, const std::vector<at::Tensor>& appended_keys,
                        const std::vector<at::Tensor>& appended_values, int64_t length, bool head) const {
    TORCH_CHECK(embedding.defined(), "token_step needs the embedding and the final norm (set_ends)");
    TORCH_CHECK(token >= 0 && token < embedding.size(0), "token ", token, " is outside the vocabulary of ",
                embedding.size(0));
    TORCH_CHECK(!head || has_head(), "token_step(head=True) needs a Q8_0 head (set_ends)");
    const at::Tensor x = step(embedding.narrow(0, token, 1), cos, sin, document, appended_keys, appended_values, length);
    // the final norm by the ATen operations of LlamaRMSNorm (semanticache_rag/fused.py, FusedLlama._norm), in
    // its order: the other steps' logits exactly (the layers' norms are the rms_norm kernel in every step)
    const at::Tensor normed =
        at::mul(final_norm, at::mul(x, at::rsqrt(at::add(at::mean(at::pow(x, 2), {-1}, true), final_eps))));
    if (!head) return normed;
    return head_scales.scalar_type() == at::kFloat ? semanticache::q8_0_product_fp32(normed, head_codes, head_scales)
                                                   : semanticache::q8_0_product(normed, head_codes, head_scales);
  }

  // x (1, hidden) float32 after every layer for one new token at RoPE's cos and signed sin (D,); its key
  // and value are written at `length` of each layer's appended buffers (1, H_kv, capacity, D).
  at::Tensor step(const at::Tensor& x_in, const at::Tensor& cos, const at::Tensor& sin,
                  const c10::intrusive_ptr<StepDocument>& document, const std::vector<at::Tensor>& appended_keys,
                  const std::vector<at::Tensor>& appended_values, int64_t length) const {
    const int64_t count = layers(), group = heads / kv_heads, q_size = heads * dim, kv_size = kv_heads * dim;
    TORCH_CHECK(x_in.scalar_type() == at::kFloat && x_in.dim() == 2 && x_in.size(0) == 1,
                "x must be one float32 row (1, hidden), got ", x_in.sizes());
    TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.numel() == dim &&
                    sin.numel() == dim && cos.is_contiguous() && sin.is_contiguous(),
                "cos and sin must be ", dim, " contiguous float32 values");
    TORCH_CHECK(document->layers() == count && static_cast<int64_t>(appended_keys.size()) == count &&
                    static_cast<int64_t>(appended_values.size()) == count,
                "the document and the appended buffers must have ", count, " layers each");
    at::Tensor x = x_in.contiguous().clone();
    float* residual = x.data_ptr<float>();
    const int64_t hidden = x.size(1);
    const float* c = cos.data_ptr<float>();
    const float* s = sin.data_ptr<float>();
    const int64_t half = dim / 2;
    const float scale = static_cast<float>(scaling);
    for (int64_t l = 0; l < count; ++l) {
      const at::Tensor* w = weights.data() + l * WEIGHTS_PER_LAYER;
      const at::Tensor& keys_buffer = appended_keys[l];
      const at::Tensor& values_buffer = appended_values[l];
      TORCH_CHECK(keys_buffer.scalar_type() == at::kFloat && values_buffer.scalar_type() == at::kFloat &&
                      keys_buffer.dim() == 4 && keys_buffer.sizes() == values_buffer.sizes() &&
                      keys_buffer.size(1) == kv_heads && keys_buffer.size(2) > length && keys_buffer.size(3) == dim &&
                      keys_buffer.stride(3) == 1 && values_buffer.stride(3) == 1,
                  "layer ", l, ": appended buffers must be float32 (1, ", kv_heads, ", > ", length, ", ", dim, ")");
      // -- attention: norm, query/key/value, RoPE, the new key and value into the buffers, the kernel
      const at::Tensor qkv = product(semanticache::rms_norm(x, w[0], eps[2 * l]), w[1], w[2], w[3]);
      TORCH_CHECK(qkv.size(1) == q_size + 2 * kv_size, "layer ", l, ": the query/key/value product gives ",
                  qkv.size(1), " outputs, the heads take ", q_size + 2 * kv_size);
      const float* p = qkv.data_ptr<float>();
      at::Tensor query = at::empty({kv_heads, group, dim}, x.options());
      float* q = query.data_ptr<float>();
      float* key_rows = keys_buffer.data_ptr<float>();
      float* value_rows = values_buffer.data_ptr<float>();
      for (int64_t h = 0; h < heads + kv_heads; ++h) {
        const float* v = p + h * dim;
        float* target = h < heads ? q + h * dim
                                  : key_rows + (h - heads) * keys_buffer.stride(1) + length * keys_buffer.stride(2);
        for (int64_t d = 0; d < dim; ++d) {
          // torch.addcmul's arithmetic: x * cos rounded, then x[swap] * sin added in one fused multiply-add
          const float rotated = std::fma(v[d < half ? d + half : d - half], s[d], v[d] * c[d]);
          target[d] = h < heads ? rotated * scale : rotated;
        }
      }
      for (int64_t h = 0; h < kv_heads; ++h) {
        const float* v = p + q_size + kv_size + h * dim;
        float* target = value_rows + h * values_buffer.stride(1) + length * values_buffer.stride(2);
        for (int64_t d = 0; d < dim; ++d) target[d] = v[d];
      }
      const at::Tensor* doc = document->tensors.data() + l * DOCUMENT_PER_LAYER;
      const at::Tensor out = semanticache::decode_attention(
          query, doc[0], present(doc[1]), present(doc[2]), document->bits[2 * l], doc[3], present(doc[4]),
          present(doc[5]), document->bits[2 * l + 1], present(doc[6]), keys_buffer.select(0, 0).narrow(1, 0, length + 1),
          values_buffer.select(0, 0).narrow(1, 0, length + 1));
      const at::Tensor projected = product(out.view({1, q_size}), w[4], w[5], w[6]);
      add_into(residual, projected, hidden);
      // -- MLP: norm, gate/up, SiLU(gate) * up, down
      const at::Tensor gate_up = product(semanticache::rms_norm(x, w[7], eps[2 * l + 1]), w[8], w[9], w[10]);
      const int64_t inner = gate_up.size(1) / 2;
      at::Tensor activated = at::silu(gate_up.narrow(1, 0, inner));  // contiguous (1, inner)
      float* a = activated.data_ptr<float>();
      const float* up = gate_up.data_ptr<float>() + inner;
      for (int64_t i = 0; i < inner; ++i) a[i] *= up[i];
      add_into(residual, product(activated, w[11], w[12], w[13]), hidden);
    }
    return x;
  }

  at::Tensor product(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                     const at::Tensor& minimums) const {
    return fp32_rows ? semanticache::q4_1_product_fp32(x, codes, scales, minimums)
                     : semanticache::q4_1_product(x, codes, scales, minimums);
  }

  static void add_into(float* residual, const at::Tensor& update, int64_t hidden) {
    TORCH_CHECK(update.numel() == hidden, "a layer's output has ", update.numel(), " values, the model ", hidden);
    const float* u = update.data_ptr<float>();
    for (int64_t i = 0; i < hidden; ++i) residual[i] += u[i];
  }
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(semanticache, m) {
  m.class_<StepDocument>("StepDocument").def(torch::init<std::vector<at::Tensor>, std::vector<int64_t>>());
  m.class_<Int4Layers>("Int4Layers")
      .def(torch::init<std::vector<at::Tensor>, std::vector<double>, int64_t, int64_t, int64_t, double, bool>())
      .def("step", &Int4Layers::step)
      .def("set_ends", &Int4Layers::set_ends)
      .def("has_head", &Int4Layers::has_head)
      .def("token_step", &Int4Layers::token_step);
}
