// Fused low-bit matmuls on the CPU for load_quantized(mode="fast"): the weight stays in its
// 4/8-bit codes (blocked layout, qcompress/lowbit.h) and is decoded in registers, never
// materialised as a float matrix.
//
// - weight-only (float32 / bfloat16 / float16 activations): per 16 output rows and column, the
//   codes are unpacked, turned into the exact path's float weight (u - o) * s, and multiplied
//   into up to 8 tokens at once (a GEMV for one token, a register-tiled GEMM for many);
// - W-A8 (int8 activation codes, e.g. dynamic per token): integer dot products of the codes
//   (AVX-512 VNNI vpdpbusd, else maddubs + madd), one int32 sum per row and group, the zero-point
//   corrections of lowbit.h's a8_group, and the scales applied once per group and token.
// - 16 tokens or more on a CPU with AMX: the tile kernels of lowbit_amx.cpp (same int32 sums
//   for W-A8; bf16 tiles with exact products for weight-only).
// Instruction set chosen at run time (scalar, AVX2, AVX-512, AVX-512 VNNI, AMX): the vector tiles are
// compiled once per ISA from lowbit_tiles.inc inside `#pragma GCC target` regions, whatever the
// flags of the rest of the extension; QCOMPRESS_LOWBIT_ISA or the lowbit_isa op caps the choice.
// Threads: row blocks split with at::parallel_for.
#include "lowbit_gemm.h"

#include "qcompress/check.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "kernels.h"
#include "lowbit_amx.h"
#include "lowbit_views.h"
#include "qcompress/lowbit.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define QC_LB_X86 1
#include <immintrin.h>
#endif

namespace qc {
namespace lowbit {
namespace {

inline int32_t load32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// y = tot * x_scale (+ bias) for one tile of A8 results (shared by every ISA).
inline void a8_store(const WView& w, const A8View& a, int64_t m0, int mt, int64_t b, const float* out) {
  for (int mm = 0; mm < mt; ++mm) {
    const float sx = a.sx[m0 + mm];
    float* yr = a.y + (m0 + mm) * w.g.n;
    for (int r = 0; r < kRows; ++r) {
      const int64_t n = b * kRows + r;
      if (n >= w.g.n) break;
      const float v = out[mm * kRows + r] * sx;
      yr[n] = a.bias ? v + a.bias[n] : v;
    }
  }
}

inline int off_at(const WView& w, int64_t n, int64_t gi) {
  return w.offs ? w.offs[param_index(w.g, n, gi)] : code_bias(w.g.cbits);
}

// ---- scalar kernels (any CPU; also the reference for the vector tiles' layout handling) ------

void wo_scalar(const WView& w, const float* x, int64_t ldx, int64_t m, const float* bias, float* y, int64_t b0,
               int64_t b1) {
  const Geometry& g = w.g;
  const int64_t n1 = std::min(b1 * kRows, g.n);
  for (int64_t n = b0 * kRows; n < n1; ++n) {
    for (int64_t mm = 0; mm < m; ++mm) {
      const float* xr = x + mm * ldx;
      float acc = 0.0f;
      for (int64_t gi = 0; gi < g.ng; ++gi) {
        const float s = w.scales[param_index(g, n, gi)];
        const int o = off_at(w, n, gi);
        for (int64_t j = 0; j < g.gp; ++j) {
          const int64_t kk = gi * g.gp + j;
          acc += xr[kk] * dequant(code_at(w.packed, g, n, kk), o, s);
        }
      }
      y[mm * g.n + n] = bias ? acc + bias[n] : acc;
    }
  }
}

void a8_scalar(const WView& w, const A8View& a, int64_t b0, int64_t b1) {
  const Geometry& g = w.g;
  const int64_t n1 = std::min(b1 * kRows, g.n);
  for (int64_t n = b0 * kRows; n < n1; ++n) {
    for (int64_t mm = 0; mm < a.m; ++mm) {
      const int8_t* xr = a.xq + mm * a.ldx;
      float tot = 0.0f;
      for (int64_t gi = 0; gi < g.ng; ++gi) {
        int32_t dot = 0, usum = 0;
        for (int64_t j = 0; j < g.gp; ++j) {
          const int64_t kk = gi * g.gp + j;
          const int u = code_at(w.packed, g, n, kk);
          dot += u * static_cast<int32_t>(xr[kk]);
          usum += u;
        }
        const int64_t idx = param_index(g, n, gi);
        const int o = off_at(w, n, gi);
        const int32_t A = a8_group(dot, o, a.xsum[mm * g.ng + gi], a.zx ? a.zx[mm] : 0, group_wsum(usum, o, g.gp));
        tot += static_cast<float>(A) * w.scales[idx];
      }
      const float v = tot * a.sx[mm];
      a.y[mm * g.n + n] = a.bias ? v + a.bias[n] : v;
    }
  }
}

}  // namespace

// ---- vector tiles, one copy per ISA -------------------------------------------------------------
#if defined(QC_LB_X86)

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {
namespace {
struct VO {
  static constexpr int L = 8;
  using F = __m256;
  using I = __m256i;
  static F fzero() { return _mm256_setzero_ps(); }
  static I izero() { return _mm256_setzero_si256(); }
  static I load(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static I load_u8(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
  static I load_i32(const int32_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static F load_f(const float* p) { return _mm256_loadu_ps(p); }
  static void store_f(float* p, F v) { _mm256_storeu_ps(p, v); }
  static F set1f(float v) { return _mm256_set1_ps(v); }
  static I set1i(int32_t v) { return _mm256_set1_epi32(v); }
  static I srli(I v, int s) { return _mm256_srli_epi32(v, s); }
  static I slli(I v, int s) { return _mm256_slli_epi32(v, s); }
  static I srai(I v, int s) { return _mm256_srai_epi32(v, s); }
  static I xori(I a, I b) { return _mm256_xor_si256(a, b); }
  static I andi(I a, I b) { return _mm256_and_si256(a, b); }
  static I addi(I a, I b) { return _mm256_add_epi32(a, b); }
  static I subi(I a, I b) { return _mm256_sub_epi32(a, b); }
  static I mullo(I a, I b) { return _mm256_mullo_epi32(a, b); }
  static F cvt(I v) { return _mm256_cvtepi32_ps(v); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  // acc += sum of 4 products u8 x s8 per lane. maddubs saturates int16 pairs above 32767: exact
  // for u <= 15 (2 * 15 * 128); 8-bit codes go through their two nibbles, u = 16 hi + lo.
  static I dot4_u4(I acc, I u, I s) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
  }
  static I dot4_u8(I acc, I u, I s) {
    const I nib = _mm256_set1_epi8(0x0F);
    const I lo = _mm256_and_si256(u, nib), hi = _mm256_and_si256(_mm256_srli_epi16(u, 4), nib);
    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(lo, s), _mm256_set1_epi16(1)));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(hi, s), _mm256_set1_epi16(16)));
  }
};
#define WO_NBLK 1
#define WO_MT 4
#define A8_MT 2
#include "lowbit_tiles.inc"
#undef WO_NBLK
#undef WO_MT
#undef A8_MT
}  // namespace
void wo(const WView& w, const float* x, int64_t ldx, int64_t m, const float* bias, float* y, int64_t b0, int64_t b1) {
  if (w.g.cbits == 2) wo_run<2>(w, x, ldx, m, bias, y, b0, b1);
  else if (w.g.cbits == 4) wo_run<4>(w, x, ldx, m, bias, y, b0, b1);
  else wo_run<8>(w, x, ldx, m, bias, y, b0, b1);
}
void a8(const WView& w, const A8View& a, int64_t b0, int64_t b1) {
  if (w.g.cbits == 2) a8_run<2>(w, a, b0, b1);
  else if (w.g.cbits == 4) a8_run<4>(w, a, b0, b1);
  else a8_run<8>(w, a, b0, b1);
}
}  // namespace avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
namespace avx512 {
namespace {
struct VO {
  static constexpr int L = 16;
  using F = __m512;
  using I = __m512i;
  static F fzero() { return _mm512_setzero_ps(); }
  static I izero() { return _mm512_setzero_si512(); }
  static I load(const uint8_t* p) { return _mm512_loadu_si512(p); }
  static I load_u8(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static I load_i32(const int32_t* p) { return _mm512_loadu_si512(p); }
  static F load_f(const float* p) { return _mm512_loadu_ps(p); }
  static void store_f(float* p, F v) { _mm512_storeu_ps(p, v); }
  static F set1f(float v) { return _mm512_set1_ps(v); }
  static I set1i(int32_t v) { return _mm512_set1_epi32(v); }
  static I srli(I v, int s) { return _mm512_srli_epi32(v, static_cast<unsigned>(s)); }
  static I slli(I v, int s) { return _mm512_slli_epi32(v, static_cast<unsigned>(s)); }
  static I srai(I v, int s) { return _mm512_srai_epi32(v, static_cast<unsigned>(s)); }
  static I xori(I a, I b) { return _mm512_xor_si512(a, b); }
  static I andi(I a, I b) { return _mm512_and_si512(a, b); }
  static I addi(I a, I b) { return _mm512_add_epi32(a, b); }
  static I subi(I a, I b) { return _mm512_sub_epi32(a, b); }
  static I mullo(I a, I b) { return _mm512_mullo_epi32(a, b); }
  static F cvt(I v) { return _mm512_cvtepi32_ps(v); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static I dot4_u4(I acc, I u, I s) {  // see avx2::VO
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1)));
  }
  static I dot4_u8(I acc, I u, I s) {
    const I nib = _mm512_set1_epi8(0x0F);
    const I lo = _mm512_and_si512(u, nib), hi = _mm512_and_si512(_mm512_srli_epi16(u, 4), nib);
    acc = _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(lo, s), _mm512_set1_epi16(1)));
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(hi, s), _mm512_set1_epi16(16)));
  }
};
#define WO_NBLK 2
#define WO_MT 8
#define A8_MT 6
#include "lowbit_tiles.inc"
#undef WO_NBLK
#undef WO_MT
#undef A8_MT
}  // namespace
void wo(const WView& w, const float* x, int64_t ldx, int64_t m, const float* bias, float* y, int64_t b0, int64_t b1) {
  if (w.g.cbits == 2) wo_run<2>(w, x, ldx, m, bias, y, b0, b1);
  else if (w.g.cbits == 4) wo_run<4>(w, x, ldx, m, bias, y, b0, b1);
  else wo_run<8>(w, x, ldx, m, bias, y, b0, b1);
}
void a8(const WView& w, const A8View& a, int64_t b0, int64_t b1) {
  if (w.g.cbits == 2) a8_run<2>(w, a, b0, b1);
  else if (w.g.cbits == 4) a8_run<4>(w, a, b0, b1);
  else a8_run<8>(w, a, b0, b1);
}
}  // namespace avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")
namespace vnni {
namespace {
struct VO : avx512::VO {
  // vpdpbusd: 4 products u8 x s8 summed into each int32 lane, no saturation
  static I dot4_u4(I acc, I u, I s) { return _mm512_dpbusd_epi32(acc, u, s); }
  static I dot4_u8(I acc, I u, I s) { return _mm512_dpbusd_epi32(acc, u, s); }
};
#define WO_NBLK 2
#define WO_MT 8
#define A8_MT 6
#include "lowbit_tiles.inc"
#undef WO_NBLK
#undef WO_MT
#undef A8_MT
}  // namespace
void a8(const WView& w, const A8View& a, int64_t b0, int64_t b1) {
  if (w.g.cbits == 2) a8_run<2>(w, a, b0, b1);
  else if (w.g.cbits == 4) a8_run<4>(w, a, b0, b1);
  else a8_run<8>(w, a, b0, b1);
}
}  // namespace vnni
#pragma GCC pop_options

#endif  // QC_LB_X86

// ---- instruction set, chosen at run time --------------------------------------------------------

namespace {

enum Isa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Vnni = 3, kAmx = 4 };
constexpr int kIsas = 5;
const char* const kIsaNames[kIsas] = {"scalar", "avx2", "avx512", "avx512_vnni", "amx"};

int detect_isa() {
#if defined(QC_LB_X86)
  __builtin_cpu_init();
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  if (avx512 && __builtin_cpu_supports("avx512vnni")) return amx::available() ? kAmx : kAvx512Vnni;
  if (avx512) return kAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return kAvx2;
#endif
  return kScalar;
}

int isa_from_name(c10::string_view name) {
  for (int i = 0; i < kIsas; ++i)
    if (name == kIsaNames[i]) return i;
  return -1;
}

int initial_isa() {
  const int best = detect_isa();
  const char* env = std::getenv("QCOMPRESS_LOWBIT_ISA");
  if (env == nullptr || *env == '\0' || std::string(env) == "auto") return best;
  const int want = isa_from_name(env);
  QC_CHECK(want >= 0, "QCOMPRESS_LOWBIT_ISA=", env, ": expected auto, scalar, avx2, avx512, avx512_vnni or amx");
  return std::min(want, best);
}

std::atomic<int>& active_isa() {
  static std::atomic<int> isa{initial_isa()};
  return isa;
}

using WoFn = void (*)(const WView&, const float*, int64_t, int64_t, const float*, float*, int64_t, int64_t);
using A8Fn = void (*)(const WView&, const A8View&, int64_t, int64_t);

WoFn wo_kernel(int isa) {
#if defined(QC_LB_X86)
  if (isa >= kAvx512) return &avx512::wo;
  if (isa >= kAvx2) return &avx2::wo;
#endif
  (void)isa;
  return &wo_scalar;
}

A8Fn a8_kernel(int isa) {
#if defined(QC_LB_X86)
  if (isa >= kAvx512Vnni) return &vnni::a8;
  if (isa >= kAvx512) return &avx512::a8;
  if (isa >= kAvx2) return &avx2::a8;
#endif
  (void)isa;
  return &a8_scalar;
}

// ---- argument checks and the torch glue -----------------------------------------------------------

Geometry checked_geometry(int64_t n, int64_t k, int64_t group, int64_t cbits) {
  QC_CHECK(cbits == 2 || cbits == 4 || cbits == 8, "qcompress.lowbit: container bits must be 2, 4 or 8, got ", cbits);
  QC_CHECK(n >= 1 && k >= 1, "qcompress.lowbit: empty weight (", n, " x ", k, ")");
  QC_CHECK(group >= 1 && group <= kMaxGroup, "qcompress.lowbit: group length ", group,
              " outside [1, ", kMaxGroup, "] (int32 sums of longer groups could overflow)");
  return make_geometry(n, k, group, static_cast<int>(cbits));
}

WView weight_view(const Geometry& g, const at::Tensor& packed, const at::Tensor& scales,
                  const std::optional<at::Tensor>& offsets) {
  const int64_t params = g.nb * g.ng * kRows;
  QC_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.numel() == g.nb * g.block_bytes(),
              "qcompress.lowbit: packed weight must be contiguous uint8 of ", g.nb * g.block_bytes(),
              " bytes for a ", g.n, " x ", g.k, " weight (", g.cbits, "-bit, group ", g.group, "), got ",
              packed.scalar_type(), " with ", packed.numel(), " elements");
  QC_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == params,
              "qcompress.lowbit: scales must be contiguous float32 with ", params, " elements, got ",
              scales.scalar_type(), " with ", scales.numel());
  WView w{packed.const_data_ptr<uint8_t>(), scales.const_data_ptr<float>(), nullptr, g};
  if (offsets.has_value() && offsets->numel()) {
    QC_CHECK(offsets->scalar_type() == at::kByte && offsets->is_contiguous() && offsets->numel() == params,
                "qcompress.lowbit: offsets must be contiguous uint8 with ", params, " elements");
    w.offs = offsets->const_data_ptr<uint8_t>();
  }
  return w;
}

void check_cpu(const at::Tensor& t, const char* what) {
  QC_CHECK(t.device().is_cpu(), "qcompress.lowbit: ", what, " is on ", t.device(), ", expected the CPU");
}

// x [M, K] -> [M, Kp] with every group padded to gp columns (zeros), in `dtype`.
at::Tensor pad_groups(const at::Tensor& x2, const Geometry& g, at::ScalarType dtype) {
  at::Tensor x = x2.to(dtype);
  if (g.kp == g.k) return x.contiguous();
  const int64_t m = x.size(0);
  if (g.ng * g.group != g.k) x = at::constant_pad_nd(x, {0, g.ng * g.group - g.k}, 0);
  x = x.reshape({m, g.ng, g.group});
  return at::constant_pad_nd(x, {0, g.gp - g.group}, 0).reshape({m, g.kp}).contiguous();
}

template <typename Fn>
void over_blocks(const Geometry& g, int64_t m, int64_t step, const Fn& fn) {
  // a task gets at least 64K weight x token products (a few microseconds): even a one-token GEMV
  // of a 384 x 384 layer splits over the threads, as torch's own GEMMs do. (With 4M products per
  // task a one-token GEMV ran on one thread and lost most of the second thread's speed-up; only on
  // an oversubscribed machine, where a parallel region can wait a scheduler slice for its second
  // thread, did that help.)
  constexpr int64_t kTaskProducts = int64_t{1} << 16;
  const int64_t units = (g.nb + step - 1) / step;
  const int64_t per_unit = step * kRows * g.kp * std::max<int64_t>(m, 1);
  const int64_t grain = std::max<int64_t>(1, kTaskProducts / std::max<int64_t>(per_unit, 1));
  at::parallel_for(0, units, grain, [&](int64_t u0, int64_t u1) {
    fn(u0 * step, std::min(u1 * step, g.nb));
  });
}

// AMX kernels: split the work over tokens (every thread decodes every row block, for its own
// tokens) rather than over row blocks (every thread reads every token's bf16 pieces / codes)?
constexpr int64_t kTokenTask = 32;   // two A tiles
bool split_by_tokens(const Geometry& g, int64_t m16) {
  const int64_t threads = at::get_num_threads();
  static const char* force = std::getenv("QCOMPRESS_LOWBIT_SPLIT");   // "tokens" / "blocks": for measurements
  if (force && force[0] == 't') return threads > 1 && m16 >= 2 * kTokenTask;
  if (force && force[0] == 'b') return false;
  // measured (benchmarks/RESULTS.md): tokens win up to 2048 x 2048 weights (384-wide layers at 64
  // tokens: 33 vs 53 us), row blocks from 4096 x 4096 on, where decoding every block twice costs more
  return threads > 1 && m16 >= threads * kTokenTask && g.n * g.kp <= (int64_t{1} << 22);
}

// fn(r0, r1) over token rows [0, m16) in tasks of kTokenTask rows (the token split above).
template <typename Fn>
void over_tokens(int64_t m16, const Fn& fn) {
  at::parallel_for(0, (m16 + kTokenTask - 1) / kTokenTask, 1, [&](int64_t u0, int64_t u1) {
    fn(u0 * kTokenTask, std::min(u1 * kTokenTask, m16));
  });
}

// Sums of the padded codes x [m][Kp] over flat groups [i0, i1) (token t, group i is flat group
// t * ng + i, at (t * ng + i) * gp): a plain loop the compiler vectorizes.
void sum_groups(const int8_t* x, int64_t gp, int64_t i0, int64_t i1, int32_t* o) {
  for (int64_t r = i0; r < i1; ++r) {
    const int8_t* p = x + r * gp;
    int32_t acc = 0;
    for (int64_t j = 0; j < gp; ++j) acc += p[j];
    o[r] = acc;
  }
}

// Sum of the int8 codes per token and group ([m, ng] int32); an ATen reduction costs more than
// the whole matmul at 64 tokens x 384.
at::Tensor group_sums(const at::Tensor& xp, int64_t m, const Geometry& g) {
  at::Tensor out = at::empty({m, g.ng}, xp.options().dtype(at::kInt));
  const int8_t* x = xp.const_data_ptr<int8_t>();
  int32_t* o = out.mutable_data_ptr<int32_t>();
  at::parallel_for(0, m * g.ng, std::max<int64_t>(1, (int64_t{1} << 18) / std::max<int64_t>(g.gp, 1)),
                   [&](int64_t i0, int64_t i1) { sum_groups(x, g.gp, i0, i1, o); });
  return out;
}

}  // namespace
}  // namespace lowbit

using namespace lowbit;

std::string lowbit_isa(c10::string_view request) {
  if (!request.empty()) {
    const int best = detect_isa();
    const int want = request == "auto" ? best : isa_from_name(request);
    QC_CHECK(want >= 0, "qcompress.lowbit_isa: unknown instruction set '", std::string(request),
                "' (expected auto, scalar, avx2, avx512, avx512_vnni or amx)");
    QC_CHECK(want <= best, "qcompress.lowbit_isa: this CPU does not have ", std::string(request),
                " (best: ", kIsaNames[best], ")");
    active_isa().store(want);
  }
  return kIsaNames[active_isa().load()];
}

int lowbit_isa_level() { return active_isa().load(); }

void lowbit_check_weight(const at::Tensor& packed, const at::Tensor& scales, const std::optional<at::Tensor>& offsets,
                         int64_t n, int64_t k, int64_t group, int64_t cbits) {
  weight_view(checked_geometry(n, k, group, cbits), packed, scales, offsets);
}

namespace lowbit {
namespace {
// Row n's codes of group gi into the blocked layout, one 4-byte lane (32 / C columns) at a time,
// written whole (the buffer starts zeroed). C is a template argument so the column -> bit
// position arithmetic folds to constants: with a run-time container the per-code divisions and
// read-modify-writes cost 6 ns per weight, more than the QAT forward's int8 matmul itself.
template <int C>
void pack_group_lanes(uint8_t* pk, const Geometry& g, int64_t n, int64_t gi, const int8_t* src, int bias, int o) {
  constexpr int kPerLane = 32 / C;
  const int64_t len = g.group_len(gi);
  uint8_t* dst = pk + lane_offset(g, n, gi * g.gp);
  for (int64_t j0 = 0; j0 < g.gp; j0 += kPerLane, dst += kChunkBytes) {
    uint8_t lane[kLaneBytes] = {0, 0, 0, 0};
    for (int i = 0; i < kPerLane; ++i) {   // padding: u = o, a zero weight
      const int64_t j = j0 + i;
      const int u = j < len ? src[j] + bias : o;
      const int sh = (i & 3) * 8 + (i >> 2) * C;    // code_shift(C, i)
      lane[sh / 8] = static_cast<uint8_t>(lane[sh / 8] | (u << (sh % 8)));
    }
    std::memcpy(dst, lane, kLaneBytes);
  }
}
}  // namespace
}  // namespace lowbit

std::tuple<at::Tensor, at::Tensor, at::Tensor> lowbit_prepack_cpu(
    const at::Tensor& q_, const at::Tensor& scale_, const std::optional<at::Tensor>& zp_, int64_t group,
    int64_t cbits) {
  QC_CHECK(q_.dim() == 2 && q_.scalar_type() == at::kChar, "qcompress.lowbit_prepack: codes must be int8 [N, K], got ",
              q_.scalar_type(), " ", q_.sizes());
  check_cpu(q_, "the weight codes");
  const Geometry g = checked_geometry(q_.size(0), q_.size(1), group, cbits);
  QC_CHECK(scale_.dim() == 2 && scale_.size(0) == g.n && scale_.size(1) == g.ng,
              "qcompress.lowbit_prepack: scale must be [", g.n, ", ", g.ng, "], got ", scale_.sizes());
  const int lo = -code_bias(g.cbits), hi = code_bias(g.cbits) - 1;
  const at::Tensor q = q_.contiguous();
  const at::Tensor scale = scale_.to(at::kFloat).contiguous();
  at::Tensor zp;
  if (zp_.has_value()) {
    QC_CHECK(zp_->sizes() == scale_.sizes() && !zp_->is_floating_point(),
                "qcompress.lowbit_prepack: zero point must be integer and shaped like scale ", scale_.sizes(),
                ", got ", zp_->scalar_type(), " ", zp_->sizes());
    zp = zp_->to(at::kInt).contiguous();
    QC_CHECK(zp.numel() == 0 || (zp.min().item<int>() >= lo && zp.max().item<int>() <= hi),
                "qcompress.lowbit_prepack: zero points outside the signed ", g.cbits, "-bit range");
  }
  QC_CHECK(q.min().item<int>() >= lo && q.max().item<int>() <= hi, "qcompress.lowbit_prepack: codes outside the signed ",
              g.cbits, "-bit range [", lo, ", ", hi, "]");
  const int64_t params = g.nb * g.ng * kRows;
  at::Tensor packed = at::zeros({g.nb * g.block_bytes()}, q.options().dtype(at::kByte));
  at::Tensor scales = at::zeros({params}, q.options().dtype(at::kFloat));
  at::Tensor offs = at::zeros({zp.defined() ? params : 0}, q.options().dtype(at::kByte));
  const int8_t* qp = q.const_data_ptr<int8_t>();
  const float* sp = scale.const_data_ptr<float>();
  const int32_t* zpp = zp.defined() ? zp.const_data_ptr<int32_t>() : nullptr;
  uint8_t* pk = packed.mutable_data_ptr<uint8_t>();
  float* sc = scales.mutable_data_ptr<float>();
  uint8_t* of = zp.defined() ? offs.mutable_data_ptr<uint8_t>() : nullptr;
  const int bias = code_bias(g.cbits);
  at::parallel_for(0, g.nb, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t n = b0 * kRows; n < std::min(b1 * kRows, g.n); ++n) {
      for (int64_t gi = 0; gi < g.ng; ++gi) {
        const int64_t idx = param_index(g, n, gi);
        const int o = offset_of(g.cbits, zpp ? zpp[n * g.ng + gi] : 0);
        sc[idx] = sp[n * g.ng + gi];
        if (of) of[idx] = static_cast<uint8_t>(o);
        const int8_t* src = qp + n * g.k + gi * g.group;
        switch (g.cbits) {
          case 2: pack_group_lanes<2>(pk, g, n, gi, src, bias, o); break;
          case 4: pack_group_lanes<4>(pk, g, n, gi, src, bias, o); break;
          default: pack_group_lanes<8>(pk, g, n, gi, src, bias, o); break;
        }
      }
    }
  });
  return {packed, scales, offs};
}

at::Tensor lowbit_unpack_cpu(const at::Tensor& packed, int64_t n, int64_t k, int64_t group, int64_t cbits) {
  const Geometry g = checked_geometry(n, k, group, cbits);
  check_cpu(packed, "the packed weight");
  QC_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.numel() == g.nb * g.block_bytes(),
              "qcompress.lowbit_unpack: packed weight must be contiguous uint8 of ", g.nb * g.block_bytes(), " bytes");
  at::Tensor q = at::empty({n, k}, packed.options().dtype(at::kChar));
  const uint8_t* pk = packed.const_data_ptr<uint8_t>();
  int8_t* qp = q.mutable_data_ptr<int8_t>();
  const int bias = code_bias(g.cbits);
  at::parallel_for(0, n, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t c = 0; c < k; ++c) qp[r * k + c] = static_cast<int8_t>(code_at(pk, g, r, padded_col(g, c)) - bias);
  });
  return q;
}


// The bias as float32 [n] for the kernels' epilogues (undefined without one).
static at::Tensor float_bias(const std::optional<at::Tensor>& bias, int64_t n, const char* op) {
  if (!bias.has_value()) return {};
  QC_CHECK(bias->numel() == n, op, ": bias has ", bias->numel(), " elements, expected ", n);
  return bias->to(at::kFloat).contiguous();
}

// The bf16 pieces of a float input (float32: 2 x 2 bytes per element) live in a grow-only buffer
// kept per calling thread, up to kScratchCap bytes. A fresh buffer per call was a fresh mmap for
// MiniLM-sized inputs (4.7-19 MB at 2048 tokens): the kernel then zero-filled its pages on first
// touch, and those page faults (system time) made the weight-only layers slower than fp32 even
// though their compute was faster. Larger inputs are allocated per call.
static constexpr int64_t kScratchCap = int64_t{64} << 20;

// At least `elems` bf16 elements (the thread's reused buffer, or a new one past kScratchCap);
// callers that need exactly `elems` narrow it (a narrow costs a few microseconds per call).
static at::Tensor split_scratch(int64_t elems) {
  const auto opts = at::TensorOptions().dtype(at::kBFloat16).device(at::kCPU);
  if (elems * 2 > kScratchCap) return at::empty({elems}, opts);
  thread_local at::Tensor buf;
  if (!buf.defined() || buf.numel() < elems) buf = at::empty({elems}, opts);
  return buf;
}

// QCOMPRESS_LOWBIT_FP32=pieces: float32 weight-only inputs keep the earlier float paths (bf16 pieces
// on the tiles, the float GEMV) instead of int8 digits; read per call so tests and measurements can
// switch it.
static bool fp32_digits_off() {
  const char* force = std::getenv("QCOMPRESS_LOWBIT_FP32");
  return force && force[0] == 'p';
}

// Weight-only float32 on the AMX int8 tiles: x as two int8 digits per element (amx::digits), then
// the W-A8 kernel, in one parallel region when the layer splits over tokens. Measured against the
// two bf16 pieces (benchmarks/RESULTS.md): half the tile work, and the weight codes are read as
// stored instead of decoded to bf16 in every task. Undefined when it does not apply (padded
// groups, groups not a whole number of 64-column steps, inf / nan or a tiny token: the caller
// takes the bf16 pieces) or turned off (fp32_digits_off).
static at::Tensor wo_digits(const at::Tensor& x2, const WView& w, const Geometry& g, const float* bias, int64_t m,
                            int act, const float* res) {
  if (fp32_digits_off() || g.kp != g.k || !amx::fits(g, true)) return {};
  const at::Tensor xc = x2.contiguous();
  const float* xp = xc.const_data_ptr<float>();
  const int64_t m16 = (m + amx::kTileRows - 1) / amx::kTileRows * amx::kTileRows;
  // two int8 code rows per token: the bytes of one bf16 piece
  at::Tensor scratch = split_scratch(m16 * g.k);
  int8_t* codes = reinterpret_cast<int8_t*>(scratch.mutable_data_ptr());
  std::vector<float> sx(static_cast<size_t>(m16));
  std::vector<int32_t> xsum(static_cast<size_t>(2 * m16 * g.ng));
  at::Tensor y = at::empty({m, g.n}, xc.options());
  const A8View a{codes, g.kp, m, xsum.data(), sx.data(), nullptr, bias, y.mutable_data_ptr<float>(), act, res};
  std::atomic<bool> ok{true};
  auto prepare = [&](int64_t r0, int64_t r1) {   // token rows [r0, r1): digits and their group sums
    if (!amx::digits(xp, g.k, m, r0, r1, codes, sx.data())) {
      ok.store(false);
      return false;
    }
    if (!amx::signed_tiles(w)) sum_groups(codes, g.gp, 2 * r0 * g.ng, 2 * r1 * g.ng, xsum.data());
    return true;
  };
  if (split_by_tokens(g, m16)) {
    over_tokens(m16, [&](int64_t r0, int64_t r1) {
      if (prepare(r0, r1)) amx::a8(w, a, 0, g.nb, r0, r1, 2);
    });
    return ok.load() ? y : at::Tensor();
  }
  if (m16 * g.k <= (int64_t{1} << 19)) {   // small: on this thread, no parallel region
    prepare(0, m16);
  } else {
    at::parallel_for(0, m16 / amx::kTileRows, std::max<int64_t>(1, (int64_t{1} << 12) / g.k),
                     [&](int64_t u0, int64_t u1) { prepare(u0 * amx::kTileRows, u1 * amx::kTileRows); });
  }
  if (!ok.load()) return {};
  over_blocks(g, m, 2, [&](int64_t b0, int64_t b1) { amx::a8(w, a, b0, b1, 0, m16, 2); });
  return y;
}

// y[0, count) = act(y) (+ res): the GEMV paths' store and act_in_place. On AVX-512 CPUs the tile
// store's 16-lane epilogue (amx::act_rows, the same bits): the scalar GELU loops below do not
// vectorize (a 64 x 1536 GELU took 250 us, more than the layer's products).
static void act_rows(float* y, int64_t count, int act, const float* res) {
  if (active_isa().load() >= kAvx512 && amx::act_rows(y, count, act, res)) return;
  if (act == kActRelu)
    for (int64_t j = 0; j < count; ++j) y[j] = apply_act(y[j], kActRelu);
  else if (act == kActGelu)
    for (int64_t j = 0; j < count; ++j) y[j] = gelu_erf(y[j]);
  else if (act == kActGeluTanh)
    for (int64_t j = 0; j < count; ++j) y[j] = gelu_tanh(y[j]);
  else if (act == kActSilu)
    for (int64_t j = 0; j < count; ++j) y[j] = silu(y[j]);
  if (res)
    for (int64_t j = 0; j < count; ++j) y[j] += res[j];
}

// Weight-only below 16 tokens (the GEMV; bfloat16 / float16 x converted to float32 first) on a CPU
// with AVX-512 VNNI: each token's two int8 digits (amx::digits, row layout) as two tokens of the
// vector W-A8 kernel, whose integer dot products take a quarter of the float kernel's instructions
// per weight, then y = row 2t + row 2t + 1 + bias (float32).
// Same precision as the tile path (within amax / 64000 of x per element). Undefined when it does not
// apply (inf / nan or a tiny token: the caller takes the float kernel) or turned off (fp32_digits_off).
// The few-token paths' output in x's dtype from their float32 results `v` [m, n] (overwritten):
// rounded to the dtype, then, for bfloat16 / float16, act on the rounded value rounded again, as
// act_in_place on the rounded output does, bit for bit. Plain loops: at one token every ATen op
// between kernel and caller (a dtype copy, an act pass) costs as much as a small layer's kernel.
template <typename T>
static void round_into(float* v, int64_t count, int act, T* out) {
  for (int64_t i = 0; i < count; ++i) v[i] = static_cast<float>(static_cast<T>(v[i]));
  if (act != kActNone) act_rows(v, count, act, nullptr);
  for (int64_t i = 0; i < count; ++i) out[i] = static_cast<T>(v[i]);
}

static at::Tensor low_precision_output(float* v, int64_t m, int64_t n, at::ScalarType dt, int act,
                                       const at::TensorOptions& opts) {
  at::Tensor y = at::empty({m, n}, opts.dtype(dt));
  if (dt == at::kBFloat16) round_into(v, m * n, act, y.mutable_data_ptr<at::BFloat16>());
  else round_into(v, m * n, act, y.mutable_data_ptr<at::Half>());
  return y;
}

// x [m, k] as float32 columns padded to the kernel's groups; a bfloat16 / float16 x without padding
// widened in a plain loop into `buf` (no ATen op), anything else through pad_groups.
static const float* float_columns(const at::Tensor& x2, const Geometry& g, std::vector<float>& buf, at::Tensor& keep) {
  const at::ScalarType dt = x2.scalar_type();
  if (g.kp == g.k && x2.is_contiguous() && (dt == at::kBFloat16 || dt == at::kHalf)) {
    buf.resize(static_cast<size_t>(x2.numel()));
    if (dt == at::kBFloat16) {
      const at::BFloat16* p = x2.const_data_ptr<at::BFloat16>();
      for (size_t i = 0; i < buf.size(); ++i) buf[i] = static_cast<float>(p[i]);
    } else {
      const at::Half* p = x2.const_data_ptr<at::Half>();
      for (size_t i = 0; i < buf.size(); ++i) buf[i] = static_cast<float>(p[i]);
    }
    return buf.data();
  }
  keep = pad_groups(x2, g, at::kFloat);
  return keep.const_data_ptr<float>();
}

static at::Tensor gemv_digits(const at::Tensor& x2, const WView& w, const Geometry& g, const float* bias, int64_t m,
                              int isa, int act, const float* res) {
  if (fp32_digits_off() || isa < kAvx512Vnni || m == 0) return {};
  std::vector<float> xbuf;
  at::Tensor xkeep;
  const float* xf = float_columns(x2, g, xbuf, xkeep);
  std::vector<int8_t> codes(static_cast<size_t>(2 * m * g.kp));
  std::vector<float> sx(static_cast<size_t>(2 * m));
  if (!amx::digits(xf, g.kp, m, 0, m, codes.data(), sx.data(), false)) return {};
  std::vector<int32_t> xsum(static_cast<size_t>(2 * m * g.ng));
  sum_groups(codes.data(), g.gp, 0, 2 * m * g.ng, xsum.data());
  std::vector<float> y2(static_cast<size_t>(2 * m * g.n));
  const A8View a{codes.data(), g.kp, 2 * m, xsum.data(), sx.data(), nullptr, nullptr, y2.data()};
  const A8Fn fn = a8_kernel(isa);
  over_blocks(g, 2 * m, 1, [&](int64_t b0, int64_t b1) { fn(w, a, b0, b1); });
  const at::ScalarType dt = x2.scalar_type();
  const bool f32 = dt == at::kFloat;
  at::Tensor y = f32 ? at::empty({m, g.n}, x2.options()) : at::Tensor();
  float* yp = f32 ? y.mutable_data_ptr<float>() : y2.data();   // other dtypes: the sums in y2's first m rows
  for (int64_t t = 0; t < m; ++t) {
    const float* hi = y2.data() + 2 * t * g.n;
    const float* lo = hi + g.n;
    float* yt = yp + t * g.n;
    for (int64_t j = 0; j < g.n; ++j) yt[j] = hi[j] + lo[j] + (bias ? bias[j] : 0.0f);
    if (f32) act_rows(yt, g.n, act, res ? res + t * g.n : nullptr);
  }
  if (f32) return y;
  if (dt == at::kBFloat16 || dt == at::kHalf) return low_precision_output(y2.data(), m, g.n, dt, act, x2.options());
  at::Tensor yf = at::empty({m, g.n}, x2.options().dtype(at::kFloat));
  std::memcpy(yf.mutable_data_ptr<float>(), y2.data(), sizeof(float) * m * g.n);
  return yf;
}

int lowbit_act_code(c10::string_view name) {
  if (name == "none") return kActNone;
  if (name == "gelu") return kActGelu;
  if (name == "relu") return kActRelu;
  if (name == "gelu_tanh") return kActGeluTanh;
  if (name == "silu") return kActSilu;
  QC_CHECK(false, "qcompress.lowbit_linear: act must be 'none', 'gelu', 'gelu_tanh', 'relu' or 'silu', got '",
              std::string(name), "'");
  return kActNone;
}

// apply_act on every element of y in place (the paths whose kernels store without it): ReLU is
// torch's (the same max), the GELUs lowbit.h's (act_rows).
static void act_in_place(at::Tensor& y, int act) {
  if (act == kActRelu) {
    y.relu_();
    return;
  }
  at::Tensor yf = y.scalar_type() == at::kFloat && y.is_contiguous() ? y : y.to(at::kFloat).contiguous();
  float* p = yf.mutable_data_ptr<float>();
  at::parallel_for(0, yf.numel(), 1 << 14, [&](int64_t i0, int64_t i1) { act_rows(p + i0, i1 - i0, act, nullptr); });
  if (!yf.is_same(y)) y.copy_(yf);
}

static at::Tensor linear_paths(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                               const std::optional<at::Tensor>& offsets, const std::optional<at::Tensor>& bias_,
                               int64_t n, int64_t group, int64_t cbits, int act, const float* res, bool& fused);

// The residual as float32 rows of y's shape when the kernels can add it in their store (float32 x),
// else undefined (added after, in y's dtype, as torch would).
static at::Tensor residual_rows(const at::Tensor& x, const std::optional<at::Tensor>& residual, int64_t n,
                                const char* op) {
  if (!residual.has_value()) return {};
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  QC_CHECK(residual->sizes().vec() == shape, op, ": residual has shape ", residual->sizes(),
              ", the output ", c10::IntArrayRef(shape));
  check_cpu(*residual, "residual");
  if (x.scalar_type() != at::kFloat || residual->scalar_type() != at::kFloat) return {};
  return residual->contiguous();
}

at::Tensor lowbit_linear_cpu(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                             const std::optional<at::Tensor>& offsets, const std::optional<at::Tensor>& bias,
                             int64_t n, int64_t group, int64_t cbits, c10::string_view act_name,
                             const std::optional<at::Tensor>& residual) {
  const int act = lowbit_act_code(act_name);
  const at::Tensor res = residual_rows(x, residual, n, "qcompress.lowbit_linear");
  bool fused = false;
  at::Tensor y = linear_paths(x, packed, scales, offsets, bias, n, group, cbits, act,
                              res.defined() ? res.const_data_ptr<float>() : nullptr, fused);
  if (act != kActNone && !fused) act_in_place(y, act);
  if (residual.has_value() && !(fused && res.defined())) y.add_(*residual);
  return y;
}

// lowbit_linear on the path this call takes; fused: the path applied act (and added res) in its store.
static at::Tensor linear_paths(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                               const std::optional<at::Tensor>& offsets, const std::optional<at::Tensor>& bias_,
                               int64_t n, int64_t group, int64_t cbits, int act, const float* res, bool& fused) {
  QC_CHECK(x.dim() >= 1 && x.is_floating_point(), "qcompress.lowbit_linear: x must be a float tensor");
  check_cpu(x, "x");
  const Geometry g = checked_geometry(n, x.size(-1), group, cbits);
  const WView w = weight_view(g, packed, scales, offsets);
  const int64_t m = g.k ? x.numel() / g.k : 0;
  const at::Tensor x2 = x.reshape({m, g.k});
  const at::Tensor bias = float_bias(bias_, n, "qcompress.lowbit_linear");
  const float* bp = bias.defined() ? bias.const_data_ptr<float>() : nullptr;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  const int isa = active_isa().load();
  if (x.scalar_type() == at::kFloat && m >= amx::kTileRows && isa >= kAmx) {
    if (at::Tensor y = wo_digits(x2, w, g, bp, m, act, res); y.defined()) {
      fused = true;
      return y.reshape(shape);
    }
  }
  if (m >= amx::kTileRows && isa >= kAmx && amx::fits(g, false)) {
    // bf16 pieces of x: bfloat16 1 and float16 2 (their sum is x exactly); float32 2, the high
    // piece and the rounded rest, which leave |x - pieces| <= 2^-16 |x| (a third piece would make
    // it exact but costs half again the tile work, for an error below the fp32 sums'). Read straight
    // from x and written straight in its dtype when no group needs padding: under load every
    // extra parallel region (a dtype copy) can cost a scheduler slice.
    const at::ScalarType dt = x.scalar_type();
    const int code = dt == at::kFloat ? amx::kF32 : dt == at::kBFloat16 ? amx::kBF16 : dt == at::kHalf ? amx::kF16 : -1;
    const int pieces = dt == at::kBFloat16 ? 1 : 2;
    const bool direct = code >= 0 && g.kp == g.k;
    const at::Tensor xin = direct ? x2.contiguous() : pad_groups(x2, g, at::kFloat);
    const int xcode = direct ? code : amx::kF32;
    const int64_t m16 = (m + amx::kTileRows - 1) / amx::kTileRows * amx::kTileRows;
    at::Tensor xs = split_scratch(pieces * m16 * g.kp).narrow(0, 0, pieces * m16 * g.kp).view({pieces, m16, g.kp});
    uint16_t* xsp = reinterpret_cast<uint16_t*>(xs.mutable_data_ptr());
    const void* xip = xin.const_data_ptr();
    at::Tensor y = at::empty({m, n}, x.options().dtype(code >= 0 ? dt : at::kFloat));
    void* yp = y.mutable_data_ptr();
    const int ycode = code >= 0 ? code : amx::kF32;
    bool finite = true;
    if (split_by_tokens(g, m16)) {
      // each task splits its own tokens and runs every row block on them: no thread reads the
      // bf16 pieces another core just wrote (pulling them over cost a 384-wide layer at 64 tokens
      // as much as the second thread saved)
      std::atomic<bool> ok{true};
      over_tokens(m16, [&](int64_t r0, int64_t r1) {
        if (!amx::split(xip, xcode, g.kp, m, r0, r1, pieces, m16, xsp)) {
          ok.store(false);
          return;
        }
        amx::wo(w, xsp, pieces, g.kp, m, m16, bp, yp, ycode, 0, g.nb, r0, r1);
      });
      if (ok.load()) return y.to(dt).reshape(shape);
      finite = false;
    } else if (m16 * g.kp * pieces <= (int64_t{1} << 20)) {   // small: on this thread, no parallel region
      finite = amx::split(xip, xcode, g.kp, m, 0, m16, pieces, m16, xsp);
    } else {
      std::atomic<bool> ok{true};
      at::parallel_for(0, m16, std::max<int64_t>(1, (int64_t{1} << 16) / g.kp), [&](int64_t r0, int64_t r1) {
        if (!amx::split(xip, xcode, g.kp, m, r0, r1, pieces, m16, xsp)) ok.store(false);
      });
      finite = ok.load();
    }
    if (finite) {  // inf / nan have no bf16 pieces: such inputs take the vector kernels
      over_blocks(g, m, 2, [&](int64_t b0, int64_t b1) {
        amx::wo(w, xsp, pieces, g.kp, m, m16, bp, yp, ycode, b0, b1, 0, m16);
      });
      return y.to(dt).reshape(shape);
    }
  }
  if (m < amx::kTileRows) {
    // bfloat16 / float16 too: their digits' error (amax / 64000) is far below their own rounding, and
    // the float kernel costs them twice the time at one token; act and the residual then come after
    // the rounding to x's dtype, as on their other paths
    const at::ScalarType dt = x.scalar_type();
    const bool f32 = dt == at::kFloat, low = dt == at::kBFloat16 || dt == at::kHalf;
    if (at::Tensor y = gemv_digits(x2, w, g, bp, m, isa, f32 || low ? act : kActNone, f32 ? res : nullptr);
        y.defined()) {
      fused = f32 || low;   // low: act applied after the rounding, the residual added by the caller
      return (y.scalar_type() == dt ? y : y.to(dt)).reshape(shape);
    }
  }
  const at::Tensor xf = pad_groups(x2, g, at::kFloat);
  at::Tensor y = at::empty({m, n}, x.options().dtype(at::kFloat));
  if (m) {
    const WoFn fn = wo_kernel(isa);
    const float* xp = xf.const_data_ptr<float>();
    float* yp = y.mutable_data_ptr<float>();
    over_blocks(g, m, 2, [&](int64_t b0, int64_t b1) { fn(w, xp, g.kp, m, bp, yp, b0, b1); });
  }
  return y.to(x.scalar_type()).reshape(shape);
}

at::Tensor lowbit_linear_a8_cpu(const at::Tensor& xq, const at::Tensor& x_scale,
                                const std::optional<at::Tensor>& x_zp, const at::Tensor& packed,
                                const at::Tensor& scales, const std::optional<at::Tensor>& offsets,
                                const std::optional<at::Tensor>& bias_, int64_t n, int64_t group, int64_t cbits,
                                at::ScalarType out_dtype) {
  QC_CHECK(xq.dim() >= 1 && xq.scalar_type() == at::kChar, "qcompress.lowbit_linear_a8: activation codes must be int8, got ",
              xq.scalar_type());
  check_cpu(xq, "the activation codes");
  const Geometry g = checked_geometry(n, xq.size(-1), group, cbits);
  const bool asym = x_zp.has_value();
  const WView w = weight_view(g, packed, scales, offsets);
  const int64_t m = g.k ? xq.numel() / g.k : 0;
  const at::Tensor xp = pad_groups(xq.reshape({m, g.k}), g, at::kChar);
  const at::Tensor xsum = group_sums(xp, m, g);
  auto per_token = [&](const at::Tensor& t, at::ScalarType dt, const char* what) {
    QC_CHECK(t.numel() == m || t.numel() == 1, "qcompress.lowbit_linear_a8: ", what, " has ", t.numel(),
                " elements, expected one per token (", m, ") or one");
    return t.reshape({-1}).to(dt).expand({m}).contiguous();
  };
  const at::Tensor sx = per_token(x_scale, at::kFloat, "x_scale");
  const at::Tensor zx = asym ? per_token(*x_zp, at::kInt, "x_zero_point") : at::Tensor();
  const at::Tensor bias = float_bias(bias_, n, "qcompress.lowbit_linear_a8");
  at::Tensor y = at::empty({m, n}, xq.options().dtype(at::kFloat));
  const int isa = active_isa().load();
  if (m && isa >= kAmx && m >= amx::kTileRows && amx::fits(g, true)) {
    const int64_t m16 = (m + amx::kTileRows - 1) / amx::kTileRows * amx::kTileRows;
    const at::Tensor x16 = m16 == m ? xp : at::constant_pad_nd(xp, {0, 0, 0, m16 - m}, 0);  // zero token rows
    const A8View a{x16.const_data_ptr<int8_t>(), g.kp, m, xsum.const_data_ptr<int32_t>(), sx.const_data_ptr<float>(),
                   asym ? zx.const_data_ptr<int32_t>() : nullptr, bias.defined() ? bias.const_data_ptr<float>() : nullptr,
                   y.mutable_data_ptr<float>()};
    if (split_by_tokens(g, m16)) {   // as the weight-only kernel: each task its tokens, every row block
      over_tokens(m16, [&](int64_t r0, int64_t r1) { amx::a8(w, a, 0, g.nb, r0, r1); });
    } else {
      over_blocks(g, m, 2, [&](int64_t b0, int64_t b1) { amx::a8(w, a, b0, b1, 0, m16); });
    }
  } else if (m) {
    const A8View a{xp.const_data_ptr<int8_t>(), g.kp, m, xsum.const_data_ptr<int32_t>(), sx.const_data_ptr<float>(),
                   asym ? zx.const_data_ptr<int32_t>() : nullptr, bias.defined() ? bias.const_data_ptr<float>() : nullptr,
                   y.mutable_data_ptr<float>()};
    const A8Fn fn = a8_kernel(isa);
    over_blocks(g, m, 1, [&](int64_t b0, int64_t b1) { fn(w, a, b0, b1); });
  }
  std::vector<int64_t> shape(xq.sizes().begin(), xq.sizes().end());
  shape.back() = n;
  return y.to(out_dtype).reshape(shape);
}

// The token-split AMX case of lowbit_linear_dyn_a8 in one parallel region: each task quantizes its
// own tokens (the quantize op's code on those rows), sums their codes per group and multiplies them,
// so no core reads codes another wrote and a 64-token layer pays one region instead of three plus
// a dozen small ATen ops. Same values as quantize + lowbit_linear_a8 (tests compare bit for bit).
// Undefined when the case does not apply (the caller takes the general path).
static at::Tensor dyn_a8_token_tasks(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                              const std::optional<at::Tensor>& offsets, const std::optional<at::Tensor>& bias_,
                              int64_t n, int64_t group, int64_t cbits, int64_t abits, bool symmetric, int64_t m,
                              int64_t k, int act, const float* res, bool& act_done) {
  const at::ScalarType dt = x.scalar_type();
  if (dt != at::kFloat && dt != at::kBFloat16 && dt != at::kHalf) return {};
  if (active_isa().load() < kAmx || m < amx::kTileRows || k == 0) return {};
  const Geometry g = checked_geometry(n, k, group, cbits);
  const int64_t m16 = (m + amx::kTileRows - 1) / amx::kTileRows * amx::kTileRows;
  if (g.kp != g.k || !amx::fits(g, true) || !split_by_tokens(g, m16)) return {};
  const WView w = weight_view(g, packed, scales, offsets);
  const at::Tensor bias = float_bias(bias_, n, "qcompress.lowbit_linear_dyn_a8");
  const at::Tensor xc = x.reshape({m, k}).contiguous();
  // uninitialised (each task writes its rows): zero-filling 2048 x 1536 codes on this thread cost more
  // than the region saved
  const at::Tensor codes = at::empty({m16 * k}, x.options().dtype(at::kChar));
  int8_t* q = codes.mutable_data_ptr<int8_t>();
  std::vector<float> sx(static_cast<size_t>(m16), 0.0f), zf(static_cast<size_t>(m16), 0.0f);
  std::vector<int32_t> zx(symmetric ? 0 : static_cast<size_t>(m16)), xsum(static_cast<size_t>(m16 * g.ng));
  at::Tensor y = at::empty({m, n}, x.options().dtype(at::kFloat));
  A8View a{q, g.kp, m, xsum.data(), sx.data(), symmetric ? nullptr : zx.data(),
           bias.defined() ? bias.const_data_ptr<float>() : nullptr, y.mutable_data_ptr<float>()};
  // float32 output: act and the residual in the tile store (a bf16 / fp16 one gets them after
  // rounding, as elsewhere)
  act_done = dt == at::kFloat;
  if (act_done) {
    a.act = act;
    a.res = res;
  }
  std::atomic<int64_t> bad{0};
  over_tokens(m16, [&](int64_t r0, int64_t r1) {
    const int64_t real = std::min(r1, m);
    if (real > r0) {
      const int64_t b = quantize_token_rows(xc, r0, real, static_cast<int>(abits), symmetric, q, sx.data(), zf.data());
      if (b) {
        bad += b;
        return;
      }
    }
    const int64_t pad0 = std::max(real, r0);   // token rows past m: zero codes
    if (r1 > pad0) std::memset(q + pad0 * k, 0, static_cast<size_t>((r1 - pad0) * k));
    if (real > r0) sum_groups(q, g.gp, r0 * g.ng, real * g.ng, xsum.data());   // Kp == K here
    if (!symmetric) {
      for (int64_t r = r0; r < real; ++r) zx[r] = static_cast<int32_t>(zf[r]);
    }
    amx::a8(w, a, 0, g.nb, r0, r1);
  });
  if (bad.load()) raise_nonfinite(bad.load(), m);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  return y.to(dt).reshape(shape);
}

// The GEMV case of lowbit_linear_dyn_a8 (fewer tokens than a tile, groups unpadded): the
// general path's quantize and lowbit_linear_a8 ops cost a dozen small ATen calls (allocations,
// dtype and layout checks) per call, as much as a decode step's 384 x 384 layer itself. Here the
// codes, sums and scales live in std::vectors, the vector kernel writes y and act is applied in
// one loop with the residual (act_rows): the values are the general path's bit for bit (the same
// quantize rows, group sums, kernel, activation functions and add). Undefined when the case does not apply.
static at::Tensor dyn_a8_gemv(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                              const std::optional<at::Tensor>& offsets, const std::optional<at::Tensor>& bias_,
                              int64_t n, int64_t group, int64_t cbits, int64_t abits, bool symmetric, int64_t m,
                              int64_t k, int act, const float* res, bool& act_done) {
  const at::ScalarType dt = x.scalar_type();
  if (dt != at::kFloat && dt != at::kBFloat16 && dt != at::kHalf) return {};
  if (m == 0 || m >= amx::kTileRows || k == 0) return {};
  const Geometry g = checked_geometry(n, k, group, cbits);
  if (g.kp != g.k) return {};
  const WView w = weight_view(g, packed, scales, offsets);
  const at::Tensor bias = float_bias(bias_, n, "qcompress.lowbit_linear_dyn_a8");
  const at::Tensor xc = x.reshape({m, k}).contiguous();
  std::vector<int8_t> codes(static_cast<size_t>(m * k));
  std::vector<float> sx(static_cast<size_t>(m)), zf(static_cast<size_t>(m));
  std::vector<int32_t> zx(symmetric ? 0 : static_cast<size_t>(m)), xsum(static_cast<size_t>(m * g.ng));
  const int64_t bad = quantize_token_rows(xc, 0, m, static_cast<int>(abits), symmetric, codes.data(), sx.data(), zf.data());
  if (bad) raise_nonfinite(bad, m);
  sum_groups(codes.data(), g.gp, 0, m * g.ng, xsum.data());
  for (size_t r = 0; r < zx.size(); ++r) zx[r] = static_cast<int32_t>(zf[r]);
  const bool f32 = dt == at::kFloat;
  at::Tensor y = f32 ? at::empty({m, n}, xc.options()) : at::Tensor();
  std::vector<float> yv(f32 ? 0 : static_cast<size_t>(m * n));
  float* yp = f32 ? y.mutable_data_ptr<float>() : yv.data();
  const A8View a{codes.data(), g.kp, m, xsum.data(), sx.data(), symmetric ? nullptr : zx.data(),
                 bias.defined() ? bias.const_data_ptr<float>() : nullptr, yp};
  const A8Fn fn = a8_kernel(active_isa().load());
  over_blocks(g, m, 1, [&](int64_t b0, int64_t b1) { fn(w, a, b0, b1); });
  // float32: act and the residual in this store; bfloat16 / float16: act after the rounding, the
  // residual (never given here for them: res is float32-only) added by the caller
  act_done = true;
  if (f32) act_rows(yp, m * n, act, res);
  else y = low_precision_output(yp, m, n, dt, act, xc.options());
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  return y.reshape(shape);
}

at::Tensor lowbit_linear_dyn_a8_cpu(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                                    const std::optional<at::Tensor>& offsets, const std::optional<at::Tensor>& bias,
                                    int64_t n, int64_t group, int64_t cbits, int64_t abits, bool symmetric,
                                    int64_t seed, c10::string_view act_name,
                                    const std::optional<at::Tensor>& residual) {
  QC_CHECK(x.dim() >= 1 && x.is_floating_point(), "qcompress.lowbit_linear_dyn_a8: x must be a float tensor");
  QC_CHECK(abits >= 2 && abits <= 8, "qcompress.lowbit_linear_dyn_a8: activation bits must be 2..8, got ", abits);
  const int act = lowbit_act_code(act_name);
  const int64_t k = x.size(-1);
  const int64_t m = k ? x.numel() / k : 0;
  const at::Tensor res = residual_rows(x, residual, n, "qcompress.lowbit_linear_dyn_a8");   // float32: the stores add it
  const float* rp = res.defined() ? res.const_data_ptr<float>() : nullptr;
  bool act_done = false;   // act (and rp) applied in the store
  at::Tensor y = dyn_a8_token_tasks(x, packed, scales, offsets, bias, n, group, cbits, abits, symmetric, m, k, act,
                                    rp, act_done);
  if (!y.defined()) {
    y = dyn_a8_gemv(x, packed, scales, offsets, bias, n, group, cbits, abits, symmetric, m, k, act, rp, act_done);
  }
  if (!y.defined()) {
    // kind 0 (integer), rounding 0 (nearest), numerics default: the token Spec's arguments
    auto [q, s, zp] = quantize_cpu(x, std::nullopt, m, k, k, abits, 0, symmetric, false, 0, seed);
    const std::optional<at::Tensor> z = symmetric ? std::nullopt : std::optional<at::Tensor>(zp);
    y = lowbit_linear_a8_cpu(q, s, z, packed, scales, offsets, bias, n, group, cbits, x.scalar_type());
  }
  if (act != kActNone && !act_done) act_in_place(y, act);   // in place on the finished output, before Python sees it
  if (residual.has_value() && !(act_done && rp)) y.add_(*residual);
  return y;
}

}  // namespace qc
