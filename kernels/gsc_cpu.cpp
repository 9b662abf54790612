// Greedy Seed-based Clustering on a CPU, from a chunked similarity grid, at K thresholds per head.
//
// The C++ twin of gsc_ref.greedy_seeds (same arguments, the same clusters: a token joins a seed when their
// float32 similarity is >= tau, as there). Per (threshold, head, chunk): the chunk's first unassigned free
// token is a seed, and every later unassigned free token at least tau alike joins it; repeat. The torch
// twin runs this loop as a few tensor operations per slot over every chunk at once, on a table sorted for
// any tau; here each (threshold, head, chunk) is a short loop of its own, over the similarity as it is, on
// torch's OpenMP pool: no sort, no packed masks, and no Python per slot.
//
// Built with the other CPU kernels into one library by kernels/cpu_ops.py, which defines the schema.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <cstdint>
#include <tuple>
#include <vector>

namespace {

// similarity (H, C, W, W) float32; chunk_lengths (C,) int64; free (C, W) bool: tokens that may merge
// (not protected, inside their chunk); tau (K, H) float32. Returns the seed slot of every token (K, H, C, W)
// int16 (a token that is not free, or past its chunk's end, is its own) and the clusters of free tokens
// per threshold and head (K, H) int64.
std::tuple<at::Tensor, at::Tensor> greedy_seeds(const at::Tensor& similarity, const at::Tensor& chunk_lengths,
                                                const at::Tensor& free, const at::Tensor& tau) {
  TORCH_CHECK(similarity.device().is_cpu() && similarity.scalar_type() == at::kFloat && similarity.dim() == 4 &&
                  similarity.is_contiguous() && similarity.size(2) == similarity.size(3),
              "similarity must be a contiguous (H, C, W, W) float32 CPU tensor, got ", similarity.sizes());
  const int64_t heads = similarity.size(0), chunks = similarity.size(1), width = similarity.size(2);
  TORCH_CHECK(width <= 32767, "chunks of at most 32,767 tokens, got ", width);
  TORCH_CHECK(chunk_lengths.scalar_type() == at::kLong && chunk_lengths.dim() == 1 && chunk_lengths.size(0) == chunks &&
                  chunk_lengths.is_contiguous(),
              "chunk_lengths must be (C,) int64 with C = ", chunks);
  TORCH_CHECK(free.scalar_type() == at::kBool && free.dim() == 2 && free.size(0) == chunks && free.size(1) == width &&
                  free.is_contiguous(),
              "free must be a contiguous (C, W) bool tensor with (C, W) = (", chunks, ", ", width, ")");
  TORCH_CHECK(tau.scalar_type() == at::kFloat && tau.dim() == 2 && tau.size(1) == heads && tau.is_contiguous(),
              "tau must be a contiguous (K, H) float32 tensor with H = ", heads);
  const int64_t thresholds = tau.size(0);
  const int64_t* lengths = chunk_lengths.data_ptr<int64_t>();
  for (int64_t c = 0; c < chunks; ++c) {
    TORCH_CHECK(lengths[c] >= 0 && lengths[c] <= width, "chunk ", c, " has length ", lengths[c], ", not in [0, ",
                width, "]");
  }
  at::Tensor slots = at::empty({thresholds, heads, chunks, width}, similarity.options().dtype(at::kShort));
  at::Tensor counts = at::zeros({thresholds, heads, chunks}, similarity.options().dtype(at::kLong));
  const float* sim = similarity.data_ptr<float>();
  const bool* may_merge = free.data_ptr<bool>();
  const float* taus = tau.data_ptr<float>();
  int16_t* out = slots.data_ptr<int16_t>();
  int64_t* seeded = counts.data_ptr<int64_t>();
  at::parallel_for(0, thresholds * heads * chunks, 16, [&](int64_t first, int64_t last) {
    std::vector<uint8_t> open(width);  // unassigned free tokens of the chunk
    for (int64_t task = first; task < last; ++task) {
      const int64_t c = task % chunks, h = (task / chunks) % heads, k = task / (chunks * heads);
      const float t = taus[k * heads + h];
      const int64_t length = lengths[c];
      int16_t* slot = out + task * width;
      const bool* chunk_free = may_merge + c * width;
      for (int64_t q = 0; q < width; ++q) {
        slot[q] = static_cast<int16_t>(q);
        open[q] = q < length && chunk_free[q];
      }
      const float* grid = sim + (h * chunks + c) * width * width;
      int64_t clusters = 0;
      for (int64_t p = 0; p < length; ++p) {
        if (!open[p]) continue;
        ++clusters;  // p seeds a cluster: itself, and every later open token at least t alike
        const float* row = grid + p * width;
        open[p] = 0;
        for (int64_t q = p + 1; q < length; ++q) {  // branch-free, so the compiler vectorises it
          const uint8_t joins = open[q] & static_cast<uint8_t>(row[q] >= t);
          slot[q] = joins ? static_cast<int16_t>(p) : slot[q];
          open[q] &= static_cast<uint8_t>(joins ^ 1);
        }
      }
      seeded[task] = clusters;
    }
  });
  return {slots, counts.sum(-1)};
}

}  // namespace

TORCH_LIBRARY_IMPL(semanticache, CPU, m) { m.impl("greedy_seeds", &greedy_seeds); }
