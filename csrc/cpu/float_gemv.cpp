// Float matmul for a few tokens (the decode step of an unquantized layer, an LLM's lm_head above
// all): y = x @ w^T (+ bias) with w float32 or bfloat16 [N, K] and at most kMaxTokens rows of x.
// At one token this is a matrix-vector product bound by reading w once; torch's CPU matmul runs it
// at a half (float32) to a third (bfloat16) of the bandwidth, and float32 at 8 tokens about 3x slower
// than at one (benchmarks/experiments/float_gemv.py). Here every 4 weight rows are read once per
// 4 tokens (twice for 5-8 tokens, the second time from L1), products and sums in float32
// (bfloat16 weights widened exactly), rounded once to x's dtype at the store: torch's numerics up to
// the order of the float32 sums.
// Instruction set: lowbit_gemm.cpp's choice (QCOMPRESS_LOWBIT_ISA / the lowbit_isa op caps it).
#include "float_gemv.h"

#include "qcompress/check.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "lowbit_gemm.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define QC_FG_X86 1
#include <immintrin.h>
#endif

namespace qc {
namespace float_gemv {
namespace {

constexpr int kRowTile = 4;  // weight rows per tile
constexpr int kTokTile = 4;  // tokens per pass over a tile

inline float widen(float v) { return v; }
inline float widen(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// out[t][r] = sum_k x[t][k] * w[n0 + r][k] for rows [n0, n0 + nr), tokens [0, mt); scalar.
template <typename W>
void tile_scalar(const W* w, int64_t k, int64_t n0, int nr, const float* x, int mt, float* out) {
  for (int t = 0; t < mt; ++t)
    for (int r = 0; r < nr; ++r) {
      const W* wr = w + (n0 + r) * k;
      const float* xt = x + t * k;
      float acc = 0.0f;
      for (int64_t j = 0; j < k; ++j) acc += xt[j] * widen(wr[j]);
      out[t * kRowTile + r] = acc;
    }
}

}  // namespace

#if defined(QC_FG_X86)
#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace avx2 {
namespace {
struct VF {
  static constexpr int L = 8;
  using F = __m256;
  static F zero() { return _mm256_setzero_ps(); }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static F load(const uint16_t* p) {
    const __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
  }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static float sum(F v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
};
#include "float_gemv_tile.inc"
}  // namespace
void tile(const float* w, int64_t k, int64_t n0, int nr, const float* x, int mt, float* out) {
  vec_tile<float>(w, k, n0, nr, x, mt, out);
}
void tile(const uint16_t* w, int64_t k, int64_t n0, int nr, const float* x, int mt, float* out) {
  vec_tile<uint16_t>(w, k, n0, nr, x, mt, out);
}
}  // namespace avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")
namespace avx512 {
namespace {
struct VF {
  static constexpr int L = 16;
  using F = __m512;
  static F zero() { return _mm512_setzero_ps(); }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static F load(const uint16_t* p) {
    const __m512i u = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
  }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static float sum(F v) { return _mm512_reduce_add_ps(v); }
};
#include "float_gemv_tile.inc"
}  // namespace
void tile(const float* w, int64_t k, int64_t n0, int nr, const float* x, int mt, float* out) {
  vec_tile<float>(w, k, n0, nr, x, mt, out);
}
void tile(const uint16_t* w, int64_t k, int64_t n0, int nr, const float* x, int mt, float* out) {
  vec_tile<uint16_t>(w, k, n0, nr, x, mt, out);
}
}  // namespace avx512
#pragma GCC pop_options
#endif  // QC_FG_X86

namespace {

template <typename W>
void run_tile(int level, const W* w, int64_t k, int64_t n0, int nr, const float* x, int mt, float* out) {
#if defined(QC_FG_X86)
  if (level >= 2) return avx512::tile(w, k, n0, nr, x, mt, out);
  if (level >= 1) return avx2::tile(w, k, n0, nr, x, mt, out);
#endif
  (void)level;
  tile_scalar<W>(w, k, n0, nr, x, mt, out);
}

// y [m, n] (float32) = x [m, k] (float32) @ w^T (+ bias float32), rows split over threads.
template <typename W>
void gemv(const W* w, const float* x, const float* bias, float* y, int64_t m, int64_t n, int64_t k) {
  const int level = lowbit_isa_level();
  const int64_t tiles = (n + kRowTile - 1) / kRowTile;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(k * kRowTile, 1));
  at::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) {
    float out[kTokTile * kRowTile];
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * kRowTile;
      const int nr = static_cast<int>(std::min<int64_t>(kRowTile, n - n0));
      for (int64_t m0 = 0; m0 < m; m0 += kTokTile) {
        const int mt = static_cast<int>(std::min<int64_t>(kTokTile, m - m0));
        run_tile<W>(level, w, k, n0, nr, x + m0 * k, mt, out);
        for (int i = 0; i < mt; ++i)
          for (int r = 0; r < nr; ++r)
            y[(m0 + i) * n + n0 + r] = out[i * kRowTile + r] + (bias ? bias[n0 + r] : 0.0f);
      }
    }
  });
}

}  // namespace
}  // namespace float_gemv

at::Tensor float_gemv_cpu(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  using namespace float_gemv;
  const auto dt = weight.scalar_type();
  QC_CHECK(dt == at::kFloat || dt == at::kBFloat16, "qcompress.float_gemv: weight must be float32 or bfloat16, got ",
           c10::toString(dt));
  QC_CHECK(x.scalar_type() == dt, "qcompress.float_gemv: x (", c10::toString(x.scalar_type()),
           ") and weight (", c10::toString(dt), ") must have one dtype");
  QC_CHECK(weight.dim() == 2 && x.dim() >= 1, "qcompress.float_gemv: weight must be [N, K] and x [..., K]");
  const int64_t n = weight.size(0), k = weight.size(1);
  QC_CHECK(x.size(-1) == k, "qcompress.float_gemv: x has ", x.size(-1), " columns, weight ", k);
  int64_t m = 1;
  for (int64_t d = 0; d + 1 < x.dim(); ++d) m *= x.size(d);
  QC_CHECK(m <= kMaxTokens, "qcompress.float_gemv: at most ", kMaxTokens, " rows of x, got ", m);
  if (bias) {
    QC_CHECK(bias->dim() == 1 && bias->size(0) == n, "qcompress.float_gemv: bias must be [", n, "]");
  }
  auto sizes = x.sizes().vec();
  sizes.back() = n;
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const at::Tensor wc = weight.contiguous();
  const at::Tensor bf = bias ? bias->to(at::kFloat).contiguous() : at::Tensor();
  at::Tensor y = at::empty({m, n}, x.options().dtype(at::kFloat));
  if (m > 0 && n > 0) {
    const float* bp = bias ? bf.data_ptr<float>() : nullptr;
    if (dt == at::kFloat)
      gemv<float>(wc.data_ptr<float>(), xf.data_ptr<float>(), bp, y.data_ptr<float>(), m, n, k);
    else
      gemv<uint16_t>(reinterpret_cast<const uint16_t*>(wc.data_ptr<at::BFloat16>()), xf.data_ptr<float>(), bp,
                     y.data_ptr<float>(), m, n, k);
  }
  return y.to(dt).reshape(sizes);
}

}  // namespace qc
