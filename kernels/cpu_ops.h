// The C++ CPU operators that other kernels call directly (kernels/decoder_step_cpu.cpp), without the
// dispatcher between them. Each is registered as torch.ops.semanticache.<name> by the file that defines
// it; kernels/cpu_ops.py builds them into one library and defines their schemas.
#pragma once

#include <ATen/core/Tensor.h>

#if defined(__AVX512VNNI__) && defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

namespace semanticache {

// kernels/rms_norm_cpu.cpp: x * (1 / sqrt(mean(x^2) + eps)) * weight, per row
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
void rms_norm_row(const float* row, const float* weight, double eps, int64_t dim, float* out);  // one float32 row

// kernels/int4_weights_cpu.cpp: x (rows, in) float32 times Q4_1 weights in their layout, (rows, out)
at::Tensor q4_1_product(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                        const at::Tensor& minimums);

// kernels/int4_exact_weights_cpu.cpp: the same product in fp32 arithmetic, the rows unquantised
at::Tensor q4_1_product_fp32(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                             const at::Tensor& minimums);

// The two products in parts, for a caller that runs its own threads: the weights viewed (and checked)
// once, the rows prepared once, then each thread computes its share of the output blocks (16 outputs
// each), each block as the products compute it, bit for bit.
struct Q4Weights {
  const uint8_t* codes;
  const uint16_t* scales;     // fp16 bits
  const uint16_t* minimums;   // fp16 bits
  int64_t blocks, in_features;  // out = 16 * blocks
};
Q4Weights q4_1_weights(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& minimums);

// One block of n values to Q8_0, as llama.cpp quantises a layer's input: scale = largest magnitude / 127
// (returned), code = round(x / scale), ties to even (all 0 for a block of zeros). Shared by quantise_rows and
// the attention kernel's rounded query (attention_q8.h); kernels/int4_weights_ref.quantize_rows is the twin.
inline float quantise_block(const float* x, int64_t n, int8_t* codes) {
  float largest = 0.0f;
  for (int64_t k = 0; k < n; ++k) largest = std::max(largest, std::fabs(x[k]));
  const float scale = largest / 127.0f, safe = scale > 0.0f ? scale : 1.0f;
  for (int64_t k = 0; k < n; ++k) codes[k] = static_cast<int8_t>(std::nearbyint(x[k] / safe));
  return scale;
}

// Rows quantised to Q8_0, as q4_1_product takes them: codes (rows, in), and per row and group of 32 its
// scale, the sum of its codes and the sum of the fp32 inputs.
struct QuantisedRows {
  std::vector<int8_t> codes;
  std::vector<float> scales, sums;
  std::vector<int32_t> code_sums;
};
void quantise_rows(const float* x, int64_t rows, int64_t in_features, QuantisedRows& q);  // q resized, reused
void q4_1_blocks(const Q4Weights& w, const QuantisedRows& q, int64_t rows, float* out, int64_t first, int64_t last);

void input_sums(const float* x, int64_t rows, int64_t in_features, float* sums);  // (rows, in / 32)

// Pieces of Q8_0 codes whose sum keeps a block of 32 floats to fp32's precision, where products with coded
// weights or keys are summed in integers without rounding their fp32 side (AVX-512 VNNI): each piece what the ones
// before left, rounded to Q8_0 (quantise_block's roundings), its remainder taken with one rounding (a fused
// multiply-add), so each leaves at most 1/254 of what it was given: 3 pieces, within 2^-24 of the block's largest
// magnitude. The int4-exact products' rows (split_rows) and the attention kernel's query (attention_q8.h).
constexpr int64_t SPLIT_PIECES = 3;

#if defined(__AVX512VNNI__) && defined(__AVX512F__) && defined(__AVX512BW__)
// The 32 floats at x as SPLIT_PIECES pieces: piece p's codes at codes + p * piece_stride, its scale steps[p].
inline void split_block(const float* x, int8_t* codes, int64_t piece_stride, float* steps) {
  __m512 left[2] = {_mm512_loadu_ps(x), _mm512_loadu_ps(x + 16)};
  for (int64_t p = 0; p < SPLIT_PIECES; ++p) {
    const float largest = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(left[0]), _mm512_abs_ps(left[1])));
    const float scale = largest / 127.0f, safe = scale > 0.0f ? scale : 1.0f;
    for (int64_t h = 0; h < 2; ++h) {
      const __m512 code = _mm512_roundscale_ps(_mm512_div_ps(left[h], _mm512_set1_ps(safe)), _MM_FROUND_TO_NEAREST_INT);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + p * piece_stride + 16 * h),
                       _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(code)));
      left[h] = _mm512_fnmadd_ps(code, _mm512_set1_ps(scale), left[h]);
    }
    steps[p] = scale;
  }
}
#endif

// Rows as the int4-exact product takes them: the sums of the fp32 inputs per group of 32 (rows, groups: input_sums)
// and, where it sums in integers (splits_rows), each group split (split_block): codes (rows, SPLIT_PIECES, in),
// scales (rows, groups, SPLIT_PIECES).
struct SplitRows {
  std::vector<int8_t> codes;
  std::vector<float> scales, sums;
};
// Whether q4_1_blocks_fp32 takes split rows here (the library built with AVX-512 VNNI)
constexpr bool splits_rows() {
#if defined(__AVX512VNNI__) && defined(__AVX512F__) && defined(__AVX512BW__)
  return true;
#else
  return false;
#endif
}
void split_rows(const float* x, int64_t rows, int64_t in_features, SplitRows& q);  // q resized, reused
// `split`: x split (split_rows), for the integer sums where splits_rows(); otherwise nullptr (fp32 sums)
void q4_1_blocks_fp32(const Q4Weights& w, const float* x, int64_t rows, const float* sums, float* out, int64_t first,
                      int64_t last, const SplitRows* split = nullptr);

// kernels/q8_0_weights_cpu.cpp: x (rows, in) float32 times Q8_0 weights (codes in their layout, bf16
// scales), the rows quantised to Q8_0 too; q8_0_product_fp32: fp32 scales, the rows as they are
at::Tensor q8_0_product(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales);
at::Tensor q8_0_product_fp32(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales);

// kernels/fp32_weights_cpu.cpp: one float32 row times float32 weights (out, in) as nn.Linear keeps them, and
// in parts for a caller that runs its own threads: outputs [first, last) as fp32_row_product computes them
struct DenseWeights {
  const float* rows;  // (out, in) row-major
  int64_t out_features, in_features;
};
DenseWeights dense_weights(const at::Tensor& weight);
void dense_outputs(const DenseWeights& w, const float* x, float* out, int64_t first, int64_t last);
at::Tensor fp32_row_product(const at::Tensor& x, const at::Tensor& weight);  // x (in,) -> (out,)

// kernels/decode_attention_cpu.cpp: one token's attention (H_kv, G, D) over a document as stored and
// the appended (H_kv, T, D); q8_query: coded keys are scored against the query rounded to Q8_0
// (kernels/attention_q8.h)
at::Tensor decode_attention(const at::Tensor& query, const at::Tensor& keys, const std::optional<at::Tensor>& key_scales,
                            const std::optional<at::Tensor>& key_minimums, int64_t key_bits, const at::Tensor& values,
                            const std::optional<at::Tensor>& value_scales,
                            const std::optional<at::Tensor>& value_minimums, int64_t value_bits,
                            const std::optional<at::Tensor>& bias, const at::Tensor& new_keys,
                            const at::Tensor& new_values, bool q8_query);

// kernels/decode_attention_cpu.cpp: decode_attention in parts, for a caller that runs its own threads.
// Made for a document (its arguments checked) and `threads` threads as decode_attention counts them (the
// blocks' bounds depend on it), then bound to the appended rows, the first `appended` of new_keys /
// new_values ((H_kv, >= appended, D) or (1, H_kv, ..)), before the threads start; each task then runs once,
// on any thread (next() hands them out in turn), and merge() gives decode_attention's result bit for bit.
// A decoding step keeps one per layer for its conversation and binds it again at each step.
class AttentionTasks {
 public:
  AttentionTasks(int64_t group, int64_t dim, const at::Tensor& keys, const std::optional<at::Tensor>& key_scales,
                 const std::optional<at::Tensor>& key_minimums, int64_t key_bits, const at::Tensor& values,
                 const std::optional<at::Tensor>& value_scales, const std::optional<at::Tensor>& value_minimums,
                 int64_t value_bits, const std::optional<at::Tensor>& bias, int64_t threads, bool q8_query);
  AttentionTasks(AttentionTasks&&) noexcept;
  ~AttentionTasks();
  void bind(const at::Tensor& new_keys, const at::Tensor& new_values, int64_t appended);  // every task to run again
  int64_t tasks() const;
  int64_t next();                             // the next task to run; tasks() or more: none left
  void run(int64_t task, const float* query);  // query (H_kv, G, D)
  void merge(float* out) const;               // (H_kv, G, D)

 private:
  struct Plan;
  std::unique_ptr<Plan> plan;
};

}  // namespace semanticache
