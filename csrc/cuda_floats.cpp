// Torch glue of the float formats' CUDA kernel (csrc/cuda/floats.cu): checks, output, stream.
// Compiled only in CUDA builds (csrc/build.py defines QC_WITH_CUDA); the schema is csrc/cpu/floats.cpp's.
#ifdef QC_WITH_CUDA

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "qcompress/float_launchers.h"

namespace qc {
namespace {

int code_of(at::ScalarType t) {
  if (t == at::kFloat) return 0;
  if (t == at::kBFloat16) return 1;
  TORCH_CHECK(t == at::kHalf, "float_fake_quant: float32, bfloat16 or float16 expected, got ", t);
  return 2;
}

at::Tensor float_fake_quant_cuda(const at::Tensor& x_in, const at::Tensor& scale_in, int64_t br, int64_t bc,
                                 int64_t bits) {
  TORCH_CHECK(x_in.dim() == 2 && (bits == 8 || bits == 4) && br >= 1 && bc >= 1,
              "float_fake_quant: x [rows, cols], bits 8 or 4, blocks >= 1");
  c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous();
  const at::Tensor s = scale_in.contiguous();
  const int xd = code_of(x.scalar_type()), sd = code_of(s.scalar_type());
  TORCH_CHECK(sd == 0 || sd == xd, "float_fake_quant: the scale is float32 or x's dtype");
  const int64_t need = ((x.size(0) + br - 1) / br) * ((x.size(1) + bc - 1) / bc);
  TORCH_CHECK(x.numel() == 0 || s.numel() == need, "float_fake_quant: ", need, " scales expected, got ", s.numel());
  at::Tensor y = at::empty_like(x);
  const int rc = qc_cuda_float_fake_quant(x.const_data_ptr(), xd, s.const_data_ptr(), sd, y.mutable_data_ptr(),
                                          x.size(0), x.size(1), br, bc, static_cast<int>(bits),
                                          static_cast<void*>(c10::cuda::getCurrentCUDAStream().stream()));
  TORCH_CHECK(rc == 0, "qcompress: CUDA launch of float_fake_quant failed with cudaError ", rc);
  return y;
}

}  // namespace
}  // namespace qc

TORCH_LIBRARY_IMPL(qcompress, CUDA, m) { m.impl("float_fake_quant", &qc::float_fake_quant_cuda); }

#endif  // QC_WITH_CUDA
