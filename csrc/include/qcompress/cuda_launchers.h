// C entry points of the CUDA kernels (csrc/cuda/*.cu). Plain C types only, so that the torch
// glue (csrc/cuda_ops.cpp) and the .cu files share no headers but this one.
// Return value: 0 on success, else a cudaError_t code from the launch.
#pragma once

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// dtype codes for float storage: 0 float32, 1 bfloat16, 2 float16; int codes: 0 int8, 1 int32.
typedef struct {
  int64_t rows, cols, group;  // x viewed as [rows, cols], groups of `group` along cols
  int bits, kind, rounding, symmetric, deepspeed;
  uint32_t seed;
  float qmin, qmax;
  const float* range;  // device [min, max] or NULL
} qc_cuda_quant_args;

// Bytes of device workspace that qc_cuda_quant needs (per-segment partial statistics).
size_t qc_cuda_quant_workspace(const qc_cuda_quant_args* a);

// Fake-quantize (y, mask: either may be NULL) and/or quantize (q, scale, zp: NULL when unused).
// bad: device int32 counter of groups with NaN/Inf statistics (the caller zeroes it).
int qc_cuda_quant(const qc_cuda_quant_args* a, const void* x, int x_dtype, void* y, bool* mask,
                  void* q, int q_dtype, float* scale, float* zp, void* workspace, int* bad,
                  void* stream);

int qc_cuda_dequantize(const void* q, int q_dtype, const float* scale, const float* zp, void* out,
                       int out_dtype, int64_t rows, int64_t cols, int64_t group, void* stream);

int qc_cuda_ste_backward(const void* grad, int dtype, const bool* mask, void* out, int64_t n,
                         void* stream);

// Integer fake-quant with given per-group scales (and zero points when zp != NULL), default
// numerics: a->range is ignored, a->symmetric must be (zp == NULL). y and/or mask may be NULL.
int qc_cuda_fake_quant_params(const qc_cuda_quant_args* a, const void* x, int x_dtype, const float* scale,
                              const float* zp, void* y, bool* mask, void* stream);

// Bytes of device workspace that qc_cuda_lsq_backward needs (per-segment partial sums).
size_t qc_cuda_lsq_workspace(const qc_cuda_quant_args* a);
// LSQ backward: grad_x (grad's dtype), gs / gz float32 [groups] sums of grad * dx^/ds and
// grad * dx^/dz (gz NULL when symmetric), combined in a fixed order (deterministic).
int qc_cuda_lsq_backward(const qc_cuda_quant_args* a, const void* x, int x_dtype, const void* grad,
                         int g_dtype, const float* scale, const float* zp, void* grad_x, float* gs,
                         float* gz, void* workspace, void* stream);

// q: int8 codes [rows, k] -> int32 words [rows, ceil(k / (32 / bits))].
int qc_cuda_pack_int32(const int8_t* q, int32_t* out, int64_t rows, int64_t k, int bits, void* stream);
int qc_cuda_unpack_int32(const int32_t* packed, int8_t* out, int64_t rows, int64_t words,
                         int64_t length, int bits, void* stream);

// workspace: qc_cuda_onebit_workspace(n) bytes.
size_t qc_cuda_onebit_workspace(int64_t n);
int qc_cuda_onebit_compress(const void* x, int x_dtype, const float* error, uint8_t* packed,
                            float* scale, float* new_error, int64_t n, void* workspace, void* stream);
int qc_cuda_onebit_decode_average(const uint8_t* packed, const float* scales, float* out,
                                  int64_t P, int64_t m, void* stream);
// packed: P rows of m bytes, row_stride bytes apart -> out float32 [P, 8 m], row r = sign * s_r.
int qc_cuda_onebit_decode(const uint8_t* packed, int64_t row_stride, const float* scales, float* out,
                          int64_t P, int64_t m, void* stream);

#ifdef __cplusplus
}
#endif
