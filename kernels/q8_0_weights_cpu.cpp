// Weight-only layers' products on CPUs, as llama.cpp computes them: the low-bit codes times the input row
// quantised to int8 (Q8_0: per group of 32 inputs, scale = largest magnitude / 127, code = round(x / scale),
// ties to even), so each group's sum is of integers, which AVX-512 VNNI multiplies 64 code bytes at a time
// (AVX2 in two steps, maddubs and madd), then scaled in fp32.
//
// The C++ twins of kernels/int4_weights_ref.py's Q8_0 and int8 products (same arguments and results, to fp32
// rounding; the integer sums bit for bit):
// - q8_0_product: GGUF's Q8_0 (the default model's head); q8_0_product_fp32: the same codes with fp32
//   scales, the rows kept in fp32 (weights="int4-exact"'s head).
// - int8_row_product: int8 codes with one scale per output row, one fp32 row (a dot product per row).
//
// The rows are quantised by quantise_rows (kernels/int4_weights_cpu.cpp, with the Q4_1 product); what the
// weights' files share: kernels/weights_cpu.h.
//
// Built with the other CPU kernels into one library by kernels/cpu_ops.py, which defines the schemas.

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
#include <cstring>

namespace {

using namespace semanticache::weights;

inline float bf16_to_float(uint16_t bits) {
  const uint32_t word = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &word, sizeof value);
  return value;
}

// sum over k < count of x[k] * codes[k] for one row of int8 codes
inline float dot_int8(const int8_t* codes, const float* x, int64_t count) {
  int64_t k = 0;
  float total = 0.0f;
#if defined(__AVX2__) && defined(__FMA__)
  // byte j of a 16-byte load into the top byte of 32-bit lane j (in-lane picks), then an arithmetic
  // shift sign-extends it
  const __m256i first = _mm256_setr_epi8(-1, -1, -1, 0, -1, -1, -1, 1, -1, -1, -1, 2, -1, -1, -1, 3, -1, -1, -1, 4,
                                         -1, -1, -1, 5, -1, -1, -1, 6, -1, -1, -1, 7);
  const __m256i second = _mm256_add_epi32(first, _mm256_set1_epi32(8 << 24));
  __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  auto add = [&](int64_t at, __m256& low, __m256& high) {  // 16 codes into two sums
    const __m256i raw = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + at)));
    const __m256 c0 = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_shuffle_epi8(raw, first), 24));
    const __m256 c1 = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_shuffle_epi8(raw, second), 24));
    low = _mm256_fmadd_ps(c0, _mm256_loadu_ps(x + at), low);
    high = _mm256_fmadd_ps(c1, _mm256_loadu_ps(x + at + 8), high);
  };
  for (; k + 32 <= count; k += 32) {  // four independent sums: consecutive FMAs do not wait on each other
    add(k, a[0], a[1]);
    add(k + 16, a[2], a[3]);
  }
  if (k + 16 <= count) add(k, a[0], a[1]), k += 16;
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, _mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3])));
  for (float lane : lanes) total += lane;
#endif
  for (; k < count; ++k) total += x[k] * static_cast<float>(codes[k]);
  return total;
}

// x (in,) float32 times int8 weights with one scale per output row: codes (out, in) int8, scales (out,)
// bf16 -> (out,) float32, scale * sum x[k] * code.
at::Tensor int8_row_product(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales) {
  TORCH_CHECK(codes.device().is_cpu() && codes.scalar_type() == at::kChar && codes.dim() == 2 && codes.is_contiguous(),
              "codes must be a contiguous (out, in) int8 CPU tensor, got ", codes.sizes());
  const int64_t out_features = codes.size(0), in_features = codes.size(1);
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && x.numel() == in_features,
              "x must be a contiguous float32 row of ", in_features, " inputs, got ", x.sizes());
  TORCH_CHECK(scales.scalar_type() == at::kBFloat16 && scales.is_contiguous() && scales.numel() == out_features,
              "scales must be ", out_features, " contiguous bf16 values, got ", scales.sizes());
  at::Tensor out = at::empty({out_features}, x.options());
  const int8_t* c = codes.data_ptr<int8_t>();
  const uint16_t* s = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::BFloat16>());
  const float* row = x.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, out_features, 16, [&](int64_t first, int64_t last) {
    for (int64_t n = first; n < last; ++n) o[n] = bf16_to_float(s[n]) * dot_int8(c + n * in_features, row, in_features);
  });
  return out;
}

// Q8_0 rows (GGUF's: int8 codes, a scale per group of 32 inputs) times fp32 rows, the rows quantised as
// llama.cpp quantises them (Q8_0 too: per group, scale = largest magnitude / 127, code = round(x / scale),
// ties to even), so the sums are of integers: AVX-512 VNNI multiplies 64 code bytes by 4 input codes
// per instruction. codes: uint8 (out / 16, in / 4, 16, 4), code + 128, for 16 outputs the codes of 4
// consecutive inputs side by side (the 4 bytes one 32-bit lane multiplies); scales: bf16
// (out / 16, in / 32, 16). x (rows, in) float32 -> (rows, out) float32: per output and group,
// scale * x's scale * sum code * x's code, summed over groups in fp32.

// sum over a group of code * x code for 16 outputs (lane j: output j); quads = the group's 8 x 64 bytes
inline void q8_group_dots(const uint8_t* quads, const int8_t* xq, int32_t xq_sum, int32_t* dots) {
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
  // unsigned codes + 128 times signed x codes, 4 per lane; minus 128 * sum of x codes
  __m512i even = _mm512_setzero_si512(), odd = even;
  for (int64_t q = 0; q < GROUP / 4; q += 2) {
    even = _mm512_dpbusd_epi32(even, _mm512_loadu_si512(quads + 64 * q), _mm512_set1_epi32(word_at(xq + 4 * q)));
    odd = _mm512_dpbusd_epi32(odd, _mm512_loadu_si512(quads + 64 * q + 64), _mm512_set1_epi32(word_at(xq + 4 * q + 4)));
  }
  const __m512i sums = _mm512_sub_epi32(_mm512_add_epi32(even, odd), _mm512_set1_epi32(128 * xq_sum));
  _mm512_storeu_si512(dots, sums);
#elif defined(__AVX2__)
  // signed codes (code + 128 with its top bit flipped); |x code| times code with x's sign, pairs summed
  // in 16 bits (at most 2 * 127 * 127) and then in 32
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80)), ones = _mm256_set1_epi16(1);
  __m256i low = _mm256_setzero_si256(), high = low;  // outputs 0..7, 8..15
  for (int64_t q = 0; q < GROUP / 4; ++q) {
    const __m256i x = _mm256_set1_epi32(word_at(xq + 4 * q)), magnitude = _mm256_abs_epi8(x);
    for (int64_t h = 0; h < 2; ++h) {
      const __m256i codes =
          _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(quads + 64 * q + 32 * h)), flip);
      const __m256i pairs = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(codes, x));
      __m256i& sum = h ? high : low;
      sum = _mm256_add_epi32(sum, _mm256_madd_epi16(pairs, ones));
    }
  }
  (void)xq_sum;
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dots), low);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dots + 8), high);
#else
  for (int64_t j = 0; j < OUTPUTS; ++j) {
    int32_t sum = 0;
    for (int64_t k = 0; k < GROUP; ++k) {
      sum += (static_cast<int32_t>(quads[64 * (k / 4) + 4 * j + k % 4]) - 128) * xq[k];
    }
    dots[j] = sum;
  }
  (void)xq_sum;
#endif
}

// Checks a Q8_0 layout's codes and scales (of `dtype`) and x's rows; returns the codes' input count.
int64_t check_q8_0(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, at::ScalarType dtype,
                   const char* dtype_name) {
  TORCH_CHECK(codes.device().is_cpu() && codes.scalar_type() == at::kByte && codes.dim() == 4 &&
                  codes.size(2) == OUTPUTS && codes.size(3) == 4 && codes.is_contiguous() &&
                  (codes.size(1) * 4) % GROUP == 0,
              "codes must be contiguous uint8 (out / 16, in / 4, 16, 4) with in a multiple of 32, got ",
              codes.sizes());
  const int64_t blocks = codes.size(0), in_features = codes.size(1) * 4, groups = in_features / GROUP;
  check_rows(x, in_features);
  TORCH_CHECK(scales.scalar_type() == dtype && scales.is_contiguous() && scales.dim() == 3 &&
                  scales.size(0) == blocks && scales.size(1) == groups && scales.size(2) == OUTPUTS,
              "scales must be contiguous ", dtype_name, " (out / 16, in / 32, 16), got ", scales.sizes());
  return in_features;
}

}  // namespace

at::Tensor semanticache::q8_0_product(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales) {
  const int64_t in_features = check_q8_0(x, codes, scales, at::kBFloat16, "bf16");
  const int64_t blocks = codes.size(0), groups = in_features / GROUP;
  const int64_t rows = x.size(0), out_features = blocks * OUTPUTS;
  at::Tensor out = at::empty({rows, out_features}, x.options());
  QuantisedRows q;
  quantise_rows(x.data_ptr<float>(), rows, in_features, q);
  const uint8_t* c = codes.data_ptr<uint8_t>();
  const uint16_t* s = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::BFloat16>());
  for (int64_t r = 0; r < rows; ++r) {
    const int8_t* xq = q.codes.data() + r * in_features;
    const float* x_scale = q.scales.data() + r * groups;
    const int32_t* xq_sum = q.code_sums.data() + r * groups;
    float* o = out.data_ptr<float>() + r * out_features;
    at::parallel_for(0, blocks, 8, [&](int64_t first, int64_t last) {
      alignas(64) int32_t dots[OUTPUTS];
      for (int64_t b = first; b < last; ++b) {
#if defined(__AVX512F__)
        __m512 total = _mm512_setzero_ps();
        for (int64_t g = 0; g < groups; ++g) {
          const uint8_t* quads = c + (b * in_features + g * GROUP) * OUTPUTS;
          for (int64_t line = 0; line < 8; ++line) __builtin_prefetch(quads + PREFETCH + 64 * line);
          q8_group_dots(quads, xq + g * GROUP, xq_sum[g], dots);
          const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + (b * groups + g) * OUTPUTS));
          const __m512 scale = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
          total = _mm512_fmadd_ps(_mm512_mul_ps(scale, _mm512_set1_ps(x_scale[g])),
                                  _mm512_cvtepi32_ps(_mm512_load_si512(dots)), total);
        }
        _mm512_storeu_ps(o + b * OUTPUTS, total);
#elif defined(__AVX2__) && defined(__FMA__)
        __m256 total[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};  // AVX-512's arithmetic, outputs 8 h ..
        for (int64_t g = 0; g < groups; ++g) {
          const uint8_t* quads = c + (b * in_features + g * GROUP) * OUTPUTS;
          for (int64_t line = 0; line < 8; ++line) __builtin_prefetch(quads + PREFETCH + 64 * line);
          q8_group_dots(quads, xq + g * GROUP, xq_sum[g], dots);
          for (int64_t h = 0; h < 2; ++h) {
            const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + (b * groups + g) * OUTPUTS + 8 * h));
            const __m256 scale = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
            total[h] = _mm256_fmadd_ps(_mm256_mul_ps(scale, _mm256_set1_ps(x_scale[g])),
                                       _mm256_cvtepi32_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(dots + 8 * h))),
                                       total[h]);
          }
        }
        _mm256_storeu_ps(o + b * OUTPUTS, total[0]);
        _mm256_storeu_ps(o + b * OUTPUTS + 8, total[1]);
#else
        float total[OUTPUTS] = {};
        for (int64_t g = 0; g < groups; ++g) {
          const uint8_t* quads = c + (b * in_features + g * GROUP) * OUTPUTS;
          for (int64_t line = 0; line < 8; ++line) __builtin_prefetch(quads + PREFETCH + 64 * line);
          q8_group_dots(quads, xq + g * GROUP, xq_sum[g], dots);
          const uint16_t* scale = s + (b * groups + g) * OUTPUTS;
          for (int64_t j = 0; j < OUTPUTS; ++j) {
            total[j] += bf16_to_float(scale[j]) * x_scale[g] * static_cast<float>(dots[j]);
          }
        }
        std::memcpy(o + b * OUTPUTS, total, sizeof total);
#endif
      }
    });
  }
  return out;
}

// Q8_0 rows times fp32 rows in fp32 arithmetic, the rows as they are (weights="int4-exact"'s head): per
// output and group, scale * (the sum of input * code), summed over groups. The layout of q8_0_product's
// codes; scales float32 (out / 16, in / 32, 16), so weights that are Q8_0 values (code * an fp16 scale)
// decode exactly. A group's sum is four FMA chains (inputs 4 q + t, t < 4, each over q), added pairwise.
// Rows go one at a time (each row's result is the one-row product's).
at::Tensor semanticache::q8_0_product_fp32(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales) {
  const int64_t in_features = check_q8_0(x, codes, scales, at::kFloat, "float32");
  const int64_t blocks = codes.size(0), groups = in_features / GROUP, rows = x.size(0), out_features = blocks * OUTPUTS;
  at::Tensor out = at::empty({rows, out_features}, x.options());
  const uint8_t* c = codes.data_ptr<uint8_t>();
  const float* s = scales.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = x.data_ptr<float>() + r * in_features;
    float* o = out.data_ptr<float>() + r * out_features;
    at::parallel_for(0, blocks, 8, [&](int64_t first, int64_t last) {
      for (int64_t b = first; b < last; ++b) {
#if defined(__AVX512F__)
        const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));  // code + 128 -> the signed code
        __m512 total = _mm512_setzero_ps();
        for (int64_t g = 0; g < groups; ++g) {
          const uint8_t* quads = c + (b * in_features + g * GROUP) * OUTPUTS;
          for (int64_t line = 0; line < 8; ++line) __builtin_prefetch(quads + PREFETCH + 64 * line);
          const float* input = row + g * GROUP;
          __m512 sums[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
          for (int64_t q = 0; q < GROUP / 4; ++q) {
            const __m512i bytes = _mm512_xor_si512(_mm512_loadu_si512(quads + 64 * q), flip);
            const __m512i lanes[4] = {_mm512_srai_epi32(_mm512_slli_epi32(bytes, 24), 24),
                                      _mm512_srai_epi32(_mm512_slli_epi32(bytes, 16), 24),
                                      _mm512_srai_epi32(_mm512_slli_epi32(bytes, 8), 24), _mm512_srai_epi32(bytes, 24)};
            for (int t = 0; t < 4; ++t) {
              sums[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lanes[t]), _mm512_set1_ps(input[4 * q + t]), sums[t]);
            }
          }
          const __m512 sum = _mm512_add_ps(_mm512_add_ps(sums[0], sums[1]), _mm512_add_ps(sums[2], sums[3]));
          total = _mm512_fmadd_ps(_mm512_loadu_ps(s + (b * groups + g) * OUTPUTS), sum, total);
        }
        _mm512_storeu_ps(o + b * OUTPUTS, total);
#elif defined(__AVX2__) && defined(__FMA__)
        const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
        __m256 total[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};  // AVX-512's arithmetic, outputs 8 h ..
        for (int64_t g = 0; g < groups; ++g) {
          const uint8_t* quads = c + (b * in_features + g * GROUP) * OUTPUTS;
          for (int64_t line = 0; line < 8; ++line) __builtin_prefetch(quads + PREFETCH + 64 * line);
          const float* input = row + g * GROUP;
          __m256 sums[2][4];  // both halves' four chains at once, each in its order
          for (int64_t h = 0; h < 2; ++h)
            for (int t = 0; t < 4; ++t) sums[h][t] = _mm256_setzero_ps();
          for (int64_t q = 0; q < GROUP / 4; ++q) {
            for (int64_t h = 0; h < 2; ++h) {
              const __m256i bytes =
                  _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(quads + 64 * q + 32 * h)), flip);
              const __m256i lanes[4] = {_mm256_srai_epi32(_mm256_slli_epi32(bytes, 24), 24),
                                        _mm256_srai_epi32(_mm256_slli_epi32(bytes, 16), 24),
                                        _mm256_srai_epi32(_mm256_slli_epi32(bytes, 8), 24), _mm256_srai_epi32(bytes, 24)};
              for (int t = 0; t < 4; ++t) {
                sums[h][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lanes[t]), _mm256_set1_ps(input[4 * q + t]), sums[h][t]);
              }
            }
          }
          for (int64_t h = 0; h < 2; ++h) {
            const __m256 sum = _mm256_add_ps(_mm256_add_ps(sums[h][0], sums[h][1]), _mm256_add_ps(sums[h][2], sums[h][3]));
            total[h] = _mm256_fmadd_ps(_mm256_loadu_ps(s + (b * groups + g) * OUTPUTS + 8 * h), sum, total[h]);
          }
        }
        _mm256_storeu_ps(o + b * OUTPUTS, total[0]);
        _mm256_storeu_ps(o + b * OUTPUTS + 8, total[1]);
#else
        float total[OUTPUTS] = {};
        for (int64_t g = 0; g < groups; ++g) {
          const uint8_t* quads = c + (b * in_features + g * GROUP) * OUTPUTS;
          const float* input = row + g * GROUP;
          for (int64_t j = 0; j < OUTPUTS; ++j) {
            float sums[4] = {};
            for (int64_t q = 0; q < GROUP / 4; ++q) {
              for (int64_t t = 0; t < 4; ++t) {
                sums[t] += static_cast<float>(static_cast<int32_t>(quads[64 * q + 4 * j + t]) - 128) * input[4 * q + t];
              }
            }
            total[j] += s[(b * groups + g) * OUTPUTS + j] * ((sums[0] + sums[1]) + (sums[2] + sums[3]));
          }
        }
        std::memcpy(o + b * OUTPUTS, total, sizeof total);
#endif
      }
    });
  }
  return out;
}

TORCH_LIBRARY_IMPL(semanticache, CPU, m) {
  m.impl("int8_row_product", &int8_row_product);
  m.impl("q8_0_product", &semanticache::q8_0_product);
  m.impl("q8_0_product_fp32", &semanticache::q8_0_product_fp32);
}
