// Operator schemas (declared once) and their CPU kernels. The CUDA kernels are registered in
// csrc/cuda_ops.cpp when the extension is built with CUDA, autograd in csrc/autograd.cpp; fake
// (meta) kernels are registered from Python in qcompress/quant/kernels.py.
#include <torch/library.h>

#include "cpu/float_gemv.h"
#include "cpu/kernels.h"
#include "cpu/lowbit_gemm.h"

TORCH_LIBRARY(qcompress, m) {
  // x viewed as [rows, cols], groups of `group` along cols; kind 0 int / 1 binary / 2 ternary;
  // rounding 0 nearest / 1 stochastic; range: optional float32 [min, max] (static range).
  m.def("fake_quant(Tensor x, Tensor? range, int rows, int cols, int group, int bits, int kind, "
        "bool symmetric, bool deepspeed, int rounding, int seed, bool with_mask) -> (Tensor, Tensor)");
  m.def("quantize(Tensor x, Tensor? range, int rows, int cols, int group, int bits, int kind, "
        "bool symmetric, bool deepspeed, int rounding, int seed) -> (Tensor, Tensor, Tensor)");
  // quantize's codes, scales and zero points and fake_quant's values (x's dtype) from one pass over x
  m.def("quantize_values(Tensor x, Tensor? range, int rows, int cols, int group, int bits, int kind, "
        "bool symmetric, bool deepspeed, int rounding, int seed) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("dequantize(Tensor q, Tensor scale, Tensor? zero_point, int rows, int cols, int group, "
        "ScalarType dtype) -> Tensor");
  m.def("ste_backward(Tensor grad, Tensor mask) -> Tensor");
  // Integer fake-quant with given float32 [groups] scales (and zero points: asymmetric when
  // present), default numerics; and its LSQ backward: (grad_x, sum grad * dx^/ds, sum grad * dx^/dz).
  m.def("fake_quant_params(Tensor x, Tensor scale, Tensor? zero_point, int rows, int cols, int group, "
        "int bits, int rounding, int seed, bool with_mask) -> (Tensor, Tensor)");
  m.def("lsq_backward(Tensor grad, Tensor x, Tensor scale, Tensor? zero_point, int rows, int cols, "
        "int group, int bits, int rounding, int seed) -> (Tensor, Tensor, Tensor)");
  // The mse observer's search (CPU): float64 [K, groups] squared errors of K candidate grids, or
  // with float64 moments the input-weighted errors d^T M d (observer_kwargs.weight_by: inputs).
  m.def("mse_errors(Tensor x, Tensor scales, Tensor? zero_points, int rows, int cols, int group, "
        "int bits, Tensor? moments=None) -> Tensor");
  // Its least-squares refinement of symmetric scales: (<q, x>, <q, q>, <d, d>) per group, float64.
  m.def("mse_refine_terms(Tensor x, Tensor scales, int rows, int cols, int group, int bits, "
        "Tensor? moments=None) -> (Tensor, Tensor, Tensor)");
  m.def("pack_int32(Tensor q, int bits) -> Tensor");
  m.def("unpack_int32(Tensor packed, int bits, int length) -> Tensor");
  m.def("onebit_compress(Tensor x, Tensor error) -> (Tensor, Tensor, Tensor)");
  m.def("onebit_decode_average(Tensor packed, Tensor scales) -> Tensor");
  m.def("onebit_decode(Tensor packed, Tensor scales) -> Tensor");  // [P, m] -> [P, 8m], row r = sign * s_r
  // fused low-bit matmuls of load_quantized(mode="fast"): blocked layout of qcompress/lowbit.h
  m.def("lowbit_prepack(Tensor q, Tensor scale, Tensor? zero_point, int group, int cbits) "
        "-> (Tensor, Tensor, Tensor)");
  m.def("lowbit_unpack(Tensor packed, int n, int k, int group, int cbits) -> Tensor");
  // act: the activation after the layer, applied before the store ("none", "gelu", "gelu_tanh", "relu", "silu");
  // residual: a tensor of the output's shape added after it (a transformer block's skip connection)
  m.def("lowbit_linear(Tensor x, Tensor packed, Tensor scales, Tensor? offsets, Tensor? bias, int n, int group, "
        "int cbits, str act=\"none\", Tensor? residual=None) -> Tensor");
  m.def("lowbit_linear_a8(Tensor xq, Tensor x_scale, Tensor? x_zero_point, Tensor packed, Tensor scales, "
        "Tensor? offsets, Tensor? bias, int n, int group, int cbits, ScalarType out_dtype) -> Tensor");
  // dynamic per-token activation codes (the quantize op's) and lowbit_linear_a8 in one call
  m.def("lowbit_linear_dyn_a8(Tensor x, Tensor packed, Tensor scales, Tensor? offsets, Tensor? bias, int n, "
        "int group, int cbits, int abits, bool symmetric, int seed, str act=\"none\", Tensor? residual=None) -> Tensor");
  m.def("lowbit_isa(str request) -> str", &qc::lowbit_isa);
  // an unquantized layer at a few tokens (load_quantized(mode="fast")'s lm_head): float32 sums
  m.def("float_gemv(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(qcompress, CPU, m) {
  m.impl("fake_quant", &qc::fake_quant_cpu);
  m.impl("quantize", &qc::quantize_cpu);
  m.impl("quantize_values", &qc::quantize_values_cpu);
  m.impl("dequantize", &qc::dequantize_cpu);
  m.impl("ste_backward", &qc::ste_backward_cpu);
  m.impl("fake_quant_params", &qc::fake_quant_params_cpu);
  m.impl("lsq_backward", &qc::lsq_backward_cpu);
  m.impl("mse_errors", &qc::mse_errors_cpu);
  m.impl("mse_refine_terms", &qc::mse_refine_terms_cpu);
  m.impl("pack_int32", &qc::pack_int32_cpu);
  m.impl("unpack_int32", &qc::unpack_int32_cpu);
  m.impl("onebit_compress", &qc::onebit_compress_cpu);
  m.impl("onebit_decode_average", &qc::onebit_decode_average_cpu);
  m.impl("onebit_decode", &qc::onebit_decode_cpu);
  m.impl("lowbit_prepack", &qc::lowbit_prepack_cpu);
  m.impl("lowbit_unpack", &qc::lowbit_unpack_cpu);
  m.impl("lowbit_linear", &qc::lowbit_linear_cpu);
  m.impl("lowbit_linear_a8", &qc::lowbit_linear_a8_cpu);
  m.impl("lowbit_linear_dyn_a8", &qc::lowbit_linear_dyn_a8_cpu);
  m.impl("float_gemv", &qc::float_gemv_cpu);
}

// Importing qcompress._C registers the operators; the module itself has no functions.
#include <Python.h>

static struct PyModuleDef qc_module = {PyModuleDef_HEAD_INIT, "_C", "qcompress C++/CUDA operators", -1, nullptr};

PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&qc_module); }
