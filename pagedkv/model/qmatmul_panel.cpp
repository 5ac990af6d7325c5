// The int8-activation matmul for many rows ("panel" path of activations=int8): AVX-512 VNNI.
//
// qmatmul_a8.cpp streams each weight row once and dots it with a few activation rows; from a
// handful of rows on, the work is arithmetic, and its per-block float steps (convert, scale,
// add, per weight row and activation row) cost more than the integer products. Here a panel of
// 16 weight rows is unpacked once per call into bytes laid out for VNNI: block b, quad j
// (elements 4j..4j+3), row n at wq[b][j][n] (64 bytes per quad: one zmm, a lane per weight
// row). One vpdpbusd then multiplies 4 elements of 16 weight rows by 4 elements of one
// activation row (broadcast) and adds them into 16 int32 lanes; a block's 32 elements take 8,
// after which one convert, one multiply and one FMA fold the block into 16 float lanes. Each
// unpacked panel is reused by every activation row (R at a time, in registers).
//
// Arithmetic, per weight row n, activation row r and block b (exactly what the scalar path,
// impl=1, does lane by lane, so both give bit-identical results):
//   i  = sum_k u[k] * xq[k] - bias * sum_k xq[k]      (int32, exact: |i| < 2^21)
//        u = Q4 nibbles 0..15 (bias 8 for Q4_0, 0 for Q4_1), Q8_0: w + 128 (bias 128)
//   y  = fma(float(i), d * dx, y)                       (d the weight block's scale, dx the row's)
//   y  = fma(m, sx, y)                                  (Q4_1 only: the block's m, sx = dx * sum xq)
// so Q4_0 and Q8_0 blocks are dotted exactly in integers (their offsets -8 and -128 folded into
// i), and the result differs from qmatmul_a8's (which sums lanes in float) only by rounding.
// Q6_K (a scale per 16 elements): the same per half h of a block, i_h = sum_k q[k] * xq[k] -
// 32 * sum_k xq[k] over its 16 elements (q the 6-bit values), y = fma(float(i_h), d sc_h * dx, y).
//
// Op (torch.ops.pagedkv_a8.*, fragment of qmatmul_a8.cpp's library):
//   panel(x [T, K] f32, ws [w_i [N_i, rb_i] u8], qtypes, out [T, sum N_i] f32, impl): as
//     linear; impl 0 = VNNI where this CPU has it (else scalar), 1 = scalar.
//   panel_vnni() -> bool: whether impl 0 runs the VNNI code on this CPU.
// The VNNI code is compiled with a target attribute and chosen at run time, so the build flags
// (and the build cache's name) stay those of the other kernels.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "ggml_blocks.h"
#include "kquant_values.h"
#include "qmatmul_a8.h"
#include "vec.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define PANEL_X86 1
#endif

namespace panel {

using namespace ggml;
constexpr int64_t NR = 16;  // weight rows per panel (a zmm lane each)

// w = d * (u - bias) + m per 32-element chunk (u unsigned bytes)
constexpr int32_t bias(int64_t qt) {
  return qt == Q4_0 ? 8 : qt == Q5_0 ? 16 : qt == Q8_0 || qt == IQ4_NL || qt == IQ4_XS ? 128 : 0;
}
constexpr bool has_m(int64_t qt) { return qt == Q4_1 || qt == Q5_1 || qt == Q4_K || qt == Q5_K; }
// the types whose blocks are transposed straight from the file (the others through a staging row)
constexpr bool direct(int64_t qt) { return qt == Q4_0 || qt == Q4_1 || qt == Q8_0; }

// chunk c (32 elements; K-quants: sub-block c % 8 of block c / 8) of a row -> u, d, m
void chunk_scalar(int64_t qt, const uint8_t* row, int64_t c, uint8_t u[QK], float& d, float& m) {
  m = 0.f;
  const int j = static_cast<int>(c % 8);
  switch (qt) {
    case Q8_0: {
      const uint8_t* b = row + sizeof(BlockQ8_0) * c;
      for (int i = 0; i < QK; ++i) u[i] = static_cast<uint8_t>(b[2 + i] ^ 0x80);  // w + 128
      d = half(b);
      return;
    }
    case Q4_0: case Q4_1: {
      const uint8_t* b = row + (qt == Q4_0 ? sizeof(BlockQ4_0) : sizeof(BlockQ4_1)) * c;
      for (int i = 0; i < QK; ++i) u[i] = static_cast<uint8_t>(nibble(b + (qt == Q4_1 ? 4 : 2), i));
      d = half(b);
      if (qt == Q4_1) m = half(b + 2);
      return;
    }
    case Q5_0: case Q5_1: {
      const uint8_t* b = row + (qt == Q5_0 ? sizeof(BlockQ5_0) : sizeof(BlockQ5_1)) * c;
      const int o = qt == Q5_0 ? 2 : 4;
      const uint32_t qh = u32(b + o);
      for (int i = 0; i < QK; ++i) u[i] = static_cast<uint8_t>(nibble(b + o + 4, i) | ((qh >> i) & 1) << 4);
      d = half(b);
      if (qt == Q5_1) m = half(b + 2);
      return;
    }
    case IQ4_NL: {
      const uint8_t* b = row + sizeof(BlockIQ4_NL) * c;
      for (int i = 0; i < QK; ++i) u[i] = static_cast<uint8_t>(IQ4_LEVELS[nibble(b + 2, i)] ^ 0x80);
      d = half(b);
      return;
    }
    case Q4_K: case Q5_K: {
      const uint8_t* b = row + (qt == Q4_K ? sizeof(BlockQ4_K) : sizeof(BlockQ5_K)) * (c / 8);
      const auto& h = *reinterpret_cast<const BlockQ4_K*>(b);  // d, dmin, scales at the same offsets
      int sc, mn;
      scale_min_k4(h.scales, j, sc, mn);
      for (int i = 0; i < QK; ++i)
        u[i] = static_cast<uint8_t>(qt == Q4_K ? kq::u_of<Q4_K>(b, QK * j + i) : kq::u_of<Q5_K>(b, QK * j + i));
      d = half(h.d) * static_cast<float>(sc);
      m = -(half(h.dmin) * static_cast<float>(mn));
      return;
    }
    case Q6_K: {  // u = the 6-bit q (w = d sc (q - 32)); m: the second half's scale
      const uint8_t* b = row + sizeof(BlockQ6_K) * (c / 8);
      for (int i = 0; i < QK; ++i) u[i] = static_cast<uint8_t>(kq::u_of<Q6_K>(b, QK * j + i));
      const auto& h = *reinterpret_cast<const BlockQ6_K*>(b);
      d = half(h.d) * static_cast<float>(h.scales[2 * j]);
      m = half(h.d) * static_cast<float>(h.scales[2 * j + 1]);
      return;
    }
    default: {  // IQ4_XS
      const uint8_t* b = row + sizeof(BlockIQ4_XS) * (c / 8);
      for (int i = 0; i < QK; ++i) u[i] = static_cast<uint8_t>(kq::u_of<IQ4_XS>(b, QK * j + i) ^ 0x80);
      const auto& h = *reinterpret_cast<const BlockIQ4_XS*>(b);
      d = half(h.d) * static_cast<float>(scale_iq4_xs(h, j));
      return;
    }
  }
}

// One segment's panel of NR weight rows [n0, n0 + NR) (rows past the segment are zeros),
// unpacked: u [nb][8][NR][4] bytes, d [nb][NR], m [nb][NR] (Q4_1; zeros otherwise).
struct Buf {
  std::vector<uint8_t> u;
  std::vector<float> d, m;
  void size(int64_t nb) {
    u.assign(nb * 8 * NR * 4, 0);
    d.assign(nb * NR, 0.f);
    m.assign(nb * NR, 0.f);
  }
};

// the activations' quantized blocks and sums (x16: per 16 elements, for Q6_K), T rows
struct Acts {
  const int8_t* q;
  const float *d, *s;
  const int32_t *sum, *x16;
  int64_t K, nb;
  Acts at(int64_t t) const { return {q + t * K, d + t * nb, s + t * nb, sum + t * nb, x16 + t * 2 * nb, K, nb}; }
};

void unpack_scalar(int64_t qt, const uint8_t* w, int64_t rb, int64_t rows, int64_t nb, Buf& p) {
  std::fill(p.u.begin(), p.u.end(), 0);
  std::fill(p.d.begin(), p.d.end(), 0.f);
  std::fill(p.m.begin(), p.m.end(), 0.f);
  for (int64_t n = 0; n < rows; ++n)
    for (int64_t b = 0; b < nb; ++b) {
      uint8_t v[QK];
      chunk_scalar(qt, w + n * rb, b, v, p.d[b * NR + n], p.m[b * NR + n]);
      for (int j = 0; j < 8; ++j) std::memcpy(&p.u[((b * 8 + j) * NR + n) * 4], v + 4 * j, 4);
    }
}

void rows_scalar(int64_t qt, const Buf& p, int64_t nb, int64_t T, const int8_t* xq, const float* xd,
                 const float* xs, const int32_t* xsum, const int32_t* x16, int64_t K, float* out, int64_t ldo,
                 int64_t cols) {
  const int32_t bi = bias(qt);
  for (int64_t r = 0; r < T; ++r)
    for (int64_t n = 0; n < cols; ++n) {
      float y = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        if (qt == Q6_K) {  // a sum per 16-element half: w = scale * (q - 32)
          const int8_t* x = xq + r * K + QK * b;
          for (int h = 0; h < 2; ++h) {
            int32_t i = -32 * x16[r * 2 * nb + 2 * b + h];
            for (int e = 0; e < 16; ++e) i += p.u[((b * 8 + 4 * h + e / 4) * NR + n) * 4 + e % 4] * x[16 * h + e];
            y = std::fmaf(static_cast<float>(i), (h ? p.m : p.d)[b * NR + n] * xd[r * nb + b], y);
          }
          continue;
        }
        int32_t i = -bi * xsum[r * nb + b];
        const int8_t* x = xq + r * K + QK * b;
        for (int j = 0; j < 8; ++j)
          for (int e = 0; e < 4; ++e) i += p.u[((b * 8 + j) * NR + n) * 4 + e] * x[4 * j + e];
        y = std::fmaf(static_cast<float>(i), p.d[b * NR + n] * xd[r * nb + b], y);
        if (has_m(qt)) y = std::fmaf(p.m[b * NR + n], xs[r * nb + b], y);
      }
      out[r * ldo + n] = y;
    }
}

#ifdef PANEL_X86
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vnni")

bool cpu_has_vnni() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vnni");
}

// 16 rows' 16-byte pieces at p[n] + off -> 4 zmm: out[j] lane n = bytes 4j..4j+3 of row n
inline void transpose16(const uint8_t* const* p, int64_t off, __m512i out[4]) {
  __m512i z[4];
  for (int a = 0; a < 4; ++a) {  // z[a] 128-bit lane l = row 4l + a
    __m512i v = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p[a] + off)));
    v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p[4 + a] + off)), 1);
    v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p[8 + a] + off)), 2);
    z[a] = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p[12 + a] + off)), 3);
  }
  const __m512i t0 = _mm512_unpacklo_epi32(z[0], z[1]), t1 = _mm512_unpackhi_epi32(z[0], z[1]);
  const __m512i t2 = _mm512_unpacklo_epi32(z[2], z[3]), t3 = _mm512_unpackhi_epi32(z[2], z[3]);
  out[0] = _mm512_unpacklo_epi64(t0, t2);
  out[1] = _mm512_unpackhi_epi64(t0, t2);
  out[2] = _mm512_unpacklo_epi64(t1, t3);
  out[3] = _mm512_unpackhi_epi64(t1, t3);
}

inline __m512 halves16(const uint8_t* const* p, int64_t off) {
  alignas(32) uint16_t h[NR];
  for (int n = 0; n < NR; ++n) std::memcpy(&h[n], p[n] + off, 2);
  return _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(h)));
}

#ifdef PQ_AVX2
// chunk_scalar's u, d, m of one row, in registers (AVX2 unpacking, vec.h)
template <int64_t QT>
inline __m256i chunk_v(const uint8_t* row, int64_t c, float& d, float& m) {
  const int j = static_cast<int>(c % 8);
  m = 0.f;
  if constexpr (QT == Q5_0 || QT == Q5_1) {
    using B = std::conditional_t<QT == Q5_0, BlockQ5_0, BlockQ5_1>;
    const auto& b = reinterpret_cast<const B*>(row)[c];
    const __m256i hi = _mm256_and_si256(vec::bit_bytes(u32(b.qh)), _mm256_set1_epi8(0x10));
    d = half(b.d);
    if constexpr (QT == Q5_1) m = half(b.m);
    return _mm256_or_si256(vec::nibbles(b.qs), hi);
  } else if constexpr (QT == IQ4_NL) {
    const auto& b = reinterpret_cast<const BlockIQ4_NL*>(row)[c];
    d = half(b.d);
    return _mm256_xor_si256(vec::lookup16(IQ4_LEVELS, vec::nibbles(b.qs)), _mm256_set1_epi8(static_cast<char>(0x80)));
  } else if constexpr (QT == Q4_K || QT == Q5_K) {
    using B = std::conditional_t<QT == Q4_K, BlockQ4_K, BlockQ5_K>;
    const auto& b = reinterpret_cast<const B*>(row)[c / 8];
    int sc, mn;
    scale_min_k4(b.scales, j, sc, mn);
    d = half(b.d) * static_cast<float>(sc);
    m = -(half(b.dmin) * static_cast<float>(mn));
    return kq::chunk<QT>(reinterpret_cast<const uint8_t*>(&b), j);
  } else if constexpr (QT == Q6_K) {
    const auto& b = reinterpret_cast<const BlockQ6_K*>(row)[c / 8];
    d = half(b.d) * static_cast<float>(b.scales[2 * j]);
    m = half(b.d) * static_cast<float>(b.scales[2 * j + 1]);
    return kq::chunk<Q6_K>(reinterpret_cast<const uint8_t*>(&b), j);
  } else {
    static_assert(QT == IQ4_XS, "a type without a staged panel decoder");
    const auto& b = reinterpret_cast<const BlockIQ4_XS*>(row)[c / 8];
    d = half(b.d) * static_cast<float>(scale_iq4_xs(b, j));
    return _mm256_xor_si256(kq::chunk<IQ4_XS>(reinterpret_cast<const uint8_t*>(&b), j),
                            _mm256_set1_epi8(static_cast<char>(0x80)));
  }
}
#endif

// the same layout as unpack_scalar; p: the NR row pointers (rows past the end at a zero row)
template <int64_t QT>
void unpack_vnni(const uint8_t* const* p, int64_t nb, Buf& buf) {
  if constexpr (!direct(QT)) {  // decode each row's chunk into a staging row, then transpose
    alignas(64) uint8_t stage[NR][QK];
    const uint8_t* srow[NR];
    for (int n = 0; n < NR; ++n) srow[n] = stage[n];
    for (int64_t b = 0; b < nb; ++b) {
      for (int n = 0; n < NR; ++n) {
#ifdef PQ_AVX2
        const __m256i u = chunk_v<QT>(p[n], b, buf.d[b * NR + n], buf.m[b * NR + n]);
        _mm256_store_si256(reinterpret_cast<__m256i*>(stage[n]), u);
#else  // a build without AVX2 flags: the same bytes by the scalar decoder
        chunk_scalar(QT, p[n], b, stage[n], buf.d[b * NR + n], buf.m[b * NR + n]);
#endif
      }
      __m512i* u = reinterpret_cast<__m512i*>(buf.u.data() + b * 8 * NR * 4);
      __m512i q[4];
      for (int h = 0; h < 2; ++h) {
        transpose16(srow, 16 * h, q);
        for (int j = 0; j < 4; ++j) _mm512_storeu_si512(u + 4 * h + j, q[j]);
      }
    }
    return;
  } else {
  constexpr int64_t bb = QT == Q4_0 ? 18 : QT == Q4_1 ? 20 : 34;
  const __m512i lo = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t b = 0; b < nb; ++b) {
    __m512i* u = reinterpret_cast<__m512i*>(buf.u.data() + b * 8 * NR * 4);
    __m512i q[4];
    if (QT == Q8_0) {
      for (int h = 0; h < 2; ++h) {
        transpose16(p, b * bb + 2 + 16 * h, q);
        for (int j = 0; j < 4; ++j) _mm512_storeu_si512(u + 4 * h + j, _mm512_xor_si512(q[j], flip));
      }
    } else {
      transpose16(p, b * bb + (QT == Q4_1 ? 4 : 2), q);
      for (int j = 0; j < 4; ++j) {
        _mm512_storeu_si512(u + j, _mm512_and_si512(q[j], lo));
        _mm512_storeu_si512(u + 4 + j, _mm512_and_si512(_mm512_srli_epi16(q[j], 4), lo));
      }
    }
    _mm512_storeu_ps(buf.d.data() + b * NR, halves16(p, b * bb));
    if (QT == Q4_1) _mm512_storeu_ps(buf.m.data() + b * NR, halves16(p, b * bb + 2));
  }
  }
}

// acc + the dpbusd of u (16 rows' quads) by the 4 activation bytes at p, broadcast from memory by
// the instruction itself (an embedded broadcast; from the intrinsic, GCC 12 emits a vpbroadcastd
// before each). 1 thread, 4096x1536, 40 rows, ns per weight and row, medians of 7 alternated
// runs, separate broadcast -> embedded: Q4_K 0.0125 -> 0.0116, Q6_K 0.0160 -> 0.0144, Q4_1
// 0.0101 -> 0.0090, Q8_0 0.0112 -> 0.0105, Q5_0 0.0105 -> 0.0103.
typedef int32_t quad_t __attribute__((may_alias, aligned(1)));
inline __m512i dp(__m512i acc, __m512i u, const int8_t* p) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(u), "m"(*reinterpret_cast<const quad_t*>(p)));
  return acc;
}

// R activation rows x the panel: out[r * ldo + n] for the first `cols` of its NR rows
template <int64_t QT, int R>
void rows_vnni(const Buf& p, int64_t nb, const int8_t* xq, const float* xd, const float* xs,
               const int32_t* xsum, const int32_t* x16, int64_t K, float* out, int64_t ldo, __mmask16 mask) {
  const int32_t bi = bias(QT);
  __m512 y[R];
  for (int r = 0; r < R; ++r) y[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const __m512i* u = reinterpret_cast<const __m512i*>(p.u.data() + b * 8 * NR * 4);
    const int8_t* x = xq + QK * b;
    if constexpr (QT == Q6_K) {  // quads 0-3 and 4-7: a scale each (d, m), q - 32 by the half's sum
      __m512i lo[R], hi[R];
      for (int r = 0; r < R; ++r)
        lo[r] = _mm512_set1_epi32(-32 * x16[r * 2 * nb + 2 * b]), hi[r] = _mm512_set1_epi32(-32 * x16[r * 2 * nb + 2 * b + 1]);
      for (int j = 0; j < 4; ++j) {
        const __m512i w0 = _mm512_loadu_si512(u + j), w1 = _mm512_loadu_si512(u + 4 + j);
        for (int r = 0; r < R; ++r) {
          lo[r] = dp(lo[r], w0, x + r * K + 4 * j);
          hi[r] = dp(hi[r], w1, x + r * K + 16 + 4 * j);
        }
      }
      const __m512 d = _mm512_loadu_ps(p.d.data() + b * NR), m = _mm512_loadu_ps(p.m.data() + b * NR);
      for (int r = 0; r < R; ++r) {
        const __m512 dx = _mm512_set1_ps(xd[r * nb + b]);
        y[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo[r]), _mm512_mul_ps(d, dx), y[r]);
        y[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi[r]), _mm512_mul_ps(m, dx), y[r]);
      }
      continue;
    }
    // two sums per row (even and odd quads): twice the independent dpbusd chains
    __m512i acc[R], odd[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_set1_epi32(-bi * xsum[r * nb + b]), odd[r] = _mm512_setzero_si512();
    for (int j = 0; j < 8; j += 2) {
      const __m512i w0 = _mm512_loadu_si512(u + j), w1 = _mm512_loadu_si512(u + j + 1);
      for (int r = 0; r < R; ++r) {
        acc[r] = dp(acc[r], w0, x + r * K + 4 * j);
        odd[r] = dp(odd[r], w1, x + r * K + 4 * j + 4);
      }
    }
    for (int r = 0; r < R; ++r) acc[r] = _mm512_add_epi32(acc[r], odd[r]);
    const __m512 d = _mm512_loadu_ps(p.d.data() + b * NR);
    for (int r = 0; r < R; ++r)
      y[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r]), _mm512_mul_ps(d, _mm512_set1_ps(xd[r * nb + b])), y[r]);
    if (has_m(QT)) {
      const __m512 m = _mm512_loadu_ps(p.m.data() + b * NR);
      for (int r = 0; r < R; ++r) y[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(xs[r * nb + b]), y[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(out + r * ldo, mask, y[r]);
}

constexpr int RB = 4;  // activation rows per register block

template <int64_t QT, int R>
void rows_at(const Buf& buf, const Acts& a, float* out, int64_t ldo, __mmask16 mask) {
  rows_vnni<QT, R>(buf, a.nb, a.q, a.d, a.s, a.sum, a.x16, a.K, out, ldo, mask);
}

template <int64_t QT>
void panel_vnni(const uint8_t* const* rows, int64_t T, const Acts& a, float* out, int64_t ldo, int64_t cols,
                Buf& buf) {
  unpack_vnni<QT>(rows, a.nb, buf);
  const __mmask16 mask = static_cast<__mmask16>((1u << cols) - 1);
  int64_t t = 0;
  for (; t + RB <= T; t += RB) rows_at<QT, RB>(buf, a.at(t), out + t * ldo, ldo, mask);
  switch (T - t) {
    case 3: rows_at<QT, 3>(buf, a.at(t), out + t * ldo, ldo, mask); break;
    case 2: rows_at<QT, 2>(buf, a.at(t), out + t * ldo, ldo, mask); break;
    case 1: rows_at<QT, 1>(buf, a.at(t), out + t * ldo, ldo, mask); break;
    default: break;
  }
}

void panel_vnni(int64_t qt, const uint8_t* const* rows, int64_t T, const Acts& a, float* out, int64_t ldo,
                int64_t cols, Buf& buf) {
  switch (qt) {
    case Q4_0: panel_vnni<Q4_0>(rows, T, a, out, ldo, cols, buf); return;
    case Q4_1: panel_vnni<Q4_1>(rows, T, a, out, ldo, cols, buf); return;
    case Q5_0: panel_vnni<Q5_0>(rows, T, a, out, ldo, cols, buf); return;
    case Q5_1: panel_vnni<Q5_1>(rows, T, a, out, ldo, cols, buf); return;
    case IQ4_NL: panel_vnni<IQ4_NL>(rows, T, a, out, ldo, cols, buf); return;
    case Q4_K: panel_vnni<Q4_K>(rows, T, a, out, ldo, cols, buf); return;
    case Q5_K: panel_vnni<Q5_K>(rows, T, a, out, ldo, cols, buf); return;
    case Q6_K: panel_vnni<Q6_K>(rows, T, a, out, ldo, cols, buf); return;
    case IQ4_XS: panel_vnni<IQ4_XS>(rows, T, a, out, ldo, cols, buf); return;
    default: panel_vnni<Q8_0>(rows, T, a, out, ldo, cols, buf); return;
  }
}

#pragma GCC pop_options
#else
bool cpu_has_vnni() { return false; }
#endif

bool vnni() {
  static const bool has = cpu_has_vnni();
  return has;
}

// the weight rows of a panel, towards L2 (a panel is unpacked once and computed for a while:
// fetching the next one meanwhile hides most of its memory latency)
void prefetch_panel(at::TensorList ws, std::pair<int64_t, int64_t> panel) {
#ifdef PANEL_X86
  const at::Tensor& w = ws[panel.first];
  const int64_t rb = w.size(1), rows = std::min<int64_t>(NR, w.size(0) - panel.second);
  const char* p = reinterpret_cast<const char*>(w.data_ptr<uint8_t>() + panel.second * rb);
  for (int64_t i = 0; i < rows * rb; i += 64) _mm_prefetch(p + i, _MM_HINT_T1);
#else
  (void)ws, (void)panel;
#endif
}

void panel(const at::Tensor& x, at::TensorList ws, at::IntArrayRef qtypes, at::Tensor& out, int64_t impl) {
  const std::vector<int64_t> first = a8::check_segments(x, ws, qtypes, out, /*panel=*/true);
  const int64_t T = x.size(0), K = x.size(1), nb = K / QK, N = first.back();
  if (T == 0 || N == 0) return;
  std::vector<int8_t> xq(T * K);
  std::vector<float> xds(2 * T * nb);  // d, then s
  std::vector<int32_t> xsum(T * nb);  // each block's integer sum
  a8::quantize_blocks(x.data_ptr<float>(), xq.data(), xds.data(), xds.data() + T * nb, T * nb, impl, xsum.data());
  const float *dp = xds.data(), *sp = xds.data() + T * nb;
  std::vector<int32_t> x16(T * 2 * nb);  // each 16-element half's sum (Q6_K)
  if (std::find(qtypes.begin(), qtypes.end(), Q6_K) != qtypes.end())
    for (int64_t i = 0; i < T * 2 * nb; ++i) {
      int32_t v = 0;
      for (int e = 0; e < 16; ++e) v += xq[16 * i + e];
      x16[i] = v;
    }
  const Acts acts{xq.data(), dp, sp, xsum.data(), x16.data(), K, nb};
  // the panels: (segment, first row), never across segments
  std::vector<std::pair<int64_t, int64_t>> panels;
  for (size_t i = 0; i < ws.size(); ++i)
    for (int64_t n = 0; n < ws[i].size(0); n += NR) panels.emplace_back(static_cast<int64_t>(i), n);
  const bool fast = impl == 0 && vnni();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, static_cast<int64_t>(panels.size()), 1, [&](int64_t p0, int64_t p1) {
    Buf buf;
    buf.size(nb);
    int64_t zbytes = 0;
    for (const at::Tensor& w : ws) zbytes = std::max<int64_t>(zbytes, w.size(1));
    const std::vector<uint8_t> zrow(zbytes, 0);  // a row past a segment's end: zeros (scale 0)
    for (int64_t pi = p0; pi < p1; ++pi) {
      const auto [seg, n0] = panels[pi];
      const at::Tensor& w = ws[seg];
      const int64_t rb = w.size(1), cols = std::min<int64_t>(NR, w.size(0) - n0);
      const uint8_t* base = w.data_ptr<uint8_t>();
      float* o = op + first[seg] + n0;
#ifdef PANEL_X86
      if (fast) {
        if (pi + 1 < p1) prefetch_panel(ws, panels[pi + 1]);  // from memory while this one computes
        const uint8_t* rows[NR];
        for (int64_t n = 0; n < NR; ++n) rows[n] = n < cols ? base + (n0 + n) * rb : zrow.data();
        panel_vnni(qtypes[seg], rows, T, acts, o, N, cols, buf);
        continue;
      }
#endif
      unpack_scalar(qtypes[seg], base + n0 * rb, rb, cols, nb, buf);
      rows_scalar(qtypes[seg], buf, nb, T, xq.data(), dp, sp, xsum.data(), x16.data(), K, o, N, cols);
    }
  });
}

}  // namespace panel

TORCH_LIBRARY_FRAGMENT(pagedkv_a8, m) {
  m.def("panel(Tensor x, Tensor[] ws, int[] qtypes, Tensor(a!) out, int impl) -> ()");
  m.def("panel_vnni() -> bool", &panel::vnni);
}

TORCH_LIBRARY_IMPL(pagedkv_a8, CPU, m) {
  m.impl("panel", &panel::panel);
}
