// The vector kernels of qmatmul_simd.inc, one set per width: y (AVX2, qmatmul_avx2.cpp) and z
// (AVX-512, qmatmul_avx512.cpp). K is a multiple of 32 and qtype a kernel type (ggml_blocks.h).
#pragma once

#include <cstdint>

#define PQ_SIMD_ENTRY_POINTS                                                                           \
  /* one weight row against T <= row_group() activation rows (ldx = K); `once`: no other call of    \
     this matmul reads the row again (its lines prefetched NTA on AVX2) */                             \
  void row(int64_t qtype, const uint8_t* row, int64_t rb, int64_t T, int64_t K, const float* x,        \
           float* res, bool once);                                                                     \
  /* weight rows `row` and `row + rb` against T <= pair_group_rows() activation rows (ldx = K) */     \
  void pair_row(int64_t qtype, const uint8_t* row, int64_t rb, int64_t T, int64_t K, const float* x,   \
                float* r0, float* r1);                                                                 \
  int64_t pair_group_rows();                                                                           \
  /* one weight row against 5 <= T <= 8 activation rows, one FMA chain per row (ldx = K) */          \
  void row_wide(int64_t qtype, const uint8_t* row, int64_t rb, int64_t T, int64_t K, const float* x,   \
                float* res);                                                                           \
  /* how many activation rows `row` takes at once (4 or 8) */                                          \
  int64_t row_group();                                                                                 \
  /* one weight row -> K floats */                                                                     \
  void deq_row(const uint8_t* row, int64_t qtype, int64_t K, float* y);                                \
  /* out[t * ldo + n] = x[t] . W[n] for n < N, t < T (T > 0) */                                        \
  void gemm(int64_t qtype, const uint8_t* wp, int64_t rb, int64_t N, int64_t T, int64_t K,             \
            const float* x, float* out, int64_t ldo);

namespace y {
PQ_SIMD_ENTRY_POINTS
}
namespace z {
PQ_SIMD_ENTRY_POINTS
}

// qmatmul_panel.cpp (AVX2): rows [0, rows) of one of the gemm's panels of 16 weight rows -> wt
// [K][16] (the weights' float32 values, a lane per row; lanes past `rows` undefined), decoded 8
// rows at a time from byte transposes; false (wt untouched) for a type it does not take
namespace panel {
bool f32_avx2(int64_t qtype, const uint8_t* w, int64_t rb, int64_t rows, int64_t K, float* wt);
}
