// CPU operators of the fused low-bit matmuls (csrc/cpu/lowbit_gemm.cpp, registered in ops.cpp).
// Layout and math: qcompress/lowbit.h.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/string_view.h>

#include <optional>
#include <string>
#include <tuple>

namespace qc {

// Signed codes q [N, K] (int8), scale float32 [N, ng], zero point [N, ng] (any int dtype) or none
// -> (packed uint8, scales float32, offsets uint8 (empty when symmetric)) in the blocked layout;
// ng = ceil(K / group).
std::tuple<at::Tensor, at::Tensor, at::Tensor> lowbit_prepack_cpu(
    const at::Tensor& q, const at::Tensor& scale, const std::optional<at::Tensor>& zero_point, int64_t group,
    int64_t cbits);

// The signed codes [n, k] (int8) back from the blocked layout.
at::Tensor lowbit_unpack_cpu(const at::Tensor& packed, int64_t n, int64_t k, int64_t group, int64_t cbits);

// lowbit.h Act of lowbit_linear's `act` argument (an error names any other value).
int lowbit_act_code(c10::string_view name);

// y = act(x @ w^T (+ bias)) (+ residual) for float activations x [..., K] (float32 / bfloat16 /
// float16); y in x's dtype; act "none", "gelu", "gelu_tanh", "relu" or "silu" (lowbit.h apply_act);
// residual: y's shape.
at::Tensor lowbit_linear_cpu(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                             const std::optional<at::Tensor>& offsets, const std::optional<at::Tensor>& bias,
                             int64_t n, int64_t group, int64_t cbits, c10::string_view act,
                             const std::optional<at::Tensor>& residual);

// y = x_scale * sum_g scale_g * (integer group sums) (+ bias) from int8 activation codes xq [..., K]
// (x_scale float32 and x_zero_point per token, or one value for all tokens); y in out_dtype.
at::Tensor lowbit_linear_a8_cpu(const at::Tensor& xq, const at::Tensor& x_scale,
                                const std::optional<at::Tensor>& x_zero_point, const at::Tensor& packed,
                                const at::Tensor& scales, const std::optional<at::Tensor>& offsets,
                                const std::optional<at::Tensor>& bias, int64_t n, int64_t group, int64_t cbits,
                                at::ScalarType out_dtype);

// y of lowbit_linear_a8 on the codes that quantize(x, per token, abits bits, nearest) makes: both
// ops' CPU implementations called in turn, without the Python between them; then act and residual
// (lowbit_linear's).
at::Tensor lowbit_linear_dyn_a8_cpu(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                                    const std::optional<at::Tensor>& offsets, const std::optional<at::Tensor>& bias,
                                    int64_t n, int64_t group, int64_t cbits, int64_t abits, bool symmetric,
                                    int64_t seed, c10::string_view act, const std::optional<at::Tensor>& residual);

// Shape / dtype checks of a blocked weight for an n x k matmul (any device; used by the CUDA glue).
void lowbit_check_weight(const at::Tensor& packed, const at::Tensor& scales, const std::optional<at::Tensor>& offsets,
                         int64_t n, int64_t k, int64_t group, int64_t cbits);

// The instruction set the CPU kernels use ("scalar", "avx2", "avx512", "avx512_vnni", "amx"); a
// non-empty request switches to that one (at most what the CPU has), "auto" back to the best.
std::string lowbit_isa(c10::string_view request);

// The same choice as a level: 0 scalar, 1 AVX2, 2 AVX-512, 3 AVX-512 VNNI, 4 AMX (float_gemv.cpp).
int lowbit_isa_level();

}  // namespace qc
