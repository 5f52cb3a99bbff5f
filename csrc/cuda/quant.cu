// CUDA fake-quantize / quantize / dequantize / straight-through backward.
//
// Statistics: each group is cut into segments of kSeg elements, one warp reduces one segment
// (min/max, float64 sum |x|), a per-group pass combines the segments in order and computes the
// scale (so results do not depend on the launch shape). Then one grid-stride elementwise pass.
// The element math is qcompress/math.h, shared with the CPU kernels.
#include <cstdlib>

#include "common.cuh"
#include "qcompress/cuda_launchers.h"
#include "qcompress/math.h"

namespace qc {
namespace cuda {
namespace {

constexpr int64_t kSeg = 1024;

struct Partial {
  float lo, hi;
  double sum;       // sum |x|, or (second pass) sum |x| over |x| > thr
  long long kept;   // second pass: count of |x| > thr
};

struct Geo {
  int64_t rows, cols, group, ngr, spg;  // spg: segments per group
  __device__ int64_t start(int64_t g) const { return (g / ngr) * cols + (g % ngr) * group; }
  __device__ int64_t count(int64_t g) const {
    int64_t c = cols - (g % ngr) * group;
    c = c < group ? c : group;
    return c < 0 ? 0 : c;
  }
};

Geo make_geo(const qc_cuda_quant_args* a) {
  Geo g;
  g.rows = a->rows;
  g.cols = a->cols;
  g.group = a->group;
  g.ngr = a->group > 0 ? (a->cols + a->group - 1) / a->group : 1;
  if (g.ngr < 1) g.ngr = 1;
  g.spg = a->group > 0 ? (a->group + kSeg - 1) / kSeg : 1;
  return g;
}

__device__ __forceinline__ float warp_min(float v) {
  for (int o = 16; o > 0; o >>= 1) v = nan_min(v, __shfl_down_sync(0xffffffffu, v, o));
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = nan_max(v, __shfl_down_sync(0xffffffffu, v, o));
  return v;
}
__device__ __forceinline__ double warp_sum(double v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ long long warp_sum_ll(long long v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  return v;
}

// One warp per segment. PASS 0: min/max and sum |x|; PASS 1: kept sum over |x| > thr[g].
template <typename T, int PASS>
__global__ void segment_stats(const T* __restrict__ x, Geo geo, const float* __restrict__ thr,
                              Partial* __restrict__ part, int64_t segments) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  for (int64_t s = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32; s < segments;
       s += warps) {
    const int64_t g = s / geo.spg, k = s % geo.spg;
    const int64_t cnt = geo.count(g);
    const int64_t b = k * kSeg;
    const int64_t e = (b + kSeg < cnt) ? b + kSeg : cnt;
    const T* gx = x + geo.start(g);
    float lo = __int_as_float(0x7f800000), hi = -__int_as_float(0x7f800000);
    double sum = 0.0;
    long long kept = 0;
    const float t = PASS == 1 ? thr[g] : 0.0f;
    for (int64_t i = b + lane; i < e; i += 32) {
      const float v = to_f(gx[i]);
      const float a = fabs_(v);
      if (PASS == 0) {
        lo = nan_min(lo, v);
        hi = nan_max(hi, v);
        sum += static_cast<double>(a);
      } else if (a > t) {
        sum += static_cast<double>(a);
        ++kept;
      }
    }
    lo = warp_min(lo);
    hi = warp_max(hi);
    sum = warp_sum(sum);
    kept = warp_sum_ll(kept);
    if (lane == 0) part[s] = Partial{lo, hi, sum, kept};
  }
}

// One thread per group: combine its segments in order, compute the parameters.
// STAGE 0 (int, binary, ternary first pass) / STAGE 1 (ternary after the kept pass).
template <int STAGE>
__global__ void group_params(qc_cuda_quant_args a, Geo geo, const Partial* __restrict__ part,
                             float* __restrict__ scale, float* __restrict__ zp, float* __restrict__ thr,
                             int* __restrict__ bad, int64_t groups) {
  for (int64_t g = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; g < groups;
       g += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float lo = __int_as_float(0x7f800000), hi = -__int_as_float(0x7f800000);
    double sum = 0.0;
    long long kept = 0;
    for (int64_t k = 0; k < geo.spg; ++k) {
      const Partial p = part[g * geo.spg + k];
      lo = nan_min(lo, p.lo);
      hi = nan_max(hi, p.hi);
      sum += p.sum;
      kept += p.kept;
    }
    const int64_t cnt = geo.count(g);
    bool ok = true;
    float s = kEps, z = 0.0f;
    if (a.kind == kInt) {
      if (a.range != nullptr) {
        lo = a.range[0];
        hi = a.range[1];
      }
      const Params p = int_params(lo, hi, a.bits, a.symmetric != 0, a.deepspeed != 0, a.qmin, a.qmax);
      ok = is_finite(lo) && is_finite(hi);
      s = p.scale;
      z = p.zp;
      thr[g] = p.z;  // deepspeed asymmetric offset travels in the thr slot
    } else if (STAGE == 0) {
      const float mean = mean_from_sum(sum, cnt);
      s = clamp_min(mean, kEps);
      if (a.kind == kTernary) {
        thr[g] = ternary_threshold(mean);
        ok = is_finite(thr[g]);
      } else {
        thr[g] = 0.0f;
        ok = is_finite(mean);
      }
    } else {
      s = clamp_min(mean_from_sum(sum, kept), kEps);
    }
    scale[g] = s;
    zp[g] = z;
    if (!ok && STAGE == 0) atomicAdd(bad, 1);
  }
}

template <typename T, typename Q, int KIND, bool STOCH, bool DS, bool ASYM_DS, bool ADD_ZP>
__global__ void quant_elements(const T* __restrict__ x, Geo geo, qc_cuda_quant_args a,
                               const float* __restrict__ scale, const float* __restrict__ zpv,
                               const float* __restrict__ aux, T* __restrict__ y, bool* __restrict__ mask,
                               Q* __restrict__ q, int64_t n) {
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = e / geo.cols, col = e % geo.cols;
    const int64_t g = row * geo.ngr + col / geo.group;
    const float xv = to_f(x[e]);
    const float s = scale[g];
    float qv;
    if (KIND == kInt) {
      float u = 0.0f;
      if (STOCH) u = uniform(rng_key(a.seed, static_cast<uint32_t>(e >> 32)), static_cast<uint32_t>(e));
      const float z = aux[g], zp = zpv[g];
      const float r = int_code<float, STOCH, DS, ASYM_DS, ADD_ZP>(xv, s, z, zp, u);
      qv = clamp_code(r, a.qmin, a.qmax);
      if (mask) mask[e] = inside_range(r, a.qmin, a.qmax);
      if (y) y[e] = from_f_sat<T>(dequant_code<float, ASYM_DS, ADD_ZP>(qv, s, z, zp));
    } else {
      qv = KIND == kBinary ? binary_code<float, DS>(xv) : ternary_code<float>(xv, aux[g]);
      if (mask) mask[e] = true;
      if (y) y[e] = from_f<T>(qv * s);
    }
    if (q) q[e] = static_cast<Q>(static_cast<int>(qv));
  }
}

template <typename T, typename Q, int KIND, bool STOCH, bool DS, bool ASYM_DS, bool ADD_ZP>
void launch_elements(const qc_cuda_quant_args* a, const Geo& geo, const void* x, const float* scale,
                     const float* zp, const float* aux, void* y, bool* mask, void* q, cudaStream_t st) {
  const int64_t n = a->rows * a->cols;
  quant_elements<T, Q, KIND, STOCH, DS, ASYM_DS, ADD_ZP><<<blocks_for(n, kThreads * 4), kThreads, 0, st>>>(
      static_cast<const T*>(x), geo, *a, scale, zp, aux, static_cast<T*>(y), mask, static_cast<Q*>(q), n);
}

template <typename T, typename Q>
void dispatch_elements(const qc_cuda_quant_args* a, const Geo& geo, const void* x, const float* scale,
                       const float* zp, const float* aux, void* y, bool* mask, void* q, cudaStream_t st) {
  const bool sto = a->rounding == kStochastic;
#define QC_LAUNCH(K, S, D, A, Z) launch_elements<T, Q, K, S, D, A, Z>(a, geo, x, scale, zp, aux, y, mask, q, st)
  if (a->kind == kBinary) {
    if (a->deepspeed) QC_LAUNCH(kBinary, false, true, false, false);
    else QC_LAUNCH(kBinary, false, false, false, false);
  } else if (a->kind == kTernary) {
    QC_LAUNCH(kTernary, false, false, false, false);
  } else if (a->symmetric) {
    if (a->deepspeed) { if (sto) QC_LAUNCH(kInt, true, true, false, false); else QC_LAUNCH(kInt, false, true, false, false); }
    else { if (sto) QC_LAUNCH(kInt, true, false, false, false); else QC_LAUNCH(kInt, false, false, false, false); }
  } else if (a->deepspeed) {
    if (sto) QC_LAUNCH(kInt, true, true, true, false); else QC_LAUNCH(kInt, false, true, true, false);
  } else {
    if (sto) QC_LAUNCH(kInt, true, false, false, true); else QC_LAUNCH(kInt, false, false, false, true);
  }
#undef QC_LAUNCH
}

// One pass for integer kinds with the ranges from the data, where a group fits in shared memory:
// one block per group loads it once, reduces min/max (exact, so the order does not matter),
// computes the parameters as group_params does and quantizes from the on-chip copy. The element
// math is quant_elements' (same flat index for the stochastic noise), so the bits are the same.
constexpr int64_t kOnChipMax = 16384;  // elements; whether a group fits the device is asked at launch

template <typename T, typename Q, bool STOCH, bool DS, bool ASYM_DS, bool ADD_ZP>
__global__ void onepass_int(const T* __restrict__ x, Geo geo, qc_cuda_quant_args a, float* __restrict__ scale,
                            float* __restrict__ zpv, T* __restrict__ y, bool* __restrict__ mask,
                            Q* __restrict__ q, int* __restrict__ bad) {
  extern __shared__ __align__(16) unsigned char onchip_raw[];
  T* buf = reinterpret_cast<T*>(onchip_raw);
  __shared__ float red_lo[32], red_hi[32];
  const int64_t g = blockIdx.x;
  const int64_t cnt = geo.count(g), base = geo.start(g);
  float lo = __int_as_float(0x7f800000), hi = -__int_as_float(0x7f800000);
  for (int64_t i = threadIdx.x; i < cnt; i += blockDim.x) {
    const T v = x[base + i];
    buf[i] = v;
    const float f = to_f(v);
    lo = nan_min(lo, f);
    hi = nan_max(hi, f);
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x / 32, warps = (blockDim.x + 31) / 32;
  lo = warp_min(lo);
  hi = warp_max(hi);
  if (lane == 0) {
    red_lo[warp] = lo;
    red_hi[warp] = hi;
  }
  __syncthreads();
  if (warp == 0) {
    lo = lane < warps ? red_lo[lane] : __int_as_float(0x7f800000);
    hi = lane < warps ? red_hi[lane] : -__int_as_float(0x7f800000);
    lo = warp_min(lo);
    hi = warp_max(hi);
    if (lane == 0) {
      red_lo[0] = lo;
      red_hi[0] = hi;
    }
  }
  __syncthreads();
  lo = red_lo[0];
  hi = red_hi[0];
  const Params p = int_params(lo, hi, a.bits, a.symmetric != 0, a.deepspeed != 0, a.qmin, a.qmax);
  if (threadIdx.x == 0) {
    scale[g] = p.scale;
    zpv[g] = p.zp;
    if (!(is_finite(lo) && is_finite(hi))) atomicAdd(bad, 1);
  }
  for (int64_t i = threadIdx.x; i < cnt; i += blockDim.x) {
    const int64_t e = base + i;
    float u = 0.0f;
    if (STOCH) u = uniform(rng_key(a.seed, static_cast<uint32_t>(e >> 32)), static_cast<uint32_t>(e));
    const float r = int_code<float, STOCH, DS, ASYM_DS, ADD_ZP>(to_f(buf[i]), p.scale, p.z, p.zp, u);
    const float qv = clamp_code(r, a.qmin, a.qmax);
    if (mask) mask[e] = inside_range(r, a.qmin, a.qmax);
    if (y) y[e] = from_f_sat<T>(dequant_code<float, ASYM_DS, ADD_ZP>(qv, p.scale, p.z, p.zp));
    if (q) q[e] = static_cast<Q>(static_cast<int>(qv));
  }
}

// The kernel's static shared memory (its reduction arrays), asked of the runtime once per
// instantiation; SIZE_MAX when the runtime cannot say (the one-pass path is then not taken).
template <typename T, typename Q, bool STOCH, bool DS, bool ASYM_DS, bool ADD_ZP>
size_t onepass_static_smem() {
  static const size_t bytes = [] {
    cudaFuncAttributes fa;
    if (cudaFuncGetAttributes(&fa, onepass_int<T, Q, STOCH, DS, ASYM_DS, ADD_ZP>) != cudaSuccess) {
      (void)cudaGetLastError();
      return static_cast<size_t>(-1);
    }
    return static_cast<size_t>(fa.sharedSizeBytes);
  }();
  return bytes;
}

// Launches the one-pass kernel when its shared memory (the group on chip plus the kernel's own
// static arrays) fits this device's per-block limit; beyond the default 48 KiB it opts in with
// cudaFuncSetAttribute. Returns false, having launched nothing and left no error behind, when the
// group does not fit, the opt-in is refused or the launch fails: the caller then runs the
// two-pass kernels.
template <typename T, typename Q, bool STOCH, bool DS, bool ASYM_DS, bool ADD_ZP>
bool launch_onepass(const qc_cuda_quant_args* a, const Geo& geo, const void* x, float* scale, float* zp, void* y,
                    bool* mask, void* q, int* bad, cudaStream_t st) {
  // an error pending from an earlier launch is left for status() to report (the checks below
  // clear the errors they cause): the two-pass kernels run, as without the one-pass path
  if (cudaPeekAtLastError() != cudaSuccess) return false;
  const int64_t groups = geo.rows * geo.ngr;
  const size_t bytes = static_cast<size_t>(geo.group) * sizeof(T);
  const size_t fixed = onepass_static_smem<T, Q, STOCH, DS, ASYM_DS, ADD_ZP>();
  int dev = 0, optin = 0, plain = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&plain, cudaDevAttrMaxSharedMemoryPerBlock, dev) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  if (fixed == static_cast<size_t>(-1) || fixed + bytes > static_cast<size_t>(optin)) return false;
  auto kernel = onepass_int<T, Q, STOCH, DS, ASYM_DS, ADD_ZP>;
  if (fixed + bytes > static_cast<size_t>(plain) &&
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)) !=
          cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  // a thread per 16 elements up to a full block; at least 64 threads, since an SM holds at most
  // 32 blocks and small groups (128) would otherwise leave half its thread slots empty
  int64_t threads = (geo.group + 15) / 16;
  threads = ((threads + 31) / 32) * 32;
  threads = threads < 64 ? 64 : (threads > 1024 ? 1024 : threads);
  kernel<<<static_cast<unsigned int>(groups), static_cast<unsigned int>(threads), bytes, st>>>(
      static_cast<const T*>(x), geo, *a, scale, zp, static_cast<T*>(y), mask, static_cast<Q*>(q), bad);
  if (cudaPeekAtLastError() != cudaSuccess) {  // a launch refused (resources): nothing ran
    (void)cudaGetLastError();
    return false;
  }
  return true;
}

template <typename T, typename Q>
bool dispatch_onepass(const qc_cuda_quant_args* a, const Geo& geo, const void* x, float* scale, float* zp, void* y,
                      bool* mask, void* q, int* bad, cudaStream_t st) {
  const bool sto = a->rounding == kStochastic;
#define QC_ONEPASS(S, D, A, Z) return launch_onepass<T, Q, S, D, A, Z>(a, geo, x, scale, zp, y, mask, q, bad, st)
  if (a->symmetric) {
    if (a->deepspeed) { if (sto) QC_ONEPASS(true, true, false, false); else QC_ONEPASS(false, true, false, false); }
    else { if (sto) QC_ONEPASS(true, false, false, false); else QC_ONEPASS(false, false, false, false); }
  } else if (a->deepspeed) {
    if (sto) QC_ONEPASS(true, true, true, false); else QC_ONEPASS(false, true, true, false);
  } else {
    if (sto) QC_ONEPASS(true, false, false, true); else QC_ONEPASS(false, false, false, true);
  }
#undef QC_ONEPASS
}

// Whether run_quant tries the one-pass kernel: asked for with QC_CUDA_ONE_PASS=1 (it has not yet
// passed `pytest -m cuda` on a GPU, so the two-pass kernels stay the default), integer codes,
// ranges from the data, a group within kOnChipMax, a grid of one block per group. Whether the
// group fits this device's shared memory is decided at launch (launch_onepass).
bool onepass_fits(const qc_cuda_quant_args* a, const Geo& geo) {
  static const bool asked = [] {
    const char* v = std::getenv("QC_CUDA_ONE_PASS");
    return v != nullptr && v[0] == '1';
  }();
  const int64_t groups = geo.rows * geo.ngr;
  return asked && a->kind == kInt && a->range == nullptr && geo.group > 0 && geo.group <= kOnChipMax &&
         groups > 0 && groups <= 0x7fffffff;
}

template <typename T>
void run_quant(const qc_cuda_quant_args* a, const void* x, void* y, bool* mask, void* q, int q_dtype,
               float* scale, float* zp, void* ws, int* bad, cudaStream_t st) {
  const Geo geo = make_geo(a);
  if (onepass_fits(a, geo)) {
    const bool ran = q_dtype == 1 ? dispatch_onepass<T, int32_t>(a, geo, x, scale, zp, y, mask, q, bad, st)
                                  : dispatch_onepass<T, int8_t>(a, geo, x, scale, zp, y, mask, q, bad, st);
    if (ran) return;  // else: the group does not fit this device's shared memory; two passes
  }
  const int64_t groups = geo.rows * geo.ngr;
  const int64_t segments = groups * geo.spg;
  Partial* part = static_cast<Partial*>(ws);
  float* aux = reinterpret_cast<float*>(part + segments);  // thr (binary/ternary) or z (int)
  const T* xt = static_cast<const T*>(x);
  const unsigned int warps_per_block = kThreads / 32;
  const bool need_stats = a->kind != kInt || a->range == nullptr;
  if (need_stats) {
    segment_stats<T, 0><<<blocks_for(segments, warps_per_block), kThreads, 0, st>>>(xt, geo, aux, part, segments);
  }
  group_params<0><<<blocks_for(groups, kThreads), kThreads, 0, st>>>(*a, geo, part, scale, zp, aux, bad, groups);
  if (a->kind == kTernary) {
    segment_stats<T, 1><<<blocks_for(segments, warps_per_block), kThreads, 0, st>>>(xt, geo, aux, part, segments);
    group_params<1><<<blocks_for(groups, kThreads), kThreads, 0, st>>>(*a, geo, part, scale, zp, aux, bad, groups);
  }
  if (q_dtype == 1) dispatch_elements<T, int32_t>(a, geo, x, scale, zp, aux, y, mask, q, st);
  else dispatch_elements<T, int8_t>(a, geo, x, scale, zp, aux, y, mask, q, st);
}

// Static range without statistics: the partials are never read, but group_params combines
// them, so they are filled with neutral values.
__global__ void neutral_partials(Partial* part, int64_t segments) {
  for (int64_t s = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; s < segments;
       s += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    part[s] = Partial{0.0f, 0.0f, 0.0, 0};
  }
}

template <typename Q, typename O>
__global__ void dequant_kernel(const Q* __restrict__ q, const float* __restrict__ scale,
                               const float* __restrict__ zp, O* __restrict__ out, int64_t cols,
                               int64_t group, int64_t ngr, int64_t n) {
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t g = (e / cols) * ngr + (e % cols) / group;
    const float qv = static_cast<float>(q[e]);
    const float v = zp ? (qv - zp[g]) * scale[g] : qv * scale[g];
    out[e] = from_f<O>(v);
  }
}

template <typename Q>
int dequant_out(const void* q, const float* scale, const float* zp, void* out, int out_dtype,
                int64_t cols, int64_t group, int64_t ngr, int64_t n, cudaStream_t st) {
  const unsigned int b = blocks_for(n, kThreads * 4);
  const Q* qt = static_cast<const Q*>(q);
  if (out_dtype == 0) dequant_kernel<Q, float><<<b, kThreads, 0, st>>>(qt, scale, zp, static_cast<float*>(out), cols, group, ngr, n);
  else if (out_dtype == 1) dequant_kernel<Q, __nv_bfloat16><<<b, kThreads, 0, st>>>(qt, scale, zp, static_cast<__nv_bfloat16*>(out), cols, group, ngr, n);
  else dequant_kernel<Q, __half><<<b, kThreads, 0, st>>>(qt, scale, zp, static_cast<__half*>(out), cols, group, ngr, n);
  return status();
}

template <typename T>
__global__ void ste_kernel(const T* __restrict__ g, const bool* __restrict__ m, T* __restrict__ out, int64_t n) {
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[e] = from_f<T>(to_f(g[e]) * (m[e] ? 1.0f : 0.0f));
  }
}

// ---- given scales / zero points, and the LSQ backward ------------------------------------------------

template <typename T, bool STOCH, bool ADD_ZP>
__global__ void params_elements(const T* __restrict__ x, Geo geo, qc_cuda_quant_args a,
                                const float* __restrict__ scale, const float* __restrict__ zpv,
                                T* __restrict__ y, bool* __restrict__ mask, int64_t n) {
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t g = (e / geo.cols) * geo.ngr + (e % geo.cols) / geo.group;
    const float s = scale[g], zp = ADD_ZP ? zpv[g] : 0.0f;
    float u = 0.0f;
    if (STOCH) u = uniform(rng_key(a.seed, static_cast<uint32_t>(e >> 32)), static_cast<uint32_t>(e));
    const float r = int_code<float, STOCH, false, false, ADD_ZP>(to_f(x[e]), s, 0.0f, zp, u);
    if (mask) mask[e] = inside_range(r, a.qmin, a.qmax);
    if (y) y[e] = from_f_sat<T>(dequant_code<float, false, ADD_ZP>(clamp_code(r, a.qmin, a.qmax), s, 0.0f, zp));
  }
}

struct LsqPartial {
  double s, z;
};

// One warp per segment of kSeg elements of a group: grad_x and the segment's partial sums.
template <typename T, typename G, bool STOCH, bool ADD_ZP>
__global__ void lsq_segments(const T* __restrict__ x, const G* __restrict__ grad, Geo geo, qc_cuda_quant_args a,
                             const float* __restrict__ scale, const float* __restrict__ zpv,
                             G* __restrict__ grad_x, LsqPartial* __restrict__ part, int64_t segments) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  for (int64_t sg = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32; sg < segments;
       sg += warps) {
    const int64_t g = sg / geo.spg, k = sg % geo.spg;
    const int64_t cnt = geo.count(g);
    const int64_t b = k * kSeg;
    const int64_t e = (b + kSeg < cnt) ? b + kSeg : cnt;
    const int64_t base = geo.start(g);
    const float s = scale[g], zp = ADD_ZP ? zpv[g] : 0.0f;
    double as = 0.0, az = 0.0;
    for (int64_t i = b + lane; i < e; i += 32) {
      const int64_t idx = base + i;
      const float xv = to_f(x[idx]), gv = to_f(grad[idx]);
      const float v = xv / s;
      float u = 0.0f;
      if (STOCH) u = uniform(rng_key(a.seed, static_cast<uint32_t>(idx >> 32)), static_cast<uint32_t>(idx));
      const float r = round_code<float, STOCH, false>(v, u);
      const float rz = ADD_ZP ? r + zp : r;
      const bool below = rz < a.qmin, above = rz > a.qmax;
      const bool inside = !(below || above);
      const float ds = inside ? r - v : (below ? a.qmin - zp : a.qmax - zp);
      as += static_cast<double>(gv) * static_cast<double>(ds);
      if (!inside) az += static_cast<double>(gv) * static_cast<double>(-s);
      grad_x[idx] = from_f<G>(gv * (inside ? 1.0f : 0.0f));
    }
    as = warp_sum(as);
    az = warp_sum(az);
    if (lane == 0) part[sg] = LsqPartial{as, az};
  }
}

__global__ void lsq_combine(Geo geo, const LsqPartial* __restrict__ part, float* __restrict__ gs,
                            float* __restrict__ gz, int64_t groups) {
  for (int64_t g = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; g < groups;
       g += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    double ts = 0.0, tz = 0.0;
    for (int64_t k = 0; k < geo.spg; ++k) {
      ts += part[g * geo.spg + k].s;
      tz += part[g * geo.spg + k].z;
    }
    gs[g] = static_cast<float>(ts);
    if (gz) gz[g] = static_cast<float>(tz);
  }
}

template <typename T>
void launch_params(const qc_cuda_quant_args* a, const void* x, const float* scale, const float* zp, void* y,
                   bool* mask, cudaStream_t st) {
  const Geo geo = make_geo(a);
  const int64_t n = a->rows * a->cols;
  const unsigned int b = blocks_for(n, kThreads * 4);
  const T* xt = static_cast<const T*>(x);
  T* yt = static_cast<T*>(y);
  const bool sto = a->rounding == kStochastic;
  if (zp) {
    if (sto) params_elements<T, true, true><<<b, kThreads, 0, st>>>(xt, geo, *a, scale, zp, yt, mask, n);
    else params_elements<T, false, true><<<b, kThreads, 0, st>>>(xt, geo, *a, scale, zp, yt, mask, n);
  } else {
    if (sto) params_elements<T, true, false><<<b, kThreads, 0, st>>>(xt, geo, *a, scale, zp, yt, mask, n);
    else params_elements<T, false, false><<<b, kThreads, 0, st>>>(xt, geo, *a, scale, zp, yt, mask, n);
  }
}

template <typename T, typename G>
void launch_lsq(const qc_cuda_quant_args* a, const void* x, const void* grad, const float* scale, const float* zp,
                void* grad_x, float* gs, float* gz, void* ws, cudaStream_t st) {
  const Geo geo = make_geo(a);
  const int64_t groups = geo.rows * geo.ngr;
  const int64_t segments = groups * geo.spg;
  LsqPartial* part = static_cast<LsqPartial*>(ws);
  const unsigned int b = blocks_for(segments, kThreads / 32);
  const T* xt = static_cast<const T*>(x);
  const G* gt = static_cast<const G*>(grad);
  G* gx = static_cast<G*>(grad_x);
  const bool sto = a->rounding == kStochastic;
  if (zp) {
    if (sto) lsq_segments<T, G, true, true><<<b, kThreads, 0, st>>>(xt, gt, geo, *a, scale, zp, gx, part, segments);
    else lsq_segments<T, G, false, true><<<b, kThreads, 0, st>>>(xt, gt, geo, *a, scale, zp, gx, part, segments);
  } else {
    if (sto) lsq_segments<T, G, true, false><<<b, kThreads, 0, st>>>(xt, gt, geo, *a, scale, zp, gx, part, segments);
    else lsq_segments<T, G, false, false><<<b, kThreads, 0, st>>>(xt, gt, geo, *a, scale, zp, gx, part, segments);
  }
  lsq_combine<<<blocks_for(groups, kThreads), kThreads, 0, st>>>(geo, part, gs, gz, groups);
}

template <typename T>
void launch_lsq_g(const qc_cuda_quant_args* a, const void* x, const void* grad, int g_dtype, const float* scale,
                  const float* zp, void* grad_x, float* gs, float* gz, void* ws, cudaStream_t st) {
  if (g_dtype == 0) launch_lsq<T, float>(a, x, grad, scale, zp, grad_x, gs, gz, ws, st);
  else if (g_dtype == 1) launch_lsq<T, __nv_bfloat16>(a, x, grad, scale, zp, grad_x, gs, gz, ws, st);
  else launch_lsq<T, __half>(a, x, grad, scale, zp, grad_x, gs, gz, ws, st);
}

}  // namespace
}  // namespace cuda
}  // namespace qc

extern "C" int qc_cuda_fake_quant_params(const qc_cuda_quant_args* a, const void* x, int x_dtype, const float* scale,
                                         const float* zp, void* y, bool* mask, void* stream) {
  using namespace qc::cuda;
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  if (a->rows * a->cols == 0) return 0;
  if (x_dtype == 0) launch_params<float>(a, x, scale, zp, y, mask, st);
  else if (x_dtype == 1) launch_params<__nv_bfloat16>(a, x, scale, zp, y, mask, st);
  else launch_params<__half>(a, x, scale, zp, y, mask, st);
  return status();
}

extern "C" size_t qc_cuda_lsq_workspace(const qc_cuda_quant_args* a) {
  const qc::cuda::Geo geo = qc::cuda::make_geo(a);
  return static_cast<size_t>(geo.rows * geo.ngr * geo.spg) * sizeof(qc::cuda::LsqPartial);
}

extern "C" int qc_cuda_lsq_backward(const qc_cuda_quant_args* a, const void* x, int x_dtype, const void* grad,
                                    int g_dtype, const float* scale, const float* zp, void* grad_x, float* gs,
                                    float* gz, void* workspace, void* stream) {
  using namespace qc::cuda;
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  if (a->rows * a->cols == 0) return 0;
  if (x_dtype == 0) launch_lsq_g<float>(a, x, grad, g_dtype, scale, zp, grad_x, gs, gz, workspace, st);
  else if (x_dtype == 1) launch_lsq_g<__nv_bfloat16>(a, x, grad, g_dtype, scale, zp, grad_x, gs, gz, workspace, st);
  else launch_lsq_g<__half>(a, x, grad, g_dtype, scale, zp, grad_x, gs, gz, workspace, st);
  return status();
}

extern "C" size_t qc_cuda_quant_workspace(const qc_cuda_quant_args* a) {
  const qc::cuda::Geo geo = qc::cuda::make_geo(a);
  const int64_t groups = geo.rows * geo.ngr;
  return static_cast<size_t>(groups * geo.spg) * sizeof(qc::cuda::Partial) +
         static_cast<size_t>(groups) * sizeof(float);
}

extern "C" int qc_cuda_quant(const qc_cuda_quant_args* a, const void* x, int x_dtype, void* y, bool* mask,
                             void* q, int q_dtype, float* scale, float* zp, void* workspace, int* bad,
                             void* stream) {
  using namespace qc::cuda;
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  if (a->rows * a->cols == 0 && a->group == 0) return 0;
  if (a->kind == qc::kInt && a->range != nullptr) {
    const Geo geo = make_geo(a);
    const int64_t segments = geo.rows * geo.ngr * geo.spg;
    neutral_partials<<<blocks_for(segments, kThreads), kThreads, 0, st>>>(static_cast<Partial*>(workspace), segments);
  }
  if (x_dtype == 0) run_quant<float>(a, x, y, mask, q, q_dtype, scale, zp, workspace, bad, st);
  else if (x_dtype == 1) run_quant<__nv_bfloat16>(a, x, y, mask, q, q_dtype, scale, zp, workspace, bad, st);
  else run_quant<__half>(a, x, y, mask, q, q_dtype, scale, zp, workspace, bad, st);
  return status();
}

extern "C" int qc_cuda_dequantize(const void* q, int q_dtype, const float* scale, const float* zp, void* out,
                                  int out_dtype, int64_t rows, int64_t cols, int64_t group, void* stream) {
  using namespace qc::cuda;
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  const int64_t n = rows * cols;
  if (n == 0) return 0;
  int64_t ngr = (cols + group - 1) / group;
  if (ngr < 1) ngr = 1;
  if (q_dtype == 0) return dequant_out<int8_t>(q, scale, zp, out, out_dtype, cols, group, ngr, n, st);
  return dequant_out<int32_t>(q, scale, zp, out, out_dtype, cols, group, ngr, n, st);
}

extern "C" int qc_cuda_ste_backward(const void* grad, int dtype, const bool* mask, void* out, int64_t n,
                                    void* stream) {
  using namespace qc::cuda;
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  if (n == 0) return 0;
  const unsigned int b = blocks_for(n, kThreads * 4);
  if (dtype == 0) ste_kernel<float><<<b, kThreads, 0, st>>>(static_cast<const float*>(grad), mask, static_cast<float*>(out), n);
  else if (dtype == 1) ste_kernel<__nv_bfloat16><<<b, kThreads, 0, st>>>(static_cast<const __nv_bfloat16*>(grad), mask, static_cast<__nv_bfloat16*>(out), n);
  else ste_kernel<__half><<<b, kThreads, 0, st>>>(static_cast<const __half*>(grad), mask, static_cast<__half*>(out), n);
  return status();
}
