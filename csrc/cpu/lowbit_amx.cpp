// AMX tile kernels of the low-bit matmuls for 16 tokens or more (Sapphire Rapids and later).
// Same layout and math as lowbit_gemm.cpp (qcompress/lowbit.h); what changes is who multiplies:
//
// - W-A8: TDPBSUD multiplies int8 activation rows (A tiles, 16 tokens x 64 columns) by the
//   unsigned weight codes (B tiles). One B tile row is 4 columns x 16 weight rows, which is
//   exactly one 64-byte chunk of the 8-bit layout, so 8-bit weights are read in place; 4-bit
//   chunks are split into their low / high nibbles first. The int32 group sums are the vector
//   kernels' (exact), followed by the same epilogue (lowbit.h a8_group, then tot += A * s), so
//   the outputs equal the AVX-512 VNNI kernel's bit for bit.
// - weight-only: TDPBF16PS on bfloat16 tiles. The weight integers u - o (|u - o| <= 255) are
//   exact in bf16, and x is split into bf16 pieces, each rounded to nearest: 1 for bfloat16 and
//   2 for float16 (their sum is x exactly), 2 for float32 (high piece and rounded rest: within
//   2^-16 |x| of x). Every product is exact; sums run in fp32 per group and y += s_g * S_g once
//   per group. Outputs differ from the exact path by rounding and, for float32, the 2^-16 |x|
//   rest (bound in tests/test_lowbit_kernels.py). AMX flushes bf16 subnormals (pieces below
//   2^-126) to zero, an error below 2^-126 |u - o| per product.
// - weight-only float32 where the W-A8 tiles fit: x as two int8 digits per element (digits(),
//   lowbit_amx.h), then the W-A8 kernel with the two digits' int32 sums combined per group.
// Tile state is per thread and other libraries (oneDNN) use it too: every task loads our tile
// configuration and releases the tiles when it ends.
#include "lowbit_amx.h"

#include <algorithm>
#include <cstring>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11
#define QC_AMX 1
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace qc {
namespace lowbit {
namespace amx {

bool fits(const Geometry& g, bool a8) {
  return (g.cbits == 4 || g.cbits == 8) && g.gp % (a8 ? 64 : 32) == 0;
}

#if defined(QC_AMX)

namespace {

bool request_tiles() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  const bool avx512 = (b >> 16 & 1) && (b >> 17 & 1) && (b >> 30 & 1) && (b >> 31 & 1) && (c >> 11 & 1);
  const bool tiles = (d >> 22 & 1) && (d >> 24 & 1) && (d >> 25 & 1);   // AMX-BF16, AMX-TILE, AMX-INT8
  if (!avx512 || !tiles) return false;
  // Linux hands out tile data only to processes that ask (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)
  return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
}

constexpr int64_t kStepBytes = 1024;

// Tokens per pass over the weights: the A rows of a pass (all columns, every piece) stay in a
// core's L2 while every row block of the task streams by; each pass re-decodes the weights.
int64_t chunk_rows(int64_t row_bytes) {
  constexpr int64_t kBudget = int64_t{1} << 20;
  const int64_t rows = kBudget / std::max<int64_t>(row_bytes, 1) / 32 * 32;
  return std::min<int64_t>(512, std::max<int64_t>(32, rows));
}

}  // namespace

bool available() {
  static const bool ok = request_tiles();
  return ok;
}

#pragma GCC push_options
#pragma GCC target("amx-tile,amx-int8,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")

namespace {

// tileloadd / tilestored are asm statements without memory operands: keep the compiler from
// moving our buffer stores past them or our loads before them.
inline void barrier() { asm volatile("" ::: "memory"); }

struct alignas(64) TileConfig {
  uint8_t palette_id, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Tiles 0-3: C (2 token tiles x 2 row blocks), 4-5: A, 6-7: B; each 16 rows x 64 bytes.
struct TileScope {
  TileScope() {
    TileConfig c;
    std::memset(&c, 0, sizeof(c));
    c.palette_id = 1;
    for (int t = 0; t < 8; ++t) {
      c.rows[t] = 16;
      c.colsb[t] = 64;
    }
    _tile_loadconfig(&c);
  }
  ~TileScope() { _tile_release(); }
};

inline __m512i offsets_of(const WView& w, int64_t idx, int cb) {
  return w.offs ? _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.offs + idx)))
                : _mm512_set1_epi32(code_bias(cb));
}

// 16 floats to bf16 / fp16 bits, rounded to nearest even like torch's conversions (bf16 NaN: 0x7FC0).
inline __m256i to_half_bits(__m512 v, int dt) {
  if (dt == kF16) return _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512i bits = _mm512_castps_si512(v);
  __m512i h = _mm512_srli_epi32(
      _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF),
                                              _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1)))),
      16);
  h = _mm512_mask_mov_epi32(h, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(h);
}

// lowbit.h exp_bounded on 16 lanes (max/min_ps return their second operand for a NaN lane, as the
// scalar comparisons pass NaN; scalef scales by 2^n exactly, as ldexp).
inline __m512 exp16(__m512 t) {
  t = _mm512_min_ps(_mm512_set1_ps(88.7f), _mm512_max_ps(_mm512_set1_ps(-87.3f), t));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(t, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-0.693145751953125f), t);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(-1.428606765330187e-06f), r);
  __m512 p = _mm512_fmadd_ps(r, _mm512_set1_ps(1.0f / 720.0f), _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// lowbit.h apply_act on 16 lanes: the same IEEE steps lane by lane, so the same bits.
inline __m512 act16(__m512 v, int act) {
  if (act == kActRelu) return _mm512_max_ps(_mm512_setzero_ps(), v);   // NaN lanes pass (second operand)
  if (act == kActSilu)   // -x as a sign flip, as the scalar negation
    return _mm512_div_ps(v, _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_xor_ps(v, _mm512_set1_ps(-0.0f)))));
  if (act == kActGeluTanh) {
    const __m512 inner = _mm512_fmadd_ps(_mm512_set1_ps(0.044715f), _mm512_mul_ps(_mm512_mul_ps(v, v), v), v);
    const __m512 e = exp16(_mm512_mul_ps(_mm512_set1_ps(-1.5957691216057308f), inner));
    return _mm512_div_ps(v, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
  }
  if (act != kActGelu) return v;
  const __m512 u = _mm512_mul_ps(_mm512_abs_ps(v), _mm512_set1_ps(0.70710678118654752f));
  __m512 p = _mm512_fmadd_ps(u, _mm512_set1_ps(4.30638e-5f), _mm512_set1_ps(2.765672e-4f));
  p = _mm512_fmadd_ps(p, u, _mm512_set1_ps(1.520143e-4f));
  p = _mm512_fmadd_ps(p, u, _mm512_set1_ps(9.2705272e-3f));
  p = _mm512_fmadd_ps(p, u, _mm512_set1_ps(4.22820123e-2f));
  p = _mm512_fmadd_ps(p, u, _mm512_set1_ps(7.05230784e-2f));
  p = _mm512_fmadd_ps(p, u, _mm512_set1_ps(1.0f));
  p = _mm512_mul_ps(p, p);
  p = _mm512_mul_ps(p, p);
  p = _mm512_mul_ps(p, p);
  p = _mm512_mul_ps(p, p);
  const __m512 tail = _mm512_div_ps(_mm512_set1_ps(1.0f), p);
  const __m512 f = _mm512_mask_mov_ps(_mm512_sub_ps(_mm512_set1_ps(2.0f), tail),
                                      _mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_LT_OQ), tail);
  return _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.5f), v), f);
}

// y[row][n] = act(tot * sx[row] (W-A8; sx null: weight-only) + bias[n]) (+ res[row][n], float32 y
// only) for rows [r0, r1) and the real rows of blocks b, b + nb2 - 1, y in ydt; tot rows start at
// r0 (the pass's first row).
void store_rows(const float* tot, int64_t r0, int64_t r1, const float* sx, const float* bias, void* y, int ydt,
                int64_t n, int64_t b, int nb2, int act = kActNone, const float* res = nullptr) {
  for (int j = 0; j < nb2; ++j) {
    const int64_t n0 = (b + j) * kRows;
    if (n0 >= n) break;
    const __mmask16 lanes = static_cast<__mmask16>((1u << std::min<int64_t>(kRows, n - n0)) - 1);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(lanes, bias + n0) : _mm512_setzero_ps();
    for (int64_t row = r0; row < r1; ++row) {
      __m512 v = _mm512_loadu_ps(tot + (row - r0) * 2 * kRows + j * kRows);
      if (sx) v = _mm512_mul_ps(v, _mm512_set1_ps(sx[row]));
      if (bias) v = _mm512_add_ps(v, bv);
      if (act != kActNone) v = act16(v, act);
      if (res) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(lanes, res + row * n + n0));
      if (ydt == kF32) _mm512_mask_storeu_ps(static_cast<float*>(y) + row * n + n0, lanes, v);
      else _mm256_mask_storeu_epi16(static_cast<uint16_t*>(y) + row * n + n0, lanes, to_half_bits(v, ydt));
    }
  }
}

// ---- W-A8 ------------------------------------------------------------------------------------

// B tiles (one per 64 columns) of group gi of block bb. SYM (symmetric 4-bit weights, o = 8): the
// signed integers u - o, which TDPBSSD multiplies as they are, so no o * xsum correction is left for
// the epilogue (the nibbles are decoded to bytes anyway); else the unsigned codes u (TDPBSUD), 8-bit
// ones read in place (a signed copy of those cost more than the correction). usum: the sum of the
// tiles' values per row (sum u, or sum (u - o) when SYM), only wanted with activation zero points.
template <int CB, bool SYM>
const uint8_t* a8_btiles(const WView& w, int64_t bb, int64_t gi, uint8_t* buf, __m512i* usum) {
  const Geometry& g = w.g;
  const int64_t chunks = g.gp / (32 / CB);
  const uint8_t* src = w.packed + bb * g.block_bytes() + gi * chunks * kChunkBytes;
  const __m512i ones = _mm512_set1_epi8(1);
  __m512i us = _mm512_setzero_si512();
  static_assert(CB == 4 || !SYM, "8-bit codes are read in place (signed_tiles)");
  if constexpr (CB == 8) {
    if (usum)
      for (int64_t c = 0; c < chunks; ++c) us = _mm512_dpbusd_epi32(us, _mm512_loadu_si512(src + c * kChunkBytes), ones);
    if (usum) *usum = us;
    return src;
  } else {
    const __m512i nib = _mm512_set1_epi8(0x0F);
    const __m512i bias = _mm512_set1_epi8(SYM ? 8 : 0);
    for (int64_t c = 0; c < chunks; ++c) {
      const __m512i raw = _mm512_loadu_si512(src + c * kChunkBytes);
      const __m512i lo = _mm512_sub_epi8(_mm512_and_si512(raw, nib), bias);                         // columns 0..3
      const __m512i hi = _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi16(raw, 4), nib), bias);   // columns 4..7
      _mm512_storeu_si512(buf + (2 * c) * kChunkBytes, lo);
      _mm512_storeu_si512(buf + (2 * c + 1) * kChunkBytes, hi);
      if (usum && SYM) us = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(us, ones, lo), ones, hi);   // signed values
      else if (usum) us = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(us, lo, ones), hi, ones);   // unsigned codes
    }
    if (usum) *usum = us;
    return buf;
  }
}

// C tiles of 16 (TWO_M: 32) tokens x 16 (TWO_N: 32) rows over `steps` k steps, stored to cbuf[mi][j].
template <bool SYM, bool TWO_M, bool TWO_N>
void a8_dot(const int8_t* xa, int64_t ldx, const uint8_t* const* bt, int64_t steps, int32_t (*cbuf)[2][256]) {
  barrier();
  _tile_zero(0);
  if constexpr (TWO_N) _tile_zero(1);
  if constexpr (TWO_M) _tile_zero(2);
  if constexpr (TWO_M && TWO_N) _tile_zero(3);
  for (int64_t s = 0; s < steps; ++s) {
    _tile_loadd(4, xa + s * 64, ldx);
    if constexpr (TWO_M) _tile_loadd(5, xa + 16 * ldx + s * 64, ldx);
    _tile_loadd(6, bt[0] + s * kStepBytes, 64);
    if constexpr (TWO_N) _tile_loadd(7, bt[1] + s * kStepBytes, 64);
    if constexpr (SYM) {
      _tile_dpbssd(0, 4, 6);
      if constexpr (TWO_N) _tile_dpbssd(1, 4, 7);
      if constexpr (TWO_M) _tile_dpbssd(2, 5, 6);
      if constexpr (TWO_M && TWO_N) _tile_dpbssd(3, 5, 7);
    } else {
      _tile_dpbsud(0, 4, 6);
      if constexpr (TWO_N) _tile_dpbsud(1, 4, 7);
      if constexpr (TWO_M) _tile_dpbsud(2, 5, 6);
      if constexpr (TWO_M && TWO_N) _tile_dpbsud(3, 5, 7);
    }
  }
  _tile_stored(0, cbuf[0][0], 64);
  if constexpr (TWO_N) _tile_stored(1, cbuf[0][1], 64);
  if constexpr (TWO_M) _tile_stored(2, cbuf[1][0], 64);
  if constexpr (TWO_M && TWO_N) _tile_stored(3, cbuf[1][1], 64);
  barrier();
}

// tot[token] += s * (256 * A0 + A1) for the 16 tokens from mt, A_d = C_d - o * xsum_d (lowbit.h
// a8_group without activation zero points) of digit d; SYM: the tiles already hold A_d = C_d.
// 256 * float(A0) is exact; the sum rounds once.
template <bool SYM>
inline void digit_epilogue(const int32_t (*cbuf)[2][256], const A8View& a, int64_t ng, int64_t gi, int64_t mt,
                           int64_t mc, int nb2, const __m512i* ov, const __m512* sv, float* tot) {
  const __m512 radix = _mm512_set1_ps(256.0f);
  const auto acc = [&](const float* t) { return gi == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(t); };
  for (int r = 0; r < 16; ++r) {
    const int64_t row = mt + r;
    if (row >= a.m) break;
    float* t = tot + (row - mc) * 2 * kRows;
    if constexpr (SYM) {
      for (int j = 0; j < nb2; ++j) {
        const __m512i d0 = _mm512_load_si512(cbuf[0][j] + r * 16), d1 = _mm512_load_si512(cbuf[1][j] + r * 16);
        const __m512 both = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d0), radix, _mm512_cvtepi32_ps(d1));
        _mm512_storeu_ps(t + j * 16, _mm512_fmadd_ps(both, sv[j], acc(t + j * 16)));
      }
      continue;
    }
    const int64_t v0 = 2 * mt + r;   // code rows of the token's two digits: v0, v0 + 16
    const __m512i xs0 = _mm512_set1_epi32(a.xsum[v0 * ng + gi]), xs1 = _mm512_set1_epi32(a.xsum[(v0 + 16) * ng + gi]);
    for (int j = 0; j < nb2; ++j) {
      const __m512i d0 = _mm512_sub_epi32(_mm512_load_si512(cbuf[0][j] + r * 16), _mm512_mullo_epi32(ov[j], xs0));
      const __m512i d1 = _mm512_sub_epi32(_mm512_load_si512(cbuf[1][j] + r * 16), _mm512_mullo_epi32(ov[j], xs1));
      const __m512 both = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d0), radix, _mm512_cvtepi32_ps(d1));
      _mm512_storeu_ps(t + j * 16, _mm512_fmadd_ps(both, sv[j], acc(t + j * 16)));
    }
  }
}

// DIG 1: a.xq holds one code row per token. DIG 2: two digit rows per token (digits() below), 16
// tokens' first digits then their second digits per 32 code rows, so the two A tiles of a pass are
// one token tile's two digits and their int32 sums combine as 256 * A0 + A1. SYM: symmetric weights
// (w.offs null), multiplied as signed u - o (a8_btiles).
template <int CB, int DIG, bool SYM>
void a8_run(const WView& w, const A8View& a, int64_t b0, int64_t b1, int64_t t0, int64_t t1) {
  const Geometry& g = w.g;
  const int64_t steps = g.gp / 64;
  std::vector<uint8_t> bbuf(CB == 4 ? 2 * steps * kStepBytes : 0);
  const int64_t mchunk = chunk_rows(g.kp * DIG);
  std::vector<float> tot(std::min(mchunk, t1 - t0) * 2 * kRows);
  // two C buffers, alternated: a pass's epilogue reads one while the next pass's tiles store to the other
  alignas(64) int32_t cbufs[2][2][2][256];
  int cur = 0;
  TileScope tiles;
  for (int64_t mc = t0; mc < t1; mc += mchunk) {
    const int64_t mrows = std::min(mchunk, t1 - mc);
    for (int64_t b = b0; b < b1; b += 2) {
      const int nb2 = b + 2 <= b1 ? 2 : 1;
      // tot: group 0's epilogue starts it from zero (no fill)
      for (int64_t gi = 0; gi < g.ng; ++gi) {
        const uint8_t* bt[2] = {nullptr, nullptr};
        __m512 sv[2];
        __m512i ov[2], ws[2];
        for (int j = 0; j < nb2; ++j) {
          __m512i us;
          bt[j] = a8_btiles<CB, SYM>(w, b + j, gi, bbuf.data() + (CB == 4 ? j * steps * kStepBytes : 0),
                                     a.zx ? &us : nullptr);
          const int64_t idx = ((b + j) * g.ng + gi) * kRows;
          sv[j] = _mm512_loadu_ps(w.scales + idx);
          ov[j] = offsets_of(w, idx, CB);
          // wsum = sum (u - o) = sum u - o * gp (padding holds u = o); SYM: the tiles' own sum
          if (!a.zx) ws[j] = _mm512_setzero_si512();
          else if constexpr (SYM) ws[j] = us;
          else ws[j] = _mm512_sub_epi32(us, _mm512_mullo_epi32(ov[j], _mm512_set1_epi32(static_cast<int32_t>(g.gp))));
        }
        for (int64_t mt = mc; mt < mc + mrows; mt += 32 / DIG) {
          const bool two = DIG == 2 || mt + 16 < mc + mrows;
          const int8_t* xa = a.xq + mt * DIG * a.ldx + gi * g.gp;
          int32_t(*cbuf)[2][256] = cbufs[cur];
          cur ^= 1;
          if (two && nb2 == 2) a8_dot<SYM, true, true>(xa, a.ldx, bt, steps, cbuf);
          else if (two) a8_dot<SYM, true, false>(xa, a.ldx, bt, steps, cbuf);
          else if (nb2 == 2) a8_dot<SYM, false, true>(xa, a.ldx, bt, steps, cbuf);
          else a8_dot<SYM, false, false>(xa, a.ldx, bt, steps, cbuf);
          if constexpr (DIG == 2) {
            digit_epilogue<SYM>(cbuf, a, g.ng, gi, mt, mc, nb2, ov, sv, tot.data());
            continue;
          }
          for (int mi = 0; mi < (two ? 2 : 1); ++mi) {
            for (int r = 0; r < 16; ++r) {
              const int64_t row = mt + mi * 16 + r;
              if (row >= a.m) break;
              const __m512i xs = SYM ? _mm512_setzero_si512() : _mm512_set1_epi32(a.xsum[row * g.ng + gi]);
              float* t = tot.data() + (row - mc) * 2 * kRows;
              for (int j = 0; j < nb2; ++j) {
                // lowbit.h a8_group, lane by lane, as the vector kernels compute it
                __m512i v = _mm512_load_si512(cbuf[mi][j] + r * 16);
                if constexpr (!SYM) v = _mm512_sub_epi32(v, _mm512_mullo_epi32(ov[j], xs));
                if (a.zx) v = _mm512_sub_epi32(v, _mm512_mullo_epi32(_mm512_set1_epi32(a.zx[row]), ws[j]));
                const __m512 prev = gi == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(t + j * 16);
                _mm512_storeu_ps(t + j * 16, _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), sv[j], prev));
              }
            }
          }
        }
      }
      store_rows(tot.data(), mc, std::min(mc + mrows, a.m), a.sx, a.bias, a.y, kF32, g.n, b, nb2, a.act, a.res);
    }
  }
}

// ---- weight-only -----------------------------------------------------------------------------

// bf16 B tiles (one per 32 columns: 16 rows of 2 columns x 16 weight rows) of the integers
// u - o of group gi of block bb.
template <int CB>
void wo_btiles(const WView& w, int64_t bb, int64_t gi, __m512i o, uint8_t* dst) {
  constexpr int KC = 32 / CB;  // columns per chunk
  const Geometry& g = w.g;
  const int64_t chunks = g.gp / KC;
  const uint8_t* src = w.packed + bb * g.block_bytes() + gi * chunks * kChunkBytes;
  const __m512i mask = _mm512_set1_epi32((1 << CB) - 1);
  const __m512i top = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  for (int64_t c = 0; c < chunks; ++c) {
    const __m512i raw = _mm512_loadu_si512(src + c * kChunkBytes);
#pragma GCC unroll 8
    for (int i = 0; i < KC; i += 2) {
      const unsigned sh0 = (i & 3) * 8 + (i >> 2) * CB, sh1 = ((i + 1) & 3) * 8 + ((i + 1) >> 2) * CB;  // code_shift
      const __m512 v0 = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_and_si512(_mm512_srli_epi32(raw, sh0), mask), o));
      const __m512 v1 = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_and_si512(_mm512_srli_epi32(raw, sh1), mask), o));
      // |u - o| <= 255 is exact in bf16: its bits are the float's top half
      const __m512i pair = _mm512_or_si512(_mm512_srli_epi32(_mm512_castps_si512(v0), 16),
                                           _mm512_and_si512(_mm512_castps_si512(v1), top));
      _mm512_storeu_si512(dst + (c * KC / 2 + i / 2) * 64, pair);
    }
  }
}

template <bool TWO_M, bool TWO_N>
void wo_dot(const uint16_t* xa, int64_t piece, int pieces, int64_t ldx, const uint8_t* const* bt, int64_t steps,
            float (*cbuf)[2][256]) {
  const int64_t stride = ldx * 2;
  barrier();
  _tile_zero(0);
  if constexpr (TWO_N) _tile_zero(1);
  if constexpr (TWO_M) _tile_zero(2);
  if constexpr (TWO_M && TWO_N) _tile_zero(3);
  for (int64_t s = 0; s < steps; ++s) {
    _tile_loadd(6, bt[0] + s * kStepBytes, 64);
    if constexpr (TWO_N) _tile_loadd(7, bt[1] + s * kStepBytes, 64);
    for (int p = 0; p < pieces; ++p) {
      const uint16_t* pa = xa + p * piece + s * 32;
      _tile_loadd(4, pa, stride);
      if constexpr (TWO_M) _tile_loadd(5, pa + 16 * ldx, stride);
      _tile_dpbf16ps(0, 4, 6);
      if constexpr (TWO_N) _tile_dpbf16ps(1, 4, 7);
      if constexpr (TWO_M) _tile_dpbf16ps(2, 5, 6);
      if constexpr (TWO_M && TWO_N) _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, cbuf[0][0], 64);
  if constexpr (TWO_N) _tile_stored(1, cbuf[0][1], 64);
  if constexpr (TWO_M) _tile_stored(2, cbuf[1][0], 64);
  if constexpr (TWO_M && TWO_N) _tile_stored(3, cbuf[1][1], 64);
  barrier();
}

template <int CB>
void wo_run(const WView& w, const uint16_t* xp, int pieces, int64_t ldx, int64_t m, int64_t m16, const float* bias,
            void* y, int ydt, int64_t b0, int64_t b1, int64_t t0, int64_t t1) {
  const Geometry& g = w.g;
  const int64_t steps = g.gp / 32;
  std::vector<uint8_t> bbuf(2 * steps * kStepBytes);
  const int64_t mchunk = chunk_rows(g.kp * 2 * pieces);
  std::vector<float> tot(std::min(mchunk, t1 - t0) * 2 * kRows);
  alignas(64) float cbuf[2][2][256];
  TileScope tiles;
  for (int64_t mc = t0; mc < t1; mc += mchunk) {
    const int64_t mrows = std::min(mchunk, t1 - mc);
    for (int64_t b = b0; b < b1; b += 2) {
      const int nb2 = b + 2 <= b1 ? 2 : 1;
      std::fill(tot.begin(), tot.begin() + mrows * 2 * kRows, 0.0f);
      for (int64_t gi = 0; gi < g.ng; ++gi) {
        const uint8_t* bt[2] = {nullptr, nullptr};
        __m512 sv[2];
        for (int j = 0; j < nb2; ++j) {
          const int64_t idx = ((b + j) * g.ng + gi) * kRows;
          sv[j] = _mm512_loadu_ps(w.scales + idx);
          uint8_t* dst = bbuf.data() + j * steps * kStepBytes;
          wo_btiles<CB>(w, b + j, gi, offsets_of(w, idx, CB), dst);
          bt[j] = dst;
        }
        for (int64_t mt = mc; mt < mc + mrows; mt += 32) {
          const bool two = mt + 16 < mc + mrows;
          const uint16_t* xa = xp + mt * ldx + gi * g.gp;
          const int64_t piece = m16 * ldx;
          if (two && nb2 == 2) wo_dot<true, true>(xa, piece, pieces, ldx, bt, steps, cbuf);
          else if (two) wo_dot<true, false>(xa, piece, pieces, ldx, bt, steps, cbuf);
          else if (nb2 == 2) wo_dot<false, true>(xa, piece, pieces, ldx, bt, steps, cbuf);
          else wo_dot<false, false>(xa, piece, pieces, ldx, bt, steps, cbuf);
          for (int mi = 0; mi < (two ? 2 : 1); ++mi) {
            for (int r = 0; r < 16; ++r) {
              const int64_t row = mt + mi * 16 + r;
              if (row >= m) break;
              float* t = tot.data() + (row - mc) * 2 * kRows;
              for (int j = 0; j < nb2; ++j)   // y += s_g * S_g, one rounding per group
                _mm512_storeu_ps(t + j * 16, _mm512_fmadd_ps(_mm512_load_ps(cbuf[mi][j] + r * 16), sv[j],
                                                             _mm512_loadu_ps(t + j * 16)));
            }
          }
        }
      }
      store_rows(tot.data(), mc, std::min(mc + mrows, m), nullptr, bias, y, ydt, g.n, b, nb2);
    }
  }
}

}  // namespace

bool signed_tiles(const WView& w) { return w.offs == nullptr && w.g.cbits == 4; }

void a8(const WView& w, const A8View& a, int64_t b0, int64_t b1, int64_t t0, int64_t t1, int digits) {
  const bool sym = signed_tiles(w);
  const bool four = w.g.cbits == 4;
  if (digits == 2 && sym) a8_run<4, 2, true>(w, a, b0, b1, t0, t1);
  else if (digits == 2) four ? a8_run<4, 2, false>(w, a, b0, b1, t0, t1) : a8_run<8, 2, false>(w, a, b0, b1, t0, t1);
  else if (sym) a8_run<4, 1, true>(w, a, b0, b1, t0, t1);
  else four ? a8_run<4, 1, false>(w, a, b0, b1, t0, t1) : a8_run<8, 1, false>(w, a, b0, b1, t0, t1);
}

bool digits(const float* x, int64_t ldx, int64_t m, int64_t r0, int64_t r1, int8_t* codes, float* sx, bool tiles) {
  const __m512i lim = _mm512_set1_epi32(kDigitMax), half = _mm512_set1_epi32(128);
  for (int64_t row = r0; row < r1; ++row) {
    // the first digit's row; the second's 16 rows on (tiles) or next
    int8_t* c0 = codes + (tiles ? (row / 16) * 32 + row % 16 : 2 * row) * ldx;
    int8_t* c1 = c0 + (tiles ? 16 : 1) * ldx;
    const float* xr = x + row * ldx;
    __m512 mx = _mm512_setzero_ps();
    __mmask16 bad = 0;
    for (int64_t k = 0; row < m && k < ldx; k += 16) {
      const __mmask16 lanes = static_cast<__mmask16>((1u << std::min<int64_t>(16, ldx - k)) - 1);
      const __m512 v = _mm512_maskz_loadu_ps(lanes, xr + k);
      bad |= _mm512_fpclass_ps_mask(v, 0x99);   // QNaN, SNaN, +inf, -inf
      mx = _mm512_max_ps(mx, _mm512_abs_ps(v));
    }
    if (bad) return false;
    const float amax = _mm512_reduce_max_ps(mx);
    if (amax == 0.0f) {   // a zero token (or a padding row): zero digits, any scale
      std::memset(c0, 0, static_cast<size_t>(ldx));
      std::memset(c1, 0, static_cast<size_t>(ldx));
      if (tiles) sx[row] = 0.0f;
      else sx[2 * row] = sx[2 * row + 1] = 0.0f;
      continue;
    }
    if (amax < kDigitTiny) return false;   // 32639 / amax would overflow
    const float s = amax / static_cast<float>(kDigitMax);
    if (tiles) {
      sx[row] = s;
    } else {
      sx[2 * row] = 256.0f * s;
      sx[2 * row + 1] = s;
    }
    const __m512 inv = _mm512_set1_ps(static_cast<float>(kDigitMax) / amax);
    for (int64_t k = 0; k < ldx; k += 16) {
      const __mmask16 lanes = static_cast<__mmask16>((1u << std::min<int64_t>(16, ldx - k)) - 1);
      __m512i d = _mm512_cvt_roundps_epi32(_mm512_mul_ps(_mm512_maskz_loadu_ps(lanes, xr + k), inv),
                                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      d = _mm512_max_epi32(_mm512_min_epi32(d, lim), _mm512_sub_epi32(_mm512_setzero_si512(), lim));
      const __m512i hi = _mm512_srai_epi32(_mm512_add_epi32(d, half), 8);   // floor((D + 128) / 256)
      const __m512i lo = _mm512_sub_epi32(d, _mm512_slli_epi32(hi, 8));    // in [-128, 127]
      _mm_mask_storeu_epi8(c0 + k, lanes, _mm512_cvtepi32_epi8(hi));
      _mm_mask_storeu_epi8(c1 + k, lanes, _mm512_cvtepi32_epi8(lo));
    }
  }
  return true;
}

void wo(const WView& w, const uint16_t* xp, int pieces, int64_t ldx, int64_t m, int64_t m16, const float* bias,
        void* y, int ydt, int64_t b0, int64_t b1, int64_t t0, int64_t t1) {
  if (w.g.cbits == 4) wo_run<4>(w, xp, pieces, ldx, m, m16, bias, y, ydt, b0, b1, t0, t1);
  else wo_run<8>(w, xp, pieces, ldx, m, m16, bias, y, ydt, b0, b1, t0, t1);
}

bool split(const void* x, int xdt, int64_t ldx, int64_t m, int64_t r0, int64_t r1, int pieces, int64_t m16,
           uint16_t* out) {
  const __m512i half = _mm512_set1_epi32(0x7FFF), one = _mm512_set1_epi32(1);
  const __m512i expo = _mm512_set1_epi32(0x7F800000);
  __mmask16 bad = 0;
  for (int64_t row = r0; row < r1; ++row) {
    for (int64_t k = 0; k < ldx; k += 16) {
      const int64_t left = std::min<int64_t>(16, ldx - k);
      const __mmask16 lanes = static_cast<__mmask16>((1u << left) - 1);
      __m512 v = _mm512_setzero_ps();
      if (row < m && xdt == kF32) {
        v = _mm512_maskz_loadu_ps(lanes, static_cast<const float*>(x) + row * ldx + k);
      } else if (row < m) {   // bf16 / fp16 bits, widened exactly
        const __m256i h = _mm256_maskz_loadu_epi16(lanes, static_cast<const uint16_t*>(x) + row * ldx + k);
        v = xdt == kF16 ? _mm512_cvtph_ps(h) : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
      }
      for (int p = 0; p < pieces; ++p) {
        const __m512i bits = _mm512_castps_si512(v);
        // round to nearest even bf16 (a rest that fits 8 bits, as float16's last piece, stays as is)
        const __m512i h =
            _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(half, _mm512_and_si512(_mm512_srli_epi32(bits, 16), one))), 16);
        const __m512i hb = _mm512_slli_epi32(h, 16);
        bad |= _mm512_mask_cmpeq_epi32_mask(lanes, _mm512_and_si512(hb, expo), expo);   // inf / nan
        _mm256_mask_storeu_epi16(out + (p * m16 + row) * ldx + k, lanes, _mm512_cvtepi32_epi16(h));
        v = _mm512_sub_ps(v, _mm512_castsi512_ps(hb));
      }
    }
  }
  return bad == 0;
}

bool act_rows(float* y, int64_t count, int act, const float* res) {
  if (act == kActNone && res == nullptr) return true;
  for (int64_t i = 0; i < count; i += 16) {
    const __mmask16 lanes = static_cast<__mmask16>(count - i >= 16 ? 0xFFFF : (1u << (count - i)) - 1);
    __m512 v = act16(_mm512_maskz_loadu_ps(lanes, y + i), act);
    if (res) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(lanes, res + i));
    _mm512_mask_storeu_ps(y + i, lanes, v);
  }
  return true;
}

#pragma GCC pop_options

#else  // no AMX build

bool available() { return false; }
bool signed_tiles(const WView&) { return false; }
void a8(const WView&, const A8View&, int64_t, int64_t, int64_t, int64_t, int) {}
bool digits(const float*, int64_t, int64_t, int64_t, int64_t, int8_t*, float*, bool) { return false; }
bool act_rows(float*, int64_t, int, const float*) { return false; }
void wo(const WView&, const uint16_t*, int, int64_t, int64_t, int64_t, const float*, void*, int, int64_t, int64_t, int64_t,
        int64_t) {}
bool split(const void*, int, int64_t, int64_t, int64_t, int64_t, int, int64_t, uint16_t*) { return false; }

#endif

}  // namespace amx
}  // namespace lowbit
}  // namespace qc
