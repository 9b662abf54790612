// One query token's attention over a stored document layer plus the appended tokens, on a CPU.
//
// The C++ twin of kernels/decode_attention_ref.py (same arguments, same result up to the rounding of
// reordered sums). The document's keys and values are read once, as they are stored (fp32, fp16 or
// bf16, or 8/4/3-bit group codes with fp16 scales and minimums), and decoded a vector at a time where they
// are used (with AVX-512; otherwise a pass of rows at a time into a tile that stays in L1), so no
// full-precision copy of a coded layer is ever built. Work is split flash-decoding
// style (Dao et al. 2023, https://pytorch.org/blog/flash-decoding/): each (kv head, block of entries)
// keeps a running maximum, sum and output (online softmax), and the blocks are merged by their
// log-sum-exp at the end. Grouped-query aware: each key row is read once for the G query heads that
// share it.
//
// Built on first use by kernels/decode_attention_cpu.py (torch.utils.cpp_extension), with
// -march=native; the operator's schema is defined there, in Python, so that TorchScript knows it
// even where no compiler is available.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include "cpu_ops.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t MAX_GROUP = 16;
constexpr int64_t ENTRIES_PER_TASK = 512;  // at most, one (kv head, block) task: ~130 KiB of fp32 keys at D = 64
constexpr int64_t MIN_ENTRIES_PER_TASK = 64;  // at least, where the document is split for the threads
constexpr int64_t ENTRIES_PER_PASS = 64;   // scores kept for one online-softmax update (a multiple of 16)
// how far ahead a pass asks for its rows: a pass of fp32 rows at D = 64 is 16 KiB, of 8-bit codes 4 KiB, and
// one pass ahead was close (4K tokens, int4 step: full cache 3-4% faster, Kaizen 0.75 the same; arithmetic unchanged)
constexpr int64_t PREFETCH_BYTES = 32768;

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
inline vf splat(float x) { return vf{} + x; }

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

inline float max_lane(vf v) {
  float top = v[0];
  for (int k = 1; k < W; ++k) top = std::max(top, v[k]);
  return top;
}

inline float sum_lanes(vf v) {
  float total = 0.0f;
  for (int k = 0; k < W; ++k) total += v[k];
  return total;
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

enum class Format { fp32, fp16, bf16, int8, int4, int3 };

// Channels [W c, W c + W) of a row of 16-bit floats, as floats.
template <bool BF16>
inline __attribute__((always_inline)) vf sixteen_bits(const uint8_t* raw, int64_t c) {
  vh h;
  std::memcpy(&h, raw + 2 * W * c, sizeof h);
  if constexpr (BF16) {
#if defined(__AVX512F__)
    return (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)h), 16);
#elif defined(__AVX2__)
    return (vf)_mm256_slli_epi32(_mm256_cvtepu16_epi32((__m128i)h), 16);
#else
    return (vf)(__builtin_convertvector(h, vu) << 16);
#endif
  } else {
    return halves_to_floats(h);
  }
}

// Channels [W c, W c + W) of a row's codes, as floats (widened to 32-bit lanes first: x86 has
// per-lane shifts and conversions for those, not for bytes).
template <Format F>
inline __attribute__((always_inline)) vf codes(const uint8_t* raw, int64_t c) {
  vi lanes;
  if constexpr (F == Format::int8) {
    vb b;
    std::memcpy(&b, raw + W * c, W);
    return __builtin_convertvector(widen(b), vf);
  } else if constexpr (F == Format::int4) {  // even channels in the low nibble: each byte twice, shifted by 0 and 4
    vb_half b;
    std::memcpy(&b, raw + W / 2 * c, W / 2);
#if defined(__AVX512F__)
    const vb pairs = __builtin_shufflevector(b, b, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
#else
    const vb pairs = __builtin_shufflevector(b, b, 0, 0, 1, 1, 2, 2, 3, 3);
#endif
    for (int64_t k = 0; k < W; ++k) lanes[k] = 4 * (k % 2);
    return __builtin_convertvector((widen(pairs) >> lanes) & 15, vf);
  } else {  // 3 bits: eight codes per three bytes (one 24-bit word), the first channel lowest
    const uint8_t* w = raw + 3 * W / 8 * c;
    const int32_t first = w[0] | (w[1] << 8) | (w[2] << 16);
#if defined(__AVX512F__)
    const int32_t second = w[3] | (w[4] << 8) | (w[5] << 16);
    const vi words = {first, first, first, first, first, first, first, first,
                      second, second, second, second, second, second, second, second};
#else
    const vi words = vi{} + first;
#endif
    for (int64_t k = 0; k < W; ++k) lanes[k] = 3 * (k % 8);
    lanes = words >> lanes;
    return __builtin_convertvector(lanes & 7, vf);
  }
}

// Keys or values of one layer as stored: rows (H, L, D) of `bits` bits (32: fp32, 16: fp16 or bf16,
// 8/4/3: group codes), read a tile of rows at a time.
struct Rows {
  const uint8_t* data = nullptr;
  int64_t head_stride = 0, row_stride = 0;  // bytes
  const uint16_t* scales = nullptr;
  const uint16_t* minimums = nullptr;
  int64_t scale_head_stride = 0, scale_row_stride = 0;  // elements
  int64_t groups = 1, group_width = 0;  // group_width: channels a group
  int64_t group_of_vector[256 / W] = {};  // the group of channels [W c, W c + W), where a group spans whole vectors
  Format format = Format::fp32;
  // 4-bit rows decoded 2 W channels at a time, in "paired" order: the block's even channels (low nibbles),
  // then its odd ones (high nibbles), with no shuffle; the kernel permutes the query the same way for keys
  // and its outputs back for values. Set where a group spans whole blocks.
  bool paired = false;

  // Rows [start, start + count) of `head` as a (count, D) fp32 tile: the data itself where it is
  // contiguous fp32, otherwise decoded into `tile` (codes: their scales and minimums converted first,
  // W at a time, into `factors`, count * groups each). The format is dispatched here, once per tile.
  template <int64_t D>
  const float* rows(int64_t head, int64_t start, int64_t count, float* tile, float* factors) const {
    const uint8_t* first = data + head * head_stride + start * row_stride;
    switch (format) {
      case Format::fp32:
        if (row_stride == D * 4) return reinterpret_cast<const float*>(first);
        return decode_rows<D, Format::fp32>(first, count, nullptr, nullptr, tile);
      case Format::fp16: return decode_rows<D, Format::fp16>(first, count, nullptr, nullptr, tile);
      case Format::bf16: return decode_rows<D, Format::bf16>(first, count, nullptr, nullptr, tile);
      default: break;
    }
    convert_factors(head, start, count, factors);
    const float* scale = factors;
    const float* minimum = factors + count * groups;
    switch (format) {
      case Format::int8: return decode_rows<D, Format::int8>(first, count, scale, minimum, tile);
      case Format::int4: return decode_rows<D, Format::int4>(first, count, scale, minimum, tile);
      default: return decode_rows<D, Format::int3>(first, count, scale, minimum, tile);
    }
  }

  // The scales and minimums of coded rows [start, start + count) of `head` as floats: factors[j * groups + g]
  // and factors[count * groups + j * groups + g] (converted W at a time where the tile's are contiguous).
  void convert_factors(int64_t head, int64_t start, int64_t count, float* factors) const {
    const int64_t offset = head * scale_head_stride + start * scale_row_stride, n = count * groups;
    float* scale = factors;
    float* minimum = factors + n;
    if (scale_row_stride == groups) {  // the tile's factors are contiguous
      int64_t i = 0;
      for (; i + W <= n; i += W) {
        vh s, m;
        std::memcpy(&s, scales + offset + i, sizeof s);
        std::memcpy(&m, minimums + offset + i, sizeof m);
        store(scale + i, halves_to_floats(s));
        store(minimum + i, halves_to_floats(m));
      }
      for (; i < n; ++i) {
        scale[i] = half_to_float(scales[offset + i]);
        minimum[i] = half_to_float(minimums[offset + i]);
      }
    } else {
      for (int64_t j = 0; j < count; ++j) {
        for (int64_t g = 0; g < groups; ++g) {
          scale[j * groups + g] = half_to_float(scales[offset + j * scale_row_stride + g]);
          minimum[j * groups + g] = half_to_float(minimums[offset + j * scale_row_stride + g]);
        }
      }
    }
  }

  // Whether the rows can be decoded a vector at a time where they are used (Decoded), rather than into a tile
  // first: 16-bit rows, and codes whose groups span whole vectors (AVX-512 only: with AVX2's 16 registers the
  // query heads' sums do not fit beside the query).
  bool decoded_in_registers() const {
    if (W != 16 || format == Format::fp32) return false;
    return format == Format::fp16 || format == Format::bf16 || group_width % W == 0;
  }

  // At the pass of rows from `start` (a task's rows [begin, end)), ask for the rows ~PREFETCH_BYTES ahead of
  // it (whole passes, 1 to 16): at the first pass, every pass up to there; then the pass that far ahead.
  void prefetch_ahead(int64_t head, int64_t start, int64_t begin, int64_t end) const {
    const int64_t passes = std::clamp<int64_t>(PREFETCH_BYTES / (ENTRIES_PER_PASS * row_stride), 1, 16);
    for (int64_t ahead = start == begin ? 1 : passes; ahead <= passes; ++ahead) {
      const int64_t at = start + ahead * ENTRIES_PER_PASS;
      if (at >= end) break;
      prefetch(head, at, std::min(ENTRIES_PER_PASS, end - at));
    }
  }

  // Ask for rows [start, start + count) of `head` (and their scales and minimums) to be cached.
  void prefetch(int64_t head, int64_t start, int64_t count) const {
    const uint8_t* first = data + head * head_stride + start * row_stride;
    const int64_t bytes = count * row_stride;
    for (int64_t at = 0; at < bytes; at += 64) __builtin_prefetch(first + at);
    if (scales == nullptr) return;
    const int64_t offset = head * scale_head_stride + start * scale_row_stride, factor_bytes = count * scale_row_stride * 2;
    for (int64_t at = 0; at < factor_bytes; at += 64) {
      __builtin_prefetch(reinterpret_cast<const uint8_t*>(scales + offset) + at);
      __builtin_prefetch(reinterpret_cast<const uint8_t*>(minimums + offset) + at);
    }
  }

  // `count` rows as (count, D) floats: fp32 copied, 16-bit converted, codes times their group's scale
  // plus its minimum (the two roundings of decode_groups_into).
  template <int64_t D, Format F>
  const float* decode_rows(const uint8_t* first, int64_t count, const float* scale, const float* minimum,
                           float* tile) const {
    constexpr int64_t C = D / W;
    const int64_t width = D / groups;
    for (int64_t j = 0; j < count; ++j) {
      const uint8_t* raw = first + j * row_stride;
      float* out = tile + j * D;
      if constexpr (F == Format::fp32) {
        std::memcpy(out, raw, D * 4);
      } else if constexpr (F == Format::fp16 || F == Format::bf16) {
        for (int64_t c = 0; c < C; ++c) store(out + W * c, sixteen_bits<F == Format::bf16>(raw, c));
      } else if (F == Format::int4 && paired) {
        const float* row_scale = scale + j * groups;
        const float* row_minimum = minimum + j * groups;
        for (int64_t c = 0; c < C; c += 2) {  // W bytes: channels [W c, W c + 2 W)
          vb b;
          std::memcpy(&b, raw + W / 2 * c, W);
          const vi lanes = widen(b);
          const int64_t g = group_of_vector[c];
          store(out + W * c, __builtin_convertvector(lanes & 15, vf) * row_scale[g] + row_minimum[g]);
          store(out + W * (c + 1), __builtin_convertvector(lanes >> 4, vf) * row_scale[g] + row_minimum[g]);
        }
      } else if (width % W == 0) {
        const float* row_scale = scale + j * groups;
        const float* row_minimum = minimum + j * groups;
        for (int64_t c = 0; c < C; ++c) {
          const int64_t g = group_of_vector[c];
          store(out + W * c, codes<F>(raw, c) * row_scale[g] + row_minimum[g]);
        }
      } else {  // groups narrower than a vector
        for (int64_t c = 0; c < C; ++c) store(out + W * c, codes<F>(raw, c));
        for (int64_t d = 0; d < D; ++d) out[d] = out[d] * scale[j * groups + d / width] + minimum[j * groups + d / width];
      }
    }
    return tile;
  }
};

Rows plain_rows(const at::Tensor& t) {  // (H, L, D), or (1, H, L, D) (the appended buffers as a step holds them)
  TORCH_CHECK((t.dim() == 3 || (t.dim() == 4 && t.size(0) == 1)) && t.stride(-1) == 1,
              "rows must be (H, L, D) with contiguous D, got ", t.sizes(), " strides ", t.strides());
  Rows rows;
  rows.data = static_cast<const uint8_t*>(t.data_ptr());
  rows.head_stride = t.stride(-3) * t.element_size();
  rows.row_stride = t.stride(-2) * t.element_size();
  if (t.scalar_type() == at::kFloat) {
    rows.format = Format::fp32;
  } else {
    TORCH_CHECK(t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16,
                "plain rows must be float32, float16 or bfloat16, got ", t.scalar_type());
    rows.format = t.scalar_type() == at::kBFloat16 ? Format::bf16 : Format::fp16;
  }
  return rows;
}

Rows stored_rows(const at::Tensor& data, const std::optional<at::Tensor>& scales,
                 const std::optional<at::Tensor>& minimums, int64_t bits, int64_t dim) {
  if (bits == 32 || bits == 16) {
    Rows rows = plain_rows(data);
    TORCH_CHECK((rows.format == Format::fp32) == (bits == 32), "bits=", bits, " but the rows are ", data.scalar_type());
    TORCH_CHECK(data.size(2) == dim, "rows of ", data.size(2), " channels, the query has ", dim);
    return rows;
  }
  TORCH_CHECK(bits == 8 || bits == 4 || bits == 3, "bits must be 32, 16, 8, 4 or 3, got ", bits);
  TORCH_CHECK(data.scalar_type() == at::kByte && data.dim() == 3 && data.stride(2) == 1,
              "codes must be (H, L, D * bits / 8) uint8 with contiguous rows");
  TORCH_CHECK(data.size(2) * 8 == dim * bits, "codes of ", data.size(2), " bytes per row do not hold ", dim,
              " channels of ", bits, " bits");
  TORCH_CHECK(scales.has_value() && minimums.has_value(), "codes need their scales and minimums");
  const at::Tensor& s = *scales;
  const at::Tensor& m = *minimums;
  TORCH_CHECK(s.scalar_type() == at::kHalf && m.scalar_type() == at::kHalf && s.dim() == 3 &&
                  s.sizes() == m.sizes() && s.strides() == m.strides() && s.stride(2) == 1,
              "scales and minimums must be (H, L, groups) float16 with the same layout");
  TORCH_CHECK(s.size(0) == data.size(0) && s.size(1) == data.size(1), "scales of shape ", s.sizes(),
              " for codes of shape ", data.sizes());
  TORCH_CHECK(s.size(2) > 0 && dim % s.size(2) == 0, "groups must divide ", dim, " channels");
  Rows rows;
  rows.data = static_cast<const uint8_t*>(data.data_ptr());
  rows.head_stride = data.stride(0);
  rows.row_stride = data.stride(1);
  rows.scales = static_cast<const uint16_t*>(s.data_ptr());
  rows.minimums = static_cast<const uint16_t*>(m.data_ptr());
  rows.scale_head_stride = s.stride(0);
  rows.scale_row_stride = s.stride(1);
  rows.groups = s.size(2);
  rows.group_width = dim / rows.groups;
  for (int64_t c = 0; c < dim / W; ++c) rows.group_of_vector[c] = W * c / rows.group_width;
  rows.format = bits == 8 ? Format::int8 : bits == 4 ? Format::int4 : Format::int3;
  rows.paired = bits == 4 && dim % (2 * W) == 0 && rows.group_width % (2 * W) == 0;
  return rows;
}

// Where a pass's rows are read from, a vector (channels [W c, W c + W) of row j) at a time: a tile of fp32 rows
// (stored so, or decoded into it first), or the stored rows decoded where they are used, with the arithmetic
// of Rows::decode_rows (the same values, bit for bit), so that no decoded tile is stored and loaded again.
template <int64_t D>
struct Tile {
  const float* rows;
  vf operator()(int64_t j, int64_t c) const { return load(rows + j * D + W * c); }
};

template <Format F, bool PAIRED>
struct Decoded {
  const uint8_t* first;
  int64_t row_stride, groups;
  const float* scale;    // (count, groups), from Rows::convert_factors
  const float* minimum;  // (count, groups)
  const int64_t* group_of_vector;
  inline __attribute__((always_inline)) vf operator()(int64_t j, int64_t c) const {
    const uint8_t* raw = first + j * row_stride;
    if constexpr (F == Format::fp16 || F == Format::bf16) {
      return sixteen_bits<F == Format::bf16>(raw, c);
    } else {
      const int64_t g = group_of_vector[PAIRED ? c & ~int64_t{1} : c];
      const float s = scale[j * groups + g], m = minimum[j * groups + g];
      if constexpr (PAIRED) {  // vectors c and c + 1 (c even): the low and high nibbles of the same W bytes
        vb b;
        std::memcpy(&b, raw + W / 2 * (c & ~int64_t{1}), W);
        const vi lanes = widen(b);
        return __builtin_convertvector(c % 2 == 0 ? lanes & 15 : lanes >> 4, vf) * s + m;
      } else {
        return codes<F>(raw, c) * s + m;
      }
    }
  }
};

// Rows [start, start + count) of `head` as a source for `body`: decoded where they are used where they can be
// (Rows::decoded_in_registers), otherwise as a tile. The format is dispatched here, once per pass.
template <int64_t D, class Body>
inline void with_rows(const Rows& rows, int64_t head, int64_t start, int64_t count, float* tile, float* factors,
                      Body&& body) {
  if (!rows.decoded_in_registers()) return body(Tile<D>{rows.rows<D>(head, start, count, tile, factors)});
  const uint8_t* first = rows.data + head * rows.head_stride + start * rows.row_stride;
  if (rows.format != Format::fp16 && rows.format != Format::bf16) rows.convert_factors(head, start, count, factors);
  const float* minimum = factors + count * rows.groups;
  const auto decoded = [&]<Format F, bool PAIRED>() {
    return Decoded<F, PAIRED>{first, rows.row_stride, rows.groups, factors, minimum, rows.group_of_vector};
  };
  switch (rows.format) {
    case Format::fp16: return body(decoded.template operator()<Format::fp16, false>());
    case Format::bf16: return body(decoded.template operator()<Format::bf16, false>());
    case Format::int8: return body(decoded.template operator()<Format::int8, false>());
    case Format::int4:
      if (rows.paired) return body(decoded.template operator()<Format::int4, true>());
      return body(decoded.template operator()<Format::int4, false>());
    default: return body(decoded.template operator()<Format::int3, false>());
  }
}

// The running state of one task: per query head the maximum logit, the sum of exp and the output.
struct Partial {
  float* maximum;  // (G)
  float* total;    // (G)
  float* out;      // (G, D)
};

// Scores of rows [0, n) of a (n, D) tile (n <= W) for one query (C vectors), plus the bias. FULL: n == W,
// with no test per row: GCC kept the `r < n` test as a branch before every multiply-add, and that one loop
// made the fp32 kernel stream at ~60% of the copy bandwidth (4K tokens, 30 layers: 9.5 -> 6.3 ms).
template <int64_t D, bool FULL>
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
      for (int64_t r = 0; r < ROWS; ++r)
        if (FULL || r0 + r < n) part[r] += q * load(tile + (r0 + r) * D + W * c);
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

// Online-softmax update of `partial` with entries [begin, end) of `keys`/`values` (one kv head), in
// passes of ENTRIES_PER_PASS: the pass's keys scored for the G query heads, the running maximum and sum, then
// its values added into the G outputs, kept in registers. DECODED: coded or 16-bit rows are decoded a
// vector at a time where they are used (with_rows), each key vector once for KEY_GROUP_BLOCK query heads;
// otherwise (fp32 rows, AVX2) a tile of rows is read (or decoded first) and scored one query head at a
// time. Storing a decoded tile and loading it again for each head made 8-bit rows ~1.4x slower (4K tokens,
// 30 layers: 6.1 -> 4.4 ms); fp32 rows keep the tile loop, which the decoded one slowed by ~10%.
template <int64_t D, bool DECODED>
void attend_rows(const float* query, int64_t group, const Rows& keys, const Rows& values, const float* bias,
                 int64_t head, int64_t begin, int64_t end, Partial partial) {
  constexpr int64_t C = D / W, SLICES = ENTRIES_PER_PASS / W;
  alignas(64) float scores[MAX_GROUP][ENTRIES_PER_PASS];
  alignas(64) float tile[ENTRIES_PER_PASS * D];
  alignas(64) float factors[ENTRIES_PER_PASS * D];  // scales and minimums of coded rows (at most D / 2 groups)
  alignas(64) float paired_query[MAX_GROUP * D];
  if (keys.paired) {  // keys decoded in paired order meet a query in that order: the same dot products
    std::copy(query, query + group * D, paired_query);
    pair_channels<D>(paired_query, group, false);
    query = paired_query;
  }
  if (values.paired) pair_channels<D>(partial.out, group, false);  // summed in the values' order, put back below
  vf q[MAX_GROUP][C];
  for (int64_t g = 0; g < group; ++g)
    for (int64_t c = 0; c < C; ++c) q[g][c] = load(query + g * D + W * c);
  for (int64_t start = begin; start < end; start += ENTRIES_PER_PASS) {
    const int64_t count = std::min(ENTRIES_PER_PASS, end - start), slices = (count + W - 1) / W;
    keys.prefetch_ahead(head, start, begin, end);
    values.prefetch_ahead(head, start, begin, end);
    // -- scores of the pass, W rows at a time (padding lanes -inf)
    if constexpr (DECODED) {  // KEY_GROUP_BLOCK query heads at a time
      with_rows<D>(keys, head, start, count, tile, factors, [&](auto key) {
        constexpr int64_t GB = KEY_GROUP_BLOCK;
        for (int64_t g = 0; g < group; g += GB) {
          const int64_t heads = std::min(GB, group - g);
          for (int64_t s = 0; s < slices; ++s) {
            const int64_t n = std::min<int64_t>(W, count - W * s);
            const float* row_bias = bias == nullptr ? nullptr : bias + start + W * s;
            vf sums[GB];
            if (heads == GB) {
              if (n == W) scores_of_decoded_rows<D, true, GB>(q + g, key, W * s, n, row_bias, sums);
              else scores_of_decoded_rows<D, false, GB>(q + g, key, W * s, n, row_bias, sums);
            } else {  // the last heads, one at a time
              for (int64_t b = 0; b < heads; ++b)
                scores_of_decoded_rows<D, false, 1>(q + g + b, key, W * s, n, row_bias, sums + b);
            }
            for (int64_t b = 0; b < heads; ++b) {
              for (int64_t r = n; r < W; ++r) sums[b][r] = -INFINITY;
              store(scores[g + b] + W * s, sums[b]);
            }
          }
        }
      });
    } else {  // one query head at a time, from a tile
      const float* key = keys.rows<D>(head, start, count, tile, factors);
      for (int64_t g = 0; g < group; ++g) {
        for (int64_t s = 0; s < slices; ++s) {
          const int64_t n = std::min<int64_t>(W, count - W * s);
          const float* row_bias = bias == nullptr ? nullptr : bias + start + W * s;
          vf sums = n == W ? scores_of_rows<D, true>(q[g], key + W * s * D, n, row_bias)
                           : scores_of_rows<D, false>(q[g], key + W * s * D, n, row_bias);
          for (int64_t r = n; r < W; ++r) sums[r] = -INFINITY;
          store(scores[g] + W * s, sums);
        }
      }
    }
    // -- new maximum and sum; scores become weights, the outputs so far are rescaled
    float rescale[MAX_GROUP];
    for (int64_t g = 0; g < group; ++g) {
      vf top = splat(partial.maximum[g]);
      for (int64_t s = 0; s < slices; ++s) {
        const vf x = load(scores[g] + W * s);
        top = x > top ? x : top;
      }
      const float maximum = max_lane(top);
      if (maximum == -INFINITY) {  // every entry so far is padding: weights 0, nothing to rescale
        std::fill(scores[g], scores[g] + SLICES * W, 0.0f);
        rescale[g] = 1.0f;
        continue;
      }
      vf total = vf{};
      for (int64_t s = 0; s < slices; ++s) {
        const vf weights = exp_nonpositive(load(scores[g] + W * s) - maximum);
        store(scores[g] + W * s, weights);
        total += weights;
      }
      rescale[g] = exp_nonpositive(partial.maximum[g] - maximum);
      partial.total[g] = partial.total[g] * rescale[g] + sum_lanes(total);
      partial.maximum[g] = maximum;
    }
    // -- weighted values, GROUP_BLOCK query heads and VALUE_BLOCK channel vectors at a time
    const auto add_pass_values = [&](const auto& value) {
      constexpr int64_t CB = std::min(C, VALUE_BLOCK);
      for (int64_t g = 0; g < group; g += GROUP_BLOCK) {
        for (int64_t c = 0; c < C; c += CB) {
          float* out = partial.out + g * D + W * c;
          switch (std::min(GROUP_BLOCK, group - g)) {
            case 1: add_values<D, 1, CB>(value, count, scores + g, rescale + g, out, c); break;
            case 2: add_values<D, 2, CB>(value, count, scores + g, rescale + g, out, c); break;
#if GROUP_BLOCK_SIZE > 3
            case 3: add_values<D, 3, CB>(value, count, scores + g, rescale + g, out, c); break;
            default: add_values<D, 4, CB>(value, count, scores + g, rescale + g, out, c);
#else
            default: add_values<D, 3, CB>(value, count, scores + g, rescale + g, out, c);
#endif
          }
        }
      }
    };
    if constexpr (DECODED) {
      with_rows<D>(values, head, start, count, tile, factors, add_pass_values);
    } else {
      add_pass_values(Tile<D>{values.rows<D>(head, start, count, tile, factors)});
    }
  }
  if (values.paired) pair_channels<D>(partial.out, group, true);
}

template <bool DECODED>
void attend_dim(int64_t dim, const float* query, int64_t group, const Rows& keys, const Rows& values,
                const float* bias, int64_t head, int64_t begin, int64_t end, Partial partial) {
  switch (dim) {
    case 16: return attend_rows<16, DECODED>(query, group, keys, values, bias, head, begin, end, partial);
    case 32: return attend_rows<32, DECODED>(query, group, keys, values, bias, head, begin, end, partial);
    case 64: return attend_rows<64, DECODED>(query, group, keys, values, bias, head, begin, end, partial);
    case 128: return attend_rows<128, DECODED>(query, group, keys, values, bias, head, begin, end, partial);
    default: return attend_rows<256, DECODED>(query, group, keys, values, bias, head, begin, end, partial);
  }
}

void attend(int64_t dim, const float* query, int64_t group, const Rows& keys, const Rows& values, const float* bias,
            int64_t head, int64_t begin, int64_t end, Partial partial) {
  if (keys.decoded_in_registers() || values.decoded_in_registers())
    return attend_dim<true>(dim, query, group, keys, values, bias, head, begin, end, partial);
  return attend_dim<false>(dim, query, group, keys, values, bias, head, begin, end, partial);
}

}  // namespace

// The tasks of one token's attention: per head, blocks of the document, then one block of appended tokens,
// each with its running state (per query head the maximum, the sum and the output: G * (D + 2) floats).
struct semanticache::AttentionTasks::Plan {
  Rows doc_keys, doc_values, tail_keys, tail_values;
  const float* bias = nullptr;
  int64_t bias_stride = 0, heads = 0, group = 0, dim = 0, length = 0, appended = 0;
  int64_t entries = 0, doc_blocks = 0, blocks = 0, count = 0, width = 0;
  std::vector<float> state;
  std::atomic<int64_t> next{0};
};

semanticache::AttentionTasks::AttentionTasks(int64_t group, int64_t dim, const at::Tensor& keys,
                                             const std::optional<at::Tensor>& key_scales,
                                             const std::optional<at::Tensor>& key_minimums, int64_t key_bits,
                                             const at::Tensor& values, const std::optional<at::Tensor>& value_scales,
                                             const std::optional<at::Tensor>& value_minimums, int64_t value_bits,
                                             const std::optional<at::Tensor>& bias, int64_t threads)
    : plan(std::make_unique<Plan>()) {
  TORCH_CHECK(dim == 16 || dim == 32 || dim == 64 || dim == 128 || dim == 256,
              "head dim must be 16, 32, 64, 128 or 256, got ", dim);
  TORCH_CHECK(group >= 1 && group <= MAX_GROUP, "1 to ", MAX_GROUP, " query heads per kv head, got ", group);
  const int64_t heads = keys.size(0), length = keys.size(1);
  TORCH_CHECK(values.size(0) == heads && values.size(1) == length,
              "document keys and values must be (H_kv, L, ...) with H_kv = ", heads);
  Plan& p = *plan;
  p.doc_keys = stored_rows(keys, key_scales, key_minimums, key_bits, dim);
  p.doc_values = stored_rows(values, value_scales, value_minimums, value_bits, dim);
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->dim() == 2 && bias->size(0) == heads &&
                    bias->size(1) == length && bias->stride(1) == 1,
                "bias must be (H_kv, L) float32 with contiguous rows");
    p.bias = bias->data_ptr<float>();
    p.bias_stride = bias->stride(0);
  }
  // At most ENTRIES_PER_TASK entries a block, and at least two blocks for each thread where the document
  // has MIN_ENTRIES_PER_TASK entries for each: a compressed document's 200-500 entries a head in one block
  // each left one of 2 threads with two of 3 heads' blocks (the blocks' bounds depend on the thread
  // count, and so does the rounding of the merged result).
  const int64_t wanted = std::max((length + ENTRIES_PER_TASK - 1) / ENTRIES_PER_TASK, (2 * threads + heads - 1) / heads);
  const int64_t per_head = std::max<int64_t>(1, std::min(wanted, length / MIN_ENTRIES_PER_TASK));
  p.entries = std::max<int64_t>(1, (length + per_head - 1) / per_head);
  p.doc_blocks = (length + p.entries - 1) / p.entries;
  p.blocks = p.doc_blocks + 1;
  p.count = heads * p.blocks;
  p.width = group * (dim + 2);
  p.heads = heads, p.group = group, p.dim = dim, p.length = length;
  p.state.resize(p.count * p.width);
}

void semanticache::AttentionTasks::bind(const at::Tensor& new_keys, const at::Tensor& new_values, int64_t appended) {
  Plan& p = *plan;
  TORCH_CHECK(new_keys.scalar_type() == at::kFloat && new_values.scalar_type() == at::kFloat && new_keys.dim() >= 3 &&
                  new_keys.sizes() == new_values.sizes() && new_keys.size(-3) == p.heads &&
                  new_keys.size(-1) == p.dim && appended >= 0 && appended <= new_keys.size(-2),
              "appended keys and values must be (H_kv, >= ", appended, ", D) float32");
  p.tail_keys = plain_rows(new_keys);
  p.tail_values = plain_rows(new_values);
  p.appended = appended;
  p.next = 0;
}

semanticache::AttentionTasks::AttentionTasks(AttentionTasks&&) noexcept = default;
semanticache::AttentionTasks::~AttentionTasks() = default;

int64_t semanticache::AttentionTasks::tasks() const { return plan->count; }

// Tasks go in turn, the document's blocks first (the appended tokens' are small), so that no thread waits
// while another still has two blocks.
int64_t semanticache::AttentionTasks::next() { return plan->next++; }

void semanticache::AttentionTasks::run(int64_t order, const float* query) {
  const Plan& p = *plan;
  const int64_t head = order < p.heads * p.doc_blocks ? order / p.doc_blocks : order - p.heads * p.doc_blocks;
  const int64_t block = order < p.heads * p.doc_blocks ? order % p.doc_blocks : p.doc_blocks;
  float* base = plan->state.data() + (head * p.blocks + block) * p.width;
  Partial partial{base, base + p.group, base + 2 * p.group};
  std::fill(partial.maximum, partial.maximum + p.group, -INFINITY);
  std::fill(partial.total, partial.total + p.group * (p.dim + 1), 0.0f);
  const float* head_query = query + head * p.group * p.dim;
  if (block < p.doc_blocks) {
    const int64_t begin = block * p.entries, end = std::min(p.length, begin + p.entries);
    const float* head_bias = p.bias == nullptr ? nullptr : p.bias + head * p.bias_stride;
    attend(p.dim, head_query, p.group, p.doc_keys, p.doc_values, head_bias, head, begin, end, partial);
  } else {
    attend(p.dim, head_query, p.group, p.tail_keys, p.tail_values, nullptr, head, 0, p.appended, partial);
  }
}

// -- merge the blocks of each head by their log-sum-exp, into out (H_kv, G, D)
void semanticache::AttentionTasks::merge(float* out) const {
  const Plan& p = *plan;
  const int64_t group = p.group, dim = p.dim, blocks = p.blocks, width = p.width;
  std::fill(out, out + p.heads * group * dim, 0.0f);
  for (int64_t head = 0; head < p.heads; ++head) {
    for (int64_t g = 0; g < group; ++g) {
      float top = -INFINITY;
      for (int64_t b = 0; b < blocks; ++b) top = std::max(top, p.state[(head * blocks + b) * width + g]);
      float total = 0.0f;
      float* target = out + (head * group + g) * dim;
      for (int64_t b = 0; b < blocks; ++b) {
        const float* base = p.state.data() + (head * blocks + b) * width;
        if (base[g] == -INFINITY) continue;
        const float weight = std::exp(base[g] - top);
        total += weight * base[group + g];
        const float* part = base + 2 * group + g * dim;
        for (int64_t d = 0; d < dim; ++d) target[d] += weight * part[d];
      }
      for (int64_t d = 0; d < dim; ++d) target[d] /= total;
    }
  }
}

at::Tensor semanticache::decode_attention(const at::Tensor& query, const at::Tensor& keys, const std::optional<at::Tensor>& key_scales,
                            const std::optional<at::Tensor>& key_minimums, int64_t key_bits, const at::Tensor& values,
                            const std::optional<at::Tensor>& value_scales,
                            const std::optional<at::Tensor>& value_minimums, int64_t value_bits,
                            const std::optional<at::Tensor>& bias, const at::Tensor& new_keys,
                            const at::Tensor& new_values) {
  TORCH_CHECK(query.device().is_cpu() && query.scalar_type() == at::kFloat && query.dim() == 3 &&
                  query.is_contiguous(),
              "query must be a contiguous (H_kv, G, D) float32 CPU tensor, got ", query.sizes());
  TORCH_CHECK(keys.dim() == 3 && keys.size(0) == query.size(0), "document keys must be (H_kv, L, ...) with H_kv = ",
              query.size(0));
  const int64_t threads = at::get_num_threads();
  AttentionTasks attention(query.size(1), query.size(2), keys, key_scales, key_minimums, key_bits, values, value_scales,
                           value_minimums, value_bits, bias, threads);
  attention.bind(new_keys, new_values, new_keys.size(1));
  const float* q = query.data_ptr<float>();
  at::parallel_for(0, std::min(threads, attention.tasks()), 1, [&](int64_t, int64_t) {
    for (int64_t task = attention.next(); task < attention.tasks(); task = attention.next()) attention.run(task, q);
  });
  at::Tensor out = at::empty_like(query);
  attention.merge(out.data_ptr<float>());
  return out;
}


TORCH_LIBRARY_IMPL(semanticache, CPU, m) { m.impl("decode_attention", &semanticache::decode_attention); }
