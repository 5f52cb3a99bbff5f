// Per-element quantizer math, shared by the CPU and CUDA kernels.
//
// Bit-identical to qcompress/quant/reference.py, rng.py and onebit.py: every operation is a
// single IEEE float32 operation in the same order as the reference (true division, no FMA:
// build with -ffp-contract=off / --fmad=false), round() is half to even, and sums that the
// reference does in float64 are done in double here too.
//
// The element functions are templates over the value type F so that the CPU kernels can run
// them on at::vec::Vectorized<float> and the CUDA kernels on float: the per-type primitives
// (round, floor, compare, select) live in the Ops<F> traits; Ops<float> is defined here.
#pragma once

#include <stdint.h>

#include <cmath>

#if defined(__CUDACC__)
#define QC_HD __host__ __device__ __forceinline__
#else
#define QC_HD inline
#endif

namespace qc {

// Scale floor (2^-100): a zero-range group gets this scale, never 0 or NaN.
constexpr float kEps = 0x1p-100f;

enum Kind : int { kInt = 0, kBinary = 1, kTernary = 2 };
enum Rounding : int { kNearest = 0, kStochastic = 1 };

// ---- counter-based uniform numbers (rng.py) -----------------------------------------------------

QC_HD uint32_t hash32(uint32_t x) {  // "lowbias32" xorshift-multiply mixer
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x;
}

// Per-seed key for element indices sharing the high 32 bits idx_hi.
QC_HD uint32_t rng_key(uint32_t seed, uint32_t idx_hi) { return hash32(hash32(idx_hi) ^ seed); }

// u(seed, i) in [0, 1): 24 random bits, exactly representable in float32.
QC_HD float uniform(uint32_t key, uint32_t idx_lo) {
  return static_cast<float>(hash32(idx_lo ^ key) >> 8) * 0x1p-24f;
}

// ---- scalar helpers with torch's NaN semantics ----------------------------------------------------

QC_HD bool is_nan(float v) { return v != v; }
QC_HD bool is_finite(float v) { return v == v && v - v == 0.0f; }
// torch.minimum / torch.maximum / amin / amax: NaN wins.
QC_HD float nan_min(float a, float b) { return is_nan(a) ? a : (is_nan(b) ? b : (b < a ? b : a)); }
// nan_max, clamp_min, clamp_max and fabs_ are generic (float and CPU vectors) below, with Ops.
QC_HD float rint_(float v) {  // half to even under the default rounding mode
#if defined(__CUDA_ARCH__)
  return rintf(v);
#else
  return std::nearbyint(v);
#endif
}

// ---- per-group parameters ---------------------------------------------------------------------

struct Params {
  float scale;  // s
  float zp;     // default asymmetric: integer zero point; deepspeed asymmetric: -round(lo / s)
  float z;      // deepspeed asymmetric: float zero offset round(lo / s) * s, else 0
  float thr;    // ternary threshold 0.7 mean|x|
};

template <class F>
struct Ops;

// Generic over the value type (float on CUDA and in scalar code, Vectorized<float> on the CPU).
template <class F>
QC_HD F nan_max(F a, F b) {  // torch.maximum / amax: NaN wins
  using O = Ops<F>;
  return O::select(O::isnan(a), a, O::select(O::isnan(b), b, O::select(O::gt(b, a), b, a)));
}
// tensor.clamp(min=lo) / clamp(max=hi): NaN passes through.
template <class F>
QC_HD F clamp_min(F v, F lo) { using O = Ops<F>; return O::select(O::lt(v, lo), lo, v); }
template <class F>
QC_HD F clamp_max(F v, F hi) { using O = Ops<F>; return O::select(O::gt(v, hi), hi, v); }
template <class F>
QC_HD F fabs_(F v) {  // +0 for either zero, NaN passes through
  using O = Ops<F>;
  return O::select(O::lt(v, F(0.0f)), O::neg(v), O::select(O::eq(v, F(0.0f)), F(0.0f), v));
}

template <>
struct Ops<float> {
  using Mask = bool;
  static QC_HD float round(float v) { return rint_(v); }
  static QC_HD float floor(float v) {
#if defined(__CUDA_ARCH__)
    return floorf(v);
#else
    return std::floor(v);
#endif
  }
  static QC_HD bool lt(float a, float b) { return a < b; }
  static QC_HD bool gt(float a, float b) { return a > b; }
  static QC_HD bool ge(float a, float b) { return a >= b; }
  static QC_HD bool le(float a, float b) { return a <= b; }
  static QC_HD bool eq(float a, float b) { return a == b; }
  static QC_HD bool isnan(float v) { return v != v; }
  static QC_HD float neg(float v) { return -v; }
  static QC_HD bool both(bool a, bool b) { return a && b; }
  static QC_HD float select(bool m, float a, float b) { return m ? a : b; }
  static QC_HD float abs(float v) { return fabs_(v); }
};

// Integer quantizer of a group from its range [lo, hi] (over its real elements, or the static
// range), generic over the value type so that the CPU kernels compute 8 groups per vector; the
// scalar int_params below is its float instance (CUDA, per-tensor paths).
template <class F>
struct ParamsT {
  F scale, zp, z;  // as Params
};

// (hi - lo) / d; where hi - lo overflows (finite values near FLT_MAX) the halves' difference over
// d / 2 instead, so the scale stays finite (reference._range_over). For finite hi and lo, diff - diff
// is NaN exactly when diff is infinite.
template <class F>
QC_HD F range_over(F hi, F lo, F d) {
  using O = Ops<F>;
  const F diff = hi - lo;
  const F half = (hi * F(0.5f) - lo * F(0.5f)) / (d * F(0.5f));
  return O::select(O::isnan(diff - diff), half, diff / d);
}

template <class F>
QC_HD ParamsT<F> int_params_t(F lo, F hi, int bits, bool symmetric, bool deepspeed, F qmin, F qmax) {
  using O = Ops<F>;
  if (symmetric) {
    F amax = nan_max(fabs_(lo), fabs_(hi));
    // deepspeed's 2 amax / 2^b as amax / 2^(b-1): the same bits, no overflow near FLT_MAX
    F s = deepspeed ? amax / F(static_cast<float>(1 << (bits - 1))) : amax / qmax;
    return {clamp_min(s, F(kEps)), F(0.0f), F(0.0f)};
  }
  if (deepspeed) {
    // -0 + 0 = +0: the zero offset round(lo / s) * s of an all-zero group is +0 whichever zero
    // the min reduction kept (its order differs between kernels and the reference)
    lo = lo + F(0.0f);
    // step floored at the float32 resolution of the group's values (reference.qparams)
    F floor_ = nan_max(fabs_(lo), fabs_(hi)) * F(0x1p-23f);
    F s = clamp_min(nan_max(range_over(hi, lo, F(static_cast<float>(1 << bits))), floor_), F(kEps));
    F zq = O::round(lo / s);
    return {s, O::neg(zq), zq * s};
  }
  lo = clamp_max(lo, F(0.0f));
  hi = clamp_min(hi, F(0.0f));
  F s = clamp_min(range_over(hi, lo, qmax - qmin), F(kEps));
  return {s, clamp_max(clamp_min(qmin - O::round(lo / s), qmin), qmax), F(0.0f)};
}

QC_HD Params int_params(float lo, float hi, int bits, bool symmetric, bool deepspeed, float qmin,
                        float qmax) {
  const ParamsT<float> p = int_params_t<float>(lo, hi, bits, symmetric, deepspeed, qmin, qmax);
  return Params{p.scale, p.zp, p.z, 0.0f};
}

// mean|x| from a float64 sum, rounded once to float32 (reference._mean_abs).
QC_HD float mean_from_sum(double total, int64_t count) {
  return static_cast<float>(total / static_cast<double>(count < 1 ? 1 : count));
}

QC_HD float ternary_threshold(float mean_abs) { return 0.7f * mean_abs; }

// ---- elementwise: generic over the value type ----------------------------------------------------

// Rounding of v = x / s (or (x - z) / s). DS: deepspeed numerics.
template <class F, bool STOCHASTIC, bool DS>
QC_HD F round_code(F v, F u) {
  using O = Ops<F>;
  if (!STOCHASTIC) return O::round(v);
  if (DS) return O::round(v + (u - F(0.5f)));
  return O::floor(v + u);
}

// Unclamped integer code r of x (reference.quantize_view before clamp).
// ASYM_DS: deepspeed asymmetric (subtract z first, no zero point); ADD_ZP: default asymmetric.
template <class F, bool STOCHASTIC, bool DS, bool ASYM_DS, bool ADD_ZP>
QC_HD F int_code(F x, F s, F z, F zp, F u) {
  F v = ASYM_DS ? (x - z) / s : x / s;
  F r = round_code<F, STOCHASTIC, DS>(v, u);
  return ADD_ZP ? r + zp : r;
}

// torch.clamp(r, qmin, qmax): NaN passes through.
template <class F>
QC_HD F clamp_code(F r, F qmin, F qmax) {
  using O = Ops<F>;
  r = O::select(O::lt(r, qmin), qmin, r);
  return O::select(O::gt(r, qmax), qmax, r);
}

template <class F>
QC_HD typename Ops<F>::Mask inside_range(F r, F qmin, F qmax) {
  using O = Ops<F>;
  return O::both(O::ge(r, qmin), O::le(r, qmax));
}

// x^ from the clamped code q (reference.dequantize_view).
template <class F, bool ASYM_DS, bool ADD_ZP>
QC_HD F dequant_code(F q, F s, F z, F zp) {
  if (ASYM_DS) return q * s + z;
  if (ADD_ZP) return (q - zp) * s;
  return q * s;
}

// A dequantized value saturated to +-m, the largest finite value of the output type: finite
// inputs give finite outputs even where (q - zp) * s or q * s + z overshoots it (NaN passes).
template <class F>
QC_HD F saturate(F v, F m) { return clamp_max(clamp_min(v, Ops<F>::neg(m)), m); }

// Binary code: default numerics +1 for x >= 0 else -1 (NaN -> -1); deepspeed sign(x).
template <class F, bool DS>
QC_HD F binary_code(F x) {
  using O = Ops<F>;
  if (DS) return O::select(O::gt(x, F(0.0f)), F(1.0f), O::select(O::lt(x, F(0.0f)), F(-1.0f), F(0.0f)));
  return O::select(O::ge(x, F(0.0f)), F(1.0f), F(-1.0f));
}

template <class F>
QC_HD F ternary_code(F x, F thr) {
  using O = Ops<F>;
  return O::select(O::gt(x, thr), F(1.0f), O::select(O::lt(x, F(0.0f) - thr), F(-1.0f), F(0.0f)));
}

// ---- 1-bit compressor (onebit.py) ----------------------------------------------------------------

// scale = ||y|| / sqrt(n): float64 sum of squares, one rounding to float32 at the end.
QC_HD float onebit_scale(double sum_sq, int64_t n) {
  double m = sum_sq / static_cast<double>(n < 1 ? 1 : n);
#if defined(__CUDA_ARCH__)
  return static_cast<float>(sqrt(m));
#else
  return static_cast<float>(std::sqrt(m));
#endif
}

// new error = y - scale * sign, sign = +1 for y >= 0 (zero counts as positive).
QC_HD float onebit_error(float y, float scale) { return y >= 0.0f ? y - scale : y - (-scale); }

}  // namespace qc
