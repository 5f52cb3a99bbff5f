// Low-bit weight layout of the fused matmul kernels (load_quantized(mode="fast")) and the math
// they share: csrc/cpu/lowbit_gemm.cpp (scalar, AVX2, AVX-512, AVX-512 VNNI) and
// csrc/cuda/lowbit_gemm.cu all decode codes and combine integer sums with these functions (the
// vector paths compute the same expressions lane by lane).
//
// Layout ("blocked"): a weight [N, K] with one scale (and zero point) per row and per group of
// G consecutive columns is stored as
//   - codes u = q + 2^(c-1), unsigned, in a c = 2, 4 or 8 bit container (2: 1/2-bit weights,
//     4: 3/4-bit, 8: 5..8-bit);
//   - every group padded with zero weights (u = o) to Gp = a multiple of 8 (2-bit: 16) columns,
//     so a 4-byte lane never straddles two groups: padded width Kp = ng * Gp;
//   - rows in blocks of kRows = 16; per block, per chunk of 4 bytes x 16 rows (64 bytes, one
//     512-bit vector): lane r holds row r's codes for 32 / c columns: column i of the chunk is in
//     byte i % 4 at bit (i / 4) * c (8-bit: byte i = column i; 4-bit: byte i holds columns i and
//     i + 4; 2-bit: columns i, i + 4, i + 8, i + 12), so masking a lane's bytes at one bit offset
//     gives 4 consecutive columns, one per byte (what vpdpbusd multiplies);
//   - scales float [Nb][ng][16]; offsets o = 2^(c-1) + zero point, uint8 [Nb][ng][16] (absent
//     when symmetric: o = 2^(c-1)).
// Rows past N (last block) are zero weights with scale 0.
#pragma once

#include <math.h>
#include <stddef.h>
#include <stdint.h>

#if !defined(QC_HD)
#if defined(__CUDACC__)
#define QC_HD __host__ __device__ __forceinline__
#else
#define QC_HD inline
#endif
#endif

namespace qc {
namespace lowbit {

constexpr int kRows = 16;          // output rows per block
constexpr int kLaneBytes = 4;      // bytes per (row, chunk)
constexpr int kChunkBytes = kRows * kLaneBytes;
constexpr int kKAlign = 8;         // groups are padded to a multiple of this many columns (2-bit: 16)
// Longest group: keeps every int32 sum of the W-A8 path exact (a8_group: each of its three
// terms is at most 255 * 128 * 16384 < 2^29).
constexpr int64_t kMaxGroup = 16384;

struct Geometry {
  int64_t n, k, group, ng, gp, kp, nb;  // rows, columns, group length, groups, padded group, Kp, blocks
  int cbits;                             // container: 2, 4 or 8
  QC_HD int64_t k_per_chunk() const { return 32 / cbits; }
  QC_HD int64_t chunks() const { return kp / k_per_chunk(); }            // per block
  QC_HD int64_t block_bytes() const { return chunks() * kChunkBytes; }
  QC_HD int64_t group_len(int64_t g) const {                             // real columns of group g
    const int64_t rest = k - g * group;
    return rest < group ? rest : group;
  }
};

QC_HD Geometry make_geometry(int64_t n, int64_t k, int64_t group, int cbits) {
  Geometry g;
  g.n = n;
  g.k = k;
  g.group = group;
  g.ng = group > 0 ? (k + group - 1) / group : 0;
  const int64_t align = cbits == 2 ? 2 * kKAlign : kKAlign;
  g.gp = (group + align - 1) / align * align;
  g.kp = g.ng * g.gp;
  g.nb = (n + kRows - 1) / kRows;
  g.cbits = cbits;
  return g;
}

// Padded column of real column k.
QC_HD int64_t padded_col(const Geometry& g, int64_t k) { return (k / g.group) * g.gp + k % g.group; }

// Byte offset of the lane of row n that holds padded column kk.
QC_HD int64_t lane_offset(const Geometry& g, int64_t n, int64_t kk) {
  const int64_t b = n / kRows, r = n % kRows, c = kk / g.k_per_chunk();
  return b * g.block_bytes() + c * kChunkBytes + r * kLaneBytes;
}

// Bit position of column kk's code inside its 32-bit lane.
QC_HD int code_shift(int cbits, int64_t kk) {
  const int i = static_cast<int>(kk % (32 / cbits));
  return (i & 3) * 8 + (i >> 2) * cbits;
}

// Unsigned code u of row n, padded column kk.
QC_HD int code_at(const uint8_t* packed, const Geometry& g, int64_t n, int64_t kk) {
  const uint8_t* lane = packed + lane_offset(g, n, kk);
  const int sh = code_shift(g.cbits, kk);
  return (lane[sh / 8] >> (sh % 8)) & ((1 << g.cbits) - 1);
}

// Index of (row n, group gi) in the [Nb][ng][16] per-group arrays.
QC_HD int64_t param_index(const Geometry& g, int64_t n, int64_t gi) {
  return ((n / kRows) * g.ng + gi) * kRows + n % kRows;
}

QC_HD int code_bias(int cbits) { return 1 << (cbits - 1); }

// o = 2^(c-1) + zero point: u - o is the integer q - zp of the exported tensors.
QC_HD int offset_of(int cbits, int zero_point) { return code_bias(cbits) + zero_point; }

// The float weight, bit for bit the exact path's (reader.dequantize_record: (q - zp) * s in
// fp32): u - o is an exact small integer, the multiply rounds once.
QC_HD float dequant(int u, int o, float s) { return static_cast<float>(u - o) * s; }

// sum over one group of a * w, a = q_x - z_x (activation integers), w = u - o (weight integers),
// from dot = sum u * q_x (what VNNI / maddubs compute on the stored codes), xsum = sum q_x and
// wsum = sum w over the padded group (padding: q_x = 0 and w = 0, so it changes no sum):
//   sum (q_x - z_x)(u - o) = sum u q_x - o sum q_x - z_x sum (u - o).
QC_HD int32_t a8_group(int32_t dot, int o, int32_t xsum, int zx, int32_t wsum) {
  return dot - o * xsum - zx * wsum;
}

// wsum from usum = sum u over the padded group (computed on the fly, only when z_x != 0: a dot
// product of the codes with ones); padding holds u = o.
QC_HD int32_t group_wsum(int32_t usum, int o, int64_t gp) { return usum - o * static_cast<int32_t>(gp); }

// ---- activation epilogue (lowbit_linear's `act`: the activation that follows the layer, applied
// to each output before it is stored; load_quantized(mode="fast") fuses BERT's GELU this way) ----

enum Act : int { kActNone = 0, kActGelu = 1, kActRelu = 2, kActGeluTanh = 3, kActSilu = 4 };

// GELU, x * Phi(x) = x / 2 * (1 + erf(x / sqrt 2)), with erf from Abramowitz & Stegun 7.1.28:
// 1 - erf(u) = p(u)^-16 for u >= 0, p = 1 + a1 u + ... + a6 u^6 (|error| <= 3e-7); p rounds once per
// Horner step, which its 16th power amplifies, so with float rounding the result is within about
// 1e-6 |x| of torch's GELU (tests/test_lowbit_kernels.py asserts 2e-6 |x| + 1e-6 |gelu|). For x < 0
// the tail x / 2 * p^-16 has no cancellation. Every step is one IEEE operation (explicit fma), so
// the AVX-512 epilogue, which computes these steps lane by lane, gives the same bits.
QC_HD float gelu_erf(float x) {
  const float u = (x < 0.0f ? -x : x) * 0.70710678118654752f;
  float p = fmaf(u, 4.30638e-5f, 2.765672e-4f);
  p = fmaf(p, u, 1.520143e-4f);
  p = fmaf(p, u, 9.2705272e-3f);
  p = fmaf(p, u, 4.22820123e-2f);
  p = fmaf(p, u, 7.05230784e-2f);
  p = fmaf(p, u, 1.0f);
  p = p * p;
  p = p * p;
  p = p * p;
  p = p * p;
  const float tail = 1.0f / p;   // 1 - erf(u)
  return 0.5f * x * (x < 0.0f ? tail : 2.0f - tail);
}

// e^t for the tanh GELU: t clamped to [-87.3, 88.7] (NaN passes), t = n ln2 + r with n = rint(t / ln2)
// and ln2 in two parts, e^r by its degree-6 Taylor polynomial on |r| <= ln2 / 2 (within 2e-7
// relative), then 2^n exactly (ldexp; the AVX-512 twin uses scalef, the same scaling).
QC_HD float exp_bounded(float t) {
  t = t < -87.3f ? -87.3f : t;
  t = t > 88.7f ? 88.7f : t;
  const float n = rintf(t * 1.44269504088896341f);
  float r = fmaf(n, -0.693145751953125f, t);
  r = fmaf(n, -1.428606765330187e-06f, r);
  float p = fmaf(r, 1.0f / 720.0f, 1.0f / 120.0f);
  p = fmaf(p, r, 1.0f / 24.0f);
  p = fmaf(p, r, 1.0f / 6.0f);
  p = fmaf(p, r, 0.5f);
  p = fmaf(p, r, 1.0f);
  p = fmaf(p, r, 1.0f);
  return n == n ? ldexpf(p, static_cast<int>(n)) : p;
}

// GELU's tanh form (GPT-2's gelu_new, nn.GELU(approximate="tanh")), x / 2 (1 + tanh(u)) with
// u = sqrt(2 / pi) (x + 0.044715 x^3), computed as x / (1 + e^(-2u)) (the same function, no
// cancellation for x < 0); within 2e-6 |x| of torch's (tests/test_lowbit_kernels.py).
QC_HD float gelu_tanh(float x) {
  const float inner = fmaf(0.044715f, x * x * x, x);
  const float e = exp_bounded(-1.5957691216057308f * inner);   // -2 sqrt(2 / pi) inner
  return x / (1.0f + e);
}

// SiLU (Llama's gate activation), x * sigmoid(x) = x / (1 + e^-x); within 1e-6 |x| of torch's
// (tests/test_lowbit_kernels.py).
QC_HD float silu(float x) { return x / (1.0f + exp_bounded(-x)); }

QC_HD float apply_act(float v, int act) {
  if (act == kActGelu) return gelu_erf(v);
  if (act == kActGeluTanh) return gelu_tanh(v);
  if (act == kActSilu) return silu(v);
  if (act == kActRelu) return v > 0.0f || v != v ? v : 0.0f;   // NaN passes, as torch.relu
  return v;
}

}  // namespace lowbit
}  // namespace qc

// CUDA launchers (csrc/cuda/lowbit_gemm.cu), plain C types; 0 on success, else a cudaError_t.
// x / y dtype codes as in cuda_launchers.h: 0 float32, 1 bfloat16, 2 float16.
#ifdef __cplusplus
extern "C" {
#endif

// y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]); x [m, k] row-major, y [m, n].
int qc_cuda_lowbit_linear(const void* x, int x_dtype, const uint8_t* packed, const float* scales,
                          const uint8_t* offsets, const float* bias, void* y, int64_t m, int64_t n,
                          int64_t k, int64_t group, int cbits, void* stream);

// y[i] = apply_act(y[i], act) in place for count elements of dtype y_dtype (0 float32, 1 bf16, 2 fp16).
int qc_cuda_lowbit_act(void* y, int y_dtype, int64_t count, int act, void* stream);

// y[m, n] = x_scale[m] * sum_g scale[n, g] * a8_group(...) (+ bias[n]); xq int8 codes [m, k],
// x_zp int32 [m] or NULL (symmetric).
int qc_cuda_lowbit_linear_a8(const int8_t* xq, const float* x_scale, const int32_t* x_zp,
                             const uint8_t* packed, const float* scales, const uint8_t* offsets,
                             const float* bias, void* y, int y_dtype, int64_t m, int64_t n, int64_t k,
                             int64_t group, int cbits, void* stream);

#ifdef __cplusplus
}
#endif
