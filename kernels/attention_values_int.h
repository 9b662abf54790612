// Coded values weighted in integers, for the CPU attention kernel (kernels/decode_attention_cpu.cpp, which alone
// includes this) where a step rounds as llama.cpp does (q8_query: weights="int4"). The float path decodes each
// vector of a row (scale * code + minimum) and multiplies it into the query heads' sums: at D = 64 and 3 heads,
// 4 + 12 multiply-adds a row, and Zen 4 issues one 512-bit multiply-add a cycle. Here, per query head and group
// of channels, each row's weight times its scale is rounded to 15 bits against the pass's largest:
//   sum_j w_j * (s_j * code_j + m_j) = step * sum_j q_j * code_j + sum_j w_j * m_j,
//   q_j = round(w_j * s_j / step),  step = max_j (w_j * s_j) / 32767,
// and vpdpwssd multiplies two rows' codes (as 16-bit words, interleaved by a byte permute, vpermt2b) by their two
// weights and adds both, per channel: 6 of them a row at D = 64 and 3 heads, and 2 permutes. The integer sums are
// exact (at most 64 rows * 32767 * 255 < 2^31); the minimums' sums stay in floats, as vectors until the task ends.
// Each weight * scale moves by at most 2^-16 of its pass's largest, so the output by at most 2^-10 of the largest
// group's range (scale * largest code); on random rows 2^-16 to 2^-19 (tests/test_cpu_kernel.py).
// In L1 (8-bit rows, D = 64, 3 heads, a pass of 64 rows): 3.8-3.9 ns a row against the float path's 6.0-6.4, of
// which the integer sums take 2.4, the rounding (with the minimums' sums) 0.7-0.8 and the factors' conversion 0.2.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "attention_rows.h"
#include "cpu_vectors.h"

namespace semanticache::cpu {

// Whether the values can be weighted in integers: 8-bit codes, or 4-bit ones in paired order, D a multiple of
// 64, groups of 1, 2 or a multiple of 4 vectors, and a CPU with AVX-512 VNNI and VBMI (vpdpwssd, vpermt2b).
inline bool integer_weighted(const Rows& values, int64_t dim) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VBMI__)
  const int64_t width = values.group_width;
  return values.scales != nullptr && dim % 64 == 0 && (width == W || width == 2 * W || width % 64 == 0) &&
         (values.format == Format::int8 || (values.format == Format::int4 && values.paired));
#else
  (void)values, (void)dim;
  return false;
#endif
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VBMI__)
constexpr int64_t WEIGHED_HEADS = 4;  // query heads weighted together: 4 x 4 sums beside 4 vectors of codes
constexpr int64_t MAX_VALUE_GROUPS = 256 / W;
constexpr int64_t MAX_WEIGHED_GROUP = 16;  // query heads a kv head (the kernel's MAX_GROUP)

// One pass's weights for WEIGHED_HEADS query heads: words[b][g][j] = q_j of head b and group g (rows 2p and 2p + 1
// in one 32-bit word, low and high, as vpdpwssd pairs them), and step[b][g].
struct IntegerWeights {
  alignas(64) int16_t words[WEIGHED_HEADS][MAX_VALUE_GROUPS][ENTRIES_PER_PASS];
  float step[WEIGHED_HEADS][MAX_VALUE_GROUPS];

  // Heads [0, heads) of `weights` (rows [0, count), 0 beyond; FULL: count == ENTRIES_PER_PASS) against
  // group-major scales (Rows::group_major_factors); and each head's sums of weight * minimum, vectors kept from
  // pass to pass, rescaled by rescale[b] and added to here too (where the weights are loaded anyway: in a loop
  // of their own 0.45 ns a row in L1).
  template <bool FULL>
  void round(const float (*weights)[ENTRIES_PER_PASS], int64_t heads, int64_t count, int64_t groups,
             const float* scale, const float* minimum, const float* rescale, vf (*minimum_sums)[MAX_VALUE_GROUPS]) {
    constexpr int64_t SLICES = ENTRIES_PER_PASS / W;
    const int64_t slices = FULL ? SLICES : (count + W - 1) / W;
    vi lane;
    for (int64_t k = 0; k < W; ++k) lane[k] = k;
    for (int64_t b = 0; b < heads; ++b) {
      for (int64_t g = 0; g < groups; ++g) {
        vf scaled[SLICES], sums[SLICES];
        vf top = vf{};
        for (int64_t s = 0; s < slices; ++s) {
          const vf w = load(weights[b] + W * s);
          scaled[s] = w * load(scale + g * ENTRIES_PER_PASS + W * s);
          sums[s] = w * load(minimum + g * ENTRIES_PER_PASS + W * s);
          if (!FULL) {  // the factors beyond count are stale
            const vi inside = lane < (vi{} + static_cast<int32_t>(count - W * s));
            scaled[s] = inside ? scaled[s] : vf{};
            sums[s] = inside ? sums[s] : vf{};
          }
          top = scaled[s] > top ? scaled[s] : top;
        }
        vf sum = minimum_sums[b][g] * rescale[b];
        for (int64_t s = 0; s < slices; ++s) sum += sums[s];
        minimum_sums[b][g] = sum;
        const float largest = max_lane(top);
        const float inverse = largest > 0.0f ? 32767.0f / largest : 0.0f;
        for (int64_t s = 0; s < slices; ++s) {
          const __m512i rounded = _mm512_cvtps_epi32((__m512)(scaled[s] * inverse));  // to nearest, ties to even
          _mm256_store_si256(reinterpret_cast<__m256i*>(words[b][g] + W * s), _mm512_cvtsepi32_epi16(rounded));
        }
        step[b][g] = largest / 32767.0f;
      }
    }
  }
};

// vpermt2b's index for two rows' codes as 16-bit words: byte 4 i of vector k is channel i of the vector in the
// first row, byte 4 i + 2 in the second (0-63: the first table, 64-127: the second), the odd bytes zeroed by the
// mask, so that each 32-bit lane holds the two rows' codes. 8-bit codes: the tables are the two rows. 4-bit codes:
// the low and the high nibbles of the two rows' 32 bytes (the first row's in bytes 0-31); vector 2 k holds low
// nibbles, 2 k + 1 high ones (paired order).
template <Format F>
struct PairIndex {
  alignas(64) uint8_t bytes[4][64] = {};
  constexpr PairIndex() {
    for (int64_t k = 0; k < 4; ++k) {
      for (int64_t i = 0; i < W; ++i) {
        const int64_t at = F == Format::int8 ? W * k + i : 64 * (k % 2) + W * (k / 2) + i;
        bytes[k][4 * i] = static_cast<uint8_t>(at);
        bytes[k][4 * i + 2] = static_cast<uint8_t>(at + (F == Format::int8 ? 64 : 32));
      }
    }
  }
};
template <Format F>
inline constexpr PairIndex<F> PAIR_INDEX{};

// Channels [64 c, 64 c + 64) of GB query heads' outputs (head b's at out + b * D, in the values' order: paired
// for 4-bit codes) rescaled by rescale[b], plus the pass's rows [0, count) from `first` weighted by `weights`.
// SPAN: vectors a group spans (1, 2, or 4 for groups of 64 channels or more), so that each head's weight for a
// pair of rows is broadcast once a group.
template <int64_t D, Format F, int64_t GB, int64_t SPAN>
inline void weigh_codes(const uint8_t* first, int64_t row_stride, int64_t count, int64_t c, int64_t first_group,
                        const IntegerWeights& weights, const float* rescale, float* out) {
  constexpr int64_t GROUPS = 4 / SPAN;  // groups in the chunk (from first_group on)
  __m512i index[4];
  for (int64_t k = 0; k < 4; ++k) index[k] = _mm512_load_si512(PAIR_INDEX<F>.bytes[k]);
  const __mmask64 even_bytes = 0x5555555555555555ULL;
  __m512i acc[GB][4];
  for (int64_t b = 0; b < GB; ++b)
    for (int64_t k = 0; k < 4; ++k) acc[b][k] = _mm512_setzero_si512();
  // rows a and b (b = a for an odd last row, whose weight is 0) as the p-th pair
  const auto add_pair = [&](const uint8_t* a, const uint8_t* b, int64_t p) __attribute__((always_inline)) {
    __m512i low, high;
    if constexpr (F == Format::int8) {
      prefetch_row_ahead<64>(a, row_stride, c);
      prefetch_row_ahead<64>(b, row_stride, c);
      low = _mm512_loadu_si512(a + 64 * c);
      high = _mm512_loadu_si512(b + 64 * c);
    } else {
      prefetch_row_ahead<32>(a, row_stride, c);
      prefetch_row_ahead<32>(b, row_stride, c);
      const __m512i both = _mm512_inserti64x4(
          _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + 32 * c))),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 32 * c)), 1);
      const __m512i nibble = _mm512_set1_epi8(15);
      low = _mm512_and_si512(both, nibble);
      high = _mm512_and_si512(_mm512_srli_epi16(both, 4), nibble);
    }
    __m512i weight[GB][GROUPS];
    for (int64_t h = 0; h < GB; ++h)
      for (int64_t g = 0; g < GROUPS; ++g)
        weight[h][g] = _mm512_set1_epi32(reinterpret_cast<const int32_t*>(weights.words[h][first_group + g])[p]);
    for (int64_t k = 0; k < 4; ++k) {
      const __m512i codes = _mm512_maskz_permutex2var_epi8(even_bytes, low, index[k], high);
      for (int64_t h = 0; h < GB; ++h) acc[h][k] = _mm512_dpwssd_epi32(acc[h][k], codes, weight[h][k / SPAN]);
    }
  };
  const int64_t pairs = count / 2;
  for (int64_t p = 0; p < pairs; ++p) {
    const uint8_t* a = first + 2 * p * row_stride;
    add_pair(a, a + row_stride, p);
  }
  if (count % 2 == 1) add_pair(first + (count - 1) * row_stride, first + (count - 1) * row_stride, pairs);
  for (int64_t b = 0; b < GB; ++b) {
    for (int64_t k = 0; k < 4; ++k) {
      const int64_t g = first_group + k / SPAN;
      float* at = out + b * D + 64 * c + W * k;
      store(at, load(at) * rescale[b] + (vf)_mm512_cvtepi32_ps(acc[b][k]) * weights.step[b][g]);
    }
  }
}

// A task's coded values weighted in integers (integer_weighted), for query heads [0, group): each pass added into
// their outputs (add_pass), and at the end the sums of weight * minimum, kept as vectors meanwhile (finish).
template <int64_t D>
class IntegerValues {
 public:
  IntegerValues(const Rows& values, int64_t group) : values_(values), group_(group) {
    for (int64_t b = 0; b < group; ++b)
      for (int64_t g = 0; g < values.groups; ++g) minimum_sums_[b][g] = vf{};
  }

  // Rows [start, start + count) of `head`, weighted by weights[b] for head b, into out (head b's at out + b * D)
  // rescaled by rescale[b]; `scratch` and `factors` hold the rows' factors.
  void add_pass(int64_t head, int64_t start, int64_t count, const float (*weights)[ENTRIES_PER_PASS],
                const float* rescale, float* out, float* scratch, float* factors) {
    const Rows& values = values_;
    values.group_major_factors(head, start, count, scratch, factors);
    const float* minimum = factors + values.groups * ENTRIES_PER_PASS;
    const uint8_t* first = values.data + head * values.head_stride + start * values.row_stride;
    const auto weigh = [&]<Format F>() {
      for (int64_t h = 0; h < group_; h += WEIGHED_HEADS) {
        const int64_t heads = std::min(WEIGHED_HEADS, group_ - h);
        if (count == ENTRIES_PER_PASS) {
          rounded_.template round<true>(weights + h, heads, count, values.groups, factors, minimum, rescale + h,
                                        minimum_sums_ + h);
        } else {
          rounded_.template round<false>(weights + h, heads, count, values.groups, factors, minimum, rescale + h,
                                         minimum_sums_ + h);
        }
        for (int64_t c = 0; c < D / 64; ++c) {
          const auto chunk = [&]<int64_t GB>() {
            const auto spans = [&]<int64_t SPAN>() {
              weigh_codes<D, F, GB, SPAN>(first, values.row_stride, count, c, values.group_of_vector[4 * c], rounded_,
                                          rescale + h, out + h * D);
            };
            switch (values.group_width / W) {
              case 1: return spans.template operator()<1>();
              case 2: return spans.template operator()<2>();
              default: return spans.template operator()<4>();
            }
          };
          switch (heads) {
            case 1: chunk.template operator()<1>(); break;
            case 2: chunk.template operator()<2>(); break;
            case 3: chunk.template operator()<3>(); break;
            default: chunk.template operator()<4>();
          }
        }
      }
    };
    if (values.format == Format::int8) return weigh.template operator()<Format::int8>();
    return weigh.template operator()<Format::int4>();
  }

  // The sums of weight * minimum into the outputs (after the last pass).
  void finish(float* out) const {
    for (int64_t b = 0; b < group_; ++b) {
      for (int64_t c = 0; c < D / W; ++c) {
        float* at = out + b * D + W * c;
        store(at, load(at) + sum_lanes(minimum_sums_[b][values_.group_of_vector[c]]));
      }
    }
  }

 private:
  const Rows& values_;
  int64_t group_;
  vf minimum_sums_[MAX_WEIGHED_GROUP][MAX_VALUE_GROUPS];
  IntegerWeights rounded_;
};
#else
template <int64_t D>
struct IntegerValues {  // never used where integer_weighted is false
  IntegerValues(const Rows&, int64_t) {}
  void add_pass(int64_t, int64_t, int64_t, const float (*)[ENTRIES_PER_PASS], const float*, float*, float*, float*) {}
  void finish(float*) const {}
};
#endif

}  // namespace semanticache::cpu
