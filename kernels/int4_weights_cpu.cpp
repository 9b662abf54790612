// A layer's int4 weights, as torch's CPU int4 kernel packs them: decoded to fp32 (in, out), and multiplied
// by one fp32 row.
//
// The C++ twins of kernels/int4_weights_ref.py (same arguments; unpack_int4_weight gives the same result
// bit for bit: each weight is (code - 8) * scale + zero, with one rounding either way, since
// (code - 8) * scale is exact in fp32).
// - unpack_int4_weight: reading a document multiplies many rows by each layer; torch's int4 kernel is
//   made for few rows, so there the weights are decoded once per call and multiplied by fp32 inputs
//   instead (semanticache_rag/weights.py, Int4Linear.rows). Decoding writes each weight once, four bytes,
//   a group of rows per task on torch's OpenMP pool; torch ops take four passes and their temporaries.
// - int8_row_product: the same for int8 codes with one scale per output row (a dot product per row).
// - int4_row_product: decoding multiplies one row by each layer. Per block of 32 or 64 outputs and group of
//   inputs, sum x[k] * code over the group's inputs, then add scale * that + (zero - 8 scale) * sum x[k]:
//   one FMA per weight in fp32, the codes widened to floats in registers (torch's kernel rounds the row
//   to bf16 and is 2-4x slower than this here).
//
// Built with the other CPU kernels into one library by kernels/cpu_ops.py, which defines the schemas.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

inline float bf16_to_float(uint16_t bits) {
  const uint32_t word = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &word, sizeof value);
  return value;
}

// packed: uint8 (out / block, in, block / 2) bytes, output j of a block in the low half-byte and output
// j + block / 2 in the high one; scales_and_zeros: bf16 (in / group, out, 2).
at::Tensor unpack_int4_weight(const at::Tensor& packed, const at::Tensor& scales_and_zeros, int64_t out_features,
                              int64_t block) {
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == at::kByte && packed.dim() == 2 &&
                  packed.is_contiguous(),
              "packed must be a contiguous uint8 CPU tensor (out, in / 2), got ", packed.sizes());
  TORCH_CHECK(block >= 2 && block % 2 == 0 && out_features > 0 && out_features % block == 0,
              "out_features (", out_features, ") must be a positive multiple of an even block (", block, ")");
  TORCH_CHECK(packed.numel() % (out_features / 2) == 0, "packed has ", packed.numel(),
              " bytes, not a multiple of out_features / 2 = ", out_features / 2);
  const int64_t in_features = packed.numel() / (out_features / 2);
  TORCH_CHECK(scales_and_zeros.scalar_type() == at::kBFloat16 && scales_and_zeros.dim() == 3 &&
                  scales_and_zeros.is_contiguous() && scales_and_zeros.size(1) == out_features &&
                  scales_and_zeros.size(2) == 2,
              "scales_and_zeros must be contiguous bf16 (in / group, out, 2), got ", scales_and_zeros.sizes());
  const int64_t groups = scales_and_zeros.size(0);
  TORCH_CHECK(groups > 0 && in_features % groups == 0, "in_features (", in_features,
              ") must be a multiple of the groups of scales_and_zeros (", groups, ")");
  const int64_t group = in_features / groups, half = block / 2, blocks = out_features / block;
  at::Tensor out = at::empty({in_features, out_features}, packed.options().dtype(at::kFloat));
  const uint8_t* codes = packed.data_ptr<uint8_t>();
  const uint16_t* pairs = reinterpret_cast<const uint16_t*>(scales_and_zeros.data_ptr<at::BFloat16>());
  float* o = out.data_ptr<float>();
  at::parallel_for(0, groups, 1, [&](int64_t first, int64_t last) {
    std::vector<float> scale(out_features), zero(out_features);
    for (int64_t g = first; g < last; ++g) {
      const uint16_t* row = pairs + g * out_features * 2;
      for (int64_t n = 0; n < out_features; ++n) {
        scale[n] = bf16_to_float(row[2 * n]);
        zero[n] = bf16_to_float(row[2 * n + 1]);
      }
      for (int64_t k = g * group; k < (g + 1) * group; ++k) {
        float* target = o + k * out_features;
        for (int64_t b = 0; b < blocks; ++b) {
          const uint8_t* bytes = codes + (b * in_features + k) * half;
          const float* s = scale.data() + b * block;
          const float* z = zero.data() + b * block;
          float* t = target + b * block;
          for (int64_t j = 0; j < half; ++j) {  // vectorised by the compiler
            t[j] = static_cast<float>(static_cast<int32_t>(bytes[j] & 15) - 8) * s[j] + z[j];
            t[half + j] = static_cast<float>(static_cast<int32_t>(bytes[j] >> 4) - 8) * s[half + j] + z[half + j];
          }
        }
      }
    }
  });
  return out;
}

// Outputs per block of the packings the row product takes: torch packs 32 on AVX2 CPUs and 64 on AVX-512
// ones (the same layout: byte j of an input's block holds output j in its low half-byte and output
// j + block / 2 in its high one).
constexpr int64_t MAX_BLOCK = 64;

#if defined(__AVX512F__)
// acc[0..block) = sum over k < count of x[k] * the codes of input k of a block (block / 2 bytes each).
// The sums stay in registers, in two sets (even and odd inputs) so that consecutive FMAs do not wait on
// each other.
template <int64_t block>
inline void sum_codes(const uint8_t* bytes, const float* x, int64_t count, float* acc) {
  constexpr int64_t half = block / 2, parts = block / 16;  // bytes per input; 16-output sums
  static_assert(half == 16 || half == 32, "blocks of 32 or 64 outputs");
  __m512 even[parts], odd[parts];
  for (int64_t p = 0; p < parts; ++p) even[p] = odd[p] = _mm512_setzero_ps();
  auto add = [&](int64_t k, __m512* sums) {
    const __m512 v = _mm512_set1_ps(x[k]);
    for (int64_t h = 0; h < half / 16; ++h) {  // 16 bytes: outputs 16 h.. (low) and half + 16 h.. (high)
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + k * half + 16 * h));
      const __m128i mask = _mm_set1_epi8(15);
      const __m512 low = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(raw, mask)));
      const __m512 high = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(raw, 4), mask)));
      sums[h] = _mm512_fmadd_ps(v, low, sums[h]);
      sums[half / 16 + h] = _mm512_fmadd_ps(v, high, sums[half / 16 + h]);
    }
  };
  int64_t k = 0;
  for (; k + 1 < count; k += 2) {
    add(k, even);
    add(k + 1, odd);
  }
  if (k < count) add(k, even);
  for (int64_t p = 0; p < parts; ++p) _mm512_storeu_ps(acc + 16 * p, _mm512_add_ps(even[p], odd[p]));
}
#elif defined(__AVX2__) && defined(__FMA__)
template <int64_t block>
inline void sum_codes(const uint8_t* bytes, const float* x, int64_t count, float* acc) {
  constexpr int64_t half = block / 2;
  static_assert(half == 16 || half == 32, "blocks of 32 or 64 outputs");
  // Each input's 16 bytes in both 128-bit halves (a load, no shuffle), then in-lane byte picks put byte j
  // in 32-bit lane j (the cross-lane widenings are slow on some x86 cores): its low and high half-bytes
  // are outputs j and j + half. A block of 64 takes two passes, one per 16 bytes of each input.
  const __m256i first = _mm256_setr_epi8(0, -1, -1, -1, 1, -1, -1, -1, 2, -1, -1, -1, 3, -1, -1, -1, 4, -1, -1, -1,
                                         5, -1, -1, -1, 6, -1, -1, -1, 7, -1, -1, -1);
  const __m256i second = _mm256_add_epi32(first, _mm256_set1_epi32(8));
  const __m256i mask = _mm256_set1_epi32(15);
  for (int64_t h = 0; h < half / 16; ++h) {
    __m256 e0 = _mm256_setzero_ps(), e1 = e0, e2 = e0, e3 = e0, o0 = e0, o1 = e0, o2 = e0, o3 = e0;
    auto add = [&](int64_t k, __m256& a0, __m256& a1, __m256& a2, __m256& a3) {
      const __m256i raw =
          _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + k * half + 16 * h)));
      const __m256i b0 = _mm256_shuffle_epi8(raw, first), b1 = _mm256_shuffle_epi8(raw, second);
      const __m256 v = _mm256_set1_ps(x[k]);
      a0 = _mm256_fmadd_ps(v, _mm256_cvtepi32_ps(_mm256_and_si256(b0, mask)), a0);
      a1 = _mm256_fmadd_ps(v, _mm256_cvtepi32_ps(_mm256_and_si256(b1, mask)), a1);
      a2 = _mm256_fmadd_ps(v, _mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4)), a2);
      a3 = _mm256_fmadd_ps(v, _mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4)), a3);
    };
    int64_t k = 0;
    for (; k + 1 < count; k += 2) {
      add(k, e0, e1, e2, e3);
      add(k + 1, o0, o1, o2, o3);
    }
    if (k < count) add(k, e0, e1, e2, e3);
    _mm256_storeu_ps(acc + 16 * h, _mm256_add_ps(e0, o0));
    _mm256_storeu_ps(acc + 16 * h + 8, _mm256_add_ps(e1, o1));
    _mm256_storeu_ps(acc + half + 16 * h, _mm256_add_ps(e2, o2));
    _mm256_storeu_ps(acc + half + 16 * h + 8, _mm256_add_ps(e3, o3));
  }
}
#else
template <int64_t block>
inline void sum_codes(const uint8_t* bytes, const float* x, int64_t count, float* acc) {
  constexpr int64_t half = block / 2;
  std::fill(acc, acc + block, 0.0f);
  for (int64_t k = 0; k < count; ++k) {
    for (int64_t j = 0; j < half; ++j) {
      acc[j] += x[k] * static_cast<float>(bytes[k * half + j] & 15);
      acc[half + j] += x[k] * static_cast<float>(bytes[k * half + j] >> 4);
    }
  }
}
#endif

// total[j] += scale_j * acc[j] + (zero_j - 8 scale_j) * sum for a block's outputs, their (scale, zero)
// bf16 pairs read 16 (or 8) at a time as 32-bit words: the scale is the word shifted up by 16 bits, the
// zero the word's top half (a third of the row product's work when written one output at a time).
template <int64_t block>
inline void add_group(float* total, const float* acc, const uint16_t* pair, float sum) {
  int64_t j = 0;
#if defined(__AVX512F__)
  const __m512i top = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (; j + 16 <= block; j += 16) {
    const __m512i words = _mm512_loadu_si512(pair + 2 * j);
    const __m512 scale = _mm512_castsi512_ps(_mm512_slli_epi32(words, 16));
    const __m512 zero = _mm512_castsi512_ps(_mm512_and_si512(words, top));
    __m512 t = _mm512_fmadd_ps(scale, _mm512_loadu_ps(acc + j), _mm512_loadu_ps(total + j));
    t = _mm512_fmadd_ps(_mm512_fnmadd_ps(_mm512_set1_ps(8.0f), scale, zero), _mm512_set1_ps(sum), t);
    _mm512_storeu_ps(total + j, t);
  }
#elif defined(__AVX2__) && defined(__FMA__)
  const __m256i top = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (; j + 8 <= block; j += 8) {
    const __m256i words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pair + 2 * j));
    const __m256 scale = _mm256_castsi256_ps(_mm256_slli_epi32(words, 16));
    const __m256 zero = _mm256_castsi256_ps(_mm256_and_si256(words, top));
    __m256 t = _mm256_fmadd_ps(scale, _mm256_loadu_ps(acc + j), _mm256_loadu_ps(total + j));
    t = _mm256_fmadd_ps(_mm256_fnmadd_ps(_mm256_set1_ps(8.0f), scale, zero), _mm256_set1_ps(sum), t);
    _mm256_storeu_ps(total + j, t);
  }
#endif
  for (; j < block; ++j) {
    const float scale = bf16_to_float(pair[2 * j]), zero = bf16_to_float(pair[2 * j + 1]);
    total[j] += scale * acc[j] + (zero - 8.0f * scale) * sum;
  }
}

// The row product for blocks of `block` outputs.
template <int64_t block>
void row_product_blocks(const float* row, const uint8_t* codes, const uint16_t* pairs, const float* sums,
                        int64_t in_features, int64_t out_features, int64_t groups, float* o) {
  const int64_t group = in_features / groups, blocks = out_features / block;
  at::parallel_for(0, blocks, 1, [&](int64_t first, int64_t last) {
    alignas(64) float total[block], acc[block];
    for (int64_t b = first; b < last; ++b) {
      std::fill(total, total + block, 0.0f);
      const uint8_t* bytes = codes + b * in_features * (block / 2);
      for (int64_t g = 0; g < groups; ++g) {
        sum_codes<block>(bytes + g * group * (block / 2), row + g * group, group, acc);
        add_group<block>(total, acc, pairs + (g * out_features + b * block) * 2, sums[g]);
      }
      std::memcpy(o + b * block, total, sizeof total);
    }
  });
}

// x (in,) float32 times the weights of unpack_int4_weight: (out,) float32. Blocks of 32 or 64 outputs.
at::Tensor int4_row_product(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales_and_zeros,
                            int64_t out_features, int64_t block) {
  TORCH_CHECK(block == 32 || block == MAX_BLOCK, "the row product takes blocks of 32 or 64 outputs, got ", block);
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  out_features > 0 && out_features % block == 0 && packed.numel() % (out_features / 2) == 0,
              "packed must be contiguous uint8 (out, in / 2) with out a multiple of ", block);
  const int64_t in_features = packed.numel() / (out_features / 2);
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && x.numel() == in_features,
              "x must be a contiguous float32 row of ", in_features, " inputs, got ", x.sizes());
  TORCH_CHECK(scales_and_zeros.scalar_type() == at::kBFloat16 && scales_and_zeros.dim() == 3 &&
                  scales_and_zeros.is_contiguous() && scales_and_zeros.size(1) == out_features &&
                  scales_and_zeros.size(2) == 2 && scales_and_zeros.size(0) > 0 &&
                  in_features % scales_and_zeros.size(0) == 0,
              "scales_and_zeros must be contiguous bf16 (in / group, out, 2), got ", scales_and_zeros.sizes());
  const int64_t groups = scales_and_zeros.size(0), group = in_features / groups;
  const float* row = x.data_ptr<float>();
  std::vector<float> sums(groups, 0.0f);  // sum of x over each group
  for (int64_t g = 0; g < groups; ++g) {
    for (int64_t k = g * group; k < (g + 1) * group; ++k) sums[g] += row[k];
  }
  at::Tensor out = at::empty({out_features}, x.options());
  const uint8_t* codes = packed.data_ptr<uint8_t>();
  const uint16_t* pairs = reinterpret_cast<const uint16_t*>(scales_and_zeros.data_ptr<at::BFloat16>());
  float* o = out.data_ptr<float>();
  if (block == 32) {
    row_product_blocks<32>(row, codes, pairs, sums.data(), in_features, out_features, groups, o);
  } else {
    row_product_blocks<MAX_BLOCK>(row, codes, pairs, sums.data(), in_features, out_features, groups, o);
  }
  return out;
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
constexpr int64_t Q8_GROUP = 32, Q8_OUTPUTS = 16;

// sum over a group of code * x code for 16 outputs (lane j: output j); quads = the group's 8 x 64 bytes
inline void q8_group_dots(const uint8_t* quads, const int8_t* xq, int32_t xq_sum, int32_t* dots) {
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
  // unsigned codes + 128 times signed x codes, 4 per lane; minus 128 * sum of x codes
  __m512i even = _mm512_setzero_si512(), odd = even;
  for (int64_t q = 0; q < Q8_GROUP / 4; q += 2) {
    int32_t x0, x1;
    std::memcpy(&x0, xq + 4 * q, 4);
    std::memcpy(&x1, xq + 4 * q + 4, 4);
    even = _mm512_dpbusd_epi32(even, _mm512_loadu_si512(quads + 64 * q), _mm512_set1_epi32(x0));
    odd = _mm512_dpbusd_epi32(odd, _mm512_loadu_si512(quads + 64 * q + 64), _mm512_set1_epi32(x1));
  }
  const __m512i sums = _mm512_sub_epi32(_mm512_add_epi32(even, odd), _mm512_set1_epi32(128 * xq_sum));
  _mm512_storeu_si512(dots, sums);
#elif defined(__AVX2__)
  // signed codes (code + 128 with its top bit flipped); |x code| times code with x's sign, pairs summed
  // in 16 bits (at most 2 * 127 * 127) and then in 32
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80)), ones = _mm256_set1_epi16(1);
  __m256i low = _mm256_setzero_si256(), high = low;  // outputs 0..7, 8..15
  for (int64_t q = 0; q < Q8_GROUP / 4; ++q) {
    int32_t word;
    std::memcpy(&word, xq + 4 * q, 4);
    const __m256i x = _mm256_set1_epi32(word), magnitude = _mm256_abs_epi8(x);
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
  for (int64_t j = 0; j < Q8_OUTPUTS; ++j) {
    int32_t sum = 0;
    for (int64_t k = 0; k < Q8_GROUP; ++k) {
      sum += (static_cast<int32_t>(quads[64 * (k / 4) + 4 * j + k % 4]) - 128) * xq[k];
    }
    dots[j] = sum;
  }
  (void)xq_sum;
#endif
}

at::Tensor q8_0_product(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales) {
  TORCH_CHECK(codes.device().is_cpu() && codes.scalar_type() == at::kByte && codes.dim() == 4 &&
                  codes.size(2) == Q8_OUTPUTS && codes.size(3) == 4 && codes.is_contiguous() &&
                  (codes.size(1) * 4) % Q8_GROUP == 0,
              "codes must be contiguous uint8 (out / 16, in / 4, 16, 4) with in a multiple of 32, got ",
              codes.sizes());
  const int64_t blocks = codes.size(0), in_features = codes.size(1) * 4, groups = in_features / Q8_GROUP;
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous() && x.size(1) == in_features,
              "x must be contiguous float32 rows of ", in_features, " inputs, got ", x.sizes());
  TORCH_CHECK(scales.scalar_type() == at::kBFloat16 && scales.is_contiguous() && scales.dim() == 3 &&
                  scales.size(0) == blocks && scales.size(1) == groups && scales.size(2) == Q8_OUTPUTS,
              "scales must be contiguous bf16 (out / 16, in / 32, 16), got ", scales.sizes());
  const int64_t rows = x.size(0), out_features = blocks * Q8_OUTPUTS;
  at::Tensor out = at::empty({rows, out_features}, x.options());
  std::vector<int8_t> xq(in_features);
  std::vector<float> x_scale(groups);
  std::vector<int32_t> xq_sum(groups);
  const uint8_t* c = codes.data_ptr<uint8_t>();
  const uint16_t* s = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::BFloat16>());
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = x.data_ptr<float>() + r * in_features;
    for (int64_t g = 0; g < groups; ++g) {
      float largest = 0.0f;
      for (int64_t k = g * Q8_GROUP; k < (g + 1) * Q8_GROUP; ++k) largest = std::max(largest, std::fabs(row[k]));
      const float scale = largest / 127.0f, safe = scale > 0.0f ? scale : 1.0f;
      int32_t sum = 0;
      for (int64_t k = g * Q8_GROUP; k < (g + 1) * Q8_GROUP; ++k) {
        xq[k] = static_cast<int8_t>(std::nearbyint(row[k] / safe));
        sum += xq[k];
      }
      x_scale[g] = scale;
      xq_sum[g] = sum;
    }
    float* o = out.data_ptr<float>() + r * out_features;
    at::parallel_for(0, blocks, 8, [&](int64_t first, int64_t last) {
      alignas(64) int32_t dots[Q8_OUTPUTS];
      for (int64_t b = first; b < last; ++b) {
#if defined(__AVX512F__)
        __m512 total = _mm512_setzero_ps();
        for (int64_t g = 0; g < groups; ++g) {
          q8_group_dots(c + (b * in_features + g * Q8_GROUP) * Q8_OUTPUTS, xq.data() + g * Q8_GROUP, xq_sum[g], dots);
          const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + (b * groups + g) * Q8_OUTPUTS));
          const __m512 scale = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
          total = _mm512_fmadd_ps(_mm512_mul_ps(scale, _mm512_set1_ps(x_scale[g])),
                                  _mm512_cvtepi32_ps(_mm512_load_si512(dots)), total);
        }
        _mm512_storeu_ps(o + b * Q8_OUTPUTS, total);
#else
        float total[Q8_OUTPUTS] = {};
        for (int64_t g = 0; g < groups; ++g) {
          q8_group_dots(c + (b * in_features + g * Q8_GROUP) * Q8_OUTPUTS, xq.data() + g * Q8_GROUP, xq_sum[g], dots);
          const uint16_t* scale = s + (b * groups + g) * Q8_OUTPUTS;
          for (int64_t j = 0; j < Q8_OUTPUTS; ++j) {
            total[j] += bf16_to_float(scale[j]) * x_scale[g] * static_cast<float>(dots[j]);
          }
        }
        std::memcpy(o + b * Q8_OUTPUTS, total, sizeof total);
#endif
      }
    });
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(semanticache, CPU, m) {
  m.impl("unpack_int4_weight", &unpack_int4_weight);
  m.impl("int4_row_product", &int4_row_product);
  m.impl("int8_row_product", &int8_row_product);
  m.impl("q8_0_product", &q8_0_product);
}
