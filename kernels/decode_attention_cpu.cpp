// One query token's attention over a stored document layer plus the appended tokens, on a CPU.
//
// The C++ twin of kernels/decode_attention_ref.py (same arguments, same result up to the rounding of
// reordered sums). The document's keys and values are read once, as they are stored (fp32, fp16 or
// bf16, or 8/4/3-bit group codes with fp16 scales and minimums), one row at a time into a buffer that
// stays in L1, so no full-precision copy of a coded layer is ever built. Work is split flash-decoding
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
#include <ATen/ops/zeros_like.h>
#include <torch/library.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t MAX_GROUP = 16;
constexpr int64_t ENTRIES_PER_TASK = 512;  // one (kv head, block) task: ~130 KiB of fp32 keys at D = 64
constexpr int64_t ENTRIES_PER_PASS = 64;   // scores kept for one online-softmax update

// exp(x) for x <= 0, written so that the compiler vectorises it (Cephes' expf polynomial, relative
// error ~1e-7); x below -87 (and -inf, the padding of ragged heads) gives exactly 0.
inline float exp_nonpositive(float x) {
  const bool underflow = x < -87.0f;
  x = std::max(x, -87.0f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.0f;
  const float out = std::bit_cast<float>(std::bit_cast<int32_t>(y) + (static_cast<int32_t>(n) << 23));
  return underflow ? 0.0f : out;
}

// IEEE half to float with integer and float operations only, so that loops of it vectorise (the
// conversion of Maratyszcza's FP16 library, which c10::Half also uses; exact for every input).
inline float half_to_float(uint16_t h) {
  const uint32_t w = static_cast<uint32_t>(h) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  const float normalized = std::bit_cast<float>((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
  const float denormalized = std::bit_cast<float>((two_w >> 17) | (126u << 23)) - 0.5f;
  const uint32_t magnitude = two_w < (1u << 27) ? std::bit_cast<uint32_t>(denormalized) : std::bit_cast<uint32_t>(normalized);
  return std::bit_cast<float>(sign | magnitude);
}

inline float bf16_to_float(uint16_t h) { return std::bit_cast<float>(static_cast<uint32_t>(h) << 16); }

// Keys or values of one layer as stored: rows (H, L, D) of `bits` bits (32: fp32, 16: fp16 or bf16,
// 8/4/3: group codes), read a tile of rows at a time.
struct Rows {
  const uint8_t* data = nullptr;
  int64_t head_stride = 0, row_stride = 0;  // bytes
  const uint16_t* scales = nullptr;
  const uint16_t* minimums = nullptr;
  int64_t scale_head_stride = 0, scale_row_stride = 0;  // elements
  int64_t groups = 1;
  int64_t bits = 32;
  bool bf16 = false;

  // Rows [start, start + count) of `head` as a (count, D) fp32 tile: the data itself where it is
  // contiguous fp32, otherwise decoded into `tile`.
  template <int64_t D>
  const float* rows(int64_t head, int64_t start, int64_t count, float* tile) const {
    const uint8_t* first = data + head * head_stride + start * row_stride;
    if (bits == 32 && row_stride == D * 4) return reinterpret_cast<const float*>(first);
    for (int64_t j = 0; j < count; ++j) decode_row<D>(first + j * row_stride, head, start + j, tile + j * D);
    return tile;
  }

  template <int64_t D>
  void decode_row(const uint8_t* raw, int64_t head, int64_t index, float* out) const {
    if (bits == 32) {
      std::memcpy(out, raw, D * 4);
      return;
    }
    if (bits == 16) {
      if (bf16) {
        const uint16_t* half = reinterpret_cast<const uint16_t*>(raw);
        for (int64_t d = 0; d < D; ++d) out[d] = bf16_to_float(half[d]);
      } else {
        const uint16_t* half = reinterpret_cast<const uint16_t*>(raw);
        for (int64_t d = 0; d < D; ++d) out[d] = half_to_float(half[d]);
      }
      return;
    }
    if (bits == 8) {
      for (int64_t d = 0; d < D; ++d) out[d] = static_cast<float>(raw[d]);
    } else if (bits == 4) {  // even channels in the low nibble
      for (int64_t b = 0; b < D / 2; ++b) {
        out[2 * b] = static_cast<float>(raw[b] & 15);
        out[2 * b + 1] = static_cast<float>(raw[b] >> 4);
      }
    } else {  // 3 bits: eight codes per three bytes, the first channel lowest
      for (int64_t w = 0; w < D / 8; ++w) {
        const uint32_t word = raw[3 * w] | (raw[3 * w + 1] << 8) | (raw[3 * w + 2] << 16);
        for (int k = 0; k < 8; ++k) out[8 * w + k] = static_cast<float>((word >> (3 * k)) & 7);
      }
    }
    // code * scale + minimum, per group of channels: the two roundings of decode_groups_into
    const int64_t offset = head * scale_head_stride + index * scale_row_stride;
    const int64_t width = D / groups;
    for (int64_t g = 0; g < groups; ++g) {
      const float s = half_to_float(scales[offset + g]), m = half_to_float(minimums[offset + g]);
      float* part = out + g * width;
      for (int64_t d = 0; d < width; ++d) part[d] = part[d] * s + m;
    }
  }
};

Rows plain_rows(const at::Tensor& t) {
  TORCH_CHECK(t.dim() == 3 && t.stride(2) == 1, "rows must be (H, L, D) with contiguous D, got ", t.sizes(),
              " strides ", t.strides());
  Rows rows;
  rows.data = static_cast<const uint8_t*>(t.data_ptr());
  rows.head_stride = t.stride(0) * t.element_size();
  rows.row_stride = t.stride(1) * t.element_size();
  if (t.scalar_type() == at::kFloat) {
    rows.bits = 32;
  } else {
    TORCH_CHECK(t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16,
                "plain rows must be float32, float16 or bfloat16, got ", t.scalar_type());
    rows.bits = 16;
    rows.bf16 = t.scalar_type() == at::kBFloat16;
  }
  return rows;
}

Rows stored_rows(const at::Tensor& data, const std::optional<at::Tensor>& scales,
                 const std::optional<at::Tensor>& minimums, int64_t bits, int64_t dim) {
  if (bits == 32 || bits == 16) {
    Rows rows = plain_rows(data);
    TORCH_CHECK(rows.bits == bits, "bits=", bits, " but the rows are ", data.scalar_type());
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
  rows.bits = bits;
  return rows;
}

// The running state of one task: per query head the maximum logit, the sum of exp and the output.
struct Partial {
  float* maximum;  // (G)
  float* total;    // (G)
  float* out;      // (G, D)
};

// Online-softmax update of `partial` with entries [begin, end) of `keys`/`values` (one kv head), in
// passes of ENTRIES_PER_PASS: a tile of keys decoded (where coded), its scores for the G query heads,
// the running maximum and sum, then a tile of values added into the G outputs, kept in registers.
template <int64_t D>
void attend_rows(const float* query, int64_t group, const Rows& keys, const Rows& values, const float* bias,
                 int64_t head, int64_t begin, int64_t end, Partial partial) {
  alignas(64) float scores[MAX_GROUP][ENTRIES_PER_PASS];
  alignas(64) float tile[ENTRIES_PER_PASS * D];
  for (int64_t start = begin; start < end; start += ENTRIES_PER_PASS) {
    const int64_t count = std::min(ENTRIES_PER_PASS, end - start);
    // -- scores of the pass
    const float* key = keys.rows<D>(head, start, count, tile);
    for (int64_t g = 0; g < group; ++g) {
      const float* q = query + g * D;
      for (int64_t j = 0; j < count; ++j) {
        float sum = 0.0f;
        for (int64_t d = 0; d < D; ++d) sum += q[d] * key[j * D + d];
        scores[g][j] = sum + (bias == nullptr ? 0.0f : bias[start + j]);
      }
    }
    // -- new maximum and sum; scores become weights, the outputs so far are rescaled
    float rescale[MAX_GROUP];
    for (int64_t g = 0; g < group; ++g) {
      float top = partial.maximum[g];
      for (int64_t j = 0; j < count; ++j) top = std::max(top, scores[g][j]);
      if (top == -INFINITY) {  // every entry so far is padding: weights 0, nothing to rescale
        std::fill(scores[g], scores[g] + count, 0.0f);
        rescale[g] = 1.0f;
        continue;
      }
      float total = 0.0f;
      for (int64_t j = 0; j < count; ++j) {
        scores[g][j] = exp_nonpositive(scores[g][j] - top);
        total += scores[g][j];
      }
      rescale[g] = exp_nonpositive(partial.maximum[g] - top);
      partial.total[g] = partial.total[g] * rescale[g] + total;
      partial.maximum[g] = top;
    }
    // -- weighted values
    const float* value = values.rows<D>(head, start, count, tile);
    for (int64_t g = 0; g < group; ++g) {
      alignas(64) float out[D];
      float* target = partial.out + g * D;
      for (int64_t d = 0; d < D; ++d) out[d] = target[d] * rescale[g];
      for (int64_t j = 0; j < count; ++j) {
        const float weight = scores[g][j];
        for (int64_t d = 0; d < D; ++d) out[d] += weight * value[j * D + d];
      }
      std::memcpy(target, out, D * 4);
    }
  }
}

void attend(int64_t dim, const float* query, int64_t group, const Rows& keys, const Rows& values, const float* bias,
            int64_t head, int64_t begin, int64_t end, Partial partial) {
  switch (dim) {
    case 16: return attend_rows<16>(query, group, keys, values, bias, head, begin, end, partial);
    case 32: return attend_rows<32>(query, group, keys, values, bias, head, begin, end, partial);
    case 64: return attend_rows<64>(query, group, keys, values, bias, head, begin, end, partial);
    case 128: return attend_rows<128>(query, group, keys, values, bias, head, begin, end, partial);
    default: return attend_rows<256>(query, group, keys, values, bias, head, begin, end, partial);
  }
}

at::Tensor decode_attention(const at::Tensor& query, const at::Tensor& keys, const std::optional<at::Tensor>& key_scales,
                            const std::optional<at::Tensor>& key_minimums, int64_t key_bits, const at::Tensor& values,
                            const std::optional<at::Tensor>& value_scales,
                            const std::optional<at::Tensor>& value_minimums, int64_t value_bits,
                            const std::optional<at::Tensor>& bias, const at::Tensor& new_keys,
                            const at::Tensor& new_values) {
  TORCH_CHECK(query.device().is_cpu() && query.scalar_type() == at::kFloat && query.dim() == 3 &&
                  query.is_contiguous(),
              "query must be a contiguous (H_kv, G, D) float32 CPU tensor, got ", query.sizes());
  const int64_t heads = query.size(0), group = query.size(1), dim = query.size(2);
  TORCH_CHECK(dim == 16 || dim == 32 || dim == 64 || dim == 128 || dim == 256,
              "head dim must be 16, 32, 64, 128 or 256, got ", dim);
  TORCH_CHECK(group <= MAX_GROUP, "at most ", MAX_GROUP, " query heads per kv head, got ", group);
  const int64_t length = keys.size(1), appended = new_keys.size(1);
  TORCH_CHECK(keys.size(0) == heads && values.size(0) == heads && values.size(1) == length,
              "document keys and values must be (H_kv, L, ...) with H_kv = ", heads);
  TORCH_CHECK(new_keys.scalar_type() == at::kFloat && new_values.scalar_type() == at::kFloat &&
                  new_keys.sizes() == new_values.sizes() && new_keys.size(0) == heads && new_keys.size(2) == dim,
              "appended keys and values must be (H_kv, T, D) float32");
  const Rows doc_keys = stored_rows(keys, key_scales, key_minimums, key_bits, dim);
  const Rows doc_values = stored_rows(values, value_scales, value_minimums, value_bits, dim);
  const Rows tail_keys = plain_rows(new_keys), tail_values = plain_rows(new_values);
  const float* bias_data = nullptr;
  int64_t bias_stride = 0;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->dim() == 2 && bias->size(0) == heads &&
                    bias->size(1) == length && bias->stride(1) == 1,
                "bias must be (H_kv, L) float32 with contiguous rows");
    bias_data = bias->data_ptr<float>();
    bias_stride = bias->stride(0);
  }
  // Tasks: per head, blocks of the document, then one block of appended tokens.
  const int64_t doc_blocks = (length + ENTRIES_PER_TASK - 1) / ENTRIES_PER_TASK;
  const int64_t blocks = doc_blocks + 1, tasks = heads * blocks, width = group * (dim + 2);
  std::vector<float> state(tasks * width);
  const float* q = query.data_ptr<float>();
  at::parallel_for(0, tasks, 1, [&](int64_t first, int64_t last) {
    for (int64_t task = first; task < last; ++task) {
      const int64_t head = task / blocks, block = task % blocks;
      float* base = state.data() + task * width;
      Partial partial{base, base + group, base + 2 * group};
      std::fill(partial.maximum, partial.maximum + group, -INFINITY);
      std::fill(partial.total, partial.total + group * (dim + 1), 0.0f);
      const float* head_query = q + head * group * dim;
      if (block < doc_blocks) {
        const int64_t begin = block * ENTRIES_PER_TASK, end = std::min(length, begin + ENTRIES_PER_TASK);
        const float* head_bias = bias_data == nullptr ? nullptr : bias_data + head * bias_stride;
        attend(dim, head_query, group, doc_keys, doc_values, head_bias, head, begin, end, partial);
      } else {
        attend(dim, head_query, group, tail_keys, tail_values, nullptr, head, 0, appended, partial);
      }
    }
  });
  // -- merge the blocks of each head by their log-sum-exp
  at::Tensor out = at::zeros_like(query);
  float* o = out.data_ptr<float>();
  for (int64_t head = 0; head < heads; ++head) {
    for (int64_t g = 0; g < group; ++g) {
      float top = -INFINITY;
      for (int64_t b = 0; b < blocks; ++b) top = std::max(top, state[(head * blocks + b) * width + g]);
      float total = 0.0f;
      float* target = o + (head * group + g) * dim;
      for (int64_t b = 0; b < blocks; ++b) {
        const float* base = state.data() + (head * blocks + b) * width;
        if (base[g] == -INFINITY) continue;
        const float weight = std::exp(base[g] - top);
        total += weight * base[group + g];
        const float* part = base + 2 * group + g * dim;
        for (int64_t d = 0; d < dim; ++d) target[d] += weight * part[d];
      }
      for (int64_t d = 0; d < dim; ++d) target[d] /= total;
    }
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(semanticache, CPU, m) { m.impl("decode_attention", &decode_attention); }
