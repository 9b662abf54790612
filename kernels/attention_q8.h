// Coded keys scored in integers, for the CPU attention kernel (kernels/decode_attention_cpu.cpp, which alone
// includes this). With weights="int4" the step keeps llama.cpp's arithmetic, and llama.cpp scores a quantised K
// cache so: the query in blocks of 32 channels, scale = largest magnitude / 127, code = round(x / scale) (ties to
// even; cpu_ops.h's quantise_block, as quantise_rows rounds). The kernel then attends with the rounded query
// q^ = code * scale where the keys are coded; with AVX-512 VNNI, 8-bit and paired 4-bit keys (D a multiple of 64,
// groups of whole blocks) are scored in integers instead: vpdpbusd multiplies 64 key codes by 64 query codes a
// instruction, on 16 rows transposed so that each lane holds one row. Per row: q^ . (scale * codes + minimum) =
// sum over blocks b of the key group's scale * q-scale(b) * (codes . query codes)(b), plus the sum over key groups
// g of minimum(g) * sum of q^ over g: the same value as the float path's, up to the rounding of the float sums
// (the integer sums are exact).
//
// Without the rounding (fp32 or int4-exact weights) the same keys are scored in integers too, the query split
// into 3 pieces of codes whose sum is the query to fp32's precision (RoundedQuery::split) and each piece's
// integer sums scaled and added: 3 vpdpbusd a row and head instead of 4 decoding and 4 x 3 multiply-adds. There
// the codes are centred (code - 128, or - 8 for 4-bit ones: an exact integer correction by the piece's sum of
// codes) and the minimum becomes minimum + centre * scale, so that the integer and minimum terms do not cancel
// and carry their fp32 roundings into the score. From memory, 30 layers at 7K tokens on 2 threads (Intel Xeon,
// AVX-512 with AMX, the builds alternating in one process): 8-bit keys and values 7.97 -> 6.93 ms, 4-bit 6.72 ->
// 5.99. (Values weighted in integers in 2 pieces of 15 bits, centred so too, were slower than the float path:
// 8.30 -> 9.49 ms at 8 bits, 6.87 -> 9.15 at 4: they stay in floats.)
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

// The query heads (group of D channels each) as the integer scores take them: rounded to Q8_0 (round: `rounded`
// q^, floats, one piece of codes and each block's scale), or split into SPLIT_PIECES pieces of 8-bit codes whose
// sum is the query (split). Per key group of `width` channels, the sum of q^ (or of the query).
template <int64_t D>
struct RoundedQuery {
  static constexpr int64_t BLOCK = D < Q8_BLOCK ? D : Q8_BLOCK;
  alignas(64) float rounded[16 * D];
  alignas(64) int8_t codes[SPLIT_PIECES][16 * D];
  float block_scale[SPLIT_PIECES][16][D / BLOCK];
  int32_t code_sum[SPLIT_PIECES][16][D / BLOCK];  // split: the sum of each block's codes
  float group_sum[16][MAX_KEY_GROUPS];
  int64_t pieces = 1;

  void round(const float* query, int64_t group, int64_t width) {
    pieces = 1;
    for (int64_t h = 0; h < group; ++h) {
      for (int64_t b = 0; b < D / BLOCK; ++b) {
        const int64_t at = h * D + b * BLOCK;
        const float scale = quantise_block(query + at, BLOCK, codes[0] + at);
        for (int64_t k = 0; k < BLOCK; ++k) rounded[at + k] = codes[0][at + k] * scale;
        block_scale[0][h][b] = scale;
      }
    }
    sum_groups(rounded, group, width);
  }

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  // Each block of the query as the sum over pieces p of step(p) * codes[p] (cpu_ops.h's split_block), with each
  // piece's sum of codes. Only where the keys are scored in integers (integer_scored: D a multiple of 64, so
  // blocks of 32). The integer sums then give the float path's scores up to the rounding of the float sums.
  void split(const float* query, int64_t group, int64_t width) {
    static_assert(D < 64 || BLOCK == 32, "split takes blocks of 32 channels");
    pieces = SPLIT_PIECES;
    for (int64_t h = 0; h < group; ++h) {
      for (int64_t b = 0; b < D / BLOCK; ++b) {
        const int64_t at = h * D + b * BLOCK;
        float steps[SPLIT_PIECES];
        split_block(query + at, codes[0] + at, 16 * D, steps);
        for (int64_t p = 0; p < SPLIT_PIECES; ++p) {
          int32_t sum = 0;
          for (int64_t k = 0; k < BLOCK; ++k) sum += codes[p][at + k];
          block_scale[p][h][b] = steps[p];
          code_sum[p][h][b] = sum;
        }
      }
    }
    sum_groups(query, group, width);
  }
#endif

 private:
  void sum_groups(const float* query, int64_t group, int64_t width) {
    for (int64_t h = 0; h < group; ++h) {
      for (int64_t g = 0; g < std::min<int64_t>(D / width, MAX_KEY_GROUPS); ++g) {
        float sum = 0.0f;
        for (int64_t k = 0; k < width; ++k) sum += query[h * D + g * width + k];
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
// at the slice's first row. PIECES: the query's pieces of codes (RoundedQuery), each block's integer sums scaled
// by its step and added.
template <int64_t D, Format F, bool FULL, int64_t PIECES>
inline void integer_scores(const RoundedQuery<D>& query, int64_t h, int64_t heads, const uint8_t* first,
                           int64_t row_stride, int64_t n, int64_t groups, int64_t width, const float* scale,
                           const float* minimum, int64_t stride, const float* bias, vf* out) {
  constexpr int64_t CHUNKS = D / 64, BLOCKS = D / Q8_BLOCK;
  constexpr int32_t CENTRE = PIECES == 1 ? 0 : F == Format::int8 ? 128 : 8;  // split: codes centred (below)
  vf block[INTEGER_HEADS][BLOCKS];
  for (int64_t b = 0; b < INTEGER_HEADS; ++b)
    for (int64_t k = 0; k < BLOCKS; ++k) block[b][k] = vf{};
  for (int64_t c = 0; c < CHUNKS; ++c) {
    __m512i codes[16];
    transposed_codes<F, FULL>(first, row_stride, n, c, codes);
    for (int64_t b = 0; b < heads; ++b) {
      for (int64_t p = 0; p < PIECES; ++p) {
        const int32_t* words = reinterpret_cast<const int32_t*>(query.codes[p] + (h + b) * D + 64 * c);
        __m512i acc[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
        for (int64_t k = 0; k < 16; ++k) acc[k / 8] = _mm512_dpbusd_epi32(acc[k / 8], codes[k], _mm512_set1_epi32(words[k]));
        for (int64_t i = 0; i < 2; ++i) {
          const int64_t at = 2 * c + i;
          const __m512i sums = PIECES == 1 ? acc[i] : _mm512_sub_epi32(acc[i], _mm512_set1_epi32(CENTRE * query.code_sum[p][h + b][at]));
          block[b][at] += (vf)_mm512_cvtepi32_ps(sums) * query.block_scale[p][h + b][at];
        }
      }
    }
  }
  for (int64_t b = 0; b < heads; ++b) {
    vf sums = vf{};
    for (int64_t g = 0; g < groups; ++g) {
      const vf row_minimum = load(minimum + g * stride);
      sums += (PIECES == 1 ? row_minimum : load(scale + g * stride) * float(CENTRE) + row_minimum) * query.group_sum[h + b][g];
    }
    for (int64_t k = 0; k < BLOCKS; ++k) sums += block[b][k] * load(scale + (k * Q8_BLOCK / width) * stride);
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
  const auto pass = [&]<Format F, int64_t PIECES>() {
    for (int64_t s = 0; s * W < count; ++s) {
      const int64_t n = std::min<int64_t>(W, count - W * s);
      const uint8_t* rows = first + W * s * keys.row_stride;
      const float* row_bias = bias == nullptr ? nullptr : bias + W * s;
      for (int64_t h = 0; h < group; h += INTEGER_HEADS) {
        const int64_t heads = std::min(INTEGER_HEADS, group - h);
        vf sums[INTEGER_HEADS];
        if (n == W) {
          integer_scores<D, F, true, PIECES>(query, h, heads, rows, keys.row_stride, n, keys.groups, keys.group_width,
                                     factors + W * s, minimum + W * s, ENTRIES_PER_PASS, row_bias, sums);
        } else {
          integer_scores<D, F, false, PIECES>(query, h, heads, rows, keys.row_stride, n, keys.groups, keys.group_width,
                                      factors + W * s, minimum + W * s, ENTRIES_PER_PASS, row_bias, sums);
        }
        for (int64_t b = 0; b < heads; ++b) {
          for (int64_t r = n; r < W; ++r) sums[b][r] = -INFINITY;
          store(scores[h + b] + W * s, sums[b]);
        }
      }
    }
  };
  const bool int8 = keys.format == Format::int8;
  if (query.pieces == 1) {
    if (int8) return pass.template operator()<Format::int8, 1>();
    return pass.template operator()<Format::int4, 1>();
  }
  if (int8) return pass.template operator()<Format::int8, SPLIT_PIECES>();
  return pass.template operator()<Format::int4, SPLIT_PIECES>();
}
#endif

}  // namespace semanticache::cpu
