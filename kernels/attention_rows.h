// Stored keys and values as the CPU attention kernel (kernels/decode_attention_cpu.cpp, which alone includes
// this) reads them: rows of fp32, fp16/bf16 or 8/4/3-bit group codes with fp16 scales and minimums, as a tile
// of fp32 rows or decoded a vector at a time where they are used.
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>

#include "cpu_vectors.h"

namespace semanticache::cpu {

constexpr int64_t ENTRIES_PER_PASS = 64;   // scores kept for one online-softmax update (a multiple of 16)
// How far ahead of the row it reads a loop asks for coded rows (and the pass for their scales and minimums): a line
// at a time as the rows are read, not a pass at a time in a burst. From memory the burst (32 KiB ahead) was no
// faster than no prefetch at all; spread out so, the kernel at 7K tokens (30 layers, 2 threads, the builds
// alternating in one process) read 8-bit rows 14-28% faster and 4-bit 7-8% (32 rows ahead the same, 128 worse
// for 8-bit), and the Kaizen 0.75 int4 step took 13.70 / 14.26 -> 12.15 / 11.80 ms at 7K tokens, 7.99 -> 7.50 ms
// at 4K. 16-bit rows were 2-12% slower so on Zen 4 when these requests went into L1; into L2, on an Intel Xeon
// with AVX-512 and AMX, they are 0.70-0.76x of the burst at 4K / 7K tokens (fp16 5.34 / 10.42 -> 3.76 / 7.67 ms,
// bf16 5.43 / 10.80 -> 3.87 / 8.15; 2K 0.97x, in L1 1.00x) and are asked for so too (Zen 4 not measured again).
// Rows decoded into a tile keep the burst (prefetch_ahead).
// fp32 rows read where they are stored (Rows::streamed) are asked for so too, a line per vector read (the
// first query head's scores and the values), into L2: on an Intel Xeon with AVX-512 and AMX (2 threads,
// 30 layers, the builds alternating in one process) the kernel took 3.26 / 9.21 / 16.44 -> 2.62 / 8.01 / 14.62
// ms at 2K / 4K / 7K tokens (0.80 / 0.87 / 0.89x), its arithmetic in L1 ~10-15% more; 32, 128 or 256 rows
// ahead 0.87-0.92x, keys alone 0.98x, values alone 0.92-0.96x.
constexpr int64_t PREFETCH_ROWS = 64;

// Ask for the line of the fp32 row PREFETCH_ROWS rows after `at` (a vector of a row read in place), into L2:
// once a line (AVX2's vectors are half a line).
inline __attribute__((always_inline)) void prefetch_vector_ahead(const float* at, int64_t dim, int64_t c) {
  if ((W * c) % 16 == 0) __builtin_prefetch(at + PREFETCH_ROWS * dim, 0, 2);
}

// Where bytes [BYTES * index, BYTES * (index + 1)) of a row (read BYTES at a time, index a constant where unrolled)
// start in a new line of the row: ask for that line of the row PREFETCH_ROWS rows after the one at `raw`, into
// L2 (prefetcht1), not L1, whose few miss buffers the requests otherwise hold. With values weighted in integers
// (attention_values_int.h) a pass asks for its rows' lines in ~150 ns; into L1, that kernel read 8-bit rows at 7K
// tokens from memory slower than the float kernel before it (6.74 against 5.59 ms: 30 layers, 2 threads, q8 on,
// the builds alternating in one process); into L2, faster: 5.23 against 6.35 ms (4-bit: 3.98 against 4.63). With
// q8 off (float arithmetic) L1 or L2 made no difference beyond noise (7.53 and 7.36 ms).
template <int64_t BYTES>
inline __attribute__((always_inline)) void prefetch_row_ahead(const uint8_t* raw, int64_t row_stride, int64_t index) {
  const int64_t offset = BYTES * index;
  if (index == 0 || offset / 64 != (offset - BYTES) / 64)
    __builtin_prefetch(raw + PREFETCH_ROWS * row_stride + offset / 64 * 64, 0, 2);
}

// how far ahead prefetch_ahead asks for a pass's rows: a pass of fp32 rows at D = 64 is 16 KiB, and one pass ahead
// was close (4K tokens: full cache 3-4% faster)
constexpr int64_t PREFETCH_BYTES = 32768;

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

  // Whether rows are fp32 read where they are stored (no tile): the kernel asks for them a line at a time as it
  // reads them (Streamed), PREFETCH_ROWS rows ahead, rather than a pass at a time with prefetch_ahead.
  bool streamed(int64_t dim) const { return format == Format::fp32 && row_stride == dim * 4; }

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
    prefetch_factors(offset, count);
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

  // Where the kernel asks for rows as it reads them: the factors of the rows PREFETCH_ROWS on from those at
  // `offset`, a line (32) at a time.
  void prefetch_factors(int64_t offset, int64_t count) const {
    if (!decoded_in_registers()) return;  // coded rows whose codes are asked for as they are read
    const int64_t ahead = offset + PREFETCH_ROWS * scale_row_stride;
    for (int64_t at = 0; at < count * scale_row_stride; at += 32) {
      __builtin_prefetch(scales + ahead + at);
      __builtin_prefetch(minimums + ahead + at);
    }
  }

#if defined(__AVX512F__)
  // W rows' factors of two groups, interleaved in a then b (row-major), to[0, W) group 0's, to[ENTRIES_PER_PASS + 0,
  // ENTRIES_PER_PASS + W) group 1's: the even and the odd lanes.
  static void split_two_groups(vf a, vf b, float* to) {
    store(to, __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30));
    store(to + ENTRIES_PER_PASS,
          __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31));
  }
#endif

  // The same, group-major: out[g * ENTRIES_PER_PASS + j] the scales, out[(groups + g) * ENTRIES_PER_PASS + j] the
  // minimums (the integer scores' and values' layout: a vector holds W rows' factors of one group), through
  // `scratch`. Two groups a row (D = 64 in groups of 32) and whole vectors of rows: converted and split into
  // even and odd lanes in registers (the same values), not stored in row order and loaded again: in L1 0.45 ->
  // 0.2 ns a row.
  void group_major_factors(int64_t head, int64_t start, int64_t count, float* scratch, float* out) const {
#if defined(__AVX512F__)
    if (groups == 2 && scale_row_stride == 2 && count % W == 0) {
      const int64_t offset = head * scale_head_stride + start * scale_row_stride;
      prefetch_factors(offset, count);
      for (int64_t side = 0; side < 2; ++side) {
        const uint16_t* from = (side == 0 ? scales : minimums) + offset;
        float* to = out + side * 2 * ENTRIES_PER_PASS;
        for (int64_t j = 0; j < count; j += W) {
          vh first, second;  // rows j to j + 7, then j + 8 to j + 15, their two groups interleaved
          std::memcpy(&first, from + 2 * j, sizeof first);
          std::memcpy(&second, from + 2 * j + W, sizeof second);
          split_two_groups(halves_to_floats(first), halves_to_floats(second), to + j);
        }
      }
      return;
    }
#endif
    convert_factors(head, start, count, scratch);
    const int64_t n = count * groups;
    for (int64_t side = 0; side < 2; ++side) {
      const float* from = scratch + side * n;
      float* to = out + side * groups * ENTRIES_PER_PASS;
      if (groups == 1) {
        std::copy(from, from + count, to);
        continue;
      }
#if defined(__AVX512F__)
      if (groups == 2) {  // W = 16 rows' two groups are two vectors: their even and odd lanes
        for (int64_t j = 0; j < count; j += W) {
          split_two_groups(load(from + 2 * j), load(from + 2 * j + W), to + j);
        }
        continue;
      }
#endif
      for (int64_t j = 0; j < count; ++j) {
        for (int64_t g = 0; g < groups; ++g) to[g * ENTRIES_PER_PASS + j] = from[j * groups + g];
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

  // Whether the kernel asks for these rows row by row as it reads them (16-bit or coded rows decoded in registers,
  // or scored in integers; fp32 rows read where they are stored), rather than a pass at a time with prefetch_ahead.
  bool prefetched_by_row(int64_t dim) const { return decoded_in_registers() || streamed(dim); }

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

inline Rows plain_rows(const at::Tensor& t) {  // (H, L, D), or (1, H, L, D) (the appended buffers as a step holds them)
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

inline Rows stored_rows(const at::Tensor& data, const std::optional<at::Tensor>& scales,
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
// STREAMED: fp32 rows read where they are stored (Rows::streamed), each vector asking for its line a few rows on.
template <int64_t D, bool STREAMED = false>
struct Tile {
  const float* rows;
  vf operator()(int64_t j, int64_t c) const {
    if constexpr (STREAMED) prefetch_vector_ahead(rows + j * D + W * c, D, c);
    return load(rows + j * D + W * c);
  }
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
      prefetch_row_ahead<2 * W>(raw, row_stride, c);
      return sixteen_bits<F == Format::bf16>(raw, c);
    } else {
      prefetch_row_ahead<F == Format::int8 ? W : F == Format::int4 ? W / 2 : 3 * W / 8>(raw, row_stride, c);
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
  if (rows.streamed(D)) return body(Tile<D, true>{rows.rows<D>(head, start, count, tile, factors)});
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

}  // namespace semanticache::cpu
