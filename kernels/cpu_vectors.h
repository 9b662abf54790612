// Vectors of W float lanes for the CPU attention kernel (kernels/decode_attention_cpu.cpp) and the fp32 rows'
// product (kernels/fp32_weights_cpu.cpp): loads and stores, widening of codes, exp, lane reductions,
// half-precision conversion.
#pragma once

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace semanticache::cpu {

// One register of W float lanes (AVX-512: 16, otherwise 8), with GCC's vector extensions. Vectors wider
// than the machine's registers are split by GCC, and its shuffles and conversions of split vectors fall
// back to scalar code, so the width follows the target.
#if defined(__AVX512F__)
constexpr int64_t W = 16;
#else
constexpr int64_t W = 8;
#endif
using vf = float __attribute__((vector_size(4 * W)));
using vi = int32_t __attribute__((vector_size(4 * W)));
using vu = uint32_t __attribute__((vector_size(4 * W)));
using vh = uint16_t __attribute__((vector_size(2 * W)));
using vb = uint8_t __attribute__((vector_size(W)));          // W bytes: W 8-bit codes
using vb_half = uint8_t __attribute__((vector_size(W / 2)));  // W / 2 bytes: W 4-bit codes

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof v); }
// x in every lane: one broadcast (from memory where x is loaded: an embedded broadcast of a multiply-add);
// `vf{} + x` added 0 first, a scalar add before every broadcast
inline vf splat(float x) {
#if defined(__AVX512F__)
  return (vf)_mm512_set1_ps(x);
#elif defined(__AVX__)
  return (vf)_mm256_set1_ps(x);
#else
  vf v;
  for (int64_t k = 0; k < W; ++k) v[k] = x;
  return v;
#endif
}

// W bytes as W int32 lanes (GCC 12 turns the generic conversion into scalar code; x86 has it in one
// instruction)
inline vi widen(vb b) {
#if defined(__AVX512F__)
  return (vi)_mm512_cvtepu8_epi32((__m128i)b);
#elif defined(__AVX2__)
  return (vi)_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(std::bit_cast<int64_t>(b)));
#else
  return __builtin_convertvector(b, vi);
#endif
}

// exp(x) for x <= 0 (Cephes' expf polynomial, relative error ~1e-7); x below -87 (and -inf, the
// padding of ragged heads) gives exactly 0.
inline vf exp_nonpositive(vf x) {
  const vi underflow = x < -87.0f;
  x = underflow ? splat(-87.0f) : x;
  const vf magic = splat(12582912.0f);  // 1.5 * 2^23: adding and subtracting it rounds to an integer
  const vf n = (x * 1.44269504088896341f + magic) - magic;
  const vf r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  vf p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const vf y = p * r * r + r + 1.0f;
  const vf out = (vf)((vi)y + (__builtin_convertvector(n, vi) << 23));
  return underflow ? splat(0.0f) : out;
}

inline float exp_nonpositive(float x) { return exp_nonpositive(splat(x))[0]; }

// The largest lane and the lanes' sum: with AVX-512 by halving (4 dependent steps, not a chain of 15). The integer
// values' pass (attention_values_int.h) reduces 6 vectors for 3 query heads and 2 groups: in chains 1.4 ns a row,
// halving 1.0 (in L1).
inline float max_lane(vf v) {
#if defined(__AVX512F__)
  return _mm512_reduce_max_ps((__m512)v);
#else
  float top = v[0];
  for (int k = 1; k < W; ++k) top = std::max(top, v[k]);
  return top;
#endif
}

inline float sum_lanes(vf v) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps((__m512)v);
#else
  float total = 0.0f;
  for (int k = 0; k < W; ++k) total += v[k];
  return total;
#endif
}

// The lane sums of W vectors, as one vector (lane r: the sum of a[r]), by halving shuffles: each level
// adds the two halves of every block, packing two vectors' blocks into one.
#if defined(__AVX512F__)
inline __attribute__((always_inline)) vf reduce_lanes(const vf* a) {
  vf b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i) {
    b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  }
  for (int i = 0; i < 4; ++i) {
    c[i] = __builtin_shufflevector(b[2 * i], b[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(b[2 * i], b[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  }
  for (int i = 0; i < 2; ++i) {
    d[i] = __builtin_shufflevector(c[2 * i], c[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           __builtin_shufflevector(c[2 * i], c[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  }
  return __builtin_shufflevector(d[0], d[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(d[0], d[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}
#elif defined(__AVX__)
// AVX's in-lane pair sums (the generic shuffles below become cross-lane permutes and blends here, ~2x the
// instructions): per 128-bit half, two levels of hadd sum each vector's four lanes; the halves then add.
inline __attribute__((always_inline)) vf reduce_lanes(const vf* a) {
  const __m256 t0 = _mm256_hadd_ps((__m256)a[0], (__m256)a[1]), t1 = _mm256_hadd_ps((__m256)a[2], (__m256)a[3]);
  const __m256 t2 = _mm256_hadd_ps((__m256)a[4], (__m256)a[5]), t3 = _mm256_hadd_ps((__m256)a[6], (__m256)a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);  // lanes r, r + 4: a[r]'s halves' sums
  return (vf)_mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
#else
inline __attribute__((always_inline)) vf reduce_lanes(const vf* a) {
  vf b[4], c[2];
  for (int i = 0; i < 4; ++i) {
    b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
  }
  for (int i = 0; i < 2; ++i) {
    c[i] = __builtin_shufflevector(b[2 * i], b[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
           __builtin_shufflevector(b[2 * i], b[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15);
  }
  return __builtin_shufflevector(c[0], c[1], 0, 2, 4, 6, 8, 10, 12, 14) +
         __builtin_shufflevector(c[0], c[1], 1, 3, 5, 7, 9, 11, 13, 15);
}
#endif

// The index of the largest of x[0, n) (n >= 1), the first of equal ones, a NaN counting as the largest (the first
// NaN): torch.argmax's choice, a greedy step's next token. The largest by vectors, then its first place.
inline int64_t first_largest(const float* x, int64_t n) {
  vf top = splat(-INFINITY);
  vi unordered = vi{};
  int64_t i = 0;
  for (; i + W <= n; i += W) {
    const vf v = load(x + i);
    top = v > top ? v : top;
    unordered |= v != v;
  }
  float largest = max_lane(top);
  bool nan = false;
  for (int64_t k = 0; k < W; ++k) nan = nan || unordered[k] != 0;
  for (; i < n; ++i) {
    nan = nan || x[i] != x[i];
    largest = std::max(largest, x[i]);
  }
  for (int64_t j = 0; j < n; ++j)
    if (nan ? x[j] != x[j] : x[j] == largest) return j;
  return 0;
}

// IEEE half to float: F16C's conversion where there is one, otherwise integer and float operations
// (the conversion of Maratyszcza's FP16 library, which c10::Half also uses; exact for every input).
inline vf halves_to_floats(vh h) {
#if defined(__AVX512F__)
  return (vf)_mm512_cvtph_ps((__m256i)h);
#elif defined(__F16C__)
  return (vf)_mm256_cvtph_ps((__m128i)h);
#else
  const vu w = __builtin_convertvector(h, vu) << 16;
  const vu sign = w & 0x80000000u;
  const vu two_w = w + w;
  const vf normalized = (vf)((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
  const vf denormalized = (vf)((two_w >> 17) | (126u << 23)) - 0.5f;
  const vu magnitude = two_w < (1u << 27) ? (vu)denormalized : (vu)normalized;
  return (vf)(sign | magnitude);
#endif
}

inline float half_to_float(uint16_t h) {  // the same conversion, one value
  const uint32_t w = static_cast<uint32_t>(h) << 16;
  const uint32_t two_w = w + w;
  const float normalized = std::bit_cast<float>((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
  const float denormalized = std::bit_cast<float>((two_w >> 17) | (126u << 23)) - 0.5f;
  const uint32_t magnitude =
      two_w < (1u << 27) ? std::bit_cast<uint32_t>(denormalized) : std::bit_cast<uint32_t>(normalized);
  return std::bit_cast<float>((w & 0x80000000u) | magnitude);
}

}  // namespace semanticache::cpu
