// The candidates of each greedy row's maximum from logits known within a bound, and their
// logits recomputed in float64 (greedy_head.py: the bounds and why they hold).
//
// screen(a [R, V] f32, x [R, K] f32, sel [S] i64, wn [V] f32, block, m, c) -> (rows [P] i64,
//   cols [P] i64, bad [S] bool), for the rows sel (each in [0, R)). Row r's logits a[r] stand for
//   t_j = w_j . x[r] within
//     b(r, j) = wn[j] * eb + beta + |a[r, j]| * 2^-20
//   eb = sqrt(sum over x[r]'s blocks of `block` elements of block (f amax)^2), f = 0.502 / 127
//   (a block with amax < 2^-60: 2.1), the int8 rounding of x (block 0: eb = 0, exact logits);
//   beta = c m (|x[r]| + eb), the float roundings. Both are computed in float64 and rounded up.
//   Then lo = max_j (a - b) is at most the row's true maximum, and every j with a + b >= lo is a
//   candidate: the true argmax always is one (its a + b is at least its true value, which is at
//   least lo). (rows, cols) lists the candidates row by row, columns ascending. A row holding a
//   value that is not finite (a, x, or b through wn) is flagged bad, and its candidates are not
//   listed: the caller takes another way for it.
//   The |a| 2^-20 term keeps every other j strictly below the candidates' recomputed values
//   rounded to float32: the first maximum of the row is then always a candidate's.
// rescore(w [P, K] f32, x [R, K] f32, rows [P] i64, cols [P] i64, a [R, V] f32) -> tokens [R] i64:
//   a[rows[p], cols[p]] = sum_k w[p, k] x[rows[p], k] in float64 (every product of two float32
//   exact there), rounded once to float32; tokens[r] = the smallest col of row r's largest such
//   value (cols ascending within a row), -1 for a row without candidates or whose largest value
//   is not finite.
// Row by row, rows split across threads; one pass over a row, 8 columns at a time with AVX2.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define LS_AVX2 1
#endif

namespace {

constexpr float REL = 1.0f / (1 << 20);  // the |a| term of the bound

// the bound of one entry; WN false: eb is 0 (exact logits), wn is not read
template <bool WN>
inline float bound(float a, const float* wn, int64_t j, float eb, float beta) {
  return (WN ? std::fma(wn[j], eb, beta) : beta) + std::fabs(a) * REL;
}

#ifdef LS_AVX2
template <bool WN>
inline __m256 bound8(__m256 x, const float* wn, int64_t j, __m256 ve, __m256 vbeta) {
  const __m256 ax = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x), rel = _mm256_set1_ps(REL);
  return _mm256_fmadd_ps(ax, rel, WN ? _mm256_fmadd_ps(_mm256_loadu_ps(wn + j), ve, vbeta) : vbeta);
}
#endif

// One pass over a row: the running lo (max of a - b so far, folded in every LO_EVERY columns, so
// at most the final lo) picks a superset of the candidates; the final lo then filters them. False
// when a value (a or its bound) is not finite.
constexpr int64_t LO_EVERY = 512;

template <bool WN>
bool row_scan(const float* a, const float* wn, int64_t V, float eb, float beta, std::vector<int64_t>& out) {
  float lo = -INFINITY;
  bool bad = false;
  int64_t j = 0;
#ifdef LS_AVX2
  const __m256 ve = _mm256_set1_ps(eb), vbeta = _mm256_set1_ps(beta);
  __m256 vl = _mm256_set1_ps(-INFINITY), vbad = _mm256_setzero_ps();
  auto fold = [&]() {
    alignas(32) float t[8];
    _mm256_store_ps(t, vl);
    for (float v : t) lo = v > lo ? v : lo;
  };
  for (int64_t j0 = 0; j0 + 8 <= V; j0 += LO_EVERY) {
    const int64_t j1 = std::min(V - V % 8, j0 + LO_EVERY);
    if (j0 == 0) {  // the first stretch sets lo before any candidate is taken
      for (int64_t i = 0; i < j1; i += 8) {
        const __m256 x = _mm256_loadu_ps(a + i);
        const __m256 b = bound8<WN>(x, wn, i, ve, vbeta);
        vl = _mm256_max_ps(vl, _mm256_sub_ps(x, b));
      }
      fold();
    }
    const __m256 vlo = _mm256_set1_ps(lo);
    for (j = j0; j < j1; j += 8) {
      const __m256 x = _mm256_loadu_ps(a + j);
      const __m256 b = bound8<WN>(x, wn, j, ve, vbeta);
      const __m256 d = _mm256_sub_ps(x, b);
      vl = _mm256_max_ps(vl, d);
      const __m256 z = _mm256_sub_ps(d, d);  // NaN where x or b is not finite
      vbad = _mm256_or_ps(vbad, _mm256_cmp_ps(z, z, _CMP_UNORD_Q));
      int m = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_add_ps(x, b), vlo, _CMP_GE_OQ));
      while (m) {
        out.push_back(j + __builtin_ctz(m));
        m &= m - 1;
      }
    }
    fold();
  }
  j = V - V % 8;
  bad = _mm256_movemask_ps(vbad) != 0;
#endif
  for (int64_t i = j; i < V; ++i) {  // the tail (the whole row without AVX2): its lo first
    const float d = a[i] - bound<WN>(a[i], wn, i, eb, beta);
    if (!std::isfinite(d)) bad = true;
    lo = d > lo ? d : lo;
  }
  for (int64_t i = j; i < V; ++i)
    if (a[i] + bound<WN>(a[i], wn, i, eb, beta) >= lo) out.push_back(i);
  if (bad || !std::isfinite(lo)) return false;
  size_t k = 0;  // the final lo's candidates
  for (int64_t i : out)
    if (a[i] + bound<WN>(a[i], wn, i, eb, beta) >= lo) out[k++] = i;
  out.resize(k);
  return true;
}

// (eb, beta) of one row of x, rounded up; false when not finite
bool row_bounds(const float* x, int64_t K, int64_t block, double m, double c, float& eb, float& beta) {
  double xn = 0, e = 0;
  for (int64_t k = 0; k < K; ++k) xn += static_cast<double>(x[k]) * x[k];
  if (block > 0)
    for (int64_t b0 = 0; b0 < K; b0 += block) {
      double amax = 0;
      for (int64_t k = b0; k < b0 + block; ++k) amax = std::max(amax, std::fabs(static_cast<double>(x[k])));
      const double f = amax < 0x1p-60 ? 2.1 * amax : amax * (0.502 / 127);
      e += static_cast<double>(block) * f * f;
    }
  constexpr double UP = 1 + 0x1p-20;
  const double se = std::sqrt(e) * UP, sb = c * m * (std::sqrt(xn) + se) * UP;
  eb = static_cast<float>(se), beta = static_cast<float>(sb);
  return std::isfinite(eb) && std::isfinite(beta);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> screen(const at::Tensor& a, const at::Tensor& x,
                                                     const at::Tensor& sel, const at::Tensor& wn,
                                                     int64_t block, double m, double c) {
  TORCH_CHECK(a.dim() == 2 && a.scalar_type() == at::kFloat && a.is_contiguous(),
              "a must be a contiguous float32 [R, V] tensor");
  const int64_t R = a.size(0), V = a.size(1);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.size(0) == R,
              "x must be a contiguous float32 [R, K] tensor");
  const int64_t K = x.size(1);
  TORCH_CHECK(block == 0 || (block > 0 && K % block == 0), "block must be 0 or divide K");
  TORCH_CHECK(std::isfinite(m) && m >= 0 && std::isfinite(c) && c >= 0, "m and c must be finite, >= 0");
  TORCH_CHECK(sel.dim() == 1 && sel.scalar_type() == at::kLong && sel.is_contiguous(),
              "sel must be a contiguous int64 [S] tensor");
  const int64_t S = sel.numel();
  const int64_t* sp = sel.data_ptr<int64_t>();
  for (int64_t i = 0; i < S; ++i) TORCH_CHECK(sp[i] >= 0 && sp[i] < R, "sel holds a row outside [0, R)");
  TORCH_CHECK(wn.scalar_type() == at::kFloat && wn.is_contiguous() && wn.dim() == 1 && wn.numel() == V,
              "wn must be a contiguous float32 [V] tensor");
  const float *ap = a.data_ptr<float>(), *xp = x.data_ptr<float>(), *wp = wn.data_ptr<float>();
  std::vector<std::vector<int64_t>> cand(S);
  std::vector<uint8_t> bad(S, 0);
  at::parallel_for(0, S, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      float eb, beta;
      const bool ok = row_bounds(xp + sp[i] * K, K, block, m, c, eb, beta) &&
                      (eb > 0 ? row_scan<true>(ap + sp[i] * V, wp, V, eb, beta, cand[i])
                              : row_scan<false>(ap + sp[i] * V, wp, V, eb, beta, cand[i]));
      if (!ok) {
        bad[i] = 1;
        cand[i].clear();
      }
    }
  });
  int64_t P = 0;
  for (const auto& cd : cand) P += static_cast<int64_t>(cd.size());
  at::Tensor rows = at::empty({P}, at::kLong), cols = at::empty({P}, at::kLong);
  at::Tensor flags = at::empty({S}, at::kBool);
  int64_t *rp = rows.data_ptr<int64_t>(), *cp = cols.data_ptr<int64_t>();
  bool* fp = flags.data_ptr<bool>();
  int64_t p = 0;
  for (int64_t i = 0; i < S; ++i) {
    fp[i] = bad[i] != 0;
    for (int64_t j : cand[i]) rp[p] = sp[i], cp[p++] = j;
  }
  return {rows, cols, flags};
}

at::Tensor rescore(const at::Tensor& w, const at::Tensor& x, const at::Tensor& rows, const at::Tensor& cols,
                   at::Tensor& a) {
  TORCH_CHECK(a.dim() == 2 && a.scalar_type() == at::kFloat && a.is_contiguous(),
              "a must be a contiguous float32 [R, V] tensor");
  const int64_t R = a.size(0), V = a.size(1);
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.is_contiguous(), "w must be a contiguous float32 [P, K] tensor");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.size(0) == R && x.size(1) == w.size(1),
              "x must be a contiguous float32 [R, K] tensor of a's R and w's K");
  const int64_t P = w.size(0), K = w.size(1);
  for (const at::Tensor* t : {&rows, &cols})
    TORCH_CHECK(t->dim() == 1 && t->scalar_type() == at::kLong && t->is_contiguous() && t->numel() == P,
                "rows and cols must be contiguous int64 [P] tensors");
  const int64_t *rp = rows.data_ptr<int64_t>(), *cp = cols.data_ptr<int64_t>();
  for (int64_t p = 0; p < P; ++p)
    TORCH_CHECK(rp[p] >= 0 && rp[p] < R && cp[p] >= 0 && cp[p] < V, "rows / cols hold an entry outside a");
  const float *wp = w.data_ptr<float>(), *xp = x.data_ptr<float>();
  float* ap = a.data_ptr<float>();
  std::vector<float> vals(P);
  at::parallel_for(0, P, 64, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const float *u = wp + p * K, *v = xp + rp[p] * K;
      double s[4] = {0, 0, 0, 0};
      int64_t k = 0;
      for (; k + 4 <= K; k += 4)
        for (int l = 0; l < 4; ++l) s[l] += static_cast<double>(u[k + l]) * v[k + l];
      for (; k < K; ++k) s[0] += static_cast<double>(u[k]) * v[k];
      vals[p] = static_cast<float>((s[0] + s[1]) + (s[2] + s[3]));
    }
  });
  at::Tensor tokens = at::empty({R}, at::kLong);
  int64_t* tp = tokens.data_ptr<int64_t>();
  std::fill(tp, tp + R, -1);
  std::vector<float> best(R, -INFINITY);
  for (int64_t p = 0; p < P; ++p) {
    ap[rp[p] * V + cp[p]] = vals[p];
    if (vals[p] > best[rp[p]]) best[rp[p]] = vals[p], tp[rp[p]] = cp[p];  // (cols ascend: the first)
  }
  for (int64_t r = 0; r < R; ++r)
    if (!std::isfinite(best[r])) tp[r] = -1;
  return tokens;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedkv_ops, m) {
  m.def("screen(Tensor a, Tensor x, Tensor sel, Tensor wn, int block, float m, float c) -> (Tensor, Tensor, Tensor)");
  m.def("rescore(Tensor w, Tensor x, Tensor rows, Tensor cols, Tensor(a!) a) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedkv_ops, CPU, m) {
  m.impl("screen", &screen);
  m.impl("rescore", &rescore);
}
