// AMX tile kernels of the low-bit matmuls (csrc/cpu/lowbit_amx.cpp), used for 16 tokens or more
// when the CPU has AMX (Sapphire Rapids and later) and the OS grants tile state.
#pragma once

#include <stdint.h>

#include "lowbit_views.h"

namespace qc {
namespace lowbit {
namespace amx {

constexpr int kTileRows = 16;   // tokens per A tile: calls pad their rows to a multiple of this

enum Dtype : int { kF32 = 0, kBF16 = 1, kF16 = 2 };   // activations and weight-only outputs

// CPU has AMX-TILE/INT8/BF16 and AVX-512, and the kernel granted this process tile data (asked once).
bool available();

// Whether the kernels take this weight: 4/8-bit containers, padded groups a whole number of k
// steps (W-A8: 64 columns, weight-only: 32).
bool fits(const Geometry& g, bool a8);

// Whether a8() multiplies this weight as signed u - o (symmetric 4-bit): it then reads no a.xsum.
bool signed_tiles(const WView& w);

// W-A8 on tiles: same int32 group sums and float epilogue as the vector kernels. a.xq has m16
// rows (a multiple of 16, padding rows zero); a.m real rows are written. Row blocks [b0, b1), token
// rows [t0, t1) (multiples of 16).
// digits 2: a.xq, a.xsum and a.sx come from digits() (two code rows per token); weight-only
// float32 as a W-A8 product, y = sx * sum_g s_g (256 A0 + A1).
void a8(const WView& w, const A8View& a, int64_t b0, int64_t b1, int64_t t0, int64_t t1, int digits = 1);

// Float32 activations as two int8 digits per element, for the weight-only kernel: per token,
// sx = amax / kDigitMax and D = round(x * (kDigitMax / amax)) (nearest even, |D| <= kDigitMax),
// D = 256 d0 + d1 with d1 in [-128, 127], d0 in [-127, 127]. So |x - sx D| <= sx / 2 (1 + 2^-6)
// (x * inv and sx round, |x / sx| <= kDigitMax): within amax / 64000 (about 2^-16 amax) of x,
// where two bf16 pieces are within 2^-16 |x|; the int8 tiles run at twice the bf16 rate and take
// the weight codes as they are stored (no decode).
// Token rows [r0, r1) of x [m, ldx] (rows past m: zero digits) to codes laid out
// tiles: [m16 / 16][2][16][ldx] with sx [m16] (r0, r1 multiples of 16), for the tile kernel;
// else: [2 m][ldx], each token's two digits as two rows with scales sx[2t] = 256 s, sx[2t + 1] = s,
// for the vector W-A8 kernel (y = row 2t + row 2t + 1). Plain AVX-512, no tile instructions.
// False when a row holds inf / nan or its amax is below kDigitTiny (the caller takes another path).
constexpr int32_t kDigitMax = 127 * 256 + 127;
constexpr float kDigitTiny = 1e-30f;
bool digits(const float* x, int64_t ldx, int64_t m, int64_t r0, int64_t r1, int8_t* codes, float* sx,
            bool tiles = true);

// y[0, count) = lowbit.h apply_act(y, act) (+ res[0, count)) on 16 lanes at a time: the AVX-512
// epilogue of the tile kernels' store, the same IEEE steps as the scalar functions, so the same bits.
// Plain AVX-512 (F / BW / VL / DQ), no tile instructions. False where this build has no AVX-512 code.
bool act_rows(float* y, int64_t count, int act, const float* res);

// rows [r0, r1) of m16 from a [m, ldx] matrix x of dtype xdt (rows past m: zeros) -> `pieces`
// bfloat16 matrices (bits) [pieces][m16][ldx] whose sum is x exactly (1: x is bf16-valued,
// 2: float16-valued, 3: any float32). False when an entry is not finite (the caller takes
// another kernel).
bool split(const void* x, int xdt, int64_t ldx, int64_t m, int64_t r0, int64_t r1, int pieces, int64_t m16,
           uint16_t* out);

// Weight-only on bf16 tiles: y[m][n] = sum_g s_g * sum_{k in g} x[m][k] (u - o) (+ bias), x given
// as `pieces` bf16 matrices from split(); products exact, sums in fp32. Row blocks [b0, b1),
// token rows [t0, t1) (multiples of 16). y [m, n] is written in ydt (rounded to nearest even, as
// torch converts).
void wo(const WView& w, const uint16_t* xp, int pieces, int64_t ldx, int64_t m, int64_t m16, const float* bias,
        void* y, int ydt, int64_t b0, int64_t b1, int64_t t0, int64_t t1);

}  // namespace amx
}  // namespace lowbit
}  // namespace qc
