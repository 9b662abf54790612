// The int4-exact weights' product on CPUs (weights="int4-exact": semanticache_rag/weights.py,
// ExactInt4Linear): x (rows, in) float32 times GGUF's Q4_1 weights in fp32 arithmetic, the rows as they are
// (not quantised to Q8_0), so the weights multiplied are the decoded ones exactly and only the order of the
// sums differs from a product by them.
//
// The C++ twin of kernels/int4_weights_ref.py's q4_1_product_fp32 (same arguments and results, to fp32
// rounding): q4_1_product_fp32, and its parts for a caller that runs its own threads (input_sums,
// q4_1_blocks_fp32; kernels/decoder_step_cpu.cpp). The codes, scales and minimums are in the layout of the
// Q4_1 products of kernels/int4_weights_cpu.cpp (which also views and checks them, q4_1_weights); what the
// weights' files share: kernels/weights_cpu.h.
//
// Built with the other CPU kernels into one library by kernels/cpu_ops.py, which defines the schemas.

#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "cpu_ops.h"
#include "weights_cpu.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using namespace semanticache::weights;

// tile[k][j] = the Q4_1 code of input k of a group for output j (as floats); octets = the group's 4 x 64 bytes
inline void q4_group_tile(const uint8_t* octets, float (*tile)[OUTPUTS]) {
#if defined(__AVX512F__)
  const __m512i mask = _mm512_set1_epi32(15);
  for (int64_t o = 0; o < GROUP / 8; ++o) {
    const __m512i bytes = _mm512_loadu_si512(octets + 64 * o);  // lane j: output j's 4 bytes
    for (int t = 0; t < 4; ++t) {
      _mm512_store_ps(tile[8 * o + t], _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(bytes, 8 * t), mask)));
      _mm512_store_ps(tile[8 * o + 4 + t],
                      _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(bytes, 8 * t + 4), mask)));
    }
  }
#elif defined(__AVX2__)
  const __m256i mask = _mm256_set1_epi32(15);
  for (int64_t o = 0; o < GROUP / 8; ++o) {
    for (int64_t h = 0; h < 2; ++h) {  // outputs 8 h .. 8 h + 7
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(octets + 64 * o + 32 * h));
      for (int t = 0; t < 4; ++t) {
        _mm256_store_ps(tile[8 * o + t] + 8 * h,
                        _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(bytes, 8 * t), mask)));
        _mm256_store_ps(tile[8 * o + 4 + t] + 8 * h,
                        _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(bytes, 8 * t + 4), mask)));
      }
    }
  }
#else
  for (int64_t k = 0; k < GROUP; ++k) {  // input k: octet k / 8, byte k % 4, half (k / 4) % 2
    const uint8_t* bytes = octets + 64 * (k / 8) + k % 4;
    const int shift = 4 * ((k / 4) % 2);
    for (int64_t j = 0; j < OUTPUTS; ++j) tile[k][j] = static_cast<float>((bytes[4 * j] >> shift) & 15);
  }
#endif
}

#if defined(__AVX512VNNI__) && defined(__AVX512F__) && defined(__AVX512BW__)
// t[j] = the group's sum of input * Q4_1 code (output j) from the split row's pieces (codes xq + p * in_features,
// scales), its integer sums exact: sum over pieces of scale * (codes . row codes); octets = the group's 4 x 64 bytes
inline __m512 q4_group_split(const uint8_t* octets, const int8_t* xq, int64_t in_features, const float* scales) {
  constexpr int64_t P = semanticache::SPLIT_PIECES;
  const __m512i mask = _mm512_set1_epi8(15);
  __m512i low_sum[P], high_sum[P];
  for (int64_t p = 0; p < P; ++p) low_sum[p] = high_sum[p] = _mm512_setzero_si512();
  for (int64_t o = 0; o < GROUP / 8; ++o) {
    const __m512i bytes = _mm512_loadu_si512(octets + 64 * o);
    const __m512i low = _mm512_and_si512(bytes, mask), high = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), mask);
    for (int64_t p = 0; p < P; ++p) {
      const int8_t* codes = xq + p * in_features + 8 * o;
      low_sum[p] = _mm512_dpbusd_epi32(low_sum[p], low, _mm512_set1_epi32(word_at(codes)));
      high_sum[p] = _mm512_dpbusd_epi32(high_sum[p], high, _mm512_set1_epi32(word_at(codes + 4)));
    }
  }
  __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(low_sum[0], high_sum[0])), _mm512_set1_ps(scales[0]));
  for (int64_t p = 1; p < P; ++p)
    t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(low_sum[p], high_sum[p])), _mm512_set1_ps(scales[p]), t);
  return t;
}
#endif

}  // namespace

// x (rows, in) as SplitRows: each group's sum (input_sums) and, where the products sum in integers, its pieces.
void semanticache::split_rows(const float* x, int64_t rows, int64_t in_features, SplitRows& q) {
  const int64_t groups = in_features / GROUP;
  q.sums.resize(rows * groups);
  input_sums(x, rows, in_features, q.sums.data());
#if defined(__AVX512VNNI__) && defined(__AVX512F__) && defined(__AVX512BW__)
  q.codes.resize(rows * SPLIT_PIECES * in_features);
  q.scales.resize(rows * groups * SPLIT_PIECES);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      split_block(x + r * in_features + g * GROUP, q.codes.data() + r * SPLIT_PIECES * in_features + g * GROUP,
                  in_features, q.scales.data() + (r * groups + g) * SPLIT_PIECES);
    }
  }
#endif
}

// Per row and group of 32 inputs, the sum of x's inputs (q4_1_blocks_fp32's sums): x (rows, in), sums (rows, in / 32).
void semanticache::input_sums(const float* x, int64_t rows, int64_t in_features, float* sums) {
  const int64_t groups = in_features / GROUP;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      float sum = 0.0f;
      for (int64_t k = 0; k < GROUP; ++k) sum += x[r * in_features + g * GROUP + k];
      sums[r * groups + g] = sum;
    }
  }
}

// Output blocks [first, last) of x (rows, in) float32 times the Q4_1 weights in fp32 arithmetic, the rows
// as they are, into out (rows, out): per output and group, scale * (the sum of input * code) + minimum *
// (the sum of the inputs, input_sums), summed over groups. The weights are the decoded ones exactly
// (code * scale + minimum); only the order of the sums differs from a product by them. Each group's codes
// become floats once, for every row.
void semanticache::q4_1_blocks_fp32(const Q4Weights& w, const float* input, int64_t rows, const float* sums, float* o,
                                    int64_t first, int64_t last, const SplitRows* split) {
  const int64_t in_features = w.in_features, groups = in_features / GROUP, out_features = w.blocks * OUTPUTS;
  const uint8_t* c = w.codes;
  const uint16_t* s = w.scales;
  const uint16_t* m = w.minimums;
#if defined(__AVX512VNNI__) && defined(__AVX512F__) && defined(__AVX512BW__)
  // The rows split (split_rows): each group's sums of input * code in integers, 6 vpdpbusd for 64 codes of 16
  // outputs instead of 16 conversions and multiply-adds; then scale * that + minimum * the sum of the inputs, as
  // below. Per row, the same operations for any row count.
  if (split != nullptr) {
    for (int64_t b = first; b < last; ++b) {
      for (int64_t r = 0; r < rows; ++r) {
        const int8_t* xq = split->codes.data() + r * SPLIT_PIECES * in_features;
        __m512 total = _mm512_setzero_ps();
        for (int64_t g = 0; g < groups; ++g) {
          const uint8_t* octets = c + (b * in_features + g * GROUP) * OUTPUTS / 2;
          if (r == 0)
            for (int64_t line = 0; line < 4; ++line) __builtin_prefetch(octets + PREFETCH + 64 * line);
          const __m512 t = q4_group_split(octets, xq + g * GROUP, in_features, split->scales.data() + (r * groups + g) * SPLIT_PIECES);
          const __m512 weight_scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + (b * groups + g) * OUTPUTS)));
          const __m512 weight_minimum = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(m + (b * groups + g) * OUTPUTS)));
          total = _mm512_fmadd_ps(weight_minimum, _mm512_set1_ps(split->sums[r * groups + g]), _mm512_fmadd_ps(weight_scale, t, total));
        }
        _mm512_storeu_ps(o + r * out_features + b * OUTPUTS, total);
      }
    }
    return;
  }
#else
  (void)split;
#endif
  alignas(64) float tile[GROUP][OUTPUTS];
  float few[FEW_ROWS * OUTPUTS];
  std::vector<float> many(rows > FEW_ROWS ? rows * OUTPUTS : 0);
  float* totals = rows > FEW_ROWS ? many.data() : few;
  for (int64_t b = first; b < last; ++b) {
    std::fill(totals, totals + rows * OUTPUTS, 0.0f);
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* octets = c + (b * in_features + g * GROUP) * OUTPUTS / 2;
      for (int64_t line = 0; line < 4; ++line) __builtin_prefetch(octets + PREFETCH + 64 * line);
      const uint16_t* scale = s + (b * groups + g) * OUTPUTS;
      const uint16_t* minimum = m + (b * groups + g) * OUTPUTS;
#if defined(__AVX512F__)
      if (rows == 1) {  // decoding: the codes converted in registers, no tile
        const float* row = input + g * GROUP;
        const __m512i mask = _mm512_set1_epi32(15);
        __m512 even = _mm512_setzero_ps(), odd = even;
        for (int64_t o = 0; o < GROUP / 8; ++o) {
          const __m512i bytes = _mm512_loadu_si512(octets + 64 * o);
          for (int t = 0; t < 4; ++t) {
            const __m512 low = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(bytes, 8 * t), mask));
            const __m512 high = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(bytes, 8 * t + 4), mask));
            even = _mm512_fmadd_ps(low, _mm512_set1_ps(row[8 * o + t]), even);
            odd = _mm512_fmadd_ps(high, _mm512_set1_ps(row[8 * o + 4 + t]), odd);
          }
        }
        const __m512 weight_scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scale)));
        const __m512 weight_minimum = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(minimum)));
        const __m512 t = _mm512_fmadd_ps(weight_scale, _mm512_add_ps(even, odd), _mm512_loadu_ps(totals));
        _mm512_storeu_ps(totals, _mm512_fmadd_ps(weight_minimum, _mm512_set1_ps(sums[g]), t));
        continue;
      }
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
      if (rows == 1) {  // AVX-512's arithmetic, outputs 8 h .. 8 h + 7
        // both halves in one loop: four FMA chains at once (two waited on each other's 5-cycle latency),
        // each chain's order as it was, so the sums are the same bit for bit
        const float* row = input + g * GROUP;
        const __m256i mask = _mm256_set1_epi32(15);
        __m256 even[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()}, odd[2] = {even[0], even[0]};
        for (int64_t o = 0; o < GROUP / 8; ++o) {
          const __m256i bytes[2] = {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(octets + 64 * o)),
                                    _mm256_loadu_si256(reinterpret_cast<const __m256i*>(octets + 64 * o + 32))};
          for (int t = 0; t < 4; ++t) {
            const __m256 x_low = _mm256_set1_ps(row[8 * o + t]), x_high = _mm256_set1_ps(row[8 * o + 4 + t]);
            for (int64_t h = 0; h < 2; ++h) {
              const __m256 low = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(bytes[h], 8 * t), mask));
              const __m256 high =
                  _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(bytes[h], 8 * t + 4), mask));
              even[h] = _mm256_fmadd_ps(low, x_low, even[h]);
              odd[h] = _mm256_fmadd_ps(high, x_high, odd[h]);
            }
          }
        }
        for (int64_t h = 0; h < 2; ++h) {
          float* total = totals + 8 * h;
          const __m256 t = _mm256_fmadd_ps(halves(scale + 8 * h), _mm256_add_ps(even[h], odd[h]), _mm256_loadu_ps(total));
          _mm256_storeu_ps(total, _mm256_fmadd_ps(halves(minimum + 8 * h), _mm256_set1_ps(sums[g]), t));
        }
        continue;
      }
#endif
      q4_group_tile(octets, tile);
      for (int64_t r = 0; r < rows; ++r) {
        const float* row = input + r * in_features + g * GROUP;
        float* total = totals + r * OUTPUTS;
        const float row_sum = sums[r * groups + g];
#if defined(__AVX512F__)
        __m512 even = _mm512_setzero_ps(), odd = even;
        for (int64_t o = 0; o < GROUP / 8; ++o) {  // the sums in the one-row path's order
          for (int64_t t = 0; t < 4; ++t) {
            const int64_t k = 8 * o + t;
            even = _mm512_fmadd_ps(_mm512_load_ps(tile[k]), _mm512_set1_ps(row[k]), even);
            odd = _mm512_fmadd_ps(_mm512_load_ps(tile[k + 4]), _mm512_set1_ps(row[k + 4]), odd);
          }
        }
        const __m512 weight_scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scale)));
        const __m512 weight_minimum = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(minimum)));
        const __m512 t = _mm512_fmadd_ps(weight_scale, _mm512_add_ps(even, odd), _mm512_loadu_ps(total));
        _mm512_storeu_ps(total, _mm512_fmadd_ps(weight_minimum, _mm512_set1_ps(row_sum), t));
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
        // the one-row path's arithmetic, its four chains at once too
        __m256 even[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()}, odd[2] = {even[0], even[0]};
        for (int64_t o = 0; o < GROUP / 8; ++o) {
          for (int64_t t = 0; t < 4; ++t) {
            const int64_t k = 8 * o + t;
            const __m256 x_low = _mm256_set1_ps(row[k]), x_high = _mm256_set1_ps(row[k + 4]);
            for (int64_t h = 0; h < 2; ++h) {
              even[h] = _mm256_fmadd_ps(_mm256_load_ps(tile[k] + 8 * h), x_low, even[h]);
              odd[h] = _mm256_fmadd_ps(_mm256_load_ps(tile[k + 4] + 8 * h), x_high, odd[h]);
            }
          }
        }
        for (int64_t h = 0; h < 2; ++h) {
          const __m256 t =
              _mm256_fmadd_ps(halves(scale + 8 * h), _mm256_add_ps(even[h], odd[h]), _mm256_loadu_ps(total + 8 * h));
          _mm256_storeu_ps(total + 8 * h, _mm256_fmadd_ps(halves(minimum + 8 * h), _mm256_set1_ps(row_sum), t));
        }
#else
        float dot[OUTPUTS] = {};
        for (int64_t k = 0; k < GROUP; ++k)
          for (int64_t j = 0; j < OUTPUTS; ++j) dot[j] += tile[k][j] * row[k];
        for (int64_t j = 0; j < OUTPUTS; ++j) {
          total[j] += half_to_float(scale[j]) * dot[j] + half_to_float(minimum[j]) * row_sum;
        }
#endif
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      std::memcpy(o + r * out_features + b * OUTPUTS, totals + r * OUTPUTS, OUTPUTS * sizeof(float));
    }
  }
}

// x (rows, in) float32 times the Q4_1 weights in fp32 arithmetic, the rows as they are (q4_1_blocks_fp32).
at::Tensor semanticache::q4_1_product_fp32(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                                           const at::Tensor& minimums) {
  const Q4Weights w = q4_1_weights(codes, scales, minimums);
  check_rows(x, w.in_features);
  const float* input = x.data_ptr<float>();
  SplitRows split;
  split_rows(input, x.size(0), w.in_features, split);
  return blocks_on_threads(x, w, [&](float* o, int64_t first, int64_t last) {
    q4_1_blocks_fp32(w, input, x.size(0), split.sums.data(), o, first, last, splits_rows() ? &split : nullptr);
  });
}

TORCH_LIBRARY_IMPL(semanticache, CPU, m) {
  m.impl("q4_1_product_fp32", &semanticache::q4_1_product_fp32);
}
