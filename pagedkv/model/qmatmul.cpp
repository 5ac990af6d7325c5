// Matmul of float32 activations by GGUF-quantized weights, for CPU.
//
// The weight stays as the GGUF file stores it: [N, row_bytes] uint8, each row a run of blocks of
// one ggml type (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K, or plain F32/F16/BF16 elements). A row is
// dequantized into a float32 scratch of K values that stays in L1, with exactly the arithmetic
// of the `gguf` package's numpy dequantizers (float32 products, no fused multiply-add: the file is
// built with -ffp-contract=off), and then dotted with every activation row in float32. Each weight
// byte is therefore read from memory once per call, whatever the number of activation rows: the
// decode case (1-16 rows), which is bandwidth-bound. Threads split the output rows.
//
// With AVX2 (and K a multiple of 32), 32 weights at a time are dequantized in registers and
// multiplied at once (no scratch round trip); where the CPU has AVX-512, the same is done 16
// lanes wide (chosen at run time, see `z`), which halves the instructions per weight: SmolLM2's
// matmuls of a batch-1 step 4.5 -> 3.4 ms.
//
// Ops (registered as torch.ops.pagedkv_q.*):
//   qmatmul(x [T, K] f32, w [N, rb] u8, qtype, out [T, >= col0 + N] f32, col0): out[:, col0:+N] = x W^T
//   qrows(w [N, rb] u8, qtype, K, idx [R] i64, out [R, K] f32): out[r] = dequant(W[idx[r]])
//   qgemm(x, w, qtype, out, col0): qmatmul for many rows (the gemms below, AVX-512 or AVX2;
//     qmatmul's paths without AVX2 or with K not a multiple of 32); has_gemm() -> whether the
//     build has a gemm
//   limit_isa(level) -> previous: 2 = AVX-512 where available (default), 1 = AVX2 at most
// Built by pagedkv/model/qkernel.py with the attention kernel's build helpers.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define PQ_AVX2 1
#endif

namespace {

// ggml type ids (gguf.GGMLQuantizationType)
enum QType : int64_t {
  F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14, BF16 = 30
};

struct Layout {
  int64_t block;  // elements per block
  int64_t bytes;  // bytes per block
};

bool layout_of(int64_t t, Layout& l) {
  switch (t) {
    case F32: l = {1, 4}; return true;
    case F16: l = {1, 2}; return true;
    case BF16: l = {1, 2}; return true;
    case Q4_0: l = {32, 18}; return true;
    case Q4_1: l = {32, 20}; return true;
    case Q8_0: l = {32, 34}; return true;
    case Q4_K: l = {256, 144}; return true;
    case Q5_K: l = {256, 176}; return true;
    case Q6_K: l = {256, 210}; return true;
    default: return false;
  }
}

inline float half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
}

// --- one block -> floats (the gguf package's formulas) ------------------------------------------

inline void deq_q4_0(const uint8_t* b, float* y) {
  const float d = half(b);
  const uint8_t* qs = b + 2;
  for (int i = 0; i < 16; ++i) {
    y[i] = d * static_cast<float>(static_cast<int>(qs[i] & 0x0F) - 8);
    y[i + 16] = d * static_cast<float>(static_cast<int>(qs[i] >> 4) - 8);
  }
}

inline void deq_q4_1(const uint8_t* b, float* y) {
  const float d = half(b), m = half(b + 2);
  const uint8_t* qs = b + 4;
#ifdef PQ_AVX2
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i lo = _mm_and_si128(raw, _mm_set1_epi8(0x0F));
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(0x0F));
  const __m256 vd = _mm256_set1_ps(d), vm = _mm256_set1_ps(m);
  const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
  for (int k = 0; k < 4; ++k) {
    const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[k]));
    _mm256_storeu_ps(y + 8 * k, _mm256_add_ps(_mm256_mul_ps(vd, q), vm));
  }
#else
  for (int i = 0; i < 16; ++i) {
    y[i] = d * static_cast<float>(qs[i] & 0x0F) + m;
    y[i + 16] = d * static_cast<float>(qs[i] >> 4) + m;
  }
#endif
}

inline void deq_q8_0(const uint8_t* b, float* y) {
  const float d = half(b);
  const int8_t* qs = reinterpret_cast<const int8_t*>(b + 2);
#ifdef PQ_AVX2
  const __m256 vd = _mm256_set1_ps(d);
  for (int k = 0; k < 4; ++k) {
    const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + 8 * k));
    const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw));
    _mm256_storeu_ps(y + 8 * k, _mm256_mul_ps(q, vd));
  }
#else
  for (int i = 0; i < 32; ++i) y[i] = static_cast<float>(qs[i]) * d;
#endif
}

// Q4_K / Q5_K: 8 sub-blocks of 32 with 6-bit scales and mins packed in 12 bytes
inline void scale_min_k4(const uint8_t* s, int j, uint8_t& sc, uint8_t& mn) {
  if (j < 4) {
    sc = s[j] & 0x3F;
    mn = s[j + 4] & 0x3F;
  } else {
    sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 2) & 0x30);
    mn = (s[j + 4] >> 4) | ((s[j] >> 2) & 0x30);
  }
}

inline void deq_q4_k(const uint8_t* b, float* y) {
  const float d = half(b), dmin = half(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* qs = b + 16;
  for (int j = 0; j < 8; ++j) {
    uint8_t sc, mn;
    scale_min_k4(scales, j, sc, mn);
    const float dj = d * static_cast<float>(sc), mj = dmin * static_cast<float>(mn);
    const uint8_t* q = qs + 32 * (j / 2);
    const int shift = 4 * (j % 2);
    float* out = y + 32 * j;
    for (int i = 0; i < 32; ++i) out[i] = dj * static_cast<float>((q[i] >> shift) & 0x0F) - mj;
  }
}

inline void deq_q5_k(const uint8_t* b, float* y) {
  const float d = half(b), dmin = half(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* qh = b + 16;
  const uint8_t* qs = b + 48;
  for (int j = 0; j < 8; ++j) {
    uint8_t sc, mn;
    scale_min_k4(scales, j, sc, mn);
    const float dj = d * static_cast<float>(sc), mj = dmin * static_cast<float>(mn);
    const uint8_t* q = qs + 32 * (j / 2);
    const int shift = 4 * (j % 2);
    float* out = y + 32 * j;
    for (int i = 0; i < 32; ++i) {
      const int v = ((q[i] >> shift) & 0x0F) | (((qh[i] >> j) & 1) << 4);
      out[i] = dj * static_cast<float>(v) - mj;
    }
  }
}

inline void deq_q6_k(const uint8_t* b, float* y) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const int8_t* scales = reinterpret_cast<const int8_t*>(b + 192);
  const float d = half(b + 208);
  for (int e = 0; e < 256; e += 16) {  // 16 elements share one scale
    const float ds = d * static_cast<float>(scales[e / 16]);
    for (int k = e; k < e + 16; ++k) {
      const int h = k / 128, r = k % 128;
      const int lo = (ql[64 * h + r % 64] >> (4 * (r / 64))) & 0x0F;
      const int hi = (qh[32 * h + r % 32] >> (2 * (r / 32))) & 0x03;
      y[k] = ds * static_cast<float>((lo | (hi << 4)) - 32);
    }
  }
}

// One weight row (K elements) -> floats.
void deq_row(const uint8_t* row, int64_t t, int64_t K, float* y) {
  switch (t) {
    case F32:
      std::memcpy(y, row, K * sizeof(float));
      return;
    case F16:
      for (int64_t i = 0; i < K; ++i) y[i] = half(row + 2 * i);
      return;
    case BF16:
      for (int64_t i = 0; i < K; ++i) {
        uint16_t h;
        std::memcpy(&h, row + 2 * i, 2);
        const uint32_t w = static_cast<uint32_t>(h) << 16;
        std::memcpy(y + i, &w, 4);
      }
      return;
    case Q4_0:
      for (int64_t i = 0; i < K / 32; ++i) deq_q4_0(row + 18 * i, y + 32 * i);
      return;
    case Q4_1:
      for (int64_t i = 0; i < K / 32; ++i) deq_q4_1(row + 20 * i, y + 32 * i);
      return;
    case Q8_0:
      for (int64_t i = 0; i < K / 32; ++i) deq_q8_0(row + 34 * i, y + 32 * i);
      return;
    case Q4_K:
      for (int64_t i = 0; i < K / 256; ++i) deq_q4_k(row + 144 * i, y + 256 * i);
      return;
    case Q5_K:
      for (int64_t i = 0; i < K / 256; ++i) deq_q5_k(row + 176 * i, y + 256 * i);
      return;
    case Q6_K:
      for (int64_t i = 0; i < K / 256; ++i) deq_q6_k(row + 210 * i, y + 256 * i);
      return;
    default:
      return;
  }
}

// --- dot products ------------------------------------------------------------------------------

#ifdef PQ_AVX2
using simd::hsum;  // simd.inc, put before this source by kernel.build_and_load
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


// --- fused path for 1-4 activation rows: each 32-element chunk is dequantized into four
// registers and multiplied at once (no scratch round trip) --------------------------------------

#ifdef PQ_AVX2
// 16 bytes of nibbles -> the 32 values 0..15 as int32, in element order (bytes 0-7 and 8-15
// widened to 32 bits: the low nibbles are elements 0-15, the high ones 16-31)
inline void nibbles32(const uint8_t* qs, __m256i q[4]) {
  const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs)));
  const __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + 8)));
  const __m256i nib = _mm256_set1_epi32(0x0F);
  q[0] = _mm256_and_si256(b0, nib), q[1] = _mm256_and_si256(b1, nib);
  q[2] = _mm256_srli_epi32(b0, 4), q[3] = _mm256_srli_epi32(b1, 4);
}

// 32 weights of one chunk -> w[0..3]; `scratch` holds a dequantized 256-block for K-quants
template <int64_t QT>
struct Chunker {
  const uint8_t* row;
  float* scratch;  // 256 floats
  inline void get(int64_t c, __m256 w[4]) const {
    switch (QT) {
      case Q4_0: {
        const uint8_t* b = row + 18 * c;
        const __m256 vd = _mm256_set1_ps(half(b));
        __m256i q[4];
        nibbles32(b + 2, q);
        const __m256i eight = _mm256_set1_epi32(8);
        for (int k = 0; k < 4; ++k) w[k] = _mm256_mul_ps(vd, _mm256_cvtepi32_ps(_mm256_sub_epi32(q[k], eight)));
        return;
      }
      case Q4_1: {
        const uint8_t* b = row + 20 * c;
        int32_t dm;  // d and m, both halves converted by one instruction
        std::memcpy(&dm, b, 4);
        const __m128 dm4 = _mm_cvtph_ps(_mm_cvtsi32_si128(dm));
        const __m256 vd = _mm256_broadcastss_ps(dm4), vm = _mm256_broadcastss_ps(_mm_movehdup_ps(dm4));
        __m256i q[4];
        nibbles32(b + 4, q);
        // d * q is exact in float32 (11 by 4 significant bits), so the fused multiply-add
        // rounds d * q + m once, exactly as the gguf package's d * q + m does
        for (int k = 0; k < 4; ++k) w[k] = _mm256_fmadd_ps(vd, _mm256_cvtepi32_ps(q[k]), vm);
        return;
      }
      case Q8_0: {
        const uint8_t* b = row + 34 * c;
        const __m256 vd = _mm256_set1_ps(half(b));
        for (int k = 0; k < 4; ++k) {
          const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 2 + 8 * k));
          w[k] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw)), vd);
        }
        return;
      }
      case F32: {
        const float* f = reinterpret_cast<const float*>(row) + 32 * c;
        for (int k = 0; k < 4; ++k) w[k] = _mm256_loadu_ps(f + 8 * k);
        return;
      }
      case F16: {
        const uint8_t* b = row + 64 * c;
        for (int k = 0; k < 4; ++k)
          w[k] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 16 * k)));
        return;
      }
      case BF16: {
        const uint8_t* b = row + 64 * c;
        for (int k = 0; k < 4; ++k) {
          const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 16 * k));
          w[k] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
        }
        return;
      }
      default: {  // K-quants: a 256-block is dequantized on its first chunk, then read from L1
        if (c % 8 == 0) {
          const int64_t blk = c / 8;
          if (QT == Q4_K) deq_q4_k(row + 144 * blk, scratch);
          else if (QT == Q5_K) deq_q5_k(row + 176 * blk, scratch);
          else deq_q6_k(row + 210 * blk, scratch);
        }
        const float* f = scratch + 32 * (c % 8);
        for (int k = 0; k < 4; ++k) w[k] = _mm256_loadu_ps(f + 8 * k);
        return;
      }
    }
  }
};

// out[r] = dot(W row, x[r]) for r < R (R <= 4); K a multiple of 32
template <int R, class C>
void fused_rows(const C& ch, int64_t K, const float* x, int64_t ldx, float* res, const uint8_t* pf,
                int64_t pf_step) {
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  __m256 w[4];
  for (int64_t c = 0; c < K / 32; ++c) {
    _mm_prefetch(reinterpret_cast<const char*>(pf + pf_step * c), _MM_HINT_T0);
    ch.get(c, w);
    for (int r = 0; r < R; ++r) {
      const float* xr = x + r * ldx + 32 * c;
      acc[r][0] = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xr), acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xr + 8), acc[r][1]);
      acc[r][0] = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xr + 16), acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xr + 24), acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) res[r] = hsum(_mm256_add_ps(acc[r][0], acc[r][1]));
}

constexpr int64_t PF_PAIRS = 4;  // software prefetch distance (pairs of weight rows)

// one activation row against two weight rows (each row's arithmetic exactly as fused_rows<1>):
// four independent FMA chains instead of two
template <class C>
void fused_pair(const C& a, const C& b, int64_t K, const float* x, float* ra, float* rb,
                const uint8_t* pf, int64_t pf_step) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  __m256 b0 = _mm256_setzero_ps(), b1 = _mm256_setzero_ps();
  __m256 wa[4], wb[4];
  for (int64_t c = 0; c < K / 32; ++c) {
    _mm_prefetch(reinterpret_cast<const char*>(pf + pf_step * c), _MM_HINT_T0);
    a.get(c, wa);
    b.get(c, wb);
    const float* xc = x + 32 * c;
    const __m256 x0 = _mm256_loadu_ps(xc), x1 = _mm256_loadu_ps(xc + 8);
    const __m256 x2 = _mm256_loadu_ps(xc + 16), x3 = _mm256_loadu_ps(xc + 24);
    a0 = _mm256_fmadd_ps(wa[0], x0, a0), b0 = _mm256_fmadd_ps(wb[0], x0, b0);
    a1 = _mm256_fmadd_ps(wa[1], x1, a1), b1 = _mm256_fmadd_ps(wb[1], x1, b1);
    a0 = _mm256_fmadd_ps(wa[2], x2, a0), b0 = _mm256_fmadd_ps(wb[2], x2, b0);
    a1 = _mm256_fmadd_ps(wa[3], x3, a1), b1 = _mm256_fmadd_ps(wb[3], x3, b1);
  }
  *ra = hsum(_mm256_add_ps(a0, a1));
  *rb = hsum(_mm256_add_ps(b0, b1));
}

template <int64_t QT>
void pair_t(const uint8_t* row, int64_t rb, float* scratch, int64_t K, const float* x, float* r0, float* r1) {
  // prefetch the pair PF_PAIRS pairs ahead, spread over the chunk loop (2 rb bytes in K / 32 steps)
  fused_pair(Chunker<QT>{row, scratch}, Chunker<QT>{row + rb, scratch + 256}, K, x, r0, r1,
             row + PF_PAIRS * 2 * rb, 2 * rb * 32 / K);
}

// f(std::integral_constant<int64_t, T>{}) for the kernel type T == qtype (the K-quants last)
template <class F>
void with_type(int64_t qtype, const F& f) {
  switch (qtype) {
    case Q4_0: f(std::integral_constant<int64_t, Q4_0>{}); return;
    case Q4_1: f(std::integral_constant<int64_t, Q4_1>{}); return;
    case Q8_0: f(std::integral_constant<int64_t, Q8_0>{}); return;
    case F32: f(std::integral_constant<int64_t, F32>{}); return;
    case F16: f(std::integral_constant<int64_t, F16>{}); return;
    case BF16: f(std::integral_constant<int64_t, BF16>{}); return;
    case Q4_K: f(std::integral_constant<int64_t, Q4_K>{}); return;
    case Q5_K: f(std::integral_constant<int64_t, Q5_K>{}); return;
    default: f(std::integral_constant<int64_t, Q6_K>{}); return;
  }
}

// weight rows n and n + 1 (bytes `row`, `row + rb`) against one activation row; scratch: 512 floats
void fused_pair_rows_avx2(int64_t qtype, const uint8_t* row, int64_t rb, float* scratch, int64_t K,
                          const float* x, float* r0, float* r1) {
  with_type(qtype, [&](auto t) { pair_t<decltype(t)::value>(row, rb, scratch, K, x, r0, r1); });
}

bool fused_ok(int64_t, int64_t K) { return K % 32 == 0; }

template <int64_t QT>
void fused_row_t(const uint8_t* row, int64_t rb, float* scratch, int64_t T, int64_t K, const float* x,
                 float* res) {
  const Chunker<QT> ch{row, scratch};
  const uint8_t* pf = row + PF_PAIRS * 2 * rb;  // the row as many bytes ahead as pair_range's
  const int64_t step = rb * 32 / K;
  switch (T) {
    case 1: fused_rows<1>(ch, K, x, K, res, pf, step); return;
    case 2: fused_rows<2>(ch, K, x, K, res, pf, step); return;
    case 3: fused_rows<3>(ch, K, x, K, res, pf, step); return;
    default: fused_rows<4>(ch, K, x, K, res, pf, step); return;
  }
}

void fused_row_avx2(int64_t qtype, const uint8_t* row, int64_t rb, float* scratch, int64_t T, int64_t K,
                    const float* x, float* res) {
  with_type(qtype, [&](auto t) { fused_row_t<decltype(t)::value>(row, rb, scratch, T, K, x, res); });
}

bool is_k_quant(int64_t t) { return t == Q4_K || t == Q5_K || t == Q6_K; }

// One row (K a multiple of 32) -> floats, through the chunk dequantizer (K-quants: deq_row): the
// tiles of prefill and big batches (qrows), several times faster than the per-type loops.
void deq_row_avx2(const uint8_t* row, int64_t qtype, int64_t K, float* y) {
  with_type(qtype, [&](auto t) {
    constexpr int64_t QT = decltype(t)::value;
    if constexpr (QT == Q4_K || QT == Q5_K || QT == Q6_K) deq_row(row, QT, K, y);
    else {
      const Chunker<QT> ch{row, nullptr};
      __m256 w[4];
      for (int64_t c = 0; c < K / 32; ++c) {
        ch.get(c, w);
        for (int k = 0; k < 4; ++k) _mm256_storeu_ps(y + 32 * c + 8 * k, w[k]);
      }
    }
  });
}

// --- many activation rows, AVX2: the gemm of `z` (below) 8 lanes wide -------------------------
// Panels of 16 weight rows (two ymm per k), 5 broadcast activation rows per pass (10
// accumulators of the 16 ymm registers); the same sequential FMA chain per output.
namespace y {

constexpr int64_t PN = 16;
constexpr int RB = 5;

// 8 x 8 floats: r[i] (row i) -> r[j] (column j)
inline void transpose8(__m256 r[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
    r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
  }
}

// rows [0, rows) of a panel (the rest zeros) -> wt [K][16]
template <int64_t QT>
void panel_f32(const uint8_t* w, int64_t rb, int64_t rows, int64_t K, float* ks, float* wt) {
  for (int64_t g = 0; g < PN; g += 8)
    for (int64_t c = 0; c < K / 32; ++c) {
      __m256 q[4][8];  // q[quarter][row]: weights 8 * quarter .. + 8 of the chunk
      for (int i = 0; i < 8; ++i) {
        const int64_t n = g + i;
        __m256 v[4];
        if (n < rows) Chunker<QT>{w + n * rb, ks + n * 256}.get(c, v);
        else v[0] = v[1] = v[2] = v[3] = _mm256_setzero_ps();
        for (int k = 0; k < 4; ++k) q[k][i] = v[k];
      }
      for (int k = 0; k < 4; ++k) {
        transpose8(q[k]);
        for (int j = 0; j < 8; ++j) _mm256_storeu_ps(wt + (32 * c + 8 * k + j) * PN + g, q[k][j]);
      }
    }
}

template <int R>
inline void gemm_rows(const float* wt, int64_t K, const float* x, float* out, int64_t ldo, int64_t cols) {
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m256 w0 = _mm256_loadu_ps(wt + k * PN), w1 = _mm256_loadu_ps(wt + k * PN + 8);
    for (int r = 0; r < R; ++r) {
      const __m256 b = _mm256_broadcast_ss(x + r * K + k);
      acc[r][0] = _mm256_fmadd_ps(w0, b, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(w1, b, acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    if (cols == PN) {
      _mm256_storeu_ps(out + r * ldo, acc[r][0]);
      _mm256_storeu_ps(out + r * ldo + 8, acc[r][1]);
    } else {  // the last panel of a segment
      alignas(32) float tmp[PN];
      _mm256_store_ps(tmp, acc[r][0]);
      _mm256_store_ps(tmp + 8, acc[r][1]);
      std::memcpy(out + r * ldo, tmp, cols * sizeof(float));
    }
  }
}

void gemm(int64_t qtype, const uint8_t* wp, int64_t rb, int64_t N, int64_t T, int64_t K, const float* x,
          float* out, int64_t ldo) {
  const int64_t panels = (N + PN - 1) / PN;
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    std::vector<float> wt(K * PN), ks(PN * 256);
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n0 = p * PN, rows = std::min<int64_t>(PN, N - n0);
      if (p + 1 < p1) {  // the next panel's bytes towards L2 while this one computes
        const char* nx = reinterpret_cast<const char*>(wp + (n0 + PN) * rb);
        const int64_t bytes = std::min<int64_t>(PN, N - n0 - PN) * rb;
        for (int64_t i = 0; i < bytes; i += 64) _mm_prefetch(nx + i, _MM_HINT_T1);
      }
      with_type(qtype, [&](auto t) {
        panel_f32<decltype(t)::value>(wp + n0 * rb, rb, rows, K, ks.data(), wt.data());
      });
      float* o = out + n0;
      int64_t r = 0;
      for (; r + RB <= T; r += RB) gemm_rows<RB>(wt.data(), K, x + r * K, o + r * ldo, ldo, rows);
      switch (T - r) {
        case 4: gemm_rows<4>(wt.data(), K, x + r * K, o + r * ldo, ldo, rows); break;
        case 3: gemm_rows<3>(wt.data(), K, x + r * K, o + r * ldo, ldo, rows); break;
        case 2: gemm_rows<2>(wt.data(), K, x + r * K, o + r * ldo, ldo, rows); break;
        case 1: gemm_rows<1>(wt.data(), K, x + r * K, o + r * ldo, ldo, rows); break;
        default: break;
      }
    }
  });
}

}  // namespace y

// The widest path the fused kernels may take (tests and benchmarks lower it to compare paths):
// 2 = AVX-512 where the CPU has it, 1 = AVX2. Op: pagedkv_q.limit_isa(level) -> previous level.
std::atomic<int64_t> isa_limit{2};

int64_t limit_isa(int64_t level) {
  TORCH_CHECK(level == 1 || level == 2, "limit_isa: level must be 1 (AVX2) or 2 (AVX-512)");
  return isa_limit.exchange(level);
}

// --- the same fused paths with AVX-512 (16 lanes), where the CPU has it -------------------------
// Compiled with a target pragma and chosen at run time, so the build flags (and the build
// cache's name) stay AVX2's. A chunk of 32 weights is two zmm (elements 0-15, 16-31), and a
// row's sum is two FMA chains (one per half) added and reduced at the end: every row of every
// path here (1-4 activation rows, weight-row pairs) does exactly that, so the outputs do not
// depend on how many rows a call has, as with AVX2 (whose lane order differs: a machine's
// results are those of the widest path it has). Dequantizing is the same exact arithmetic.

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl")
namespace z {

template <int64_t QT>
struct Chunker {
  const uint8_t* row;
  float* scratch;  // 256 floats
  inline void get(int64_t c, __m512 w[2]) const {
    switch (QT) {
      case Q4_0: {
        const uint8_t* b = row + 18 * c;
        const __m512 vd = _mm512_set1_ps(half(b));
        const __m512i raw = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2)));
        const __m512i eight = _mm512_set1_epi32(8);
        const __m512i lo = _mm512_and_si512(raw, _mm512_set1_epi32(0x0F)), hi = _mm512_srli_epi32(raw, 4);
        w[0] = _mm512_mul_ps(vd, _mm512_cvtepi32_ps(_mm512_sub_epi32(lo, eight)));
        w[1] = _mm512_mul_ps(vd, _mm512_cvtepi32_ps(_mm512_sub_epi32(hi, eight)));
        return;
      }
      case Q4_1: {
        const uint8_t* b = row + 20 * c;
        int32_t dm;
        std::memcpy(&dm, b, 4);
        const __m128 dm4 = _mm_cvtph_ps(_mm_cvtsi32_si128(dm));
        const __m512 vd = _mm512_broadcastss_ps(dm4), vm = _mm512_broadcastss_ps(_mm_movehdup_ps(dm4));
        const __m512i raw = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 4)));
        const __m512i lo = _mm512_and_si512(raw, _mm512_set1_epi32(0x0F)), hi = _mm512_srli_epi32(raw, 4);
        // d * q is exact in float32: the FMA rounds d * q + m once, as gguf's d * q + m does
        w[0] = _mm512_fmadd_ps(vd, _mm512_cvtepi32_ps(lo), vm);
        w[1] = _mm512_fmadd_ps(vd, _mm512_cvtepi32_ps(hi), vm);
        return;
      }
      case Q8_0: {
        const uint8_t* b = row + 34 * c;
        const __m512 vd = _mm512_set1_ps(half(b));
        for (int k = 0; k < 2; ++k) {
          const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2 + 16 * k));
          w[k] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(raw)), vd);
        }
        return;
      }
      case F32: {
        const float* f = reinterpret_cast<const float*>(row) + 32 * c;
        w[0] = _mm512_loadu_ps(f), w[1] = _mm512_loadu_ps(f + 16);
        return;
      }
      case F16: {
        const uint8_t* b = row + 64 * c;
        for (int k = 0; k < 2; ++k)
          w[k] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 32 * k)));
        return;
      }
      case BF16: {
        const uint8_t* b = row + 64 * c;
        for (int k = 0; k < 2; ++k) {
          const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 32 * k));
          w[k] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
        }
        return;
      }
      default: {  // K-quants: a 256-block dequantized on its first chunk, then read from L1
        if (c % 8 == 0) {
          const int64_t blk = c / 8;
          if (QT == Q4_K) deq_q4_k(row + 144 * blk, scratch);
          else if (QT == Q5_K) deq_q5_k(row + 176 * blk, scratch);
          else deq_q6_k(row + 210 * blk, scratch);
        }
        const float* f = scratch + 32 * (c % 8);
        w[0] = _mm512_loadu_ps(f), w[1] = _mm512_loadu_ps(f + 16);
        return;
      }
    }
  }
};

inline float sum(__m512 a, __m512 b) { return _mm512_reduce_add_ps(_mm512_add_ps(a, b)); }

// out[r] = dot(W row, x[r]) for r < R (R <= 4); K a multiple of 32
template <int R, class C>
void rows(const C& ch, int64_t K, const float* x, int64_t ldx, float* res, const uint8_t* pf, int64_t pf_step) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  __m512 w[2];
  for (int64_t c = 0; c < K / 32; ++c) {
    _mm_prefetch(reinterpret_cast<const char*>(pf + pf_step * c), _MM_HINT_T0);
    ch.get(c, w);
    for (int r = 0; r < R; ++r) {
      const float* xr = x + r * ldx + 32 * c;
      acc[r][0] = _mm512_fmadd_ps(w[0], _mm512_loadu_ps(xr), acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(w[1], _mm512_loadu_ps(xr + 16), acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) res[r] = sum(acc[r][0], acc[r][1]);
}

// one activation row against two weight rows (each row's arithmetic exactly as rows<1>)
template <class C>
void pair(const C& a, const C& b, int64_t K, const float* x, float* ra, float* rb, const uint8_t* pf,
          int64_t pf_step) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, b0 = a0, b1 = a0;
  __m512 wa[2], wb[2];
  for (int64_t c = 0; c < K / 32; ++c) {
    _mm_prefetch(reinterpret_cast<const char*>(pf + pf_step * c), _MM_HINT_T0);
    a.get(c, wa);
    b.get(c, wb);
    const __m512 x0 = _mm512_loadu_ps(x + 32 * c), x1 = _mm512_loadu_ps(x + 32 * c + 16);
    a0 = _mm512_fmadd_ps(wa[0], x0, a0), b0 = _mm512_fmadd_ps(wb[0], x0, b0);
    a1 = _mm512_fmadd_ps(wa[1], x1, a1), b1 = _mm512_fmadd_ps(wb[1], x1, b1);
  }
  *ra = sum(a0, a1);
  *rb = sum(b0, b1);
}

void pair_rows(int64_t qtype, const uint8_t* row, int64_t rb, float* scratch, int64_t K, const float* x,
               float* r0, float* r1) {
  with_type(qtype, [&](auto t) {
    constexpr int64_t QT = decltype(t)::value;
    pair(Chunker<QT>{row, scratch}, Chunker<QT>{row + rb, scratch + 256}, K, x, r0, r1,
         row + PF_PAIRS * 2 * rb, 2 * rb * 32 / K);
  });
}

void row(int64_t qtype, const uint8_t* row, int64_t rb, float* scratch, int64_t T, int64_t K, const float* x,
         float* res) {
  with_type(qtype, [&](auto t) {
    const Chunker<decltype(t)::value> ch{row, scratch};
    const uint8_t* pf = row + PF_PAIRS * 2 * rb;
    const int64_t step = rb * 32 / K;
    switch (T) {
      case 1: rows<1>(ch, K, x, K, res, pf, step); return;
      case 2: rows<2>(ch, K, x, K, res, pf, step); return;
      case 3: rows<3>(ch, K, x, K, res, pf, step); return;
      default: rows<4>(ch, K, x, K, res, pf, step); return;
    }
  });
}

void deq_row(const uint8_t* row, int64_t qtype, int64_t K, float* y) {  // as deq_row_avx2
  with_type(qtype, [&](auto t) {
    constexpr int64_t QT = decltype(t)::value;
    if constexpr (QT == Q4_K || QT == Q5_K || QT == Q6_K) {
      ::deq_row(row, QT, K, y);
    } else {
      const Chunker<QT> ch{row, nullptr};
      __m512 w[2];
      for (int64_t c = 0; c < K / 32; ++c) {
        ch.get(c, w);
        _mm512_storeu_ps(y + 32 * c, w[0]);
        _mm512_storeu_ps(y + 32 * c + 16, w[1]);
      }
    }
  });
}

// --- many activation rows (prefill, big batches): gemm ------------------------------------------
// Panels of 32 weight rows are dequantized (exact values) and transposed into a scratch
// wt [K][32] that stays in L1/L2; then, RB activation rows at a time, each x[r][k] is broadcast
// and FMA'd with wt[k] (two zmm: the panel's 32 rows) into 2 RB accumulators. Every output is one
// sequential FMA chain over k: the same bits whatever the row count.

constexpr int64_t PN = 32;  // weight rows per panel
constexpr int RB = 6;       // activation rows per register block

// 16 x 16 floats: r[i] (row i) -> r[j] (column j)
inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);
    r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int h = 0; h < 16; h += 8)
    for (int i = 0; i < 4; ++i) {
      t[h + i] = _mm512_shuffle_f32x4(r[h + i], r[h + i + 4], 0x88);
      t[h + i + 4] = _mm512_shuffle_f32x4(r[h + i], r[h + i + 4], 0xDD);
    }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xDD);
  }
}

// rows [0, rows) of a panel (the rest zeros) -> wt [K][32]: 16 rows' 32-weight chunks are
// dequantized into registers and transposed there (no row-major round trip)
template <int64_t QT>
void panel_f32(const uint8_t* w, int64_t rb, int64_t rows, int64_t K, float* ks, float* wt) {
  for (int64_t g = 0; g < PN; g += 16) {
    for (int64_t c = 0; c < K / 32; ++c) {
      __m512 lo[16], hi[16];
      for (int i = 0; i < 16; ++i) {
        const int64_t n = g + i;
        if (n >= rows) {
          lo[i] = hi[i] = _mm512_setzero_ps();
          continue;
        }
        __m512 v[2];
        Chunker<QT>{w + n * rb, ks + n * 256}.get(c, v);
        lo[i] = v[0], hi[i] = v[1];
      }
      transpose16(lo);
      transpose16(hi);
      float* o = wt + 32 * c * PN + g;
      for (int j = 0; j < 16; ++j) {
        _mm512_storeu_ps(o + j * PN, lo[j]);
        _mm512_storeu_ps(o + (16 + j) * PN, hi[j]);
      }
    }
  }
}

// R activation rows x the panel: out[r * ldo + n] for n < 32 (mask: the panel's real rows)
template <int R>
inline void gemm_rows(const float* wt, int64_t K, const float* x, float* out, int64_t ldo, __mmask16 m0,
                      __mmask16 m1) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m512 w0 = _mm512_loadu_ps(wt + k * PN), w1 = _mm512_loadu_ps(wt + k * PN + 16);
    for (int r = 0; r < R; ++r) {
      const __m512 b = _mm512_set1_ps(x[r * K + k]);
      acc[r][0] = _mm512_fmadd_ps(w0, b, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(w1, b, acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm512_mask_storeu_ps(out + r * ldo, m0, acc[r][0]);
    _mm512_mask_storeu_ps(out + r * ldo + 16, m1, acc[r][1]);
  }
}

// out[:, n] for the weight rows n of [0, N), T > 0 rows; K a multiple of 32
void gemm(int64_t qtype, const uint8_t* wp, int64_t rb, int64_t N, int64_t T, int64_t K, const float* x,
          float* out, int64_t ldo) {
  const int64_t panels = (N + PN - 1) / PN;
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    std::vector<float> wt(K * PN), ks(PN * 256);
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n0 = p * PN, rows = std::min<int64_t>(PN, N - n0);
      if (p + 1 < p1) {  // the next panel's bytes towards L2 while this one computes
        const char* nx = reinterpret_cast<const char*>(wp + (n0 + PN) * rb);
        const int64_t bytes = std::min<int64_t>(PN, N - n0 - PN) * rb;
        for (int64_t i = 0; i < bytes; i += 64) _mm_prefetch(nx + i, _MM_HINT_T1);
      }
      with_type(qtype, [&](auto t) {
        panel_f32<decltype(t)::value>(wp + n0 * rb, rb, rows, K, ks.data(), wt.data());
      });
      const __mmask16 m0 = static_cast<__mmask16>(rows >= 16 ? 0xFFFF : (1u << rows) - 1);
      const __mmask16 m1 = static_cast<__mmask16>(rows >= 32 ? 0xFFFF : rows <= 16 ? 0 : (1u << (rows - 16)) - 1);
      float* o = out + n0;
      int64_t r = 0;
      for (; r + RB <= T; r += RB) gemm_rows<RB>(wt.data(), K, x + r * K, o + r * ldo, ldo, m0, m1);
      switch (T - r) {
        case 5: gemm_rows<5>(wt.data(), K, x + r * K, o + r * ldo, ldo, m0, m1); break;
        case 4: gemm_rows<4>(wt.data(), K, x + r * K, o + r * ldo, ldo, m0, m1); break;
        case 3: gemm_rows<3>(wt.data(), K, x + r * K, o + r * ldo, ldo, m0, m1); break;
        case 2: gemm_rows<2>(wt.data(), K, x + r * K, o + r * ldo, ldo, m0, m1); break;
        case 1: gemm_rows<1>(wt.data(), K, x + r * K, o + r * ldo, ldo, m0, m1); break;
        default: break;
      }
    }
  });
}

}  // namespace z
#pragma GCC pop_options

bool has_avx512() {
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
  return ok && isa_limit.load(std::memory_order_relaxed) >= 2;
}

void fused_pair_rows(int64_t qtype, const uint8_t* row, int64_t rb, float* scratch, int64_t K,
                     const float* x, float* r0, float* r1) {
  if (has_avx512()) z::pair_rows(qtype, row, rb, scratch, K, x, r0, r1);
  else fused_pair_rows_avx2(qtype, row, rb, scratch, K, x, r0, r1);
}

void fused_row(int64_t qtype, const uint8_t* row, int64_t rb, float* scratch, int64_t T, int64_t K,
               const float* x, float* res) {
  if (has_avx512()) z::row(qtype, row, rb, scratch, T, K, x, res);
  else fused_row_avx2(qtype, row, rb, scratch, T, K, x, res);
}

// deq_row, through the chunk dequantizers where they apply (same values)
void deq_row_fast(const uint8_t* row, int64_t qtype, int64_t K, float* y) {
  if (K % 32 != 0 || is_k_quant(qtype)) deq_row(row, qtype, K, y);
  else if (has_avx512()) z::deq_row(row, qtype, K, y);
  else deq_row_avx2(row, qtype, K, y);
}
#else
int64_t limit_isa(int64_t level) { return level; }  // nothing to limit: the scalar path
void deq_row_fast(const uint8_t* row, int64_t qtype, int64_t K, float* y) { deq_row(row, qtype, K, y); }
bool fused_ok(int64_t, int64_t) { return false; }
void fused_row(int64_t, const uint8_t*, int64_t, float*, int64_t, int64_t, const float*, float*) {}
void fused_pair_rows(int64_t, const uint8_t*, int64_t, float*, int64_t, const float*, float*, float*) {}
#endif

// weight rows [n0, n1) against one activation row, two rows at a time
__attribute__((noinline)) void pair_range(int64_t qtype, const uint8_t* wp, int64_t rb, int64_t n0, int64_t n1,
                                          int64_t K, const float* xp, float* op) {
  float buf[512];
  int64_t n = n0;
  for (; n + 2 <= n1; n += 2) fused_pair_rows(qtype, wp + n * rb, rb, buf, K, xp, op + n, op + n + 1);
  if (n < n1) fused_row(qtype, wp + n * rb, rb, buf, 1, K, xp, op + n);
}

// weight rows [n0, n1) against T activation rows: the fused path in groups of 4 rows while the
// weight row stays in L1, or (K not a multiple of 32) the row dequantized into a scratch first
__attribute__((noinline)) void row_range(int64_t qtype, const uint8_t* wp, int64_t rb, int64_t n0, int64_t n1,
                                         int64_t T, int64_t K, const float* xp, float* op, int64_t ldo,
                                         bool fused) {
  std::vector<float> buf(fused ? 256 : K);
  float r[4];
  for (int64_t n = n0; n < n1; ++n) {
    if (fused) {
      for (int64_t t = 0; t < T; t += 4) {
        const int64_t m = std::min<int64_t>(4, T - t);
        fused_row(qtype, wp + n * rb, rb, buf.data(), m, K, xp + t * K, r);
        for (int64_t i = 0; i < m; ++i) op[(t + i) * ldo + n] = r[i];
      }
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
  Layout l;
  TORCH_CHECK(layout_of(qtype, l), "qmatmul: unsupported ggml type ", qtype);
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(),
              "weight must be a contiguous uint8 [N, row_bytes] tensor");
  TORCH_CHECK(K > 0 && K % l.block == 0 && w.size(1) == K / l.block * l.bytes,
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
  // one activation row: weight rows in pairs (see fused_pair), except Q8_0, where pairs
  // measured 3-4x slower on a large matrix streamed from memory (SmolLM2's LM head)
  const bool pairs = fused && T == 1 && qtype != Q8_0;
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
  m.def("has_gemm() -> bool", &has_gemm);
}

TORCH_LIBRARY_IMPL(pagedkv_q, CPU, m) {
  m.impl("qmatmul", &qmatmul);
  m.impl("qgemm", &qgemm);
  m.impl("qrows", &qrows);
}
