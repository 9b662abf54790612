// The C++ CPU operators that other kernels call directly (kernels/decoder_step_cpu.cpp), without the
// dispatcher between them. Each is registered as torch.ops.semanticache.<name> by the file that defines
// it; kernels/cpu_ops.py builds them into one library and defines their schemas.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

namespace semanticache {

// kernels/rms_norm_cpu.cpp: x * (1 / sqrt(mean(x^2) + eps)) * weight, per row
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);

// kernels/int4_weights_cpu.cpp: x (rows, in) float32 times Q4_1 weights in their layout, (rows, out)
at::Tensor q4_1_product(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                        const at::Tensor& minimums);

// kernels/int4_weights_cpu.cpp: the same product in fp32 arithmetic, the rows unquantised
at::Tensor q4_1_product_fp32(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                             const at::Tensor& minimums);

// kernels/int4_weights_cpu.cpp: x (rows, in) float32 times Q8_0 weights (codes in their layout, bf16
// scales), the rows quantised to Q8_0 too; q8_0_product_fp32: fp32 scales, the rows as they are
at::Tensor q8_0_product(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales);
at::Tensor q8_0_product_fp32(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales);

// kernels/decode_attention_cpu.cpp: one token's attention (H_kv, G, D) over a document as stored and
// the appended (H_kv, T, D)
at::Tensor decode_attention(const at::Tensor& query, const at::Tensor& keys, const std::optional<at::Tensor>& key_scales,
                            const std::optional<at::Tensor>& key_minimums, int64_t key_bits, const at::Tensor& values,
                            const std::optional<at::Tensor>& value_scales,
                            const std::optional<at::Tensor>& value_minimums, int64_t value_bits,
                            const std::optional<at::Tensor>& bias, const at::Tensor& new_keys,
                            const at::Tensor& new_values);

}  // namespace semanticache
