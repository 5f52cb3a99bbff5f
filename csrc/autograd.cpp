// Autograd of the ops that have one: the straight-through estimator of fake_quant, for direct
// users of the op (qcompress's own layers call it inside their autograd Functions, with grad
// mode off). Registered here rather than from Python because a Python autograd kernel runs on
// every call, grad or not: about 5 us of a 10 us call on a small tensor (benchmarks/host_overhead.py).
#include <torch/autograd.h>
#include <torch/library.h>

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

c10::TypedOperatorHandle<std::tuple<at::Tensor, at::Tensor>(
    const at::Tensor&, const std::optional<at::Tensor>&, int64_t, int64_t, int64_t, int64_t, int64_t, bool,
    bool, int64_t, int64_t, bool)>&
fake_quant_op() {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("qcompress::fake_quant", "")
                       .typed<std::tuple<at::Tensor, at::Tensor>(
                           const at::Tensor&, const std::optional<at::Tensor>&, int64_t, int64_t, int64_t, int64_t,
                           int64_t, bool, bool, int64_t, int64_t, bool)>();
  return op;
}

// y = x^ passes the gradient through unchanged; the clip mask and the range get none.
struct FakeQuantSte : public torch::autograd::Function<FakeQuantSte> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const std::optional<at::Tensor>& range,
                               int64_t rows, int64_t cols, int64_t group, int64_t bits, int64_t kind,
                               bool symmetric, bool deepspeed, int64_t rounding, int64_t seed, bool with_mask) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto out = fake_quant_op().call(x, range, rows, cols, group, bits, kind, symmetric, deepspeed, rounding,
                                    seed, with_mask);
    ctx->mark_non_differentiable({std::get<1>(out)});
    return {std::get<0>(out), std::get<1>(out)};
  }

  static variable_list backward(AutogradContext*, variable_list grads) {
    variable_list out(12);
    out[0] = grads[0];
    return out;
  }
};

std::tuple<at::Tensor, at::Tensor> fake_quant_autograd(const at::Tensor& x, const std::optional<at::Tensor>& range,
                                                       int64_t rows, int64_t cols, int64_t group, int64_t bits,
                                                       int64_t kind, bool symmetric, bool deepspeed,
                                                       int64_t rounding, int64_t seed, bool with_mask) {
  auto out = FakeQuantSte::apply(x, range, rows, cols, group, bits, kind, symmetric, deepspeed, rounding, seed,
                                 with_mask);
  return {out[0], out[1]};
}

}  // namespace

TORCH_LIBRARY_IMPL(qcompress, Autograd, m) { m.impl("fake_quant", &fake_quant_autograd); }
