// CPU dequantize, straight-through backward, int32 packing and the 1-bit compressor; plus the
// argument checks shared with the CUDA glue.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "kernels.h"
#include "vec.h"

namespace qc {

QuantConfig make_config(const at::Tensor& x, const std::optional<at::Tensor>& range, int64_t rows,
                        int64_t cols, int64_t group, int64_t bits, int64_t kind, bool symmetric,
                        bool deepspeed, int64_t rounding, int64_t seed) {
  TORCH_CHECK(rows >= 0 && cols >= 0 && rows * cols == x.numel(), "qcompress: layout rows=", rows,
              " x cols=", cols, " does not match the tensor's ", x.numel(), " elements");
  TORCH_CHECK(group >= 0, "qcompress: group must be >= 0, got ", group);
  TORCH_CHECK(group > 0 || x.numel() == 0, "qcompress: group 0 (zero-width view) needs an empty tensor");
  TORCH_CHECK(bits >= 1 && bits <= 16, "qcompress: bits must be in 1..16, got ", bits);
  TORCH_CHECK(kind >= kInt && kind <= kTernary, "qcompress: kind must be 0 (int), 1 (binary) or 2 (ternary), got ", kind);
  TORCH_CHECK(kind == kInt || symmetric, "qcompress: binary/ternary quantization is symmetric only");
  TORCH_CHECK(rounding == kNearest || rounding == kStochastic, "qcompress: rounding must be 0 or 1, got ", rounding);
  TORCH_CHECK(x.is_floating_point(), "qcompress: expected a floating point tensor, got ", x.scalar_type());
  QuantConfig c;
  c.rows = rows;
  c.cols = cols;
  c.group = group;
  c.bits = static_cast<int>(bits);
  c.kind = static_cast<int>(kind);
  c.rounding = static_cast<int>(rounding);
  c.symmetric = symmetric;
  c.deepspeed = deepspeed;
  c.seed = static_cast<uint32_t>(seed);
  if (deepspeed && !symmetric) {
    c.qmin = 0.0f;
    c.qmax = static_cast<float>((1 << bits) - 1);
  } else {
    c.qmin = static_cast<float>(-(1 << (bits - 1)));
    c.qmax = static_cast<float>((1 << (bits - 1)) - 1);
  }
  if (range.has_value()) {
    const at::Tensor& r = *range;
    TORCH_CHECK(r.scalar_type() == at::kFloat && r.numel() == 2,
                "qcompress: range must be a float32 tensor [min, max]");
    c.has_range = true;
    if (r.device().is_cpu()) {
      at::Tensor rc = r.contiguous();
      c.range_lo = rc.data_ptr<float>()[0];
      c.range_hi = rc.data_ptr<float>()[1];
    }
  }
  return c;
}

void check_dequant_args(const at::Tensor& q, const at::Tensor& scale, const std::optional<at::Tensor>& zp,
                        int64_t rows, int64_t cols, int64_t group) {
  TORCH_CHECK(rows >= 0 && cols >= 0 && rows * cols == q.numel(), "qcompress.dequantize: layout rows=", rows,
              " x cols=", cols, " does not match the ", q.numel(), " codes");
  TORCH_CHECK(group > 0 || q.numel() == 0, "qcompress.dequantize: group must be >= 1");
  TORCH_CHECK(!q.is_floating_point() && !q.is_complex() && q.scalar_type() != at::kBool,
              "qcompress.dequantize: codes must be an integer tensor, got ", q.scalar_type());
  const int64_t ngr = group > 0 ? std::max<int64_t>(1, (cols + group - 1) / group) : 1;
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == rows * ngr,
              "qcompress.dequantize: expected ", rows * ngr, " float32 scales, got ", scale.numel(), " ",
              scale.scalar_type());
  if (zp.has_value()) {
    TORCH_CHECK(zp->scalar_type() == at::kFloat && zp->numel() == rows * ngr,
                "qcompress.dequantize: expected ", rows * ngr, " float32 zero points, got ", zp->numel());
  }
}

namespace {

template <typename Q>
inline V load_int(const Q* p, int n) {
  float tmp[kW] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int j = 0; j < n; ++j) tmp[j] = static_cast<float>(p[j]);
  return V::loadu(tmp);
}

template <typename O>
inline void store_out(O* p, V v, int n) {
  if constexpr (std::is_same_v<O, double>) {
    float tmp[kW];
    v.store(tmp);
    for (int j = 0; j < n; ++j) p[j] = static_cast<double>(tmp[j]);
  } else {
    store_f(p, v, n);
  }
}

}  // namespace

at::Tensor dequantize_cpu(const at::Tensor& q_, const at::Tensor& scale_, const std::optional<at::Tensor>& zp_,
                          int64_t rows, int64_t cols, int64_t group, at::ScalarType dtype) {
  check_dequant_args(q_, scale_, zp_, rows, cols, group);
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kDouble || dtype == at::kBFloat16 || dtype == at::kHalf,
              "qcompress.dequantize: output dtype must be a float type, got ", dtype);
  at::Tensor q = q_.contiguous(), scale = scale_.contiguous();
  at::Tensor zp = zp_.has_value() ? zp_->contiguous() : at::Tensor();
  at::Tensor out = at::empty(q.sizes(), q.options().dtype(dtype));
  if (q.numel() == 0) return out;
  const int64_t ngr = std::max<int64_t>(1, (cols + group - 1) / group);
  const float* s = scale.data_ptr<float>();
  const float* z = zp.defined() ? zp.data_ptr<float>() : nullptr;
  AT_DISPATCH_INTEGRAL_TYPES(q.scalar_type(), "qcompress_dequantize", [&] {
    using Q = scalar_t;
    const Q* qp = q.data_ptr<Q>();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "qcompress_dequantize_out", [&] {
      scalar_t* op = out.data_ptr<scalar_t>();
      const int64_t G = rows * ngr;
      const int64_t grain = std::max<int64_t>(1, 16384 / group);
      at::parallel_for(0, G, grain, [&](int64_t g0, int64_t g1) {
        for (int64_t g = g0; g < g1; ++g) {
          const int64_t j = g % ngr;
          const int64_t start = (g / ngr) * cols + j * group;
          const int64_t len = std::max<int64_t>(0, std::min(group, cols - j * group));
          const V sv(s[g]);
          const V zv(z ? z[g] : 0.0f);
          for (int64_t i = 0; i < len; i += kW) {
            const int n = static_cast<int>(std::min<int64_t>(kW, len - i));
            const V qv = load_int(qp + start + i, n);
            store_out(op + start + i, z ? (qv - zv) * sv : qv * sv, n);
          }
        }
      });
    });
  });
  return out;
}

at::Tensor ste_backward_cpu(const at::Tensor& grad_, const at::Tensor& mask_) {
  TORCH_CHECK(mask_.scalar_type() == at::kBool, "qcompress.ste_backward: mask must be bool");
  TORCH_CHECK(grad_.sizes() == mask_.sizes(), "qcompress.ste_backward: grad ", grad_.sizes(),
              " and mask ", mask_.sizes(), " differ in shape");
  at::Tensor grad = grad_.contiguous(), mask = mask_.contiguous();
  at::Tensor out = at::empty_like(grad, at::MemoryFormat::Contiguous);
  const bool* m = mask.data_ptr<bool>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, grad.scalar_type(), "qcompress_ste_backward", [&] {
    const scalar_t* g = grad.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, grad.numel(), 1 << 15, [&](int64_t b, int64_t e) {
      // grad * mask.to(grad.dtype), as the reference backward: clipped elements give g * 0
      if constexpr (std::is_same_v<scalar_t, float>) {
        int64_t i = b;
        for (; i + kW <= e; i += kW) {
          V mv = load_int(reinterpret_cast<const uint8_t*>(m + i), kW);
          (V::loadu(g + i) * mv).store(o + i);
        }
        for (; i < e; ++i) o[i] = g[i] * static_cast<float>(m[i]);
      } else {
        for (int64_t i = b; i < e; ++i) o[i] = static_cast<scalar_t>(g[i] * static_cast<scalar_t>(m[i] ? 1 : 0));
      }
    });
  });
  return out;
}

at::Tensor pack_int32_cpu(const at::Tensor& q_, int64_t bits) {
  TORCH_CHECK(bits == 1 || bits == 2 || bits == 4 || bits == 8, "qcompress.pack_int32: bits must be 1, 2, 4 or 8, got ", bits);
  TORCH_CHECK(q_.dim() >= 1, "qcompress.pack_int32: needs at least one dimension");
  TORCH_CHECK(!q_.is_floating_point() && q_.scalar_type() != at::kBool, "qcompress.pack_int32: codes must be integers");
  at::Tensor q = q_.contiguous();
  const int64_t per = 32 / bits, k = q.size(-1);
  const int64_t rows = k ? q.numel() / k : 0;
  const int64_t words = (k + per - 1) / per;
  std::vector<int64_t> shape(q.sizes().begin(), q.sizes().end());
  shape.back() = words;
  at::Tensor out = at::empty(shape, q.options().dtype(at::kInt));
  if (rows == 0 || words == 0) return out;
  const uint32_t off = 1u << (bits - 1), msk = (bits == 32) ? 0xFFFFFFFFu : ((1u << bits) - 1);
  AT_DISPATCH_INTEGRAL_TYPES(q.scalar_type(), "qcompress_pack_int32", [&] {
    const scalar_t* qp = q.data_ptr<scalar_t>();
    int32_t* op = out.data_ptr<int32_t>();
    at::parallel_for(0, rows * words, 4096, [&](int64_t b, int64_t e) {
      for (int64_t w = b; w < e; ++w) {
        const int64_t r = w / words, c0 = (w % words) * per;
        const int64_t n = std::min(per, k - c0);
        const scalar_t* src = qp + r * k + c0;
        uint32_t word = 0;
        for (int64_t j = 0; j < n; ++j) {
          const uint32_t u = (static_cast<uint32_t>(static_cast<int64_t>(src[j])) + off) & msk;
          word |= u << (j * bits);
        }
        op[w] = static_cast<int32_t>(word);
      }
    });
  });
  return out;
}

at::Tensor unpack_int32_cpu(const at::Tensor& packed_, int64_t bits, int64_t length) {
  TORCH_CHECK(bits == 1 || bits == 2 || bits == 4 || bits == 8, "qcompress.unpack_int32: bits must be 1, 2, 4 or 8, got ", bits);
  TORCH_CHECK(packed_.scalar_type() == at::kInt && packed_.dim() >= 1, "qcompress.unpack_int32: expected int32 words");
  at::Tensor p = packed_.contiguous();
  const int64_t per = 32 / bits, words = p.size(-1);
  TORCH_CHECK(length >= 0 && length <= words * per, "qcompress.unpack_int32: length ", length,
              " does not fit in ", words, " words of ", per, " values");
  const int64_t rows = words ? p.numel() / words : 0;
  std::vector<int64_t> shape(p.sizes().begin(), p.sizes().end());
  shape.back() = length;
  at::Tensor out = at::empty(shape, p.options().dtype(at::kChar));
  if (rows == 0 || length == 0) return out;
  const int32_t off = 1 << (bits - 1);
  const uint32_t msk = (1u << bits) - 1;
  const int32_t* pp = p.data_ptr<int32_t>();
  int8_t* op = out.data_ptr<int8_t>();
  at::parallel_for(0, rows, std::max<int64_t>(1, 32768 / std::max<int64_t>(1, length)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t i = 0; i < length; ++i) {
        const uint32_t w = static_cast<uint32_t>(pp[r * words + i / per]);
        const int32_t u = static_cast<int32_t>((w >> ((i % per) * bits)) & msk);
        op[r * length + i] = static_cast<int8_t>(u - off);
      }
    }
  });
  return out;
}

namespace {

struct Bytes {  // reverse the 8 bits of a byte: lane 0 goes to the most significant bit
  uint8_t rev[256];
  Bytes() {
    for (int b = 0; b < 256; ++b) {
      int r = 0;
      for (int j = 0; j < 8; ++j) r |= ((b >> j) & 1) << (7 - j);
      rev[b] = static_cast<uint8_t>(r);
    }
  }
};
const Bytes& bytes() {
  static const Bytes t;
  return t;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> onebit_compress_cpu(const at::Tensor& x_, const at::Tensor& err_) {
  TORCH_CHECK(x_.numel() == err_.numel(), "qcompress.onebit_compress: x has ", x_.numel(),
              " elements but error has ", err_.numel());
  TORCH_CHECK(x_.numel() % 8 == 0, "qcompress.onebit_compress: needs a multiple of 8 elements, got ", x_.numel());
  TORCH_CHECK(err_.scalar_type() == at::kFloat, "qcompress.onebit_compress: error must be float32");
  at::Tensor x = x_.contiguous().reshape(-1), err = err_.contiguous().reshape(-1);
  const int64_t n = x.numel();
  at::Tensor packed = at::empty({n / 8}, x.options().dtype(at::kByte));
  at::Tensor scale_t = at::empty({}, x.options().dtype(at::kFloat));
  at::Tensor new_err = at::empty({n}, x.options().dtype(at::kFloat));
  const float* e = err.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "qcompress_onebit_compress", [&] {
    if constexpr (std::is_same_v<scalar_t, double>) {
      TORCH_CHECK(false, "qcompress.onebit_compress: float64 input is converted by the Python wrapper");
    } else {
      const scalar_t* xp = x.data_ptr<scalar_t>();
      // pass 1: float64 sum of squares of y = x + error over fixed chunks, combined in order
      constexpr int64_t kChunk = 1 << 16;
      const int64_t nch = (n + kChunk - 1) / kChunk;
      std::vector<double> part(nch, 0.0);
      at::parallel_for(0, nch, 1, [&](int64_t c0, int64_t c1) {
        for (int64_t c = c0; c < c1; ++c) {
          const int64_t b = c * kChunk, end = std::min(n, b + kChunk);
          double acc[kW] = {0, 0, 0, 0, 0, 0, 0, 0};
          for (int64_t i = b; i < end; i += kW) {  // n is a multiple of 8
            float y[kW];
            (load_f(xp + i, kW) + V::loadu(e + i)).store(y);
            for (int j = 0; j < kW; ++j) acc[j] += static_cast<double>(y[j]) * static_cast<double>(y[j]);
          }
          double s = 0.0;
          for (int j = 0; j < kW; ++j) s += acc[j];
          part[c] = s;
        }
      });
      double total = 0.0;
      for (double v : part) total += v;
      const float scale = onebit_scale(total, n);
      *scale_t.data_ptr<float>() = scale;
      // pass 2: sign bits (MSB first) and the new error
      uint8_t* pk = packed.data_ptr<uint8_t>();
      float* ne = new_err.data_ptr<float>();
      const V sv(scale), nsv(-scale), zero(0.0f);
      at::parallel_for(0, n / 8, 4096, [&](int64_t b, int64_t end) {
        for (int64_t k = b; k < end; ++k) {
          const V y = load_f(xp + 8 * k, kW) + V::loadu(e + 8 * k);
          const V pos = y >= zero;
          pk[k] = bytes().rev[mask_bits(pos) & 0xFF];
          (y - V::blendv(nsv, sv, pos)).store(ne + 8 * k);
        }
      });
    }
  });
  return {packed, scale_t, new_err};
}

at::Tensor onebit_decode_average_cpu(const at::Tensor& packed_, const at::Tensor& scales_) {
  TORCH_CHECK(packed_.scalar_type() == at::kByte && packed_.dim() == 2,
              "qcompress.onebit_decode_average: packed must be uint8 [P, m]");
  TORCH_CHECK(scales_.scalar_type() == at::kFloat && scales_.numel() == packed_.size(0),
              "qcompress.onebit_decode_average: expected ", packed_.size(0), " float32 scales");
  at::Tensor packed = packed_.contiguous(), scales = scales_.contiguous();
  const int64_t P = packed.size(0), m = packed.size(1);
  at::Tensor out = at::empty({8 * m}, packed.options().dtype(at::kFloat));
  std::vector<float> w(P);
  for (int64_t j = 0; j < P; ++j) w[j] = scales.data_ptr<float>()[j] / static_cast<float>(P);
  const uint8_t* pk = packed.data_ptr<uint8_t>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, m, 2048, [&](int64_t b, int64_t e) {
    for (int64_t k = b; k < e; ++k) {
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int64_t j = 0; j < P; ++j) {  // chunk order j = 0 .. P-1, as the reference
        const uint8_t byte = pk[j * m + k];
        for (int t = 0; t < 8; ++t) acc[t] = acc[t] + (((byte >> (7 - t)) & 1) ? w[j] : -w[j]);
      }
      for (int t = 0; t < 8; ++t) o[8 * k + t] = acc[t];
    }
  });
  return out;
}

}  // namespace qc
