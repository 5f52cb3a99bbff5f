// Views of one low-bit matmul call shared by the CPU kernel files (lowbit_gemm.cpp,
// lowbit_amx.cpp): the blocked weight (layout: qcompress/lowbit.h) and the int8 activations.
#pragma once

#include <stdint.h>

#include "qcompress/lowbit.h"

namespace qc {
namespace lowbit {

struct WView {  // one blocked weight
  const uint8_t* packed;
  const float* scales;
  const uint8_t* offs;   // null: symmetric
  Geometry g;
};

struct A8View {  // activation codes of one call, padded to Kp columns
  const int8_t* xq;
  int64_t ldx, m;
  const int32_t* xsum;   // [m][ng]
  const float* sx;       // [m]
  const int32_t* zx;     // [m] or null
  const float* bias;     // [n] or null
  float* y;              // [m][n]
  int act = kActNone;    // lowbit.h Act, applied to y (the tile kernels' store; others leave it to the caller)
  const float* res = nullptr;   // [m][n] added after act (same)
};

}  // namespace lowbit
}  // namespace qc
