// Matmul of float32 activations by GGUF-quantized weights, for CPU.
//
// The weight stays as the GGUF file stores it: [N, row_bytes] uint8, each row a run of blocks of
// one ggml type (every type of ggml_blocks.h: the legacy quants, the K-quants, IQ4_NL / IQ4_XS,
// or plain F32/F16/BF16 elements), with exactly the arithmetic of the `gguf` package's numpy
// dequantizers (float32 products, no fused multiply-add unless exact: the files are built with
// -ffp-contract=off). Each weight byte is read from memory once per call, whatever the number of
// activation rows: the decode case (1-16 rows), which is bandwidth-bound. Threads split the
// output rows.
//
// With AVX2 (and K a multiple of 32), 32 weights at a time are dequantized in registers and
// multiplied at once (qmatmul_simd.inc, written once over the vector width and built 8 lanes
// wide in qmatmul_avx2.cpp and 16 wide in qmatmul_avx512.cpp; the widest the CPU has is chosen
// at run time, see has_avx512). Without AVX2, or K not a multiple of 32, a row is dequantized
// into a float32 scratch that stays in L1 (ggml::deq_row) and dotted with every activation row.
//
// Ops (registered as torch.ops.pagedkv_q.*):
//   qmatmul(x [T, K] f32, w [N, rb] u8, qtype, out [T, >= col0 + N] f32, col0): out[:, col0:+N] = x W^T
//   qrows(w [N, rb] u8, qtype, K, idx [R] i64, out [R, K] f32): out[r] = dequant(W[idx[r]])
//   qgemm(x, w, qtype, out, col0): qmatmul for many rows (the gemm of qmatmul_simd.inc, AVX-512 or
//     AVX2; qmatmul's paths without AVX2 or with K not a multiple of 32); has_gemm() -> whether
//     the build has a gemm
//   limit_isa(level) -> previous: 2 = AVX-512 where available (default), 1 = AVX2 at most, for
//     every kernel of the library (isa.h)
//   batch_invariant(on) -> previous: whether qgemm sums in the row kernel's order (isa.h: order)
//   isa() -> what calls run now: 0 scalar (a build without AVX2), 1 AVX2, 2 AVX-512, 3 AVX-512
//     with the int8 kernels' VNNI code
//   types() -> [type, block elements, block bytes] * n: the kernel types (ggml::TYPES)
// Built by pagedkv/model/qkernel.py with the attention kernel's build helpers.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#include "ggml_blocks.h"
#include "isa.h"
#include "qmatmul_a8.h"
#include "qmatmul_simd.h"
#include "simd.inc"
#include "vec.h"

namespace isa {
// the library's ISA limit (isa.h)
std::atomic<int64_t> level{2};
int64_t limit() { return level.load(std::memory_order_relaxed); }
}  // namespace isa

namespace order {
std::atomic<bool> on{false};
bool invariant() { return on.load(std::memory_order_relaxed); }
}  // namespace order

namespace {

using namespace ggml;

// --- dot products ------------------------------------------------------------------------------

#ifdef PQ_AVX2
using simd::hsum;
#endif

inline float dot(const float* w, const float* x, int64_t K) {
  int64_t i = 0;
  float s = 0.f;
#ifdef PQ_AVX2
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  for (; i + 16 <= K; i += 16) {
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i), _mm256_loadu_ps(x + i), a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i + 8), _mm256_loadu_ps(x + i + 8), a1);
  }
  s = hsum(_mm256_add_ps(a0, a1));
#endif
  for (; i < K; ++i) s += w[i] * x[i];
  return s;
}

// four activation rows against one weight row: the weight scratch is loaded once for all four
inline void dot4(const float* w, const float* x, int64_t ldx, int64_t K, float* r) {
  int64_t i = 0;
  float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
  const float *x0 = x, *x1 = x + ldx, *x2 = x + 2 * ldx, *x3 = x + 3 * ldx;
#ifdef PQ_AVX2
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  __m256 a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
  for (; i + 8 <= K; i += 8) {
    const __m256 v = _mm256_loadu_ps(w + i);
    a0 = _mm256_fmadd_ps(v, _mm256_loadu_ps(x0 + i), a0);
    a1 = _mm256_fmadd_ps(v, _mm256_loadu_ps(x1 + i), a1);
    a2 = _mm256_fmadd_ps(v, _mm256_loadu_ps(x2 + i), a2);
    a3 = _mm256_fmadd_ps(v, _mm256_loadu_ps(x3 + i), a3);
  }
  s0 = hsum(a0), s1 = hsum(a1), s2 = hsum(a2), s3 = hsum(a3);
#endif
  for (; i < K; ++i) {
    s0 += w[i] * x0[i], s1 += w[i] * x1[i], s2 += w[i] * x2[i], s3 += w[i] * x3[i];
  }
  r[0] = s0, r[1] = s1, r[2] = s2, r[3] = s3;
}

#ifdef PQ_AVX2
// Op pagedkv_q.limit_isa(level) -> the previous level: the widest path every kernel may take
// (isa.h): 2 = AVX-512 where the CPU has it, 1 = AVX2.
int64_t limit_isa(int64_t level) {
  TORCH_CHECK(level == 1 || level == 2, "limit_isa: level must be 1 (AVX2) or 2 (AVX-512)");
  return isa::level.exchange(level);
}

bool has_avx512() {
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
  return ok && isa::limit() >= 2;
}

int64_t isa_now() { return has_avx512() ? (a8::vnni512() ? 3 : 2) : 1; }

// Op pagedkv_q.batch_invariant(on) -> the previous setting (isa.h: order::invariant)
bool batch_invariant(bool on) { return order::on.exchange(on); }

bool fused_ok(int64_t, int64_t K) { return K % 32 == 0; }

// activation rows a weight row is dequantized once for: the kernel's group (8 with AVX-512, 4
// with AVX2) while those rows of x fit in L1 (32 KiB), else 4. Past L1 each weight row reads the
// group's x from L2, which halves the FMA rate: 1 thread, ns per weight, 8 rows in one group /
// two of 4: K = 1536 0.33 / 0.27, K = 896 0.25-0.32 / 0.29-0.30, K = 8960 0.35 / 0.35-0.38.
int64_t fused_group(int64_t K) {
  const int64_t g = has_avx512() ? z::row_group() : y::row_group();
  return g * K * 4 <= 32 * 1024 ? g : std::min<int64_t>(g, 4);
}

// activation rows the pair kernel (two weight rows at once) takes for T rows of length K, or 0
// where the row kernel's groups are kept: AVX2 (16 registers), and with AVX-512 5 or more rows
// while a group of 8 fits in L1 (K <= 1024: each weight dequantized once for 8 rows beats pairs
// of 4 there). Each x vector then feeds two weight rows: half the loads. 2 threads, ns per weight,
// groups / pairs, 8960 x 1536 Q4_K: 0.209 / 0.183 at 8 rows, 0.316 / 0.261 at 12, 0.404 / 0.352
// at 16; Q6_K 0.237 / 0.172 at 8; 1536 x 8960 Q5_0 0.101 / 0.069 at 4, 0.185 / 0.146 at 8; Q8_0
// 0.198 / 0.129 at 8; 4864 x 896 Q5_0 0.170 (one group of 8) / 0.180 at 8.
int64_t pair_group(int64_t T, int64_t K) {
  if (!has_avx512()) return 0;
  const int64_t pg = z::pair_group_rows();
  return T <= pg || fused_group(K) < z::row_group() ? pg : 0;
}

// whether T activation rows of length K take the AVX2 row kernel's one chain per row (y::row_wide)
// instead of its groups of 4 (which dequantize each weight once per group): 5-7 rows, and 8 while
// their x fits in L1; not under order::invariant (the groups' order is the row kernels' order).
// Zen 2, 1 thread, ns per weight, groups / one chain: Q5_0 896 x 4864 0.284 / 0.220 at 5 rows,
// 0.344 / 0.280 at 7, 0.375 / 0.319 at 8; Q6_K 1536 x 2837 0.359 / 0.263 at 6; Q4_K 1024 x 4256
// 0.298 / 0.244 at 7. At 8 rows past L1 (and with the K-quants' accumulators spilled) one chain
// lost or tied: Q4_K 1536 x 2837 0.308 / 0.340, Q8_0 0.294 / 0.352, Q6_K 0.412 / 0.414.
bool wide_rows(int64_t T, int64_t K) {
  return !has_avx512() && T >= 5 && (T <= 7 || (T == 8 && T * K * 4 <= 32 * 1024)) && !order::invariant();
}

// weight rows `row`, `row + rb` against T <= pair_group(T, K) activation rows (T = 1 on any width)
void fused_pair_row(int64_t qtype, const uint8_t* row, int64_t rb, int64_t T, int64_t K, const float* x, float* r0,
                    float* r1) {
  if (has_avx512()) z::pair_row(qtype, row, rb, T, K, x, r0, r1);
  else y::pair_row(qtype, row, rb, T, K, x, r0, r1);
}

void fused_row(int64_t qtype, const uint8_t* row, int64_t rb, int64_t T, int64_t K, const float* x, float* res,
               bool once) {
  if (has_avx512()) z::row(qtype, row, rb, T, K, x, res, once);
  else y::row(qtype, row, rb, T, K, x, res, once);
}

// deq_row, through the chunk dequantizers where they apply (the same values)
void deq_row_fast(const uint8_t* row, int64_t qtype, int64_t K, float* out) {
  if (K % 32 != 0) deq_row(row, qtype, K, out);
  else if (has_avx512()) z::deq_row(row, qtype, K, out);
  else y::deq_row(row, qtype, K, out);
}
#else
int64_t limit_isa(int64_t level) { return isa::level.exchange(level); }  // nothing to limit: the scalar path
int64_t isa_now() { return 0; }
bool batch_invariant(bool on) { return order::on.exchange(on); }  // (no gemm: every path is the row loop)
void deq_row_fast(const uint8_t* row, int64_t qtype, int64_t K, float* out) { deq_row(row, qtype, K, out); }
bool fused_ok(int64_t, int64_t) { return false; }
bool wide_rows(int64_t, int64_t) { return false; }
int64_t fused_group(int64_t) { return 4; }
int64_t pair_group(int64_t, int64_t) { return 0; }
void fused_pair_row(int64_t, const uint8_t*, int64_t, int64_t, int64_t, const float*, float*, float*) {}
void fused_row(int64_t, const uint8_t*, int64_t, int64_t, int64_t, const float*, float*, bool) {}
#endif

// weight rows [n0, n1) against one activation row, two rows at a time
__attribute__((noinline)) void pair_range(int64_t qtype, const uint8_t* wp, int64_t rb, int64_t n0, int64_t n1,
                                          int64_t K, const float* xp, float* op) {
  int64_t n = n0;
  for (; n + 2 <= n1; n += 2) fused_pair_row(qtype, wp + n * rb, rb, 1, K, xp, op + n, op + n + 1);
  if (n < n1) fused_row(qtype, wp + n * rb, rb, 1, K, xp, op + n, true);
}

// weight rows a block of the fused path takes against each group of activation rows in turn, where
// T spans several groups: each group's x stays in L1 (K <= 1536) while the block's rows, in L2, pass
// it, where each weight row against all groups cycled the T rows' x through L2 (8 rows of 1536: 48
// KB). The groups are as even as they can be (5 rows: 3 + 2, not 4 + 1). Zen 2, 2 threads, whole
// exact decode steps, ms, one weight row at a time against groups of 4 -> blocks of even groups:
// the 1.5B K-quant file 248.4 -> 214.4 at 5 rows, 305.6 -> 274.3 at 8, 441 -> 409 at 12; the 0.5B
// Q4_K_M mix 81.9 -> 79.3 at 6, 96.0 -> 94.0 at 8, 153.3 -> 140.0 at 12.
constexpr int64_t ROW_BLOCK = 16;

// weight rows [n0, n1) against T activation rows: the fused path, weight rows in pairs against
// groups of pair_group(T, K) activation rows where it applies, one at a time against all T rows
// in one chain each where wide_rows(T, K) (AVX2), else one at a time against groups
// of up to fused_group(K) (8 with AVX-512, 4 with AVX2; ROW_BLOCK rows against each group in turn
// where T spans several); or (K not a
// multiple of 32) the row dequantized into a scratch first
__attribute__((noinline)) void row_range(int64_t qtype, const uint8_t* wp, int64_t rb, int64_t n0, int64_t n1,
                                         int64_t T, int64_t K, const float* xp, float* op, int64_t ldo,
                                         bool fused) {
  std::vector<float> buf(fused ? 0 : K);
  float r[8];
  const int64_t group = fused_group(K), pg = fused ? pair_group(T, K) : 0;
  int64_t n = n0;
  if (pg > 0) {  // weight rows in pairs, each x vector loaded once for both
    float r1[8];
    for (; n + 2 <= n1; n += 2)
      for (int64_t t = 0; t < T; t += pg) {
        const int64_t m = std::min<int64_t>(pg, T - t);
        fused_pair_row(qtype, wp + n * rb, rb, m, K, xp + t * K, r, r1);
        for (int64_t i = 0; i < m; ++i) op[(t + i) * ldo + n] = r[i], op[(t + i) * ldo + n + 1] = r1[i];
      }
  }
  if (fused && wide_rows(T, K)) {  // each weight row once against all T rows, one chain per row
    for (; n < n1; ++n) {
      y::row_wide(qtype, wp + n * rb, rb, T, K, xp, r);
      for (int64_t i = 0; i < T; ++i) op[i * ldo + n] = r[i];
    }
  }
  if (fused && T > group) {  // ROW_BLOCK weight rows against each group of x in turn
    const int64_t ng = (T + group - 1) / group;  // groups of T / ng or one more row (5 rows: 3 + 2)
    for (; n < n1; n += ROW_BLOCK) {
      const int64_t e = std::min<int64_t>(n + ROW_BLOCK, n1);
      for (int64_t g = 0, t = 0; g < ng; ++g) {
        const int64_t m = T / ng + (g < T % ng ? 1 : 0);
        for (int64_t j = n; j < e; ++j) {
          fused_row(qtype, wp + j * rb, rb, m, K, xp + t * K, r, false);  // (read again by the next group)
          for (int64_t i = 0; i < m; ++i) op[(t + i) * ldo + j] = r[i];
        }
        t += m;
      }
    }
  }
  for (; n < n1; ++n) {
    if (fused) {
      fused_row(qtype, wp + n * rb, rb, T, K, xp, r, true);
      for (int64_t i = 0; i < T; ++i) op[i * ldo + n] = r[i];
      continue;
    }
    deq_row(wp + n * rb, qtype, K, buf.data());
    int64_t t = 0;
    for (; t + 4 <= T; t += 4) {
      dot4(buf.data(), xp + t * K, K, K, r);
      for (int k = 0; k < 4; ++k) op[(t + k) * ldo + n] = r[k];
    }
    for (; t < T; ++t) op[t * ldo + n] = dot(buf.data(), xp + t * K, K);
  }
}

void check_weight(const at::Tensor& w, int64_t qtype, int64_t K) {
  const TypeInfo* l = type_info(qtype);
  TORCH_CHECK(l, "qmatmul: unsupported ggml type ", qtype);
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(),
              "weight must be a contiguous uint8 [N, row_bytes] tensor");
  TORCH_CHECK(K > 0 && K % l->block == 0 && w.size(1) == K / l->block * l->bytes,
              "weight rows of ", w.size(1), " bytes do not hold ", K, " elements of type ", qtype);
}

void qmatmul(const at::Tensor& x, const at::Tensor& w, int64_t qtype, at::Tensor& out, int64_t col0) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x must be a contiguous float32 [T, K] tensor");
  const int64_t T = x.size(0), K = x.size(1), N = w.size(0);
  check_weight(w, qtype, K);
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == at::kFloat && out.stride(1) == 1 &&
                  out.size(0) == T && col0 >= 0 && col0 + N <= out.size(1),
              "out must be float32 [T, >= col0 + N] with contiguous rows");
  if (T == 0 || N == 0) return;
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const int64_t rb = w.size(1), ldo = out.stride(0);
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>() + col0;
  // grain: enough rows that a chunk is worth a thread wake-up, few enough to balance two cores
  const int64_t grain = std::max<int64_t>(16, N / (8 * std::max<int64_t>(1, at::get_num_threads())));
  const bool fused = fused_ok(T, K);
  // one activation row: weight rows in pairs (fused_pair_row), Q8_0 too: an early build measured
  // its pairs 3-4x slower on SmolLM2's LM head; this one, 2 threads, ns per weight, one row /
  // pairs, min of 9: 49152 x 576 0.036 / 0.032, 151936 x 896 0.060 / 0.055, x 1536 0.044 / 0.041
  const bool pairs = fused && T == 1;
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    if (pairs) pair_range(qtype, wp, rb, n0, n1, K, xp, op);
    else row_range(qtype, wp, rb, n0, n1, T, K, xp, op, ldo, fused);
  });
}

// qmatmul for many rows: the gemm, AVX-512 or AVX2 (K a multiple of 32), else qmatmul's own paths
void qgemm(const at::Tensor& x, const at::Tensor& w, int64_t qtype, at::Tensor& out, int64_t col0) {
#ifdef PQ_AVX2
  const bool ok = x.dim() == 2 && x.size(1) % 32 == 0;
#else
  const bool ok = false;
#endif
  if (!ok) return qmatmul(x, w, qtype, out, col0);
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be a contiguous float32 [T, K] tensor");
  const int64_t T = x.size(0), K = x.size(1), N = w.size(0);
  check_weight(w, qtype, K);
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == at::kFloat && out.stride(1) == 1 &&
                  out.size(0) == T && col0 >= 0 && col0 + N <= out.size(1),
              "out must be float32 [T, >= col0 + N] with contiguous rows");
  if (T == 0 || N == 0) return;
#ifdef PQ_AVX2
  const auto gemm = has_avx512() ? z::gemm : y::gemm;
  gemm(qtype, w.data_ptr<uint8_t>(), w.size(1), N, T, K, x.data_ptr<float>(), out.data_ptr<float>() + col0,
       out.stride(0));
#endif
}

std::vector<int64_t> types() {
  std::vector<int64_t> v;
  for (const TypeInfo& i : TYPES) v.insert(v.end(), {i.type, i.block, i.bytes});
  return v;
}

bool has_gemm() {
#ifdef PQ_AVX2
  return true;
#else
  return false;
#endif
}

void qrows(const at::Tensor& w, int64_t qtype, int64_t K, const at::Tensor& idx, at::Tensor& out) {
  check_weight(w, qtype, K);
  TORCH_CHECK(idx.dim() == 1 && idx.scalar_type() == at::kLong && idx.is_contiguous(),
              "idx must be a contiguous int64 [R] tensor");
  const int64_t R = idx.size(0), N = w.size(0);
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == at::kFloat && out.is_contiguous() &&
                  out.size(0) == R && out.size(1) == K,
              "out must be a contiguous float32 [R, K] tensor");
  const int64_t* ip = idx.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) {
    TORCH_CHECK(ip[r] >= 0 && ip[r] < N, "row index ", ip[r], " outside [0, ", N, ")");
  }
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const int64_t rb = w.size(1);
  float* op = out.data_ptr<float>();
  at::parallel_for(0, R, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) deq_row_fast(wp + ip[r] * rb, qtype, K, op + r * K);
  });
}

}  // namespace

TORCH_LIBRARY(pagedkv_q, m) {
  m.def("qmatmul(Tensor x, Tensor w, int qtype, Tensor(a!) out, int col0) -> ()");
  m.def("qrows(Tensor w, int qtype, int K, Tensor idx, Tensor(a!) out) -> ()");
  m.def("qgemm(Tensor x, Tensor w, int qtype, Tensor(a!) out, int col0) -> ()");
  m.def("limit_isa(int level) -> int", &limit_isa);
  m.def("batch_invariant(bool on) -> bool", &batch_invariant);
  m.def("has_gemm() -> bool", &has_gemm);
  m.def("isa() -> int", &isa_now);
  m.def("types() -> int[]", &types);
}

TORCH_LIBRARY_IMPL(pagedkv_q, CPU, m) {
  m.impl("qmatmul", &qmatmul);
  m.impl("qgemm", &qgemm);
  m.impl("qrows", &qrows);
}
