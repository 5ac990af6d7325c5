// Opt-in activation-quantized matmul ("activations=int8"), for CPU: the llama.cpp way.
//
// Each activation row is quantized once per call to int8 per 32-element block: d = max|x| / 127,
// q = nearbyint(x * (1 / d)), and s = d * sum(q) (the block sum, for weights with an offset).
// A weight block of Q4_0, Q4_1 or Q8_0 is then dotted with it in integers:
//   Q4_1: y += dw * dx * sum(qw * qx) + m * s            (qw the unsigned nibbles 0..15)
//   Q4_0: the same with m = -8 * dw                      (dw * (qw - 8) == dw * qw - 8 * dw)
//   Q8_0: y += dw * dx * sum(qw * qx)                    (qw signed)
// With AVX2 the 32 products of a block are summed by maddubs (u8 x s8 -> pairs in int16; Q8_0
// weights through the sign trick |w| x sign(x, w)) and madd (-> 8 int32 lanes, lane j holding
// elements 4j..4j+3), converted to float and accumulated with one FMA per block into 8 float
// lanes; the offset terms (m * s) are summed block by block in a scalar, except for rows in whole
// groups of 4, which keep them per block and sum them after the block loop (8 lanes of FMAs,
// then the remainder): cheaper per row there, dearer for 1-3 rows (measured). The scalar path (impl=1, or a build without
// AVX2) does exactly the same arithmetic lane by lane, so both give bit-identical results.
//
// Each weight row is read from memory once per call: a pair of weight rows is unpacked block by
// block for a group of up to 4 activation rows at a time (each activation block loaded once for
// the pair) and stays in L1 between groups. Threads split the weight rows.
//
// Ops (torch.ops.pagedkv_a8.*):
//   quantize(x [T, K] f32, xq [T, K] i8, xd [T, K/32] f32, xs [T, K/32] f32, impl)
//   matmul(xq, xd, xs, w [N, rb] u8, qtype, out [T, >= col0 + N] f32, col0, impl)
//   linear(x [T, K] f32, ws [w_i [N_i, rb_i] u8], qtypes, out [T, sum N_i] f32, impl): quantize
//     once, then every segment into its columns, in one parallel loop (one op call per Linear)
// impl: 0 = fastest available (AVX-512 VNNI for 1-3 rows where the CPU has it), 1 = scalar,
// 2 = AVX2 (the VNNI paths off); every impl gives the same results.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "ggml_blocks.h"
#include "isa.h"
#include "qmatmul_a8.h"
#include "simd.inc"
#include "vec.h"

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define A8_AVX2 1
#endif

namespace a8 {

using ggml::half;
using ggml::Q4_0;
using ggml::Q4_1;
using ggml::Q8_0;
using ggml::Q5_0;
using ggml::Q5_1;
using ggml::IQ4_NL;
constexpr int64_t PF_TILES = 4;
// AVX2: the next tile only, NTA (each weight byte is read once a call): T0 lines 4 tiles ahead
// passed through L2 into Zen 2's L3 and pushed out what the rest of the step runs from (see
// qmatmul_simd.inc: PF_NTA_BYTES). Batch-1 int8 steps, Zen 2, 2 threads, ms, T0 4 tiles -> NTA
// 1 (with qmatmul_a8x's tiles): the 0.5B Q4_K_M mix 22.0-22.7 -> 20.2-22.3, the 1.5B 51.0-51.7
// -> 45.9-48.5, Gemma 3 270M 13.2-13.6 -> 12.8-13.5. The VNNI code keeps T0, 4 tiles (not
// measured with NTA).
constexpr int64_t PF_NTA_TILES = 1;
constexpr int64_t QK = ggml::QK;

int64_t block_bytes(int64_t t) {  // 0: a type of qmatmul_a8x.cpp, or none
  return t == Q4_0 || t == Q4_1 || t == Q8_0 || t == Q5_0 || t == Q5_1 || t == IQ4_NL
             ? ggml::type_info(t)->bytes : 0;
}

bool panel_type(int64_t t) {
  return t == Q4_0 || t == Q4_1 || t == Q8_0 || t == Q5_0 || t == Q5_1 || t == IQ4_NL || t == ggml::Q4_K ||
         t == ggml::Q5_K || t == ggml::Q6_K || t == ggml::IQ4_XS || t == ggml::Q2_K || t == ggml::Q3_K;
}

// signed integer weights (the sign trick before maddubs) and no offset term
constexpr bool signed_type(int64_t t) { return t == Q8_0 || t == IQ4_NL; }

int64_t row_bytes(int64_t t, int64_t K) {
  if (!block_bytes(t) && !x_type(t)) return 0;
  const ggml::TypeInfo* i = ggml::type_info(t);
  return K % i->block ? 0 : K / i->block * i->bytes;
}

// --- activation quantization -------------------------------------------------------------------

// a block holding an inf or a NaN: zeros, its d and s NaN (so every path's products are 0 and its
// outputs NaN alike; the cast of inf * 0 would give -128, which the sign trick reads as +128)
static void non_finite_block(int8_t* q, int n, float* d, float* s, int32_t* isum) {
  std::memset(q, 0, n);
  *d = NAN;
  if (s) *s = NAN;
  if (isum) *isum = 0;
}

void quant_block_scalar(const float* x, int8_t* q, float* d, float* s, int32_t* isum) {
  float amax = 0.f;
  bool nan = false;
  for (int i = 0; i < QK; ++i) amax = std::max(amax, std::fabs(x[i])), nan |= std::isnan(x[i]);
  if (nan || std::isinf(amax)) return non_finite_block(q, QK, d, s, isum);
  const float dd = amax / 127.f;
  const float id = inv_scale(dd);  // (qmatmul_a8.h: the same steps as the AVX2 code)
  int32_t sum = 0;
  for (int i = 0; i < QK; ++i) {
    const int32_t v = round_i32(x[i] * id);
    q[i] = sat8(v);
    sum = wrap_add(sum, v);
  }
  *d = dd;
  *s = dd * static_cast<float>(sum);
  if (isum) *isum = sum;
}

#ifdef A8_AVX2
void quant_block_avx2(const float* x, int8_t* q, float* d, float* s, int32_t* isum) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 v[4];
  __m256 m = _mm256_setzero_ps(), un = _mm256_setzero_ps();
  for (int k = 0; k < 4; ++k) {
    v[k] = _mm256_loadu_ps(x + 8 * k);
    m = _mm256_max_ps(_mm256_andnot_ps(sign, v[k]), m);  // a NaN dropped, as std::max does,
    un = _mm256_or_ps(un, _mm256_cmp_ps(v[k], v[k], _CMP_UNORD_Q));  // and flagged
  }
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  if (_mm256_movemask_ps(un) || std::isinf(_mm_cvtss_f32(h))) return non_finite_block(q, QK, d, s, isum);
  const float dd = _mm_cvtss_f32(h) / 127.f;
  const __m256 id = _mm256_set1_ps(inv_scale(dd));
  __m256i i[4];
  for (int k = 0; k < 4; ++k)
    i[k] = _mm256_cvtps_epi32(
        _mm256_round_ps(_mm256_mul_ps(v[k], id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  __m256i sum = _mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3]));
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
  s4 = _mm_add_epi32(s4, _mm_unpackhi_epi64(s4, s4));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 1));
  // int32 -> int8 in element order (packs interleave the 128-bit lanes; the permute undoes it)
  const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
  const __m256i ordered = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), ordered);
  *d = dd;
  *s = dd * static_cast<float>(_mm_cvtsi128_si32(s4));
  if (isum) *isum = _mm_cvtsi128_si32(s4);
}
#endif

// --- scalar dot products: the AVX2 arithmetic, lane by lane ------------------------------------

struct WBlock {
  int w[QK];  // integer weights: Q4 nibbles 0..15, Q5 0..31 (element order), Q8 / IQ4_NL signed
  float d, m;
};

inline void unpack_scalar(int64_t t, const uint8_t* b, WBlock& wb) {
  if (t == Q8_0) {
    wb.d = half(b), wb.m = 0.f;
    for (int i = 0; i < QK; ++i) wb.w[i] = static_cast<int8_t>(b[2 + i]);
    return;
  }
  if (t == IQ4_NL) {
    wb.d = half(b), wb.m = 0.f;
    for (int i = 0; i < QK; ++i) wb.w[i] = ggml::IQ4_LEVELS[ggml::nibble(b + 2, i)];
    return;
  }
  if (t == Q5_0 || t == Q5_1) {  // u = nibble | high bit << 4; Q5_0: w = d (u - 16)
    const int o = t == Q5_0 ? 2 : 4;
    const uint32_t qh = ggml::u32(b + o);
    for (int i = 0; i < QK; ++i) wb.w[i] = ggml::nibble(b + o + 4, i) | static_cast<int>((qh >> i) & 1) << 4;
    wb.d = half(b);
    wb.m = t == Q5_1 ? half(b + 2) : wb.d * -16.f;
    return;
  }
  const uint8_t* qs = b + (t == Q4_1 ? 4 : 2);
  wb.d = half(b);
  wb.m = t == Q4_1 ? half(b + 2) : -8.f * wb.d;
  for (int i = 0; i < 16; ++i) wb.w[i] = qs[i] & 0x0F, wb.w[i + 16] = qs[i] >> 4;
}

// the AVX2 horizontal sum's order: ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))
inline float hsum_lanes(const float* l) {
  return ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
}

// sum over blocks of m[b] * s[b] (the offset terms): 8 lanes of FMAs over whole groups of 8
// blocks, the AVX2 horizontal sum, then the rest one by one
float offset_dot_scalar(const float* m, const float* s, int64_t nb) {
  float l[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int64_t b = 0;
  for (; b + 8 <= nb; b += 8)
    for (int j = 0; j < 8; ++j) l[j] = std::fmaf(m[b + j], s[b + j], l[j]);
  float t = hsum_lanes(l);
  for (; b < nb; ++b) t = t + m[b] * s[b];
  return t;
}

void row_scalar(int64_t t, const uint8_t* row, int64_t nb, int64_t T, const int8_t* xq,
                const float* xd, const float* xs, int64_t K, float* res, int64_t ldr) {
  const int64_t bb = block_bytes(t);
  std::vector<float> mb(nb);
  for (int64_t r = 0; r < T; ++r) {
    // rows in whole groups of 4 (tile_late) sum every block into one set of lanes; the others
    // (tile_inline) even and odd blocks apart, added at the end
    const bool late = r < T - T % 4;
    float acc[2][8] = {};
    WBlock wb;
    for (int64_t b = 0; b < nb; ++b) {
      unpack_scalar(t, row + bb * b, wb);
      const int8_t* x = xq + r * K + QK * b;
      const float d = wb.d * xd[r * nb + b];
      float* a = acc[late ? 0 : b % 2];
      for (int j = 0; j < 8; ++j) {
        int lane = 0;
        for (int i = 4 * j; i < 4 * j + 4; ++i) lane += wb.w[i] * x[i];
        a[j] = std::fmaf(static_cast<float>(lane), d, a[j]);
      }
      mb[b] = wb.m;
    }
    // the offsets: after the loop (late), else block by block, even and odd blocks apart
    float summ = 0.f;
    if (!signed_type(t) && late) {
      summ = offset_dot_scalar(mb.data(), xs + r * nb, nb);
    } else if (!signed_type(t)) {
      float s2[2] = {0.f, 0.f};
      for (int64_t b = 0; b < nb; ++b) s2[b % 2] = s2[b % 2] + mb[b] * xs[r * nb + b];
      summ = s2[0] + s2[1];
    }
    if (!late)
      for (int j = 0; j < 8; ++j) acc[0][j] = acc[0][j] + acc[1][j];
    res[r * ldr] = hsum_lanes(acc[0]) + summ;
  }
}

// --- AVX2 --------------------------------------------------------------------------------------

#ifdef A8_AVX2
using simd::hsum;

float offset_dot_avx2(const float* m, const float* s, int64_t nb) {
  __m256 l = _mm256_setzero_ps();
  int64_t b = 0;
  for (; b + 8 <= nb; b += 8) l = _mm256_fmadd_ps(_mm256_loadu_ps(m + b), _mm256_loadu_ps(s + b), l);
  float t = hsum(l);
  for (; b < nb; ++b) t = t + m[b] * s[b];
  return t;
}

// One weight block -> w (Q8: signed values; Q4: nibbles 0..15 in element order), aw = |w| for
// maddubs, and [d, m, 0, 0]: its scale and its offset (Q4_1: the block's m; Q4_0: -8 d; Q8_0: 0),
// both converted from half by one instruction.
template <int64_t QT>
__attribute__((always_inline)) inline __m128 load_block(const uint8_t* blk, __m256i& w, __m256i& aw) {
  if (QT == Q8_0 || QT == IQ4_NL) {
    w = QT == Q8_0 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2))
                   : vec::lookup16(ggml::IQ4_LEVELS, vec::nibbles(blk + 2));
    aw = _mm256_abs_epi8(w);
    uint16_t h;
    std::memcpy(&h, blk, 2);
    return _mm_cvtph_ps(_mm_cvtsi32_si128(h));
  }
  if (QT == Q5_0 || QT == Q5_1) {
    const int o = QT == Q5_0 ? 2 : 4;
    const __m256i hi = _mm256_and_si256(vec::bit_bytes(ggml::u32(blk + o)), _mm256_set1_epi8(0x10));
    w = aw = _mm256_or_si256(vec::nibbles(blk + o + 4), hi);
    if (QT == Q5_1) return vec::half2(blk);
    uint16_t h;
    std::memcpy(&h, blk, 2);
    return _mm_mul_ps(_mm_cvtph_ps(_mm_set1_epi16(static_cast<short>(h))), _mm_setr_ps(1.f, -16.f, 0.f, 0.f));
  }
  // the 16 bytes in both halves, the upper half shifted right by 4: nibbles in element order
  const __m256i raw = _mm256_broadcastsi128_si256(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + (QT == Q4_1 ? 4 : 2))));
  w = aw = _mm256_and_si256(_mm256_srlv_epi64(raw, _mm256_setr_epi64x(0, 0, 4, 4)),
                            _mm256_set1_epi8(0x0F));
  if (QT == Q4_1) {
    int32_t dm;
    std::memcpy(&dm, blk, 4);
    return _mm_cvtph_ps(_mm_cvtsi32_si128(dm));
  }
  uint16_t h;
  std::memcpy(&h, blk, 2);
  return _mm_mul_ps(_mm_cvtph_ps(_mm_set1_epi16(static_cast<short>(h))), _mm_setr_ps(1.f, -8.f, 0.f, 0.f));
}

// W weight rows (W <= 2) x 1-3 activation rows: as tile_late, but the offsets are summed block
// by block, and even and odd blocks into separate sums (lanes and offsets), added at the end
// (so the VNNI code folds two blocks with one 16-lane FMA). The activation side comes as pairs
// xp = [dx, sx] per block, so that one multiply [d, m] x [dx, sx] gives both the block's scale
// d * dx (broadcast to the 8 lanes) and its offset term m * sx, added to lane 1 of a running sum
// (lane 0 of that sum is unused).
template <int64_t QT, int W, int R>
__attribute__((always_inline)) inline void tile_inline(const uint8_t* row, int64_t rb, int64_t nb, const int8_t* xq,
                                                       const float* xp, int64_t K, float* res, int64_t ldr) {
  constexpr int64_t bb = QT == Q4_0 || QT == IQ4_NL ? 18 : QT == Q4_1 ? 20 : QT == Q5_0 ? 22 : QT == Q5_1 ? 24 : 34;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[2][W][R];  // even and odd blocks apart
  __m128 summ[2][W][R];
  for (int e = 0; e < 2; ++e)
    for (int v = 0; v < W; ++v)
      for (int r = 0; r < R; ++r) acc[e][v][r] = _mm256_setzero_ps(), summ[e][v][r] = _mm_setzero_ps();
  // block b into the sums of parity E (a constant: the sums stay in registers)
  auto block = [&](int64_t b, auto E) __attribute__((always_inline)) {
    constexpr int e = decltype(E)::value;
    __m256i w[W], aw[W];
    __m128 dm[W];
    // fetch the rows PF_TILES tiles ahead (W rows, W * bb bytes per block step: the whole
    // tile over the block loop); the hardware prefetcher alone left streaming at ~20 GB/s
    _mm_prefetch(reinterpret_cast<const char*>(row + PF_NTA_TILES * W * rb + W * bb * b), _MM_HINT_NTA);
    for (int v = 0; v < W; ++v) dm[v] = load_block<QT>(row + v * rb + bb * b, w[v], aw[v]);
    for (int r = 0; r < R; ++r) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + r * K + QK * b));
      const __m128 ds = _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(xp + 2 * (r * nb + b))));
      for (int v = 0; v < W; ++v) {
        const __m256i xv = signed_type(QT) ? _mm256_sign_epi8(x, w[v]) : x;
        const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(aw[v], xv), ones);
        const __m128 prod = _mm_mul_ps(dm[v], ds);  // [d * dx, m * sx]
        acc[e][v][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_broadcastss_ps(prod), acc[e][v][r]);
        if (!signed_type(QT)) summ[e][v][r] = _mm_add_ps(summ[e][v][r], prod);
      }
    }
  };
  int64_t b = 0;
  for (; b + 2 <= nb; b += 2) {
    block(b, std::integral_constant<int, 0>{});
    block(b + 1, std::integral_constant<int, 1>{});
  }
  if (b < nb) block(b, std::integral_constant<int, 0>{});
  for (int v = 0; v < W; ++v)
    for (int r = 0; r < R; ++r) {
      const float sm = _mm_cvtss_f32(_mm_movehdup_ps(summ[0][v][r])) + _mm_cvtss_f32(_mm_movehdup_ps(summ[1][v][r]));
      res[v + r * ldr] = hsum(_mm256_add_ps(acc[0][v][r], acc[1][v][r])) + sm;
    }
}

// W weight rows (W <= 2) x R activation rows (a whole group of 4): each activation block is
// loaded and its scale broadcast once for both weight rows; the offsets m of the weight blocks
// are kept in mb [W, nb] and summed against xs after the block loop. res[w + r * ldr]
template <int64_t QT, int W, int R>
__attribute__((always_inline)) inline void tile_late(const uint8_t* row, int64_t rb, int64_t nb, const int8_t* xq, const float* xd,
               const float* xs, int64_t K, float* res, int64_t ldr, float* mb) {
  constexpr int64_t bb = QT == Q4_0 || QT == IQ4_NL ? 18 : QT == Q4_1 ? 20 : QT == Q5_0 ? 22 : QT == Q5_1 ? 24 : 34;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[W][R];
  for (int v = 0; v < W; ++v)
    for (int r = 0; r < R; ++r) acc[v][r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m256i w[W], aw[W];
    __m256 dw[W];
    _mm_prefetch(reinterpret_cast<const char*>(row + PF_NTA_TILES * W * rb + W * bb * b), _MM_HINT_NTA);
    for (int v = 0; v < W; ++v) {
      const __m128 dm = load_block<QT>(row + v * rb + bb * b, w[v], aw[v]);
      dw[v] = _mm256_broadcastss_ps(dm);
      if (!signed_type(QT)) mb[v * nb + b] = _mm_cvtss_f32(_mm_movehdup_ps(dm));
    }
    for (int r = 0; r < R; ++r) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + r * K + QK * b));
      const __m256 dx = _mm256_broadcast_ss(xd + r * nb + b);
      for (int v = 0; v < W; ++v) {
        const __m256i xv = signed_type(QT) ? _mm256_sign_epi8(x, w[v]) : x;
        const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(aw[v], xv), ones);
        acc[v][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(dw[v], dx), acc[v][r]);
      }
    }
  }
  for (int v = 0; v < W; ++v)
    for (int r = 0; r < R; ++r)
      res[v + r * ldr] = hsum(acc[v][r]) + (signed_type(QT) ? 0.f : offset_dot_avx2(mb + v * nb, xs + r * nb, nb));
}

}  // namespace a8

// --- AVX-512 VNNI: two blocks per instruction (1-3 activation rows) ------------------------------
//
// tile_inline's arithmetic with blocks b and b + 1 in one register: their 64 bytes unpacked at
// once (Q5's high bits by one mask), the integer sums by one vpdpbusd (maddubs + madd(ones) never
// saturates here: |w| <= 128, |q| <= 127, so the sums of 4 are the same int32), and the float
// steps block by block in tile_inline's order: bit-identical results.

#ifdef A8_AVX2
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni")
namespace a8::zb {

using namespace ggml;

PQ_INLINE int h16(const uint8_t* p) {  // a block's half d, as the low 16 bits
  uint16_t h;
  std::memcpy(&h, p, 2);
  return h;
}
PQ_INLINE __m512i two(__m256i a, __m256i b) { return _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1); }
PQ_INLINE __m256i bcast16(const uint8_t* p) {
  return _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
// the 2 x 16 bytes at p0, p1 -> their 64 nibbles in element order (block p0's, then p1's)
PQ_INLINE __m512i nibbles2(const uint8_t* p0, const uint8_t* p1) {
  return _mm512_and_si512(_mm512_srlv_epi64(two(bcast16(p0), bcast16(p1)), _mm512_setr_epi64(0, 0, 4, 4, 0, 0, 4, 4)),
                          _mm512_set1_epi8(0x0F));
}

// blocks b0, b1 -> w (signed types: signed values; the others: 0..15 / 0..31) and [d, m, 0, 0] each
template <int64_t QT>
PQ_INLINE __m512i load2(const uint8_t* b0, const uint8_t* b1, __m128& dm0, __m128& dm1) {
  if constexpr (QT == Q8_0) {
    dm0 = _mm_cvtph_ps(_mm_cvtsi32_si128(h16(b0))), dm1 = _mm_cvtph_ps(_mm_cvtsi32_si128(h16(b1)));
    return two(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b0 + 2)), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b1 + 2)));
  } else if constexpr (QT == IQ4_NL) {
    dm0 = _mm_cvtph_ps(_mm_cvtsi32_si128(h16(b0))), dm1 = _mm_cvtph_ps(_mm_cvtsi32_si128(h16(b1)));
    const __m512i lev = _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(IQ4_LEVELS)));
    return _mm512_shuffle_epi8(lev, nibbles2(b0 + 2, b1 + 2));
  } else {
    constexpr int o = QT == Q4_0 ? 2 : QT == Q4_1 ? 4 : QT == Q5_0 ? 6 : 8;  // the quants' offset
    __m512i u = nibbles2(b0 + o, b1 + o);
    if constexpr (QT == Q5_0 || QT == Q5_1) {  // bit i of qh: element i's 0x10
      const uint64_t hb = u32(b0 + o - 4) | (static_cast<uint64_t>(u32(b1 + o - 4)) << 32);
      u = _mm512_mask_add_epi8(u, _cvtu64_mask64(hb), u, _mm512_set1_epi8(0x10));
    }
    if constexpr (QT == Q4_1 || QT == Q5_1) {
      dm0 = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(u32(b0))));
      dm1 = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(u32(b1))));
    } else {
      const __m128 off = _mm_setr_ps(1.f, QT == Q4_0 ? -8.f : -16.f, 0.f, 0.f);
      dm0 = _mm_mul_ps(_mm_cvtph_ps(_mm_set1_epi16(static_cast<short>(h16(b0)))), off);
      dm1 = _mm_mul_ps(_mm_cvtph_ps(_mm_set1_epi16(static_cast<short>(h16(b1)))), off);
    }
    return u;
  }
}

template <int64_t QT, int W, int R>
__attribute__((noinline)) void tile_inline(const uint8_t* row, int64_t rb, int64_t nb, const int8_t* xq,
                                           const float* xp, int64_t K, float* res, int64_t ldr) {
  constexpr int64_t bb = QT == Q4_0 || QT == IQ4_NL ? 18 : QT == Q4_1 ? 20 : QT == Q5_0 ? 22 : QT == Q5_1 ? 24 : 34;
  constexpr bool SG = signed_type(QT);
  // lanes 0-7: the even blocks' sums, 8-15: the odd blocks' (tile_inline's two sets); summ lane
  // 1 the even blocks' offsets, lane 3 the odd ones'
  __m512 acc[W][R];
  __m128 summ[W][R];
  for (int v = 0; v < W; ++v)
    for (int r = 0; r < R; ++r) acc[v][r] = _mm512_setzero_ps(), summ[v][r] = _mm_setzero_ps();
  const __m512i halves = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi32(2), 1);  // lanes 8-15: element 2
  int64_t b = 0;
  for (; b + 2 <= nb; b += 2) {
    __m512i w[W], aw[W];
    __mmask64 neg[W];
    __m128 dm[W];  // [d, m] of blocks b and b + 1
    _mm_prefetch(reinterpret_cast<const char*>(row + PF_TILES * W * rb + W * bb * b), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(row + PF_TILES * W * rb + W * bb * (b + 1)), _MM_HINT_T0);
    for (int v = 0; v < W; ++v) {
      const uint8_t* b0 = row + v * rb + bb * b;
      __m128 dm0, dm1;
      w[v] = load2<QT>(b0, b0 + bb, dm0, dm1);
      dm[v] = _mm_movelh_ps(dm0, dm1);
      if constexpr (SG) neg[v] = _mm512_movepi8_mask(w[v]), aw[v] = _mm512_abs_epi8(w[v]);
      else aw[v] = w[v];
    }
    for (int r = 0; r < R; ++r) {
      const __m512i x = _mm512_loadu_si512(xq + r * K + QK * b);
      const __m128 ds = _mm_loadu_ps(xp + 2 * (r * nb + b));  // [dx, sx] of blocks b, b + 1
      for (int v = 0; v < W; ++v) {
        const __m512i xv = SG ? _mm512_mask_sub_epi8(x, neg[v], _mm512_setzero_si512(), x) : x;
        const __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), aw[v], xv);
        const __m128 prod = _mm_mul_ps(dm[v], ds);  // [d dx, m sx] of b, then of b + 1
        const __m512 scale = _mm512_permutexvar_ps(halves, _mm512_castps128_ps512(prod));
        acc[v][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), scale, acc[v][r]);
        if (!SG) summ[v][r] = _mm_add_ps(summ[v][r], prod);
      }
    }
  }
  if (b < nb) {  // the last block of an odd count (an even one): the same sums in 256 bits
    for (int v = 0; v < W; ++v) {
      const uint8_t* b0 = row + v * rb + bb * b;
      __m128 dm0, dm1;
      const __m512i w2 = load2<QT>(b0, b0, dm0, dm1);  // the block twice; the lower half used
      const __m256i wv = _mm512_castsi512_si256(w2);
      const __m256i awv = SG ? _mm256_abs_epi8(wv) : wv;
      for (int r = 0; r < R; ++r) {
        const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + r * K + QK * b));
        const __m256i xv = SG ? _mm256_sign_epi8(x, wv) : x;
        const __m256i p = _mm256_dpbusd_epi32(_mm256_setzero_si256(), awv, xv);
        const __m128 ds = _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(xp + 2 * (r * nb + b))));
        const __m128 prod = _mm_mul_ps(dm0, ds);
        const __m256 lo = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_broadcastss_ps(prod), _mm512_castps512_ps256(acc[v][r]));
        acc[v][r] = _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(acc[v][r]), _mm256_castps_pd(lo), 0));
        if (!SG) summ[v][r] = _mm_add_ps(summ[v][r], _mm_movelh_ps(prod, _mm_setzero_ps()));
      }
    }
  }
  for (int v = 0; v < W; ++v)
    for (int r = 0; r < R; ++r) {
      const __m256 even = _mm512_castps512_ps256(acc[v][r]);
      const __m256 odd = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[v][r]), 1));
      const __m128 s = summ[v][r];  // lanes 1 (even blocks) and 3 (odd)
      const float sm = _mm_cvtss_f32(_mm_movehdup_ps(s)) + _mm_cvtss_f32(_mm_movehdup_ps(_mm_movehl_ps(s, s)));
      res[v + r * ldr] = simd::hsum(_mm256_add_ps(even, odd)) + sm;
    }
}

}  // namespace a8::zb
#pragma GCC pop_options
#endif

namespace a8 {

// W weight rows against all T activation rows, 4 at a time (the weight rows stay in L1)
template <int64_t QT, int W>
void rows_avx2(const uint8_t* row, int64_t rb, int64_t nb, int64_t T, const int8_t* xq,
               const float* xd, const float* xs, const float* xp, int64_t K, float* res, int64_t ldr,
               float* mb, bool vnni) {
  int64_t t = 0;
  for (; t + 4 <= T; t += 4)
    tile_late<QT, W, 4>(row, rb, nb, xq + t * K, xd + t * nb, xs + t * nb, K, res + t * ldr, ldr, mb);
  const int64_t m = T - t;
  const int8_t* q = xq + t * K;
  const float* p = xp + 2 * t * nb;
  float* o = res + t * ldr;
  if (vnni) {
    if (m == 3) zb::tile_inline<QT, W, 3>(row, rb, nb, q, p, K, o, ldr);
    else if (m == 2) zb::tile_inline<QT, W, 2>(row, rb, nb, q, p, K, o, ldr);
    else if (m == 1) zb::tile_inline<QT, W, 1>(row, rb, nb, q, p, K, o, ldr);
    return;
  }
  if (m == 3) tile_inline<QT, W, 3>(row, rb, nb, q, p, K, o, ldr);
  else if (m == 2) tile_inline<QT, W, 2>(row, rb, nb, q, p, K, o, ldr);
  else if (m == 1) tile_inline<QT, W, 1>(row, rb, nb, q, p, K, o, ldr);
}

// weight rows [n0, n1) (pairs, then a last single one)
template <int64_t QT>
void range_avx2(const uint8_t* w, int64_t rb, int64_t n0, int64_t n1, int64_t nb, int64_t T,
                const int8_t* xq, const float* xd, const float* xs, const float* xp, int64_t K,
                float* out, int64_t ldo, bool vnni) {
  std::vector<float> mb(T >= 4 ? 2 * nb : 0);  // the offsets of the current weight rows (tile_late)
  int64_t n = n0;
  for (; !signed_type(QT) && n + 2 <= n1; n += 2)
    rows_avx2<QT, 2>(w + n * rb, rb, nb, T, xq, xd, xs, xp, K, out + n, ldo, mb.data(), vnni);
  for (; n < n1; ++n) rows_avx2<QT, 1>(w + n * rb, rb, nb, T, xq, xd, xs, xp, K, out + n, ldo, mb.data(), vnni);
}

bool vnni512() {
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
  return ok && isa::limit() >= 2;
}

// vnni: 1-3 activation rows by zb::tile_inline (impl 0 on a CPU with AVX-512 VNNI)
void range_avx2(int64_t qt, const uint8_t* w, int64_t rb, int64_t n0, int64_t n1, int64_t nb,
                int64_t T, const int8_t* xq, const float* xd, const float* xs, const float* xp,
                int64_t K, float* out, int64_t ldo, int64_t impl) {
  const bool z = impl == 0 && vnni512();
  if (qt == Q4_0) range_avx2<Q4_0>(w, rb, n0, n1, nb, T, xq, xd, xs, xp, K, out, ldo, z);
  else if (qt == Q4_1) range_avx2<Q4_1>(w, rb, n0, n1, nb, T, xq, xd, xs, xp, K, out, ldo, z);
  else if (qt == Q5_0) range_avx2<Q5_0>(w, rb, n0, n1, nb, T, xq, xd, xs, xp, K, out, ldo, z);
  else if (qt == Q5_1) range_avx2<Q5_1>(w, rb, n0, n1, nb, T, xq, xd, xs, xp, K, out, ldo, z);
  else if (qt == IQ4_NL) range_avx2<IQ4_NL>(w, rb, n0, n1, nb, T, xq, xd, xs, xp, K, out, ldo, z);
  else range_avx2<Q8_0>(w, rb, n0, n1, nb, T, xq, xd, xs, xp, K, out, ldo, z);
}
#endif

bool use_avx2(int64_t impl) {
#ifdef A8_AVX2
  return impl == 0 || impl == 2;
#else
  (void)impl;
  return false;
#endif
}

// --- ops ---------------------------------------------------------------------------------------

void check_act(const at::Tensor& xq, const at::Tensor& xd, const at::Tensor& xs) {
  TORCH_CHECK(xq.dim() == 2 && xq.scalar_type() == at::kChar && xq.is_contiguous() &&
                  xq.size(1) > 0 && xq.size(1) % QK == 0,
              "xq must be a contiguous int8 [T, K] tensor, K a multiple of 32");
  const int64_t T = xq.size(0), nb = xq.size(1) / QK;
  for (const at::Tensor* t : {&xd, &xs})
    TORCH_CHECK(t->dim() == 2 && t->scalar_type() == at::kFloat && t->is_contiguous() &&
                    t->size(0) == T && t->size(1) == nb,
                "xd/xs must be contiguous float32 [T, K/32] tensors");
}

// [d, s] per block, interleaved (tile_inline reads both with one load)
std::vector<float> pairs(const float* d, const float* s, int64_t n) {
  std::vector<float> p(2 * n);
  for (int64_t i = 0; i < n; ++i) p[2 * i] = d[i], p[2 * i + 1] = s[i];
  return p;
}

// isum (optional): each block's integer sum of q
void quantize_blocks(const float* xp, int8_t* qp, float* dp, float* sp, int64_t nblocks, int64_t impl,
                     int32_t* isum) {
  const bool fast = use_avx2(impl);
  at::parallel_for(0, nblocks, 2048, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
#ifdef A8_AVX2
      if (fast) {
        quant_block_avx2(xp + QK * b, qp + QK * b, dp + b, sp + b, isum ? isum + b : nullptr);
        continue;
      }
#endif
      quant_block_scalar(xp + QK * b, qp + QK * b, dp + b, sp + b, isum ? isum + b : nullptr);
    }
  });
  (void)fast;
}

void quantize(const at::Tensor& x, at::Tensor& xq, at::Tensor& xd, at::Tensor& xs, int64_t impl) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x must be a contiguous float32 [T, K] tensor");
  check_act(xq, xd, xs);
  TORCH_CHECK(xq.size(0) == x.size(0) && xq.size(1) == x.size(1), "xq must have x's shape");
  quantize_blocks(x.data_ptr<float>(), xq.data_ptr<int8_t>(), xd.data_ptr<float>(), xs.data_ptr<float>(),
                  x.numel() / QK, impl);
}

void matmul(const at::Tensor& xq, const at::Tensor& xd, const at::Tensor& xs, const at::Tensor& w,
            int64_t qtype, at::Tensor& out, int64_t col0, int64_t impl) {
  check_act(xq, xd, xs);
  const int64_t T = xq.size(0), K = xq.size(1), nb = K / QK, N = w.size(0);
  TORCH_CHECK(block_bytes(qtype) > 0, "activation-quantized matmul: unsupported ggml type ", qtype,
              " (the super-block types take linear, which quantizes x per 256)");
  const int64_t bb = block_bytes(qtype);
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous() && w.size(1) == nb * bb,
              "weight must be a contiguous uint8 [N, ", nb * bb, "] tensor");
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == at::kFloat && out.stride(1) == 1 &&
                  out.size(0) == T && col0 >= 0 && col0 + N <= out.size(1),
              "out must be float32 [T, >= col0 + N] with contiguous rows");
  if (T == 0 || N == 0) return;
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const int8_t* qp = xq.data_ptr<int8_t>();
  const float *dp = xd.data_ptr<float>(), *sp = xs.data_ptr<float>();
  float* op = out.data_ptr<float>() + col0;
  const int64_t ldo = out.stride(0), rb = w.size(1);
  const int64_t grain = std::max<int64_t>(16, N / (8 * std::max<int64_t>(1, at::get_num_threads())));
  const bool fast = use_avx2(impl);
  const std::vector<float> pp = pairs(dp, sp, T * nb);
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
#ifdef A8_AVX2
    if (fast) {
      range_avx2(qtype, wp, rb, n0, n1, nb, T, qp, dp, sp, pp.data(), K, op, ldo, impl);
      return;
    }
#endif
    for (int64_t n = n0; n < n1; ++n) row_scalar(qtype, wp + n * rb, nb, T, qp, dp, sp, K, op + n, ldo);
  });
  (void)fast;
}

// The arguments of linear (and panel): x [T, K] f32 (K a multiple of 32), weight segments of
// the int8 types with K / 32 blocks per row, out [T, sum N_i]; returns each segment's first
// output column (and the total last).
std::vector<int64_t> check_segments(const at::Tensor& x, at::TensorList ws, at::IntArrayRef qtypes,
                                    const at::Tensor& out, bool panel) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.size(1) > 0 &&
                  x.size(1) % QK == 0,
              "x must be a contiguous float32 [T, K] tensor, K a multiple of 32");
  TORCH_CHECK(ws.size() == qtypes.size() && !ws.empty(), "one qtype per weight segment");
  const int64_t K = x.size(1);
  std::vector<int64_t> first{0};
  for (size_t i = 0; i < ws.size(); ++i) {
    TORCH_CHECK(panel ? panel_type(qtypes[i]) : block_bytes(qtypes[i]) > 0 || x_type(qtypes[i]),
                "activation-quantized matmul: unsupported ggml type ", qtypes[i]);
    const int64_t rbytes = row_bytes(qtypes[i], K);
    TORCH_CHECK(rbytes > 0, "rows of ", K, " elements are not whole blocks of ggml type ", qtypes[i]);
    TORCH_CHECK(ws[i].dim() == 2 && ws[i].scalar_type() == at::kByte && ws[i].is_contiguous() &&
                    ws[i].size(1) == rbytes,
                "weight must be a contiguous uint8 [N, ", rbytes, "] tensor");
    first.push_back(first.back() + ws[i].size(0));
  }
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == at::kFloat && out.is_contiguous() &&
                  out.size(0) == x.size(0) && out.size(1) == first.back(),
              "out must be a contiguous float32 [T, N] tensor");
  return first;
}

// One call per Linear: x quantized once (into buffers of this call), then every segment w[i]
// (rows of one type) multiplied into its columns of out, all rows in one parallel loop.
void linear(const at::Tensor& x, at::TensorList ws, at::IntArrayRef qtypes, at::Tensor& out, int64_t impl) {
  const std::vector<int64_t> first = check_segments(x, ws, qtypes, out);
  const int64_t T = x.size(0), K = x.size(1), nb = K / QK, N = first.back();
  if (T == 0 || N == 0) return;
  // the 32-element types' activations, quantized per 32 (only when a segment needs them: a
  // K-quant linear skips it, 2-5 us a call at K = 1536-8960)
  const bool blocks = !std::all_of(qtypes.begin(), qtypes.end(), x_type);
  std::vector<int8_t> xq(blocks ? T * K : 0);
  std::vector<float> xds(blocks ? 2 * T * nb : 0);  // d, then s
  if (blocks) quantize_blocks(x.data_ptr<float>(), xq.data(), xds.data(), xds.data() + T * nb, T * nb, impl);
  const int8_t* qp = xq.data();
  const float *dp = xds.data(), *sp = xds.data() + (blocks ? T * nb : 0);
  float* op = out.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(16, N / (8 * std::max<int64_t>(1, at::get_num_threads())));
  const bool fast = use_avx2(impl);
  const std::vector<float> pp = blocks ? pairs(dp, sp, T * nb) : std::vector<float>{};
  // the super-block types' activations, quantized per 256 (only when a segment needs them)
  std::vector<int8_t> kq;
  std::vector<float> kd;
  std::vector<int16_t> kbs;
  const int64_t nsb = K / ggml::QK_K;
  std::vector<int8_t> ku;  // kq in unit order, where a segment's kernel reads that (once per call)
  if (std::any_of(qtypes.begin(), qtypes.end(), x_type)) {
    kq.resize(T * K), kd.resize(T * nsb), kbs.resize(16 * T * nsb);
    quantize_sb(x.data_ptr<float>(), kq.data(), kd.data(), kbs.data(), T * nsb, impl);
    if (std::any_of(qtypes.begin(), qtypes.end(), [&](int64_t t) { return reads_units(t, T, impl); })) {
      ku.resize(T * K);
      unit_order(kq.data(), ku.data(), T * K);
    }
  }
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    for (size_t i = 0; i < ws.size(); ++i) {
      const int64_t a = std::max(n0, first[i]), b = std::min(n1, first[i + 1]);
      if (a >= b) continue;
      const uint8_t* wp = ws[i].data_ptr<uint8_t>();  // segment rows, local index n - first[i]
      const int64_t rb = ws[i].size(1), c = first[i];
      float* oc = op + c;
      if (x_type(qtypes[i])) {
        x_range(qtypes[i], wp, rb, a - c, b - c, nsb, T, kq.data(), kd.data(), kbs.data(), K, oc, N, impl,
                ku.empty() ? nullptr : ku.data());
        continue;
      }
#ifdef A8_AVX2
      if (fast) {
        range_avx2(qtypes[i], wp, rb, a - c, b - c, nb, T, qp, dp, sp, pp.data(), K, oc, N, impl);
        continue;
      }
#endif
      for (int64_t n = a - c; n < b - c; ++n)
        row_scalar(qtypes[i], wp + n * rb, nb, T, qp, dp, sp, K, oc + n, N);
    }
  });
  (void)fast;
}

}  // namespace a8

TORCH_LIBRARY(pagedkv_a8, m) {
  m.def("quantize(Tensor x, Tensor(a!) xq, Tensor(b!) xd, Tensor(c!) xs, int impl) -> ()");
  m.def("matmul(Tensor xq, Tensor xd, Tensor xs, Tensor w, int qtype, Tensor(a!) out, int col0, int impl) -> ()");
  m.def("linear(Tensor x, Tensor[] ws, int[] qtypes, Tensor(a!) out, int impl) -> ()");
}

TORCH_LIBRARY_IMPL(pagedkv_a8, CPU, m) {
  m.impl("quantize", &a8::quantize);
  m.impl("matmul", &a8::matmul);
  m.impl("linear", &a8::linear);
}
