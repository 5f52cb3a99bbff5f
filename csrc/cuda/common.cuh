// Device helpers shared by the .cu files: float storage conversions and launch geometry.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace qc {
namespace cuda {

constexpr int kThreads = 256;

template <typename T>
__device__ __forceinline__ float to_f(T v);
template <>
__device__ __forceinline__ float to_f<float>(float v) { return v; }
template <>
__device__ __forceinline__ float to_f<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }
template <>
__device__ __forceinline__ float to_f<__half>(__half v) { return __half2float(v); }

// float32 -> storage, round to nearest even (as torch's .to(dtype)).
template <typename T>
__device__ __forceinline__ T from_f(float v);
template <>
__device__ __forceinline__ float from_f<float>(float v) { return v; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <>
__device__ __forceinline__ __half from_f<__half>(float v) { return __float2half_rn(v); }

inline unsigned int blocks_for(int64_t n, int64_t per_block, unsigned int cap = 65535u * 16u) {
  int64_t b = (n + per_block - 1) / per_block;
  if (b < 1) b = 1;
  return b > static_cast<int64_t>(cap) ? cap : static_cast<unsigned int>(b);
}

inline int status() { return static_cast<int>(cudaGetLastError()); }

}  // namespace cuda
}  // namespace qc
