// CUDA 1-bit compressor, its decode-average, and int32 packing (compressed-tensors layout).
// The float64 sum of squares uses a fixed grid, so its bits do not depend on the device.
#include "common.cuh"
#include "qcompress/cuda_launchers.h"
#include "qcompress/math.h"

namespace qc {
namespace cuda {
namespace {

constexpr unsigned int kSumBlocks = 1024;  // fixed: the reduction order is part of the result

template <typename T>
__global__ void sumsq_partials(const T* __restrict__ x, const float* __restrict__ err, double* __restrict__ part,
                               int64_t n) {
  __shared__ double sh[kThreads];
  double acc = 0.0;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float y = to_f(x[i]) + err[i];
    acc += static_cast<double>(y) * static_cast<double>(y);
  }
  sh[threadIdx.x] = acc;
  __syncthreads();
  for (int s = kThreads / 2; s > 0; s >>= 1) {
    if (static_cast<int>(threadIdx.x) < s) sh[threadIdx.x] += sh[threadIdx.x + s];
    __syncthreads();
  }
  if (threadIdx.x == 0) part[blockIdx.x] = sh[0];
}

__global__ void finish_scale(const double* __restrict__ part, float* __restrict__ scale, int64_t n) {
  if (threadIdx.x == 0 && blockIdx.x == 0) {
    double total = 0.0;
    for (unsigned int b = 0; b < kSumBlocks; ++b) total += part[b];
    *scale = onebit_scale(total, n);
  }
}

// One thread per output byte: 8 signs (MSB = first element, zero counts as positive), new error.
template <typename T>
__global__ void signs_and_error(const T* __restrict__ x, const float* __restrict__ err,
                                const float* __restrict__ scale, uint8_t* __restrict__ packed,
                                float* __restrict__ new_err, int64_t bytes) {
  const float s = *scale;
  for (int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; k < bytes;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    unsigned int b = 0;
    for (int j = 0; j < 8; ++j) {
      const float y = to_f(x[8 * k + j]) + err[8 * k + j];
      b |= (y >= 0.0f ? 1u : 0u) << (7 - j);
      new_err[8 * k + j] = onebit_error(y, s);
    }
    packed[k] = static_cast<uint8_t>(b);
  }
}

__global__ void decode_average(const uint8_t* __restrict__ packed, const float* __restrict__ scales,
                               float* __restrict__ out, int64_t P, int64_t m) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < 8 * m;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t k = i / 8;
    const int t = static_cast<int>(i % 8);
    float acc = 0.0f;
    for (int64_t j = 0; j < P; ++j) {  // chunk order j = 0 .. P-1, as the reference
      const float w = scales[j] / static_cast<float>(P);
      acc = acc + (((packed[j * m + k] >> (7 - t)) & 1) ? w : -w);
    }
    out[i] = acc;
  }
}

// Each row on its own: out[r, 8k + t] = +s_r or -s_r by bit (7 - t) of byte k of row r (rows may
// sit row_stride bytes apart, e.g. payload rows followed by their scale bytes).
__global__ void decode_rows(const uint8_t* __restrict__ packed, int64_t row_stride, const float* __restrict__ scales,
                            float* __restrict__ out, int64_t P, int64_t m) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < P * 8 * m;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / (8 * m), c = i % (8 * m);
    const float s = scales[r];
    out[i] = ((packed[r * row_stride + c / 8] >> (7 - static_cast<int>(c % 8))) & 1) ? s : -s;
  }
}

__global__ void pack_kernel(const int8_t* __restrict__ q, int32_t* __restrict__ out, int64_t rows, int64_t k,
                            int64_t words, int bits) {
  const int per = 32 / bits;
  const uint32_t off = 1u << (bits - 1), msk = (1u << bits) - 1u;
  for (int64_t w = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; w < rows * words;
       w += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = w / words, c0 = (w % words) * per;
    uint32_t word = 0;
    for (int j = 0; j < per && c0 + j < k; ++j) {
      const uint32_t u = (static_cast<uint32_t>(static_cast<int32_t>(q[r * k + c0 + j])) + off) & msk;
      word |= u << (j * bits);
    }
    out[w] = static_cast<int32_t>(word);
  }
}

__global__ void unpack_kernel(const int32_t* __restrict__ p, int8_t* __restrict__ out, int64_t rows,
                              int64_t words, int64_t length, int bits) {
  const int per = 32 / bits;
  const int32_t off = 1 << (bits - 1);
  const uint32_t msk = (1u << bits) - 1u;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < rows * length;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / length, c = i % length;
    const uint32_t w = static_cast<uint32_t>(p[r * words + c / per]);
    const int32_t u = static_cast<int32_t>((w >> ((c % per) * bits)) & msk);
    out[i] = static_cast<int8_t>(u - off);
  }
}

}  // namespace
}  // namespace cuda
}  // namespace qc

extern "C" size_t qc_cuda_onebit_workspace(int64_t n) {
  (void)n;
  return qc::cuda::kSumBlocks * sizeof(double);
}

extern "C" int qc_cuda_onebit_compress(const void* x, int x_dtype, const float* error, uint8_t* packed,
                                       float* scale, float* new_error, int64_t n, void* workspace,
                                       void* stream) {
  using namespace qc::cuda;
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  double* part = static_cast<double*>(workspace);
  const unsigned int b = blocks_for(n / 8, kThreads * 4);
  if (x_dtype == 0) {
    sumsq_partials<float><<<kSumBlocks, kThreads, 0, st>>>(static_cast<const float*>(x), error, part, n);
  } else if (x_dtype == 1) {
    sumsq_partials<__nv_bfloat16><<<kSumBlocks, kThreads, 0, st>>>(static_cast<const __nv_bfloat16*>(x), error, part, n);
  } else {
    sumsq_partials<__half><<<kSumBlocks, kThreads, 0, st>>>(static_cast<const __half*>(x), error, part, n);
  }
  finish_scale<<<1, 32, 0, st>>>(part, scale, n);
  if (n == 0) return status();
  if (x_dtype == 0) {
    signs_and_error<float><<<b, kThreads, 0, st>>>(static_cast<const float*>(x), error, scale, packed, new_error, n / 8);
  } else if (x_dtype == 1) {
    signs_and_error<__nv_bfloat16><<<b, kThreads, 0, st>>>(static_cast<const __nv_bfloat16*>(x), error, scale, packed, new_error, n / 8);
  } else {
    signs_and_error<__half><<<b, kThreads, 0, st>>>(static_cast<const __half*>(x), error, scale, packed, new_error, n / 8);
  }
  return status();
}

extern "C" int qc_cuda_onebit_decode_average(const uint8_t* packed, const float* scales, float* out, int64_t P,
                                             int64_t m, void* stream) {
  using namespace qc::cuda;
  if (m == 0) return 0;
  decode_average<<<blocks_for(8 * m, kThreads * 4), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(packed, scales, out, P, m);
  return status();
}

extern "C" int qc_cuda_onebit_decode(const uint8_t* packed, int64_t row_stride, const float* scales, float* out,
                                     int64_t P, int64_t m, void* stream) {
  using namespace qc::cuda;
  if (P * m == 0) return 0;
  decode_rows<<<blocks_for(P * 8 * m, kThreads * 4), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      packed, row_stride, scales, out, P, m);
  return status();
}

extern "C" int qc_cuda_pack_int32(const int8_t* q, int32_t* out, int64_t rows, int64_t k, int bits, void* stream) {
  using namespace qc::cuda;
  const int64_t per = 32 / bits, words = (k + per - 1) / per;
  if (rows * words == 0) return 0;
  pack_kernel<<<blocks_for(rows * words, kThreads * 4), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(q, out, rows, k, words, bits);
  return status();
}

extern "C" int qc_cuda_unpack_int32(const int32_t* packed, int8_t* out, int64_t rows, int64_t words, int64_t length,
                                    int bits, void* stream) {
  using namespace qc::cuda;
  if (rows * length == 0) return 0;
  unpack_kernel<<<blocks_for(rows * length, kThreads * 4), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(packed, out, rows, words, length, bits);
  return status();
}
