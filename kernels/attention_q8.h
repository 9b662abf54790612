// Coded keys scored against the query rounded to Q8_0, for the CPU attention kernel
// (kernels/decode_attention_cpu.cpp, which alone includes this). With weights="int4" the step keeps llama.cpp's
// arithmetic, and llama.cpp scores a quantised K cache so: the query in blocks of 32 channels, scale = largest
// magnitude / 127, code = round(x / scale) (ties to even; cpu_ops.h's quantise_block, as quantise_rows rounds).
// The kernel then attends with the rounded query q^ = code * scale where the keys are coded; with AVX-512 VNNI,
// 8-bit and paired 4-bit keys (D a multiple of 64, groups of whole blocks) are scored in integers instead:
// vpdpbusd multiplies 64 key codes by 64 query codes a instruction, on 16 rows transposed so that each lane
// holds one row. Per row: q^ . (scale * codes + minimum) = sum over blocks b of the key group's scale *
// q-scale(b) * (codes . query codes)(b), plus the sum over key groups g of minimum(g) * sum of q^ over g: the
// same value as the float path's, up to the rounding of the float sums (the integer sums are exact).
#pragma once

#include <cmath>
#include <cstdint>

#include "attention_rows.h"
#include "cpu_ops.h"
#include "cpu_vectors.h"

namespace semanticache::cpu {

constexpr int64_t Q8_BLOCK = 32;        // channels a block of the rounded query (the whole head where D < 32)
constexpr int64_t MAX_KEY_GROUPS = 8;   // key groups the integer scores take: D / 32 at D = 256
// query heads scored together from one transpose of 16 rows: their 3 x D / 32 sums beside the 16 transposed
// vectors in AVX-512's 32 registers (at D = 64)
constexpr int64_t INTEGER_HEADS = 3;

// The query heads (group of D channels each) rounded to Q8_0: `rounded` q^ (floats), and for the integer
// scores their codes, each block's scale and, per key group of `width` channels, the sum of q^.
template <int64_t D>
struct RoundedQuery {
  static constexpr int64_t BLOCK = D < Q8_BLOCK ? D : Q8_BLOCK;
  alignas(64) float rounded[16 * D];
  alignas(64) int8_t codes[16 * D];
  float block_scale[16][D / BLOCK];
  float group_sum[16][MAX_KEY_GROUPS];

  void round(const float* query, int64_t group, int64_t width) {
    for (int64_t h = 0; h < group; ++h) {
      for (int64_t b = 0; b < D / BLOCK; ++b) {
        const int64_t at = h * D + b * BLOCK;
        const float scale = quantise_block(query + at, BLOCK, codes + at);
        for (int64_t k = 0; k < BLOCK; ++k) rounded[at + k] = codes[at + k] * scale;
        block_scale[h][b] = scale;
      }
      for (int64_t g = 0; g < std::min<int64_t>(D / width, MAX_KEY_GROUPS); ++g) {
        float sum = 0.0f;
        for (int64_t k = 0; k < width; ++k) sum += rounded[h * D + g * width + k];
        group_sum[h][g] = sum;
      }
    }
  }
};

// Whether coded keys are scored in integers (VNNI): 8-bit codes, or 4-bit ones in paired order, D a multiple
// of 64, key groups of whole blocks of the rounded query.
inline bool integer_scored(const Rows& keys, int64_t dim) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  return dim % 64 == 0 && keys.group_width % Q8_BLOCK == 0 && dim / keys.group_width <= MAX_KEY_GROUPS &&
         (keys.format == Format::int8 || (keys.format == Format::int4 && keys.paired));
#else
  (void)keys, (void)dim;
  return false;
#endif
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// 16 x 16 32-bit words transposed in place: word k of r[j] goes to word j of r[k].
inline __attribute__((always_inline)) void transpose_words(__m512i* r) {
  __m512i t[16], u[16], v[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int i = 0; i < 2; ++i) {
    for (int k = 0; k < 4; ++k) {
      v[8 * i + k] = _mm512_shuffle_i32x4(u[8 * i + k], u[8 * i + 4 + k], 0x88);
      v[8 * i + 4 + k] = _mm512_shuffle_i32x4(u[8 * i + k], u[8 * i + 4 + k], 0xDD);
    }
  }
  for (int k = 0; k < 8; ++k) {
    r[k] = _mm512_shuffle_i32x4(v[k], v[8 + k], 0x88);
    r[8 + k] = _mm512_shuffle_i32x4(v[k], v[8 + k], 0xDD);
  }
}

// Channels [64 c, 64 c + 64) of rows [0, n) (n <= 16; FULL: n == 16) as codes, one byte each, in the query's
// order (4-bit codes: paired), transposed: lane r of out[k] holds the codes of channels 64 c + [4 k, 4 k + 4)
// of row r (0 for r >= n).
template <Format F, bool FULL>
inline __attribute__((always_inline)) void transposed_codes(const uint8_t* first, int64_t row_stride, int64_t n,
                                                            int64_t c, __m512i* out) {
  for (int64_t r = 0; r < 16; ++r) {
    if (!FULL && r >= n) {
      out[r] = _mm512_setzero_si512();
      continue;
    }
    const uint8_t* raw = first + r * row_stride;
    prefetch_row_ahead<F == Format::int8 ? 64 : 32>(raw, row_stride, c);  // a chunk: 64 codes
    if constexpr (F == Format::int8) {
      out[r] = _mm512_loadu_si512(raw + 64 * c);
    } else {  // 32 bytes: [low nibbles of 0-15, of 16-31, high of 0-15, of 16-31] -> lanes 0, 2, 1, 3: paired
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(raw + 32 * c));
      const __m256i nibble = _mm256_set1_epi8(15);
      const __m256i low = _mm256_and_si256(bytes, nibble);
      const __m256i high = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble);
      const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1);
      out[r] = _mm512_shuffle_i32x4(both, both, 0xD8);
    }
  }
  transpose_words(out);
}

// Scores of rows [0, n) of a pass (W = 16 of them from `first`; FULL: n == 16) for query heads [h, h + heads)
// (heads <= INTEGER_HEADS), into out[b]: scale and minimum are the pass's key factors group-major (scale[g * stride + j]),
// at the slice's first row.
template <int64_t D, Format F, bool FULL>
inline void integer_scores(const RoundedQuery<D>& query, int64_t h, int64_t heads, const uint8_t* first,
                           int64_t row_stride, int64_t n, int64_t groups, int64_t width, const float* scale,
                           const float* minimum, int64_t stride, const float* bias, vf* out) {
  constexpr int64_t CHUNKS = D / 64, BLOCKS = D / Q8_BLOCK;
  __m512i acc[INTEGER_HEADS][BLOCKS];
  for (int64_t b = 0; b < INTEGER_HEADS; ++b)
    for (int64_t k = 0; k < BLOCKS; ++k) acc[b][k] = _mm512_setzero_si512();
  for (int64_t c = 0; c < CHUNKS; ++c) {
    __m512i codes[16];
    transposed_codes<F, FULL>(first, row_stride, n, c, codes);
    for (int64_t b = 0; b < heads; ++b) {
      const int32_t* words = reinterpret_cast<const int32_t*>(query.codes + (h + b) * D + 64 * c);
      for (int64_t k = 0; k < 16; ++k)
        acc[b][2 * c + k / 8] = _mm512_dpbusd_epi32(acc[b][2 * c + k / 8], codes[k], _mm512_set1_epi32(words[k]));
    }
  }
  for (int64_t b = 0; b < heads; ++b) {
    vf sums = vf{};
    for (int64_t g = 0; g < groups; ++g) sums += load(minimum + g * stride) * query.group_sum[h + b][g];
    for (int64_t k = 0; k < BLOCKS; ++k) {
      const vf block = (vf)_mm512_cvtepi32_ps(acc[b][k]) * query.block_scale[h + b][k];
      sums += block * load(scale + (k * Q8_BLOCK / width) * stride);
    }
    if (bias != nullptr) {
      if (FULL) {
        sums += load(bias);
      } else {
        for (int64_t r = 0; r < n; ++r) sums[r] += bias[r];
      }
    }
    out[b] = sums;
  }
}
// Scores of a pass of coded keys (rows [start, start + count) of `head`, integer_scored) for the query heads
// [0, group), into scores[h] (padding lanes -inf); `scratch` and `factors` hold the keys' factors.
template <int64_t D>
inline void integer_pass_scores(const RoundedQuery<D>& query, int64_t group, const Rows& keys, int64_t head,
                                int64_t start, int64_t count, const float* bias, float* scratch, float* factors,
                                float (*scores)[ENTRIES_PER_PASS]) {
  keys.group_major_factors(head, start, count, scratch, factors);
  const uint8_t* first = keys.data + head * keys.head_stride + start * keys.row_stride;
  const float* minimum = factors + keys.groups * ENTRIES_PER_PASS;
  const auto pass = [&]<Format F>() {
    for (int64_t s = 0; s * W < count; ++s) {
      const int64_t n = std::min<int64_t>(W, count - W * s);
      const uint8_t* rows = first + W * s * keys.row_stride;
      const float* row_bias = bias == nullptr ? nullptr : bias + W * s;
      for (int64_t h = 0; h < group; h += INTEGER_HEADS) {
        const int64_t heads = std::min(INTEGER_HEADS, group - h);
        vf sums[INTEGER_HEADS];
        if (n == W) {
          integer_scores<D, F, true>(query, h, heads, rows, keys.row_stride, n, keys.groups, keys.group_width,
                                     factors + W * s, minimum + W * s, ENTRIES_PER_PASS, row_bias, sums);
        } else {
          integer_scores<D, F, false>(query, h, heads, rows, keys.row_stride, n, keys.groups, keys.group_width,
                                      factors + W * s, minimum + W * s, ENTRIES_PER_PASS, row_bias, sums);
        }
        for (int64_t b = 0; b < heads; ++b) {
          for (int64_t r = n; r < W; ++r) sums[b][r] = -INFINITY;
          store(scores[h + b] + W * s, sums[b]);
        }
      }
    }
  };
  if (keys.format == Format::int8) return pass.template operator()<Format::int8>();
  return pass.template operator()<Format::int4>();
}
#endif

}  // namespace semanticache::cpu
