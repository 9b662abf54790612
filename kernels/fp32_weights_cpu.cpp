// One float32 row times a float32 matrix stored as nn.Linear stores it, (out, in) row-major
// (weights="fp32": the model's own weights and arithmetic, up to the order of the sums).
//
// A decoding step multiplies one row by every matrix once, so the product is bound by how fast the rows
// stream in: each output is one dot product over a row read from start to end (one sequential stream a
// thread), in four independent sums of W lanes (kernels/cpu_vectors.h: 16 with AVX-512, else 8) so that
// consecutive multiply-adds do not wait on each other, the lines PREFETCH bytes ahead asked for as in the int4
// products. On the default model's layer shapes (30 layers, 2 threads, 4 KiB pages, alternating) it took
// 0.84-1.04x torch's one-row product (MKL's) time, ~16 GB/s; in huge pages, as converted weights are kept,
// it reads ~24 GB/s, where a sum reads ~26.
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
#include "cpu_vectors.h"
#include "weights_cpu.h"

#include <cmath>
#include <cstdint>

namespace {

using semanticache::cpu::load, semanticache::cpu::sum_lanes, semanticache::cpu::vf, semanticache::cpu::W;
using semanticache::weights::PREFETCH;

// sum over k < count of row[k] * x[k]: four sums of W lanes, the lines PREFETCH bytes ahead asked for once each
inline float dot(const float* row, const float* x, int64_t count) {
  int64_t k = 0;
  vf a0{}, a1{}, a2{}, a3{};
  for (; k + 4 * W <= count; k += 4 * W) {
    for (int64_t line = 0; line < 4 * W / 16; ++line) __builtin_prefetch(row + k + PREFETCH / 4 + 16 * line);
    a0 += load(row + k) * load(x + k);  // one multiply-add each (the build contracts them, as the kernels' sums)
    a1 += load(row + k + W) * load(x + k + W);
    a2 += load(row + k + 2 * W) * load(x + k + 2 * W);
    a3 += load(row + k + 3 * W) * load(x + k + 3 * W);
  }
  for (; k + W <= count; k += W) a0 += load(row + k) * load(x + k);
  float total = sum_lanes((a0 + a1) + (a2 + a3));
  for (; k < count; ++k) total = std::fma(row[k], x[k], total);
  return total;
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
