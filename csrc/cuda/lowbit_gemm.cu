// CUDA low-bit matmuls of load_quantized(mode="fast") on the blocked layout of
// qcompress/lowbit.h (the same buffers the CPU kernels use, moved with the module).
//
// One warp per output (token m, row n): lanes stride over each group's real columns, decode the
// codes with lowbit.h's code_at / dequant, and the warp reduces. Weight-only: float sums of
// x * w. W-A8: int32 sums per group (dot, sum of activation codes, sum of weight codes), combined
// by lowbit.h's a8_group and scaled once per group. Written for correctness and layout parity
// with the CPU kernels; the shared math is the point, not peak GPU speed.
#include "common.cuh"
#include "qcompress/lowbit.h"

namespace qc {
namespace cuda {
namespace {

using lowbit::Geometry;

constexpr int kWarps = kThreads / 32;

__device__ __forceinline__ float warp_sum_f(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ int warp_sum_i(int v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ int offset_at(const uint8_t* offsets, const Geometry& g, int64_t n, int64_t gi) {
  return offsets ? offsets[lowbit::param_index(g, n, gi)] : lowbit::code_bias(g.cbits);
}

template <typename T>
__global__ void lowbit_linear_kernel(const T* __restrict__ x, const uint8_t* __restrict__ packed,
                                     const float* __restrict__ scales, const uint8_t* __restrict__ offsets,
                                     const float* __restrict__ bias, T* __restrict__ y, int64_t m, Geometry g) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarps;
  for (int64_t out = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32; out < m * g.n; out += warps) {
    const int64_t mm = out / g.n, n = out % g.n;
    const T* xr = x + mm * g.k;
    float acc = 0.0f;
    for (int64_t gi = 0; gi < g.ng; ++gi) {
      const float s = scales[lowbit::param_index(g, n, gi)];
      const int o = offset_at(offsets, g, n, gi);
      const int64_t len = g.group_len(gi);
      for (int64_t j = lane; j < len; j += 32) {
        const float w = lowbit::dequant(lowbit::code_at(packed, g, n, gi * g.gp + j), o, s);
        acc = __fmaf_rn(to_f(xr[gi * g.group + j]), w, acc);
      }
    }
    acc = warp_sum_f(acc);
    if (lane == 0) y[mm * g.n + n] = from_f<T>(bias ? acc + bias[n] : acc);
  }
}

template <typename T>
__global__ void lowbit_linear_a8_kernel(const int8_t* __restrict__ xq, const float* __restrict__ x_scale,
                                        const int32_t* __restrict__ x_zp, const uint8_t* __restrict__ packed,
                                        const float* __restrict__ scales, const uint8_t* __restrict__ offsets,
                                        const float* __restrict__ bias, T* __restrict__ y, int64_t m, Geometry g) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarps;
  for (int64_t out = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32; out < m * g.n; out += warps) {
    const int64_t mm = out / g.n, n = out % g.n;
    const int8_t* xr = xq + mm * g.k;
    const int zx = x_zp ? x_zp[mm] : 0;
    float tot = 0.0f;
    for (int64_t gi = 0; gi < g.ng; ++gi) {
      const int o = offset_at(offsets, g, n, gi);
      const int64_t len = g.group_len(gi);
      int dot = 0, xsum = 0, usum = 0;
      for (int64_t j = lane; j < len; j += 32) {
        const int u = lowbit::code_at(packed, g, n, gi * g.gp + j);
        const int a = xr[gi * g.group + j];
        dot += u * a;
        xsum += a;
        usum += u;
      }
      dot = warp_sum_i(dot);
      xsum = warp_sum_i(xsum);
      usum = warp_sum_i(usum);
      // real columns only here, so sum (u - o) = usum - o * len
      const int32_t A = lowbit::a8_group(dot, o, xsum, zx, lowbit::group_wsum(usum, o, len));
      tot = __fmaf_rn(static_cast<float>(A), scales[lowbit::param_index(g, n, gi)], tot);
    }
    if (lane == 0) {
      const float v = __fmul_rn(tot, x_scale[mm]);
      y[mm * g.n + n] = from_f<T>(bias ? __fadd_rn(v, bias[n]) : v);
    }
  }
}

unsigned int grid_for(int64_t outputs) { return blocks_for(outputs, kWarps, 65535u * 8u); }

// lowbit_linear's `act` after the matmul kernel, in place (lowbit.h apply_act).
template <typename T>
__global__ void act_kernel(T* __restrict__ y, int64_t count, int act) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride)
    y[i] = from_f<T>(lowbit::apply_act(to_f<T>(y[i]), act));
}

}  // namespace
}  // namespace cuda
}  // namespace qc

extern "C" int qc_cuda_lowbit_linear(const void* x, int x_dtype, const uint8_t* packed, const float* scales,
                                     const uint8_t* offsets, const float* bias, void* y, int64_t m, int64_t n,
                                     int64_t k, int64_t group, int cbits, void* stream) {
  using namespace qc::cuda;
  const qc::lowbit::Geometry g = qc::lowbit::make_geometry(n, k, group, cbits);
  if (m * n == 0) return 0;
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  const unsigned int grid = grid_for(m * n);
  switch (x_dtype) {
    case 0:
      lowbit_linear_kernel<float><<<grid, kThreads, 0, st>>>(static_cast<const float*>(x), packed, scales, offsets,
                                                             bias, static_cast<float*>(y), m, g);
      break;
    case 1:
      lowbit_linear_kernel<__nv_bfloat16><<<grid, kThreads, 0, st>>>(
          static_cast<const __nv_bfloat16*>(x), packed, scales, offsets, bias, static_cast<__nv_bfloat16*>(y), m, g);
      break;
    default:
      lowbit_linear_kernel<__half><<<grid, kThreads, 0, st>>>(static_cast<const __half*>(x), packed, scales, offsets,
                                                              bias, static_cast<__half*>(y), m, g);
      break;
  }
  return status();
}

extern "C" int qc_cuda_lowbit_linear_a8(const int8_t* xq, const float* x_scale, const int32_t* x_zp,
                                        const uint8_t* packed, const float* scales, const uint8_t* offsets,
                                        const float* bias, void* y, int y_dtype, int64_t m, int64_t n, int64_t k,
                                        int64_t group, int cbits, void* stream) {
  using namespace qc::cuda;
  const qc::lowbit::Geometry g = qc::lowbit::make_geometry(n, k, group, cbits);
  if (m * n == 0) return 0;
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  const unsigned int grid = grid_for(m * n);
  switch (y_dtype) {
    case 0:
      lowbit_linear_a8_kernel<float><<<grid, kThreads, 0, st>>>(xq, x_scale, x_zp, packed, scales, offsets, bias,
                                                                static_cast<float*>(y), m, g);
      break;
    case 1:
      lowbit_linear_a8_kernel<__nv_bfloat16><<<grid, kThreads, 0, st>>>(
          xq, x_scale, x_zp, packed, scales, offsets, bias, static_cast<__nv_bfloat16*>(y), m, g);
      break;
    default:
      lowbit_linear_a8_kernel<__half><<<grid, kThreads, 0, st>>>(xq, x_scale, x_zp, packed, scales, offsets, bias,
                                                                 static_cast<__half*>(y), m, g);
      break;
  }
  return status();
}

extern "C" int qc_cuda_lowbit_act(void* y, int y_dtype, int64_t count, int act, void* stream) {
  using namespace qc::cuda;
  if (count == 0 || act == qc::lowbit::kActNone) return 0;
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  const unsigned int grid = blocks_for(count, kThreads);
  switch (y_dtype) {
    case 0:
      act_kernel<float><<<grid, kThreads, 0, st>>>(static_cast<float*>(y), count, act);
      break;
    case 1:
      act_kernel<__nv_bfloat16><<<grid, kThreads, 0, st>>>(static_cast<__nv_bfloat16*>(y), count, act);
      break;
    default:
      act_kernel<__half><<<grid, kThreads, 0, st>>>(static_cast<__half*>(y), count, act);
      break;
  }
  return status();
}
