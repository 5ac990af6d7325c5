// Per-layer elementwise work of the decoder fused into one pass each (CPU, float32).
//
// add_rms_norm(x, delta, w, eps, out): x += delta (in place), then out = x / rms(x) * w, row by
// row: the residual add and the next RMSNorm cost one read of x instead of six torch ops. The
// mean of squares is accumulated in float32, as transformers' LlamaRMSNorm does; the result
// equals it up to summation order. Compiled together with qmatmul.cpp (pagedkv/model/qkernel.py)
// and registered as torch.ops.pagedkv_ops.*.
//
// silu_mul(gu [T, 2I], out [T, I]): out = silu(gu[:, :I]) * gu[:, I:] (SwiGLU), one pass; with
//   AVX2, 8 at a time through exp8 (within ~1 ulp of expf; torch's own vectorized silu is not
//   bit-identical to expf either).
// gelu_tanh_mul(gu [T, 2I], out [T, I]): out = gelu_tanh(gu[:, :I]) * gu[:, I:] (GeGLU, Gemma),
//   one pass, with gelu_tanh(x) = 0.5 x (1 + tanh(y)) = x / (1 + e^(-2y)),
//   y = sqrt(2 / pi) (x + 0.044715 x^3), through exp8 as silu_mul.
// norm_add_rms_norm(x, delta, wd, w, eps, out): x += rms_norm(delta) * wd, then
//   out = rms_norm(x) * w (Gemma's output norm, residual add and the next input norm).
// argmax(x [R, V] f32, best [R] f32, idx [R] i64): per row the first maximum and its index, as
//   torch.max(x, dim=-1); a row holding NaN gives NaN (its first NaN), so "not finite" flags it
//   (the sampler fails such rows). torch's own reduction took ~1 ms for 40 x 49152 here.
// rope(x [T, H, D] rows of stride sx, cos [T, D], sin_signed [T, D], out [T, H, D] contiguous):
//   out = x * cos + flip_halves(x) * sin_signed (the HF rotate_half layout), one pass over the
//   q and k heads of a fused qkv row.
// norm_rope(x, w [H, D], eps, cos, sin_signed, out): rope of each head RMS-normed first
//   (n = x / rms(head) * w[h], the mean of squares accumulated in float32 as add_rms_norm's):
//   QK-norm (Qwen3, Gemma 3) and RoPE in one pass, where torch's rms_norm and mul_ took eight
//   ops a layer.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cmath>
#include <utility>
#include <vector>
#include <cstdint>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define FO_AVX2 1
#endif

namespace {

#ifdef FO_AVX2
// e^x for 8 floats, x clamped to [-87.3, 88.3] (2^n stays normal): x = n ln2 + r with
// |r| <= ln2 / 2 (Cody-Waite, ln2 in two parts), e^r by its degree-7 Taylor polynomial
// (truncation below 1e-8 relative), then times 2^n through the exponent bits.
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), r);
  __m256 p = _mm256_set1_ps(1.f / 5040.f);
  for (const float c : {1.f / 720.f, 1.f / 120.f, 1.f / 24.f, 1.f / 6.f, 0.5f, 1.f, 1.f})
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

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

void check_rows(const at::Tensor& x, const at::Tensor& delta, const at::Tensor& w, const at::Tensor& out) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x must be a contiguous float32 [T, H] tensor");
  TORCH_CHECK(delta.scalar_type() == at::kFloat && delta.sizes() == x.sizes() && delta.is_contiguous(),
              "delta must be a contiguous float32 tensor shaped like x");
  TORCH_CHECK(w.dim() == 1 && w.scalar_type() == at::kFloat && w.size(0) == x.size(1) && w.is_contiguous(),
              "w must be a contiguous float32 [H] tensor");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.sizes() == x.sizes() && out.is_contiguous(),
              "out must be a contiguous float32 tensor shaped like x");
}

// 1 / rms(row) with the mean of squares accumulated in float32
inline float inv_rms(const float* r, int64_t H, float eps) {
  float ss = 0.f;
  for (int64_t i = 0; i < H; ++i) ss += r[i] * r[i];
  return 1.0f / std::sqrt(ss / static_cast<float>(H) + eps);
}

void norm_add_rms_norm(at::Tensor& x, const at::Tensor& delta, const at::Tensor& wd, const at::Tensor& w,
                       double eps, at::Tensor& out) {
  check_rows(x, delta, w, out);
  TORCH_CHECK(wd.sizes() == w.sizes() && wd.scalar_type() == at::kFloat && wd.is_contiguous(),
              "wd must be a contiguous float32 [H] tensor");
  const int64_t T = x.size(0), H = x.size(1);
  float* xp = x.data_ptr<float>();
  const float* dp = delta.data_ptr<float>();
  const float* wdp = wd.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      float* xr = xp + t * H;
      const float* dr = dp + t * H;
      const float rd = inv_rms(dr, H, feps);
      for (int64_t i = 0; i < H; ++i) xr[i] += (dr[i] * rd) * wdp[i];
      const float r = inv_rms(xr, H, feps);
      float* orow = op + t * H;
      for (int64_t i = 0; i < H; ++i) orow[i] = (xr[i] * r) * wp[i];
    }
  });
}

// the arguments of a gated activation: gu [T, 2I] (gate, then up), out [T, I]; returns (T, I)
std::pair<int64_t, int64_t> check_gated(const at::Tensor& gu, const at::Tensor& out) {
  TORCH_CHECK(gu.dim() == 2 && gu.scalar_type() == at::kFloat && gu.is_contiguous() && gu.size(1) % 2 == 0,
              "gu must be a contiguous float32 [T, 2I] tensor");
  const int64_t T = gu.size(0), I = gu.size(1) / 2;
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.dim() == 2 &&
                  out.size(0) == T && out.size(1) == I,
              "out must be a contiguous float32 [T, I] tensor");
  return {T, I};
}

void gelu_tanh_mul(const at::Tensor& gu, at::Tensor& out) {
  const auto [T, I] = check_gated(gu, out);
  const float* g = gu.data_ptr<float>();
  float* o = out.data_ptr<float>();
  constexpr float kC = 0.7978845608028654f;  // sqrt(2 / pi)
  constexpr float kA = 0.044715f;
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* gr = g + t * 2 * I;
      const float* ur = gr + I;
      float* orow = o + t * I;
      int64_t i = 0;
#ifdef FO_AVX2
      const __m256 one = _mm256_set1_ps(1.f), m2c = _mm256_set1_ps(-2.f * kC), a = _mm256_set1_ps(kA);
      for (; i + 8 <= I; i += 8) {
        const __m256 x = _mm256_loadu_ps(gr + i);
        const __m256 x3 = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
        const __m256 e = exp8(_mm256_mul_ps(m2c, _mm256_fmadd_ps(a, x3, x)));  // e^(-2y)
        const __m256 s = _mm256_div_ps(x, _mm256_add_ps(one, e));
        _mm256_storeu_ps(orow + i, _mm256_mul_ps(s, _mm256_loadu_ps(ur + i)));
      }
#endif
      for (; i < I; ++i) {
        const float x = gr[i];
        orow[i] = x / (1.0f + std::exp(-2.f * kC * (x + kA * x * x * x))) * ur[i];
      }
    }
  });
}

void silu_mul(const at::Tensor& gu, at::Tensor& out) {
  const auto [T, I] = check_gated(gu, out);
  const float* g = gu.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* gr = g + t * 2 * I;
      const float* ur = gr + I;
      float* orow = o + t * I;
      int64_t i = 0;
#ifdef FO_AVX2
      const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
      for (; i + 8 <= I; i += 8) {
        const __m256 g = _mm256_loadu_ps(gr + i);
        const __m256 s = _mm256_div_ps(g, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, g))));
        _mm256_storeu_ps(orow + i, _mm256_mul_ps(s, _mm256_loadu_ps(ur + i)));
      }
#endif
      for (; i < I; ++i) orow[i] = gr[i] / (1.0f + std::exp(-gr[i])) * ur[i];
    }
  });
}

// 1 / rms(head) for norm_rope: with AVX2, 8 partial sums of squares (lane i: elements i mod 8),
// added in a fixed order; a head is short (64-256), and one float32 chain over it was the op's
// cost (40 rows x 24 heads of 128: 75 us a layer)
inline float inv_rms_head(const float* r, int64_t D, float eps) {
#ifdef FO_AVX2
  if (D % 8 == 0) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < D; i += 8) {
      const __m256 v = _mm256_loadu_ps(r + i);
      acc = _mm256_fmadd_ps(v, v, acc);
    }
    alignas(32) float l[8];
    _mm256_store_ps(l, acc);
    const float ss = ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
    return 1.0f / std::sqrt(ss / static_cast<float>(D) + eps);
  }
#endif
  return inv_rms(r, D, eps);
}

// rope, each head RMS-normed and times its weights first when w is given (norm_rope)
void rope_heads(const at::Tensor& x, const at::Tensor* w, double eps, const at::Tensor& cos, const at::Tensor& sin,
                at::Tensor& out) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat && x.stride(2) == 1 &&
                  x.stride(1) == x.size(2) && x.size(2) % 2 == 0,
              "x must be float32 [T, H, D] with contiguous heads");
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2), half = D / 2;
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                  cos.is_contiguous() && sin.is_contiguous() && cos.numel() == T * D &&
                  sin.numel() == T * D,
              "cos/sin must be contiguous float32 [T, D] tables");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.sizes() == x.sizes(),
              "out must be a contiguous float32 tensor shaped like x");
  TORCH_CHECK(!w || (w->scalar_type() == at::kFloat && w->is_contiguous() && w->dim() == 2 && w->size(0) == H &&
                     w->size(1) == D),
              "w must be a contiguous float32 [H, D] tensor");
  TORCH_CHECK(std::isfinite(eps) && eps >= 0, "eps must be finite and >= 0");
  const float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const float* wp = w ? w->data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  const int64_t sx = x.stride(0);
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    std::vector<float> normed(wp ? D : 0);
    for (int64_t t = t0; t < t1; ++t) {
      const float* c = cp + t * D;
      const float* s = sp + t * D;
      for (int64_t h = 0; h < H; ++h) {
        const float* xr = xp + t * sx + h * D;
        if (wp) {  // (x / rms) * w, as rms_norm(x) then mul_(w)
          const float r = inv_rms_head(xr, D, feps);
          const float* wr = wp + h * D;
          for (int64_t i = 0; i < D; ++i) normed[i] = (xr[i] * r) * wr[i];
          xr = normed.data();
        }
        float* orow = op + (t * H + h) * D;
        for (int64_t i = 0; i < half; ++i) orow[i] = xr[i] * c[i] + xr[i + half] * s[i];
        for (int64_t i = half; i < D; ++i) orow[i] = xr[i] * c[i] + xr[i - half] * s[i];
      }
    }
  });
}

void rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& out) {
  rope_heads(x, nullptr, 0.0, cos, sin, out);
}

void norm_rope(const at::Tensor& x, const at::Tensor& w, double eps, const at::Tensor& cos, const at::Tensor& sin,
               at::Tensor& out) {
  rope_heads(x, &w, eps, cos, sin, out);
}

// first maximum of x[0, n) -> (value, index); NaN wins (first NaN)
void argmax_row(const float* x, int64_t n, float& best, int64_t& at) {
  int64_t i = 0;
  float bv = -INFINITY;
  int64_t bi = 0;
  bool nan = false;
#ifdef FO_AVX2
  if (n >= 8) {
    __m256 vbest = _mm256_set1_ps(-INFINITY);
    __m256i vidx = _mm256_setzero_si256(), cur = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256 vnan = _mm256_setzero_ps();
    const __m256i step = _mm256_set1_epi32(8);
    for (; i + 8 <= n; i += 8) {
      const __m256 v = _mm256_loadu_ps(x + i);
      const __m256 gt = _mm256_cmp_ps(v, vbest, _CMP_GT_OQ);  // strict: a lane keeps its first max
      vbest = _mm256_blendv_ps(vbest, v, gt);
      vidx = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(vidx), _mm256_castsi256_ps(cur), gt));
      vnan = _mm256_or_ps(vnan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      cur = _mm256_add_epi32(cur, step);
    }
    nan = _mm256_movemask_ps(vnan) != 0;
    alignas(32) float lv[8];
    alignas(32) int32_t li[8];
    _mm256_store_ps(lv, vbest);
    _mm256_store_si256(reinterpret_cast<__m256i*>(li), vidx);
    bv = lv[0], bi = li[0];
    for (int l = 1; l < 8; ++l)  // the largest value; among equal ones the smallest index
      if (lv[l] > bv || (lv[l] == bv && li[l] < bi)) bv = lv[l], bi = li[l];
  }
#endif
  for (; i < n; ++i) {
    if (x[i] > bv) bv = x[i], bi = i;
    if (x[i] != x[i]) nan = true;
  }
  if (nan) {  // rare: the first NaN, as torch reports it
    for (int64_t j = 0; j < n; ++j)
      if (x[j] != x[j]) {
        bv = x[j], bi = j;
        break;
      }
  }
  best = bv, at = bi;
}

void argmax(const at::Tensor& x, at::Tensor& best, at::Tensor& idx) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.size(1) > 0,
              "x must be a contiguous float32 [R, V] tensor, V > 0");
  const int64_t R = x.size(0), V = x.size(1);
  TORCH_CHECK(best.scalar_type() == at::kFloat && best.is_contiguous() && best.numel() == R,
              "best must be a contiguous float32 [R] tensor");
  TORCH_CHECK(idx.scalar_type() == at::kLong && idx.is_contiguous() && idx.numel() == R,
              "idx must be a contiguous int64 [R] tensor");
  const float* xp = x.data_ptr<float>();
  float* bp = best.data_ptr<float>();
  int64_t* ip = idx.data_ptr<int64_t>();
  at::parallel_for(0, R, 4, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) argmax_row(xp + r * V, V, bp[r], ip[r]);
  });
}

}  // namespace

TORCH_LIBRARY(pagedkv_ops, m) {
  m.def("add_rms_norm(Tensor(a!) x, Tensor delta, Tensor w, float eps, Tensor(b!) out) -> ()");
  m.def("silu_mul(Tensor gu, Tensor(a!) out) -> ()");
  m.def("rope(Tensor x, Tensor cos, Tensor sin, Tensor(a!) out) -> ()");
  m.def("argmax(Tensor x, Tensor(a!) best, Tensor(b!) idx) -> ()");
  m.def("gelu_tanh_mul(Tensor gu, Tensor(a!) out) -> ()");
  m.def("norm_add_rms_norm(Tensor(a!) x, Tensor delta, Tensor wd, Tensor w, float eps, Tensor(b!) out) -> ()");
  m.def("norm_rope(Tensor x, Tensor w, float eps, Tensor cos, Tensor sin, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(pagedkv_ops, CPU, m) {
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_mul", &silu_mul);
  m.impl("rope", &rope);
  m.impl("argmax", &argmax);
  m.impl("gelu_tanh_mul", &gelu_tanh_mul);
  m.impl("norm_add_rms_norm", &norm_add_rms_norm);
  m.impl("norm_rope", &norm_rope);
}
