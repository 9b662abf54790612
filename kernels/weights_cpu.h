// What the weight-only layers' products on CPUs share (kernels/int4_weights_cpu.cpp: Q4_1;
// kernels/int4_exact_weights_cpu.cpp: Q4_1 in fp32 arithmetic; kernels/q8_0_weights_cpu.cpp: Q8_0 and int8
// codes per row): the layouts' sizes, how far ahead codes are asked for, a word of 4 code bytes, fp16
// scales as floats, the check of the input rows and the output blocks shared out to threads.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>

#include "cpu_ops.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <cstdint>
#include <cstring>

namespace semanticache::weights {

constexpr int64_t GROUP = 32, OUTPUTS = 16;  // inputs per group; outputs per block of the layouts
// How far ahead of the group it multiplies a thread asks for codes (bytes): the hardware prefetcher
// alone left one-row products at 9.8-12.0 GB/s on a 2-core Xeon whose sum reads 19-21 GB/s; 4 KiB ahead
// measured 12.0-13.0 (2 KiB and 8 KiB within the noise of it, alternating processes)
constexpr int64_t PREFETCH = 4096;
constexpr int64_t FEW_ROWS = 16;  // rows whose sums a block keeps on the stack

inline int32_t word_at(const int8_t* bytes) {
  int32_t word;
  std::memcpy(&word, bytes, 4);
  return word;
}

inline float half_to_float(uint16_t bits) { return c10::detail::fp16_ieee_to_fp32_value(bits); }

#if defined(__AVX2__) && defined(__F16C__)
inline __m256 halves(const uint16_t* bits) {  // 8 fp16 values as floats
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bits)));
}
#endif

inline void check_rows(const at::Tensor& x, int64_t in_features) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous() && x.size(1) == in_features,
              "x must be contiguous float32 rows of ", in_features, " inputs, got ", x.sizes());
}

// A new (rows, out) float32 product of x's rows and w, its output blocks shared out to torch's threads:
// blocks(out, first, last) computes blocks [first, last).
template <typename Blocks>
at::Tensor blocks_on_threads(const at::Tensor& x, const semanticache::Q4Weights& w, Blocks blocks) {
  at::Tensor out = at::empty({x.size(0), w.blocks * OUTPUTS}, x.options());
  float* o = out.data_ptr<float>();
  at::parallel_for(0, w.blocks, 4, [&](int64_t first, int64_t last) { blocks(o, first, last); });
  return out;
}

}  // namespace semanticache::weights
