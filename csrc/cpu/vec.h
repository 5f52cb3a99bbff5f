// at::vec glue for the shared element math: Ops<Vectorized<float>>, loads/stores that convert
// fp32/bf16/fp16 to float32 lanes, bool-mask stores, and the stochastic-rounding noise.
#pragma once

#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "qcompress/math.h"

namespace qc {

using V = at::vec::Vectorized<float>;
constexpr int kW = V::size();
static_assert(kW == 8, "the CPU kernels assume 8 float lanes (AVX2 or the 256-bit generic path)");

template <>
struct Ops<V> {
  using Mask = V;  // all-ones lanes where true
  static V round(V v) { return v.round(); }  // half to even
  static V floor(V v) { return v.floor(); }
  static V lt(V a, V b) { return a < b; }
  static V gt(V a, V b) { return a > b; }
  static V ge(V a, V b) { return a >= b; }
  static V le(V a, V b) { return a <= b; }
  static V eq(V a, V b) { return a == b; }
  static V isnan(V v) { return v.isnan(); }
  static V neg(V v) { return v.neg(); }
  static V both(V a, V b) { return a & b; }
  static V select(V m, V a, V b) { return V::blendv(b, a, m); }
  static V abs(V v) { return v.abs(); }
};

#if defined(CPU_CAPABILITY_AVX2)
// clamp_code for vectors (overload of math.h's template): max_ps/min_ps return their second
// operand when either is NaN or both are equal, so NaN passes through and ties keep r, exactly
// as the select-based template; 2 ops instead of 4.
inline V clamp_code(V r, V qmin, V qmax) {
  return _mm256_min_ps(qmax, _mm256_max_ps(qmin, r));
}

// 8 bf16 / fp16 values <-> float32 lanes (exact widening; narrowing rounds to nearest even,
// as c10::BFloat16 / c10::Half do).
inline V load8(const c10::BFloat16* p) {
  __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
inline V load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline void store8(c10::BFloat16* p, V v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}
inline void store8(c10::Half* p, V v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}
#endif

// n (1..8) values from p as float32 lanes; lanes past n are 0.
template <typename T>
inline V load_f(const T* p, int n) {
  if constexpr (std::is_same_v<T, float>) {
    return n == kW ? V::loadu(p) : V::loadu(p, n);
  } else {
#if defined(CPU_CAPABILITY_AVX2)
    if constexpr (std::is_same_v<T, c10::BFloat16> || std::is_same_v<T, c10::Half>) {
      if (n == kW) return load8(p);
    }
#endif
    float tmp[kW] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int j = 0; j < n; ++j) tmp[j] = static_cast<float>(p[j]);
    return V::loadu(tmp);
  }
}

// Store n lanes, rounding to T (round to nearest even, as torch's .to(dtype)).
template <typename T>
inline void store_f(T* p, V v, int n) {
  if constexpr (std::is_same_v<T, float>) {
    if (n == kW) v.store(p); else v.store(p, n);
  } else {
#if defined(CPU_CAPABILITY_AVX2)
    if constexpr (std::is_same_v<T, c10::BFloat16> || std::is_same_v<T, c10::Half>) {
      if (n == kW) return store8(p, v);
    }
#endif
    float tmp[kW];
    v.store(tmp);
    for (int j = 0; j < n; ++j) p[j] = static_cast<T>(tmp[j]);
  }
}

// Largest finite value of a storage type, as float (fp32 FLT_MAX, bf16 (2 - 2^-7) 2^127, fp16 65504).
template <typename T>
constexpr float finite_max() {
  if constexpr (std::is_same_v<T, c10::Half>) return 65504.0f;
  else if constexpr (std::is_same_v<T, c10::BFloat16>) return 0x1.fep127f;
  else return 3.40282346638528859812e+38f;
}

// A dequantized value stored saturated (qc::saturate): finite in, finite out.
template <typename T>
inline void store_sat(T* p, V v, int n) { store_f(p, saturate(v, V(finite_max<T>())), n); }

// Integer-valued float lanes to an integer type (values are already clamped into range).
template <typename Q>
inline void store_int(Q* p, V v, int n) {
#if defined(CPU_CAPABILITY_AVX2)
  if (n == kW) {  // the lanes hold integers (exact), or NaN (INT32_MIN, like the scalar cast)
    const __m256i i32 = _mm256_cvtps_epi32(v);
    if constexpr (std::is_same_v<Q, int8_t>) {  // low byte of each lane, as static_cast<int8_t>
      const __m256i low = _mm256_shuffle_epi8(
          i32, _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1));
      const int32_t a = _mm_cvtsi128_si32(_mm256_castsi256_si128(low));
      const int32_t b = _mm_cvtsi128_si32(_mm256_extracti128_si256(low, 1));
      std::memcpy(p, &a, 4);
      std::memcpy(p + 4, &b, 4);
      return;
    } else if constexpr (std::is_same_v<Q, int32_t>) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), i32);
      return;
    }
  }
#endif
  float tmp[kW];
  v.store(tmp);
  for (int j = 0; j < n; ++j) p[j] = static_cast<Q>(static_cast<int32_t>(tmp[j]));
}

struct BoolBytes {  // byte pattern of 8 bools for each 8-bit mask
  uint64_t v[256];
  BoolBytes() {
    for (int b = 0; b < 256; ++b) {
      uint64_t w = 0;
      for (int j = 0; j < 8; ++j) w |= static_cast<uint64_t>((b >> j) & 1) << (8 * j);
      v[b] = w;
    }
  }
};
inline const BoolBytes& bool_bytes() {
  static const BoolBytes t;
  return t;
}

inline uint32_t mask_bits(V m) {
#if defined(CPU_CAPABILITY_AVX2)
  return static_cast<uint32_t>(_mm256_movemask_ps(m));
#else
  uint32_t w[kW];
  std::memcpy(w, &m, sizeof(w));
  uint32_t b = 0;
  for (int j = 0; j < kW; ++j) b |= (w[j] >> 31) << j;
  return b;
#endif
}

inline void store_mask(bool* p, V m, int n) {
  uint64_t w = bool_bytes().v[mask_bits(m) & 0xFF];
  if (n == kW) std::memcpy(p, &w, 8);
  else std::memcpy(p, &w, static_cast<size_t>(n));
}

#if defined(CPU_CAPABILITY_AVX2)
// uniform(key, lo + j) for j = 0..7 with AVX2 integer lanes (same arithmetic as math.h).
inline V uniform8(uint32_t key, uint32_t lo) {
  __m256i v = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(lo)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  v = _mm256_xor_si256(v, _mm256_set1_epi32(static_cast<int>(key)));
  v = _mm256_xor_si256(v, _mm256_srli_epi32(v, 16));
  v = _mm256_mullo_epi32(v, _mm256_set1_epi32(0x7FEB352D));
  v = _mm256_xor_si256(v, _mm256_srli_epi32(v, 15));
  v = _mm256_mullo_epi32(v, _mm256_set1_epi32(static_cast<int>(0x846CA68Bu)));
  v = _mm256_xor_si256(v, _mm256_srli_epi32(v, 16));
  v = _mm256_srli_epi32(v, 8);  // 24 bits: exact in float32
  return _mm256_mul_ps(_mm256_cvtepi32_ps(v), _mm256_set1_ps(0x1p-24f));
}
#endif

// Stochastic-rounding noise u(seed, idx0 + j), j < n, with the per-2^32 key cached.
struct Noise {
  uint32_t seed;
  int64_t hi = -1;
  uint32_t key = 0;
  explicit Noise(uint32_t s) : seed(s) {}
  uint32_t key_for(int64_t idx) {
    int64_t h = idx >> 32;
    if (h != hi) { hi = h; key = rng_key(seed, static_cast<uint32_t>(h)); }
    return key;
  }
  V get(int64_t idx0, int n) {
    float u[kW] = {0, 0, 0, 0, 0, 0, 0, 0};
    if ((idx0 >> 32) == ((idx0 + n - 1) >> 32)) {
      const uint32_t k = key_for(idx0);
      const uint32_t lo = static_cast<uint32_t>(idx0);
#if defined(CPU_CAPABILITY_AVX2)
      return uniform8(k, lo);
#else
      for (int j = 0; j < kW; ++j) u[j] = uniform(k, lo + static_cast<uint32_t>(j));
#endif
    } else {
      for (int j = 0; j < n; ++j) u[j] = uniform(key_for(idx0 + j), static_cast<uint32_t>(idx0 + j));
    }
    return V::loadu(u);
  }
};

}  // namespace qc
