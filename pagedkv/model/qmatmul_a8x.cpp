// The int8-activation row kernel for the super-block types (activations=int8): Q2_K, Q3_K,
// Q4_K, Q5_K, Q6_K, IQ4_XS, the llama.cpp way (its vec_dot_q*_K_q8_K family).
//
// The activations of these rows are quantized per 256-element block (one super-block):
// dK = max|x| / 127, q = nearbyint(x * (1 / dK)), and bs[k] = the integer sum of q over each 16
// elements (int16). A weight super-block is written as integers u with 16 integer scales sc and
// mins mn (one per 16 elements; the per-32 types repeat each):
//   w[e] = d * sc[e / 16] * u[e] - dmin * MK * mn[e / 16]
//   Q4_K, Q5_K: u the 4/5-bit quants, sc/mn their 6-bit scales and mins, MK = 1
//   Q2_K: u 0..3, sc/mn 4 bits, MK = 1
//   Q6_K: u 0..63, w = d sc (u - 32): mn = sc, dmin = d, MK = 32   (sc signed)
//   Q3_K: u = ql + 4 h (0..7), w = d sc (u - 4): mn = sc, dmin = d, MK = 4   (sc signed)
//   IQ4_XS: u the signed non-linear levels, sc = ls - 32, no min
// The dot with the activations is summed in 8 int32 lanes per super-block, exactly:
//   I[l] = sum over chunks j (32 elements) and i = 4l..4l+3 of sc[(32 j + i) / 16] u q
//   M[l] = MK * (mn[2l] bs[2l] + mn[2l+1] bs[2l+1])
// then folded into 8 float lanes, super-block by super-block, and summed at the end:
//   y[l] = fma(float(I[l]), d * dK, y[l]);  y[l] = fma(float(M[l]), -(dmin * dK), y[l])
//   result = ((y0 + y4) + (y2 + y6)) + ((y1 + y5) + (y3 + y7))
// With AVX2, I comes from maddubs (u8 x s8 -> int16 pairs; IQ4_XS by the sign trick |u| x
// sign(q, u); no pair saturates: |u| <= 127, |q| <= 127) and madd with the chunk's scales, M
// from one madd of the mins with bs. The scalar path (impl=1, or a build without AVX2) computes
// the same integers and float steps lane by lane: both give bit-identical results.
//
// With AVX-512 VNNI (impl 0 where the CPU has it) two chunks go through one maddubs and one
// vpdpwssd (= madd + add, exact), the same int32 lanes (chunk 2i's and 2i+1's halves added once
// per super-block), so all three paths agree bit for bit (impl 2 = AVX2, tested). The tile is
// written once over the unit (qmatmul_a8x_tile.inc: Y = a chunk, Z = two).
//
// Each weight row is read once per call: up to 2 weight rows x 4 activation rows per pass over
// the row (the rows stay in L1 for the next pass); threads split the weight rows
// (the caller).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "ggml_blocks.h"
#include "kquant_values.h"
#include "qmatmul_a8.h"
#include "vec.h"

namespace a8 {

using namespace ggml;

bool x_type(int64_t t) {
  switch (t) {
    case Q2_K: case Q3_K: case Q4_K: case Q5_K: case Q6_K: case IQ4_XS: return true;
    default: return false;
  }
}

// unit_order's chunk order within a super-block: Q4_K / Q5_K's VNNI tile (tile_k4) takes chunks
// UNIT_ORDER[2i], UNIT_ORDER[2i + 1] as its unit i
constexpr int UNIT_ORDER[8] = {0, 2, 1, 3, 4, 6, 5, 7};

namespace {

// --- activations per 256 ------------------------------------------------------------------------

// a super-block holding an inf or a NaN: zeros, its d NaN (as quant_block_scalar's blocks)
void non_finite_sb(int8_t* q, float* d, int16_t* bs) {
  std::memset(q, 0, QK_K);
  std::memset(bs, 0, sizeof(int16_t) * QK_K / 16);
  *d = NAN;
}

void quant_sb_scalar(const float* x, int8_t* q, float* d, int16_t* bs) {
  float amax = 0.f;
  bool nan = false;
  for (int i = 0; i < QK_K; ++i) amax = std::max(amax, std::fabs(x[i])), nan |= std::isnan(x[i]);
  if (nan || std::isinf(amax)) return non_finite_sb(q, d, bs);
  const float dd = amax / 127.f;
  const float id = inv_scale(dd);
  for (int k = 0; k < QK_K / 16; ++k) {
    int32_t s = 0;
    for (int i = 16 * k; i < 16 * k + 16; ++i) {
      const int32_t v = round_i32(x[i] * id);
      q[i] = sat8(v);
      s = wrap_add(s, v);
    }
    bs[k] = static_cast<int16_t>(s);
  }
  *d = dd;
}

#ifdef PQ_AVX2
PQ_INLINE int32_t hsum_i32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 1));
  return _mm_cvtsi128_si32(s);
}

void quant_sb_avx2(const float* x, int8_t* q, float* d, int16_t* bs) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 m = _mm256_setzero_ps(), un = _mm256_setzero_ps();
  // max(|x|, m): a NaN in x is dropped (maxps returns its second operand then), as std::max does,
  // and flagged in un
  for (int i = 0; i < QK_K; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    m = _mm256_max_ps(_mm256_andnot_ps(sign, v), m);
    un = _mm256_or_ps(un, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  if (_mm256_movemask_ps(un) || std::isinf(_mm_cvtss_f32(h))) return non_finite_sb(q, d, bs);
  const float dd = _mm_cvtss_f32(h) / 127.f;
  const __m256 id = _mm256_set1_ps(inv_scale(dd));
  constexpr int R = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  for (int k = 0; k < QK_K / 16; ++k) {
    const __m256i a = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + 16 * k), id), R));
    const __m256i b = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + 16 * k + 8), id), R));
    bs[k] = static_cast<int16_t>(hsum_i32(_mm256_add_epi32(a, b)));
    // int32 -> int8: packs interleave the 128-bit halves (a0-3 b0-3 | a4-7 b4-7), then a0-3 b0-3 a4-7 b4-7
    const __m256i p16 = _mm256_packs_epi32(a, b);
    const __m128i p8 = _mm_packs_epi16(_mm256_castsi256_si128(p16), _mm256_extracti128_si256(p16, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16 * k),
                     _mm_shuffle_epi8(p8, _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15)));
  }
  *d = dd;
}
#endif

}  // namespace

void quantize_sb(const float* x, int8_t* q, float* d, int16_t* bs, int64_t nsb, int64_t impl) {
  for (int64_t b = 0; b < nsb; ++b) {
#ifdef PQ_AVX2
    if (impl == 0 || impl == 2) {
      quant_sb_avx2(x + QK_K * b, q + QK_K * b, d + b, bs + 16 * b);
      continue;
    }
#endif
    quant_sb_scalar(x + QK_K * b, q + QK_K * b, d + b, bs + 16 * b);
  }
  (void)impl;
}

namespace {

// --- one weight super-block's scales (both paths) -----------------------------------------------

constexpr int min_mult(int64_t t) { return t == Q6_K ? 32 : t == Q3_K ? 4 : 1; }
constexpr bool has_min(int64_t t) { return t != IQ4_XS; }
constexpr int64_t sb_bytes(int64_t t) {
  return t == Q2_K ? 84 : t == Q3_K ? 110 : t == Q4_K ? 144 : t == Q5_K ? 176 : t == Q6_K ? 210 : 136;
}

// 16 signed bytes of scales and 16 of mins, one per 16 elements; d and dmin
struct Scales {
  alignas(16) int8_t sc[16];
  alignas(16) int8_t mn[16];
  float d, dmin;
};

inline uint32_t word(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

inline void put(int8_t* dst, uint32_t w) { std::memcpy(dst, &w, 4); }

// 8 per-32 values (bytes) -> 16 per-16 values
inline void twice(const uint8_t v[8], int8_t* dst) {
  for (int j = 0; j < 8; ++j) dst[2 * j] = dst[2 * j + 1] = static_cast<int8_t>(v[j]);
}

template <int64_t QT>
inline void scales_of(const uint8_t* b, Scales& s) {
  if constexpr (QT == Q4_K || QT == Q5_K) {
    // scale_min_k4 for the 8 sub-blocks at once: words a, b, c of the 12 bytes
    const auto& h = *reinterpret_cast<const BlockQ4_K*>(b);  // d, dmin, scales: the same offsets in Q5_K
    const uint32_t a = word(h.scales), bw = word(h.scales + 4), c = word(h.scales + 8);
    uint8_t sc[8], mn[8];
    const uint32_t s03 = a & 0x3F3F3F3F, m03 = bw & 0x3F3F3F3F;
    const uint32_t s47 = (c & 0x0F0F0F0F) | (((a >> 6) & 0x03030303) << 4);
    const uint32_t m47 = ((c >> 4) & 0x0F0F0F0F) | (((bw >> 6) & 0x03030303) << 4);
    std::memcpy(sc, &s03, 4), std::memcpy(sc + 4, &s47, 4);
    std::memcpy(mn, &m03, 4), std::memcpy(mn + 4, &m47, 4);
    twice(sc, s.sc), twice(mn, s.mn);
    s.d = half(h.d), s.dmin = half(h.dmin);
  } else if constexpr (QT == Q2_K) {
    const auto& h = *reinterpret_cast<const BlockQ2_K*>(b);
    for (int k = 0; k < 16; ++k) s.sc[k] = static_cast<int8_t>(h.scales[k] & 0x0F), s.mn[k] = static_cast<int8_t>(h.scales[k] >> 4);
    s.d = half(h.d), s.dmin = half(h.dmin);
  } else if constexpr (QT == Q6_K) {
    const auto& h = *reinterpret_cast<const BlockQ6_K*>(b);
    std::memcpy(s.sc, h.scales, 16), std::memcpy(s.mn, h.scales, 16);
    s.d = s.dmin = half(h.d);
  } else if constexpr (QT == Q3_K) {
    // scale_q3_k for the 16 groups at once: low nibbles from bytes 0-7, 2-bit highs from 8-11
    const auto& h = *reinterpret_cast<const BlockQ3_K*>(b);
    const uint32_t w0 = word(h.scales), w1 = word(h.scales + 4), hw = word(h.scales + 8);
    const uint32_t lo[4] = {w0 & 0x0F0F0F0F, w1 & 0x0F0F0F0F, (w0 >> 4) & 0x0F0F0F0F, (w1 >> 4) & 0x0F0F0F0F};
    for (int g = 0; g < 4; ++g) put(s.sc + 4 * g, (lo[g] | (((hw >> (2 * g)) & 0x03030303) << 4)));
    for (int k = 0; k < 16; ++k) s.sc[k] = static_cast<int8_t>(s.sc[k] - 32);
    std::memcpy(s.mn, s.sc, 16);
    s.d = s.dmin = half(h.d);
  } else {
    static_assert(QT == IQ4_XS, "a type without int8 scales");
    const auto& h = *reinterpret_cast<const BlockIQ4_XS*>(b);
    uint8_t sc[8];
    for (int j = 0; j < 8; ++j) sc[j] = static_cast<uint8_t>(scale_iq4_xs(h, j));
    twice(sc, s.sc);
    std::memset(s.mn, 0, 16);
    s.d = half(h.d), s.dmin = 0.f;
  }
}

#ifdef PQ_AVX2
// The tiles fetch the rows PF_TILES tiles ahead, one super-block per step: every cache line of
// it (points at most 64 bytes apart, its last byte last; three lines per step left a Q6_K
// block's fourth to demand misses), into L2 (T1). 1 thread, 4096 x 1536 rows cycled through
// 400 MB (DRAM), GB/s of weights: Q4_K 7.5 -> 10.5-12.6, Q6_K 6.9 -> 14.5-17 (T0: no gain).
// The AVX2 tiles (Y::NTA) fetch the next tile only, NTA: T1 lines 4 tiles ahead passed through L2
// into Zen 2's L3 and pushed out what the rest of the step runs from (qmatmul_a8.cpp:
// PF_NTA_TILES has the figures). The VNNI ones (Z) keep T1, 4 tiles (not measured with NTA).
constexpr int64_t PF_TILES = 4;
constexpr int64_t PF_NTA_TILES = 1;
template <int64_t QT, bool NTA = false>
PQ_INLINE void prefetch_sb(const uint8_t* p) {
  constexpr int64_t bb = sb_bytes(QT);
  const auto one = [](const uint8_t* q) __attribute__((always_inline)) {
    if constexpr (NTA) _mm_prefetch(reinterpret_cast<const char*>(q), _MM_HINT_NTA);
    else _mm_prefetch(reinterpret_cast<const char*>(q), _MM_HINT_T1);
  };
  for (int64_t o = 0; o < bb; o += 64) one(p + o);
  one(p + bb - 1);
}
#endif

// --- scalar ------------------------------------------------------------------------------------

using kq::u_of;

inline float hsum8(const float* l) { return ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7])); }

template <int64_t QT>
void row_scalar(const uint8_t* row, int64_t nsb, int64_t T, const int8_t* xq, const float* xd,
                const int16_t* bs, int64_t K, float* res, int64_t ldr) {
  for (int64_t r = 0; r < T; ++r) {
    float y[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int64_t sb = 0; sb < nsb; ++sb) {
      const uint8_t* b = row + sb_bytes(QT) * sb;
      Scales s;
      scales_of<QT>(b, s);
      const int8_t* x = xq + r * K + QK_K * sb;
      const int16_t* bk = bs + 16 * (r * nsb + sb);
      const float dx = xd[r * nsb + sb];
      for (int l = 0; l < 8; ++l) {
        int32_t isum = 0;
        for (int j = 0; j < 8; ++j)
          for (int i = 32 * j + 4 * l; i < 32 * j + 4 * l + 4; ++i) isum += s.sc[i / 16] * u_of<QT>(b, i) * x[i];
        y[l] = std::fmaf(static_cast<float>(isum), s.d * dx, y[l]);
        if (has_min(QT)) {
          const int32_t msum = min_mult(QT) * (s.mn[2 * l] * bk[2 * l] + s.mn[2 * l + 1] * bk[2 * l + 1]);
          y[l] = std::fmaf(static_cast<float>(msum), -(s.dmin * dx), y[l]);
        }
      }
    }
    res[r * ldr] = hsum8(y);
  }
}

// --- AVX2 ----------------------------------------------------------------------------------------

#ifdef PQ_AVX2

using kq::chunk;

// scales_of in registers (the same bytes; no byte stores for the vector loads to wait on)
PQ_INLINE __m128i twice_v(uint64_t v) {  // 8 bytes -> each twice
  const __m128i x = _mm_cvtsi64_si128(static_cast<long long>(v));
  return _mm_unpacklo_epi8(x, x);
}

template <int64_t QT>
PQ_INLINE void scales_v(const uint8_t* b, __m128i& sc, __m128i& mn, float& d, float& dmin) {
  if constexpr (QT == Q4_K || QT == Q5_K) {
    const auto& h = *reinterpret_cast<const BlockQ4_K*>(b);
    const uint32_t a = word(h.scales), bw = word(h.scales + 4), c = word(h.scales + 8);
    const uint64_t s03 = a & 0x3F3F3F3F, m03 = bw & 0x3F3F3F3F;
    const uint64_t s47 = (c & 0x0F0F0F0F) | (((a >> 6) & 0x03030303) << 4);
    const uint64_t m47 = ((c >> 4) & 0x0F0F0F0F) | (((bw >> 6) & 0x03030303) << 4);
    sc = twice_v(s03 | s47 << 32), mn = twice_v(m03 | m47 << 32);
    const __m128 dd = vec::half2(h.d);
    d = _mm_cvtss_f32(dd), dmin = _mm_cvtss_f32(_mm_movehdup_ps(dd));
  } else if constexpr (QT == Q2_K) {
    const auto& h = *reinterpret_cast<const BlockQ2_K*>(b);
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(h.scales));
    sc = _mm_and_si128(raw, _mm_set1_epi8(0x0F));
    mn = _mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(0x0F));
    const __m128 dd = vec::half2(h.d);  // d, dmin adjacent
    d = _mm_cvtss_f32(dd), dmin = _mm_cvtss_f32(_mm_movehdup_ps(dd));
  } else if constexpr (QT == Q6_K) {
    const auto& h = *reinterpret_cast<const BlockQ6_K*>(b);
    sc = mn = _mm_loadu_si128(reinterpret_cast<const __m128i*>(h.scales));
    d = dmin = half(h.d);
  } else if constexpr (QT == Q3_K) {
    const auto& h = *reinterpret_cast<const BlockQ3_K*>(b);
    const uint32_t w0 = word(h.scales), w1 = word(h.scales + 4), hw = word(h.scales + 8);
    const __m128i lo = _mm_setr_epi32(static_cast<int>(w0 & 0x0F0F0F0F), static_cast<int>(w1 & 0x0F0F0F0F),
                                      static_cast<int>((w0 >> 4) & 0x0F0F0F0F), static_cast<int>((w1 >> 4) & 0x0F0F0F0F));
    const __m128i hi = _mm_and_si128(_mm_srlv_epi32(_mm_set1_epi32(static_cast<int>(hw)), _mm_setr_epi32(0, 2, 4, 6)),
                                     _mm_set1_epi8(0x03));
    sc = mn = _mm_sub_epi8(_mm_or_si128(lo, _mm_slli_epi16(hi, 4)), _mm_set1_epi8(32));
    d = dmin = half(h.d);
  } else {
    // scale_iq4_xs for the 8 sub-blocks at once: nibbles of scales_l in order, 2-bit highs of scales_h
    const auto& h = *reinterpret_cast<const BlockIQ4_XS*>(b);
    const uint32_t l = word(h.scales_l);
    const __m128i lo = _mm_unpacklo_epi8(_mm_cvtsi32_si128(static_cast<int>(l & 0x0F0F0F0F)),
                                         _mm_cvtsi32_si128(static_cast<int>((l >> 4) & 0x0F0F0F0F)));
    const int hw = h.scales_h[0] | (h.scales_h[1] << 8);
    const __m256i hi32 = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(hw), _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14)),
                                          _mm256_set1_epi32(3));
    const __m128i hi16 = _mm_packs_epi32(_mm256_castsi256_si128(hi32), _mm256_extracti128_si256(hi32, 1));
    const __m128i ls = _mm_or_si128(lo, _mm_slli_epi16(_mm_packs_epi16(hi16, hi16), 4));  // bytes 0-7
    const __m128i v = _mm_sub_epi8(ls, _mm_set1_epi8(32));
    sc = _mm_unpacklo_epi8(v, v), mn = _mm_setzero_si128();
    d = half(h.d), dmin = 0.f;
  }
}

// the 16 per-16 scales sc8 as int16, the even ones in the low 128-bit lane and the odd ones in
// the high lane (once per super-block), so that chunk_scales takes one in-lane shuffle
PQ_INLINE __m256i split_scales(__m128i sc8) {
  return _mm256_cvtepi8_epi16(_mm_shuffle_epi8(sc8, _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15)));
}

// chunk j's scales as 16 int16 lanes: lanes 0-7 (elements 0-15) sc[2j], lanes 8-15 sc[2j+1],
// from split_scales' vector: int16 j of each 128-bit lane, repeated (one vpshufb; a permute
// across lanes first cost one more instruction a chunk)
PQ_INLINE __m256i chunk_scales(__m256i split, int j) {
  const char lo = static_cast<char>(2 * j), hi = static_cast<char>(2 * j + 1);
  return _mm256_shuffle_epi8(split, _mm256_setr_epi8(lo, hi, lo, hi, lo, hi, lo, hi, lo, hi, lo, hi, lo, hi, lo, hi,
                                                     lo, hi, lo, hi, lo, hi, lo, hi, lo, hi, lo, hi, lo, hi, lo, hi));
}

// one super-block's exact int32 lane sums I of a weight row and an activation row folded into
// its 8 float lanes y: fma(I, d dx), then (types with mins) fma(MK * mn * bs, -(dmin dx))
template <int64_t QT>
PQ_INLINE __m256 fold(__m256 y, __m256i I, __m128i mn8, __m256i b16, float d, float dmin, float dx) {
  y = _mm256_fmadd_ps(_mm256_cvtepi32_ps(I), _mm256_set1_ps(d * dx), y);
  if constexpr (has_min(QT)) {
    __m256i m = _mm256_madd_epi16(_mm256_cvtepi8_epi16(mn8), b16);
    if constexpr (min_mult(QT) == 32) m = _mm256_slli_epi32(m, 5);
    if constexpr (min_mult(QT) == 4) m = _mm256_slli_epi32(m, 2);
    y = _mm256_fmadd_ps(_mm256_cvtepi32_ps(m), _mm256_set1_ps(-(dmin * dx)), y);
  }
  return y;
}

// the 16 per-16 sums bs of activation row r's super-block sb (zero for a type without mins)
template <int64_t QT>
PQ_INLINE __m256i sums16(const int16_t* bs, int64_t r, int64_t nsb, int64_t sb) {
  if constexpr (has_min(QT)) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bs + 16 * (r * nsb + sb)));
  return _mm256_setzero_si256();
}

// f(std::integral_constant<int, R>{}, t) for the activation rows t .. t + R - 1, in groups of
// MAXR (2 or 4), then 2, then 1
template <int MAXR, class F>
PQ_INLINE void by_rows(int64_t T, const F& f) {
  int64_t t = 0;
  if constexpr (MAXR >= 4)
    for (; t + 4 <= T; t += 4) f(std::integral_constant<int, 4>{}, t);
  for (; t + 2 <= T; t += 2) f(std::integral_constant<int, 2>{}, t);
  if (t < T) f(std::integral_constant<int, 1>{}, t);
}

// the AVX2 unit: one 32-element chunk (maddubs, then madd by the chunk's int16 scales)
struct Y {
  using I = __m256i;
  // 4 activation rows per pass too, though 16 ymm registers do not hold the float sums (spilled
  // once per super-block): 1 thread, 4096x1536 in L3, 8 rows, ns/w, 2 rows per pass -> 4:
  // Q4_K 0.333 -> 0.189, Q5_K 0.392 -> 0.208, Q6_K 0.356 -> 0.191, IQ4_XS 0.356 -> 0.283
  static constexpr int BYTES = 32, UNITS = 8, MAXR = 4;
  static constexpr bool NTA = true;  // (prefetch_sb)
  template <bool SG>
  struct Unit {
    __m256i u;
  };
  static PQ_INLINE I zero() { return _mm256_setzero_si256(); }
  static PQ_INLINE I scales(__m128i sc8) { return split_scales(sc8); }
  static PQ_INLINE I unit_scales(I split, int j) { return chunk_scales(split, j); }
  template <int64_t QT>
  static PQ_INLINE Unit<QT == IQ4_XS> weights(const uint8_t* b, int j) { return {chunk<QT>(b, j)}; }
  static PQ_INLINE I load(const int8_t* x) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)); }
  template <bool SG>
  static PQ_INLINE I dot(I acc, const Unit<SG>& w, I x, I s) {  // IQ4_XS: the sign trick |u| x sign(x, u)
    const __m256i p = SG ? _mm256_maddubs_epi16(_mm256_abs_epi8(w.u), _mm256_sign_epi8(x, w.u)) : _mm256_maddubs_epi16(w.u, x);
    return _mm256_add_epi32(acc, _mm256_madd_epi16(p, s));
  }
  static PQ_INLINE __m256i lanes(I acc) { return acc; }
};

namespace y {
using U = Y;
#include "qmatmul_a8x_tile.inc"
}  // namespace y

}  // namespace

// --- AVX-512 VNNI: two chunks (64 elements) per instruction --------------------------------------
//
// The same integers as tile above: pair i holds chunks 2i and 2i+1 in element order, so its 16
// int32 lanes are the AVX2 acc lanes of chunk 2i (0-7) and 2i+1 (8-15), and maddubs + dpwssd is
// madd + add (exact, wrapping int32). The two halves are added once per super-block: the same
// I[l], hence the same floats.

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni")
namespace zv {

PQ_INLINE __m512i both(const uint8_t* p) {  // 32 bytes in both halves
  return _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
PQ_INLINE __m512i halves(int lo, int hi) {  // 16-bit lanes: lo in the lower 256 bits, hi in the upper
  return _mm512_inserti64x4(_mm512_set1_epi16(static_cast<short>(lo)), _mm256_set1_epi16(static_cast<short>(hi)), 1);
}
PQ_INLINE __m512i shr(__m512i v, int lo, int hi) { return _mm512_srlv_epi16(v, halves(lo, hi)); }
PQ_INLINE __m512i bytes(int v) { return _mm512_set1_epi8(static_cast<char>(v)); }
// + add to the bytes whose bit `lo` (lower half) / `hi` (upper half) is set in qh (32 bytes)
PQ_INLINE __m512i add_bit(__m512i u, const uint8_t* qh, int lo, int hi, int add) {
  const __m512i sel = _mm512_inserti64x4(bytes(1 << lo), _mm256_set1_epi8(static_cast<char>(1 << hi)), 1);
  return _mm512_mask_add_epi8(u, _mm512_test_epi8_mask(both(qh), sel), u, bytes(add));
}

// the 64 u of chunks 2i, 2i+1 of super-block b (IQ4_XS: signed)
template <int64_t QT>
PQ_INLINE __m512i pair(const uint8_t* b, int i) {
  if constexpr (QT == Q4_K) {
    return _mm512_and_si512(shr(both(reinterpret_cast<const BlockQ4_K*>(b)->qs + 32 * i), 0, 4), bytes(0x0F));
  } else if constexpr (QT == Q5_K) {
    const auto& h = *reinterpret_cast<const BlockQ5_K*>(b);
    const __m512i lo = _mm512_and_si512(shr(both(h.qs + 32 * i), 0, 4), bytes(0x0F));
    return add_bit(lo, h.qh, 2 * i, 2 * i + 1, 0x10);
  } else if constexpr (QT == Q2_K || QT == Q3_K) {
    const uint8_t* qs = QT == Q2_K ? reinterpret_cast<const BlockQ2_K*>(b)->qs : reinterpret_cast<const BlockQ3_K*>(b)->qs;
    const int s = 2 * ((2 * i) % 4);
    const __m512i lo = _mm512_and_si512(shr(both(qs + 32 * (i / 2)), s, s + 2), bytes(0x03));
    if constexpr (QT == Q2_K) return lo;
    else return add_bit(lo, reinterpret_cast<const BlockQ3_K*>(b)->hmask, 2 * i, 2 * i + 1, 4);
  } else if constexpr (QT == Q6_K) {
    const auto& h = *reinterpret_cast<const BlockQ6_K*>(b);
    const int hh = i / 2, odd = i % 2;  // chunks 2i, 2i+1: jj = 2 odd, 2 odd + 1
    const __m512i ql = _mm512_loadu_si512(h.ql + 64 * hh);  // chunk 2i's 32 bytes, then 2i+1's
    const __m512i lo = _mm512_and_si512(_mm512_srli_epi16(ql, 4 * odd), bytes(0x0F));
    // ((qh >> 2 jj) & 3) << 4 = (qh shifted by 2 jj - 4) & 0x30, per 16-bit lane (no bits cross)
    const __m512i qh = both(h.qh + 32 * hh);
    const __m512i hi = odd ? _mm512_srlv_epi16(qh, halves(0, 2)) : _mm512_sllv_epi16(qh, halves(4, 2));
    return _mm512_or_si512(lo, _mm512_and_si512(hi, bytes(0x30)));
  } else {
    // chunk j = the 16 bytes qs[16 j ..]: low nibbles (elements 0-15), then high ones
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(reinterpret_cast<const BlockIQ4_XS*>(b)->qs + 32 * i));
    const __m512i dup = _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 1, 0, 1, 2, 3, 2, 3), _mm512_castsi256_si512(raw));
    const __m512i idx = _mm512_and_si512(_mm512_srlv_epi64(dup, _mm512_setr_epi64(0, 0, 4, 4, 0, 0, 4, 4)), bytes(0x0F));
    const __m512i lev = _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(IQ4_LEVELS)));
    return _mm512_shuffle_epi8(lev, idx);
  }
}

// pair i's scales as 32 int16 lanes: 128-bit lane L (elements 16 L ..) holds sc[4 i + L]
PQ_INLINE __m512i pair_scales(__m512i sc16, int i) {
  const __m512i idx = _mm512_inserti64x4(
      _mm512_castsi256_si512(_mm256_inserti128_si256(_mm256_set1_epi16(static_cast<short>(4 * i)),
                                                     _mm_set1_epi16(static_cast<short>(4 * i + 1)), 1)),
      _mm256_inserti128_si256(_mm256_set1_epi16(static_cast<short>(4 * i + 2)), _mm_set1_epi16(static_cast<short>(4 * i + 3)), 1), 1);
  return _mm512_permutexvar_epi16(idx, sc16);
}

// the VNNI unit: chunks 2i and 2i+1 (maddubs, then vpdpwssd by their int16 scales)
struct Z {
  using I = __m512i;
  static constexpr int BYTES = 64, UNITS = 4, MAXR = 4;  // 4 activation rows: 32 zmm hold them
  static constexpr bool NTA = false;  // (prefetch_sb)
  template <bool SG>
  struct Unit {
    __m512i u;  // IQ4_XS: |u|, and the mask of the negative ones
    __mmask64 neg;
  };
  static PQ_INLINE I zero() { return _mm512_setzero_si512(); }
  static PQ_INLINE I scales(__m128i sc8) { return _mm512_castsi256_si512(_mm256_cvtepi8_epi16(sc8)); }
  static PQ_INLINE I unit_scales(I sc16, int i) { return pair_scales(sc16, i); }
  template <int64_t QT>
  static PQ_INLINE Unit<QT == IQ4_XS> weights(const uint8_t* b, int i) {
    const __m512i u = pair<QT>(b, i);
    if constexpr (QT == IQ4_XS) return {_mm512_abs_epi8(u), _mm512_movepi8_mask(u)};
    else return {u, 0};
  }
  static PQ_INLINE I load(const int8_t* x) { return _mm512_loadu_si512(x); }
  template <bool SG>
  static PQ_INLINE I dot(I acc, const Unit<SG>& w, I x, I s) {
    const __m512i xv = SG ? _mm512_mask_sub_epi8(x, w.neg, _mm512_setzero_si512(), x) : x;
    return _mm512_dpwssd_epi32(acc, _mm512_maddubs_epi16(w.u, xv), s);
  }
  static PQ_INLINE __m256i lanes(I acc) {  // chunk 2i's lanes + chunk 2i+1's: AVX2's I
    return _mm256_add_epi32(_mm512_castsi512_si256(acc), _mm512_extracti64x4_epi64(acc, 1));
  }
};

using U = Z;
#include "qmatmul_a8x_tile.inc"

// --- Q4_K / Q5_K, two weight rows at a time -----------------------------------------------------
//
// The generic tile above spends most of its instructions per super-block outside the products: a
// scalar decode of the 12 scale bytes, 32-byte broadcasts and a variable shift per unit, and a
// fold per row. Here, per pair of weight rows: the scales of both rows decoded in one ymm (7
// vector ops), their 16 scales and mins widened to int16 in one zmm (row 1 in lanes 16-31), the
// quants read 64 bytes at a time (low nibbles: chunks 2j and 2j + 2 of the 64 bytes' two 32-byte
// halves, high nibbles: 2j + 1 and 2j + 3), and both rows folded in one zmm (row 1 in its upper
// 8 lanes). The units are chunk pairs (0, 2), (1, 3), (4, 6), (5, 7), so the activations are read
// in that order (unit_order: once per linear call, by the caller). Every int32 lane sum I[l]
// and every float step per lane is the generic tile's, so the results are the same bits (tested
// against impl 1 and 2).
// Zen 4, 1 thread, 2048 x 1536 from L2/L3, medians of alternated runs, generic -> tile_k4: Q4_K
// 94 -> 80 us at 1 row, 211 -> 192 at 3, 288 -> 273 at 5; Q5_K 111 -> 100 at 1 row, 246 -> 233
// at 3 (at 4 and 5 rows, 233 -> 242 and 334 -> 337: Q5_K keeps the generic tile there).


// the 12 scale bytes of two blocks (p0 low lane, p1 high) -> per lane bytes sc0-7 then mn0-7
// (scale_min_k4: sc j<4 = a & 63, mn j<4 = b & 63, sc 4+j = (c & 15) | (a >> 6) << 4,
// mn 4+j = (c >> 4) | (b >> 6) << 4, for the words a, b, c of the 12 bytes)
PQ_INLINE __m256i k4_scales(const uint8_t* p0, const uint8_t* p1) {
  const __m256i raw = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p0))),
                                              _mm_loadu_si128(reinterpret_cast<const __m128i*>(p1)), 1);
  const __m256i acbc = _mm256_shuffle_epi8(raw, _mm256_broadcastsi128_si256(_mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11)));
  const __m256i lo = _mm256_and_si256(_mm256_srlv_epi32(acbc, _mm256_setr_epi32(0, 0, 0, 4, 0, 0, 0, 4)),
                                      _mm256_setr_epi32(0x3F3F3F3F, 0x0F0F0F0F, 0x3F3F3F3F, 0x0F0F0F0F,
                                                        0x3F3F3F3F, 0x0F0F0F0F, 0x3F3F3F3F, 0x0F0F0F0F));
  const __m256i z0b = _mm256_shuffle_epi8(raw, _mm256_broadcastsi128_si256(_mm_setr_epi8(-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7)));
  return _mm256_or_si256(lo, _mm256_and_si256(_mm256_srli_epi32(z0b, 2), _mm256_set1_epi8(0x30)));
}

// vpshufb control: int16 a of each 128-bit lane in lanes 0-1, int16 b in lanes 2-3
PQ_INLINE __m512i pick2(int a, int b) {
  const __m256i lo = _mm256_set1_epi16(static_cast<short>((2 * a) | (2 * a + 1) << 8));
  const __m256i hi = _mm256_set1_epi16(static_cast<short>((2 * b) | (2 * b + 1) << 8));
  return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

// float lanes 0-7 = v[a], 8-15 = v[b]
PQ_INLINE __m512 lanes2(__m512 v, int a, int b) {
  return _mm512_permutexvar_ps(_mm512_inserti64x4(_mm512_set1_epi32(a), _mm256_set1_epi32(b), 1), v);
}

// 2 weight rows x R activation rows (unit order, xp), the whole row: res[v + r * ldr]
template <int64_t QT, int R>
PQ_INLINE void tile_k4(const uint8_t* row, int64_t rb, int64_t nsb, const int8_t* xp, const float* xd,
                       const int16_t* bs, int64_t K, float* res, int64_t ldr) {
  constexpr int64_t bb = sb_bytes(QT);
  constexpr int64_t QS = QT == Q4_K ? 16 : 48;  // the quants' offset in the block
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  // the mins twice each (per-16 groups 2l, 2l + 1 -> mn l) for both rows: sc16 lanes 8 + l, 24 + l
  const __m512i mn_idx = _mm512_inserti64x4(
      _mm512_castsi256_si512(_mm256_setr_epi16(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15)),
      _mm256_setr_epi16(24, 24, 25, 25, 26, 26, 27, 27, 28, 28, 29, 29, 30, 30, 31, 31), 1);
  __m512 y[R];
  for (int r = 0; r < R; ++r) y[r] = _mm512_setzero_ps();
  for (int64_t sb = 0; sb < nsb; ++sb) {
    const uint8_t* b0 = row + bb * sb;
    const uint8_t* b1 = b0 + rb;
    for (int64_t o = 0; o < bb; o += 64) {  // every line of the block PF_TILES tiles ahead (the next block's first ends it)
      _mm_prefetch(reinterpret_cast<const char*>(b0 + 2 * PF_TILES * rb + o), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(b1 + 2 * PF_TILES * rb + o), _MM_HINT_T1);
    }
    const __m512i sc16 = _mm512_cvtepu8_epi16(k4_scales(b0 + 4, b1 + 4));  // row 0: lanes 0-15, row 1: 16-31
    const __m512i mn16 = _mm512_permutexvar_epi16(mn_idx, sc16);
    // each row's 8 scales (int16) in every 128-bit lane, for the units' in-lane shuffles
    const __m512i pv[2] = {_mm512_broadcast_i32x4(_mm512_castsi512_si128(sc16)),
                           _mm512_broadcast_i32x4(_mm512_extracti32x4_epi32(sc16, 2))};
    // d, dmin of both rows: [d0, dmin0, d1, dmin1]
    const __m128 dd = _mm_cvtph_ps(_mm_unpacklo_epi32(_mm_cvtsi32_si128(static_cast<int>(word(b0))),
                                                      _mm_cvtsi32_si128(static_cast<int>(word(b1)))));
    __m512i acc[2][R];
    for (int v = 0; v < 2; ++v)
      for (int r = 0; r < R; ++r) acc[v][r] = _mm512_setzero_si512();
    __m512i qh[2];
    if constexpr (QT == Q5_K) {
      qh[0] = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b0 + 16)));
      qh[1] = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b1 + 16)));
    }
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      const int ca = UNIT_ORDER[2 * i], cb = UNIT_ORDER[2 * i + 1];
      __m512i u[2], s[2];
      for (int v = 0; v < 2; ++v) {
        const __m512i q = _mm512_loadu_si512(row + v * rb + bb * sb + QS + 64 * (i / 2));
        u[v] = _mm512_and_si512(i % 2 ? _mm512_srli_epi16(q, 4) : q, m4);
        if constexpr (QT == Q5_K) {
          const __m512i sel = _mm512_inserti64x4(_mm512_set1_epi8(static_cast<char>(1 << ca)),
                                                 _mm256_set1_epi8(static_cast<char>(1 << cb)), 1);
          u[v] = _mm512_mask_add_epi8(u[v], _mm512_test_epi8_mask(qh[v], sel), u[v], _mm512_set1_epi8(0x10));
        }
        s[v] = _mm512_shuffle_epi8(pv[v], pick2(ca, cb));
      }
      for (int r = 0; r < R; ++r) {
        const __m512i x = _mm512_loadu_si512(xp + r * K + QK_K * sb + 64 * i);
        for (int v = 0; v < 2; ++v) {
          acc[v][r] = _mm512_dpwssd_epi32(acc[v][r], _mm512_maddubs_epi16(u[v], x), s[v]);
          asm("" : "+v"(acc[v][r]));
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      // I of both rows in one zmm (row v's chunk halves added: the generic tile's lanes())
      const __m512i I = _mm512_add_epi32(_mm512_shuffle_i64x2(acc[0][r], acc[1][r], 0x44),
                                         _mm512_shuffle_i64x2(acc[0][r], acc[1][r], 0xEE));
      const __m512i b16 = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bs + 16 * (r * nsb + sb))));
      const __m512i M = _mm512_madd_epi16(mn16, b16);
      const __m128 f = _mm_mul_ps(dd, _mm_set1_ps(xd[r * nsb + sb]));  // d dx, dmin dx per row
      const __m512 f4 = _mm512_castps128_ps512(_mm_xor_ps(f, _mm_setr_ps(0.f, -0.f, 0.f, -0.f)));  // d dx, -(dmin dx)
      y[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(I), lanes2(f4, 0, 2), y[r]);
      y[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(M), lanes2(f4, 1, 3), y[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    res[r * ldr] = simd::hsum(_mm512_castps512_ps256(y[r]));
    res[1 + r * ldr] = simd::hsum(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(y[r]), 1)));
  }
}

template <int64_t QT>
void rows_k4(const uint8_t* row, int64_t rb, int64_t nsb, int64_t T, const int8_t* xp, const float* xd,
             const int16_t* bs, int64_t K, float* res, int64_t ldr) {
  by_rows<4>(T, [&](auto R, int64_t t) {
    tile_k4<QT, decltype(R)::value>(row, rb, nsb, xp + t * K, xd + t * nsb, bs + 16 * t * nsb, K, res + t * ldr, ldr);
  });
}

template <int64_t QT>
void range(const uint8_t* w, int64_t rb, int64_t n0, int64_t n1, int64_t nsb, int64_t T,
           const int8_t* xq, const float* xd, const int16_t* bs, int64_t K, float* out, int64_t ldo,
           const int8_t* xu) {
  int64_t n = n0;
  // Q4_K, Q5_K: pairs of weight rows by tile_k4 (Q5_K below 4 activation rows: from 4 on, the
  // generic tile measured as fast), on xu (x in unit order)
  if constexpr (QT == Q4_K || QT == Q5_K) {
    if (reads_units(QT, T, 0)) {
      TORCH_CHECK(xu != nullptr, "x_range: Q4_K / Q5_K here read x in unit order (unit_order)");
      for (; n + 2 <= n1; n += 2) rows_k4<QT>(w + n * rb, rb, nsb, T, xu, xd, bs, K, out + n, ldo);
    }
  }
  for (; n + 2 <= n1; n += 2) rows<QT, 2>(w + n * rb, rb, nsb, T, xq, xd, bs, K, out + n, ldo);
  for (; n < n1; ++n) rows<QT, 1>(w + n * rb, rb, nsb, T, xq, xd, bs, K, out + n, ldo);
}

}  // namespace zv
#pragma GCC pop_options

namespace {

// impl 0: AVX-512 VNNI where the CPU has it, else AVX2; 2: AVX2; 1 (or anything else): scalar
template <int64_t QT>
void range(const uint8_t* w, int64_t rb, int64_t n0, int64_t n1, int64_t nsb, int64_t T,
           const int8_t* xq, const float* xd, const int16_t* bs, int64_t K, float* out, int64_t ldo,
           int64_t impl, const int8_t* xu) {
  if (impl == 0 && vnni512()) return zv::range<QT>(w, rb, n0, n1, nsb, T, xq, xd, bs, K, out, ldo, xu);
  if (impl == 0 || impl == 2) {
    int64_t n = n0;
    for (; n + 2 <= n1; n += 2) y::rows<QT, 2>(w + n * rb, rb, nsb, T, xq, xd, bs, K, out + n, ldo);
    for (; n < n1; ++n) y::rows<QT, 1>(w + n * rb, rb, nsb, T, xq, xd, bs, K, out + n, ldo);
    return;
  }
  for (int64_t n = n0; n < n1; ++n) row_scalar<QT>(w + n * rb, nsb, T, xq, xd, bs, K, out + n, ldo);
}

#else

template <int64_t QT>
void range(const uint8_t* w, int64_t rb, int64_t n0, int64_t n1, int64_t nsb, int64_t T,
           const int8_t* xq, const float* xd, const int16_t* bs, int64_t K, float* out, int64_t ldo,
           int64_t, const int8_t*) {
  for (int64_t n = n0; n < n1; ++n) row_scalar<QT>(w + n * rb, nsb, T, xq, xd, bs, K, out + n, ldo);
}

#endif  // PQ_AVX2

}  // namespace

void unit_order(const int8_t* x, int8_t* out, int64_t n) {
  for (int64_t sb = 0; sb < n; sb += QK_K)
    for (int j = 0; j < 8; ++j) std::memcpy(out + sb + 32 * j, x + sb + 32 * UNIT_ORDER[j], 32);
}

bool reads_units(int64_t t, int64_t T, int64_t impl) {
#ifdef PQ_AVX2
  return impl == 0 && vnni512() && (t == Q4_K || (t == Q5_K && T < 4));
#else
  (void)t, (void)T, (void)impl;
  return false;
#endif
}

void x_range(int64_t t, const uint8_t* w, int64_t rb, int64_t n0, int64_t n1, int64_t nsb, int64_t T,
             const int8_t* xq, const float* xd, const int16_t* bs, int64_t K, float* out, int64_t ldo,
             int64_t impl, const int8_t* xu) {
  switch (t) {
    case Q2_K: range<Q2_K>(w, rb, n0, n1, nsb, T, xq, xd, bs, K, out, ldo, impl, xu); return;
    case Q3_K: range<Q3_K>(w, rb, n0, n1, nsb, T, xq, xd, bs, K, out, ldo, impl, xu); return;
    case Q4_K: range<Q4_K>(w, rb, n0, n1, nsb, T, xq, xd, bs, K, out, ldo, impl, xu); return;
    case Q5_K: range<Q5_K>(w, rb, n0, n1, nsb, T, xq, xd, bs, K, out, ldo, impl, xu); return;
    case Q6_K: range<Q6_K>(w, rb, n0, n1, nsb, T, xq, xd, bs, K, out, ldo, impl, xu); return;
    case IQ4_XS: range<IQ4_XS>(w, rb, n0, n1, nsb, T, xq, xd, bs, K, out, ldo, impl, xu); return;
    default: TORCH_CHECK(false, "x_range: not a super-block type: ", t);
  }
}

}  // namespace a8
