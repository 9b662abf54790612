// One float32 row times a float32 matrix stored as nn.Linear stores it, (out, in) row-major
// (weights="fp32": the model's own weights and arithmetic, up to the order of the sums).
//
// A decoding step multiplies one row by every matrix once, so the product is bound by how fast the rows
// stream in: each output is one dot product over a row read from start to end (one sequential stream a
// thread), in four independent sums of 16 lanes (AVX-512; 8 with AVX2) so that consecutive multiply-adds
// do not wait on each other, with the lines PREFETCH bytes ahead asked for as in the int4 products. torch's
// product of one row (MKL's) read the default model's layers at ~16 GB/s where a sum reads ~19 (2 threads).
//
// - fp32_row_product: x (in,) -> (out,), the outputs shared out to torch's threads;
// - dense_weights / dense_outputs: the same in parts, for the decoding step's own threads
//   (kernels/decoder_step_cpu.cpp), each output as fp32_row_product computes it, bit for bit.
//
// Built with the other CPU kernels into one library by kernels/cpu_ops.py, which defines the schema.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "cpu_ops.h"
#include "weights_cpu.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <cstdint>

namespace {

using semanticache::weights::PREFETCH;

// sum over k < count of row[k] * x[k]
inline float dot(const float* row, const float* x, int64_t count) {
  int64_t k = 0;
#if defined(__AVX512F__)
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (; k + 64 <= count; k += 64) {
    for (int64_t line = 0; line < 4; ++line) __builtin_prefetch(row + k + PREFETCH / 4 + 16 * line);
    a0 = _mm512_fmadd_ps(_mm512_loadu_ps(row + k), _mm512_loadu_ps(x + k), a0);
    a1 = _mm512_fmadd_ps(_mm512_loadu_ps(row + k + 16), _mm512_loadu_ps(x + k + 16), a1);
    a2 = _mm512_fmadd_ps(_mm512_loadu_ps(row + k + 32), _mm512_loadu_ps(x + k + 32), a2);
    a3 = _mm512_fmadd_ps(_mm512_loadu_ps(row + k + 48), _mm512_loadu_ps(x + k + 48), a3);
  }
  for (; k + 16 <= count; k += 16) a0 = _mm512_fmadd_ps(_mm512_loadu_ps(row + k), _mm512_loadu_ps(x + k), a0);
  if (k < count) {  // the last 1-15 inputs, the lanes beyond them zero
    const __mmask16 rest = static_cast<__mmask16>((1u << (count - k)) - 1u);
    a1 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(rest, row + k), _mm512_maskz_loadu_ps(rest, x + k), a1);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
#else
  float total = 0.0f;
#if defined(__AVX2__) && defined(__FMA__)
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (; k + 32 <= count; k += 32) {
    for (int64_t line = 0; line < 2; ++line) __builtin_prefetch(row + k + PREFETCH / 4 + 16 * line);
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(row + k), _mm256_loadu_ps(x + k), a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(row + k + 8), _mm256_loadu_ps(x + k + 8), a1);
    a2 = _mm256_fmadd_ps(_mm256_loadu_ps(row + k + 16), _mm256_loadu_ps(x + k + 16), a2);
    a3 = _mm256_fmadd_ps(_mm256_loadu_ps(row + k + 24), _mm256_loadu_ps(x + k + 24), a3);
  }
  for (; k + 8 <= count; k += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(row + k), _mm256_loadu_ps(x + k), a0);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
  for (float lane : lanes) total += lane;
#endif
  for (; k < count; ++k) total += row[k] * x[k];
  return total;
#endif
}

}  // namespace

namespace semanticache {

DenseWeights dense_weights(const at::Tensor& weight) {
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kFloat && weight.dim() == 2 &&
                  weight.is_contiguous(),
              "the weight must be a contiguous (out, in) float32 CPU tensor, got ", weight.scalar_type(), " ",
              weight.sizes());
  return {weight.data_ptr<float>(), weight.size(0), weight.size(1)};
}

void dense_outputs(const DenseWeights& w, const float* x, float* out, int64_t first, int64_t last) {
  for (int64_t n = first; n < last; ++n) out[n] = dot(w.rows + n * w.in_features, x, w.in_features);
}

// x (in,) float32 times weight (out, in) float32 -> (out,) float32; the outputs in blocks of 16 on torch's threads
at::Tensor fp32_row_product(const at::Tensor& x, const at::Tensor& weight) {
  const DenseWeights w = dense_weights(weight);
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && x.numel() == w.in_features,
              "x must be a contiguous float32 row of ", w.in_features, " inputs, got ", x.sizes());
  at::Tensor out = at::empty({w.out_features}, x.options());
  const float* row = x.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, w.out_features, 16, [&](int64_t first, int64_t last) {
    dense_outputs(w, row, o, first, last);
  });
  return out;
}

}  // namespace semanticache

TORCH_LIBRARY_IMPL(semanticache, CPU, m) { m.impl("fp32_row_product", &semanticache::fp32_row_product); }
