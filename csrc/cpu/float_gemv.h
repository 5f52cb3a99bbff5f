// CPU operator of the few-token float matmul (csrc/cpu/float_gemv.cpp, registered in ops.cpp).
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace qc {
namespace float_gemv {
constexpr int64_t kMaxTokens = 16;  // rows of x the op takes (above them torch's GEMM is the faster)
}

// y = x @ weight^T (+ bias) for x [..., K] with at most kMaxTokens rows, weight [N, K] float32 or
// bfloat16 and x of its dtype; float32 products and sums, y rounded once to that dtype.
at::Tensor float_gemv_cpu(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias);

}  // namespace qc
