// Per-element math of the float formats (FP8 e4m3, E2M1 for NVFP4 / MXFP4), shared by the CPU
// kernel (csrc/cpu/floats.cpp) and the CUDA kernel (csrc/cuda/floats.cu). It reproduces
// qcompress/quant/floats.py (itself compressed-tensors 0.20's op order) bit for bit:
//   v = round_Q(x / s) + 0      Q: float32, or the dtype shared by x and the scale
//   c = grid(clamp(v, -qmax, qmax))   e4m3: round half to even; E2M1: {0,.5,1,1.5,2,3,4,6}, ties even
//   y = round_D(round_S(c * s))  S: the scale's dtype, D: x's dtype
// No FMA contraction may fuse c * s with anything (built with -ffp-contract=off / --fmad=false).
#pragma once

#include <stdint.h>
#include <string.h>
#include <math.h>

#if defined(__CUDACC__)
#define QC_FM_HD __host__ __device__ __forceinline__
#else
#define QC_FM_HD inline
#endif

namespace qc {
namespace fmath {

// storage dtype codes: 0 float32, 1 bfloat16, 2 float16
enum { kF32 = 0, kBF16 = 1, kF16 = 2 };

QC_FM_HD uint32_t bits_of(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof(u));
  return u;
}

QC_FM_HD float from_bits(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof(f));
  return f;
}

// Nearest value with `mbits` stored mantissa bits and smallest normal exponent `emin` (round half
// to even; below 2^emin the subnormal step 2^(emin - mbits)). Finite inputs only.
QC_FM_HD float round_mantissa(float v, int mbits, int emin) {
  const float a = fabsf(v);
  if (a < ldexpf(1.0f, emin)) {
    const float step = ldexpf(1.0f, emin - mbits);
    return copysignf(rintf(a / step) * step, v);  // a / step is exact: a power-of-two scaling
  }
  const int drop = 23 - mbits;
  uint32_t u = bits_of(a);
  u += ((1u << (drop - 1)) - 1u) + ((u >> drop) & 1u);
  u &= ~((1u << drop) - 1u);
  return copysignf(from_bits(u), v);
}

// float32 -> the storage dtype's value (as a float): RNE, as c10::BFloat16 / c10::Half convert
QC_FM_HD float round_to(float v, int dtype) {
  if (dtype == kBF16) {
    uint32_t u = bits_of(v);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return from_bits(u & 0xFFFF0000u);
  }
  if (dtype == kF16) return round_mantissa(v, 10, -14);
  return v;
}

QC_FM_HD float e4m3(float v) { return round_mantissa(v, 3, -6); }

// compressed-tensors' cast_to_fp4 thresholds: ties go to the even neighbour
QC_FM_HD float e2m1(float v) {
  const float a = fabsf(v);
  float m;
  if (a <= 0.25f) m = 0.0f;
  else if (a < 0.75f) m = 0.5f;
  else if (a <= 1.25f) m = 1.0f;
  else if (a < 1.75f) m = 1.5f;
  else if (a <= 2.5f) m = 2.0f;
  else if (a < 3.5f) m = 3.0f;
  else if (a <= 5.0f) m = 4.0f;
  else m = 6.0f;
  // sign(v) * m: +0 stays +0 (v == 0 is +0 here), negatives keep their sign, also at zero
  return v == 0.0f ? 0.0f : copysignf(m, v);
}

// One element: x and s as floats (their stored values), bits 8 (e4m3) or 4 (E2M1).
QC_FM_HD float fake_quant(float x, float s, int bits, int q_dtype, int s_dtype, int x_dtype) {
  const float qmax = bits == 8 ? 448.0f : 6.0f;
  float v = round_to(x / s, q_dtype) + 0.0f;  // the zero point's add: -0 becomes +0
  v = v < -qmax ? -qmax : (v > qmax ? qmax : v);  // no NaN reaches here: plain compares inline
  const float c = bits == 8 ? e4m3(v) : e2m1(v);
  return round_to(round_to(c * s, s_dtype), x_dtype);
}

}  // namespace fmath
}  // namespace qc
