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

// Largest finite value of a storage type, as float (fp32 FLT_MAX, bf16 (2 - 2^-7) 2^127, fp16 65504).
template <typename T>
__device__ __forceinline__ float finite_max();
template <>
__device__ __forceinline__ float finite_max<float>() { return 3.40282346638528859812e+38f; }
template <>
__device__ __forceinline__ float finite_max<__nv_bfloat16>() { return 0x1.fep127f; }
template <>
__device__ __forceinline__ float finite_max<__half>() { return 65504.0f; }

// A dequantized value stored saturated to +-finite_max<T> (qc::saturate; NaN passes): finite in,
// finite out.
template <typename T>
__device__ __forceinline__ T from_f_sat(float v) {
  const float m = finite_max<T>();
  return from_f<T>(v < -m ? -m : (v > m ? m : v));
}

inline unsigned int blocks_for(int64_t n, int64_t per_block, unsigned int cap = 65535u * 16u) {
  int64_t b = (n + per_block - 1) / per_block;
  if (b < 1) b = 1;
  return b > static_cast<int64_t>(cap) ? cap : static_cast<unsigned int>(b);
}

inline int status() { return static_cast<int>(cudaGetLastError()); }

}  // namespace cuda
}  // namespace qc
