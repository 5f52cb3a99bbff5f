// CPU operator implementations (registered in csrc/ops.cpp) and the argument checks that the
// CPU and CUDA glue share.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <tuple>

namespace qc {

// Prefix of the error raised for NaN/Inf groups; qcompress/quant/kernels.py turns it into
// qcompress.NonFiniteError.
constexpr const char* kNonFiniteTag = "qcompress.NonFiniteError: ";

// x is viewed as [rows, cols]; each row is cut into groups of `group` elements (the last one may
// be partial, as if zero padded). group == 0 means a zero-width view (no elements).
struct QuantConfig {
  int64_t rows = 0, cols = 0, group = 0;
  int bits = 8, kind = 0, rounding = 0;
  bool symmetric = true, deepspeed = false;
  uint32_t seed = 0;
  bool has_range = false;
  float range_lo = 0.0f, range_hi = 0.0f;
  float qmin = 0.0f, qmax = 0.0f;
  int64_t groups_per_row() const {
    return group > 0 ? std::max<int64_t>(1, (cols + group - 1) / group) : 1;
  }
};

// Validates the operator arguments; reads the static range when it lives on the CPU.
QuantConfig make_config(const at::Tensor& x, const std::optional<at::Tensor>& range, int64_t rows,
                        int64_t cols, int64_t group, int64_t bits, int64_t kind, bool symmetric,
                        bool deepspeed, int64_t rounding, int64_t seed);

template <typename T, typename Q>
struct Outputs {
  T* y = nullptr;         // fake-quantized values
  bool* mask = nullptr;   // not clipped
  Q* q = nullptr;         // integer codes
  float* scale = nullptr; // per group
  float* zp = nullptr;    // per group (float holding an integer)
};

// Checks shared by the dequantize implementations.
void check_dequant_args(const at::Tensor& q, const at::Tensor& scale, const std::optional<at::Tensor>& zp,
                        int64_t rows, int64_t cols, int64_t group);

std::tuple<at::Tensor, at::Tensor> fake_quant_cpu(const at::Tensor& x, const std::optional<at::Tensor>& range,
                                                  int64_t rows, int64_t cols, int64_t group, int64_t bits,
                                                  int64_t kind, bool symmetric, bool deepspeed,
                                                  int64_t rounding, int64_t seed, bool with_mask);
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_cpu(const at::Tensor& x, const std::optional<at::Tensor>& range,
                                                            int64_t rows, int64_t cols, int64_t group, int64_t bits,
                                                            int64_t kind, bool symmetric, bool deepspeed,
                                                            int64_t rounding, int64_t seed);
// quantize_cpu's (q, scale, zp) and fake_quant_cpu's values, one pass over x
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_values_cpu(
    const at::Tensor& x, const std::optional<at::Tensor>& range, int64_t rows, int64_t cols, int64_t group,
    int64_t bits, int64_t kind, bool symmetric, bool deepspeed, int64_t rounding, int64_t seed);
at::Tensor dequantize_cpu(const at::Tensor& q, const at::Tensor& scale, const std::optional<at::Tensor>& zp,
                          int64_t rows, int64_t cols, int64_t group, at::ScalarType dtype);
// Rows [r0, r1) of quantize_cpu with one group per row (per token), nearest rounding, default
// numerics, 2..8 bits, on a contiguous float32/bfloat16/float16 x [m, k]: codes to q + r0 * k, scale
// and zero point (a float holding the integer; untouched when symmetric) to [r0, r1). For a task of
// the fused low-bit matmul, which quantizes the tokens it multiplies. Returns the rows that hold
// NaN/Inf; raise_nonfinite(bad, rows) then fails as the quantize op does.
int64_t quantize_token_rows(const at::Tensor& x, int64_t r0, int64_t r1, int bits, bool symmetric, int8_t* q,
                            float* scale, float* zp);
void raise_nonfinite(int64_t bad, int64_t groups);
at::Tensor ste_backward_cpu(const at::Tensor& grad, const at::Tensor& mask);
std::tuple<at::Tensor, at::Tensor> fake_quant_params_cpu(const at::Tensor& x, const at::Tensor& scale,
                                                         const std::optional<at::Tensor>& zp, int64_t rows,
                                                         int64_t cols, int64_t group, int64_t bits, int64_t rounding,
                                                         int64_t seed, bool with_mask);
at::Tensor mse_errors_cpu(const at::Tensor& x, const at::Tensor& scales, const std::optional<at::Tensor>& zps,
                          int64_t rows, int64_t cols, int64_t group, int64_t bits,
                          const std::optional<at::Tensor>& moments);
std::tuple<at::Tensor, at::Tensor, at::Tensor> mse_refine_terms_cpu(const at::Tensor& x, const at::Tensor& scales,
                                                                    int64_t rows, int64_t cols, int64_t group,
                                                                    int64_t bits,
                                                                    const std::optional<at::Tensor>& moments);
std::tuple<at::Tensor, at::Tensor, at::Tensor> lsq_backward_cpu(const at::Tensor& grad, const at::Tensor& x,
                                                                const at::Tensor& scale,
                                                                const std::optional<at::Tensor>& zp, int64_t rows,
                                                                int64_t cols, int64_t group, int64_t bits,
                                                                int64_t rounding, int64_t seed);
at::Tensor pack_int32_cpu(const at::Tensor& q, int64_t bits);
at::Tensor unpack_int32_cpu(const at::Tensor& packed, int64_t bits, int64_t length);
std::tuple<at::Tensor, at::Tensor, at::Tensor> onebit_compress_cpu(const at::Tensor& x, const at::Tensor& error);
at::Tensor onebit_decode_average_cpu(const at::Tensor& packed, const at::Tensor& scales);
at::Tensor onebit_decode_cpu(const at::Tensor& packed, const at::Tensor& scales);

}  // namespace qc
