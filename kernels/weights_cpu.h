// What the weight-only layers' products on CPUs share (kernels/int4_weights_cpu.cpp: Q4_1;
// kernels/q8_0_weights_cpu.cpp: Q8_0 and int8 codes per row): the layouts' sizes, how far ahead codes are
// asked for, a word of 4 code bytes and the check of the input rows.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <cstring>

namespace semanticache::weights {

constexpr int64_t GROUP = 32, OUTPUTS = 16;  // inputs per group; outputs per block of the layouts
// How far ahead of the group it multiplies a thread asks for codes (bytes): the hardware prefetcher
// alone left one-row products at 9.8-12.0 GB/s on a 2-core Xeon whose sum reads 19-21 GB/s; 4 KiB ahead
// measured 12.0-13.0 (2 KiB and 8 KiB within the noise of it, alternating processes)
constexpr int64_t PREFETCH = 4096;

inline int32_t word_at(const int8_t* bytes) {
  int32_t word;
  std::memcpy(&word, bytes, 4);
  return word;
}

inline void check_rows(const at::Tensor& x, int64_t in_features) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous() && x.size(1) == in_features,
              "x must be contiguous float32 rows of ", in_features, " inputs, got ", x.sizes());
}

}  // namespace semanticache::weights
