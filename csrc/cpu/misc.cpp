// CPU dequantize, straight-through backward, int32 packing and the 1-bit compressor; plus the
// argument checks shared with the CUDA glue.
#include <ATen/ATen.h>

#include "qcompress/check.h"
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "block_cache.h"
#include "kernels.h"
#include "vec.h"

namespace qc {

QuantConfig make_config(const at::Tensor& x, const std::optional<at::Tensor>& range, int64_t rows,
                        int64_t cols, int64_t group, int64_t bits, int64_t kind, bool symmetric,
                        bool deepspeed, int64_t rounding, int64_t seed) {
  QC_CHECK(rows >= 0 && cols >= 0 && rows * cols == x.numel(), "qcompress: layout rows=", rows,
              " x cols=", cols, " does not match the tensor's ", x.numel(), " elements");
  QC_CHECK(group >= 0, "qcompress: group must be >= 0, got ", group);
  QC_CHECK(group > 0 || x.numel() == 0, "qcompress: group 0 (zero-width view) needs an empty tensor");
  QC_CHECK(bits >= 1 && bits <= 16, "qcompress: bits must be in 1..16, got ", bits);
  QC_CHECK(kind >= kInt && kind <= kTernary, "qcompress: kind must be 0 (int), 1 (binary) or 2 (ternary), got ", kind);
  QC_CHECK(kind == kInt || symmetric, "qcompress: binary/ternary quantization is symmetric only");
  QC_CHECK(rounding == kNearest || rounding == kStochastic, "qcompress: rounding must be 0 or 1, got ", rounding);
  QC_CHECK(x.is_floating_point(), "qcompress: expected a floating point tensor, got ", x.scalar_type());
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
    QC_CHECK(r.scalar_type() == at::kFloat && r.numel() == 2,
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
  QC_CHECK(rows >= 0 && cols >= 0 && rows * cols == q.numel(), "qcompress.dequantize: layout rows=", rows,
              " x cols=", cols, " does not match the ", q.numel(), " codes");
  QC_CHECK(group > 0 || q.numel() == 0, "qcompress.dequantize: group must be >= 1");
  QC_CHECK(!q.is_floating_point() && !q.is_complex() && q.scalar_type() != at::kBool,
              "qcompress.dequantize: codes must be an integer tensor, got ", q.scalar_type());
  const int64_t ngr = group > 0 ? std::max<int64_t>(1, (cols + group - 1) / group) : 1;
  QC_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == rows * ngr,
              "qcompress.dequantize: expected ", rows * ngr, " float32 scales, got ", scale.numel(), " ",
              scale.scalar_type());
  if (zp.has_value()) {
    QC_CHECK(zp->scalar_type() == at::kFloat && zp->numel() == rows * ngr,
                "qcompress.dequantize: expected ", rows * ngr, " float32 zero points, got ", zp->numel());
  }
}

namespace {

// n (1..8) integers from p as float32 lanes (exact for |q| < 2^24); lanes past n are 0.
template <typename Q>
inline V load_int(const Q* p, int n) {
#if defined(CPU_CAPABILITY_AVX2)
  if (n == kW) {
    if constexpr (sizeof(Q) == 1) {
      const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
      return _mm256_cvtepi32_ps(std::is_signed_v<Q> ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b));
    } else if constexpr (sizeof(Q) == 4 && std::is_signed_v<Q>) {
      return _mm256_cvtepi32_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    }
  }
#endif
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
  QC_CHECK(dtype == at::kFloat || dtype == at::kDouble || dtype == at::kBFloat16 || dtype == at::kHalf,
              "qcompress.dequantize: output dtype must be a float type, got ", dtype);
  at::Tensor q = q_.contiguous(), scale = scale_.contiguous();
  at::Tensor zp = zp_.has_value() ? zp_->contiguous() : at::Tensor();
  at::Tensor out = empty_reused(q.sizes(), q.options().dtype(dtype));
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
  QC_CHECK(mask_.scalar_type() == at::kBool, "qcompress.ste_backward: mask must be bool");
  QC_CHECK(grad_.sizes() == mask_.sizes(), "qcompress.ste_backward: grad ", grad_.sizes(),
              " and mask ", mask_.sizes(), " differ in shape");
  at::Tensor grad = grad_.contiguous(), mask = mask_.contiguous();
  at::Tensor out = empty_reused(grad.sizes(), grad.options());
  const bool* m = mask.data_ptr<bool>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, grad.scalar_type(), "qcompress_ste_backward", [&] {
    const scalar_t* g = grad.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, grad.numel(), 1 << 15, [&](int64_t b, int64_t e) {
      // grad * mask.to(grad.dtype), as the reference backward: clipped elements give g * 0
      // (bf16 / fp16: g * 1 and g * 0 are exact in float32, so one rounding back gives the same bits)
      if constexpr (std::is_same_v<scalar_t, double>) {
        for (int64_t i = b; i < e; ++i) o[i] = g[i] * static_cast<double>(m[i]);
      } else {
        const uint8_t* mb = reinterpret_cast<const uint8_t*>(m);
        for (int64_t i = b; i < e; i += kW) {
          const int n = static_cast<int>(std::min<int64_t>(kW, e - i));
          store_f(o + i, load_f(g + i, n) * load_int(mb + i, n), n);
        }
      }
    });
  });
  return out;
}

at::Tensor pack_int32_cpu(const at::Tensor& q_, int64_t bits) {
  QC_CHECK(bits == 1 || bits == 2 || bits == 4 || bits == 8, "qcompress.pack_int32: bits must be 1, 2, 4 or 8, got ", bits);
  QC_CHECK(q_.dim() >= 1, "qcompress.pack_int32: needs at least one dimension");
  QC_CHECK(!q_.is_floating_point() && q_.scalar_type() != at::kBool, "qcompress.pack_int32: codes must be integers");
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
  QC_CHECK(bits == 1 || bits == 2 || bits == 4 || bits == 8, "qcompress.unpack_int32: bits must be 1, 2, 4 or 8, got ", bits);
  QC_CHECK(packed_.scalar_type() == at::kInt && packed_.dim() >= 1, "qcompress.unpack_int32: expected int32 words");
  at::Tensor p = packed_.contiguous();
  const int64_t per = 32 / bits, words = p.size(-1);
  QC_CHECK(length >= 0 && length <= words * per, "qcompress.unpack_int32: length ", length,
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

// ---- the 1-bit compressor -------------------------------------------------------------------
// Bit-for-bit with qcompress.quant.onebit: y = x + error in float32; the sum of squares in float64
// over fixed 64K-element chunks (each chunk in a fixed lane order, chunks combined in index order,
// so the scale does not depend on the thread count); sign bits MSB first; decode accumulates
// 0 + sign_0 w_0 + sign_1 w_1 + ... in float32, chunk order j = 0 .. P-1, for every element.

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

constexpr int64_t kSqChunk = 1 << 16;  // elements per partial sum of squares (a multiple of 16)

#if defined(CPU_CAPABILITY_AVX2)
// Lane t of the result holds bit (7 - t) of `byte` in its sign bit (MSB-first unpacking).
inline __m256 sign_lanes(uint32_t byte) {
  const __m256i sh = _mm256_setr_epi32(24, 25, 26, 27, 28, 29, 30, 31);
  return _mm256_castsi256_ps(_mm256_sllv_epi32(_mm256_set1_epi32(static_cast<int>(byte)), sh));
}
inline __m256d sq_lo(__m256 y) {
  const __m256d d = _mm256_cvtps_pd(_mm256_castps256_ps128(y));
  return _mm256_mul_pd(d, d);
}
inline __m256d sq_hi(__m256 y) {
  const __m256d d = _mm256_cvtps_pd(_mm256_extractf128_ps(y, 1));
  return _mm256_mul_pd(d, d);
}
#endif

// One read of y = x + e over [b, end) (end - b a multiple of 8): its sign bytes into pk (MSB
// first) and the float64 sum of squares in a fixed lane order (returned).
template <typename T>
double signs_sumsq_chunk(const T* xp, const float* e, uint8_t* pk, int64_t b, int64_t end) {
  const uint8_t* rev = bytes().rev;
#if defined(CPU_CAPABILITY_AVX2)
  const __m256 zero = _mm256_setzero_ps();
  __m256d a0 = _mm256_setzero_pd(), a1 = a0, a2 = a0, a3 = a0;
  int64_t i = b;
  for (; i + 16 <= end; i += 16) {
    const __m256 y0 = load_f(xp + i, kW) + V::loadu(e + i);
    const __m256 y1 = load_f(xp + i + 8, kW) + V::loadu(e + i + 8);
    pk[i / 8] = rev[_mm256_movemask_ps(_mm256_cmp_ps(y0, zero, _CMP_GE_OQ))];
    pk[i / 8 + 1] = rev[_mm256_movemask_ps(_mm256_cmp_ps(y1, zero, _CMP_GE_OQ))];
    a0 = _mm256_add_pd(a0, sq_lo(y0));
    a1 = _mm256_add_pd(a1, sq_hi(y0));
    a2 = _mm256_add_pd(a2, sq_lo(y1));
    a3 = _mm256_add_pd(a3, sq_hi(y1));
  }
  if (i < end) {
    const __m256 y0 = load_f(xp + i, kW) + V::loadu(e + i);
    pk[i / 8] = rev[_mm256_movemask_ps(_mm256_cmp_ps(y0, zero, _CMP_GE_OQ))];
    a0 = _mm256_add_pd(a0, sq_lo(y0));
    a1 = _mm256_add_pd(a1, sq_hi(y0));
  }
  const __m256d s = _mm256_add_pd(_mm256_add_pd(a0, a1), _mm256_add_pd(a2, a3));
  double l[4];
  _mm256_storeu_pd(l, s);
  return (l[0] + l[1]) + (l[2] + l[3]);
#else
  double acc[kW] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int64_t i = b; i < end; i += kW) {
    float y[kW];
    const V yv = load_f(xp + i, kW) + V::loadu(e + i);
    pk[i / 8] = rev[mask_bits(yv >= V(0.0f)) & 0xFF];
    yv.store(y);
    for (int j = 0; j < kW; ++j) acc[j] += static_cast<double>(y[j]) * static_cast<double>(y[j]);
  }
  double s = 0.0;
  for (int j = 0; j < kW; ++j) s += acc[j];
  return s;
#endif
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> onebit_compress_cpu(const at::Tensor& x_, const at::Tensor& err_) {
  QC_CHECK(x_.numel() == err_.numel(), "qcompress.onebit_compress: x has ", x_.numel(),
              " elements but error has ", err_.numel());
  QC_CHECK(x_.numel() % 8 == 0, "qcompress.onebit_compress: needs a multiple of 8 elements, got ", x_.numel());
  QC_CHECK(err_.scalar_type() == at::kFloat, "qcompress.onebit_compress: error must be float32");
  at::Tensor x = x_.contiguous().reshape(-1), err = err_.contiguous().reshape(-1);
  const int64_t n = x.numel();
  at::Tensor packed = at::empty({n / 8}, x.options().dtype(at::kByte));
  at::Tensor scale_t = at::empty({}, x.options().dtype(at::kFloat));
  at::Tensor new_err = empty_reused({n}, x.options().dtype(at::kFloat));
  const float* e = err.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "qcompress_onebit_compress", [&] {
    if constexpr (std::is_same_v<scalar_t, double>) {
      QC_CHECK(false, "qcompress.onebit_compress: float64 input is converted by the Python wrapper");
    } else {
      const scalar_t* xp = x.data_ptr<scalar_t>();
      uint8_t* pk = packed.data_ptr<uint8_t>();
      // pass 1: partial float64 sums of squares per fixed chunk, and the sign bits (they do not
      // need the scale), while x and e stream through once
      const int64_t nch = (n + kSqChunk - 1) / kSqChunk;
      std::vector<double> part(nch, 0.0);
      at::parallel_for(0, nch, 1, [&](int64_t c0, int64_t c1) {
        for (int64_t c = c0; c < c1; ++c) {
          const int64_t b = c * kSqChunk, end = std::min(n, b + kSqChunk);
          part[c] = signs_sumsq_chunk(xp, e, pk, b, end);
        }
      });
      double total = 0.0;
      for (double v : part) total += v;  // chunk order: independent of the thread count
      const float scale = onebit_scale(total, n);
      *scale_t.data_ptr<float>() = scale;
      // pass 2: new error = y - scale * sign, i.e. y - s or y - (-s)
      float* ne = new_err.data_ptr<float>();
      const V sv(scale), nsv(-scale), zero(0.0f);
      // The new error is read only at the next call: for large buffers, stream it past the caches
      // (no read-for-ownership of the 4n output bytes). Outputs are at least 32-byte aligned.
      const bool stream = n >= (int64_t{1} << 20) && reinterpret_cast<uintptr_t>(ne) % 32 == 0;
      at::parallel_for(0, n / 8, 4096, [&](int64_t b, int64_t end) {
#if defined(CPU_CAPABILITY_AVX2)
        if (stream) {
          for (int64_t k = b; k < end; ++k) {
            const V y = load_f(xp + 8 * k, kW) + V::loadu(e + 8 * k);
            _mm256_stream_ps(ne + 8 * k, y - V::blendv(nsv, sv, y >= zero));
          }
          _mm_sfence();
          return;
        }
#endif
        for (int64_t k = b; k < end; ++k) {
          const V y = load_f(xp + 8 * k, kW) + V::loadu(e + 8 * k);
          (y - V::blendv(nsv, sv, y >= zero)).store(ne + 8 * k);
        }
      });
    }
  });
  return {packed, scale_t, new_err};
}

namespace {

// out[r * ostride + 8 k + t] for bytes k in [k0, k1): average (P > 0 rows summed with weights w)
// or, with `rows_out`, each row decoded alone as sign * w_r.
void onebit_decode_range(const uint8_t* pk, int64_t pstride, const float* w, int64_t P, float* o,
                         int64_t k0, int64_t k1, bool rows_out, int64_t ostride) {
#if defined(CPU_CAPABILITY_AVX2)
  if (rows_out) {
    for (int64_t r = 0; r < P; ++r) {
      const __m256 pos = _mm256_set1_ps(w[r]), neg = _mm256_set1_ps(-w[r]);
      const uint8_t* row = pk + r * pstride;
      float* orow = o + r * ostride;
      for (int64_t k = k0; k < k1; ++k) _mm256_storeu_ps(orow + 8 * k, _mm256_blendv_ps(neg, pos, sign_lanes(row[k])));
    }
    return;
  }
  // blocks of 4 bytes (32 values) held in registers across the P rows
  constexpr int64_t kMaxP = 64;
  __m256 pos[kMaxP], neg[kMaxP];
  const int64_t pc = std::min(P, kMaxP);
  for (int64_t j = 0; j < pc; ++j) { pos[j] = _mm256_set1_ps(w[j]); neg[j] = _mm256_set1_ps(-w[j]); }
  auto wpos = [&](int64_t j) { return j < kMaxP ? pos[j] : _mm256_set1_ps(w[j]); };
  auto wneg = [&](int64_t j) { return j < kMaxP ? neg[j] : _mm256_set1_ps(-w[j]); };
  int64_t k = k0;
  for (; k + 4 <= k1; k += 4) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t j = 0; j < P; ++j) {
      const uint8_t* row = pk + j * pstride + k;
      const __m256 p = wpos(j), q = wneg(j);
      a0 = _mm256_add_ps(a0, _mm256_blendv_ps(q, p, sign_lanes(row[0])));
      a1 = _mm256_add_ps(a1, _mm256_blendv_ps(q, p, sign_lanes(row[1])));
      a2 = _mm256_add_ps(a2, _mm256_blendv_ps(q, p, sign_lanes(row[2])));
      a3 = _mm256_add_ps(a3, _mm256_blendv_ps(q, p, sign_lanes(row[3])));
    }
    _mm256_storeu_ps(o + 8 * k, a0);
    _mm256_storeu_ps(o + 8 * k + 8, a1);
    _mm256_storeu_ps(o + 8 * k + 16, a2);
    _mm256_storeu_ps(o + 8 * k + 24, a3);
  }
  for (; k < k1; ++k) {
    __m256 a = _mm256_setzero_ps();
    for (int64_t j = 0; j < P; ++j) a = _mm256_add_ps(a, _mm256_blendv_ps(wneg(j), wpos(j), sign_lanes(pk[j * pstride + k])));
    _mm256_storeu_ps(o + 8 * k, a);
  }
#else
  for (int64_t k = k0; k < k1; ++k) {
    if (rows_out) {
      for (int64_t r = 0; r < P; ++r) {
        const uint8_t byte = pk[r * pstride + k];
        for (int t = 0; t < 8; ++t) o[r * ostride + 8 * k + t] = ((byte >> (7 - t)) & 1) ? w[r] : -w[r];
      }
      continue;
    }
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int64_t j = 0; j < P; ++j) {  // chunk order j = 0 .. P-1, as the reference
      const uint8_t byte = pk[j * pstride + k];
      for (int t = 0; t < 8; ++t) acc[t] = acc[t] + (((byte >> (7 - t)) & 1) ? w[j] : -w[j]);
    }
    for (int t = 0; t < 8; ++t) o[8 * k + t] = acc[t];
  }
#endif
}

// packed: uint8 [P, >= m] rows with unit inner stride (a view of payload rows is fine: no copy).
at::Tensor onebit_decode_impl(const at::Tensor& packed_, const at::Tensor& scales_, int64_t m, bool average,
                              const char* name) {
  QC_CHECK(packed_.scalar_type() == at::kByte && packed_.dim() == 2, name, ": packed must be uint8 [P, m]");
  QC_CHECK(scales_.scalar_type() == at::kFloat && scales_.numel() == packed_.size(0), name, ": expected ",
              packed_.size(0), " float32 scales");
  at::Tensor packed = packed_.stride(1) == 1 || packed_.size(1) <= 1 ? packed_ : packed_.contiguous();
  at::Tensor scales = scales_.contiguous();
  const int64_t P = packed.size(0);
  at::Tensor out = empty_reused(average ? at::IntArrayRef{8 * m} : at::IntArrayRef{P, 8 * m}, packed.options().dtype(at::kFloat));
  if (m == 0 || P == 0) {
    if (average && m > 0) out.zero_();
    return out;
  }
  std::vector<float> w(P);
  const float* sp = scales.data_ptr<float>();
  for (int64_t j = 0; j < P; ++j) w[j] = average ? sp[j] / static_cast<float>(P) : sp[j];
  const uint8_t* pk = packed.data_ptr<uint8_t>();
  const int64_t pstride = P > 1 ? packed.stride(0) : m;
  float* o = out.data_ptr<float>();
  at::parallel_for(0, m, 8192, [&](int64_t b, int64_t e) {
    onebit_decode_range(pk, pstride, w.data(), P, o, b, e, !average, 8 * m);
  });
  return out;
}

}  // namespace

at::Tensor onebit_decode_average_cpu(const at::Tensor& packed, const at::Tensor& scales) {
  return onebit_decode_impl(packed, scales, packed.dim() == 2 ? packed.size(1) : 0, true,
                            "qcompress.onebit_decode_average");
}

at::Tensor onebit_decode_cpu(const at::Tensor& packed, const at::Tensor& scales) {
  return onebit_decode_impl(packed, scales, packed.dim() == 2 ? packed.size(1) : 0, false,
                            "qcompress.onebit_decode");
}

}  // namespace qc
