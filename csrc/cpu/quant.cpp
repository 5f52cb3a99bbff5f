// CPU fake-quantize and quantize: per-group statistics (min/max or mean|x|) fused with the
// elementwise pass. Many small groups: one task per run of groups, the group stays in cache
// between its two passes. Few large groups (per tensor): a chunked parallel reduction, then a
// parallel elementwise pass.
#include <ATen/ATen.h>

#include "qcompress/check.h"
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <limits>
#include <type_traits>
#include <vector>

#include "block_cache.h"
#include "kernels.h"
#include "vec.h"

#include <ATen/cpu/vec/functional.h>

namespace qc {
namespace {

struct Stats {
  float lo = std::numeric_limits<float>::infinity();
  float hi = -std::numeric_limits<float>::infinity();
  double sum = 0.0;       // sum |x| (binary / ternary)
  double kept_sum = 0.0;  // ternary: sum |x| over |x| > thr
  int64_t kept = 0;
};

template <typename T>
void range_stats(const T* x, int64_t n, Stats& st) {
  V lo(st.lo), hi(st.hi);
  int64_t i = 0;
#if defined(CPU_CAPABILITY_AVX2)
  // Plain min/max (same operand order as at::vec::minimum/maximum, so signed zeros come out the
  // same) plus one NaN flag: 3 ops per vector instead of 6. A NaN group reports NaN bounds.
  __m256 nan = _mm256_setzero_ps();
  for (; i + kW <= n; i += kW) {
    const __m256 v = load_f(x + i, kW);
    lo = _mm256_min_ps(lo, v);
    hi = _mm256_max_ps(hi, v);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
  lo = _mm256_or_ps(lo, nan);  // all-ones lanes are NaN
  hi = _mm256_or_ps(hi, nan);
#else
  for (; i + kW <= n; i += kW) {
    V v = load_f(x + i, kW);
    lo = at::vec::minimum(lo, v);
    hi = at::vec::maximum(hi, v);
  }
#endif
  // lane reductions (NaN propagating, order independent)
  float a = at::vec::vec_reduce_all<float>([](V p, V q) { return at::vec::minimum(p, q); }, lo);
  float b = at::vec::vec_reduce_all<float>([](V p, V q) { return at::vec::maximum(p, q); }, hi);
  for (; i < n; ++i) {
    float v = static_cast<float>(x[i]);
    a = nan_min(a, v);
    b = nan_max(b, v);
  }
  st.lo = a;
  st.hi = b;
}

template <typename T>
void abs_sum(const T* x, int64_t n, Stats& st) {
  double acc[kW] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + kW <= n; i += kW) {
    float a[kW];
    load_f(x + i, kW).abs().store(a);
    for (int j = 0; j < kW; ++j) acc[j] += static_cast<double>(a[j]);
  }
  double s = st.sum;
  for (int j = 0; j < kW; ++j) s += acc[j];
  for (; i < n; ++i) s += static_cast<double>(fabs_(static_cast<float>(x[i])));
  st.sum = s;
}

template <typename T>
void kept_sum(const T* x, int64_t n, float thr, Stats& st) {
  double acc[kW] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t cnt[kW] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + kW <= n; i += kW) {
    float a[kW];
    load_f(x + i, kW).abs().store(a);
    for (int j = 0; j < kW; ++j) {
      const bool k = a[j] > thr;
      acc[j] += k ? static_cast<double>(a[j]) : 0.0;
      cnt[j] += k;
    }
  }
  double s = st.kept_sum;
  int64_t c = st.kept;
  for (int j = 0; j < kW; ++j) { s += acc[j]; c += cnt[j]; }
  for (; i < n; ++i) {
    float a = fabs_(static_cast<float>(x[i]));
    if (a > thr) { s += static_cast<double>(a); ++c; }
  }
  st.kept_sum = s;
  st.kept = c;
}

void merge(Stats& a, const Stats& b) {
  a.lo = nan_min(a.lo, b.lo);
  a.hi = nan_max(a.hi, b.hi);
  a.sum += b.sum;
  a.kept_sum += b.kept_sum;
  a.kept += b.kept;
}

// Scale, zero point and threshold of one group from its statistics; false if non-finite.
bool finalize_int(Stats st, int64_t count, const QuantConfig& c, Params& p) {
  float lo = st.lo, hi = st.hi;
  (void)count;  // the range covers the group's real elements only (no zero padding)
  if (c.has_range) {
    lo = c.range_lo;
    hi = c.range_hi;
  }
  p = int_params(lo, hi, c.bits, c.symmetric, c.deepspeed, c.qmin, c.qmax);
  return is_finite(lo) && is_finite(hi);
}

template <typename T, typename Q, int KIND, bool STOCH, bool DS, bool ASYM_DS, bool ADD_ZP>
void quant_segment(const T* x, int64_t len, int64_t flat0, const Params& p, const QuantConfig& c,
                   const Outputs<T, Q>& o) {
  const V s(p.scale), z(p.z), zp(p.zp), thr(p.thr), qmin(c.qmin), qmax(c.qmax);
  Noise noise(c.seed);
  if constexpr (KIND == kInt) {
    // Full vectors, no per-lane checks: the fake-quant forward (values, maybe the mask) and the
    // codes of quantize (maybe with values); the tail takes the general loop below.
    T* y = o.y ? o.y + flat0 : nullptr;
    Q* q = o.q ? o.q + flat0 : nullptr;
    bool* mask = o.mask ? o.mask + flat0 : nullptr;
    int64_t i = 0;
    auto body = [&](auto with_mask, auto with_y, auto with_q) {
      for (; i + kW <= len; i += kW) {
        const V u = STOCH ? noise.get(flat0 + i, kW) : V(0.0f);
        const V r = int_code<V, STOCH, DS, ASYM_DS, ADD_ZP>(load_f(x + i, kW), s, z, zp, u);
        if constexpr (decltype(with_mask)::value) store_mask(mask + i, inside_range(r, qmin, qmax), kW);
        const V qv = clamp_code(r, qmin, qmax);
        if constexpr (decltype(with_y)::value) store_sat(y + i, dequant_code<V, ASYM_DS, ADD_ZP>(qv, s, z, zp), kW);
        if constexpr (decltype(with_q)::value) store_int(q + i, qv, kW);
      }
    };
    using yes = std::true_type;
    using no = std::false_type;
    if (q == nullptr && y != nullptr) {
      if (mask) body(yes{}, yes{}, no{}); else body(no{}, yes{}, no{});
    } else if (q != nullptr && mask == nullptr) {
      if (y) body(no{}, yes{}, yes{}); else body(no{}, no{}, yes{});
    }
    if (i == len) return;
    x += i, len -= i, flat0 += i;
  }
  for (int64_t i = 0; i < len; i += kW) {
    const int n = static_cast<int>(std::min<int64_t>(kW, len - i));
    const V xv = load_f(x + i, n);
    V qv;
    if constexpr (KIND == kInt) {
      const V u = STOCH ? noise.get(flat0 + i, n) : V(0.0f);
      const V r = int_code<V, STOCH, DS, ASYM_DS, ADD_ZP>(xv, s, z, zp, u);
      qv = clamp_code(r, qmin, qmax);
      if (o.mask) store_mask(o.mask + flat0 + i, inside_range(r, qmin, qmax), n);
      if (o.y) store_sat(o.y + flat0 + i, dequant_code<V, ASYM_DS, ADD_ZP>(qv, s, z, zp), n);
    } else {
      if constexpr (KIND == kBinary) qv = binary_code<V, DS>(xv);
      else qv = ternary_code<V>(xv, thr);
      if (o.mask) std::memset(o.mask + flat0 + i, 1, static_cast<size_t>(n));
      if (o.y) store_f(o.y + flat0 + i, qv * s, n);
    }
    if (o.q) store_int(o.q + flat0 + i, qv, n);
  }
}

// Groups per block in the many-small-groups path: statistics of the block first, then its
// elementwise pass while the block is still in L1/L2.
constexpr int64_t kBlock = 64;

template <typename T, typename Q, int KIND, bool STOCH, bool DS, bool ASYM_DS, bool ADD_ZP>
int64_t run(const T* x, const QuantConfig& c, const Outputs<T, Q>& o) {
  const int64_t ngr = c.groups_per_row();
  const int64_t G = c.rows * ngr;
  const int64_t n = c.rows * c.cols;
  std::atomic<int64_t> bad{0};

  auto start_of = [&](int64_t g) { return (g / ngr) * c.cols + (g % ngr) * c.group; };
  auto count_of = [&](int64_t g) {
    return std::max<int64_t>(0, std::min<int64_t>(c.group, c.cols - (g % ngr) * c.group));
  };
  // Group statistics -> params; false when the group holds NaN/Inf.
  auto params_of = [&](const T* gx, int64_t count, Stats st, Params& p, bool have_stats) {
    if constexpr (KIND == kInt) {
      if (!have_stats && !c.has_range) range_stats(gx, count, st);
      return finalize_int(st, count, c, p);
    } else {
      if (!have_stats) abs_sum(gx, count, st);
      const float mean = mean_from_sum(st.sum, count);
      p = Params{clamp_min(mean, kEps), 0.0f, 0.0f, 0.0f};
      if constexpr (KIND == kTernary) {
        p.thr = ternary_threshold(mean);
        if (!is_finite(p.thr)) return false;
        if (!have_stats) kept_sum(gx, count, p.thr, st);
        p.scale = clamp_min(mean_from_sum(st.kept_sum, st.kept), kEps);
        return true;
      }
      return is_finite(mean);
    }
  };
  auto emit = [&](int64_t g, const Params& p) {
    if (o.scale) o.scale[g] = p.scale;
    if (o.zp) o.zp[g] = p.zp;
  };

  // Integer params of groups [b, e) (at most kBlock) from their ranges, 8 groups per vector:
  // the per-group scalar division stalled the loop. Same bits as int_params (its float instance).
  auto int_params_block = [&](int64_t b, int64_t e, Params* ps, bool* oks) {
    float lo[kBlock + kW], hi[kBlock + kW];
    const int64_t m = e - b;
    for (int64_t g = b; g < e; ++g) {
      Stats st;
      range_stats(x + start_of(g), count_of(g), st);
      lo[g - b] = st.lo;
      hi[g - b] = st.hi;
    }
    for (int64_t j = m; j < (m + kW - 1) / kW * kW; ++j) lo[j] = hi[j] = 0.0f;
    for (int64_t j = 0; j < m; j += kW) {
      const V l = V::loadu(lo + j), h = V::loadu(hi + j), zero(0.0f);
      const ParamsT<V> p = int_params_t<V>(l, h, c.bits, c.symmetric, c.deepspeed, V(c.qmin), V(c.qmax));
      float sc[kW], zp[kW], z[kW];
      p.scale.store(sc);
      p.zp.store(zp);
      p.z.store(z);
      const uint32_t finite = mask_bits(((l - l) == zero) & ((h - h) == zero));  // is_finite(lo, hi)
      for (int64_t k = 0; k < kW && j + k < m; ++k) {
        ps[j + k] = Params{sc[k], zp[k], z[k], 0.0f};
        oks[j + k] = (finite >> k) & 1u;
      }
    }
  };

  const int nthreads = at::get_num_threads();
  if (G >= 4 * static_cast<int64_t>(nthreads) || n <= 65536) {
    const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, c.group));
    // Blocks of groups small enough to stay in L1/L2: all statistics first (independent
    // dependency chains overlap), then the elementwise pass over the cached block.
    const int64_t per_block = std::max<int64_t>(1, std::min<int64_t>(kBlock, 8192 / std::max<int64_t>(1, c.group)));
    at::parallel_for(0, G, grain, [&](int64_t g0, int64_t g1) {
      Params ps[kBlock];
      bool oks[kBlock];
      for (int64_t b = g0; b < g1; b += per_block) {
        const int64_t e = std::min(g1, b + per_block);
        if (KIND == kInt && !c.has_range) {
          int_params_block(b, e, ps, oks);
        } else {
          for (int64_t g = b; g < e; ++g) oks[g - b] = params_of(x + start_of(g), count_of(g), Stats{}, ps[g - b], false);
        }
        for (int64_t g = b; g < e; ++g) {
          if (!oks[g - b]) bad.fetch_add(1);
          emit(g, ps[g - b]);
        }
        for (int64_t g = b; g < e; ++g) {
          if (!oks[g - b]) continue;
          const int64_t st0 = start_of(g);
          quant_segment<T, Q, KIND, STOCH, DS, ASYM_DS, ADD_ZP>(x + st0, count_of(g), st0, ps[g - b], c, o);
        }
      }
    });
    return bad.load();
  }

  // Few large groups: chunked reduction with a fixed chunking (deterministic for any thread count).
  constexpr int64_t kChunk = 1 << 16;
  struct Job { int64_t g, begin, end; };
  std::vector<Job> jobs;
  for (int64_t g = 0; g < G; ++g) {
    const int64_t st0 = start_of(g), cnt = count_of(g);
    int64_t b = 0;
    do {
      const int64_t e = std::min(cnt, b + kChunk);
      jobs.push_back({g, st0 + b, st0 + e});
      b = e;
    } while (b < cnt);
  }
  std::vector<Stats> part(jobs.size());
  auto reduce = [&](auto&& fn) {
    at::parallel_for(0, static_cast<int64_t>(jobs.size()), 1, [&](int64_t j0, int64_t j1) {
      for (int64_t j = j0; j < j1; ++j) fn(jobs[j], part[j]);
    });
  };
  std::vector<Stats> gst(G);
  auto combine = [&]() {
    for (int64_t g = 0; g < G; ++g) gst[g] = Stats{};
    for (size_t j = 0; j < jobs.size(); ++j) merge(gst[jobs[j].g], part[j]);
  };
  std::vector<Params> params(G);
  std::vector<char> ok(G, 1);
  if constexpr (KIND == kInt) {
    if (!c.has_range) {
      reduce([&](const Job& jb, Stats& st) { range_stats(x + jb.begin, jb.end - jb.begin, st); });
      combine();
    }
  } else {
    reduce([&](const Job& jb, Stats& st) { abs_sum(x + jb.begin, jb.end - jb.begin, st); });
    combine();
    if constexpr (KIND == kTernary) {
      for (int64_t g = 0; g < G; ++g) params[g].thr = ternary_threshold(mean_from_sum(gst[g].sum, count_of(g)));
      reduce([&](const Job& jb, Stats& st) {
        st = Stats{};
        kept_sum(x + jb.begin, jb.end - jb.begin, params[jb.g].thr, st);
      });
      std::vector<Stats> kst = gst;
      combine();
      for (int64_t g = 0; g < G; ++g) { gst[g].sum = kst[g].sum; }
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    ok[g] = params_of(x + start_of(g), count_of(g), gst[g], params[g], true);
    if (!ok[g]) bad.fetch_add(1);
    emit(g, params[g]);
  }
  if (bad.load()) return bad.load();
  at::parallel_for(0, n, 1 << 15, [&](int64_t b, int64_t e) {
    int64_t i = b;
    while (i < e) {  // split [b, e) into runs that stay inside one group
      const int64_t row = i / c.cols, col = i % c.cols, j = col / c.group;
      const int64_t g = row * ngr + j;
      const int64_t end = std::min(e, row * c.cols + std::min(c.cols, (j + 1) * c.group));
      quant_segment<T, Q, KIND, STOCH, DS, ASYM_DS, ADD_ZP>(x + i, end - i, i, params[g], c, o);
      i = end;
    }
  });
  return 0;
}

template <typename T, typename Q>
int64_t dispatch_mode(const T* x, const QuantConfig& c, const Outputs<T, Q>& o) {
  const bool st = c.rounding == kStochastic;
  if (c.kind == kBinary) {
    return c.deepspeed ? run<T, Q, kBinary, false, true, false, false>(x, c, o)
                       : run<T, Q, kBinary, false, false, false, false>(x, c, o);
  }
  if (c.kind == kTernary) return run<T, Q, kTernary, false, false, false, false>(x, c, o);
  if (c.symmetric) {
    if (c.deepspeed) {
      return st ? run<T, Q, kInt, true, true, false, false>(x, c, o)
                : run<T, Q, kInt, false, true, false, false>(x, c, o);
    }
    return st ? run<T, Q, kInt, true, false, false, false>(x, c, o)
              : run<T, Q, kInt, false, false, false, false>(x, c, o);
  }
  if (c.deepspeed) {
    return st ? run<T, Q, kInt, true, true, true, false>(x, c, o)
              : run<T, Q, kInt, false, true, true, false>(x, c, o);
  }
  return st ? run<T, Q, kInt, true, false, false, true>(x, c, o)
            : run<T, Q, kInt, false, false, false, true>(x, c, o);
}

template <typename T>
const T* data_of(const at::Tensor& t) { return reinterpret_cast<const T*>(t.const_data_ptr()); }
template <typename T>
T* mdata_of(const at::Tensor& t) { return reinterpret_cast<T*>(t.mutable_data_ptr()); }

void raise_bad(int64_t bad, int64_t groups) {
  QC_CHECK(bad == 0, kNonFiniteTag, bad, " of ", groups,
              " quantization groups contain NaN or Inf values; fix the input before quantizing");
}

// Fill scale/zp for the width-0 view (reference: scale EPS, zero point 0, no elements).
void empty_groups(const QuantConfig& c, float* scale, float* zp) {
  const int64_t G = c.rows * c.groups_per_row();
  for (int64_t g = 0; g < G; ++g) {
    if (scale) scale[g] = kEps;
    if (zp) zp[g] = 0.0f;
  }
}

// ---- given (learned or observer-chosen) scales and zero points ------------------------------------

// Per-group scale / zero point tensors must be float32 [groups] on x's device.
void check_group_params(const at::Tensor& x, const at::Tensor& scale, const std::optional<at::Tensor>& zp,
                        const QuantConfig& c, const char* op) {
  const int64_t G = c.group > 0 ? c.rows * c.groups_per_row() : 0;
  QC_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == G && scale.device() == x.device(),
              op, ": expected ", G, " float32 scales on ", x.device(), ", got ", scale.numel(), " ",
              scale.scalar_type(), " on ", scale.device());
  if (zp.has_value()) {
    QC_CHECK(zp->scalar_type() == at::kFloat && zp->numel() == G && zp->device() == x.device(),
                op, ": expected ", G, " float32 zero points on ", x.device(), ", got ", zp->numel(), " ",
                zp->scalar_type());
  }
}

template <typename T, bool STOCH, bool ADD_ZP>
void run_params(const T* x, const float* scale, const float* zp, const QuantConfig& c, const Outputs<T, int8_t>& o) {
  const int64_t ngr = c.groups_per_row();
  const int64_t n = c.rows * c.cols;
  at::parallel_for(0, n, 1 << 14, [&](int64_t b, int64_t e) {
    int64_t i = b;
    while (i < e) {  // runs of [b, e) inside one group
      const int64_t row = i / c.cols, col = i % c.cols, j = col / c.group;
      const int64_t g = row * ngr + j;
      const int64_t end = std::min(e, row * c.cols + std::min(c.cols, (j + 1) * c.group));
      const Params p{scale[g], ADD_ZP ? zp[g] : 0.0f, 0.0f, 0.0f};
      quant_segment<T, int8_t, kInt, STOCH, false, false, ADD_ZP>(x + i, end - i, i, p, c, o);
      i = end;
    }
  });
}

// LSQ gradients of one run of elements of group g (math in reference.lsq_backward).
template <typename T, typename G, bool STOCH, bool ADD_ZP>
void lsq_segment(const T* x, const G* grad, G* grad_x, int64_t begin, int64_t end, float s, float zp,
                 const QuantConfig& c, double& acc_s, double& acc_z) {
  double as = 0.0, az = 0.0;
  const float qmin = c.qmin, qmax = c.qmax;
  Noise noise(c.seed);
  for (int64_t i = begin; i < end; ++i) {
    const float xv = static_cast<float>(x[i]);
    const float gv = static_cast<float>(grad[i]);
    const float v = xv / s;
    float u = 0.0f;
    if (STOCH) u = uniform(noise.key_for(i), static_cast<uint32_t>(i));
    const float r = round_code<float, STOCH, false>(v, u);
    const float rz = ADD_ZP ? r + zp : r;
    const bool below = rz < qmin, above = rz > qmax;
    const bool inside = !(below || above);
    const float ds = inside ? r - v : (below ? qmin - zp : qmax - zp);
    as += static_cast<double>(gv) * static_cast<double>(ds);
    if (!inside) az += static_cast<double>(gv) * static_cast<double>(-s);
    grad_x[i] = static_cast<G>(gv * (inside ? 1.0f : 0.0f));
  }
  acc_s += as;
  acc_z += az;
}

template <typename T, typename G, bool STOCH, bool ADD_ZP>
void run_lsq(const T* x, const G* grad, G* grad_x, const float* scale, const float* zp, const QuantConfig& c,
             float* gs, float* gz) {
  const int64_t ngr = c.groups_per_row();
  const int64_t groups = c.rows * ngr;
  // Fixed chunking (not thread-dependent), partial sums combined in order: deterministic.
  constexpr int64_t kChunk = 1 << 14;
  struct Job { int64_t g, begin, end; };
  std::vector<Job> jobs;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t st0 = (g / ngr) * c.cols + (g % ngr) * c.group;
    const int64_t cnt = std::max<int64_t>(0, std::min<int64_t>(c.group, c.cols - (g % ngr) * c.group));
    for (int64_t b = 0; b < cnt; b += kChunk) jobs.push_back({g, st0 + b, st0 + std::min(cnt, b + kChunk)});
  }
  std::vector<double> ps(jobs.size(), 0.0), pz(jobs.size(), 0.0);
  at::parallel_for(0, static_cast<int64_t>(jobs.size()), 1, [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; ++j) {
      const Job& jb = jobs[j];
      lsq_segment<T, G, STOCH, ADD_ZP>(x, grad, grad_x, jb.begin, jb.end, scale[jb.g], ADD_ZP ? zp[jb.g] : 0.0f,
                                       c, ps[j], pz[j]);
    }
  });
  std::vector<double> ts(groups, 0.0), tz(groups, 0.0);
  for (size_t j = 0; j < jobs.size(); ++j) {
    ts[jobs[j].g] += ps[j];
    tz[jobs[j].g] += pz[j];
  }
  for (int64_t g = 0; g < groups; ++g) {
    gs[g] = static_cast<float>(ts[g]);
    if (gz) gz[g] = static_cast<float>(tz[g]);
  }
}

// ---- the mse observer's search: squared errors of every candidate grid ------------------------------

// d[i] = (clamp(round(x_i / s) + z) - z) s - x_i in float32, the reference's dequantize_view(q) - x.
template <typename T, bool ADD_ZP>
void group_diffs(const T* x, int64_t len, float sk, float zk, float qmin, float qmax, float* d) {
  const V vqmin(qmin), vqmax(qmax), vs(sk), vz(zk);
  int64_t i = 0;
  for (; i + kW <= len; i += kW) {
    const V xv = load_f(x + i, kW);
    V r = (xv / vs).round();
    if (ADD_ZP) r = r + vz;
    const V q = clamp_code(r, vqmin, vqmax);
    const V y = ADD_ZP ? (q - vz) * vs : q * vs;
    (y - xv).store(d + i);
  }
  for (; i < len; ++i) {
    const float xv = static_cast<float>(x[i]);
    float r = rint_(xv / sk);
    if (ADD_ZP) r = r + zk;
    const float q = clamp_code(r, qmin, qmax);
    d[i] = (ADD_ZP ? (q - zk) * sk : q * sk) - xv;
  }
}

// sum d_i^2, each square in double (exact: a float32 squared fits a double), lane-wise then the tail.
double squared_sum(const float* d, int64_t len) {
  double acc[kW] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + kW <= len; i += kW)
    for (int j = 0; j < kW; ++j) acc[j] += static_cast<double>(d[i + j]) * static_cast<double>(d[i + j]);
  double total = 0.0;
  for (int j = 0; j < kW; ++j) total += acc[j];
  for (; i < len; ++i) total += static_cast<double>(d[i]) * static_cast<double>(d[i]);
  return total;
}

// The input-weighted error d^T M d (double) of one group: M its len x len block of E[u u^T] (row
// stride ld), or with diag the diagonal weights w[(col0 + i) % ncols] of a group spanning rows.
struct Weighting {
  const double* block = nullptr;  // [len, ld] block of this group's columns, or null
  int64_t ld = 0;
  const double* diag = nullptr;   // per weight column, or null
  int64_t col0 = 0, ncols = 0;
};

// The search's moments, checked against the layout: [groups per row, group, group] blocks
// (granularity group), or [weight columns, 1, 1] diagonal weights for groups that span whole rows
// (channel / tensor granularity). Absent: the plain error.
struct Moments {
  at::Tensor t;
  bool diagonal = false;
  const double* data() const { return t.defined() ? t.data_ptr<double>() : nullptr; }
  // group g (starting at flat offset st0) of a layout with ngr groups per row
  Weighting of(int64_t g, int64_t st0, int64_t ngr, int64_t group) const {
    Weighting w;
    if (!t.defined()) return w;
    if (diagonal) {
      w.diag = data();
      w.col0 = st0;
      w.ncols = t.size(0);
    } else {
      w.block = data() + (g % ngr) * group * group;
      w.ld = group;
    }
    return w;
  }
};

Moments check_moments(const std::optional<at::Tensor>& m, const at::Tensor& x, const QuantConfig& c,
                      const char* op) {
  Moments out;
  if (!m.has_value()) return out;
  out.t = m->contiguous();
  const at::Tensor& t = out.t;
  QC_CHECK(t.scalar_type() == at::kDouble && t.dim() == 3 && t.device() == x.device() && t.size(1) == t.size(2),
           op, ": moments must be float64 [blocks, b, b] on the input's device");
  out.diagonal = t.size(1) == 1 && c.group >= c.cols;
  const int64_t ngr = c.groups_per_row();
  QC_CHECK(out.diagonal ? t.size(0) > 0 && c.cols % t.size(0) == 0 : t.size(0) == ngr && t.size(1) == c.group,
           op, ": moments of shape [", t.size(0), ", ", t.size(1), ", ", t.size(2), "] fit neither ", ngr,
           " blocks of ", c.group, " columns nor a diagonal");
  return out;
}

double weighted_sum(const float* d, int64_t len, const Weighting& w, double* dd, double* y) {
  for (int64_t i = 0; i < len; ++i) dd[i] = static_cast<double>(d[i]);
  double total = 0.0;
  if (w.diag) {
    int64_t col = w.col0 % w.ncols;
    for (int64_t i = 0; i < len; ++i) {
      total += w.diag[col] * dd[i] * dd[i];
      if (++col == w.ncols) col = 0;
    }
    return total;
  }
  // y = M d, 16 columns at a time (their sums stay in registers) by rows of the symmetric M, with
  // fused multiply-adds: this sum has no bit-exact reference (torch's bmm orders it its own way)
  constexpr int64_t kC = 16;
  int64_t j0 = 0;
  for (; j0 + kC <= len; j0 += kC) {
    double acc[kC] = {};
    for (int64_t i = 0; i < len; ++i) {
      const double c = dd[i];
      const double* row = w.block + i * w.ld + j0;
      for (int64_t t = 0; t < kC; ++t) acc[t] = std::fma(c, row[t], acc[t]);
    }
    for (int64_t t = 0; t < kC; ++t) y[j0 + t] = acc[t];
  }
  for (int64_t j = j0; j < len; ++j) y[j] = 0.0;
  for (int64_t i = 0; i < len && j0 < len; ++i) {
    const double c = dd[i];
    const double* row = w.block + i * w.ld;
    for (int64_t j = j0; j < len; ++j) y[j] = std::fma(c, row[j], y[j]);
  }
  for (int64_t j = 0; j < len; ++j) total += y[j] * dd[j];
  return total;
}

// err[k * stride] = the group's error under candidate k: sum of squares, or d^T M d with a weighting.
template <typename T, bool ADD_ZP>
void mse_group(const T* x, int64_t len, const float* s, const float* z, int64_t K, int64_t stride,
               float qmin, float qmax, const Weighting* w, float* d, double* dd, double* y, double* err) {
  for (int64_t k = 0; k < K; ++k) {
    group_diffs<T, ADD_ZP>(x, len, s[k * stride], ADD_ZP ? z[k * stride] : 0.0f, qmin, qmax, d);
    err[k * stride] = w ? weighted_sum(d, len, *w, dd, y) : squared_sum(d, len);
  }
}

}  // namespace

at::Tensor mse_errors_cpu(const at::Tensor& x_, const at::Tensor& scales_, const std::optional<at::Tensor>& zps_,
                          int64_t rows, int64_t cols, int64_t group, int64_t bits,
                          const std::optional<at::Tensor>& moments_) {
  const QuantConfig c = make_config(x_, std::nullopt, rows, cols, group, bits, kInt, !zps_.has_value(), false, 0, 0);
  const int64_t G = c.group > 0 ? c.rows * c.groups_per_row() : 0;
  QC_CHECK(scales_.scalar_type() == at::kFloat && scales_.dim() == 2 && scales_.size(1) == G &&
                  scales_.device() == x_.device(),
              "qcompress::mse_errors: expected float32 scales [candidates, ", G, "]");
  const int64_t K = scales_.size(0);
  if (zps_.has_value()) {
    QC_CHECK(zps_->scalar_type() == at::kFloat && zps_->sizes() == scales_.sizes(),
                "qcompress::mse_errors: zero points must be float32 shaped like the scales");
  }
  const int64_t ngr = c.groups_per_row();
  const Moments moments = check_moments(moments_, x_, c, "qcompress::mse_errors");
  at::Tensor x = x_.contiguous(), scales = scales_.contiguous();
  at::Tensor zps = zps_.has_value() ? zps_->contiguous() : at::Tensor();
  at::Tensor err = at::zeros({K, G}, x.options().dtype(at::kDouble));
  if (G == 0 || K == 0 || x.numel() == 0) return err;
  const float* s = scales.data_ptr<float>();
  const float* z = zps.defined() ? zps.data_ptr<float>() : nullptr;
  const bool mp = moments.data() != nullptr;
  double* e = err.data_ptr<double>();
  const int64_t grain = std::max<int64_t>(1, 4096 / std::max<int64_t>(1, c.group));
  const int64_t width = std::min<int64_t>(c.group, c.cols);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "qcompress_mse_errors", [&] {
    if constexpr (std::is_same_v<scalar_t, double>) {
      QC_CHECK(false, "qcompress::mse_errors: float64 input is converted by the Python wrapper");
    } else {
      const scalar_t* xd = data_of<scalar_t>(x);
      at::parallel_for(0, G, grain, [&](int64_t g0, int64_t g1) {
        std::vector<float> d(width);
        std::vector<double> dd(mp ? width : 0), y(mp && !moments.diagonal ? width : 0);
        for (int64_t g = g0; g < g1; ++g) {
          const int64_t st0 = (g / ngr) * c.cols + (g % ngr) * c.group;
          const int64_t cnt = std::max<int64_t>(0, std::min<int64_t>(c.group, c.cols - (g % ngr) * c.group));
          const Weighting w = moments.of(g, st0, ngr, c.group);
          const Weighting* wp = mp ? &w : nullptr;
          if (z) mse_group<scalar_t, true>(xd + st0, cnt, s + g, z + g, K, G, c.qmin, c.qmax, wp, d.data(), dd.data(),
                                           y.data(), e + g);
          else mse_group<scalar_t, false>(xd + st0, cnt, s + g, nullptr, K, G, c.qmin, c.qmax, wp, d.data(),
                                          dd.data(), y.data(), e + g);
        }
      });
    }
  });
  return err;
}

// The least-squares refinement's terms for symmetric scales s (one per group): with the codes
// q = clamp(round(x / s)) and d = q s - x (float32, as the reference's dequantize_view(q) - x),
// num = <q, x>, den = <q, q> and err = <d, d>, each in the weighted inner product <a, b> = a^T M b
// (M the group's block, or diagonal weights) or the plain one. All float64 [groups].
std::tuple<at::Tensor, at::Tensor, at::Tensor> mse_refine_terms_cpu(const at::Tensor& x_, const at::Tensor& scales_,
                                                                    int64_t rows, int64_t cols, int64_t group,
                                                                    int64_t bits,
                                                                    const std::optional<at::Tensor>& moments_) {
  const QuantConfig c = make_config(x_, std::nullopt, rows, cols, group, bits, kInt, true, false, 0, 0);
  const int64_t G = c.group > 0 ? c.rows * c.groups_per_row() : 0;
  QC_CHECK(scales_.scalar_type() == at::kFloat && scales_.dim() == 1 && scales_.size(0) == G &&
               scales_.device() == x_.device(),
           "qcompress::mse_refine_terms: expected float32 scales [", G, "]");
  const int64_t ngr = c.groups_per_row();
  const Moments moments = check_moments(moments_, x_, c, "qcompress::mse_refine_terms");
  const bool diagonal = moments.diagonal;
  at::Tensor x = x_.contiguous(), scales = scales_.contiguous();
  const auto opts = x.options().dtype(at::kDouble);
  at::Tensor num = at::zeros({G}, opts), den = at::zeros({G}, opts), err = at::zeros({G}, opts);
  if (G == 0 || x.numel() == 0) return {num, den, err};
  const float* s = scales.data_ptr<float>();
  const bool mp = moments.data() != nullptr;
  double *pn = num.data_ptr<double>(), *pd = den.data_ptr<double>(), *pe = err.data_ptr<double>();
  const int64_t grain = std::max<int64_t>(1, 4096 / std::max<int64_t>(1, c.group));
  const int64_t width = std::min<int64_t>(c.group, c.cols);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "qcompress_mse_refine_terms", [&] {
    if constexpr (std::is_same_v<scalar_t, double>) {
      QC_CHECK(false, "qcompress::mse_refine_terms: float64 input is converted by the Python wrapper");
    } else {
      const scalar_t* xd = data_of<scalar_t>(x);
      at::parallel_for(0, G, grain, [&](int64_t g0, int64_t g1) {
        std::vector<float> d(width), q(width), xf(width);
        std::vector<double> dd(width), y(width);
        for (int64_t g = g0; g < g1; ++g) {
          const int64_t st0 = (g / ngr) * c.cols + (g % ngr) * c.group;
          const int64_t cnt = std::max<int64_t>(0, std::min<int64_t>(c.group, c.cols - (g % ngr) * c.group));
          const float sk = s[g];
          for (int64_t i = 0; i < cnt; ++i) {   // as group_diffs' scalar tail, keeping the codes
            xf[i] = static_cast<float>(xd[st0 + i]);
            q[i] = clamp_code(rint_(xf[i] / sk), c.qmin, c.qmax);
            d[i] = q[i] * sk - xf[i];
          }
          const Weighting w = moments.of(g, st0, ngr, c.group);
          pe[g] = mp ? weighted_sum(d.data(), cnt, w, dd.data(), y.data()) : squared_sum(d.data(), cnt);
          double a = 0.0, b = 0.0;
          if (mp && !diagonal) {
            weighted_sum(q.data(), cnt, w, dd.data(), y.data());   // leaves y = M q
            for (int64_t i = 0; i < cnt; ++i) {
              a += y[i] * double(xf[i]);
              b += y[i] * double(q[i]);
            }
          } else {                                                  // diagonal weights, or none
            int64_t col = diagonal ? w.col0 % w.ncols : 0;
            for (int64_t i = 0; i < cnt; ++i) {
              const double wi = diagonal ? w.diag[col] : 1.0;
              a += wi * double(q[i]) * double(xf[i]);
              b += wi * double(q[i]) * double(q[i]);
              if (diagonal && ++col == w.ncols) col = 0;
            }
          }
          pn[g] = a;
          pd[g] = b;
        }
      });
    }
  });
  return {num, den, err};
}

std::tuple<at::Tensor, at::Tensor> fake_quant_params_cpu(const at::Tensor& x_, const at::Tensor& scale_,
                                                         const std::optional<at::Tensor>& zp_, int64_t rows,
                                                         int64_t cols, int64_t group, int64_t bits, int64_t rounding,
                                                         int64_t seed, bool with_mask) {
  const QuantConfig c = make_config(x_, std::nullopt, rows, cols, group, bits, kInt, !zp_.has_value(), false,
                                    rounding, seed);
  check_group_params(x_, scale_, zp_, c, "qcompress::fake_quant_params");
  at::Tensor x = x_.contiguous(), scale = scale_.contiguous();
  at::Tensor zp = zp_.has_value() ? zp_->contiguous() : at::Tensor();
  at::Tensor y = empty_reused(x.sizes(), x.options());
  at::Tensor mask = empty_reused(with_mask ? x.sizes() : at::IntArrayRef{0}, x.options().dtype(at::kBool));
  if (c.group == 0 || c.rows == 0 || x.numel() == 0) return {y, mask};
  const float* s = scale.data_ptr<float>();
  const float* z = zp.defined() ? zp.data_ptr<float>() : nullptr;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "qcompress_fake_quant_params", [&] {
    if constexpr (std::is_same_v<scalar_t, double>) {
      QC_CHECK(false, "qcompress::fake_quant_params: float64 input is converted by the Python wrapper");
    } else {
      Outputs<scalar_t, int8_t> o;
      o.y = mdata_of<scalar_t>(y);
      o.mask = with_mask ? mask.mutable_data_ptr<bool>() : nullptr;
      const scalar_t* xd = data_of<scalar_t>(x);
      const bool st = c.rounding == kStochastic;
      if (z) {
        if (st) run_params<scalar_t, true, true>(xd, s, z, c, o); else run_params<scalar_t, false, true>(xd, s, z, c, o);
      } else {
        if (st) run_params<scalar_t, true, false>(xd, s, z, c, o); else run_params<scalar_t, false, false>(xd, s, z, c, o);
      }
    }
  });
  return {y, mask};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> lsq_backward_cpu(const at::Tensor& grad_, const at::Tensor& x_,
                                                                const at::Tensor& scale_,
                                                                const std::optional<at::Tensor>& zp_, int64_t rows,
                                                                int64_t cols, int64_t group, int64_t bits,
                                                                int64_t rounding, int64_t seed) {
  const QuantConfig c = make_config(x_, std::nullopt, rows, cols, group, bits, kInt, !zp_.has_value(), false,
                                    rounding, seed);
  check_group_params(x_, scale_, zp_, c, "qcompress::lsq_backward");
  QC_CHECK(grad_.sizes() == x_.sizes() && grad_.is_floating_point() && grad_.device() == x_.device(),
              "qcompress::lsq_backward: grad must be a floating tensor shaped like x");
  at::Tensor x = x_.contiguous(), grad = grad_.contiguous(), scale = scale_.contiguous();
  at::Tensor zp = zp_.has_value() ? zp_->contiguous() : at::Tensor();
  const int64_t G = c.group > 0 ? c.rows * c.groups_per_row() : 0;
  at::Tensor grad_x = at::empty_like(grad, at::MemoryFormat::Contiguous);
  at::Tensor gs = at::zeros({G}, x.options().dtype(at::kFloat));
  at::Tensor gz = at::zeros({zp.defined() ? G : 0}, x.options().dtype(at::kFloat));
  if (c.group == 0 || G == 0 || x.numel() == 0) return {grad_x, gs, gz};
  const float* s = scale.data_ptr<float>();
  const float* z = zp.defined() ? zp.data_ptr<float>() : nullptr;
  float* gsp = gs.data_ptr<float>();
  float* gzp = zp.defined() ? gz.data_ptr<float>() : nullptr;
  const bool st = c.rounding == kStochastic;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "qcompress_lsq_backward_x", [&] {
    using T = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, grad.scalar_type(), "qcompress_lsq_backward_g", [&] {
      using Gt = scalar_t;
      const T* xd = data_of<T>(x);
      const Gt* gd = data_of<Gt>(grad);
      Gt* gx = mdata_of<Gt>(grad_x);
      if (z) {
        if (st) run_lsq<T, Gt, true, true>(xd, gd, gx, s, z, c, gsp, gzp); else run_lsq<T, Gt, false, true>(xd, gd, gx, s, z, c, gsp, gzp);
      } else {
        if (st) run_lsq<T, Gt, true, false>(xd, gd, gx, s, z, c, gsp, gzp); else run_lsq<T, Gt, false, false>(xd, gd, gx, s, z, c, gsp, gzp);
      }
    });
  });
  return {grad_x, gs, gz};
}

std::tuple<at::Tensor, at::Tensor> fake_quant_cpu(const at::Tensor& x_, const std::optional<at::Tensor>& range,
                                                  int64_t rows, int64_t cols, int64_t group, int64_t bits,
                                                  int64_t kind, bool symmetric, bool deepspeed,
                                                  int64_t rounding, int64_t seed, bool with_mask) {
  const QuantConfig c = make_config(x_, range, rows, cols, group, bits, kind, symmetric, deepspeed, rounding, seed);
  at::Tensor x = x_.contiguous();
  at::Tensor y = empty_reused(x.sizes(), x.options());
  at::Tensor mask = empty_reused(with_mask ? x.sizes() : at::IntArrayRef{0}, x.options().dtype(at::kBool));
  // (an empty tensor with group > 0 still has groups: the reference reports their empty range)
  if (c.group == 0 || c.rows == 0) return {y, mask};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "qcompress_fake_quant", [&] {
    Outputs<scalar_t, int8_t> o;
    o.y = mdata_of<scalar_t>(y);
    o.mask = with_mask ? mask.mutable_data_ptr<bool>() : nullptr;
    if constexpr (std::is_same_v<scalar_t, double>) {
      QC_CHECK(false, "qcompress::fake_quant: float64 input is converted by the Python wrapper");
    } else {
      raise_bad(dispatch_mode<scalar_t, int8_t>(data_of<scalar_t>(x), c, o), c.rows * c.groups_per_row());
    }
  });
  return {y, mask};
}

namespace {

// quantize_cpu with the values too when `y` is given (defined, x's shape and dtype).
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_into(const at::Tensor& x_, const std::optional<at::Tensor>& range,
                                                             int64_t rows, int64_t cols, int64_t group, int64_t bits,
                                                             int64_t kind, bool symmetric, bool deepspeed,
                                                             int64_t rounding, int64_t seed, at::Tensor* y) {
  const QuantConfig c = make_config(x_, range, rows, cols, group, bits, kind, symmetric, deepspeed, rounding, seed);
  at::Tensor x = x_.contiguous();
  const int64_t G = c.rows * c.groups_per_row();
  const bool small = c.qmin >= -128.0f && c.qmax <= 127.0f;  // codes fit int8
  at::Tensor q = empty_reused(x.sizes(), x.options().dtype(small ? at::kChar : at::kInt));
  at::Tensor scale = at::empty({G}, x.options().dtype(at::kFloat));
  at::Tensor zp = at::zeros({G}, x.options().dtype(at::kFloat));
  if (c.group == 0) {
    empty_groups(c, scale.data_ptr<float>(), zp.data_ptr<float>());
    return {q, scale, zp.to(at::kInt)};
  }
  if (G == 0) return {q, scale, zp.to(at::kInt)};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "qcompress_quantize", [&] {
    if constexpr (std::is_same_v<scalar_t, double>) {
      QC_CHECK(false, "qcompress::quantize: float64 input is converted by the Python wrapper");
    } else {
      int64_t bad;
      scalar_t* yv = y ? mdata_of<scalar_t>(*y) : nullptr;
      if (small) {
        Outputs<scalar_t, int8_t> o;
        o.y = yv;
        o.q = q.data_ptr<int8_t>();
        o.scale = scale.data_ptr<float>();
        o.zp = zp.data_ptr<float>();
        bad = dispatch_mode<scalar_t, int8_t>(data_of<scalar_t>(x), c, o);
      } else {
        Outputs<scalar_t, int32_t> o;
        o.y = yv;
        o.q = q.data_ptr<int32_t>();
        o.scale = scale.data_ptr<float>();
        o.zp = zp.data_ptr<float>();
        bad = dispatch_mode<scalar_t, int32_t>(data_of<scalar_t>(x), c, o);
      }
      raise_bad(bad, G);
    }
  });
  return {q, scale, zp.to(at::kInt)};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_cpu(const at::Tensor& x, const std::optional<at::Tensor>& range,
                                                            int64_t rows, int64_t cols, int64_t group, int64_t bits,
                                                            int64_t kind, bool symmetric, bool deepspeed,
                                                            int64_t rounding, int64_t seed) {
  return quantize_into(x, range, rows, cols, group, bits, kind, symmetric, deepspeed, rounding, seed, nullptr);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_values_cpu(
    const at::Tensor& x, const std::optional<at::Tensor>& range, int64_t rows, int64_t cols, int64_t group,
    int64_t bits, int64_t kind, bool symmetric, bool deepspeed, int64_t rounding, int64_t seed) {
  // fake_quant's output buffer (same shape, dtype, contiguity); groups with no elements write none
  at::Tensor y = empty_reused(x.sizes(), x.options());
  auto [q, scale, zp] = quantize_into(x, range, rows, cols, group, bits, kind, symmetric, deepspeed, rounding, seed, &y);
  return {q, scale, zp, y};
}

int64_t quantize_token_rows(const at::Tensor& x, int64_t r0, int64_t r1, int bits, bool symmetric, int8_t* q,
                            float* scale, float* zp) {
  const int64_t k = x.size(-1);
  QuantConfig c;
  c.rows = r1 - r0;
  c.cols = k;
  c.group = k;
  c.bits = bits;
  c.kind = kInt;
  c.rounding = kNearest;
  c.symmetric = symmetric;
  c.qmin = static_cast<float>(-(1 << (bits - 1)));
  c.qmax = static_cast<float>((1 << (bits - 1)) - 1);
  if (c.rows <= 0 || k == 0) return 0;
  int64_t bad = 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "qcompress_quantize_rows", [&] {
    if constexpr (!std::is_same_v<scalar_t, double>) {
      Outputs<scalar_t, int8_t> o;
      o.q = q + r0 * k;
      o.scale = scale + r0;
      o.zp = zp + r0;
      bad = dispatch_mode<scalar_t, int8_t>(data_of<scalar_t>(x) + r0 * k, c, o);
    }
  });
  return bad;
}

void raise_nonfinite(int64_t bad, int64_t groups) { raise_bad(bad, groups); }

}  // namespace qc
