// Paged decode attention for CPU: one query token per sequence attends to its cached K/V,
// read block by block through the block table (never copied into a contiguous buffer).
//
// Work item = one sequence (or a split of its tokens when the batch is too small to occupy the
// thread pool). The item keeps its Hq query heads in float32 and walks the sequence's tokens in
// tiles of TILE rows: each K row is loaded from memory once and scored against the G = Hq / Hkv
// query heads of each kv head (GQA); an online softmax (running max m, sum l) is updated per
// query head; then each V row is loaded once and accumulated into the G outputs of its kv head.
// Everything is float32 inside; bf16/fp16 rows are widened on load into a per-tile buffer, and
// quantized rows (int8 or fp8 e4m3, one float32 scale per token and kv head) are converted in
// registers, 8 values at a time, with the scales applied to scores and softmax weights: the
// sequence is never copied or dequantized as a whole.
//
// Built by pagedkv/attention/kernel.py with torch.utils.cpp_extension.load_inline and only the
// light headers below (no torch/extension.h, no pybind11) to keep the first compile short; the op
// is registered with the dispatcher as torch.ops.pagedkv_attn.paged_decode. AVX2/FMA/F16C paths
// are used when the build enables them (kernel.py checks the CPU), scalar code otherwise.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PKV_AVX2 1
#endif

namespace {

// Tokens per online-softmax step: large enough to amortize the max/exp/rescale work per head,
// small enough that the tile's rows, re-read once per query head, stay in L1/L2.
#ifndef PKV_TILE
#define PKV_TILE 32
#endif
constexpr int64_t TILE = PKV_TILE;
static_assert(TILE % 8 == 0, "softcap_tile works on whole 8-score vectors of a tile");
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

// ---------------------------------------------------------------------------------------------
// Row loads: cache element -> float. For float32 rows the cache memory is used in place.

inline void widen(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
  int64_t i = 0;
#ifdef PKV_AVX2
  for (; i + 8 <= n; i += 8) {
    // bf16 is the top half of a float32: zero-extend to 32 bits and shift into place
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
    __m256i w = _mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16);
    _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(w));
  }
#endif
  for (; i < n; ++i) {
    uint32_t bits = static_cast<uint32_t>(s[i]) << 16;
    std::memcpy(dst + i, &bits, sizeof(float));
  }
}

inline void widen(const c10::Half* src, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(PKV_AVX2) && defined(__F16C__)
  for (; i + 8 <= n; i += 8) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
  }
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// fp8 e4m3 bytes become IEEE half bits by moving the sign to bit 15 and the exponent/mantissa up
// by 7 (exact, subnormals included); the half value is then 2^-8 of the fp8 value, so FP8_SCALE
// is multiplied into the row's scale.
struct Fp8 {
  uint8_t bits;
};
constexpr float FP8_SCALE = 256.0f;

inline uint16_t fp8_half_bits(uint8_t b) {
  return static_cast<uint16_t>(((b & 0x80u) << 8) | ((b & 0x7Fu) << 7));
}

// Query rows and outputs are touched once per work item, so a runtime dtype switch is enough.
void load_any(const void* src, at::ScalarType t, float* dst, int64_t n) {
  switch (t) {
    case at::kFloat:
      std::memcpy(dst, src, n * sizeof(float));
      break;
    case at::kBFloat16:
      widen(static_cast<const c10::BFloat16*>(src), dst, n);
      break;
    case at::kHalf:
      widen(static_cast<const c10::Half*>(src), dst, n);
      break;
    default:
      TORCH_CHECK(false, "paged_decode: unsupported dtype ", t);
  }
}

void store_any(const float* src, void* dst, at::ScalarType t, int64_t n) {
  switch (t) {
    case at::kFloat:
      std::memcpy(dst, src, n * sizeof(float));
      break;
    case at::kBFloat16: {
      auto* d = static_cast<c10::BFloat16*>(dst);
      for (int64_t i = 0; i < n; ++i) d[i] = c10::BFloat16(src[i]);  // round to nearest even
      break;
    }
    case at::kHalf: {
      auto* d = static_cast<c10::Half*>(dst);
      for (int64_t i = 0; i < n; ++i) d[i] = c10::Half(src[i]);
      break;
    }
    default:
      TORCH_CHECK(false, "paged_decode: unsupported dtype ", t);
  }
}

// ---------------------------------------------------------------------------------------------
// Small vector helpers (AVX2 + FMA when compiled for it, scalar otherwise).

#ifdef PKV_AVX2
using simd::hsum;  // simd.inc, put before this source by kernel.build_and_load

// exp(x) for x <= 0-ish: Cody-Waite reduction x = n ln2 + r, |r| <= ln2/2, then a degree-6
// Taylor polynomial (relative error ~1e-7, below float32 rounding of the final sums). x is
// clamped to [-87, 88] so 2^n stays a normal float: exp(-inf) becomes ~1.6e-38, negligible
// next to the softmax denominator, which is always >= 1 after max subtraction.
inline __m256 exp256(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  x = _mm256_min_ps(x, _mm256_set1_ps(88.0f));
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720.0f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

inline float dot(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  float s = 0.0f;
#ifdef PKV_AVX2
  __m256 acc0 = _mm256_setzero_ps();
  __m256 acc1 = _mm256_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
  }
  for (; i + 8 <= n; i += 8) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
  }
  s = hsum(_mm256_add_ps(acc0, acc1));
#endif
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// y += a * x
inline void axpy(float a, const float* x, float* y, int64_t n) {
  int64_t i = 0;
#ifdef PKV_AVX2
  __m256 va = _mm256_set1_ps(a);
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
  }
#endif
  for (; i < n; ++i) y[i] += a * x[i];
}

inline void prefetch(const void* p) {
#if defined(__GNUC__)
#ifndef PKV_PF_LOCALITY
#define PKV_PF_LOCALITY 3
#endif
#if PKV_PF_LOCALITY >= 0
  __builtin_prefetch(p, 0, PKV_PF_LOCALITY);
#endif
#endif
}

inline void scale_inplace(float a, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] *= a;
}

// s[i] = cap * tanh(s[i] / cap) for i < n8, n8 a multiple of 8 (Gemma 2's attention logit
// soft-capping), to float32's relative accuracy whatever the cap: for |y| < 0.4 tanh's odd
// series to y^11 (the first term left out, 2.4e-8 at 0.4, is below half an ulp), above
// (1 - e) / (1 + e) with e = exp(-2|y|) <= 0.45 (no cancellation; exp256 clamps, so large |y|
// give exactly +-1). Every score goes through the same vector code (the scratch row is TILE
// wide), so a score does not depend on where a tile ends.
inline void softcap_tile(float* s, float cap, int64_t n8) {
  int64_t i = 0;
#ifdef PKV_AVX2
  const __m256 inv = _mm256_set1_ps(1.0f / cap), vcap = _mm256_set1_ps(cap);
  const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f), small = _mm256_set1_ps(0.4f);
  for (; i < n8; i += 8) {
    const __m256 y = _mm256_mul_ps(_mm256_loadu_ps(s + i), inv);
    const __m256 ay = _mm256_andnot_ps(sign, y);
    const __m256 e = exp256(_mm256_mul_ps(ay, _mm256_set1_ps(-2.0f)));
    const __m256 big = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));
    const __m256 y2 = _mm256_mul_ps(y, y);
    __m256 p = _mm256_set1_ps(-1382.0f / 155925.0f);
    p = _mm256_fmadd_ps(p, y2, _mm256_set1_ps(62.0f / 2835.0f));
    p = _mm256_fmadd_ps(p, y2, _mm256_set1_ps(-17.0f / 315.0f));
    p = _mm256_fmadd_ps(p, y2, _mm256_set1_ps(2.0f / 15.0f));
    p = _mm256_fmadd_ps(p, y2, _mm256_set1_ps(-1.0f / 3.0f));
    p = _mm256_fmadd_ps(_mm256_mul_ps(p, y2), y, y);  // y + y^3 (...)
    const __m256 t = _mm256_blendv_ps(_mm256_or_ps(big, _mm256_and_ps(sign, y)), p,
                                      _mm256_cmp_ps(ay, small, _CMP_LT_OQ));
    _mm256_storeu_ps(s + i, _mm256_mul_ps(vcap, t));
  }
#endif
  for (; i < n8; ++i) s[i] = cap * std::tanh(s[i] / cap);
}

// s[i] = exp(s[i] - m) for i < n; returns their sum.
inline float exp_sub_sum(float* s, float m, int64_t n) {
  float sum = 0.0f;
  int64_t i = 0;
#ifdef PKV_AVX2
  __m256 vm = _mm256_set1_ps(m);
  __m256 vs = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + i), vm));
    _mm256_storeu_ps(s + i, e);
    vs = _mm256_add_ps(vs, e);
  }
  sum = hsum(vs);
#endif
  for (; i < n; ++i) {
    s[i] = std::exp(s[i] - m);
    sum += s[i];
  }
  return sum;
}

// ---------------------------------------------------------------------------------------------
// Tile kernels. A tile is n <= TILE token rows given as pointers: float ones (straight into a
// float32 cache, or into a widened copy for bf16/fp16) or a quantized cache's own rows (int8,
// fp8); `off` selects the kv head inside a row.

#ifdef PKV_AVX2
// Lane j of the result = sum of the 8 lanes of a_j (8 dot products finished at once, cheaper
// than 8 separate horizontal sums).
inline __m256 hsum8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5,
                    __m256 a6, __m256 a7) {
  __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
  // u0 = [a0..a3 low-half sums | a0..a3 high-half sums], u1 likewise for a4..a7
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
#endif

// Element loads of a tile's rows, one struct per row type T: float32 rows (straight into a
// float32 cache, or a widened copy for bf16/fp16) and quantized ones (int8, fp8: K and V rows
// read as bytes and converted to float in registers, 8 values at a time; the per-(token, kv
// head) scales are applied to the 8-token score vector (K) and folded into the softmax weights
// (V), never to the rows themselves). One score kernel and one value kernel below serve all.
//   one(p): the value at p; eight(p): 8 values (kVec: whether the vector paths may be used);
//   dot(q, r, D): a score outside the 8-token groups (its own summation order per type)

template <typename T>
struct RowLoad;

template <>
struct RowLoad<float> {
  static float one(const float* p) { return *p; }
  static float dot(const float* q, const float* r, int64_t D) { return ::dot(q, r, D); }
#ifdef PKV_AVX2
  static constexpr bool kVec = true;
  static __m256 eight(const float* p) { return _mm256_loadu_ps(p); }
#endif
};

template <typename T>
float scalar_dot(const float* q, const T* r, int64_t D) {
  float acc = 0.0f;
  for (int64_t d = 0; d < D; ++d) acc += q[d] * RowLoad<T>::one(r + d);
  return acc;
}

template <>
struct RowLoad<int8_t> {
  static float one(const int8_t* p) { return static_cast<float>(*p); }
  static float dot(const float* q, const int8_t* r, int64_t D) { return scalar_dot(q, r, D); }
#ifdef PKV_AVX2
  static constexpr bool kVec = true;
  static __m256 eight(const int8_t* p) {
    return _mm256_cvtepi32_ps(
        _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
#endif
};

template <>
struct RowLoad<Fp8> {
  // the value / FP8_SCALE (the caller multiplies FP8_SCALE into the scale)
  static float one(const Fp8* p) { return c10::detail::fp16_ieee_to_fp32_value(fp8_half_bits(p->bits)); }
  static float dot(const float* q, const Fp8* r, int64_t D) { return scalar_dot(q, r, D); }
#if defined(PKV_AVX2) && defined(__F16C__)
  static constexpr bool kVec = true;
  static __m256 eight(const Fp8* p) {
    __m128i x = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(x, _mm_set1_epi16(0x80)), 8),
                             _mm_slli_epi16(_mm_and_si128(x, _mm_set1_epi16(0x7F)), 7));
    return _mm256_cvtph_ps(h);
  }
#elif defined(PKV_AVX2)
  static constexpr bool kVec = false;
  static __m256 eight(const Fp8*) { return _mm256_setzero_ps(); }  // never called
#endif
};

// float16 / bfloat16 rows read in place, converted in registers 8 at a time (exactly: every
// value of both types is a float32), so a tile's rows are never widened into a copy first; a
// score outside the 8-token groups widens its one row and takes float32's dot, so every score
// has the bits of the widened path. A 40-sequence step of 85 tokens, 8 kv heads of 128 (Zen 4,
// 2 threads): float16 1.0 ms a layer widened, the same float32 cache 0.93.
template <typename H>
struct HalfRowLoad {
  static float one(const H* p) { return static_cast<float>(*p); }
  static float dot(const float* q, const H* r, int64_t D) {
    float t[256];
    std::vector<float> big(D > 256 ? D : 0);
    float* w = D > 256 ? big.data() : t;
    widen(r, w, D);
    return ::dot(q, w, D);
  }
};

template <>
struct RowLoad<c10::Half> : HalfRowLoad<c10::Half> {
#if defined(PKV_AVX2) && defined(__F16C__)
  static constexpr bool kVec = true;
  static __m256 eight(const c10::Half* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
#elif defined(PKV_AVX2)
  static constexpr bool kVec = false;
  static __m256 eight(const c10::Half*) { return _mm256_setzero_ps(); }  // never called
#endif
};

template <>
struct RowLoad<c10::BFloat16> : HalfRowLoad<c10::BFloat16> {
#ifdef PKV_AVX2
  static constexpr bool kVec = true;
  static __m256 eight(const c10::BFloat16* p) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  }
#endif
};

// s[i] = q . rows[i][off : off + D] for i < n (quantized rows: raw, unscaled)
template <typename T>
inline void score_tile(const float* q, const T* const* rows, int64_t off, int64_t n, int64_t D,
                       float* s) {
  int64_t i = 0;
#ifdef PKV_AVX2
  if constexpr (RowLoad<T>::kVec) {
    if (D % 8 == 0) {
      // 8 tokens at a time: 8 independent FMA chains hide the FMA latency, and q is loaded
      // once per 8 tokens instead of once per token.
      for (; i + 8 <= n; i += 8) {
        __m256 a[8];
        for (int j = 0; j < 8; ++j) a[j] = _mm256_setzero_ps();
        for (int64_t d = 0; d < D; d += 8) {
          const __m256 qv = _mm256_loadu_ps(q + d);
          for (int j = 0; j < 8; ++j) {
            a[j] = _mm256_fmadd_ps(qv, RowLoad<T>::eight(rows[i + j] + off + d), a[j]);
          }
        }
        _mm256_storeu_ps(s + i, hsum8(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]));
      }
    }
  }
#endif
  for (; i < n; ++i) s[i] = RowLoad<T>::dot(q, rows[i] + off, D);
}

#ifdef PKV_AVX2
// acc[0 : 8R] += sum_i p[i] * rows[i][off : off + 8R], the accumulator held in R registers
// across the whole tile (instead of a load + store of acc per token).
template <typename T, int R>
inline void pv_block(const float* p, const T* const* rows, int64_t off, int64_t n, float* acc) {
  __m256 c[R];
  for (int r = 0; r < R; ++r) c[r] = _mm256_loadu_ps(acc + 8 * r);
  for (int64_t i = 0; i < n; ++i) {
    const __m256 pi = _mm256_set1_ps(p[i]);
    const T* v = rows[i] + off;
    for (int r = 0; r < R; ++r) c[r] = _mm256_fmadd_ps(pi, RowLoad<T>::eight(v + 8 * r), c[r]);
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(acc + 8 * r, c[r]);
}
#endif

// acc[0 : D] += sum_i w[i] * rows[i][off : off + D] (quantized rows: raw; w carries the scales)
template <typename T>
inline void pv_tile(const float* w, const T* const* rows, int64_t off, int64_t n, int64_t D,
                    float* acc) {
  int64_t d = 0;
#ifdef PKV_AVX2
  if constexpr (RowLoad<T>::kVec) {
    for (; d + 64 <= D; d += 64) pv_block<T, 8>(w, rows, off + d, n, acc + d);
    for (; d + 32 <= D; d += 32) pv_block<T, 4>(w, rows, off + d, n, acc + d);
    for (; d + 8 <= D; d += 8) pv_block<T, 1>(w, rows, off + d, n, acc + d);
  }
#endif
  for (int64_t i = 0; i < n && d < D; ++i) {
    const T* v = rows[i] + off;
    for (int64_t e = d; e < D; ++e) acc[e] += w[i] * RowLoad<T>::one(v + e);
  }
}

// ---------------------------------------------------------------------------------------------

struct Problem {
  const void* q;  // [B, Hq, D], last dim contiguous
  at::ScalarType q_dtype;
  int64_t q_sb, q_sh;  // strides in elements
  const void* k;  // [N, bs, Hkv, D] contiguous
  const void* v;
  const float* k_scale;  // [N, bs, Hkv] for quantized caches, else nullptr
  const float* v_scale;
  const int32_t* block_tables;  // [B, max_blocks] contiguous
  int64_t bt_stride;
  const int32_t* seq_lens;  // [B]
  int64_t B, Hq, Hkv, G, D, bs;
  float scale;
  int64_t window;  // > 0: attend to the last `window` tokens only (sliding window); 0: all
  float softcap;  // > 0: scores become softcap * tanh(score / softcap) (Gemma 2); 0: none

  // First position sequence b attends to: the window's start, or 0.
  int64_t start(int64_t b) const {
    return window > 0 ? std::max<int64_t>(0, seq_lens[b] - window) : 0;
  }
};

// Per-thread scratch, reused across the work items a thread runs.
struct Scratch {
  std::vector<float> qf, acc, scores, ktile, vtile, m, l;
  std::vector<int64_t> rows;
  std::vector<const float*> kptr, vptr;
  // quantized tiles: raw row pointers, scales [Hkv][TILE], weighted probabilities [TILE]
  std::vector<const void*> kraw, vraw;
  std::vector<float> ks, vs, w;
  Scratch(int64_t Hq, int64_t Hkv, int64_t D, bool widen_rows)
      : qf(Hq * D),
        acc(Hq * D),
        scores(Hq * TILE),
        ktile(widen_rows ? TILE * Hkv * D : 0),
        vtile(widen_rows ? TILE * Hkv * D : 0),
        m(Hq),
        l(Hq),
        rows(2 * TILE),
        kptr(TILE),
        vptr(TILE),
        kraw(TILE),
        vraw(TILE),
        ks(Hkv * TILE),
        vs(Hkv * TILE),
        w(TILE) {}
};

template <typename T>
constexpr bool kQuantized = std::is_same<T, int8_t>::value || std::is_same<T, Fp8>::value;

// 16-bit float rows read in place through RowLoad (the vector code: AVX2, F16C for float16)
template <typename T>
constexpr bool kDirect = [] {
#ifdef PKV_AVX2
  if constexpr (std::is_same<T, c10::Half>::value || std::is_same<T, c10::BFloat16>::value) return RowLoad<T>::kVec;
#endif
  return false;
}();

// Float pointers to a tile's rows: the cache itself for float32, else a widened copy.
template <typename T>
inline void tile_rows(const T* cache, const int64_t* rows, int64_t n, int64_t row_len,
                      float* buf, const float** ptr) {
  for (int64_t i = 0; i < n; ++i) {
    widen(cache + rows[i], buf + i * row_len, row_len);
    ptr[i] = buf + i * row_len;
  }
}

template <>
inline void tile_rows<float>(const float* cache, const int64_t* rows, int64_t n, int64_t,
                             float*, const float** ptr) {
  for (int64_t i = 0; i < n; ++i) ptr[i] = cache + rows[i];
}

// A quantized tile's raw K/V row pointers and its scales, transposed to [Hkv][TILE] so a kv
// head's scales are contiguous (fp8 scales carry FP8_SCALE, see RowLoad<Fp8>).
template <typename T>
inline void quant_tile_setup(const Problem& p, const int64_t* rows, int64_t n, Scratch& sc) {
  const float f = std::is_same<T, Fp8>::value ? FP8_SCALE : 1.0f;
  const T* kc = static_cast<const T*>(p.k);
  const T* vc = static_cast<const T*>(p.v);
  for (int64_t i = 0; i < n; ++i) {
    sc.kraw[i] = kc + rows[i];
    sc.vraw[i] = vc + rows[i];
    const int64_t at = rows[i] / p.D;  // the row's first scale
    for (int64_t h = 0; h < p.Hkv; ++h) {
      sc.ks[h * TILE + i] = p.k_scale[at + h] * f;
      sc.vs[h * TILE + i] = p.v_scale[at + h] * f;
    }
  }
}

// Online softmax of sequence b's Hq query heads over its tokens [t0, t1). Leaves the
// un-normalized outputs in sc.acc ([Hq, D]) and the running max / sum in sc.m / sc.l ([Hq]).
//
// A token's K (or V) for all kv heads is one contiguous [Hkv, D] row of its block, so walking a
// sequence token by token reads each block front to back. (Splitting the work by kv head
// instead reads 1/Hkv of every row with a stride, which measured 2-5x slower: it defeats the
// hardware prefetcher and wastes the lines it fetches anyway.)
template <typename T>
void attend_range(const Problem& p, int64_t b, int64_t t0, int64_t t1, Scratch& sc) {
  const int64_t Hq = p.Hq, G = p.G, D = p.D, bs = p.bs;
  const int64_t row_len = p.Hkv * D;  // elements of one token's row, all kv heads
  const T* kc = static_cast<const T*>(p.k);
  const T* vc = static_cast<const T*>(p.v);
  const int32_t* bt = p.block_tables + b * p.bt_stride;
  const int64_t q_elem = at::elementSize(p.q_dtype);
  const char* qb = static_cast<const char*>(p.q) + b * p.q_sb * q_elem;

  // Pre-scale q so a score is a plain dot product.
  for (int64_t hq = 0; hq < Hq; ++hq) {
    float* qh = sc.qf.data() + hq * D;
    load_any(qb + hq * p.q_sh * q_elem, p.q_dtype, qh, D);
    scale_inplace(p.scale, qh, D);
  }
  std::fill(sc.acc.begin(), sc.acc.end(), 0.0f);
  std::fill(sc.m.begin(), sc.m.end(), NEG_INF);
  std::fill(sc.l.begin(), sc.l.end(), 0.0f);

  // (block index, offset) walk instead of a division per token
  int64_t blk = t0 / bs;
  int64_t off = t0 % bs;
  const int64_t row_bytes = row_len * static_cast<int64_t>(sizeof(T));
  // Row offsets of the next tile are computed, and its K/V rows prefetched, one tile ahead:
  // blocks are scattered, so the hardware prefetcher cannot run ahead across a block boundary.
  auto next_rows = [&](int64_t* rows, int64_t n) {
    for (int64_t i = 0; i < n; ++i) {
      rows[i] = (static_cast<int64_t>(bt[blk]) * bs + off) * row_len;
      if (++off == bs) {
        off = 0;
        ++blk;
      }
      const char* kp = reinterpret_cast<const char*>(kc + rows[i]);
      const char* vp = reinterpret_cast<const char*>(vc + rows[i]);
      for (int64_t c = 0; c < row_bytes; c += 64) {
        prefetch(kp + c);
        prefetch(vp + c);
      }
      if constexpr (kQuantized<T>) {
        prefetch(p.k_scale + rows[i] / D);
        prefetch(p.v_scale + rows[i] / D);
      }
    }
  };
  int64_t* cur = sc.rows.data();
  int64_t* nxt = sc.rows.data() + TILE;
  if (t0 < t1) next_rows(cur, std::min<int64_t>(TILE, t1 - t0));
  for (int64_t pos = t0; pos < t1; pos += TILE) {
    const int64_t n = std::min<int64_t>(TILE, t1 - pos);
    if (pos + n < t1) next_rows(nxt, std::min<int64_t>(TILE, t1 - pos - n));
    // scores: each K row is read from memory once (then from L1 for the other query heads)
    if constexpr (kQuantized<T>) {
      quant_tile_setup<T>(p, cur, n, sc);
      const T* const* krows = reinterpret_cast<const T* const*>(sc.kraw.data());
      for (int64_t hq = 0; hq < Hq; ++hq) {
        float* s = sc.scores.data() + hq * TILE;
        const float* ks = sc.ks.data() + (hq / G) * TILE;
        score_tile<T>(sc.qf.data() + hq * D, krows, (hq / G) * D, n, D, s);
        for (int64_t i = 0; i < n; ++i) s[i] *= ks[i];
      }
    } else if constexpr (kDirect<T>) {
      const T** krows = reinterpret_cast<const T**>(sc.kraw.data());
      for (int64_t i = 0; i < n; ++i) krows[i] = kc + cur[i];
      for (int64_t hq = 0; hq < Hq; ++hq)
        score_tile<T>(sc.qf.data() + hq * D, krows, (hq / G) * D, n, D, sc.scores.data() + hq * TILE);
    } else {
      tile_rows<T>(kc, cur, n, row_len, sc.ktile.data(), sc.kptr.data());
      for (int64_t hq = 0; hq < Hq; ++hq) {
        score_tile<float>(sc.qf.data() + hq * D, sc.kptr.data(), (hq / G) * D, n, D,
                   sc.scores.data() + hq * TILE);
      }
    }
    if (p.softcap > 0.0f) {
      for (int64_t hq = 0; hq < Hq; ++hq) softcap_tile(sc.scores.data() + hq * TILE, p.softcap, (n + 7) / 8 * 8);
    }
    // online softmax update per query head
    for (int64_t hq = 0; hq < Hq; ++hq) {
      float* s = sc.scores.data() + hq * TILE;
      float mt = s[0];
      for (int64_t i = 1; i < n; ++i) mt = std::max(mt, s[i]);
      const float m_new = std::max(sc.m[hq], mt);
      const float alpha = std::exp(sc.m[hq] - m_new);  // 0 on the first tile (m = -inf)
      sc.l[hq] = sc.l[hq] * alpha + exp_sub_sum(s, m_new, n);
      if (alpha != 1.0f) scale_inplace(alpha, sc.acc.data() + hq * D, D);
      sc.m[hq] = m_new;
    }
    // values: each V row read once from memory, accumulated into the G outputs of its group
    if constexpr (kQuantized<T>) {
      const T* const* vrows = reinterpret_cast<const T* const*>(sc.vraw.data());
      for (int64_t hq = 0; hq < Hq; ++hq) {
        const float* pr = sc.scores.data() + hq * TILE;
        const float* vs = sc.vs.data() + (hq / G) * TILE;
        for (int64_t i = 0; i < n; ++i) sc.w[i] = pr[i] * vs[i];
        pv_tile<T>(sc.w.data(), vrows, (hq / G) * D, n, D, sc.acc.data() + hq * D);
      }
    } else if constexpr (kDirect<T>) {
      const T** vrows = reinterpret_cast<const T**>(sc.vraw.data());
      for (int64_t i = 0; i < n; ++i) vrows[i] = vc + cur[i];
      for (int64_t hq = 0; hq < Hq; ++hq)
        pv_tile<T>(sc.scores.data() + hq * TILE, vrows, (hq / G) * D, n, D, sc.acc.data() + hq * D);
    } else {
      tile_rows<T>(vc, cur, n, row_len, sc.vtile.data(), sc.vptr.data());
      for (int64_t hq = 0; hq < Hq; ++hq) {
        pv_tile<float>(sc.scores.data() + hq * TILE, sc.vptr.data(), (hq / G) * D, n, D,
                sc.acc.data() + hq * D);
      }
    }
    std::swap(cur, nxt);
  }
}

// Runs fn(item, scratch) for item in [0, n) on torch's intra-op thread pool (OpenMP), so
// torch.set_num_threads applies. Items are handed out through an atomic counter rather than
// static ranges because the sequences of a batch differ in length.
template <typename F>
void run_items(int64_t n, int64_t nthreads, const Problem& p, bool widen_rows, const F& fn) {
  nthreads = std::min(nthreads, n);
  if (nthreads <= 1) {
    Scratch sc(p.Hq, p.Hkv, p.D, widen_rows);
    for (int64_t i = 0; i < n; ++i) fn(i, sc);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, nthreads, 1, [&](int64_t, int64_t) {
    Scratch sc(p.Hq, p.Hkv, p.D, widen_rows);
    for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) fn(i, sc);
  });
}

template <typename T>
void decode_impl(const Problem& p, at::Tensor& out, int64_t max_len, int64_t total_len) {
  const int64_t B = p.B, Hq = p.Hq, D = p.D;
  const at::ScalarType out_dtype = out.scalar_type();
  const int64_t elem = at::elementSize(out_dtype);
  char* out_base = static_cast<char*>(out.data_ptr());
  auto out_row = [&](int64_t b, int64_t hq) { return out_base + (b * Hq + hq) * D * elem; };
  constexpr bool kWiden = !std::is_same<T, float>::value && !kQuantized<T> && !kDirect<T>;

  // Split sequences along their length only when the batch is too small to keep every thread
  // busy with whole sequences (a single stream, say); each split must still span a few tiles
  // to be worth the merge.
  // Tiny steps (short contexts, few sequences) run on the calling thread: waking the pool costs
  // more than the work, and much more when other processes compete for the cores.
  const int64_t work = total_len * Hq * D;
  const int64_t nthreads = work < (1 << 15) ? 1 : at::get_num_threads();
  int64_t splits = 1;
  if (nthreads > 1 && B < 4 * nthreads && max_len >= 4 * TILE) {
    const int64_t want = (4 * nthreads + B - 1) / B;
    splits = std::max<int64_t>(1, std::min<int64_t>(want, max_len / (2 * TILE)));
    // prefer a whole number of rounds over the pool: 6 equal items on 2 threads beat 7
    while (splits > 1 && (B * splits) % nthreads != 0) --splits;
  }

  if (splits == 1) {
    run_items(B, nthreads, p, kWiden, [&](int64_t b, Scratch& sc) {
      attend_range<T>(p, b, p.start(b), p.seq_lens[b], sc);
      for (int64_t hq = 0; hq < Hq; ++hq) {
        float* a = sc.acc.data() + hq * D;
        // seq_len == 0 leaves acc = 0, l = 0: write zeros rather than NaN
        scale_inplace(sc.l[hq] > 0.0f ? 1.0f / sc.l[hq] : 0.0f, a, D);
        store_any(a, out_row(b, hq), out_dtype, D);
      }
    });
    return;
  }

  // Split-K: partial (m, l, acc) per split, merged afterwards with the log-sum-exp rule.
  const int64_t chunk = (max_len + splits - 1) / splits;
  std::vector<float> pm(B * splits * Hq), pl(B * splits * Hq), pacc(B * splits * Hq * D);
  run_items(B * splits, nthreads, p, kWiden, [&](int64_t item, Scratch& sc) {
    const int64_t b = item / splits, s = item % splits;
    const int64_t len = p.seq_lens[b];
    const int64_t t0 = std::min(len, p.start(b) + s * chunk), t1 = std::min(len, t0 + chunk);
    attend_range<T>(p, b, t0, t1, sc);  // an empty range leaves m = -inf, l = 0, acc = 0
    std::copy(sc.m.begin(), sc.m.end(), pm.begin() + item * Hq);
    std::copy(sc.l.begin(), sc.l.end(), pl.begin() + item * Hq);
    std::copy(sc.acc.begin(), sc.acc.end(), pacc.begin() + item * Hq * D);
  });
  std::vector<float> res(D);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t hq = 0; hq < Hq; ++hq) {
      float mx = NEG_INF;
      for (int64_t s = 0; s < splits; ++s) mx = std::max(mx, pm[(b * splits + s) * Hq + hq]);
      std::fill(res.begin(), res.end(), 0.0f);
      float l = 0.0f;
      if (mx != NEG_INF) {
        for (int64_t s = 0; s < splits; ++s) {
          const int64_t idx = (b * splits + s) * Hq + hq;
          const float w = std::exp(pm[idx] - mx);  // 0 for empty splits
          l += w * pl[idx];
          axpy(w, pacc.data() + idx * D, res.data(), D);
        }
      }
      scale_inplace(l > 0.0f ? 1.0f / l : 0.0f, res.data(), D);
      store_any(res.data(), out_row(b, hq), out_dtype, D);
    }
  }
}

// out[b, hq] = softmax(scale * q[b, hq] . K[b, s_b:len_b, hq // G]) V[b, s_b:len_b, hq // G]
// with s_b = max(0, len_b - window) for a sliding-window layer (window > 0), else 0, each
// score soft-capped first when softcap > 0. Blocks
// wholly before s_b are never read (nor checked): their table entries may be anything.
// A checked decode call, ready to run: every argument and every block id it will read validated.
struct Prepared {
  Problem p;
  at::ScalarType kv_type;
  int64_t max_len, total_len;
};

// paged_decode's checks (a TORCH_CHECK error on a bad argument); nullopt for an empty batch
std::optional<Prepared> prepare(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                                const at::Tensor& out, const std::optional<at::Tensor>& k_scale,
                                const std::optional<at::Tensor>& v_scale, int64_t window, double softcap) {
  TORCH_CHECK(window >= 0, "window must be >= 0 (0: no window)");
  TORCH_CHECK(softcap >= 0 && std::isfinite(softcap), "softcap must be finite and >= 0 (0: none)");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [B, Hq, D] with a contiguous last dim");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes() &&
                  k_cache.scalar_type() == v_cache.scalar_type(),
              "k_cache/v_cache must be equal contiguous [N, bs, Hkv, D] tensors");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.scalar_type() == at::kInt &&
                  block_tables.is_contiguous(),
              "block_tables must be a contiguous int32 [B, max_blocks] tensor");
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous(),
              "seq_lens must be a contiguous int32 [B] tensor");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == q.sizes(), "out must be contiguous like q");
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t N = k_cache.size(0), bs = k_cache.size(1), Hkv = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D, "head_dim mismatch between q and the cache");
  TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0, "Hq must be a multiple of Hkv");
  TORCH_CHECK(block_tables.size(0) == B && seq_lens.size(0) == B, "batch size mismatch");
  const at::ScalarType kv_type = k_cache.scalar_type();
  const bool quantized = kv_type == at::kChar || kv_type == at::kFloat8_e4m3fn;
  const float* ks = nullptr;
  const float* vs = nullptr;
  if (quantized) {
    for (const auto* sc : {&k_scale, &v_scale}) {
      TORCH_CHECK(sc->has_value() && (*sc)->scalar_type() == at::kFloat && (*sc)->is_contiguous() &&
                      (*sc)->dim() == 3 && (*sc)->size(0) == N && (*sc)->size(1) == bs &&
                      (*sc)->size(2) == Hkv,
                  "a quantized cache needs contiguous float32 [N, bs, Hkv] k_scale and v_scale");
    }
    ks = k_scale->data_ptr<float>();
    vs = v_scale->data_ptr<float>();
  }
  if (B == 0) return std::nullopt;

  // Validate every block id a sequence will touch before going parallel: a bad id would
  // otherwise be an out-of-bounds read. This is B * max_blocks compares, cheap next to the work.
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t max_blocks = block_tables.size(1);
  int64_t max_len = 0, total_len = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t len = lens[b];
    TORCH_CHECK(len >= 0 && len <= max_blocks * bs, "seq_lens[", b, "] = ", len,
                " does not fit the block table");
    const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
    for (int64_t j = first / bs; j < (len + bs - 1) / bs; ++j) {
      const int64_t id = bt[b * max_blocks + j];
      TORCH_CHECK(id >= 0 && id < N, "block id ", id, " outside [0, ", N, ")");
    }
    max_len = std::max(max_len, len - first);  // the longest span attended
    total_len += len - first;
  }

  return Prepared{{q.data_ptr(), q.scalar_type(), q.stride(0), q.stride(1), k_cache.data_ptr(),
                   v_cache.data_ptr(), ks, vs, bt, max_blocks, lens, B, Hq, Hkv, Hq / Hkv, D, bs,
                   static_cast<float>(scale), window, static_cast<float>(softcap)},
                  kv_type, max_len, total_len};
}

void run(const Prepared& d, at::Tensor& out) {
  const Problem& p = d.p;
  const int64_t max_len = d.max_len, total_len = d.total_len;
  switch (d.kv_type) {
    case at::kFloat:
      decode_impl<float>(p, out, max_len, total_len);
      break;
    case at::kBFloat16:
      decode_impl<c10::BFloat16>(p, out, max_len, total_len);
      break;
    case at::kHalf:
      decode_impl<c10::Half>(p, out, max_len, total_len);
      break;
    case at::kChar:
      decode_impl<int8_t>(p, out, max_len, total_len);
      break;
    case at::kFloat8_e4m3fn:
      decode_impl<Fp8>(p, out, max_len, total_len);
      break;
    default:
      TORCH_CHECK(false, "paged_decode: unsupported cache dtype ", d.kv_type);
  }
}

void paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                  at::Tensor& out, const std::optional<at::Tensor>& k_scale,
                  const std::optional<at::Tensor>& v_scale, int64_t window, double softcap) {
  if (const auto d = prepare(q, k_cache, v_cache, block_tables, seq_lens, scale, out, k_scale, v_scale,
                             window, softcap))
    run(*d, out);
}

// A pure-decode step's attention in one call: each sequence's new K/V row (k_new, v_new [B, Hkv,
// D], any strides, the cache's float dtype) copied to its slot (slots int64 [B]: row slot of the
// cache seen as [N * bs, Hkv, D]; a negative slot is not written), then paged_decode. What the
// indexed copies of write_layer and the decode op did in three calls (and their Python: ~20 us
// a layer at one row). Every argument, block id and slot is checked before the first copy, so a
// bad one writes nothing.
void write_decode(const at::Tensor& q, const at::Tensor& k_new, const at::Tensor& v_new,
                  const at::Tensor& slots, at::Tensor& k_cache, at::Tensor& v_cache,
                  const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                  at::Tensor& out, int64_t window, double softcap) {
  const at::ScalarType t = k_cache.scalar_type();
  TORCH_CHECK(t == at::kFloat || t == at::kBFloat16 || t == at::kHalf,
              "write_decode takes a float cache (a quantized one: write_layer, then paged_decode)");
  const std::optional<Prepared> d = prepare(q, k_cache, v_cache, block_tables, seq_lens, scale, out,
                                            std::nullopt, std::nullopt, window, softcap);
  const int64_t rows = k_cache.size(0) * k_cache.size(1), H = k_cache.size(2), D = k_cache.size(3);
  const int64_t B = q.size(0);  // (prepare checked q: [B, Hq, D])
  const bool narrow = k_new.scalar_type() == at::kFloat && t != at::kFloat;  // float32 rows into a 16-bit cache
  for (const at::Tensor* x : {&k_new, &v_new})
    TORCH_CHECK(x->dim() == 3 && x->size(0) == B && x->size(1) == H && x->size(2) == D &&
                    x->scalar_type() == (narrow ? at::kFloat : t),
                "k_new/v_new must be [B, Hkv, D] in the cache's dtype (or float32 for a 16-bit cache), "
                "B = q's batch");
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == B && slots.scalar_type() == at::kLong &&
                  slots.is_contiguous(),
              "slots must be a contiguous int64 [B] tensor");
  const int64_t* sl = slots.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(sl[b] < rows, "slot ", sl[b], " outside the cache's ", rows, " rows");
  const int64_t es = k_cache.element_size();
  if (narrow) {  // each float rounded to the cache's type as torch's .to() does (to nearest, ties to even)
    for (const auto& [src, dst] : {std::pair{&k_new, &k_cache}, std::pair{&v_new, &v_cache}}) {
      const float* sp = src->data_ptr<float>();
      const int64_t s0 = src->stride(0), s1 = src->stride(1), s2 = src->stride(2);
      for (int64_t b = 0; b < B; ++b) {
        if (sl[b] < 0) continue;
        for (int64_t h = 0; h < H; ++h) {
          const float* from = sp + b * s0 + h * s1;
          if (t == at::kHalf) {
            c10::Half* row = dst->data_ptr<c10::Half>() + (sl[b] * H + h) * D;
            for (int64_t d = 0; d < D; ++d) row[d] = c10::Half(from[d * s2]);
          } else {
            c10::BFloat16* row = dst->data_ptr<c10::BFloat16>() + (sl[b] * H + h) * D;
            for (int64_t d = 0; d < D; ++d) row[d] = c10::BFloat16(from[d * s2]);
          }
        }
      }
    }
    if (d) run(*d, out);
    return;
  }
  for (const auto& [src, dst] : {std::pair{&k_new, &k_cache}, std::pair{&v_new, &v_cache}}) {
    const char* sp = static_cast<const char*>(src->data_ptr());
    char* dp = static_cast<char*>(dst->data_ptr());
    const int64_t s0 = src->stride(0) * es, s1 = src->stride(1) * es, s2 = src->stride(2) * es;
    for (int64_t b = 0; b < B; ++b) {
      if (sl[b] < 0) continue;
      char* row = dp + sl[b] * H * D * es;
      for (int64_t h = 0; h < H; ++h) {
        const char* from = sp + b * s0 + h * s1;
        if (s2 == es) {
          std::memcpy(row + h * D * es, from, D * es);
        } else {
          for (int64_t d = 0; d < D; ++d) std::memcpy(row + (h * D + d) * es, from + d * s2, es);
        }
      }
    }
  }
  if (d) run(*d, out);
}

}  // namespace

TORCH_LIBRARY(pagedkv_attn, m) {
  m.def(
      "paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor seq_lens, float scale, Tensor(a!) out, Tensor? k_scale=None, "
      "Tensor? v_scale=None, int window=0, float softcap=0) -> ()");
  m.def(
      "write_decode(Tensor q, Tensor k_new, Tensor v_new, Tensor slots, Tensor(a!) k_cache, "
      "Tensor(b!) v_cache, Tensor block_tables, Tensor seq_lens, float scale, Tensor(c!) out, "
      "int window=0, float softcap=0) -> ()");
}

TORCH_LIBRARY_IMPL(pagedkv_attn, CPU, m) {
  m.impl("paged_decode", &paged_decode);
  m.impl("write_decode", &write_decode);
}
