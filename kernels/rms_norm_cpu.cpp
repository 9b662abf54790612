// The RMS norm of fp32 rows, for decoding's one-token steps: torch's own (F.rms_norm) costs ~26 us a call
// on one row of 576 on a 2-core AVX-512 CPU, and a step of the default model makes 60 of them; this is a
// loop over the row. The sum of squares is kept in double, so the result is within an fp32 rounding of
// torch's: x * (1 / sqrt(mean(x^2) + eps)) * weight. Other dtypes go to torch's.
//
// Built with the other CPU kernels into one library by kernels/cpu_ops.py, which defines the schema.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/rms_norm.h>
#include <torch/library.h>

#include "cpu_ops.h"

#include <cmath>
#include <cstdint>

namespace semanticache {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() >= 1 && weight.dim() == 1 && weight.numel() == x.size(-1),
              "weight must hold one value per feature of x (", x.size(-1), "), got ", weight.sizes());
  if (x.scalar_type() != at::kFloat || weight.scalar_type() != at::kFloat || !x.is_contiguous() ||
      !weight.is_contiguous()) {
    return at::rms_norm(x, {x.size(-1)}, weight, eps);
  }
  const int64_t dim = x.size(-1), rows = dim ? x.numel() / dim : 0;
  at::Tensor out = at::empty_like(x);
  const float* in = x.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, rows, 64, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) rms_norm_row(in + r * dim, w, eps, dim, o + r * dim);
  });
  return out;
}

void rms_norm_row(const float* row, const float* weight, double eps, int64_t dim, float* out) {
  double squares = 0.0;
  for (int64_t i = 0; i < dim; ++i) squares += static_cast<double>(row[i]) * row[i];
  const float inverse = static_cast<float>(1.0 / std::sqrt(squares / static_cast<double>(dim) + eps));
  for (int64_t i = 0; i < dim; ++i) out[i] = row[i] * inverse * weight[i];
}

}  // namespace semanticache

TORCH_LIBRARY_IMPL(semanticache, CPU, m) { m.impl("rms_norm", &semanticache::rms_norm); }
