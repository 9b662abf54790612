// A layer's int4 weights, as torch's CPU int4 kernel packs them, decoded to fp32 (in, out).
//
// The C++ twin of kernels/int4_weights_ref.py (same arguments, the same result bit for bit: each weight
// is (code - 8) * scale + zero, with one rounding either way, since (code - 8) * scale is exact in fp32).
// Reading a document multiplies many rows by each layer; torch's int4 kernel is made for few rows, so
// there the weights are decoded once per call and multiplied by fp32 inputs instead
// (semanticache_rag/weights.py, Int4Linear.rows). Decoding writes each weight once, four bytes, a group
// of rows per task on torch's OpenMP pool; torch ops take four passes and their temporaries for it.
//
// Built with decode_attention_cpu.cpp into one library by kernels/cpu_ops.py, which defines the schema.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

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

}  // namespace

TORCH_LIBRARY_IMPL(semanticache, CPU, m) { m.impl("unpack_int4_weight", &unpack_int4_weight); }
