// Torch glue for the CUDA kernels: argument checks, output allocation, stream, and the NaN/Inf
// report. Compiled only in CUDA builds (csrc/build.py defines QC_WITH_CUDA); the kernels
// themselves are plain .cu files behind the C launchers in qcompress/cuda_launchers.h.
#ifdef QC_WITH_CUDA

#include <ATen/ATen.h>

#include <array>
#include <atomic>
#include <mutex>
#include <string>

#include "qcompress/check.h"
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "cpu/kernels.h"
#include "cpu/lowbit_gemm.h"
#include "qcompress/cuda_launchers.h"
#include "qcompress/lowbit.h"
#include "qcompress/math.h"

namespace qc {
namespace {

void* stream() { return static_cast<void*>(c10::cuda::getCurrentCUDAStream().stream()); }

void check_launch(int rc, const char* what) {
  QC_CHECK(rc == 0, "qcompress: CUDA launch of ", what, " failed with cudaError ", rc);
}

int float_code(at::ScalarType t) {
  if (t == at::kFloat) return 0;
  if (t == at::kBFloat16) return 1;
  if (t == at::kHalf) return 2;
  QC_CHECK(false, "qcompress: CUDA kernels take float32, bfloat16 or float16, got ", t);
}

qc_cuda_quant_args cuda_args(const QuantConfig& c, const std::optional<at::Tensor>& range, at::Tensor& range_dev) {
  qc_cuda_quant_args a;
  a.rows = c.rows;
  a.cols = c.cols;
  a.group = c.group;
  a.bits = c.bits;
  a.kind = c.kind;
  a.rounding = c.rounding;
  a.symmetric = c.symmetric ? 1 : 0;
  a.deepspeed = c.deepspeed ? 1 : 0;
  a.seed = c.seed;
  a.qmin = c.qmin;
  a.qmax = c.qmax;
  a.range = nullptr;
  if (range.has_value()) {
    range_dev = range->to(at::kCUDA, at::kFloat).contiguous();
    a.range = range_dev.data_ptr<float>();
  }
  return a;
}

// NaN/Inf report. Reading the kernel's count back is a device sync, and one per quantizer call
// stalled the GPU: a QAT step took a multiple of FP32's (benchmarks/results/gpu.md). So by default the kernels add their count to a per-device counter that
// `cuda_nonfinite_take` reads (qcompress.quant.kernels.check_nonfinite: once per
// CompressionScheduler.step, at export, after an evaluation); `cuda_sync_checks(true)` restores
// the check per call.
std::atomic<bool> g_sync_checks{false};
std::mutex g_pending_mutex;
std::array<at::Tensor, 64> g_pending;

int* pending_counter(const at::Tensor& x) {
  const int dev = x.get_device();
  QC_CHECK(dev >= 0 && dev < 64, "qcompress: CUDA device index ", dev, " out of range");
  std::lock_guard<std::mutex> lock(g_pending_mutex);
  if (!g_pending[dev].defined()) g_pending[dev] = at::zeros({1}, x.options().dtype(at::kInt));
  return g_pending[dev].mutable_data_ptr<int>();
}

bool cuda_sync_checks(bool on) { return g_sync_checks.exchange(on); }

int64_t cuda_nonfinite_take(int64_t device) {
  at::Tensor t;
  {
    std::lock_guard<std::mutex> lock(g_pending_mutex);
    if (device < 0 || device >= 64 || !g_pending[device].defined()) return 0;
    t = g_pending[device];
  }
  c10::cuda::CUDAGuard guard(t.device());
  const int64_t n = t.item<int>();     // the one sync
  if (n) t.zero_();
  return n;
}

// Runs the quantizer; any of y/mask/q may be undefined. NaN/Inf groups: raised here (one sync)
// in sync mode, else counted for cuda_nonfinite_take.
void run(const at::Tensor& x, const QuantConfig& c, const std::optional<at::Tensor>& range, at::Tensor* y,
         at::Tensor* mask, at::Tensor* q, at::Tensor* scale, at::Tensor* zp) {
  at::Tensor range_dev;
  qc_cuda_quant_args a = cuda_args(c, range, range_dev);
  const int64_t groups = c.rows * c.groups_per_row();
  at::Tensor sc = scale ? *scale : at::empty({groups}, x.options().dtype(at::kFloat));
  at::Tensor z = zp ? *zp : at::empty({groups}, x.options().dtype(at::kFloat));
  at::Tensor ws = at::empty({static_cast<int64_t>(qc_cuda_quant_workspace(&a))}, x.options().dtype(at::kByte));
  const bool sync = g_sync_checks.load();
  at::Tensor bad = sync ? at::zeros({1}, x.options().dtype(at::kInt)) : at::Tensor();
  const int qcode = (q && q->scalar_type() == at::kInt) ? 1 : 0;
  check_launch(qc_cuda_quant(&a, x.const_data_ptr(), float_code(x.scalar_type()),
                             (y && y->defined()) ? y->mutable_data_ptr() : nullptr,
                             (mask && mask->defined() && mask->numel()) ? mask->mutable_data_ptr<bool>() : nullptr,
                             q ? q->mutable_data_ptr() : nullptr, qcode, sc.mutable_data_ptr<float>(),
                             z.mutable_data_ptr<float>(), ws.mutable_data_ptr(),
                             sync ? bad.mutable_data_ptr<int>() : pending_counter(x), stream()),
               "quantize");
  if (!sync) return;
  const int nbad = bad.item<int>();
  QC_CHECK(nbad == 0, kNonFiniteTag, nbad, " of ", groups,
           " quantization groups contain NaN or Inf values; fix the input before quantizing");
}

std::tuple<at::Tensor, at::Tensor> fake_quant_cuda(const at::Tensor& x_, const std::optional<at::Tensor>& range,
                                                   int64_t rows, int64_t cols, int64_t group, int64_t bits,
                                                   int64_t kind, bool symmetric, bool deepspeed, int64_t rounding,
                                                   int64_t seed, bool with_mask) {
  c10::cuda::CUDAGuard guard(x_.device());
  const QuantConfig c = make_config(x_, range, rows, cols, group, bits, kind, symmetric, deepspeed, rounding, seed);
  at::Tensor x = x_.contiguous();
  at::Tensor y = at::empty_like(x, at::MemoryFormat::Contiguous);
  at::Tensor mask = at::empty(with_mask ? x.sizes() : at::IntArrayRef{0}, x.options().dtype(at::kBool));
  if (c.group == 0 || c.rows == 0) return {y, mask};
  run(x, c, range, &y, &mask, nullptr, nullptr, nullptr);
  return {y, mask};
}

// quantize's codes, scales and zero points, and with `values` fake_quant's values from the same pass
// (else an undefined tensor in their place).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_maybe_values(
    const at::Tensor& x_, const std::optional<at::Tensor>& range, int64_t rows, int64_t cols, int64_t group,
    int64_t bits, int64_t kind, bool symmetric, bool deepspeed, int64_t rounding, int64_t seed, bool values) {
  c10::cuda::CUDAGuard guard(x_.device());
  const QuantConfig c = make_config(x_, range, rows, cols, group, bits, kind, symmetric, deepspeed, rounding, seed);
  at::Tensor x = x_.contiguous();
  const int64_t groups = c.rows * c.groups_per_row();
  const bool small = c.qmin >= -128.0f && c.qmax <= 127.0f;
  at::Tensor q = at::empty(x.sizes(), x.options().dtype(small ? at::kChar : at::kInt));
  at::Tensor y = values ? at::empty_like(x, at::MemoryFormat::Contiguous) : at::Tensor();
  at::Tensor scale = at::full({groups}, kEps, x.options().dtype(at::kFloat));
  at::Tensor zp = at::zeros({groups}, x.options().dtype(at::kFloat));
  if (c.group == 0 || groups == 0) return {q, scale, zp.to(at::kInt), y};
  run(x, c, range, values ? &y : nullptr, nullptr, &q, &scale, &zp);
  return {q, scale, zp.to(at::kInt), y};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_cuda(const at::Tensor& x, const std::optional<at::Tensor>& range,
                                                             int64_t rows, int64_t cols, int64_t group, int64_t bits,
                                                             int64_t kind, bool symmetric, bool deepspeed,
                                                             int64_t rounding, int64_t seed) {
  auto [q, scale, zp, y] =
      quantize_maybe_values(x, range, rows, cols, group, bits, kind, symmetric, deepspeed, rounding, seed, false);
  return {q, scale, zp};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_values_cuda(
    const at::Tensor& x, const std::optional<at::Tensor>& range, int64_t rows, int64_t cols, int64_t group,
    int64_t bits, int64_t kind, bool symmetric, bool deepspeed, int64_t rounding, int64_t seed) {
  return quantize_maybe_values(x, range, rows, cols, group, bits, kind, symmetric, deepspeed, rounding, seed, true);
}

at::Tensor dequantize_cuda(const at::Tensor& q_, const at::Tensor& scale_, const std::optional<at::Tensor>& zp_,
                           int64_t rows, int64_t cols, int64_t group, at::ScalarType dtype) {
  c10::cuda::CUDAGuard guard(q_.device());
  check_dequant_args(q_, scale_, zp_, rows, cols, group);
  at::Tensor q = q_.scalar_type() == at::kChar || q_.scalar_type() == at::kInt ? q_.contiguous()
                                                                                 : q_.to(at::kInt).contiguous();
  at::Tensor scale = scale_.contiguous();
  at::Tensor zp = zp_.has_value() ? zp_->contiguous() : at::Tensor();
  const at::ScalarType kdt = dtype == at::kDouble ? at::kFloat : dtype;
  at::Tensor out = at::empty(q.sizes(), q.options().dtype(kdt));
  if (q.numel()) {
    check_launch(qc_cuda_dequantize(q.const_data_ptr(), q.scalar_type() == at::kChar ? 0 : 1,
                                    scale.const_data_ptr<float>(), zp.defined() ? zp.const_data_ptr<float>() : nullptr,
                                    out.mutable_data_ptr(), float_code(kdt), rows, cols, group, stream()),
                 "dequantize");
  }
  return dtype == at::kDouble ? out.to(at::kDouble) : out;
}

at::Tensor ste_backward_cuda(const at::Tensor& grad_, const at::Tensor& mask_) {
  c10::cuda::CUDAGuard guard(grad_.device());
  QC_CHECK(mask_.scalar_type() == at::kBool && grad_.sizes() == mask_.sizes(),
              "qcompress.ste_backward: mask must be bool and shaped like grad");
  if (grad_.scalar_type() == at::kDouble) return grad_ * mask_.to(at::kDouble);
  at::Tensor grad = grad_.contiguous(), mask = mask_.contiguous();
  at::Tensor out = at::empty_like(grad, at::MemoryFormat::Contiguous);
  check_launch(qc_cuda_ste_backward(grad.const_data_ptr(), float_code(grad.scalar_type()), mask.const_data_ptr<bool>(),
                                    out.mutable_data_ptr(), grad.numel(), stream()),
               "ste_backward");
  return out;
}

void check_params_cuda(const at::Tensor& x, const at::Tensor& scale, const std::optional<at::Tensor>& zp,
                       const QuantConfig& c, const char* op) {
  const int64_t G = c.group > 0 ? c.rows * c.groups_per_row() : 0;
  QC_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == G && scale.device() == x.device(),
              op, ": expected ", G, " float32 scales on ", x.device());
  if (zp.has_value()) {
    QC_CHECK(zp->scalar_type() == at::kFloat && zp->numel() == G && zp->device() == x.device(),
                op, ": expected ", G, " float32 zero points on ", x.device());
  }
}

std::tuple<at::Tensor, at::Tensor> fake_quant_params_cuda(const at::Tensor& x_, const at::Tensor& scale_,
                                                          const std::optional<at::Tensor>& zp_, int64_t rows,
                                                          int64_t cols, int64_t group, int64_t bits, int64_t rounding,
                                                          int64_t seed, bool with_mask) {
  c10::cuda::CUDAGuard guard(x_.device());
  const QuantConfig c = make_config(x_, std::nullopt, rows, cols, group, bits, kInt, !zp_.has_value(), false,
                                    rounding, seed);
  check_params_cuda(x_, scale_, zp_, c, "qcompress::fake_quant_params");
  at::Tensor x = x_.contiguous(), scale = scale_.contiguous();
  at::Tensor zp = zp_.has_value() ? zp_->contiguous() : at::Tensor();
  at::Tensor y = at::empty_like(x, at::MemoryFormat::Contiguous);
  at::Tensor mask = at::empty(with_mask ? x.sizes() : at::IntArrayRef{0}, x.options().dtype(at::kBool));
  if (c.group == 0 || c.rows == 0 || x.numel() == 0) return {y, mask};
  at::Tensor unused;
  qc_cuda_quant_args a = cuda_args(c, std::nullopt, unused);
  check_launch(qc_cuda_fake_quant_params(&a, x.const_data_ptr(), float_code(x.scalar_type()),
                                         scale.const_data_ptr<float>(), zp.defined() ? zp.const_data_ptr<float>() : nullptr,
                                         y.mutable_data_ptr(), with_mask ? mask.mutable_data_ptr<bool>() : nullptr,
                                         stream()),
               "fake_quant_params");
  return {y, mask};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> lsq_backward_cuda(const at::Tensor& grad_, const at::Tensor& x_,
                                                                 const at::Tensor& scale_,
                                                                 const std::optional<at::Tensor>& zp_, int64_t rows,
                                                                 int64_t cols, int64_t group, int64_t bits,
                                                                 int64_t rounding, int64_t seed) {
  c10::cuda::CUDAGuard guard(x_.device());
  const QuantConfig c = make_config(x_, std::nullopt, rows, cols, group, bits, kInt, !zp_.has_value(), false,
                                    rounding, seed);
  check_params_cuda(x_, scale_, zp_, c, "qcompress::lsq_backward");
  QC_CHECK(grad_.sizes() == x_.sizes() && grad_.device() == x_.device(),
              "qcompress::lsq_backward: grad must be shaped like x, on its device");
  at::Tensor x = x_.contiguous(), grad = grad_.contiguous(), scale = scale_.contiguous();
  at::Tensor zp = zp_.has_value() ? zp_->contiguous() : at::Tensor();
  const int64_t G = c.group > 0 ? c.rows * c.groups_per_row() : 0;
  at::Tensor grad_x = at::empty_like(grad, at::MemoryFormat::Contiguous);
  at::Tensor gs = at::zeros({G}, x.options().dtype(at::kFloat));
  at::Tensor gz = at::zeros({zp.defined() ? G : 0}, x.options().dtype(at::kFloat));
  if (c.group == 0 || G == 0 || x.numel() == 0) return {grad_x, gs, gz};
  at::Tensor unused;
  qc_cuda_quant_args a = cuda_args(c, std::nullopt, unused);
  at::Tensor ws = at::empty({static_cast<int64_t>(qc_cuda_lsq_workspace(&a))}, x.options().dtype(at::kByte));
  check_launch(qc_cuda_lsq_backward(&a, x.const_data_ptr(), float_code(x.scalar_type()), grad.const_data_ptr(),
                                    float_code(grad.scalar_type()), scale.const_data_ptr<float>(),
                                    zp.defined() ? zp.const_data_ptr<float>() : nullptr, grad_x.mutable_data_ptr(),
                                    gs.mutable_data_ptr<float>(), zp.defined() ? gz.mutable_data_ptr<float>() : nullptr,
                                    ws.mutable_data_ptr(), stream()),
               "lsq_backward");
  return {grad_x, gs, gz};
}

at::Tensor pack_int32_cuda(const at::Tensor& q_, int64_t bits) {
  c10::cuda::CUDAGuard guard(q_.device());
  QC_CHECK(bits == 1 || bits == 2 || bits == 4 || bits == 8, "qcompress.pack_int32: bits must be 1, 2, 4 or 8");
  QC_CHECK(q_.dim() >= 1 && !q_.is_floating_point(), "qcompress.pack_int32: expected integer codes");
  // int8 keeps the low 8 bits, all that the b <= 8 bit fields depend on
  at::Tensor q = q_.to(at::kChar).contiguous();
  const int64_t per = 32 / bits, k = q.size(-1), rows = k ? q.numel() / k : 0;
  std::vector<int64_t> shape(q.sizes().begin(), q.sizes().end());
  shape.back() = (k + per - 1) / per;
  at::Tensor out = at::empty(shape, q.options().dtype(at::kInt));
  check_launch(qc_cuda_pack_int32(q.const_data_ptr<int8_t>(), out.mutable_data_ptr<int32_t>(), rows, k,
                                  static_cast<int>(bits), stream()),
               "pack_int32");
  return out;
}

at::Tensor unpack_int32_cuda(const at::Tensor& p_, int64_t bits, int64_t length) {
  c10::cuda::CUDAGuard guard(p_.device());
  QC_CHECK(bits == 1 || bits == 2 || bits == 4 || bits == 8, "qcompress.unpack_int32: bits must be 1, 2, 4 or 8");
  QC_CHECK(p_.scalar_type() == at::kInt && p_.dim() >= 1, "qcompress.unpack_int32: expected int32 words");
  at::Tensor p = p_.contiguous();
  const int64_t words = p.size(-1), rows = words ? p.numel() / words : 0;
  QC_CHECK(length >= 0 && length <= words * (32 / bits), "qcompress.unpack_int32: length too large");
  std::vector<int64_t> shape(p.sizes().begin(), p.sizes().end());
  shape.back() = length;
  at::Tensor out = at::empty(shape, p.options().dtype(at::kChar));
  check_launch(qc_cuda_unpack_int32(p.const_data_ptr<int32_t>(), out.mutable_data_ptr<int8_t>(), rows, words, length,
                                    static_cast<int>(bits), stream()),
               "unpack_int32");
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> onebit_compress_cuda(const at::Tensor& x_, const at::Tensor& e_) {
  c10::cuda::CUDAGuard guard(x_.device());
  QC_CHECK(x_.numel() == e_.numel() && x_.numel() % 8 == 0 && e_.scalar_type() == at::kFloat,
              "qcompress.onebit_compress: x and float32 error must have the same multiple-of-8 size");
  at::Tensor x = x_.contiguous().reshape(-1), err = e_.contiguous().reshape(-1);
  const int64_t n = x.numel();
  at::Tensor packed = at::empty({n / 8}, x.options().dtype(at::kByte));
  at::Tensor scale = at::empty({}, x.options().dtype(at::kFloat));
  at::Tensor new_err = at::empty({n}, x.options().dtype(at::kFloat));
  at::Tensor ws = at::empty({static_cast<int64_t>(qc_cuda_onebit_workspace(n))}, x.options().dtype(at::kByte));
  check_launch(qc_cuda_onebit_compress(x.const_data_ptr(), float_code(x.scalar_type()), err.const_data_ptr<float>(),
                                       packed.mutable_data_ptr<uint8_t>(), scale.mutable_data_ptr<float>(),
                                       new_err.mutable_data_ptr<float>(), n, ws.mutable_data_ptr(), stream()),
               "onebit_compress");
  return {packed, scale, new_err};
}

at::Tensor onebit_decode_average_cuda(const at::Tensor& p_, const at::Tensor& s_) {
  c10::cuda::CUDAGuard guard(p_.device());
  QC_CHECK(p_.scalar_type() == at::kByte && p_.dim() == 2 && s_.scalar_type() == at::kFloat &&
                  s_.numel() == p_.size(0),
              "qcompress.onebit_decode_average: expected uint8 [P, m] and float32 [P]");
  at::Tensor p = p_.contiguous(), s = s_.contiguous();
  at::Tensor out = at::empty({8 * p.size(1)}, p.options().dtype(at::kFloat));
  check_launch(qc_cuda_onebit_decode_average(p.const_data_ptr<uint8_t>(), s.const_data_ptr<float>(),
                                             out.mutable_data_ptr<float>(), p.size(0), p.size(1), stream()),
               "onebit_decode_average");
  return out;
}

at::Tensor onebit_decode_cuda(const at::Tensor& p_, const at::Tensor& s_) {
  c10::cuda::CUDAGuard guard(p_.device());
  QC_CHECK(p_.scalar_type() == at::kByte && p_.dim() == 2 && s_.scalar_type() == at::kFloat &&
                  s_.numel() == p_.size(0),
              "qcompress.onebit_decode: expected uint8 [P, m] and float32 [P]");
  // rows may be strided (payload rows without their scale bytes); bytes within a row must not be
  at::Tensor p = p_.size(1) <= 1 || p_.stride(1) == 1 ? p_ : p_.contiguous();
  at::Tensor s = s_.contiguous();
  at::Tensor out = at::empty({p.size(0), 8 * p.size(1)}, p.options().dtype(at::kFloat));
  check_launch(qc_cuda_onebit_decode(p.const_data_ptr<uint8_t>(), p.size(0) > 1 ? p.stride(0) : p.size(1),
                                     s.const_data_ptr<float>(), out.mutable_data_ptr<float>(), p.size(0),
                                     p.size(1), stream()),
               "onebit_decode");
  return out;
}

// Low-bit matmuls (csrc/cuda/lowbit_gemm.cu) on the blocked layout the CPU prepack wrote.
at::Tensor lowbit_bias(const std::optional<at::Tensor>& bias, int64_t n, const at::Tensor& like) {
  if (!bias.has_value()) return at::Tensor();
  QC_CHECK(bias->numel() == n, "qcompress.lowbit: bias has ", bias->numel(), " elements, expected ", n);
  return bias->to(like.device(), at::kFloat).contiguous();
}

at::Tensor lowbit_linear_cuda(const at::Tensor& x_, const at::Tensor& packed, const at::Tensor& scales,
                              const std::optional<at::Tensor>& offsets, const std::optional<at::Tensor>& bias_,
                              int64_t n, int64_t group, int64_t cbits, c10::string_view act_name,
                              const std::optional<at::Tensor>& residual) {
  c10::cuda::CUDAGuard guard(x_.device());
  const int act = lowbit_act_code(act_name);
  QC_CHECK(x_.dim() >= 1 && x_.is_floating_point(), "qcompress.lowbit_linear: x must be a float tensor");
  const int64_t k = x_.size(-1);
  lowbit_check_weight(packed, scales, offsets, n, k, group, cbits);
  const bool dbl = x_.scalar_type() == at::kDouble;
  at::Tensor x = (dbl ? x_.to(at::kFloat) : x_).contiguous();
  const int64_t m = k ? x.numel() / k : 0;
  at::Tensor bias = lowbit_bias(bias_, n, x);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  at::Tensor y = at::empty(shape, x.options());
  const bool has_offs = offsets.has_value() && offsets->numel();
  check_launch(qc_cuda_lowbit_linear(x.const_data_ptr(), float_code(x.scalar_type()), packed.const_data_ptr<uint8_t>(),
                                     scales.const_data_ptr<float>(),
                                     has_offs ? offsets->const_data_ptr<uint8_t>() : nullptr,
                                     bias.defined() ? bias.const_data_ptr<float>() : nullptr, y.mutable_data_ptr(), m, n,
                                     k, group, static_cast<int>(cbits), stream()),
               "lowbit_linear");
  check_launch(qc_cuda_lowbit_act(y.mutable_data_ptr(), float_code(y.scalar_type()), y.numel(), act, stream()),
               "lowbit_linear (act)");
  if (residual.has_value()) {
    QC_CHECK(residual->sizes() == y.sizes(), "qcompress.lowbit_linear: residual has shape ", residual->sizes(),
                ", the output ", y.sizes());
    y.add_(*residual);
  }
  return dbl ? y.to(at::kDouble) : y;
}

at::Tensor lowbit_linear_a8_cuda(const at::Tensor& xq_, const at::Tensor& x_scale, const std::optional<at::Tensor>& x_zp,
                                 const at::Tensor& packed, const at::Tensor& scales,
                                 const std::optional<at::Tensor>& offsets, const std::optional<at::Tensor>& bias_,
                                 int64_t n, int64_t group, int64_t cbits, at::ScalarType out_dtype) {
  c10::cuda::CUDAGuard guard(xq_.device());
  QC_CHECK(xq_.dim() >= 1 && xq_.scalar_type() == at::kChar, "qcompress.lowbit_linear_a8: activation codes must be int8");
  const int64_t k = xq_.size(-1);
  lowbit_check_weight(packed, scales, offsets, n, k, group, cbits);
  at::Tensor xq = xq_.contiguous();
  const int64_t m = k ? xq.numel() / k : 0;
  auto per_token = [&](const at::Tensor& t, at::ScalarType dt, const char* what) {
    QC_CHECK(t.numel() == m || t.numel() == 1, "qcompress.lowbit_linear_a8: ", what, " has ", t.numel(),
                " elements, expected one per token (", m, ") or one");
    return t.reshape({-1}).to(xq.device(), dt).expand({m}).contiguous();
  };
  at::Tensor sx = per_token(x_scale, at::kFloat, "x_scale");
  at::Tensor zx = x_zp.has_value() ? per_token(*x_zp, at::kInt, "x_zero_point") : at::Tensor();
  at::Tensor bias = lowbit_bias(bias_, n, xq);
  const at::ScalarType kdt = out_dtype == at::kDouble ? at::kFloat : out_dtype;
  std::vector<int64_t> shape(xq.sizes().begin(), xq.sizes().end());
  shape.back() = n;
  at::Tensor y = at::empty(shape, xq.options().dtype(kdt));
  const bool has_offs = offsets.has_value() && offsets->numel();
  check_launch(qc_cuda_lowbit_linear_a8(xq.const_data_ptr<int8_t>(), sx.const_data_ptr<float>(),
                                        zx.defined() ? zx.const_data_ptr<int32_t>() : nullptr,
                                        packed.const_data_ptr<uint8_t>(), scales.const_data_ptr<float>(),
                                        has_offs ? offsets->const_data_ptr<uint8_t>() : nullptr,
                                        bias.defined() ? bias.const_data_ptr<float>() : nullptr, y.mutable_data_ptr(),
                                        float_code(kdt), m, n, k, group, static_cast<int>(cbits), stream()),
               "lowbit_linear_a8");
  return out_dtype == at::kDouble ? y.to(at::kDouble) : y;
}

}  // namespace
}  // namespace qc

TORCH_LIBRARY_FRAGMENT(qcompress, m) {
  m.def("cuda_sync_checks(bool on) -> bool", &qc::cuda_sync_checks);
  m.def("cuda_nonfinite_take(int device) -> int", &qc::cuda_nonfinite_take);
}

TORCH_LIBRARY_IMPL(qcompress, CUDA, m) {
  m.impl("fake_quant", &qc::fake_quant_cuda);
  m.impl("quantize", &qc::quantize_cuda);
  m.impl("quantize_values", &qc::quantize_values_cuda);
  m.impl("dequantize", &qc::dequantize_cuda);
  m.impl("ste_backward", &qc::ste_backward_cuda);
  m.impl("fake_quant_params", &qc::fake_quant_params_cuda);
  m.impl("lsq_backward", &qc::lsq_backward_cuda);
  m.impl("pack_int32", &qc::pack_int32_cuda);
  m.impl("unpack_int32", &qc::unpack_int32_cuda);
  m.impl("onebit_compress", &qc::onebit_compress_cuda);
  m.impl("onebit_decode_average", &qc::onebit_decode_average_cuda);
  m.impl("onebit_decode", &qc::onebit_decode_cuda);
  m.impl("lowbit_linear", &qc::lowbit_linear_cuda);
  m.impl("lowbit_linear_a8", &qc::lowbit_linear_a8_cuda);
}

#endif  // QC_WITH_CUDA
