// The C++ CPU operators that other kernels call directly (kernels/decoder_step_cpu.cpp), without the
// dispatcher between them. Each is registered as torch.ops.semanticache.<name> by the file that defines
// it; kernels/cpu_ops.py builds them into one library and defines their schemas.
#pragma once

#include <ATen/core/Tensor.h>

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

// Rows as the int4-exact product takes them in integers (AVX-512 VNNI): per group of 32 inputs, ROW_PIECES pieces
// of Q8_0 codes whose sum is the group to fp32's precision (each piece what the ones before left, rounded to Q8_0:
// within 2^-24 of the group's largest magnitude), codes (rows, ROW_PIECES, in), scales (rows, groups, ROW_PIECES),
// and the sums of the fp32 inputs (rows, groups: input_sums).
constexpr int64_t ROW_PIECES = 3;
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
