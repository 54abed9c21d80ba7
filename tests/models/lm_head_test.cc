// LmHeadCrossEntropy (src/models/lm_head.h) against autograd's
// cross_entropy(linear(h, w).float(), labels): the same loss and gradients, with
// ignored labels, in fp32 and bf16 (on the CPU bit for bit); on CUDA also through
// the aligned rows of a vocabulary that is not a multiple of 8.
#include <gtest/gtest.h>
#include <torch/cuda.h>
#include <torch/torch.h>

#include "models/lm_head.h"

namespace uckpt::models {
namespace {

struct Result {
  at::Tensor loss, grad_h, grad_w;
};

Result ForwardBackward(bool fused, at::ScalarType dtype, at::Device device, int64_t vocab) {
  at::manual_seed(11);
  const int64_t N = 37, C = 24;
  at::Tensor h = (at::randn({N, C}) * 3).to(dtype).to(device).requires_grad_();
  at::Tensor w = at::randn({vocab, C}).to(dtype).to(device).requires_grad_();
  at::Tensor labels = at::randint(0, vocab, {N}, at::kLong);
  labels.index_put_({at::tensor({2, 5, 30}, at::kLong)}, -100);  // ignored, as cross_entropy's default
  labels = labels.to(device);
  at::Tensor loss =
      fused ? LmHeadCrossEntropy(h, w, labels) : at::cross_entropy_loss(at::linear(h, w).to(at::kFloat), labels);
  (loss * 0.7).backward();
  return {loss.detach(), h.grad(), w.grad()};
}

// The gradients agree to within one rounding of the 16-bit dtype (fp32: a few
// ulps), which only the entries at the labels may take.
void ExpectSame(const Result& want, const Result& got, at::ScalarType dtype, double loss_tol) {
  EXPECT_EQ(got.loss.scalar_type(), at::kFloat);
  EXPECT_NEAR(got.loss.item<double>(), want.loss.item<double>(), loss_tol);
  EXPECT_EQ(got.grad_h.scalar_type(), dtype);
  EXPECT_EQ(got.grad_w.scalar_type(), dtype);
  EXPECT_EQ(got.grad_w.sizes(), want.grad_w.sizes());
  const double tol = dtype == at::kFloat ? 1e-6 : 1e-2;
  for (const auto& [a, b] : {std::pair{want.grad_h, got.grad_h}, std::pair{want.grad_w, got.grad_w}}) {
    const double rel =
        (a.to(at::kFloat) - b.to(at::kFloat)).norm().item<double>() / a.to(at::kFloat).norm().item<double>();
    EXPECT_LT(rel, tol);
  }
}

TEST(LmHeadCrossEntropy, IsAutogradsCrossEntropyOnTheCpu) {
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    SCOPED_TRACE(c10::toString(dtype));
    const Result want = ForwardBackward(false, dtype, at::kCPU, 50), got = ForwardBackward(true, dtype, at::kCPU, 50);
    EXPECT_TRUE(at::equal(got.loss, want.loss)) << got.loss.item<double>() << " vs " << want.loss.item<double>();
    ExpectSame(want, got, dtype, 0);
    // bf16 bit for bit; fp32 within ExpectSame's 1e-6 (PyTorch 2.x's CPU log-softmax backward
    // rounds differently from the one-pass gradient; on 1.13 both were bit for bit).
    if (dtype == at::kBFloat16) {
      EXPECT_TRUE(at::equal(got.grad_h, want.grad_h));
      EXPECT_TRUE(at::equal(got.grad_w, want.grad_w));
    }
    // Rows whose label is ignored give h no gradient.
    EXPECT_EQ(got.grad_h[2].abs().sum().item<double>(), 0.0);
  }
}

TEST(LmHeadCrossEntropy, AlignedRowsOnCudaGiveTheSameLossAndGradients) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "needs a GPU";
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
    SCOPED_TRACE(c10::toString(dtype));
    const Result want = ForwardBackward(false, dtype, at::kCUDA, 50257 % 64),
                 got = ForwardBackward(true, dtype, at::kCUDA, 50257 % 64);
    ExpectSame(want, got, dtype, 1e-5);
    const Result want_v = ForwardBackward(false, dtype, at::kCUDA, 1001),
                 got_v = ForwardBackward(true, dtype, at::kCUDA, 1001);
    ExpectSame(want_v, got_v, dtype, 1e-5);
  }
}

}  // namespace
}  // namespace uckpt::models
