// Weight-only layers' products on CPUs, as llama.cpp computes them: the low-bit codes times the input row
// quantised to int8 (Q8_0: per group of 32 inputs, scale = largest magnitude / 127, code = round(x / scale),
// ties to even), so each group's sum is of integers, which AVX-512 VNNI multiplies 64 code bytes at a time
// (AVX2 in two steps, maddubs and madd), then scaled in fp32.
//
// The C++ twins of kernels/int4_weights_ref.py (same arguments and results, to fp32 rounding; the integer
// sums and unpack_q4_1 bit for bit):
// - q4_1_product / unpack_q4_1: GGUF's Q4_1 (4-bit codes, an fp16 scale and minimum per group of 32
//   inputs: weight = code * scale + minimum), in a layout of their own: codes uint8 (out / 16, in / 8,
//   16, 4), for 16 outputs the codes of 8 consecutive inputs in each output's 4 bytes, byte t holding input
//   t in its low half and input 4 + t in its high one (the 4 bytes one 32-bit lane multiplies, for two
//   instructions); scales and minimums fp16 (out / 16, in / 32, 16). Few rows (decoding, a question)
//   take the product, each block of codes loaded once for all rows; many rows (reading) multiply by the
//   decoded weights (semanticache_rag/weights.py, Int4Linear.rows), one pass writing each weight once.
//
// The Q8_0 and int8 products: kernels/q8_0_weights_cpu.cpp (which quantises its rows with quantise_rows);
// the Q4_1 product in fp32 arithmetic (int4-exact, q4_1_product_fp32): kernels/int4_exact_weights_cpu.cpp
// (which views and checks its weights with q4_1_weights); what the files share: kernels/weights_cpu.h.
//
// Built with the other CPU kernels into one library by kernels/cpu_ops.py, which defines the schemas.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Half.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "cpu_ops.h"
#include "weights_cpu.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using namespace semanticache::weights;

}  // namespace

// x (rows, in) quantised to Q8_0 into q (its vectors sized once, then reused).
void semanticache::quantise_rows(const float* x, int64_t rows, int64_t in_features, QuantisedRows& q) {
  const int64_t groups = in_features / GROUP;
  q.codes.resize(rows * in_features);
  q.scales.resize(rows * groups);
  q.sums.resize(rows * groups);
  q.code_sums.resize(rows * groups);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      const float* row = x + r * in_features + g * GROUP;
      int8_t* codes = q.codes.data() + r * in_features + g * GROUP;
      const float scale = quantise_block(row, GROUP, codes);
      float sum = 0.0f;
      int32_t code_sum = 0;
      for (int64_t k = 0; k < GROUP; ++k) {
        sum += row[k];
        code_sum += codes[k];
      }
      q.scales[r * groups + g] = scale;
      q.sums[r * groups + g] = sum;
      q.code_sums[r * groups + g] = code_sum;
    }
  }
}

namespace {

#if defined(__AVX512VNNI__) && defined(__AVX512F__)
// Lane j: the sum over a group's 32 inputs of Q4_1 code (output j) * row code; octets = the group's 4 x 64 bytes
inline __m512i q4_group_sums(const uint8_t* octets, const int8_t* xq) {
  const __m512i mask = _mm512_set1_epi8(15);
  __m512i low_sum = _mm512_setzero_si512(), high_sum = low_sum;
  for (int64_t o = 0; o < GROUP / 8; ++o) {
    const __m512i bytes = _mm512_loadu_si512(octets + 64 * o);
    low_sum = _mm512_dpbusd_epi32(low_sum, _mm512_and_si512(bytes, mask), _mm512_set1_epi32(word_at(xq + 8 * o)));
    high_sum = _mm512_dpbusd_epi32(high_sum, _mm512_and_si512(_mm512_srli_epi16(bytes, 4), mask),
                                   _mm512_set1_epi32(word_at(xq + 8 * o + 4)));
  }
  return _mm512_add_epi32(low_sum, high_sum);
}
#endif

// dots[j] = sum over a group's 32 inputs of Q4_1 code (output j) * row code; octets = the group's 4 x 64 bytes
inline void q4_group_dots(const uint8_t* octets, const int8_t* xq, int32_t* dots) {
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
  _mm512_storeu_si512(dots, q4_group_sums(octets, xq));
#elif defined(__AVX2__)
  // unsigned codes (at most 15) times signed row codes, pairs summed in 16 bits: each 16-bit lane of an
  // output gathers 16 of the group's 32 products (at most 16 * 15 * 127 = 30480 in magnitude, exact),
  // and one madd a group adds an output's two lanes in 32 bits
  const __m256i mask = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
  __m256i pairs[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};  // outputs 0..7, 8..15
  for (int64_t o = 0; o < GROUP / 8; ++o) {
    const __m256i low_x = _mm256_set1_epi32(word_at(xq + 8 * o)), high_x = _mm256_set1_epi32(word_at(xq + 8 * o + 4));
    for (int64_t h = 0; h < 2; ++h) {
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(octets + 64 * o + 32 * h));
      const __m256i low = _mm256_maddubs_epi16(_mm256_and_si256(bytes, mask), low_x);
      const __m256i high = _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(bytes, 4), mask), high_x);
      pairs[h] = _mm256_add_epi16(pairs[h], _mm256_add_epi16(low, high));
    }
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dots), _mm256_madd_epi16(pairs[0], ones));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dots + 8), _mm256_madd_epi16(pairs[1], ones));
#else
  for (int64_t j = 0; j < OUTPUTS; ++j) {
    int32_t sum = 0;
    for (int64_t o = 0; o < GROUP / 8; ++o) {
      for (int64_t t = 0; t < 4; ++t) {
        const uint8_t byte = octets[64 * o + 4 * j + t];
        sum += (byte & 15) * xq[8 * o + t] + (byte >> 4) * xq[8 * o + 4 + t];
      }
    }
    dots[j] = sum;
  }
#endif
}

void check_q4_1(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& minimums) {
  TORCH_CHECK(codes.device().is_cpu() && codes.scalar_type() == at::kByte && codes.dim() == 4 &&
                  codes.size(2) == OUTPUTS && codes.size(3) == 4 && codes.is_contiguous() &&
                  (codes.size(1) * 8) % GROUP == 0,
              "codes must be contiguous uint8 (out / 16, in / 8, 16, 4) with in a multiple of 32, got ", codes.sizes());
  const int64_t blocks = codes.size(0), groups = codes.size(1) * 8 / GROUP;
  for (const at::Tensor* t : {&scales, &minimums}) {
    TORCH_CHECK(t->scalar_type() == at::kHalf && t->is_contiguous() && t->dim() == 3 && t->size(0) == blocks &&
                    t->size(1) == groups && t->size(2) == OUTPUTS,
                "scales and minimums must be contiguous fp16 (out / 16, in / 32, 16), got ", t->sizes());
  }
}


// The Q4_1 weights (in, out) fp32: code * scale + minimum (the product exact, one rounding).
at::Tensor unpack_q4_1(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& minimums) {
  check_q4_1(codes, scales, minimums);
  const int64_t blocks = codes.size(0), in_features = codes.size(1) * 8, groups = in_features / GROUP;
  const int64_t out_features = blocks * OUTPUTS;
  at::Tensor out = at::empty({in_features, out_features}, codes.options().dtype(at::kFloat));
  const uint8_t* c = codes.data_ptr<uint8_t>();
  const uint16_t* s = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  const uint16_t* m = reinterpret_cast<const uint16_t*>(minimums.data_ptr<at::Half>());
  float* o = out.data_ptr<float>();
  at::parallel_for(0, groups, 1, [&](int64_t first, int64_t last) {
    for (int64_t g = first; g < last; ++g) {
      for (int64_t b = 0; b < blocks; ++b) {
        float scale[OUTPUTS], minimum[OUTPUTS];
        for (int64_t j = 0; j < OUTPUTS; ++j) {
          scale[j] = half_to_float(s[(b * groups + g) * OUTPUTS + j]);
          minimum[j] = half_to_float(m[(b * groups + g) * OUTPUTS + j]);
        }
        const uint8_t* octets = c + (b * in_features + g * GROUP) * OUTPUTS / 2;
        for (int64_t k = 0; k < GROUP; ++k) {  // input g * GROUP + k: octet k / 8, byte k % 4, half (k / 4) % 2
          const uint8_t* bytes = octets + 64 * (k / 8) + k % 4;
          const int shift = 4 * ((k / 4) % 2);
          float* target = o + (g * GROUP + k) * out_features + b * OUTPUTS;
          for (int64_t j = 0; j < OUTPUTS; ++j) {
            target[j] = static_cast<float>((bytes[4 * j] >> shift) & 15) * scale[j] + minimum[j];
          }
        }
      }
    }
  });
  return out;
}

}  // namespace

#if defined(__AVX512F__)
// total + one row's terms of a group for 16 outputs: weight scale * row scale * the integer sums (dots) +
// weight minimum * the sum of the row's inputs (the order of q4_1_blocks' sums, for every row count)
inline __m512 q4_group_total(__m512i dots, const uint16_t* scale, const uint16_t* minimum, float row_scale,
                             float row_sum, __m512 total) {
  const __m512 weight_scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scale)));
  const __m512 weight_minimum = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(minimum)));
  const __m512 t =
      _mm512_fmadd_ps(_mm512_mul_ps(weight_scale, _mm512_set1_ps(row_scale)), _mm512_cvtepi32_ps(dots), total);
  return _mm512_fmadd_ps(weight_minimum, _mm512_set1_ps(row_sum), t);
}
#endif

semanticache::Q4Weights semanticache::q4_1_weights(const at::Tensor& codes, const at::Tensor& scales,
                                                   const at::Tensor& minimums) {
  check_q4_1(codes, scales, minimums);
  return {codes.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>()),
          reinterpret_cast<const uint16_t*>(minimums.data_ptr<at::Half>()), codes.size(0), codes.size(1) * 8};
}

// Output blocks [first, last) of `rows` rows (quantised to Q8_0 in q) times the Q4_1 weights, into out
// (rows, out): per output and group, scale * row scale * the integer sum + minimum * the sum of the fp32
// inputs, summed in fp32.
void semanticache::q4_1_blocks(const Q4Weights& w, const QuantisedRows& q, int64_t rows, float* o, int64_t first,
                               int64_t last) {
  const int64_t in_features = w.in_features, groups = in_features / GROUP, out_features = w.blocks * OUTPUTS;
  const uint8_t* c = w.codes;
  const uint16_t* s = w.scales;
  const uint16_t* m = w.minimums;
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
  // Decoding's one row: its sums kept in a register from group to group instead of stored and loaded again
  // (the same operations in the same order, bit for bit). Each product from L2 5-13% faster on one thread,
  // 4-10% on two (the default model's four shapes, old and new alternating in one process); a decoding step
  // from memory within its noise (a 200-token cache 5.07 -> 4.85 ms, Kaizen 0.75 at 4K 7.29 -> 7.48).
  if (rows == 1) {
    const int8_t* xq = q.codes.data();
    for (int64_t b = first; b < last; ++b) {
      __m512 total = _mm512_setzero_ps();
      for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* octets = c + (b * in_features + g * GROUP) * OUTPUTS / 2;
        for (int64_t line = 0; line < 4; ++line) __builtin_prefetch(octets + PREFETCH + 64 * line);
        total = q4_group_total(q4_group_sums(octets, xq + g * GROUP), s + (b * groups + g) * OUTPUTS,
                               m + (b * groups + g) * OUTPUTS, q.scales[g], q.sums[g], total);
      }
      _mm512_storeu_ps(o + b * OUTPUTS, total);
    }
    return;
  }
#endif
  alignas(64) int32_t dots[OUTPUTS];
  float few[FEW_ROWS * OUTPUTS];  // no allocation for decoding's one row (a step makes 120 products)
  std::vector<float> many(rows > FEW_ROWS ? rows * OUTPUTS : 0);
  float* totals = rows > FEW_ROWS ? many.data() : few;
  for (int64_t b = first; b < last; ++b) {
    std::fill(totals, totals + rows * OUTPUTS, 0.0f);
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* octets = c + (b * in_features + g * GROUP) * OUTPUTS / 2;  // in L1 for the rows after the first
      for (int64_t line = 0; line < 4; ++line) __builtin_prefetch(octets + PREFETCH + 64 * line);
      const uint16_t* scale = s + (b * groups + g) * OUTPUTS;
      const uint16_t* minimum = m + (b * groups + g) * OUTPUTS;
      for (int64_t r = 0; r < rows; ++r) {
        q4_group_dots(octets, q.codes.data() + r * in_features + g * GROUP, dots);
        float* total = totals + r * OUTPUTS;
        const float row_scale = q.scales[r * groups + g], row_sum = q.sums[r * groups + g];
#if defined(__AVX512F__)
        _mm512_storeu_ps(total, q4_group_total(_mm512_load_si512(dots), scale, minimum, row_scale, row_sum,
                                               _mm512_loadu_ps(total)));
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
        for (int64_t h = 0; h < 2; ++h) {  // AVX-512's arithmetic, outputs 8 h .. 8 h + 7
          const __m256 weight_scale = halves(scale + 8 * h), weight_minimum = halves(minimum + 8 * h);
          const __m256 t = _mm256_fmadd_ps(_mm256_mul_ps(weight_scale, _mm256_set1_ps(row_scale)),
                                           _mm256_cvtepi32_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(dots + 8 * h))),
                                           _mm256_loadu_ps(total + 8 * h));
          _mm256_storeu_ps(total + 8 * h, _mm256_fmadd_ps(weight_minimum, _mm256_set1_ps(row_sum), t));
        }
#else
        for (int64_t j = 0; j < OUTPUTS; ++j) {
          total[j] += half_to_float(scale[j]) * row_scale * static_cast<float>(dots[j]) + half_to_float(minimum[j]) * row_sum;
        }
#endif
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      std::memcpy(o + r * out_features + b * OUTPUTS, totals + r * OUTPUTS, OUTPUTS * sizeof(float));
    }
  }
}

// x (rows, in) float32 times the Q4_1 weights, x quantised to Q8_0: (rows, out) float32 (q4_1_blocks).
at::Tensor semanticache::q4_1_product(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                                      const at::Tensor& minimums) {
  const Q4Weights w = q4_1_weights(codes, scales, minimums);
  check_rows(x, w.in_features);
  QuantisedRows q;
  quantise_rows(x.data_ptr<float>(), x.size(0), w.in_features, q);
  return blocks_on_threads(x, w, [&](float* o, int64_t first, int64_t last) {
    q4_1_blocks(w, q, x.size(0), o, first, last);
  });
}

TORCH_LIBRARY_IMPL(semanticache, CPU, m) {
  m.impl("unpack_q4_1", &unpack_q4_1);
  m.impl("q4_1_product", &semanticache::q4_1_product);
}
