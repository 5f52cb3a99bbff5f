// C entry point of the float formats' CUDA kernel (csrc/cuda/floats.cu), for its torch glue
// (csrc/cuda_floats.cpp). Plain C types only. Returns 0 or a cudaError_t code.
#pragma once

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// x, y: [rows, cols] of dtype x_dtype (0 float32, 1 bfloat16, 2 float16); scale: one value per
// block_rows x block_cols block, row-major over blocks, of dtype s_dtype (float32 or x_dtype);
// bits 8: e4m3, 4: E2M1 (qcompress/float_math.h).
int qc_cuda_float_fake_quant(const void* x, int x_dtype, const void* scale, int s_dtype, void* y,
                             int64_t rows, int64_t cols, int64_t block_rows, int64_t block_cols, int bits,
                             void* stream);

#ifdef __cplusplus
}
#endif
