// One decoding step of a Llama model with int4 (Q4_1) or float32 weights, in one call: its decoder layers, and
// with the step's ends set, the embedding row before them and the final norm and a Q8_0 or float32 head after them.
//
// TorchScript's step (semanticache_rag/scripted_step.py) makes ~15 small tensor operations a layer
// around the products: slices, RoPE's gather and multiply-add, the cache writes, SiLU, the residual
// adds. On a 2-core CPU each costs ~5-15 us in the interpreter and the dispatcher, a few milliseconds
// a step, as much as the products read in their time. Here the same arithmetic runs as C++ loops between
// direct calls of the other kernels' parts (cpu_ops.h): the RMS norms, the Q4_1 products' blocks, the
// attention's tasks and merge. The layers run in one parallel region, torch's threads meeting at barriers
// between a layer's phases (starting a region for each product and attention, 150 a step, and allocating
// their outputs cost ~1 ms of a 7.5 ms step on a 2-core AVX2 CPU, with the per-step plan below).
//
// Two classes, torch.classes.semanticache.*, made once and kept:
// - Int4Layers: the model's weights (per layer the two norms' weights and, for each of the fused
//   query/key/value, output, fused gate/up and down products, the Q4_1 codes, scales and minimums, or a
//   float32 matrix (out, in) and two empty tensors: weights="fp32", kernels/fp32_weights_cpu.cpp), its shape
//   and whether its products keep fp32 rows (weights="int4-exact" and "fp32"); step() runs every layer for one
//   token. With its ends set (set_ends: the embedding table, the final norm, a Q8_0 or fp32 head), token_step() runs
//   the whole step from a token id to its logits, so that no Python operation is left between them.
//   With set_timing(true) it adds up where its steps' time goes (timings(): the attention, the rest of
//   the layers, the head), for benchmarks; a few clock readings a layer, only then.
// - StepDocument: one conversation's document layers as the attention kernel takes them (rows or
//   codes, scales, minimums, bits; the log s bias), made once per conversation, and from its first step
//   each layer's attention tasks (the document read and checked once: at a step its tensors' metadata
//   is cold, the weights having just streamed through the caches, ~9 us a layer).
//
// The arithmetic is the scripted step's kernel path, operation for operation: RoPE as torch.addcmul
// computes x * cos + x[swap] * sin (sin carrying rotate_half's sign; the second product fused into the
// add), the query then times the scaling, SiLU by ATen's own, products and norms by the same kernels.
// Where torch's addcmul does not fuse (a CPU without FMA), a rounding may differ; the Q8_0 rounding of
// the next product's row can carry one such difference far, so tests compare the two steps' answers.
//
// Built with the other CPU kernels into one library by kernels/cpu_ops.py.

#include <ATen/Version.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/add.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mean.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/pow.h>
#include <ATen/ops/rsqrt.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/silu.h>
#include <ATen/Parallel.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include "cpu_ops.h"
#include "cpu_vectors.h"

#include <omp.h>

#if defined(__AVX512F__)
#include <immintrin.h>
// SLEEF's exp of 16 floats (1-ulp accuracy), as ATen's AVX-512 kernels call it; exported by libtorch_cpu.
extern "C" __m512 Sleef_expf16_u10avx512f(__m512);
#endif

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

namespace {

constexpr int64_t WEIGHTS_PER_LAYER = 14;  // norm, qkv (codes, scales, minimums), o (3), norm, gate/up (3), down (3)

// One of a layer's products: Q4_1 codes, or float32 rows (rows != nullptr; the product's three tensors are the
// matrix and two empty ones)
struct Product {
  semanticache::Q4Weights q4{};
  semanticache::DenseWeights dense{};

  static Product of(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& minimums) {
    Product p;
    if (codes.scalar_type() == at::kFloat) {
      TORCH_CHECK(scales.numel() == 0 && minimums.numel() == 0, "a float32 product takes no scales or minimums");
      p.dense = semanticache::dense_weights(codes);
    } else {
      p.q4 = semanticache::q4_1_weights(codes, scales, minimums);
    }
    return p;
  }

  bool is_dense() const { return dense.rows != nullptr; }
  int64_t in_features() const { return is_dense() ? dense.in_features : q4.in_features; }
  int64_t out_features() const { return is_dense() ? dense.out_features : 16 * q4.blocks; }
};
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

  // Each layer's attention for query groups of `group` heads of `dim` channels on `threads` threads, made
  // at the conversation's first step and kept: the document's tensors are read and checked once, not at
  // every step (where their metadata is cold: the step's weights have just streamed through the caches).
  // q8: coded keys meet the query rounded to Q8_0 (where the products quantise their rows so too).
  std::vector<semanticache::AttentionTasks>& attention_tasks(int64_t group, int64_t dim, int64_t threads, bool q8) {
    if (attention.empty() || group != attention_shape[0] || dim != attention_shape[1] ||
        threads != attention_shape[2] || int64_t{q8} != attention_shape[3]) {
      std::vector<semanticache::AttentionTasks> made;
      made.reserve(layers());
      for (int64_t l = 0; l < layers(); ++l) {
        const at::Tensor* doc = tensors.data() + l * DOCUMENT_PER_LAYER;
        made.emplace_back(group, dim, doc[0], present(doc[1]), present(doc[2]), bits[2 * l], doc[3], present(doc[4]),
                          present(doc[5]), bits[2 * l + 1], present(doc[6]), threads, q8);
      }
      attention = std::move(made);
      attention_shape = {group, dim, threads, int64_t{q8}};
    }
    return attention;
  }

 private:
  std::vector<semanticache::AttentionTasks> attention;
  std::vector<int64_t> attention_shape = {0, 0, 0, 0};
};

struct Int4Layers : torch::CustomClassHolder {
  using Clock = std::chrono::steady_clock;
  enum Timing { STEPS, TOKEN_STEP, REGION, ATTENTION, HEAD, TIMINGS };  // timings()'s order
  std::vector<at::Tensor> weights;  // WEIGHTS_PER_LAYER a layer
  std::vector<double> eps;          // per layer: the two norms' epsilons
  int64_t heads, kv_heads, dim;
  double scaling;
  // products in fp32 arithmetic (q4_1_product_fp32), not with rows quantised to Q8_0 (and coded keys scored
  // against the query quantised so: decode_attention's q8_query)
  bool fp32_rows;

  Int4Layers(std::vector<at::Tensor> weights_, std::vector<double> eps_, int64_t heads_, int64_t kv_heads_,
             int64_t dim_, double scaling_, bool fp32_rows_)
      : weights(std::move(weights_)), eps(std::move(eps_)), heads(heads_), kv_heads(kv_heads_), dim(dim_),
        scaling(scaling_), fp32_rows(fp32_rows_) {
    TORCH_CHECK(weights.size() % WEIGHTS_PER_LAYER == 0 && eps.size() * WEIGHTS_PER_LAYER == 2 * weights.size(),
                "Int4Layers takes ", WEIGHTS_PER_LAYER, " weights and 2 epsilons a layer, got ", weights.size(),
                " weights and ", eps.size(), " epsilons");
    TORCH_CHECK(heads > 0 && kv_heads > 0 && heads % kv_heads == 0 && dim > 0 && dim % 2 == 0,
                "heads (", heads, ") must be a multiple of kv heads (", kv_heads, "), dim (", dim, ") even");
    TORCH_CHECK(!weights.empty(), "Int4Layers takes at least one layer");
    hidden = weights[0].numel();
    for (int64_t l = 0; l < layers(); ++l) views.push_back(layer_view(l));
  }

  // set_timing, timings(): written by the calling thread (thread 0 in the region) of one step at a time
  bool timing = false;
  mutable std::array<double, TIMINGS> times{};

  static double seconds_since(Clock::time_point started) {
    return std::chrono::duration<double>(Clock::now() - started).count();
  }

  // What a step reads of one layer's weights, viewed (and checked) once.
  struct LayerView {
    const float* norm;
    const float* norm_mlp;
    Product qkv, o, gate_up, down;
  };
  std::vector<LayerView> views;
  int64_t hidden;

  LayerView layer_view(int64_t l) const {
    const at::Tensor* w = weights.data() + l * WEIGHTS_PER_LAYER;
    for (const at::Tensor* norm : {&w[0], &w[7]}) {
      TORCH_CHECK(norm->scalar_type() == at::kFloat && norm->is_contiguous() && norm->numel() == hidden, "layer ", l,
                  ": the norms' weights must be ", hidden, " contiguous float32 values, got ", norm->sizes());
    }
    const LayerView view{w[0].data_ptr<float>(),
                         w[7].data_ptr<float>(),
                         Product::of(w[1], w[2], w[3]),
                         Product::of(w[4], w[5], w[6]),
                         Product::of(w[8], w[9], w[10]),
                         Product::of(w[11], w[12], w[13])};
    const int64_t q_size = heads * dim, kv_size = kv_heads * dim;
    const Product &qkv = view.qkv, &o = view.o, &gate_up = view.gate_up, &down = view.down;
    TORCH_CHECK(qkv.in_features() == hidden && qkv.out_features() == q_size + 2 * kv_size &&
                    o.in_features() == q_size && o.out_features() == hidden && gate_up.in_features() == hidden &&
                    down.out_features() == hidden && gate_up.out_features() == 2 * down.in_features(),
                "layer ", l, ": products of ", qkv.in_features(), "->", qkv.out_features(), ", ", o.in_features(),
                "->", o.out_features(), ", ", gate_up.in_features(), "->", gate_up.out_features(), ", ",
                down.in_features(), "->", down.out_features(), " do not fit ", hidden, " hidden values and ", heads,
                " + 2 x ", kv_heads, " heads of ", dim);
    return view;
  }

  int64_t layers() const { return static_cast<int64_t>(eps.size()) / 2; }

  // The step's two ends (set_ends): the embedding table (V, hidden) fp32, the final norm's weight and
  // epsilon, and the output head's Q8_0 codes and scales, or its float32 matrix (V, hidden) and no scales
  // (undefined: no head in the step, the caller multiplies by it). Shared with the model's modules, like the
  // layers' weights.
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
                    head_scales_.scalar_type() == at::kFloat || head_codes_.scalar_type() == at::kFloat,
                "the head's Q8_0 scales must be bf16 (q8_0_product) or float32 (q8_0_product_fp32), got ",
                head_scales_.scalar_type());
    if (head_codes_.numel() && head_codes_.scalar_type() == at::kFloat) {  // fp32_row_product's weights
      const semanticache::DenseWeights head = semanticache::dense_weights(head_codes_);
      TORCH_CHECK(head.in_features == embedding_.size(1) && head_scales_.numel() == 0,
                  "a float32 head must be (V, ", embedding_.size(1), ") with no scales, got ", head_codes_.sizes());
    }
    embedding = embedding_;
    final_norm = final_norm_.contiguous();
    final_eps = final_eps_;
    head_codes = head_codes_.numel() ? head_codes_ : at::Tensor();
    head_scales = head_codes_.numel() ? head_scales_ : at::Tensor();
  }

  bool has_head() const { return head_codes.defined(); }

  // Where steps' time goes while timing is on (set_timing(true) starts it from zero): steps, then seconds in
  // token_step, in step()'s parallel region, in its attention (thread 0's tasks and the wait for the other
  // threads' at the barrier after them) and in the head's product. The region less the attention is the
  // products and the small row operations between them; token_step less the region and the head, the
  // embedding row, the checks and binds before the region and the final norm.
  void set_timing(bool on) {
    if (on) times.fill(0.0);
    timing = on;
  }

  std::vector<double> timings() const { return {times.begin(), times.end()}; }

  // One whole step for token `token`: its embedding row, every layer (step()), the final norm, and with
  // `head` the logits (1, V) by the Q8_0 head (set_ends), otherwise the final hidden state (1, hidden).
  at::Tensor token_step(int64_t token, const at::Tensor& cos, const at::Tensor& sin,
                        const c10::intrusive_ptr<StepDocument>& document, const std::vector<at::Tensor>& appended_keys,
                        const std::vector<at::Tensor>& appended_values, int64_t length, bool head) const {
    const Clock::time_point started = timing ? Clock::now() : Clock::time_point{};
    const at::Tensor out = token_step_(token, cos, sin, document, appended_keys, appended_values, length, head);
    if (timing) {
      times[STEPS] += 1.0;
      times[TOKEN_STEP] += seconds_since(started);
    }
    return out;
  }

  // token_step with its head, and the token of the largest logit (cpu::first_largest: torch.argmax's choice), a
  // greedy step's next token, taken while the head's logits are still cached: in Python their argmax took ~0.13 ms
  // of a 6 ms step.
  int64_t greedy_step(int64_t token, const at::Tensor& cos, const at::Tensor& sin,
                      const c10::intrusive_ptr<StepDocument>& document, const std::vector<at::Tensor>& appended_keys,
                      const std::vector<at::Tensor>& appended_values, int64_t length) const {
    const at::Tensor logits = token_step(token, cos, sin, document, appended_keys, appended_values, length, true);
    return semanticache::cpu::first_largest(logits.const_data_ptr<float>(), logits.numel());
  }

  // greedy_step for up to n = cos.size(0) tokens in a row: step i runs the token step i - 1 chose (the first
  // `token`) at rows i of cos and sin (n, D) and at length + i, until a step chooses one of `stops` (a stop is
  // never run). The tokens chosen, one a step run. Between steps made one at a time from Python, ~0.45 ms of a
  // ~6 ms step (2K tokens, Kaizen 0.75) went in the call, its binds and the buffers' counting.
  std::vector<int64_t> greedy_steps(int64_t token, const at::Tensor& cos, const at::Tensor& sin,
                                    const c10::intrusive_ptr<StepDocument>& document,
                                    const std::vector<at::Tensor>& appended_keys,
                                    const std::vector<at::Tensor>& appended_values, int64_t length,
                                    const std::vector<int64_t>& stops) const {
    TORCH_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes(), "cos and sin must be (n, ", dim, ") rows, got ",
                cos.sizes(), " and ", sin.sizes());
    std::vector<int64_t> chosen;
    chosen.reserve(cos.size(0));
    for (int64_t i = 0; i < cos.size(0); ++i) {
      token = greedy_step(token, cos[i], sin[i], document, appended_keys, appended_values, length + i);
      chosen.push_back(token);
      if (std::find(stops.begin(), stops.end(), token) != stops.end()) break;
    }
    return chosen;
  }

  at::Tensor token_step_(int64_t token, const at::Tensor& cos, const at::Tensor& sin,
                         const c10::intrusive_ptr<StepDocument>& document,
                         const std::vector<at::Tensor>& appended_keys, const std::vector<at::Tensor>& appended_values,
                         int64_t length, bool head) const {
    TORCH_CHECK(embedding.defined(), "token_step needs the embedding and the final norm (set_ends)");
    TORCH_CHECK(token >= 0 && token < embedding.size(0), "token ", token, " is outside the vocabulary of ",
                embedding.size(0));
    TORCH_CHECK(!head || has_head(), "token_step(head=True) needs a Q8_0 or float32 head (set_ends)");
    const at::Tensor x = step(embedding.narrow(0, token, 1), cos, sin, document, appended_keys, appended_values, length);
    // the final norm by the ATen operations of LlamaRMSNorm (semanticache_rag/fused.py, FusedLlama._norm), in
    // its order: the other steps' logits exactly (the layers' norms are the rms_norm kernel in every step)
    const at::Tensor normed =
        at::mul(final_norm, at::mul(x, at::rsqrt(at::add(at::mean(at::pow(x, 2), {-1}, true), final_eps))));
    if (!head) return normed;
    const Clock::time_point started = timing ? Clock::now() : Clock::time_point{};
    at::Tensor logits = head_codes.scalar_type() == at::kFloat
                            ? semanticache::fp32_row_product(normed, head_codes).view({1, -1})
                        : head_scales.scalar_type() == at::kFloat
                            ? semanticache::q8_0_product_fp32(normed, head_codes, head_scales)
                            : semanticache::q8_0_product(normed, head_codes, head_scales);
    if (timing) times[HEAD] += seconds_since(started);
    return logits;
  }

  // x (1, hidden) float32 after every layer for one new token at RoPE's cos and signed sin (D,); its key
  // and value are written at `length` of each layer's appended buffers (1, H_kv, capacity, D).
  //
  // The whole step is one parallel region: torch's threads meet at barriers between the phases of a layer
  // instead of starting a region (and allocating an output) for each of its four products and its
  // attention. Each thread keeps its own copy of the residual stream and makes the small row operations
  // (norms, the rows' Q8_0 codes or group sums, RoPE of the query, the attention's merge, SiLU(gate) * up)
  // itself, the same arithmetic on the same inputs in every thread; the products' output blocks and the
  // attention's tasks are shared out. (SiLU in thread 0 alone, between two barriers, kept the other thread
  // waiting ~7 us a layer, ~0.2 ms of a Kaizen 0.75 step at 7K tokens.) Everything it reads is checked
  // before the region starts: nothing may throw inside it.
  at::Tensor step(const at::Tensor& x_in, const at::Tensor& cos, const at::Tensor& sin,
                  const c10::intrusive_ptr<StepDocument>& document, const std::vector<at::Tensor>& appended_keys,
                  const std::vector<at::Tensor>& appended_values, int64_t length) const {
    const int64_t count = layers(), q_size = heads * dim, kv_size = kv_heads * dim;
    TORCH_CHECK(x_in.scalar_type() == at::kFloat && x_in.dim() == 2 && x_in.size(0) == 1,
                "x must be one float32 row (1, hidden), got ", x_in.sizes());
    TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.numel() == dim &&
                    sin.numel() == dim && cos.is_contiguous() && sin.is_contiguous(),
                "cos and sin must be ", dim, " contiguous float32 values");
    TORCH_CHECK(document->layers() == count && static_cast<int64_t>(appended_keys.size()) == count &&
                    static_cast<int64_t>(appended_values.size()) == count,
                "the document and the appended buffers must have ", count, " layers each");
    TORCH_CHECK(x_in.size(1) == hidden, "x must hold ", hidden, " values, got ", x_in.size(1));
    at::Tensor x = x_in.contiguous().clone();
    const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
    std::vector<semanticache::AttentionTasks>& attention = document->attention_tasks(heads / kv_heads, dim, threads, !fp32_rows);
    std::vector<NewRows> rows;
    rows.reserve(count);
    for (int64_t l = 0; l < count; ++l) {
      rows.push_back(new_rows(l, appended_keys[l], appended_values[l], length));
      attention[l].bind(appended_keys[l], appended_values[l], length + 1);
    }
    int64_t inner = 0;
    for (const LayerView& view : views) inner = std::max(inner, view.gate_up.out_features() / 2);
    // shared: the products' outputs (their blocks written by the threads)
    std::vector<float> qkv(q_size + 2 * kv_size), projected(hidden), gate_up(2 * inner), down(hidden);
    float* result = x.data_ptr<float>();
    const float* c = cos.data_ptr<float>();
    const float* s = sin.data_ptr<float>();
    const Clock::time_point region_started = timing ? Clock::now() : Clock::time_point{};
    double attention_seconds = 0.0;
#pragma omp parallel num_threads(threads)
    {
      Worker worker(*this, hidden, std::max({hidden, q_size, inner}), result);
      for (int64_t l = 0; l < count; ++l) {
        const LayerView& p = views[l];
        semanticache::AttentionTasks& tasks = attention[l];
        // -- attention: norm, query/key/value, RoPE, the new key and value into the buffers, the kernel
        worker.norm(p.norm, eps[2 * l]);
        worker.product(p.qkv, worker.normed.data(), hidden, qkv.data());
#pragma omp barrier
        worker.rotate(qkv.data(), c, s, rows[l], scaling);
#pragma omp barrier
        const Clock::time_point attention_started = timing && worker.first ? Clock::now() : Clock::time_point{};
        for (int64_t task = tasks.next(); task < tasks.tasks(); task = tasks.next()) tasks.run(task, worker.query.data());
#pragma omp barrier
        if (timing && worker.first) attention_seconds += seconds_since(attention_started);
        tasks.merge(worker.attended.data());
        worker.product(p.o, worker.attended.data(), q_size, projected.data());
#pragma omp barrier
        worker.add(projected.data());
        // -- MLP: norm, gate/up, SiLU(gate) * up, down
        worker.norm(p.norm_mlp, eps[2 * l + 1]);
        worker.product(p.gate_up, worker.normed.data(), hidden, gate_up.data());
#pragma omp barrier
        silu_times_up(gate_up.data(), worker.activated.data(), p.gate_up.out_features() / 2);
        worker.product(p.down, worker.activated.data(), p.down.in_features(), down.data());
#pragma omp barrier
        worker.add(down.data());
      }
      if (worker.first) std::copy(worker.residual.begin(), worker.residual.end(), result);
    }
    if (timing) {
      times[REGION] += seconds_since(region_started);
      times[ATTENTION] += attention_seconds;
    }
    return x;
  }

  // Where a step writes the new token's key and value in one layer's appended buffers: per kv head at
  // head_stride floats.
  struct NewRows {
    float* key_row;
    float* value_row;
    int64_t key_head_stride, value_head_stride;
  };

  NewRows new_rows(int64_t l, const at::Tensor& keys_buffer, const at::Tensor& values_buffer, int64_t length) const {
    TORCH_CHECK(keys_buffer.scalar_type() == at::kFloat && values_buffer.scalar_type() == at::kFloat &&
                    keys_buffer.dim() == 4 && keys_buffer.sizes() == values_buffer.sizes() &&
                    keys_buffer.size(1) == kv_heads && keys_buffer.size(2) > length && keys_buffer.size(3) == dim &&
                    keys_buffer.stride(3) == 1 && values_buffer.stride(3) == 1,
                "layer ", l, ": appended buffers must be float32 (1, ", kv_heads, ", > ", length, ", ", dim, ")");
    return {keys_buffer.data_ptr<float>() + length * keys_buffer.stride(2),
            values_buffer.data_ptr<float>() + length * values_buffer.stride(2), keys_buffer.stride(1),
            values_buffer.stride(1)};
  }

  // One thread of a step: its copy of the residual stream, its rows, its share of the products' blocks.
  struct Worker {
    const Int4Layers& model;
    const int64_t thread, threads, hidden;
    const bool first;  // thread 0: writes what only one thread may (the cache rows, the result)
    std::vector<float> residual, normed, query, attended, activated;
    semanticache::QuantisedRows codes;
    semanticache::SplitRows split;  // the rows of fp32 products: their group sums, and their pieces (splits_rows)

    Worker(const Int4Layers& model_, int64_t hidden_, int64_t widest, const float* x)
        : model(model_), thread(omp_get_thread_num()), threads(omp_get_num_threads()), hidden(hidden_),
          first(thread == 0), residual(x, x + hidden_), normed(hidden_), query(model_.heads * model_.dim),
          attended(model_.heads * model_.dim), activated(widest) {}

    void norm(const float* weight, double eps) {
      semanticache::rms_norm_row(residual.data(), weight, eps, hidden, normed.data());
    }

    void add(const float* update) {
      for (int64_t i = 0; i < hidden; ++i) residual[i] += update[i];
    }

    // this thread's share of the output blocks (16 outputs each) of row (in,) times p, each as
    // q4_1_product(_fp32) or fp32_row_product computes it
    void product(const Product& p, const float* row, int64_t in, float* out) {
      const int64_t outputs = p.out_features(), blocks = (outputs + 15) / 16, share = (blocks + threads - 1) / threads;
      const int64_t begin = std::min(blocks, thread * share), end = std::min(blocks, begin + share);
      if (p.is_dense()) {
        semanticache::dense_outputs(p.dense, row, out, 16 * begin, std::min(outputs, 16 * end));
        return;
      }
      const semanticache::Q4Weights& w = p.q4;
      if (model.fp32_rows) {
        semanticache::split_rows(row, 1, in, split);
      } else {
        semanticache::quantise_rows(row, 1, in, codes);
      }
      if (begin >= end) return;
      if (model.fp32_rows) {
        semanticache::q4_1_blocks_fp32(w, row, 1, split.sums.data(), out, begin, end,
                                       semanticache::splits_rows() ? &split : nullptr);
      } else {
        semanticache::q4_1_blocks(w, codes, 1, out, begin, end);
      }
    }

    // RoPE of the query (this thread's copy, times the scaling) and, in thread 0, of the key, written with the
    // value at the new token's row of the appended buffers. torch.addcmul's arithmetic: x * cos rounded, then
    // x[swap] * sin added in one fused multiply-add.
    void rotate(const float* qkv, const float* c, const float* s, const NewRows& p, double scaling) {
      const int64_t dim = model.dim, half = dim / 2, q_heads = model.heads, kv_heads = model.kv_heads;
      const float scale = static_cast<float>(scaling);
      for (int64_t h = 0; h < (first ? q_heads + kv_heads : q_heads); ++h) {
        const float* v = qkv + h * dim;
        float* target = h < q_heads ? query.data() + h * dim : p.key_row + (h - q_heads) * p.key_head_stride;
        for (int64_t d = 0; d < dim; ++d) {
          const float rotated = std::fma(v[d < half ? d + half : d - half], s[d], v[d] * c[d]);
          target[d] = h < q_heads ? rotated * scale : rotated;
        }
      }
      if (!first) return;
      for (int64_t h = 0; h < kv_heads; ++h) {
        const float* v = qkv + (q_heads + kv_heads + h) * dim;
        std::copy(v, v + dim, p.value_row + h * p.value_head_stride);
      }
    }
  };

  // activated = SiLU(gate) * up for gate_up = [gate, up] (inner each): ATen's own SiLU (the other steps'
  // rounding), called by each thread inside the step's region (it then runs on that thread alone). Where ATen
  // runs its AVX-512 kernels and inner is whole vectors, that kernel's arithmetic is made here: x / (1 + exp(-x))
  // with the SLEEF exp ATen calls (exported by libtorch_cpu), the same operations in the same order. Through
  // ATen (two tensors made and the operator dispatched) it cost ~6 us a call, 60 calls a step: ~0.35 ms of a step.
  static void silu_times_up(const float* gate_up, float* activated, int64_t inner) {  // gate_up is only read
    const float* up = gate_up + inner;
#if defined(__AVX512F__)
    static const bool aten_avx512 = at::get_cpu_capability() == "AVX512";
    if (aten_avx512 && inner % 16 == 0) {
      for (int64_t i = 0; i < inner; i += 16) {
        const __m512 x = _mm512_loadu_ps(gate_up + i);
        const __m512 e = Sleef_expf16_u10avx512f(_mm512_xor_ps(_mm512_set1_ps(-0.0f), x));
        const __m512 silu = _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
        _mm512_storeu_ps(activated + i, _mm512_mul_ps(silu, _mm512_loadu_ps(up + i)));
      }
      return;
    }
#endif
    const at::Tensor gate =
        at::from_blob(const_cast<float*>(gate_up), {1, inner}, at::TensorOptions().dtype(at::kFloat));
    at::Tensor out = at::from_blob(activated, {1, inner}, at::TensorOptions().dtype(at::kFloat));
    at::silu_out(out, gate);
    for (int64_t i = 0; i < inner; ++i) activated[i] *= up[i];
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
      .def("token_step", &Int4Layers::token_step)
      .def("greedy_steps", &Int4Layers::greedy_steps)
      .def("set_timing", &Int4Layers::set_timing)
      .def("timings", &Int4Layers::timings);
}
