// Per-layer elementwise work of the decoder fused into one pass each (CPU, float32).
//
// add_rms_norm(x, delta, w, eps, out): x += delta (in place), then out = x / rms(x) * w, row by
// row: the residual add and the next RMSNorm cost one read of x instead of six torch ops. The
// mean of squares is accumulated in float32, as transformers' LlamaRMSNorm does; the result
// equals it up to summation order. Compiled together with qmatmul.cpp (pagedkv/model/qkernel.py)
// and registered as torch.ops.pagedkv_ops.add_rms_norm.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>

namespace {

void add_rms_norm(at::Tensor& x, const at::Tensor& delta, const at::Tensor& w, double eps, at::Tensor& out) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x must be a contiguous float32 [T, H] tensor");
  TORCH_CHECK(delta.scalar_type() == at::kFloat && delta.sizes() == x.sizes() && delta.is_contiguous(),
              "delta must be a contiguous float32 tensor shaped like x");
  TORCH_CHECK(w.dim() == 1 && w.scalar_type() == at::kFloat && w.size(0) == x.size(1) && w.is_contiguous(),
              "w must be a contiguous float32 [H] tensor");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.sizes() == x.sizes() && out.is_contiguous(),
              "out must be a contiguous float32 tensor shaped like x");
  const int64_t T = x.size(0), H = x.size(1);
  float* xp = x.data_ptr<float>();
  const float* dp = delta.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      float* xr = xp + t * H;
      const float* dr = dp + t * H;
      float ss = 0.f;
      for (int64_t i = 0; i < H; ++i) {
        xr[i] += dr[i];
        ss += xr[i] * xr[i];
      }
      const float r = 1.0f / std::sqrt(ss / static_cast<float>(H) + feps);
      float* orow = op + t * H;
      for (int64_t i = 0; i < H; ++i) orow[i] = wp[i] * (xr[i] * r);
    }
  });
}

}  // namespace

TORCH_LIBRARY(pagedkv_ops, m) {
  m.def("add_rms_norm(Tensor(a!) x, Tensor delta, Tensor w, float eps, Tensor(b!) out) -> ()");
}

TORCH_LIBRARY_IMPL(pagedkv_ops, CPU, m) {
  m.impl("add_rms_norm", &add_rms_norm);
}
