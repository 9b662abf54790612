// The inner sums of the CPU attention kernel (kernels/decode_attention_cpu.cpp, which alone includes this):
// a pass's scores, W rows at a time, and its weighted values, a few query heads and channel vectors at a time.
#pragma once

#include <cstdint>

#include "attention_rows.h"
#include "cpu_vectors.h"

namespace semanticache::cpu {

// Scores of rows [0, n) of a (n, D) tile (n <= W) for one query (C vectors), plus the bias. FULL: n == W,
// with no test per row: GCC kept the `r < n` test as a branch before every multiply-add, and that one loop
// made the fp32 kernel stream at ~60% of the copy bandwidth (4K tokens, 30 layers: 9.5 -> 6.3 ms).
// STREAMED: the tile is fp32 rows read where they are stored; each vector read asks for the line a few rows on.
template <int64_t D, bool FULL, bool STREAMED = false>
inline vf scores_of_rows(const vf* query, const float* tile, int64_t n, const float* bias) {
  constexpr int64_t C = D / W;
  if constexpr (FULL) n = W;
  vf acc[W];
  // ROWS rows at a time: their sums and the query's C vectors stay in the registers
  constexpr int64_t ROWS = W == 16 ? 8 : 4;
  for (int64_t r0 = 0; r0 < W; r0 += ROWS) {
    vf part[ROWS];
    for (int64_t r = 0; r < ROWS; ++r) part[r] = vf{};
#pragma GCC unroll 32
    for (int64_t c = 0; c < C; ++c) {
      const vf q = query[c];
      for (int64_t r = 0; r < ROWS; ++r) {
        if (STREAMED) prefetch_vector_ahead(tile + (r0 + r) * D + W * c, D, c);
        if (FULL || r0 + r < n) part[r] += q * load(tile + (r0 + r) * D + W * c);
      }
    }
    for (int64_t r = 0; r < ROWS; ++r) acc[r0 + r] = part[r];
  }
  vf sums = reduce_lanes(acc);
  if (bias != nullptr) {
    if (n == W) return sums + load(bias);
    for (int64_t r = 0; r < n; ++r) sums[r] += bias[r];
  }
  return sums;
}

// The same for GB query heads at a time from rows [first, first + n) of a source (Decoded: each vector of a row
// decoded once for the GB heads, where it is used), into out[b]. The same sums as scores_of_rows, bit for bit.
template <int64_t D, bool FULL, int64_t GB, class Source>
inline void scores_of_decoded_rows(const vf (*query)[D / W], const Source& key, int64_t first, int64_t n,
                                   const float* bias, vf* out) {
  constexpr int64_t C = D / W;
  if constexpr (FULL) n = W;
  vf acc[GB][W];
  // ROWS rows at a time: their GB sums and the query's vectors stay in the registers
  constexpr int64_t ROWS = GB > 1 ? 4 : W == 16 ? 8 : 4;
#pragma GCC unroll 4
  for (int64_t r0 = 0; r0 < W; r0 += ROWS) {
    vf part[GB][ROWS];
    for (int64_t b = 0; b < GB; ++b)
      for (int64_t r = 0; r < ROWS; ++r) part[b][r] = vf{};
#pragma GCC unroll 32
    for (int64_t c = 0; c < C; ++c) {
      for (int64_t r = 0; r < ROWS; ++r) {
        if (FULL || r0 + r < n) {
          const vf k = key(first + r0 + r, c);
          for (int64_t b = 0; b < GB; ++b) part[b][r] += query[b][c] * k;
        }
      }
    }
    for (int64_t b = 0; b < GB; ++b)
      for (int64_t r = 0; r < ROWS; ++r) acc[b][r0 + r] = part[b][r];
  }
  for (int64_t b = 0; b < GB; ++b) {
    vf sums = reduce_lanes(acc[b]);
    if (bias != nullptr) {
      if (n == W) {
        sums += load(bias);
      } else {
        for (int64_t r = 0; r < n; ++r) sums[r] += bias[r];
      }
    }
    out[b] = sums;
  }
}

// Query heads and channel vectors whose weighted values are summed together: each value vector is loaded
// once for GROUP_BLOCK heads, and GROUP_BLOCK x VALUE_BLOCK sums, the heads' weights and the loaded vector
// fit in the registers (16 with AVX2, 32 with AVX-512).
#if defined(__AVX512F__)
#define GROUP_BLOCK_SIZE 4
#else
#define GROUP_BLOCK_SIZE 3
#endif
constexpr int64_t GROUP_BLOCK = GROUP_BLOCK_SIZE, VALUE_BLOCK = 4;
// query heads scored together from rows decoded where they are used: 3 x 4 sums and 3 x C query vectors (C = 4
// at D = 64) in AVX-512's 32 registers
constexpr int64_t KEY_GROUP_BLOCK = 3;

// out[b][W k] (b < GB: query heads, k < CB: channel vectors; head b's row at out + b * D) rescaled by
// rescale[b], plus the sum over rows j < count of weights[b][j] * value[j][c + k].
template <int64_t D, int64_t GB, int64_t CB, class Source>
inline __attribute__((always_inline)) void add_values(const Source& value, int64_t count,
                                                      const float (*weights)[ENTRIES_PER_PASS], const float* rescale,
                                                      float* out, int64_t c) {
  vf sums[GB][CB];
  for (int64_t b = 0; b < GB; ++b)
    for (int64_t k = 0; k < CB; ++k) sums[b][k] = load(out + b * D + W * k) * rescale[b];
  for (int64_t j = 0; j < count; ++j) {
    vf weight[GB];
    for (int64_t b = 0; b < GB; ++b) weight[b] = splat(weights[b][j]);
    for (int64_t k = 0; k < CB; ++k) {
      const vf v = value(j, c + k);
      for (int64_t b = 0; b < GB; ++b) sums[b][k] += weight[b] * v;
    }
  }
  for (int64_t b = 0; b < GB; ++b)
    for (int64_t k = 0; k < CB; ++k) store(out + b * D + W * k, sums[b][k]);
}

// Rows of D channels from natural to paired order (Rows::paired): in each block of 2 W channels, the even
// ones first, then the odd ones; `back`: the other way.
template <int64_t D>
void pair_channels(float* rows, int64_t count, bool back) {
  float block[2 * W];
  for (int64_t r = 0; r < count; ++r) {
    for (int64_t b = 0; b < D; b += 2 * W) {
      float* x = rows + r * D + b;
      std::copy(x, x + 2 * W, block);
      for (int64_t i = 0; i < W; ++i) {
        if (back) {
          x[2 * i] = block[i], x[2 * i + 1] = block[W + i];
        } else {
          x[i] = block[2 * i], x[W + i] = block[2 * i + 1];
        }
      }
    }
  }
}

}  // namespace semanticache::cpu
