// CUDA kernel of the float formats' fake quantization: one thread per element, the per-element
// math of qcompress/float_math.h (the CPU kernel's and quant/floats.py's, bit for bit).
#include "common.cuh"
#include "qcompress/float_launchers.h"
#include "qcompress/float_math.h"

namespace qc {
namespace cuda {
namespace {

template <typename X, typename S>
__global__ void float_fake_quant_kernel(const X* __restrict__ x, const S* __restrict__ scale, X* __restrict__ y,
                                        int64_t rows, int64_t cols, int64_t br, int64_t bc, int bits,
                                        int qd, int sd, int xd) {
  const int64_t n = rows * cols;
  const int64_t ncs = (cols + bc - 1) / bc;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / cols, c = i - r * cols;
    const float s = to_f(scale[(r / br) * ncs + c / bc]);
    y[i] = from_f<X>(fmath::fake_quant(to_f(x[i]), s, bits, qd, sd, xd));
  }
}

template <typename X, typename S>
int launch(const void* x, const void* scale, void* y, int64_t rows, int64_t cols, int64_t br, int64_t bc,
           int bits, int xd, int sd, cudaStream_t st) {
  const int64_t n = rows * cols;
  if (n == 0) return 0;
  const int64_t want = (n + kThreads - 1) / kThreads;
  const unsigned int blocks = static_cast<unsigned int>(want < 65535 * 8 ? want : 65535 * 8);
  const int qd = xd == sd ? xd : fmath::kF32;
  float_fake_quant_kernel<X, S><<<blocks, kThreads, 0, st>>>(
      static_cast<const X*>(x), static_cast<const S*>(scale), static_cast<X*>(y), rows, cols, br, bc, bits, qd, sd, xd);
  return static_cast<int>(cudaGetLastError());
}

template <typename X>
int by_scale(const void* x, int xd, const void* scale, int sd, void* y, int64_t rows, int64_t cols, int64_t br,
             int64_t bc, int bits, cudaStream_t st) {
  if (sd == fmath::kF32) return launch<X, float>(x, scale, y, rows, cols, br, bc, bits, xd, sd, st);
  if (sd != xd) return static_cast<int>(cudaErrorInvalidValue);
  return launch<X, X>(x, scale, y, rows, cols, br, bc, bits, xd, sd, st);
}

}  // namespace
}  // namespace cuda
}  // namespace qc

extern "C" int qc_cuda_float_fake_quant(const void* x, int x_dtype, const void* scale, int s_dtype, void* y,
                                        int64_t rows, int64_t cols, int64_t block_rows, int64_t block_cols,
                                        int bits, void* stream) {
  using namespace qc::cuda;
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  switch (x_dtype) {
    case 0: return by_scale<float>(x, x_dtype, scale, s_dtype, y, rows, cols, block_rows, block_cols, bits, st);
    case 1: return by_scale<__nv_bfloat16>(x, x_dtype, scale, s_dtype, y, rows, cols, block_rows, block_cols, bits, st);
    case 2: return by_scale<__half>(x, x_dtype, scale, s_dtype, y, rows, cols, block_rows, block_cols, bits, st);
    default: return static_cast<int>(cudaErrorInvalidValue);
  }
}
