// CPU kernel of the float formats' fake quantization (per-element math: qcompress/float_math.h),
// with its schema (TORCH_LIBRARY_FRAGMENT) and meta kernel. Scales come in computed (a torch
// reduction, qcompress/quant/floats.py); this pass reads each element once and writes it once.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "qcompress/float_math.h"

namespace qc {
namespace {

int dtype_code(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return fmath::kF32;
    case at::kBFloat16: return fmath::kBF16;
    case at::kHalf: return fmath::kF16;
    default: TORCH_CHECK(false, "float fake quantization takes float32, bfloat16 or float16, got ", t);
  }
  return -1;
}

template <typename T>
inline float load(const T* p, int64_t i) { return static_cast<float>(p[i]); }

template <typename T>
inline void store(T* p, int64_t i, float v) { p[i] = static_cast<T>(v); }  // v is already representable

template <typename X, typename S>
void run(const at::Tensor& x, const at::Tensor& scale, at::Tensor& y, int64_t rows, int64_t cols,
         int64_t br, int64_t bc, int64_t bits) {
  const X* xp = x.data_ptr<X>();
  const S* sp = scale.data_ptr<S>();
  X* yp = y.data_ptr<X>();
  const int xd = dtype_code(x.scalar_type()), sd = dtype_code(scale.scalar_type());
  const int qd = xd == sd ? xd : fmath::kF32;
  const int64_t ncs = (cols + bc - 1) / bc;
  at::parallel_for(0, rows, std::max<int64_t>(1, 32768 / std::max<int64_t>(cols, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const S* srow = sp + (r / br) * ncs;
      const X* xr = xp + r * cols;
      X* yr = yp + r * cols;
      for (int64_t c0 = 0; c0 < cols; c0 += bc) {
        const float s = load(srow, c0 / bc);
        const int64_t c1 = std::min(cols, c0 + bc);
        for (int64_t c = c0; c < c1; ++c)
          store(yr, c, fmath::fake_quant(load(xr, c), s, static_cast<int>(bits), qd, sd, xd));
      }
    }
  });
}

template <typename X>
void dispatch_scale(const at::Tensor& x, const at::Tensor& s, at::Tensor& y, int64_t rows, int64_t cols,
                    int64_t br, int64_t bc, int64_t bits) {
  if (s.scalar_type() == at::kFloat) return run<X, float>(x, s, y, rows, cols, br, bc, bits);
  TORCH_CHECK(s.scalar_type() == x.scalar_type(), "float_fake_quant: the scale is float32 or x's dtype, got ",
              s.scalar_type(), " for ", x.scalar_type());
  run<X, X>(x, s, y, rows, cols, br, bc, bits);
}

void check_args(const at::Tensor& x, const at::Tensor& scale, int64_t br, int64_t bc, int64_t bits) {
  TORCH_CHECK(x.dim() == 2, "float_fake_quant: x must be 2-D [rows, cols], got ", x.sizes());
  TORCH_CHECK(bits == 8 || bits == 4, "float_fake_quant: bits must be 8 (e4m3) or 4 (E2M1), got ", bits);
  TORCH_CHECK(br >= 1 && bc >= 1, "float_fake_quant: block sizes must be >= 1");
  const int64_t need = ((x.size(0) + br - 1) / br) * ((x.size(1) + bc - 1) / bc);
  TORCH_CHECK(x.size(0) == 0 || x.size(1) == 0 || scale.numel() == need, "float_fake_quant: ", need,
              " scales expected for ", x.sizes(), " in blocks of ", br, " x ", bc, ", got ", scale.numel());
}

at::Tensor float_fake_quant_cpu(const at::Tensor& x_in, const at::Tensor& scale_in, int64_t br, int64_t bc,
                                int64_t bits) {
  check_args(x_in, scale_in, br, bc, bits);
  const at::Tensor x = x_in.contiguous();
  const at::Tensor scale = scale_in.contiguous();
  at::Tensor y = at::empty_like(x);
  if (x.numel() == 0) return y;
  const int64_t rows = x.size(0), cols = x.size(1);
  switch (x.scalar_type()) {
    case at::kFloat: dispatch_scale<float>(x, scale, y, rows, cols, br, bc, bits); break;
    case at::kBFloat16: dispatch_scale<c10::BFloat16>(x, scale, y, rows, cols, br, bc, bits); break;
    case at::kHalf: dispatch_scale<c10::Half>(x, scale, y, rows, cols, br, bc, bits); break;
    default: dtype_code(x.scalar_type());
  }
  return y;
}

at::Tensor float_fake_quant_meta(const at::Tensor& x, const at::Tensor& scale, int64_t br, int64_t bc, int64_t bits) {
  check_args(x, scale, br, bc, bits);
  return at::empty_like(x, at::MemoryFormat::Contiguous);
}

}  // namespace
}  // namespace qc

TORCH_LIBRARY_FRAGMENT(qcompress, m) {
  // x [rows, cols]; one scale per br x bc block (row-major over blocks), float32 or x's dtype;
  // bits 8: e4m3, 4: E2M1. Returns x^ in x's dtype (quant/floats.py's math, bit for bit).
  m.def("float_fake_quant(Tensor x, Tensor scale, int block_rows, int block_cols, int bits) -> Tensor");
}

TORCH_LIBRARY_IMPL(qcompress, CPU, m) { m.impl("float_fake_quant", &qc::float_fake_quant_cpu); }
TORCH_LIBRARY_IMPL(qcompress, Meta, m) { m.impl("float_fake_quant", &qc::float_fake_quant_meta); }
