// The int8-activation matmul for many rows ("panel" path of activations=int8): AVX-512 VNNI,
// or AVX2 on a CPU without it (the AVX2 section below).
//
// qmatmul_a8.cpp streams each weight row once and dots it with a few activation rows; from a
// handful of rows on, the work is arithmetic, and its per-block float steps (convert, scale,
// add, per weight row and activation row) cost more than the integer products. Here a panel of
// 16 weight rows is unpacked once per call into bytes laid out for VNNI: block b, quad j
// (elements 4j..4j+3), row n at wq[b][j][n] (64 bytes per quad: one zmm, a lane per weight
// row), decoded 16 rows at a time from byte transposes of the file's blocks. One vpdpbusd then
// multiplies 4 elements of 16 weight rows by 4 elements of one activation row (broadcast) and
// adds them into 16 int32 lanes; a block's 32 elements take 8,
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
// The K-quants: per super-block against activations per 256 (km, below); Q6_K and Q3_K (a
// signed scale per 16 elements) with their scales applied in integers (HALVES, below).
//
// Op (torch.ops.pagedkv_a8.*, fragment of qmatmul_a8.cpp's library):
//   panel(x [T, K] f32, ws [w_i [N_i, rb_i] u8], qtypes, out [T, sum N_i] f32, impl): as
//     linear; impl 0 = VNNI where this CPU has it (within the ISA limit of isa.h), else AVX2
//     (else scalar); 1 = scalar; 2 = AVX2; 3 = VNNI with two panels at a time (rows_vnni2) at
//     every row count (impl 0 takes them from pair_rows(): PAIR_ROWS on an Intel CPU, every row
//     count on a Zen 5 or later AMD one, never elsewhere). Every impl gives the same bits.
//   panel_vnni() -> bool: whether impl 0 runs the VNNI code; panel_avx2(): the AVX2 code.
// The VNNI code is compiled with a target attribute and chosen at run time, so the build flags
// (and the build cache's name) stay those of the other kernels.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "ahead.h"
#include "ggml_blocks.h"
#include "isa.h"
#include "kquant_values.h"
#include "out_store.h"
#include "qmatmul_a8.h"
#include "vec.h"
#include "work_split.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <cpuid.h>
#include <immintrin.h>
#define PANEL_X86 1
#endif

namespace panel {

using namespace ggml;
constexpr int64_t NR = 16;  // weight rows per panel (a zmm lane each)
constexpr int64_t NR2 = 8;  // the AVX2 code's (a ymm lane each)

// w = d * (u - bias) + m per 32-element chunk (u unsigned bytes)
constexpr int32_t bias(int64_t qt) {
  return qt == Q4_0 ? 8 : qt == Q5_0 ? 16 : qt == Q8_0 || qt == IQ4_NL || qt == IQ4_XS ? 128 : 0;
}
constexpr bool has_m(int64_t qt) { return qt == Q4_1 || qt == Q5_1; }  // (the K-quants' mins: Buf::mn)
// Q4_K / Q5_K (a 6-bit scale and min per 32, d and dmin per 256) and Q2_K (a 4-bit scale and min
// per 16: u = scale * q <= 45, a byte, so a chunk's two halves share one integer sum and d):
// activations quantized per 256 (as the int8 row kernel's and llama.cpp's q8_K), so that a
// super-block's min term is one integer sum and its activation scale one multiply (see KM below)
// Q6_K and Q3_K (a signed scale per 16 elements): a chunk's two halves summed apart, w = d *
// scale * (u - hbias), u = Q6_K's 6-bit q, Q3_K's 3-bit q + 4; activations per 256 (km below),
// the scales applied in integers (HALVES below)
constexpr bool halved(int64_t qt) { return qt == Q6_K || qt == Q3_K; }
constexpr int32_t hbias(int64_t qt) { return qt == Q6_K ? 32 : 4; }
// the types whose u reach 255 (the AVX2 code holds their w = u - 128 and dots them by the sign trick)
constexpr bool wide_u(int64_t qt) { return qt == Q8_0 || qt == IQ4_NL || qt == IQ4_XS; }
// The types whose panels go two at a time (3 activation rows per register block): Q4_K. The others
// lost: 1 thread, Zen 2 EPYC, 40 rows, per-row cost of a call (fit over 8-40 rows), multiply-adds
// per cycle, one panel -> two: Q4_K 896 x 4864 20.6 -> 21.9-22.1; Q4_0 4864 x 896 21.6 -> 14.6 (3
// rows), Q5_0 19.8 -> 19.4-19.7, Q6_K 896 x 4864 16.4-16.7 -> 15.2-16.4. Those whose u reaches 255
// (the sign trick) went two at a time with 2 rows (Q8_0 32768 x 896 T40 28.7 ms; one panel with 4
// rows: 29.4-29.7) and now go one at a time with 2 rows (RB2): T40 29.7 -> 29.2, 2048 x 1536 at
// 40 rows 0.0241 -> 0.0238 ns per weight (IQ4_NL 0.0242 -> 0.0236, IQ4_XS 0.0241 -> 0.0235); in
// an isolated copy of the loop, in L1, 13.9 -> 14.9 multiply-adds a cycle.
constexpr bool pair_avx2(int64_t qt) { return qt == Q4_K; }
constexpr bool km(int64_t qt) { return qt == Q4_K || qt == Q5_K || qt == Q2_K || halved(qt); }
// a km type's mins per super-block in int16 pairs (Buf::mn; Acts::ks or ks16): Q2_K 16, else 8
constexpr int64_t mpairs(int64_t qt) { return qt == Q2_K ? 8 : 4; }
constexpr int64_t MPAIRS = 8;  // the most (Buf::mn's room per super-block)
constexpr int64_t PAIR_ROWS = 32;  // an Intel CPU's impl 0 takes pairs from this many activation rows

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
      int sc, mn;  // (the mins: mins_km)
      scale_min_k4(h.scales, j, sc, mn);
      for (int i = 0; i < QK; ++i)
        u[i] = static_cast<uint8_t>(qt == Q4_K ? kq::u_of<Q4_K>(b, QK * j + i) : kq::u_of<Q5_K>(b, QK * j + i));
      d = half(h.d) * static_cast<float>(sc);
      return;
    }
    case Q6_K: {  // u = the 6-bit q (w = d sc (q - 32)); the scales and d: mins_km
      const uint8_t* b = row + sizeof(BlockQ6_K) * (c / 8);
      for (int i = 0; i < QK; ++i) u[i] = static_cast<uint8_t>(kq::u_of<Q6_K>(b, QK * j + i));
      d = 0.f;
      return;
    }
    case Q3_K: {  // u = the 3-bit q + 4 (w = d sc (u - 4)); the scales and d: mins_km
      const uint8_t* b = row + sizeof(BlockQ3_K) * (c / 8);
      for (int i = 0; i < QK; ++i) u[i] = static_cast<uint8_t>(kq::u_of<Q3_K>(b, QK * j + i));
      d = 0.f;
      return;
    }
    case Q2_K: {  // u = the half's scale times the 2-bit q (<= 45); d the super-block's (mins: mins_km)
      const uint8_t* b = row + sizeof(BlockQ2_K) * (c / 8);
      const auto& h = *reinterpret_cast<const BlockQ2_K*>(b);
      for (int i = 0; i < QK; ++i)
        u[i] = static_cast<uint8_t>((h.scales[2 * j + i / 16] & 0x0F) * kq::u_of<Q2_K>(b, QK * j + i));
      d = half(h.d);
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
// unpacked: u [nb][8][NR][4] bytes, d [nb][NR], m [nb][NR] (Q4_1, Q5_1: the block's m; zeros
// otherwise). km types: mn [nb / 8][mpairs][NR] the sub-block mins in int16 pairs (mn 2k | mn
// 2k+1 << 16), dm [nb / 8][NR] each super-block's -dmin. The halves types: sc [nb][2][NR] the
// halves' signed scales, dm each super-block's d.
struct Buf {
  std::vector<uint8_t> u;
  std::vector<float> d, m, dm;
  std::vector<int32_t> mn, sc;
  bool stream = false;  // this call's outputs are streamed past the caches (out_store.h)
  void scales(int64_t nb) {  // the scales alone (r16: u stays in the records)
    d.assign(nb * NR, 0.f);
    m.assign(nb * NR, 0.f);
    mn.assign(nb / 8 * MPAIRS * NR, 0);
    dm.assign(nb / 8 * NR, 0.f);
    sc.assign(nb * 2 * NR, 0);
  }
  void size(int64_t nb) {
    u.assign(nb * 8 * NR * 4, 0);
    scales(nb);
  }
};

// the activations' quantized blocks and sums, T rows; for the km types also quantized per 256:
// kq, kd (one per super-block), ks (each 32 elements' integer sum, in int16 pairs as Buf::mn:
// [nb / 8][4] per row), ks16 (each 16's, [nb / 8][8]: Q2_K's mins, Q3_K's AVX2 offsets)
// and hb (the halves types: each 16's times -hbias, [2 nb] per row: hb[0] Q6_K's, hb[1] Q3_K's)
struct Acts {
  const int8_t* q;
  const float *d, *s;
  const int32_t* sum;
  int64_t K, nb;
  const int8_t* kq;
  const float* kd;
  const int32_t *ks, *ks16;
  const int32_t* hb[2];
  const int32_t* xb[2];  // -8 and -16 times each block's sum (Q4_0's and Q5_0's bias terms, AVX2)
  Acts at(int64_t t) const {  // (an array a call does not need is empty: its pointer stays null)
    const auto row = [](auto* p, int64_t n) { return p ? p + n : p; };
    return {row(q, t * K), row(d, t * nb), row(s, t * nb), row(sum, t * nb), K, nb,
            row(kq, t * K), row(kd, t * (nb / 8)), row(ks, t * (nb / 8) * 4), row(ks16, t * (nb / 8) * 8),
            {row(hb[0], t * 2 * nb), row(hb[1], t * 2 * nb)}, {row(xb[0], t * nb), row(xb[1], t * nb)}};
  }
  // row r's min sums of super-block sb for a km type QT (mpairs(QT) int16 pairs)
  const int32_t* mins(int64_t qt, int64_t r, int64_t sb) const {
    const int64_t P = mpairs(qt);
    return (qt == Q2_K ? ks16 : ks) + (r * (nb / 8) + sb) * P;
  }
  // row r's sums of each 16 elements of super-block sb, in int16 pairs (8; ks16)
  const int32_t* halves(int64_t r, int64_t sb) const { return ks16 + (r * (nb / 8) + sb) * 8; }
  // row r's -hbias times the sums of the halves of a halves type's block b (two)
  const int32_t* offsets(int64_t qt, int64_t r, int64_t b) const { return hb[qt == Q6_K ? 0 : 1] + r * 2 * nb + 2 * b; }
};

// The km types' arithmetic, per weight row n, activation row r and super-block sb (every path,
// bit for bit; xq, dx: the activations per 256):
//   z  = 0; for its 8 chunks j: z = fma(float(i_j), d_j, z)   i_j = sum_k u[k] xq[k] (exact),
//                                                                d_j = d * sc_j (chunk_scalar's d)
//        (Q2_K, whose u carry the scales: z = float(sum_j i_j) * d, one integer sum)
//   M  = sum_j mn_j * s_j        (int32, exact: s_j the chunk's sum of xq; Q2_K: per 16-element half)
//   y  = fma(fma(float(M), -dmin, z), dx, y)
// HALVES (Q6_K, Q3_K), in integers to the last steps:
//   I  = sum_h sc_h * i_h        i_h = sum_k u[k] xq[k] - hbias s_h over half h's 16 elements
//                                (s_h their sum of xq; the 16 halves of the super-block)
//   y  = fma(float(I) * d, dx, y)
// (|i_h| < 2^17, |I| < 2^28: exact in int32), two vpmulld and two adds per chunk and activation
// row, one convert, multiply and FMA per super-block. Against the halves' float steps with
// activations per 32 (two converts, a multiply and two FMAs per chunk and row, on vpdpbusd's
// pipes; or the offsets as a min term, vpdpwssd per super-block, 5-7% slower): Zen 4, 1 thread,
// 40 rows, 1.5B file's tensors, ms, alternated runs: Q6_K 1536 x 8960 5.23 / 4.95 -> 4.50 /
// 4.92, 151936 x 1536 85.2 / 80.8 -> 73.3 / 73.3; Q3_K 8960 x 1536 4.31 / 4.28 -> 4.35 / 3.73.
// against a multiply and an FMA more per 32 elements with activations per 32 (its min term as
// m_j * dx_j * s_j, which shared the pipes of vpdpbusd): Zen 4, 1 thread, 1024 x 1536 from
// cache, 40 rows, ns per weight, alternated: Q4_K 0.287-0.289 -> 0.270-0.275, Q5_K 0.288-0.290
// -> 0.275-0.277.

// the mins of a km type's super-block sb of one weight row into lane n (stride lanes) of mn, dm
// (the halves types: their 16 scales into sc, d into dm)
inline void mins_km(const uint8_t* row, int64_t qt, int64_t sb, int64_t n, int64_t lanes, Buf& p) {
  if (halved(qt)) {  // the 16 signed scales, d
    int sc[16];
    float d;
    if (qt == Q6_K) {
      const auto& h = reinterpret_cast<const BlockQ6_K*>(row)[sb];
      for (int i = 0; i < 16; ++i) sc[i] = h.scales[i];
      d = half(h.d);
    } else {
      const auto& h = reinterpret_cast<const BlockQ3_K*>(row)[sb];
      for (int i = 0; i < 16; ++i) sc[i] = scale_q3_k(h.scales, i);
      d = half(h.d);
    }
    for (int i = 0; i < 16; ++i) p.sc[(sb * 16 + i) * lanes + n] = sc[i];
    p.dm[sb * lanes + n] = d;
    return;
  }
  if (qt == Q2_K) {  // 16 mins (the scale bytes' high nibbles), -dmin
    const auto& h = reinterpret_cast<const BlockQ2_K*>(row)[sb];
    for (int k = 0; k < 8; ++k) p.mn[(sb * 8 + k) * lanes + n] = h.scales[2 * k] >> 4 | (h.scales[2 * k + 1] >> 4) << 16;
    p.dm[sb * lanes + n] = -half(h.dmin);
    return;
  }
  // (Q5_K's d, dmin and scales are at Q4_K's offsets)
  const auto& h = *reinterpret_cast<const BlockQ4_K*>(row + (qt == Q4_K ? sizeof(BlockQ4_K) : sizeof(BlockQ5_K)) * sb);
  int mn[8];
  for (int j = 0; j < 8; ++j) {
    int sc;
    scale_min_k4(h.scales, j, sc, mn[j]);
  }
  for (int k = 0; k < 4; ++k) p.mn[(sb * 4 + k) * lanes + n] = mn[2 * k] | mn[2 * k + 1] << 16;  // (0..63 each)
  p.dm[sb * lanes + n] = -half(h.dmin);
}

// the integer sum of int16 pairs a . b (a dword of each: lo * lo + hi * hi)
inline int32_t pair_dot(int32_t a, int32_t b) {
  return static_cast<int16_t>(a & 0xFFFF) * static_cast<int16_t>(b & 0xFFFF) + (a >> 16) * (b >> 16);
}

void unpack_scalar(int64_t qt, const uint8_t* w, int64_t rb, int64_t rows, int64_t nb, Buf& p) {
  std::fill(p.u.begin(), p.u.end(), 0);
  std::fill(p.d.begin(), p.d.end(), 0.f);
  std::fill(p.m.begin(), p.m.end(), 0.f);
  for (int64_t n = 0; n < rows; ++n)
    for (int64_t b = 0; b < nb; ++b) {
      uint8_t v[QK];
      chunk_scalar(qt, w + n * rb, b, v, p.d[b * NR + n], p.m[b * NR + n]);
      for (int j = 0; j < 8; ++j) std::memcpy(&p.u[((b * 8 + j) * NR + n) * 4], v + 4 * j, 4);
      if (km(qt) && b % 8 == 0) mins_km(w + n * rb, qt, b / 8, n, NR, p);
    }
}

void rows_scalar_km(int64_t qt, const Buf& p, int64_t nb, int64_t T, const Acts& a, float* out, int64_t ldo, int64_t cols) {
  const int64_t P = mpairs(qt);
  for (int64_t r = 0; r < T; ++r)
    for (int64_t n = 0; n < cols; ++n) {
      float y = 0.f;
      for (int64_t sb = 0; sb < nb / 8; ++sb) {
        if (halved(qt)) {  // HALVES
          int32_t I = 0;
          for (int64_t h = 16 * sb; h < 16 * sb + 16; ++h) {
            const int8_t* x = a.kq + r * a.K + 16 * h;
            int32_t i = a.offsets(qt, r, h / 2)[h % 2];
            for (int e = 0; e < 16; ++e) i += p.u[((h * 4 + e / 4) * NR + n) * 4 + e % 4] * x[e];
            I += p.sc[h * NR + n] * i;
          }
          y = std::fmaf(static_cast<float>(I) * p.dm[sb * NR + n], a.kd[r * (nb / 8) + sb], y);
          continue;
        }
        float z = 0.f;
        int32_t i = 0;
        for (int64_t b = 8 * sb; b < 8 * sb + 8; ++b) {
          if (qt != Q2_K) i = 0;
          const int8_t* x = a.kq + r * a.K + QK * b;
          for (int j = 0; j < 8; ++j)
            for (int e = 0; e < 4; ++e) i += p.u[((b * 8 + j) * NR + n) * 4 + e] * x[4 * j + e];
          if (qt != Q2_K) z = std::fmaf(static_cast<float>(i), p.d[b * NR + n], z);
        }
        if (qt == Q2_K) z = static_cast<float>(i) * p.d[8 * sb * NR + n];
        int32_t M = 0;
        for (int k = 0; k < P; ++k) M += pair_dot(p.mn[(sb * P + k) * NR + n], a.mins(qt, r, sb)[k]);
        y = std::fmaf(std::fmaf(static_cast<float>(M), p.dm[sb * NR + n], z), a.kd[r * (nb / 8) + sb], y);
      }
      out[r * ldo + n] = y;
    }
}

void rows_scalar(int64_t qt, const Buf& p, int64_t nb, int64_t T, const int8_t* xq, const float* xd,
                 const float* xs, const int32_t* xsum, int64_t K, float* out, int64_t ldo, int64_t cols) {
  const int32_t bi = bias(qt);
  for (int64_t r = 0; r < T; ++r)
    for (int64_t n = 0; n < cols; ++n) {
      float y = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
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

// f(std::integral_constant<int64_t, QT>{}) for the panel type QT == qt (quant.PANEL_TYPES)
template <class Fn>
void with_panel_type(int64_t qt, const Fn& f) {
  switch (qt) {
    case Q4_0: f(std::integral_constant<int64_t, Q4_0>{}); return;
    case Q4_1: f(std::integral_constant<int64_t, Q4_1>{}); return;
    case Q5_0: f(std::integral_constant<int64_t, Q5_0>{}); return;
    case Q5_1: f(std::integral_constant<int64_t, Q5_1>{}); return;
    case IQ4_NL: f(std::integral_constant<int64_t, IQ4_NL>{}); return;
    case Q4_K: f(std::integral_constant<int64_t, Q4_K>{}); return;
    case Q5_K: f(std::integral_constant<int64_t, Q5_K>{}); return;
    case Q6_K: f(std::integral_constant<int64_t, Q6_K>{}); return;
    case Q3_K: f(std::integral_constant<int64_t, Q3_K>{}); return;
    case Q2_K: f(std::integral_constant<int64_t, Q2_K>{}); return;
    case IQ4_XS: f(std::integral_constant<int64_t, IQ4_XS>{}); return;
    default: f(std::integral_constant<int64_t, Q8_0>{}); return;
  }
}

// f(std::integral_constant<int, R>{}, t) for activation rows t .. t + R - 1: groups of G, then
// the remainder (one group of fewer rows)
template <int G, class Fn>
void by_groups(int64_t T, const Fn& f, int64_t t = 0) {
  for (; t + G <= T; t += G) f(std::integral_constant<int, G>{}, t);
  if constexpr (G > 1)
    if (t < T) by_groups<G - 1>(T, f, t);
}

// --- AVX2 (a CPU without AVX-512 VNNI): 8 weight rows a panel, maddubs ----------------------------
//
// The same arithmetic with 8 weight rows per panel (a ymm lane each, NR2) and the products by
// maddubs (u8 x s8 -> pairs in int16) and madd (-> int32 lanes): the int16 pairs of several quads
// are added first, as many as cannot overflow (|x| <= 127: u <= 15 all 8 quads of a block, u <= 31
// four, a half's four for Q3_K), and the types whose u reaches 255 (Q8_0, IQ4_NL, IQ4_XS) are held
// as their signed w = u - 128 and dotted by the sign trick (maddubs(|w|, x * sign w), rows_avx2),
// Q6_K as its w = q - 32 the same way (|w| <= 32: a half's four quads in int16, and no offsets).
// Against Q6_K's u = q and two quads, its offsets one min-like term a super-block: 1 thread,
// Zen 2 EPYC, 896 x 4864, alternated, T40 3.39 / 3.42 -> 3.25 / 3.36 ms; the 1.5B's int8 step at
// 40 rows, 2 threads, 568 / 570 -> 557 / 563. Each block's int32 sums are
// those of the scalar path, and the float steps the same, so the results are bit-identical.
// Unpacking (unpack_avx2): 8 rows' raw bytes transposed by dwords, then decoded 8 rows per
// instruction (the nibble types, Q4_K, Q5_K, Q6_K); Q8_0, Q3_K and Q2_K decode each row's chunk in
// element order first, then transpose 8 rows.
#ifdef PQ_AVX2

// chunk c of one row -> its 32 u (element order), d, m: chunk_scalar's values; the wide types
// (wide_u) their signed w = u - 128 instead (rows_avx2's sign trick). (The nibble_chunks types:
// unpack_nibbles_avx2; Q4_K, Q5_K: unpack_k4_avx2; Q6_K: unpack_q6k_avx2.)
template <int64_t QT>
inline __m256i chunk_avx2(const uint8_t* row, int64_t c, float& d, float& m) {
  m = 0.f;
  if constexpr (QT == Q8_0) {
    const uint8_t* b = row + sizeof(BlockQ8_0) * c;
    d = half(b);
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2));
  } else if constexpr (QT == Q3_K) {  // (the scales and d: mins_km)
    d = 0.f;
    return kq::chunk<Q3_K>(row + sizeof(BlockQ3_K) * (c / 8), static_cast<int>(c % 8));
  } else {  // Q2_K: q times its half's scale: 16-bit products, each byte's fits
    static_assert(QT == Q2_K, "not a panel type (or one unpack_avx2 decodes after the transpose)");
    const uint8_t* b = row + sizeof(BlockQ2_K) * (c / 8);
    const auto& h = *reinterpret_cast<const BlockQ2_K*>(b);
    const int j = static_cast<int>(c % 8);
    d = half(h.d);
    const __m256i sc = _mm256_setr_m128i(_mm_set1_epi16(static_cast<int16_t>(h.scales[2 * j] & 0x0F)),
                                         _mm_set1_epi16(static_cast<int16_t>(h.scales[2 * j + 1] & 0x0F)));
    return _mm256_mullo_epi16(kq::chunk<Q2_K>(b, j), sc);
  }
}

// a halves type's super-block sb, its scales as rows_avx2_km takes them: each half's sc twice in
// an int16 pair (sc[h][n] = sc | sc << 16: madd by it scales both int16 sums of a lane at once),
// and mn [sb][8][NR2] the 16 scales as consecutive pairs (sc 2k | sc 2k+1 << 16) for the offsets
inline void scale_pairs_avx2(int64_t sb, Buf& p) {
  auto* sc = reinterpret_cast<__m256i*>(p.sc.data() + sb * 16 * NR2);
  auto* mn = reinterpret_cast<__m256i*>(p.mn.data() + sb * 8 * NR2);
  const __m256i lo = _mm256_set1_epi32(0xFFFF);
  for (int k = 0; k < 8; ++k)
    _mm256_storeu_si256(mn + k, _mm256_or_si256(_mm256_and_si256(_mm256_loadu_si256(sc + 2 * k), lo),
                                                _mm256_slli_epi32(_mm256_loadu_si256(sc + 2 * k + 1), 16)));
  for (int h = 0; h < 16; ++h) {
    const __m256i v = _mm256_loadu_si256(sc + h);
    _mm256_storeu_si256(sc + h, _mm256_or_si256(_mm256_and_si256(v, lo), _mm256_slli_epi32(v, 16)));
  }
}

// 8 rows' bytes at byte o, transposed by dwords (lane n = row n): rows k and k + 4 share a
// register, then each 128-bit half is transposed in place, so the lanes come out in row order

// the 8 bytes at o -> h (bytes o..o+3 of each row), l (o+4..o+7)
PQ_INLINE void rows8x8(const uint8_t* const* rows, int64_t o, __m256i& h, __m256i& l) {
  __m256i t[4];
  for (int k = 0; k < 4; ++k)
    t[k] = _mm256_setr_m128i(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(rows[k] + o)),
                             _mm_loadl_epi64(reinterpret_cast<const __m128i*>(rows[k + 4] + o)));
  const __m256i a0 = _mm256_unpacklo_epi32(t[0], t[1]), a1 = _mm256_unpacklo_epi32(t[2], t[3]);
  h = _mm256_unpacklo_epi64(a0, a1), l = _mm256_unpackhi_epi64(a0, a1);
}

// the 16 bytes at o -> q[j] (bytes o+4j..o+4j+3 of each row)
PQ_INLINE void rows8x16(const uint8_t* const* rows, int64_t o, __m256i q[4]) {
  __m256i t[4];
  for (int k = 0; k < 4; ++k)
    t[k] = _mm256_setr_m128i(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[k] + o)),
                             _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[k + 4] + o)));
  const __m256i a0 = _mm256_unpacklo_epi32(t[0], t[1]), a1 = _mm256_unpackhi_epi32(t[0], t[1]);
  const __m256i a2 = _mm256_unpacklo_epi32(t[2], t[3]), a3 = _mm256_unpackhi_epi32(t[2], t[3]);
  q[0] = _mm256_unpacklo_epi64(a0, a2), q[1] = _mm256_unpackhi_epi64(a0, a2);
  q[2] = _mm256_unpacklo_epi64(a1, a3), q[3] = _mm256_unpackhi_epi64(a1, a3);
}

// the fp16 value in the low 16 bits of each dword lane -> 8 floats (exact)
PQ_INLINE __m256 halves8(__m256i v) {
  return _mm256_cvtph_ps(_mm256_castsi256_si128(_mm256_permutevar8x32_epi32(
      _mm256_packus_epi32(_mm256_and_si256(v, _mm256_set1_epi32(0xFFFF)), _mm256_setzero_si256()),
      _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7))));
}

// Q4_K / Q5_K super-block sb of 8 rows -> buf's d of its 8 chunks (half(d) * sc, as
// chunk_scalar), its mins in int16 pairs (mn, as mins_km) and -dmin (dm), 8 rows per instruction:
// each row's first 16 bytes (d, dmin, scales[0..11]) transposed (lane n of t[0] is d | dmin << 16
// of row n, of t[1..3] scales[0..3], [4..7], [8..11])
template <int64_t QT>
void header_k4_avx2(const uint8_t* const* rows, int64_t sb, Buf& buf) {
  constexpr int64_t B = QT == Q4_K ? sizeof(BlockQ4_K) : sizeof(BlockQ5_K);
  __m256i t[4];
  rows8x16(rows, B * sb, t);
  const __m256i h = t[0], s0 = t[1], s1 = t[2], s2 = t[3];
  const __m256i m6 = _mm256_set1_epi32(0x3F), m4 = _mm256_set1_epi32(0x0F);
  auto byte = [](__m256i v, int k) { return _mm256_and_si256(_mm256_srli_epi32(v, 8 * k), _mm256_set1_epi32(0xFF)); };
  __m256i sc[8], mn[8];
  for (int j = 0; j < 4; ++j) {
    sc[j] = _mm256_and_si256(byte(s0, j), m6);
    mn[j] = _mm256_and_si256(byte(s1, j), m6);
    sc[j + 4] = _mm256_or_si256(_mm256_and_si256(byte(s2, j), m4), _mm256_slli_epi32(_mm256_srli_epi32(byte(s0, j), 6), 4));
    mn[j + 4] = _mm256_or_si256(_mm256_srli_epi32(byte(s2, j), 4), _mm256_slli_epi32(_mm256_srli_epi32(byte(s1, j), 6), 4));
  }
  const __m256 dd = halves8(h), dmin = halves8(_mm256_srli_epi32(h, 16));
  for (int j = 0; j < 8; ++j) _mm256_storeu_ps(buf.d.data() + (sb * 8 + j) * NR2, _mm256_mul_ps(dd, _mm256_cvtepi32_ps(sc[j])));
  for (int k = 0; k < 4; ++k)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(buf.mn.data() + (sb * 4 + k) * NR2),
                        _mm256_or_si256(mn[2 * k], _mm256_slli_epi32(mn[2 * k + 1], 16)));
  _mm256_storeu_ps(buf.dm.data() + sb * NR2, _mm256_xor_ps(dmin, _mm256_set1_ps(-0.f)));  // -dmin, exactly
}

// Q6_K super-block sb of 8 rows -> buf's scales as rows_avx2_km takes them (scale_pairs_avx2's
// sc; its w are signed, so no offsets) and d (dm), its 16 signed scales decoded 8 rows per
// instruction from the 16 scale bytes transposed (lane n of s[i] = scales[4i..4i+3] of row n)
inline void header_q6k_avx2(const uint8_t* const* rows, int64_t sb, Buf& buf) {
  __m256i s[4];
  rows8x16(rows, sizeof(BlockQ6_K) * sb + offsetof(BlockQ6_K, scales), s);
  __m256i sc[16];  // sign-extended scale h of each row
  for (int h = 0; h < 16; ++h) sc[h] = _mm256_srai_epi32(_mm256_slli_epi32(s[h / 4], 24 - 8 * (h % 4)), 24);
  const __m256i lo = _mm256_set1_epi32(0xFFFF);
  auto* scp = reinterpret_cast<__m256i*>(buf.sc.data() + sb * 16 * NR2);
  for (int h = 0; h < 16; ++h) _mm256_storeu_si256(scp + h, _mm256_or_si256(_mm256_and_si256(sc[h], lo), _mm256_slli_epi32(sc[h], 16)));
  for (int n = 0; n < NR2; ++n) buf.dm[sb * NR2 + n] = half(reinterpret_cast<const BlockQ6_K*>(rows[n])[sb].d);
}

// IQ4_XS super-block sb of 8 rows -> buf's d of its 8 chunks (half(d) * (ls - 32), as chunk_scalar),
// 8 rows per instruction from each row's first 8 bytes transposed (lane n of h is d | scales_h <<
// 16 of row n, of l its scales_l). Against each row's scales decoded apart (chunk_avx2), Zen 2
// EPYC, 2048 x 1536, 1 thread, alternated, ms: 10 rows 0.958-0.969 -> 0.883-0.893, 40 rows
// 3.13-3.19 -> 3.05-3.10 (the crossover: PANEL_AVX2_FROM).
inline void header_xs_avx2(const uint8_t* const* rows, int64_t sb, Buf& buf) {
  __m256i h, l;
  rows8x8(rows, sizeof(BlockIQ4_XS) * sb, h, l);
  const __m256 dd = halves8(h);
  const __m256i m4 = _mm256_set1_epi32(0x0F), m2 = _mm256_set1_epi32(0x30), b32 = _mm256_set1_epi32(32);
  for (int j = 0; j < 8; ++j) {  // scale_iq4_xs: (scales_l nibble j | scales_h bits 2j, 2j + 1 << 4) - 32
    const __m256i lo = _mm256_and_si256(_mm256_srli_epi32(l, 4 * j), m4);
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi32(h, 12 + 2 * j), m2);  // (scales_h: h's bits 16..31)
    const __m256i ls = _mm256_sub_epi32(_mm256_or_si256(lo, hi), b32);
    _mm256_storeu_ps(buf.d.data() + (sb * 8 + j) * NR2, _mm256_mul_ps(dd, _mm256_cvtepi32_ps(ls)));
  }
}

// the types whose chunks hold their 32 quants as 16 bytes of nibbles (element i low, i + 16 high)
constexpr bool nibble_chunks(int64_t qt) {
  return qt == Q4_0 || qt == Q4_1 || qt == Q5_0 || qt == Q5_1 || qt == IQ4_NL || qt == IQ4_XS;
}

// A nibble_chunks type's chunks of 8 rows -> buf (unpack_rows_avx2's layout), decoded after the
// transpose, 8 rows per instruction: the chunk's 16 quant bytes (q[j] lane n = bytes 4j..4j+3 of
// row n: quad j in their low nibbles, quad j + 4 in the high ones) and the block's first 8 bytes
// (d, m, qh; IQ4_XS's scales: header_xs_avx2). Q5's element 4j + e takes bit 4(j % 2) + e of byte
// j / 2 of qh as its 0x10: that byte copied into the quad's 4 bytes, masked by byte, each nonzero
// mask to 0x10 (a table lookup for bits 0-3, a min for 4-7); IQ4's nibbles index their levels.
// Against each row's chunk decoded in element order and 8 rows transposed: Zen 2 EPYC, 1 thread,
// 4864 x 896, alternated, a call's fixed cost (fit over 8-40 rows) Q5_0 0.27 -> 0.22 ms (8 rows
// 0.81 -> 0.76 ms), Q4_0 0.24 -> 0.20 (0.74 -> 0.70).
template <int64_t QT>
void unpack_nibbles_avx2(const uint8_t* const* rows, int64_t nb, Buf& buf) {
  constexpr bool five = QT == Q5_0 || QT == Q5_1;
  constexpr int64_t B = QT == Q4_0 ? sizeof(BlockQ4_0) : QT == Q4_1 ? sizeof(BlockQ4_1) : QT == IQ4_NL ? sizeof(BlockIQ4_NL)
                      : QT == Q5_0 ? sizeof(BlockQ5_0) : QT == Q5_1 ? sizeof(BlockQ5_1) : sizeof(BlockIQ4_XS);
  constexpr int64_t at = QT == Q4_0 || QT == IQ4_NL ? 2 : QT == Q4_1 ? 4 : QT == Q5_0 ? 6 : 8;  // the quants
  const __m256i b4 = _mm256_set1_epi8(0x10);
  const __m256i levels = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(IQ4_LEVELS)));
  const __m256i any = _mm256_setr_epi8(0, 16, 16, 0, 16, 0, 0, 0, 16, 0, 0, 0, 0, 0, 0, 0,  // (v = 0, 1, 2, 4, 8)
                                       0, 16, 16, 0, 16, 0, 0, 0, 16, 0, 0, 0, 0, 0, 0, 0);
  const __m256i mask[2] = {_mm256_set1_epi32(0x08040201), _mm256_set1_epi32(static_cast<int32_t>(0x80402010u))};
  for (int64_t c = 0; c < nb; ++c) {
    __m256i h = _mm256_setzero_si256(), l = h, q[4];  // (IQ4_XS: h, l unused)
    if constexpr (QT == IQ4_XS) {
      if (c % 8 == 0) header_xs_avx2(rows, c / 8, buf);
      rows8x16(rows, B * (c / 8) + at + 16 * (c % 8), q);
    } else {
      rows8x8(rows, B * c, h, l);
      rows8x16(rows, B * c + at, q);
      _mm256_storeu_ps(buf.d.data() + c * NR2, halves8(h));
      if constexpr (has_m(QT)) _mm256_storeu_ps(buf.m.data() + c * NR2, halves8(_mm256_srli_epi32(h, 16)));
    }
    const __m256i qh = QT == Q5_0 ? _mm256_or_si256(_mm256_srli_epi32(h, 16), _mm256_slli_epi32(l, 16)) : l;  // (Q5)
    auto* u = reinterpret_cast<__m256i*>(buf.u.data() + c * 8 * NR2 * 4);
    for (int j = 0; j < 8; ++j) {
      __m256i v = vec::field(q[j % 4], 4 * (j / 4), 0, 0x0F);
      if constexpr (five) {
        const __m256i rep = _mm256_shuffle_epi8(qh, _mm256_add_epi32(_mm256_set1_epi32(0x01010101 * (j / 2)),
                                                                     _mm256_setr_epi32(0, 0x04040404, 0x08080808, 0x0C0C0C0C,
                                                                                       0, 0x04040404, 0x08080808, 0x0C0C0C0C)));
        const __m256i bit = _mm256_and_si256(rep, mask[j % 2]);
        v = _mm256_or_si256(v, j % 2 ? _mm256_min_epu8(bit, b4) : _mm256_shuffle_epi8(any, bit));
      }
      if constexpr (QT == IQ4_NL || QT == IQ4_XS) v = _mm256_shuffle_epi8(levels, v);  // (signed: the sign trick's w)
      _mm256_storeu_si256(u + j, v);
    }
  }
}

// Q4_K / Q5_K super-blocks of 8 rows -> buf (unpack_rows_avx2's layout), decoded after the
// transpose, 8 rows per instruction: each pair of chunks' 32 quant bytes (q[j] lane n = bytes
// 4j..4j+3 of row n: the even chunk's quad j in their low nibbles, the odd one's in the high),
// Q5_K's 32 qh bytes once per super-block (chunk c's fifth bits are their bit c), the scales by
// header_k4_avx2. Against each row's chunk decoded apart: Zen 2 EPYC, 1 thread, 896 x 4864,
// alternated, Q4_K's per-call cost (fit over 8-40 rows) 0.208 -> 0.147-0.159 ms, 8 rows 0.70 -> 0.64;
// Q5_K 16 rows 1.33 -> 1.29.
template <int64_t QT>
void unpack_k4_avx2(const uint8_t* const* rows, int64_t nb, Buf& buf) {
  using B = std::conditional_t<QT == Q4_K, BlockQ4_K, BlockQ5_K>;
  for (int64_t sb = 0; sb < nb / 8; ++sb) {
    header_k4_avx2<QT>(rows, sb, buf);
    __m256i qh[8];
    if constexpr (QT == Q5_K) {
      rows8x16(rows, sizeof(B) * sb + offsetof(BlockQ5_K, qh), qh);
      rows8x16(rows, sizeof(B) * sb + offsetof(BlockQ5_K, qh) + 16, qh + 4);
    }
    for (int pr = 0; pr < 4; ++pr) {  // chunks 2 pr (low nibbles), 2 pr + 1 (high)
      __m256i q[8];
      rows8x16(rows, sizeof(B) * sb + offsetof(B, qs) + 32 * pr, q);
      rows8x16(rows, sizeof(B) * sb + offsetof(B, qs) + 32 * pr + 16, q + 4);
      for (int hi = 0; hi < 2; ++hi) {
        const int c = 2 * pr + hi;  // (of the super-block)
        auto* u = reinterpret_cast<__m256i*>(buf.u.data() + (8 * sb + c) * 8 * NR2 * 4);
        for (int j = 0; j < 8; ++j) {
          __m256i v = vec::field(q[j], 4 * hi, 0, 0x0F);
          if constexpr (QT == Q5_K) v = _mm256_or_si256(v, vec::field(qh[j], c, 4, 0x10));  // bit c of each qh byte
          _mm256_storeu_si256(u + j, v);
        }
      }
    }
  }
}

// Q6_K super-blocks of 8 rows -> buf (unpack_rows_avx2's layout, signed w = q - 32), decoded after
// the transpose, 8 rows per instruction: per half, its 64 ql bytes (ql[m] lane n = bytes 4m..4m+3
// of row n) and 32 qh bytes; chunk k of the half takes quad j's low bits from ql[8 (k % 2) + j]
// (nibble k / 2) and its high ones from bits 2k, 2k + 1 of qh[j]; the scales by header_q6k_avx2.
// Against each row's chunk decoded apart: Zen 2 EPYC, 1 thread, 896 x 4864, alternated, 16 rows
// 1.48 -> 1.42 ms, 40 rows 3.18 / 3.25 -> 3.12 / 3.13; the 1.5B's int8 step (2 threads) at 12
// rows 199.1 / 199.4 -> 197.3 / 196.1, at 40 rows 550.3 / 548.7 -> 545.5 / 547.6.
inline void unpack_q6k_avx2(const uint8_t* const* rows, int64_t nb, Buf& buf) {
  const __m256i lo4 = _mm256_set1_epi8(0x0F), hi2 = _mm256_set1_epi8(0x30), b32 = _mm256_set1_epi8(32);
  for (int64_t sb = 0; sb < nb / 8; ++sb) {
    header_q6k_avx2(rows, sb, buf);
    for (int h = 0; h < 2; ++h) {
      __m256i ql[16], qh[8];
      for (int i = 0; i < 4; ++i) rows8x16(rows, sizeof(BlockQ6_K) * sb + offsetof(BlockQ6_K, ql) + 64 * h + 16 * i, ql + 4 * i);
      for (int i = 0; i < 2; ++i) rows8x16(rows, sizeof(BlockQ6_K) * sb + offsetof(BlockQ6_K, qh) + 32 * h + 16 * i, qh + 4 * i);
      for (int k = 0; k < 4; ++k) {
        auto* u = reinterpret_cast<__m256i*>(buf.u.data() + (8 * sb + 4 * h + k) * 8 * NR2 * 4);
        for (int j = 0; j < 8; ++j) {
          const __m256i q = ql[8 * (k % 2) + j];
          const __m256i lo = _mm256_and_si256(k / 2 ? _mm256_srli_epi16(q, 4) : q, lo4);
          const __m256i hi = _mm256_and_si256(k < 3 ? _mm256_slli_epi16(qh[j], 4 - 2 * k) : _mm256_srli_epi16(qh[j], 2), hi2);
          _mm256_storeu_si256(u + j, _mm256_sub_epi8(_mm256_or_si256(lo, hi), b32));  // (vec::field's steps, unrolled)
        }
      }
    }
  }
}

// rows[n] (n < NR2) -> buf: u [nb][8][NR2][4], d [nb][NR2], m [nb][NR2] (unpack_scalar's layout, 8 rows),
// each row's chunk decoded in element order (chunk_avx2), then 8 rows transposed
template <int64_t QT>
void unpack_rows_avx2(const uint8_t* const* rows, int64_t nb, Buf& buf) {
  for (int64_t c = 0; c < nb; ++c) {
    __m256 r[8];
    for (int n = 0; n < NR2; ++n)
      r[n] = _mm256_castsi256_ps(chunk_avx2<QT>(rows[n], c, buf.d[c * NR2 + n], buf.m[c * NR2 + n]));
    vec::V8::transpose(r);  // r[j] lane n = quad j of row n
    auto* u = reinterpret_cast<__m256*>(buf.u.data() + c * 8 * NR2 * 4);
    for (int j = 0; j < 8; ++j) _mm256_storeu_ps(reinterpret_cast<float*>(u + j), r[j]);
    if constexpr (km(QT))
      if (c % 8 == 0) {
        for (int n = 0; n < NR2; ++n) mins_km(rows[n], QT, c / 8, n, NR2, buf);
        if constexpr (halved(QT)) scale_pairs_avx2(c / 8, buf);
      }
  }
}

// unpack_rows_avx2's layout: the nibble_chunks types, Q4_K, Q5_K and Q6_K decoded after the
// transpose, the others (Q8_0, Q3_K, Q2_K) before it
template <int64_t QT>
void unpack_avx2(const uint8_t* const* rows, int64_t nb, Buf& buf) {
  if constexpr (nibble_chunks(QT)) unpack_nibbles_avx2<QT>(rows, nb, buf);
  else if constexpr (QT == Q4_K || QT == Q5_K) unpack_k4_avx2<QT>(rows, nb, buf);
  else if constexpr (QT == Q6_K) unpack_q6k_avx2(rows, nb, buf);
  else unpack_rows_avx2<QT>(rows, nb, buf);
}

// the 4 activation bytes at p in every lane
inline __m256i quad(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// quads [j0, j0 + n) of a block of P panels (u[p]) against R activation rows x + r K, into
// acc[p R + r] (int32 lanes): maddubs(u[p][j], x quad j) summed in int16 pairs over G quads at
// a time, then widened by madd with by[p] (ones: the plain sum; a halves type: its scale pair).
// Quad outer, row inner: each u[p][j] is loaded once for the R rows, each quad broadcast once
// for the P panels. SIGNED: the panel holds signed w (Q6_K's q - 32), dotted by the sign trick
// (maddubs(|w|, x * sign w)).
template <int R, int G, int P, bool SIGNED = false>
PQ_INLINE void dot_rows(const __m256i* const* u, const int8_t* x, int64_t K, int j0, int n, __m256i* acc,
                        const __m256i* by) {
  for (int g = j0; g < j0 + n; g += G) {
    __m256i s[P * R];
    for (int j = g; j < g + G; ++j) {
      __m256i v[P], a[P];
      for (int q = 0; q < P; ++q) v[q] = _mm256_loadu_si256(u[q] + j), a[q] = SIGNED ? _mm256_abs_epi8(v[q]) : v[q];
      for (int r = 0; r < R; ++r) {
        const __m256i x4 = quad(x + r * K + 4 * j);
        for (int q = 0; q < P; ++q) {
          const __m256i prod = _mm256_maddubs_epi16(a[q], SIGNED ? _mm256_sign_epi8(x4, v[q]) : x4);
          s[q * R + r] = j == g ? prod : _mm256_add_epi16(s[q * R + r], prod);
          asm("" : "+x"(s[q * R + r]));  // keeps the running sum: without it GCC builds a tree and spills
        }
      }
    }
    for (int q = 0; q < P; ++q)
      for (int r = 0; r < R; ++r) {
        acc[q * R + r] = _mm256_add_epi32(acc[q * R + r], _mm256_madd_epi16(s[q * R + r], by[q]));
        asm("" : "+x"(acc[q * R + r]));  // (the same: a chain, where G = 1 gives 8 of them a block)
      }
  }
}

// one output row's first `cols` of 8 lanes at p, streamed where `stream` and the store is whole
inline void put8(float* p, int64_t cols, __m256 v, bool stream) {
  if (stream && cols == NR2 && (reinterpret_cast<uintptr_t>(p) & 31) == 0) return _mm256_stream_ps(p, v);
  alignas(32) float t[NR2];
  _mm256_store_ps(t, v);
  std::memcpy(p, t, sizeof(float) * cols);
}

// P unpacked panels (pb[q], outputs at out[q], cols[q] of them stored) at once
template <int P>
struct Panels {
  const Buf* pb[P];
  float* out[P];
  int64_t cols[P];
  const __m256i* u(int q, int64_t b) const { return reinterpret_cast<const __m256i*>(pb[q]->u.data() + b * 8 * NR2 * 4); }
  void put(const __m256* y, int R, int64_t ldo) const {  // y[q R + r] -> row r of panel q
    for (int q = 0; q < P; ++q)
      for (int r = 0; r < R; ++r) put8(out[q] + r * ldo, cols[q], y[q * R + r], pb[q]->stream);
  }
};

// R activation rows x P panels (rows_scalar's arithmetic): out[q][r * ldo + n] for n < cols[q]
template <int64_t QT, int R, int P>
void rows_avx2(const Panels<P>& ps, int64_t nb, const int8_t* xq, const float* xd, const float* xs, const int32_t* xb,
               int64_t K, int64_t ldo, ahead::Cursor& next) {
  constexpr bool wide = wide_u(QT);  // u up to 255: the panel holds w = u - 128 (signed)
  constexpr int G = QT == Q4_0 || QT == Q4_1 || QT == Q4_K ? 8 : 4;  // quads summed in int16 (u <= 15 / 31)
  const int32_t bi = bias(QT);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i by[P];
  for (int q = 0; q < P; ++q) by[q] = ones;
  __m256 y[P * R];
  for (int i = 0; i < P * R; ++i) y[i] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    next.step();
    const __m256i* u[P];
    for (int q = 0; q < P; ++q) u[q] = ps.u(q, b);
    const int8_t* x = xq + QK * b;
    __m256i i[P * R];
    if constexpr (wide) {  // the sign trick: maddubs(|w|, x * sign w) = the pairs of w x (|pair| <= 2 * 128 *
      // 127: in int16), each quad's widened by madd; sum_k w x = the scalar path's sum_k u x - 128 sum_k x.
      // Against u as two nibbles (u = 16 hi + lo: two maddubs a quad, each summed over the block):
      // 1 thread, Zen 2 EPYC, Q8_0 32768 x 896, per-row cost of a call (fit over 8-40 rows) 11.6 ->
      // 13.2 multiply-adds per cycle, T8 8.05 -> 7.25 ms, T40 32.4 -> 28.7; held as int16 pairs and
      // dotted by madd alone (a panel twice the bytes): 12.1, T8 8.4.
      for (int k = 0; k < P * R; ++k) i[k] = _mm256_setzero_si256();
      dot_rows<R, 1, P, true>(u, x, K, 0, 8, i, by);
    } else {
      for (int q = 0; q < P; ++q)
        for (int r = 0; r < R; ++r) i[q * R + r] = bi ? _mm256_set1_epi32(xb[r * nb + b]) : _mm256_setzero_si256();
      dot_rows<R, G, P>(u, x, K, 0, 8, i, by);
    }
    for (int q = 0; q < P; ++q) {
      const __m256 d = _mm256_loadu_ps(ps.pb[q]->d.data() + b * NR2);
      for (int r = 0; r < R; ++r)
        y[q * R + r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i[q * R + r]), _mm256_mul_ps(d, _mm256_set1_ps(xd[r * nb + b])),
                                       y[q * R + r]);
      if constexpr (has_m(QT)) {
        const __m256 m = _mm256_loadu_ps(ps.pb[q]->m.data() + b * NR2);
        for (int r = 0; r < R; ++r) y[q * R + r] = _mm256_fmadd_ps(m, _mm256_set1_ps(xs[r * nb + b]), y[q * R + r]);
      }
    }
  }
  ps.put(y, R, ldo);
}

// R activation rows x P panels, a km type (rows_scalar_km's arithmetic)
template <int64_t QT, int R, int P>
void rows_avx2_km(const Panels<P>& ps, int64_t nb, const Acts& a, int64_t ldo, ahead::Cursor& next) {
  constexpr int G = QT == Q4_K ? 8 : QT == Q5_K ? 4 : 2;  // quads summed in int16 (u <= 15 / 31 / 45, 63)
  constexpr int64_t PP = mpairs(QT);
  const int64_t nsb = nb / 8;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i by[P];
  for (int q = 0; q < P; ++q) by[q] = ones;
  __m256 y[P * R];
  for (int k = 0; k < P * R; ++k) y[k] = _mm256_setzero_ps();
  for (int64_t sb = 0; sb < nsb; ++sb) {
    if constexpr (halved(QT)) {  // HALVES, in integers: madd by each half's scale (no vpmulld)
      // I = sum_h sc_h (sum_k u x) - hbias M, M = sum_h sc_h s_h (the scales' pairs . the halves' sums);
      // Q6_K's panel holds w = u - 32 instead (signed: the sign trick), so I = sum_h sc_h (sum_k w x), no M
      constexpr bool SIGNED = QT == Q6_K;
      constexpr int GH = 4;  // quads summed in int16 within a half (Q6_K |w| <= 32, Q3_K u <= 7: 4 x 2 x 32 x 127 fits)
      constexpr int SH = 2;  // log2 hbias (Q3_K's 4)
      __m256i I[P * R];
      for (int k = 0; k < P * R; ++k) I[k] = _mm256_setzero_si256();
      for (int64_t b = 8 * sb; b < 8 * sb + 8; ++b) {
        next.step();
        const __m256i* u[P];
        __m256i s0[P], s1[P];
        for (int q = 0; q < P; ++q) {
          u[q] = ps.u(q, b);
          const __m256i* sc = reinterpret_cast<const __m256i*>(ps.pb[q]->sc.data() + 2 * b * NR2);
          s0[q] = _mm256_loadu_si256(sc), s1[q] = _mm256_loadu_si256(sc + 1);
        }
        dot_rows<R, GH, P, SIGNED>(u, a.kq + QK * b, a.K, 0, 4, I, s0);
        dot_rows<R, GH, P, SIGNED>(u, a.kq + QK * b, a.K, 4, 4, I, s1);
      }
      for (int q = 0; q < P; ++q) {
        const __m256 d = _mm256_loadu_ps(ps.pb[q]->dm.data() + sb * NR2);
        for (int r = 0; r < R; ++r) {
          __m256i i = I[q * R + r];
          if constexpr (!SIGNED) {
            const __m256i* mn = reinterpret_cast<const __m256i*>(ps.pb[q]->mn.data() + sb * 8 * NR2);
            const int32_t* hs = a.halves(r, sb);
            __m256i M = _mm256_madd_epi16(_mm256_loadu_si256(mn), _mm256_set1_epi32(hs[0]));
            for (int k = 1; k < 8; ++k) M = _mm256_add_epi32(M, _mm256_madd_epi16(_mm256_loadu_si256(mn + k), _mm256_set1_epi32(hs[k])));
            i = _mm256_sub_epi32(i, _mm256_slli_epi32(M, SH));
          }
          y[q * R + r] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(i), d), _mm256_set1_ps(a.kd[r * nsb + sb]), y[q * R + r]);
        }
      }
      continue;
    }
    __m256 z[P * R];
    __m256i i[P * R];  // a chunk's integer sums (Q2_K: the super-block's)
    for (int k = 0; k < P * R; ++k) z[k] = _mm256_setzero_ps(), i[k] = _mm256_setzero_si256();
    for (int64_t b = 8 * sb; b < 8 * sb + 8; ++b) {
      next.step();
      const __m256i* u[P];
      for (int q = 0; q < P; ++q) u[q] = ps.u(q, b);
      if constexpr (QT != Q2_K)
        for (int k = 0; k < P * R; ++k) i[k] = _mm256_setzero_si256();
      dot_rows<R, G, P>(u, a.kq + QK * b, a.K, 0, 8, i, by);
      if constexpr (QT != Q2_K)
        for (int q = 0; q < P; ++q) {
          const __m256 d = _mm256_loadu_ps(ps.pb[q]->d.data() + b * NR2);
          for (int r = 0; r < R; ++r) z[q * R + r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i[q * R + r]), d, z[q * R + r]);
        }
    }
    for (int q = 0; q < P; ++q) {
      const Buf& p = *ps.pb[q];
      if constexpr (QT == Q2_K) {
        const __m256 d = _mm256_loadu_ps(p.d.data() + 8 * sb * NR2);
        for (int r = 0; r < R; ++r) z[q * R + r] = _mm256_mul_ps(_mm256_cvtepi32_ps(i[q * R + r]), d);
      }
      const __m256i* mn = reinterpret_cast<const __m256i*>(p.mn.data() + sb * PP * NR2);
      const __m256 dm = _mm256_loadu_ps(p.dm.data() + sb * NR2);
      for (int r = 0; r < R; ++r) {
        const int32_t* ks = a.mins(QT, r, sb);
        __m256i M = _mm256_madd_epi16(_mm256_loadu_si256(mn), _mm256_set1_epi32(ks[0]));
        for (int k = 1; k < PP; ++k) M = _mm256_add_epi32(M, _mm256_madd_epi16(_mm256_loadu_si256(mn + k), _mm256_set1_epi32(ks[k])));
        const __m256 t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(M), dm, z[q * R + r]);
        y[q * R + r] = _mm256_fmadd_ps(t, _mm256_set1_ps(a.kd[r * nsb + sb]), y[q * R + r]);
      }
    }
  }
  ps.put(y, R, ldo);
}

// activation rows per register block: one panel at a time (RB2; the sign-trick types 2), two (RB2X2)
template <int64_t QT>
constexpr int RB2 = wide_u(QT) ? 2 : 4;
constexpr int RB2X2 = 3;

template <int64_t QT, int P>
void rows_groups_avx2(const Panels<P>& ps, int64_t T, const Acts& a, int64_t ldo, const ahead::Ranges& next) {
  constexpr int RB = P == 1 ? RB2<QT> : RB2X2;
  ahead::Cursor cur(next, (T + RB - 1) / RB * a.nb);  // (a step per block of each group)
  by_groups<RB>(T, [&](auto r, int64_t t) {
    const Acts s = a.at(t);
    Panels<P> at = ps;
    for (int q = 0; q < P; ++q) at.out[q] += t * ldo;
    if constexpr (km(QT)) rows_avx2_km<QT, decltype(r)::value, P>(at, s.nb, s, ldo, cur);
    else rows_avx2<QT, decltype(r)::value, P>(at, s.nb, s.q, s.d, s.s, s.xb[QT == Q5_0], s.K, ldo, cur);
  });
}

template <int64_t QT>
void panel_avx2(const uint8_t* const* rows, int64_t T, const Acts& a, float* out, int64_t ldo, int64_t cols,
                Buf& buf, const ahead::Ranges& next) {
  unpack_avx2<QT>(rows, a.nb, buf);
  rows_groups_avx2<QT, 1>(Panels<1>{{&buf}, {out}, {cols}}, T, a, ldo, next);
}

void panel_avx2(int64_t qt, const uint8_t* const* rows, int64_t T, const Acts& a, float* out, int64_t ldo,
                int64_t cols, Buf& buf, const ahead::Ranges& next) {
  with_panel_type(qt, [&](auto q) { panel_avx2<decltype(q)::value>(rows, T, a, out, ldo, cols, buf, next); });
}

// two panels of one segment (the first whole) at once: each activation quad broadcast once for
// both, fewer broadcasts and float steps per product (the same bits as one at a time)
template <int64_t QT>
void panel_avx2x2(const uint8_t* const* rows, const uint8_t* const* rows_b, int64_t T, const Acts& a, float* out,
                  float* out_b, int64_t ldo, int64_t cols_b, Buf& buf, Buf& buf_b, const ahead::Ranges& next) {
  unpack_avx2<QT>(rows, a.nb, buf);
  unpack_avx2<QT>(rows_b, a.nb, buf_b);
  rows_groups_avx2<QT, 2>(Panels<2>{{&buf, &buf_b}, {out, out_b}, {NR2, cols_b}}, T, a, ldo, next);
}

void panel_avx2x2(int64_t qt, const uint8_t* const* rows, const uint8_t* const* rows_b, int64_t T, const Acts& a,
                  float* out, float* out_b, int64_t ldo, int64_t cols_b, Buf& buf, Buf& buf_b,
                  const ahead::Ranges& next) {
  with_panel_type(qt, [&](auto q) {
    if constexpr (pair_avx2(decltype(q)::value))
      panel_avx2x2<decltype(q)::value>(rows, rows_b, T, a, out, out_b, ldo, cols_b, buf, buf_b, next);
  });
}

// --- the exact path's gemm panels, AVX2 (qmatmul_simd.h: f32_avx2) --------------------------------
//
// qmatmul_simd.inc's gemm multiplies panels of 16 weight rows dequantized into wt [K][16] (a lane
// per row). Dequantizing each row's chunk in element order and transposing 8 x 8 floats took 24
// shuffles per 64 weights and spilled (16 ymm registers): 1 thread, 2048 x 1536 Q4_K, the panel
// cost more than the 1-row kernel's whole product. Here 8 rows at a time are unpacked as the int8
// panels are (unpack_avx2: bytes transposed by dwords, decoded 8 rows per instruction), then each
// element's byte of the 8 rows is widened in its lane, converted and scaled by that row's factors:
// the float32 operation of qmatmul_simd.inc's Chunker for the type, so the same weights.
constexpr bool f32_type(int64_t qt) { return nibble_chunks(qt) || qt == Q8_0 || qt == Q4_K || qt == Q5_K || qt == Q6_K; }

// byte e (0..3) of each dword lane of v, zero- or sign-extended
template <bool SIGNED>
PQ_INLINE __m256i byte_of(__m256i v, int e) {
  if constexpr (SIGNED) return _mm256_srai_epi32(e == 3 ? v : _mm256_slli_epi32(v, 24 - 8 * e), 24);
  // unsigned: one byte shuffle, zeros above (against a shift and a mask: the 0.5B Q4_K_M mix's
  // exact step at 12 rows, Zen 2, 116.2 -> 114.4 ms)
  const char z = -128;
  return _mm256_shuffle_epi8(v, _mm256_setr_epi8(e, z, z, z, e + 4, z, z, z, e + 8, z, z, z, e + 12, z, z, z,
                                                 e, z, z, z, e + 4, z, z, z, e + 8, z, z, z, e + 12, z, z, z));
}

// chunk c of buf (8 rows) -> element k's 8 values at o + k pn: Chunker's d * (u - bias) (Q4_0,
// Q5_0; Q8_0 and the IQ4 levels signed, no bias), d * u + m (Q4_1, Q5_1), s * u + nm (Q4_K, Q5_K:
// s = d * sc, nm = -dmin * mn) or s * q (Q6_K: s = d * sc per 16)
template <int64_t QT>
PQ_INLINE void f32_chunk(const Buf& buf, int64_t c, float* o, int64_t pn) {
  constexpr bool sgn = QT == Q8_0 || QT == IQ4_NL || QT == IQ4_XS || QT == Q6_K;
  constexpr bool fma = has_m(QT) || QT == Q4_K || QT == Q5_K;
  const auto* u = reinterpret_cast<const __m256i*>(buf.u.data() + c * 8 * NR2 * 4);
  __m256 a[2], b = _mm256_setzero_ps();  // a[h]: quads 4h .. 4h + 3
  if constexpr (QT == Q6_K) {
    const __m256 d = _mm256_loadu_ps(buf.dm.data());
    const auto* sc = reinterpret_cast<const __m256i*>(buf.sc.data());  // sc | sc << 16 per 16 elements
    for (int h = 0; h < 2; ++h) a[h] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_loadu_si256(sc + 2 * c + h), 16)));
  } else {
    a[0] = a[1] = _mm256_loadu_ps(buf.d.data() + c * NR2);
    if constexpr (has_m(QT)) b = _mm256_loadu_ps(buf.m.data() + c * NR2);
    if constexpr (QT == Q4_K || QT == Q5_K) {  // mn 2k | mn 2k + 1 << 16
      const __m256i mn = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(buf.mn.data() + c / 2 * NR2));
      const __m256i m = c % 2 ? _mm256_srli_epi32(mn, 16) : _mm256_and_si256(mn, _mm256_set1_epi32(0xFFFF));
      b = _mm256_mul_ps(_mm256_loadu_ps(buf.dm.data()), _mm256_cvtepi32_ps(m));
    }
  }
  const __m256i off = _mm256_set1_epi32(bias(QT) * !sgn);
  for (int j = 0; j < 8; ++j) {
    const __m256i v = _mm256_loadu_si256(u + j);
    for (int e = 0; e < 4; ++e) {
      __m256i q = byte_of<sgn>(v, e);
      if constexpr (QT == Q4_0 || QT == Q5_0) q = _mm256_sub_epi32(q, off);
      const __m256 f = _mm256_cvtepi32_ps(q);
      _mm256_storeu_ps(o + (4 * j + e) * pn, fma ? _mm256_fmadd_ps(a[j / 4], f, b) : _mm256_mul_ps(a[j / 4], f));
    }
  }
}

template <int64_t QT>
void f32_panel(const uint8_t* w, int64_t rb, int64_t rows, int64_t K, float* wt) {
  constexpr int64_t PN = 2 * NR2;
  constexpr bool super = is_super_block(QT);
  constexpr int64_t B = type_info(QT)->bytes;
  const int64_t nb = K / QK;
  thread_local Buf tbuf = [] {
    Buf b;
    b.size(8);
    return b;
  }();
  Buf& buf = tbuf;  // (its address once: each thread_local access in a shared library is a call)
  for (int64_t g = 0; g < PN; g += NR2) {
    for (int64_t c0 = 0; c0 < nb; c0 += 8) {  // 8 chunks (a super-block) at a time: buf stays in L1
      const uint8_t* r[NR2];  // past the panel's rows its last row again (lanes the gemm does not store)
      for (int n = 0; n < NR2; ++n) r[n] = w + std::min<int64_t>(g + n, rows - 1) * rb + (super ? c0 / 8 : c0) * B;
      const int64_t n = std::min<int64_t>(8, nb - c0);
      unpack_avx2<QT>(r, n, buf);
      for (int64_t c = 0; c < n; ++c) f32_chunk<QT>(buf, c, wt + 32 * (c0 + c) * PN + g, PN);
    }
  }
}

bool f32_avx2(int64_t qt, const uint8_t* w, int64_t rb, int64_t rows, int64_t K, float* wt) {
  if (!f32_type(qt)) return false;
  with_panel_type(qt, [&](auto q) {
    if constexpr (f32_type(decltype(q)::value)) f32_panel<decltype(q)::value>(w, rb, rows, K, wt);
  });
  return true;
}
#endif

// --- r16 (see the VNNI section): the layout ----------------------------------------------------

// a panel: the headers of its super-blocks (HDR bytes each: Q4_K / Q5_K the 16 bytes of d, dmin
// and scales, Q6_K its 16 scales then the 16 rows' d), then their quants (QB bytes each), so that
// the per-call scale decode reads the panel's first lines and the products the rest in order
template <int64_t QT>
constexpr int64_t HDR = QT == Q6_K ? 16 * 16 + 32 : 16 * 16;
template <int64_t QT>
constexpr int64_t QB = QT == Q4_K ? 16 * 128 : QT == Q5_K ? 16 * 160 : 16 * 192;

// where a Q6_K block's quant dword w (ql 0-31, qh 32-47) is kept: in the order the chunks first
// read them (ql 0-7, qh 32-39, ql 8-15, 16-23, qh 40-47, ql 24-31), so that a super-block is
// read front to back. In the file's order one row streamed from DRAM at 8.7 GB/s, in this one
// at 14 (1 thread, Zen 4; Q4_K 17.8; in cache both 35-40).
constexpr int q6_pos(int w) {
  return w < 8 ? w : w < 24 ? w + 8 : w < 32 ? w + 16 : w < 40 ? w - 24 : w - 8;
}

#ifdef PANEL_X86
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vnni")

bool cpu_has_vnni() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vnni");
}

// The rows of a panel: NR pointers into one segment (rows past its end repeat its last row: their
// lanes are computed and never stored), and each row's byte offset from the first, for gathers.
struct Rows {
  const uint8_t* const* p;
  __m512i off;
  int64_t stride = 0;  // rows[n] = rows[0] + n stride (a panel inside its segment), else 0
  explicit Rows(const uint8_t* const* rows) : p(rows) {
    alignas(64) int32_t o[NR];
    for (int n = 0; n < NR; ++n) o[n] = static_cast<int32_t>(rows[n] - rows[0]);
    off = _mm512_load_si512(o);
    bool even = o[1] > 0;
    for (int n = 2; n < NR; ++n) even = even && o[n] == n * o[1];
    if (even) stride = o[1];
  }
  const uint8_t* operator[](int n) const { return p[n]; }
  // the 4 bytes at byte o of each row, lane n = row n
  __m512i dwords(int64_t o) const { return _mm512_i32gather_epi32(off, p[0] + o, 1); }
};

// 16 rows' 16-byte pieces at p[n] + off -> 4 zmm: out[j] lane n = bytes 4j..4j+3 of row n
inline void transpose16(const Rows& p, int64_t off, __m512i out[4]) {
  __m512i z[4];
  auto ld = [](const uint8_t* q) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(q)); };
  if (p.stride) {  // 4 bases and the stride (16 pointers do not fit the registers)
    int64_t s = p.stride;
    const uint8_t* b = p[0] + off;
    asm("" : "+r"(s), "+r"(b));
    const uint8_t* const b1 = b + 4 * s;
    const uint8_t* const b2 = b + 8 * s;
    const uint8_t* const b3 = b + 12 * s;
    for (int a = 0; a < 4; ++a) {
      __m512i v = _mm512_castsi128_si512(ld(b + a * s));
      v = _mm512_inserti32x4(v, ld(b1 + a * s), 1);
      v = _mm512_inserti32x4(v, ld(b2 + a * s), 2);
      z[a] = _mm512_inserti32x4(v, ld(b3 + a * s), 3);
    }
  } else {
    for (int a = 0; a < 4; ++a) {  // z[a] 128-bit lane l = row 4l + a
      __m512i v = _mm512_castsi128_si512(ld(p[a] + off));
      v = _mm512_inserti32x4(v, ld(p[4 + a] + off), 1);
      v = _mm512_inserti32x4(v, ld(p[8 + a] + off), 2);
      z[a] = _mm512_inserti32x4(v, ld(p[12 + a] + off), 3);
    }
  }
  const __m512i t0 = _mm512_unpacklo_epi32(z[0], z[1]), t1 = _mm512_unpackhi_epi32(z[0], z[1]);
  const __m512i t2 = _mm512_unpacklo_epi32(z[2], z[3]), t3 = _mm512_unpackhi_epi32(z[2], z[3]);
  out[0] = _mm512_unpacklo_epi64(t0, t2);
  out[1] = _mm512_unpackhi_epi64(t0, t2);
  out[2] = _mm512_unpacklo_epi64(t1, t3);
  out[3] = _mm512_unpackhi_epi64(t1, t3);
}

// the low (hi = false) or high 16 bits of each dword lane, as fp16 -> 16 floats
inline __m512 halves(__m512i v, bool hi) {
  return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(hi ? _mm512_srli_epi32(v, 16) : v));
}

// Unpacking straight from the file's blocks: every type's bytes are transposed 16 rows at a time
// (transpose16) and decoded in the transposed layout, 16 rows per instruction, so a panel's
// unpacking costs a few instructions per 64 bytes of u whatever the type. The values are
// chunk_scalar's, operation for operation (the scales: the same float products).

inline __m512i lo4() { return _mm512_set1_epi8(0x0F); }

// byte k (0..3) of every dword lane, as an int32
inline __m512i byte_of(__m512i v, int k) {
  return _mm512_and_si512(_mm512_srli_epi32(v, 8 * k), _mm512_set1_epi32(0xFF));
}

inline __m512 cvt(__m512i v) { return _mm512_cvtepi32_ps(v); }
inline __m512 neg(__m512 v) { return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(v), _mm512_set1_epi32(INT32_MIN))); }

// the low (hi = false) or high nibbles of transposed bytes
inline __m512i nib(__m512i q, bool hi) { return _mm512_and_si512(hi ? _mm512_srli_epi16(q, 4) : q, lo4()); }

// a 16-entry byte table (t[nibble] ^ 0x80) applied to the nibbles of 16 transposed bytes
inline void lut_quads(const __m512i q[4], bool hi, __m512i tab, __m512i* u) {
  for (int j = 0; j < 4; ++j) _mm512_storeu_si512(u + j, _mm512_shuffle_epi8(tab, nib(q[j], hi)));
}

inline __m512i iq4_table() {
  alignas(16) int8_t t[16];
  for (int i = 0; i < 16; ++i) t[i] = static_cast<int8_t>(IQ4_LEVELS[i] ^ 0x80);
  return _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(t)));
}

// Q4_K / Q5_K super-block at byte o of each row -> d of its 8 chunks (d sc), its mins in int16
// pairs (mn2: Buf::mn's layout) and -dmin (dm)
// t[0] lane n = d | dmin << 16 of row n, t[1..3] = scales[0..3], [4..7], [8..11] (the
// super-block's first 16 bytes, transposed by dwords)
inline void scales_k4(const __m512i t[4], float* d, int32_t* mn2, float* dm) {
  const __m512i* s = t + 1;
  const __m512 dd = halves(t[0], false);
  const __m512i six = _mm512_set1_epi32(0x3F), hi2 = _mm512_set1_epi32(0x30), lo = _mm512_set1_epi32(0x0F);
  _mm512_storeu_ps(dm, neg(halves(t[0], true)));
  __m512i even;
  for (int j = 0; j < 8; ++j) {
    __m512i sc, mn;
    if (j < 4) {
      sc = _mm512_and_si512(byte_of(s[0], j), six);
      mn = _mm512_and_si512(byte_of(s[1], j), six);
    } else {
      const __m512i c = byte_of(s[2], j - 4);
      sc = _mm512_or_si512(_mm512_and_si512(c, lo), _mm512_and_si512(_mm512_srli_epi32(byte_of(s[0], j - 4), 2), hi2));
      mn = _mm512_or_si512(_mm512_srli_epi32(c, 4), _mm512_and_si512(_mm512_srli_epi32(byte_of(s[1], j - 4), 2), hi2));
    }
    _mm512_storeu_ps(d + j * NR, _mm512_mul_ps(dd, cvt(sc)));
    if (j % 2 == 0) even = mn;
    else _mm512_storeu_si512(mn2 + j / 2 * NR, _mm512_or_si512(even, _mm512_slli_epi32(mn, 16)));
  }
}

inline void scales_k4(const Rows& p, int64_t o, float* d, int32_t* mn2, float* dm) {
  __m512i t[4];
  transpose16(p, o, t);
  scales_k4(t, d, mn2, dm);
}

// a halves type's super-block sb: its 16 signed scales (sc[i] lane n = scale i of row n) and d
// -> Buf's sc and dm (d): mins_km's values
inline void scales_halves(const __m512i sc[16], __m512 dd, int64_t sb, Buf& buf) {
  for (int i = 0; i < 16; ++i) _mm512_storeu_si512(buf.sc.data() + (16 * sb + i) * NR, sc[i]);
  _mm512_storeu_ps(buf.dm.data() + sb * NR, dd);
}

// Q6_K super-block scales (s[i] lane n = scales[4 i .. 4 i + 3] of row n, signed bytes) and d
inline void scales_q6(const __m512i s[4], __m512 dd, int64_t sb, Buf& buf) {
  __m512i sc[16];
  for (int i = 0; i < 16; ++i) sc[i] = _mm512_srai_epi32(_mm512_slli_epi32(s[i / 4], 24 - 8 * (i % 4)), 24);
  scales_halves(sc, dd, sb, buf);
}

// bit j of each byte of h, moved to bit 4 (0x10 or 0)
inline __m512i bit_to_4(__m512i h, int j) {
  const __m512i b4 = _mm512_set1_epi8(0x10);
  return _mm512_and_si512(j < 4 ? _mm512_slli_epi32(h, 4 - j) : _mm512_srli_epi32(h, j - 4), b4);
}

// Q5_0 / Q5_1: bit 4 of element 4 j + e of a row is bit 4 j + e of its qh (dword lane n of qh):
// the byte holding those 4 bits, copied into the quad's 4 bytes, tested against 1 << (bit % 8)
inline __m512i q5_bits(__m512i qh, int j) {
  const int shift = 4 * (j % 2);
  const __m128i idx = _mm_add_epi8(_mm_setr_epi8(0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12),
                                   _mm_set1_epi8(static_cast<char>(j / 2)));
  const __m512i rep = _mm512_shuffle_epi8(qh, _mm512_broadcast_i32x4(idx));
  const __m512i sel = _mm512_set1_epi32(static_cast<int32_t>(0x08040201u << shift));
  return _mm512_maskz_mov_epi8(_mm512_test_epi8_mask(rep, sel), _mm512_set1_epi8(0x10));
}

// the same layout as unpack_scalar (rows past the segment's end: see Rows)
template <int64_t QT>
void unpack_vnni(const Rows& p, int64_t nb, Buf& buf) {
  __m512i q[4], r[4];
  auto u_of = [&](int64_t c) { return reinterpret_cast<__m512i*>(buf.u.data() + c * 8 * NR * 4); };
  if constexpr (QT == Q4_K || QT == Q5_K) {
    constexpr int64_t bb = QT == Q4_K ? sizeof(BlockQ4_K) : sizeof(BlockQ5_K), qs = QT == Q4_K ? 16 : 48;
    for (int64_t sb = 0; sb < nb / 8; ++sb) {
      const int64_t o = sb * bb;
      scales_k4(p, o, buf.d.data() + 8 * sb * NR, buf.mn.data() + 4 * sb * NR, buf.dm.data() + sb * NR);
      __m512i h[2][4];
      if constexpr (QT == Q5_K) transpose16(p, o + 16, h[0]), transpose16(p, o + 32, h[1]);
      for (int pr = 0; pr < 4; ++pr) {  // qs bytes 32 pr .. 32 pr + 31: chunks 2 pr (low), 2 pr + 1 (high)
        transpose16(p, o + qs + 32 * pr, q);
        transpose16(p, o + qs + 32 * pr + 16, r);
        for (int hi = 0; hi < 2; ++hi) {
          const int j = 2 * pr + hi;
          __m512i* u = u_of(8 * sb + j);
          for (int k = 0; k < 8; ++k) {
            __m512i v = nib(k < 4 ? q[k] : r[k - 4], hi);
            if constexpr (QT == Q5_K) v = _mm512_or_si512(v, bit_to_4(h[k / 4][k % 4], j));
            _mm512_storeu_si512(u + k, v);
          }
        }
      }
    }
  } else if constexpr (QT == Q6_K) {  // u = the 6-bit q; d, m: the chunk's two scales times d
    constexpr int64_t bb = sizeof(BlockQ6_K);
    const __m512i hi2 = _mm512_set1_epi8(0x30);
    for (int64_t sb = 0; sb < nb / 8; ++sb) {
      const int64_t o = sb * bb;
      __m512i s[4];  // s[i] lane n = scales[4 i .. 4 i + 3] of row n
      transpose16(p, o + 192, s);
      const __m512 dd = halves(p.dwords(o + 206), true);  // scales[14..15] | d << 16
      scales_q6(s, dd, sb, buf);
      for (int hh = 0; hh < 2; ++hh) {  // elements 128 hh ..: ql 64 hh (a: +0, b: +32), qh 32 hh
        __m512i a[2][4], b[2][4], h[2][4];
        for (int x = 0; x < 2; ++x) {
          transpose16(p, o + 64 * hh + 16 * x, a[x]);
          transpose16(p, o + 64 * hh + 32 + 16 * x, b[x]);
          transpose16(p, o + 128 + 32 * hh + 16 * x, h[x]);
        }
        for (int jj = 0; jj < 4; ++jj) {  // chunk 4 hh + jj: nibble jj / 2 of (a, b)[jj % 2], qh bits 2 jj
          __m512i* u = u_of(8 * sb + 4 * hh + jj);
          for (int k = 0; k < 8; ++k) {
            const __m512i ql = (jj % 2 ? b : a)[k / 4][k % 4], qh = h[k / 4][k % 4];
            const __m512i lo = _mm512_and_si512(jj / 2 ? _mm512_srli_epi16(ql, 4) : ql, lo4());
            const int sh = 4 - 2 * jj;  // qh bits 2 jj, 2 jj + 1 -> bits 4, 5
            const __m512i hb = sh > 0 ? _mm512_slli_epi16(qh, sh) : sh < 0 ? _mm512_srli_epi16(qh, -sh) : qh;
            _mm512_storeu_si512(u + k, _mm512_or_si512(lo, _mm512_and_si512(hb, hi2)));
          }
        }
      }
    }
  } else if constexpr (QT == Q2_K) {  // u = the half's scale times q; d the super-block's; mins: mn, dm
    constexpr int64_t bb = sizeof(BlockQ2_K);
    const __m512i three = _mm512_set1_epi8(0x03), lo = _mm512_set1_epi32(0x0F);
    // scale byte i of each row (s[i / 4]: bytes 4 (i / 4) .., lane n = row n): its low or high nibble
    auto nib_of = [&](const __m512i s[4], int i, bool hi) {
      return _mm512_and_si512(_mm512_srli_epi32(s[i / 4], 8 * (i % 4) + 4 * hi), lo);
    };
    for (int64_t sb = 0; sb < nb / 8; ++sb) {
      const int64_t o = sb * bb;
      __m512i s[4];  // s[i] lane n = scales[4 i .. 4 i + 3] of row n
      transpose16(p, o, s);
      const __m512i dd = p.dwords(o + 80);  // d | dmin << 16
      const __m512 d = halves(dd, false);
      _mm512_storeu_ps(buf.dm.data() + sb * NR, neg(halves(dd, true)));
      for (int k = 0; k < 8; ++k)  // mins 2 k, 2 k + 1 in int16 pairs
        _mm512_storeu_si512(buf.mn.data() + (sb * 8 + k) * NR,
                            _mm512_or_si512(nib_of(s, 2 * k, true), _mm512_slli_epi32(nib_of(s, 2 * k + 1, true), 16)));
      for (int h = 0; h < 2; ++h) {  // qs bytes 32 h ..: chunk 4 h + jj takes bits 2 jj
        transpose16(p, o + 16 + 32 * h, q);
        transpose16(p, o + 32 + 32 * h, r);
        for (int jj = 0; jj < 4; ++jj) {
          const int c = 4 * h + jj;
          _mm512_storeu_ps(buf.d.data() + (8 * sb + c) * NR, d);
          __m512i sc[2];  // the halves' scales (2 c, 2 c + 1) in both 16-bit words of each lane
          for (int e = 0; e < 2; ++e) {
            const __m512i v = nib_of(s, 2 * c + e, false);
            sc[e] = _mm512_or_si512(v, _mm512_slli_epi32(v, 16));
          }
          __m512i* u = u_of(8 * sb + c);
          for (int k = 0; k < 8; ++k) {  // q <= 3 times a scale <= 15: each byte's product fits it
            const __m512i v = _mm512_and_si512(_mm512_srli_epi16(k < 4 ? q[k] : r[k - 4], 2 * jj), three);
            _mm512_storeu_si512(u + k, _mm512_mullo_epi16(v, sc[k / 4]));
          }
        }
      }
    }
  } else if constexpr (QT == Q3_K) {  // u = q + 4 (the hmask bit as bit 2); d, m: the halves' scales times d
    constexpr int64_t bb = sizeof(BlockQ3_K);
    const __m512i three = _mm512_set1_epi8(0x03), four = _mm512_set1_epi8(0x04);
    const __m512i k4 = _mm512_set1_epi32(0x0F0F0F0F), k2 = _mm512_set1_epi32(0x03030303);
    for (int64_t sb = 0; sb < nb / 8; ++sb) {
      const int64_t o = sb * bb;
      __m512i t[4];  // bytes 94 .. 109 of each row: qs[62..63], scales[0..11], d
      transpose16(p, o + 94, t);
      auto dword = [&](int i) {  // scale bytes 4 i .. 4 i + 3
        return _mm512_or_si512(_mm512_srli_epi32(t[i], 16), _mm512_slli_epi32(t[i + 1], 16));
      };
      const __m512i a0 = dword(0), a1 = dword(1), a2 = dword(2);
      const __m512 dd = halves(t[3], true);
      auto six = [&](__m512i l, int ls, int hs) {  // 4 low bits from l >> ls, 2 high from a2 >> hs
        return _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(l, ls), k4),
                               _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(a2, hs), k2), 4));
      };
      const __m512i sc4[4] = {six(a0, 0, 0), six(a1, 0, 2), six(a0, 4, 4), six(a1, 4, 6)};  // scales 4 i ..
      __m512i sc[16];  // each minus 32
      for (int i = 0; i < 16; ++i) sc[i] = _mm512_sub_epi32(byte_of(sc4[i / 4], i % 4), _mm512_set1_epi32(32));
      scales_halves(sc, dd, sb, buf);
      __m512i hm[2][4];
      transpose16(p, o, hm[0]);
      transpose16(p, o + 16, hm[1]);
      for (int h = 0; h < 2; ++h) {  // qs bytes 32 h ..: chunk 4 h + jj takes bits 2 jj
        transpose16(p, o + 32 + 32 * h, q);
        transpose16(p, o + 48 + 32 * h, r);
        for (int jj = 0; jj < 4; ++jj) {
          const int c = 4 * h + jj;
          __m512i* u = u_of(8 * sb + c);
          for (int k = 0; k < 8; ++k) {
            const __m512i lo = _mm512_and_si512(_mm512_srli_epi16(k < 4 ? q[k] : r[k - 4], 2 * jj), three);
            const __m512i m = hm[k / 4][k % 4];  // bit c of each byte -> bit 2
            const __m512i hb = _mm512_and_si512(c >= 2 ? _mm512_srli_epi16(m, c - 2) : _mm512_slli_epi16(m, 2 - c), four);
            _mm512_storeu_si512(u + k, _mm512_or_si512(lo, hb));
          }
        }
      }
    }
  } else if constexpr (QT == IQ4_XS) {  // chunk j: the 16 bytes qs[16 j ..], nibbles through the table
    constexpr int64_t bb = sizeof(BlockIQ4_XS);
    const __m512i tab = iq4_table();
    for (int64_t sb = 0; sb < nb / 8; ++sb) {
      const int64_t o = sb * bb;
      __m512i s[4];  // s[0] lane n = d | scales_h << 16 of row n, s[1] = scales_l[0..3]
      transpose16(p, o, s);
      const __m512 dd = halves(s[0], false);
      for (int j = 0; j < 8; ++j) {
        const __m512i l = _mm512_and_si512(_mm512_srli_epi32(s[1], 4 * j), _mm512_set1_epi32(0x0F));
        const __m512i h = _mm512_and_si512(_mm512_srli_epi32(s[0], 16 + 2 * j), _mm512_set1_epi32(0x03));
        const __m512i sc = _mm512_sub_epi32(_mm512_or_si512(l, _mm512_slli_epi32(h, 4)), _mm512_set1_epi32(32));
        _mm512_storeu_ps(buf.d.data() + (8 * sb + j) * NR, _mm512_mul_ps(dd, cvt(sc)));
        transpose16(p, o + 8 + 16 * j, q);
        __m512i* u = u_of(8 * sb + j);
        lut_quads(q, false, tab, u);
        lut_quads(q, true, tab, u + 4);
      }
    }
  } else {  // the 32-element types
    constexpr int64_t bb = QT == Q4_0 ? sizeof(BlockQ4_0) : QT == Q4_1 ? sizeof(BlockQ4_1) : QT == Q8_0 ? sizeof(BlockQ8_0)
                         : QT == Q5_0 ? sizeof(BlockQ5_0) : QT == Q5_1 ? sizeof(BlockQ5_1) : sizeof(BlockIQ4_NL);
    constexpr bool off = has_m(QT);  // Q4_1, Q5_1: m after d
    constexpr int64_t qh = 2 + 2 * off, qs = QT == Q5_0 || QT == Q5_1 ? qh + 4 : qh;
    const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
    [[maybe_unused]] const __m512i tab = iq4_table();
    for (int64_t b = 0; b < nb; ++b) {
      __m512i* u = u_of(b);
      if constexpr (QT == Q8_0) {
        for (int h = 0; h < 2; ++h) {
          transpose16(p, b * bb + 2 + 16 * h, q);
          for (int j = 0; j < 4; ++j) _mm512_storeu_si512(u + 4 * h + j, _mm512_xor_si512(q[j], flip));
        }
      } else {
        transpose16(p, b * bb + qs, q);
        if constexpr (QT == IQ4_NL) {
          lut_quads(q, false, tab, u);
          lut_quads(q, true, tab, u + 4);
        } else {
          [[maybe_unused]] __m512i h;
          if constexpr (QT == Q5_0 || QT == Q5_1) h = p.dwords(b * bb + qh);
          for (int j = 0; j < 8; ++j) {
            __m512i v = nib(q[j % 4], j >= 4);
            if constexpr (QT == Q5_0 || QT == Q5_1) v = _mm512_or_si512(v, q5_bits(h, j));
            _mm512_storeu_si512(u + j, v);
          }
        }
      }
      const __m512i dm = p.dwords(b * bb);  // d | (Q4_1, Q5_1: m) << 16
      _mm512_storeu_ps(buf.d.data() + b * NR, halves(dm, false));
      if constexpr (off) _mm512_storeu_ps(buf.m.data() + b * NR, halves(dm, true));
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

// the quad that chain c (0, 1) of a km type's chunk takes at step j (0-3): the halves types quad
// j of half c, the others quads 2 j + c (even and odd)
template <int64_t QT>
constexpr int quad(int j, int c) {
  return halved(QT) ? j + 4 * c : 2 * j + c;
}

// a halves type's chunk b: its halves' scales (Buf::sc), loaded once for the activation rows
struct HalfScales {
  __m512i c0, c1;
  HalfScales(const Buf& p, int64_t b)
      : c0(_mm512_loadu_si512(p.sc.data() + 2 * b * NR)), c1(_mm512_loadu_si512(p.sc.data() + (2 * b + 1) * NR)) {}
  // I + the chunk's two halves' sums s0, s1 times their scales (HALVES)
  __m512i add(__m512i I, __m512i s0, __m512i s1) const {
    return _mm512_add_epi32(I, _mm512_add_epi32(_mm512_mullo_epi32(s0, c0), _mm512_mullo_epi32(s1, c1)));
  }
};

// One output's two integer sums of block b before its products (the 32-element types): the even
// quads start at -bias times the block's activation sum, the odd ones at 0
template <int64_t QT>
inline void sums0(const int32_t* xsum, int64_t nb, int64_t b, int r, __m512i& s0, __m512i& s1) {
  s0 = _mm512_set1_epi32(-bias(QT) * xsum[r * nb + b]);
  s1 = _mm512_setzero_si512();
}

// y + block b's float steps for one output from its two integer sums (sums0, then the products):
// their sum by d dx, then (Q4_1, Q5_1) + m times the activations' scaled sum. Every kernel folds
// with this, so one output gets the same bits from each.
template <int64_t QT>
inline __m512 fold(__m512 y, __m512i s0, __m512i s1, const Buf& p, int64_t b, const float* xd, const float* xs, int64_t i) {
  const __m512 d = _mm512_loadu_ps(p.d.data() + b * NR);
  y = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1)), _mm512_mul_ps(d, _mm512_set1_ps(xd[i])), y);
  if constexpr (has_m(QT)) y = _mm512_fmadd_ps(_mm512_loadu_ps(p.m.data() + b * NR), _mm512_set1_ps(xs[i]), y);
  return y;
}

// one output row's 16 lanes at p (mask: the columns kept), streamed where `stream` and the store
// is one whole line
inline void put16(float* p, __mmask16 mask, __m512 v, bool stream) {
  if (stream && mask == 0xFFFF && (reinterpret_cast<uintptr_t>(p) & 63) == 0) _mm512_stream_ps(p, v);
  else _mm512_mask_storeu_ps(p, mask, v);
}

// R activation rows x the panel: out[r * ldo + n] for the first `cols` of its NR rows
template <int64_t QT, int R>
void rows_vnni(const Buf& p, int64_t nb, const int8_t* xq, const float* xd, const float* xs,
               const int32_t* xsum, int64_t K, float* out, int64_t ldo, __mmask16 mask, ahead::Cursor& next) {
  __m512 y[R];
  for (int r = 0; r < R; ++r) y[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    next.step();
    const __m512i* u = reinterpret_cast<const __m512i*>(p.u.data() + b * 8 * NR * 4);
    const int8_t* x = xq + QK * b;
    __m512i s0[R], s1[R];  // even and odd quads (twice the chains)
    for (int r = 0; r < R; ++r) sums0<QT>(xsum, nb, b, r, s0[r], s1[r]);
    for (int j = 0; j < 4; ++j) {
      const int j0 = 2 * j, j1 = 2 * j + 1;
      const __m512i w0 = _mm512_loadu_si512(u + j0), w1 = _mm512_loadu_si512(u + j1);
      for (int r = 0; r < R; ++r) {
        s0[r] = dp(s0[r], w0, x + r * K + 4 * j0);
        s1[r] = dp(s1[r], w1, x + r * K + 4 * j1);
      }
    }
    for (int r = 0; r < R; ++r) y[r] = fold<QT>(y[r], s0[r], s1[r], p, b, xd, xs, r * nb + b);
  }
  for (int r = 0; r < R; ++r) put16(out + r * ldo, mask, y[r], p.stream);
}

constexpr int RB = 4;  // activation rows per register block

// the 4 activation bytes at p in every dword lane
inline __m512i quad512(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// R activation rows x P panels (1, or 2 as rows_vnni2: each activation quad broadcast once into
// a register for both), a km type: rows_scalar_km's arithmetic, 16 rows per lane set
template <int64_t QT, int R, int P>
void rows_vnni_km(const Buf* const* pb, int64_t nb, const Acts& a, float* const* out, int64_t ldo, const __mmask16* mask,
                  ahead::Cursor& next) {
  constexpr int64_t MP = mpairs(QT);
  const int64_t nsb = nb / 8;
  __m512 y[P][R];
  for (int q = 0; q < P; ++q)
    for (int r = 0; r < R; ++r) y[q][r] = _mm512_setzero_ps();
  for (int64_t sb = 0; sb < nsb; ++sb) {
    __m512 z[P][R];
    __m512i I[P][R];  // HALVES: the super-block's scaled sum
    // the chunk's two chains: even and odd quads (Q2_K: the super-block's), the halves types' halves
    __m512i s0[P][R], s1[P][R];
    for (int q = 0; q < P; ++q)
      for (int r = 0; r < R; ++r)
        z[q][r] = _mm512_setzero_ps(), I[q][r] = s0[q][r] = s1[q][r] = _mm512_setzero_si512();
    for (int64_t b = 8 * sb; b < 8 * sb + 8; ++b) {
      next.step();
      const int8_t* x = a.kq + QK * b;
      if constexpr (halved(QT))  // each half from -hbias times its activation sum
        for (int r = 0; r < R; ++r) {
          const int32_t* o = a.offsets(QT, r, b);
          const __m512i o0 = _mm512_set1_epi32(o[0]), o1 = _mm512_set1_epi32(o[1]);
          for (int q = 0; q < P; ++q) s0[q][r] = o0, s1[q][r] = o1;
        }
      else if constexpr (QT != Q2_K)
        if (b > 8 * sb)
          for (int q = 0; q < P; ++q)
            for (int r = 0; r < R; ++r) s0[q][r] = s1[q][r] = _mm512_setzero_si512();
      for (int j = 0; j < 4; ++j) {
        __m512i w0[P], w1[P];
        for (int q = 0; q < P; ++q) {
          const __m512i* u = reinterpret_cast<const __m512i*>(pb[q]->u.data() + b * 8 * NR * 4);
          w0[q] = _mm512_loadu_si512(u + quad<QT>(j, 0)), w1[q] = _mm512_loadu_si512(u + quad<QT>(j, 1));
        }
        for (int r = 0; r < R; ++r) {
          if constexpr (P == 1) {
            s0[0][r] = dp(s0[0][r], w0[0], x + r * a.K + 4 * quad<QT>(j, 0));
            s1[0][r] = dp(s1[0][r], w1[0], x + r * a.K + 4 * quad<QT>(j, 1));
          } else {
            const __m512i x0 = quad512(x + r * a.K + 4 * quad<QT>(j, 0)), x1 = quad512(x + r * a.K + 4 * quad<QT>(j, 1));
            for (int q = 0; q < P; ++q) {
              s0[q][r] = _mm512_dpbusd_epi32(s0[q][r], w0[q], x0);
              s1[q][r] = _mm512_dpbusd_epi32(s1[q][r], w1[q], x1);
            }
          }
        }
      }
      if constexpr (halved(QT))
        for (int q = 0; q < P; ++q) {
          const HalfScales sc(*pb[q], b);
          for (int r = 0; r < R; ++r) I[q][r] = sc.add(I[q][r], s0[q][r], s1[q][r]);
        }
      else if constexpr (QT != Q2_K)
        for (int q = 0; q < P; ++q) {
          const __m512 d = _mm512_loadu_ps(pb[q]->d.data() + b * NR);
          for (int r = 0; r < R; ++r) z[q][r] = _mm512_fmadd_ps(cvt(_mm512_add_epi32(s0[q][r], s1[q][r])), d, z[q][r]);
        }
    }
    if constexpr (QT == Q2_K)  // one d for the super-block's chunks: their sum in integers, one multiply
      for (int q = 0; q < P; ++q) {
        const __m512 d = _mm512_loadu_ps(pb[q]->d.data() + 8 * sb * NR);
        for (int r = 0; r < R; ++r) z[q][r] = _mm512_mul_ps(cvt(_mm512_add_epi32(s0[q][r], s1[q][r])), d);
      }
    for (int q = 0; q < P; ++q) {
      const __m512i* mn = reinterpret_cast<const __m512i*>(pb[q]->mn.data() + sb * MP * NR);
      const __m512 dm = _mm512_loadu_ps(pb[q]->dm.data() + sb * NR);  // (halves: d)
      for (int r = 0; r < R; ++r) {
        const __m512 kd = _mm512_set1_ps(a.kd[r * nsb + sb]);
        if constexpr (halved(QT)) {
          y[q][r] = _mm512_fmadd_ps(_mm512_mul_ps(cvt(I[q][r]), dm), kd, y[q][r]);
          continue;
        }
        const int32_t* ks = a.mins(QT, r, sb);
        __m512i M = _mm512_setzero_si512();
        for (int k = 0; k < MP; ++k) M = _mm512_dpwssd_epi32(M, _mm512_loadu_si512(mn + k), _mm512_set1_epi32(ks[k]));
        y[q][r] = _mm512_fmadd_ps(_mm512_fmadd_ps(cvt(M), dm, z[q][r]), kd, y[q][r]);
      }
    }
  }
  for (int q = 0; q < P; ++q)
    for (int r = 0; r < R; ++r) put16(out[q] + r * ldo, mask[q], y[q][r], pb[q]->stream);
}

// Two panels (32 weight rows) x R activation rows: each activation quad is broadcast once into a
// register for both panels' vpdpbusd (rows_vnni broadcasts it from memory for each: one load per
// vpdpbusd, and a core that runs two vpdpbusd a cycle is short of load ports), with the same
// integer sums and float steps per output as rows_vnni, so the same bits; every panel type (Q6_K
// with its two halves). Measured on an Intel Xeon (2 vpdpbusd a cycle), 2 threads, ns per
// multiply-add and thread, one panel / pairs, alternated: Q5_0 9728x896 0.0088 / 0.0085 at 24
// rows, 0.0080 / 0.0074 at 32, 0.0077 / 0.0070 at 40, 1 thread 0.0069 / 0.0055 at 256; Q8_0
// 16384x896 0.0083 / 0.0080 at 32, 0.0080 / 0.0076 at 40; Q4_1 4864x896 0.0086 / 0.0095 at 16,
// 0.0079 / 0.0075 at 40 (hence PAIR_ROWS there; the K-quants were not measured with pairs on it).
// On a Zen 5 EPYC (family 0x1A, full-width AVX-512), 2 threads, 8960x1536, ps per multiply-add
// and thread, min of 9 alternated, one panel / pairs: Q4_K 9.34 / 7.53 at 8 rows, 6.47 / 5.09 at
// 16, 5.46 / 4.39 at 40; Q6_K 9.80 / 7.14 at 16, 8.28 / 5.79 at 40; Q5_0 11.28 / 9.69 at 8, 6.23
// / 4.62 at 40; Q8_0 17.24 / 16.04 at 4, 11.75 / 10.10 at 8: pairs from the first row there. The
// 1.5B Q4_K + Q6_K file's 40-row int8 step 239 / 278 / 238 -> 212 / 218 / 186 ms (alternated).
template <int64_t QT, int R>
void rows_vnni2(const Buf& pa, const Buf& pb, int64_t nb, const int8_t* xq, const float* xd, const float* xs,
                const int32_t* xsum, int64_t K, float* oa, float* ob, int64_t ldo, __mmask16 ma, __mmask16 mb,
                ahead::Cursor& next) {
  __m512 ya[R], yb[R];
  for (int r = 0; r < R; ++r) ya[r] = yb[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    next.step();
    const __m512i* ua = reinterpret_cast<const __m512i*>(pa.u.data() + b * 8 * NR * 4);
    const __m512i* ub = reinterpret_cast<const __m512i*>(pb.u.data() + b * 8 * NR * 4);
    const int8_t* x = xq + QK * b;
    __m512i a0[R], a1[R], b0[R], b1[R];
    for (int r = 0; r < R; ++r) {
      sums0<QT>(xsum, nb, b, r, a0[r], a1[r]);
      b0[r] = a0[r], b1[r] = a1[r];
    }
    for (int j = 0; j < 4; ++j) {  // both panels per broadcast
      const int j0 = 2 * j, j1 = 2 * j + 1;
      const __m512i wa0 = _mm512_loadu_si512(ua + j0), wa1 = _mm512_loadu_si512(ua + j1);
      const __m512i wb0 = _mm512_loadu_si512(ub + j0), wb1 = _mm512_loadu_si512(ub + j1);
      for (int r = 0; r < R; ++r) {
        const __m512i x0 = quad512(x + r * K + 4 * j0), x1 = quad512(x + r * K + 4 * j1);
        a0[r] = _mm512_dpbusd_epi32(a0[r], wa0, x0);
        b0[r] = _mm512_dpbusd_epi32(b0[r], wb0, x0);
        a1[r] = _mm512_dpbusd_epi32(a1[r], wa1, x1);
        b1[r] = _mm512_dpbusd_epi32(b1[r], wb1, x1);
      }
    }
    for (int r = 0; r < R; ++r) {
      ya[r] = fold<QT>(ya[r], a0[r], a1[r], pa, b, xd, xs, r * nb + b);
      yb[r] = fold<QT>(yb[r], b0[r], b1[r], pb, b, xd, xs, r * nb + b);
    }
  }
  for (int r = 0; r < R; ++r) {
    put16(oa + r * ldo, ma, ya[r], pa.stream);
    put16(ob + r * ldo, mb, yb[r], pb.stream);
  }
}

template <int64_t QT>
void panel_vnni2(const uint8_t* const* ra, const uint8_t* const* rb2, int64_t T, const Acts& a, float* oa, float* ob,
                 int64_t ldo, int64_t cols_b, Buf& bufa, Buf& bufb, const ahead::Ranges& next) {
  unpack_vnni<QT>(Rows(ra), a.nb, bufa);
  unpack_vnni<QT>(Rows(rb2), a.nb, bufb);
  const __mmask16 mb = static_cast<__mmask16>((1u << cols_b) - 1);
  ahead::Cursor cur(next, (T + RB - 1) / RB * a.nb);  // (a step per block of each group)
  by_groups<RB>(T, [&](auto r, int64_t t) {
    const Acts s = a.at(t);
    if constexpr (km(QT)) {
      const Buf* pb[2] = {&bufa, &bufb};
      float* o[2] = {oa + t * ldo, ob + t * ldo};
      const __mmask16 m[2] = {0xFFFF, mb};
      rows_vnni_km<QT, decltype(r)::value, 2>(pb, s.nb, s, o, ldo, m, cur);
    } else {
      rows_vnni2<QT, decltype(r)::value>(bufa, bufb, s.nb, s.q, s.d, s.s, s.sum, s.K, oa + t * ldo, ob + t * ldo,
                                         ldo, 0xFFFF, mb, cur);
    }
  });
}

void panel_vnni2(int64_t qt, const uint8_t* const* ra, const uint8_t* const* rb2, int64_t T, const Acts& a, float* oa,
                 float* ob, int64_t ldo, int64_t cols_b, Buf& bufa, Buf& bufb, const ahead::Ranges& next) {
  with_panel_type(qt, [&](auto q) { panel_vnni2<decltype(q)::value>(ra, rb2, T, a, oa, ob, ldo, cols_b, bufa, bufb, next); });
}

template <int64_t QT, int R>
void rows_at(const Buf& buf, const Acts& a, float* out, int64_t ldo, __mmask16 mask, ahead::Cursor& next) {
  if constexpr (km(QT)) {
    const Buf* pb[1] = {&buf};
    float* o[1] = {out};
    rows_vnni_km<QT, R, 1>(pb, a.nb, a, o, ldo, &mask, next);
  } else {
    rows_vnni<QT, R>(buf, a.nb, a.q, a.d, a.s, a.sum, a.K, out, ldo, mask, next);
  }
}

template <int64_t QT>
void panel_vnni(const uint8_t* const* rows, int64_t T, const Acts& a, float* out, int64_t ldo, int64_t cols,
                Buf& buf, const ahead::Ranges& next) {
  unpack_vnni<QT>(Rows(rows), a.nb, buf);
  const __mmask16 mask = static_cast<__mmask16>((1u << cols) - 1);
  ahead::Cursor cur(next, (T + RB - 1) / RB * a.nb);  // (a step per block of each group)
  by_groups<RB>(T, [&](auto r, int64_t t) { rows_at<QT, decltype(r)::value>(buf, a.at(t), out + t * ldo, ldo, mask, cur); });
}

void panel_vnni(int64_t qt, const uint8_t* const* rows, int64_t T, const Acts& a, float* out, int64_t ldo,
                int64_t cols, Buf& buf, const ahead::Ranges& next) {
  with_panel_type(qt, [&](auto q) { panel_vnni<decltype(q)::value>(rows, T, a, out, ldo, cols, buf, next); });
}

// --- The panel layout kept from load (r16, batch_weights="panel") ---------------------------------
//
// unpack_vnni above rebuilds every panel on every call: 16 rows' bytes gathered and transposed by
// dwords, then decoded into one byte per weight (4x a Q4_K panel's bytes), before the products
// can start. At 40 rows that was a quarter of a decode step (1.5B Q4_K + Q6_K, Zen 4, perf:
// unpack 26% of the step's samples, the products 61%). r16 keeps the transposed form itself, built
// once at load (r16_pack) beside the file's rows: per panel of 16 rows, each super-block's header
// then each one's quants (HDR, QB above), dword w of row n at byte (16 w + n) * 4 of its part, so
// that one load gives 4 bytes of 16 rows; the same bytes as the 16 blocks. The products decode
// their u from it in registers (a mask, or a shift and a mask, per 64 bytes, shared by the
// activation rows of a group); only the per-chunk scales are decoded per call, once per panel.
// The arithmetic per output is the panel's, operation for operation: the same bits as panel() on
// the file's rows (tested against its scalar code). Zen 4, 2 threads, 1.5B Q4_K + Q6_K file,
// interleaved medians, file -> kept: Q6_K 151936 x 1536 at 40 rows 51.8 -> 47.1 ms, Q4_K (the
// same shape) 40.3 -> 34.8; the 40-row decode step 307 / 294 -> 277 / 269 ms. One row stays on
// the row kernels (from DRAM, one Q6_K row streamed at 0.63-0.88x of theirs).

// dword w (16 rows) of a record
inline __attribute__((always_inline)) __m512i rdw(const uint8_t* rec, int w) { return _mm512_loadu_si512(rec + 64 * w); }

// quad k (0..7) of chunk j (0..7) of a super-block's quants: 16 rows' u (unpack_vnni's values)
template <int64_t QT>
inline __attribute__((always_inline)) __m512i r16_u(const uint8_t* qs, int j, int k) {
  if constexpr (QT == Q4_K) {
    return nib(rdw(qs, 8 * (j / 2) + k), j % 2);
  } else if constexpr (QT == Q5_K) {  // qh at dwords 0-7, qs at 8-39
    return _mm512_or_si512(nib(rdw(qs, 8 + 8 * (j / 2) + k), j % 2), bit_to_4(rdw(qs, k), j));
  } else {
    static_assert(QT == Q6_K, "not an r16 type");
    const int hh = j / 4, jj = j % 4;  // ql dwords 16 hh + 8 (jj % 2) + k, nibble jj / 2; qh 32 + 8 hh + k
    const __m512i ql = rdw(qs, q6_pos(16 * hh + 8 * (jj % 2) + k)), qh = rdw(qs, q6_pos(32 + 8 * hh + k));
    const __m512i lo = _mm512_and_si512(jj / 2 ? _mm512_srli_epi16(ql, 4) : ql, lo4());
    const int sh = 4 - 2 * jj;  // qh bits 2 jj, 2 jj + 1 -> bits 4, 5
    const __m512i hb = sh > 0 ? _mm512_slli_epi16(qh, sh) : sh < 0 ? _mm512_srli_epi16(qh, -sh) : qh;
    return _mm512_or_si512(lo, _mm512_and_si512(hb, _mm512_set1_epi8(0x30)));
  }
}

// f(std::integral_constant<int, j>{}) for the chunks j = 0..7 of a super-block, in order (j a
// constant in each: the decode's shifts and offsets fold into the instructions; with j a loop
// variable, 1.5B Q6_K 151936 x 1536 at 40 rows ran 53.6 ms against 50.3)
template <class F>
inline __attribute__((always_inline)) void chunks8(const F& f) {
  [&]<int... J>(std::integer_sequence<int, J...>) { (f(std::integral_constant<int, J>{}), ...); }(std::make_integer_sequence<int, 8>{});
}

// a panel's per-chunk scales (Buf's d, m, mn, dm) from its headers
template <int64_t QT>
void r16_scales(const uint8_t* panel, int64_t nsb, Buf& buf) {
  for (int64_t sb = 0; sb < nsb; ++sb) {
    const uint8_t* h = panel + sb * HDR<QT>;
    if constexpr (QT == Q6_K) {
      const __m512i s[4] = {rdw(h, 0), rdw(h, 1), rdw(h, 2), rdw(h, 3)};
      const __m512 dd = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + 64 * 4)));
      scales_q6(s, dd, sb, buf);
    } else {
      const __m512i t[4] = {rdw(h, 0), rdw(h, 1), rdw(h, 2), rdw(h, 3)};
      scales_k4(t, buf.d.data() + 8 * sb * NR, buf.mn.data() + 4 * sb * NR, buf.dm.data() + sb * NR);
    }
  }
}

// R activation rows x a km panel (rows_vnni_km's arithmetic, P = 1)
template <int64_t QT, int R>
void rows_r16_km(const uint8_t* recs, const Buf& p, const Acts& a, float* out, int64_t ldo, __mmask16 mask,
                 ahead::Cursor& next) {
  constexpr int64_t MP = mpairs(QT);
  const int64_t nsb = a.nb / 8;
  __m512 y[R];
  for (int r = 0; r < R; ++r) y[r] = _mm512_setzero_ps();
  for (int64_t sb = 0; sb < nsb; ++sb) {
    const uint8_t* rec = recs + nsb * HDR<QT> + sb * QB<QT>;
    __m512 z[R];
    __m512i I[R];  // HALVES: the super-block's scaled sum
    for (int r = 0; r < R; ++r) z[r] = _mm512_setzero_ps(), I[r] = _mm512_setzero_si512();
    chunks8([&](auto jc) {
      constexpr int j = decltype(jc)::value;
      const int64_t b = 8 * sb + j;
      next.step();
      const int8_t* x = a.kq + QK * b;
      __m512i s0[R], s1[R];  // even and odd quads, or the halves (two chains: from -hbias s_h)
      for (int r = 0; r < R; ++r)
        if constexpr (halved(QT)) {
          const int32_t* o = a.offsets(QT, r, b);
          s0[r] = _mm512_set1_epi32(o[0]), s1[r] = _mm512_set1_epi32(o[1]);
        } else {
          s0[r] = s1[r] = _mm512_setzero_si512();
        }
      for (int q = 0; q < 4; ++q) {
        const __m512i w0 = r16_u<QT>(rec, j, quad<QT>(q, 0)), w1 = r16_u<QT>(rec, j, quad<QT>(q, 1));
        for (int r = 0; r < R; ++r) {
          s0[r] = dp(s0[r], w0, x + r * a.K + 4 * quad<QT>(q, 0));
          s1[r] = dp(s1[r], w1, x + r * a.K + 4 * quad<QT>(q, 1));
        }
      }
      if constexpr (halved(QT)) {
        const HalfScales sc(p, b);
        for (int r = 0; r < R; ++r) I[r] = sc.add(I[r], s0[r], s1[r]);
      } else {
        const __m512 d = _mm512_loadu_ps(p.d.data() + b * NR);
        for (int r = 0; r < R; ++r) z[r] = _mm512_fmadd_ps(cvt(_mm512_add_epi32(s0[r], s1[r])), d, z[r]);
      }
    });
    const __m512i* mn = reinterpret_cast<const __m512i*>(p.mn.data() + sb * MP * NR);
    const __m512 dm = _mm512_loadu_ps(p.dm.data() + sb * NR);
    for (int r = 0; r < R; ++r) {
      const __m512 kd = _mm512_set1_ps(a.kd[r * nsb + sb]);
      if constexpr (halved(QT)) {
        y[r] = _mm512_fmadd_ps(_mm512_mul_ps(cvt(I[r]), dm), kd, y[r]);
        continue;
      }
      const int32_t* ks = a.mins(QT, r, sb);
      __m512i M = _mm512_setzero_si512();
      for (int k = 0; k < MP; ++k) M = _mm512_dpwssd_epi32(M, _mm512_loadu_si512(mn + k), _mm512_set1_epi32(ks[k]));
      y[r] = _mm512_fmadd_ps(_mm512_fmadd_ps(cvt(M), dm, z[r]), kd, y[r]);
    }
  }
  for (int r = 0; r < R; ++r) put16(out + r * ldo, mask, y[r], p.stream);
}

template <int64_t QT>
void panel_r16(const uint8_t* recs, int64_t T, const Acts& a, float* out, int64_t ldo, int64_t cols, Buf& buf,
               const ahead::Ranges& next) {
  r16_scales<QT>(recs, a.nb / 8, buf);
  const __mmask16 mask = static_cast<__mmask16>((1u << cols) - 1);
  ahead::Cursor cur(next, (T + RB - 1) / RB * a.nb);  // the next panel fetched a part per chunk of each group
  by_groups<RB>(T, [&](auto r, int64_t t) {
    rows_r16_km<QT, decltype(r)::value>(recs, buf, a.at(t), out + t * ldo, ldo, mask, cur);
  });
}

void panel_r16(int64_t qt, const uint8_t* recs, int64_t T, const Acts& a, float* out, int64_t ldo, int64_t cols,
               Buf& buf, const ahead::Ranges& next) {
  if (qt == Q4_K) return panel_r16<Q4_K>(recs, T, a, out, ldo, cols, buf, next);
  if (qt == Q5_K) return panel_r16<Q5_K>(recs, T, a, out, ldo, cols, buf, next);
  panel_r16<Q6_K>(recs, T, a, out, ldo, cols, buf, next);
}
#pragma GCC pop_options
#else
bool cpu_has_vnni() { return false; }
#endif

// From how many activation rows impl 0 takes two panels at a time (rows_vnni2): where the CPU
// runs 512-bit vpdpbusd at full width, an Intel core (from PAIR_ROWS) or AMD's Zen 5 and later
// (cpuid family 0x1A on: from the panel's first row); never on Zen 4 (double-pumped 512 bits:
// 2 threads, 8960 x 1536, pairs / one panel at 16 and 40 rows, medians of 15 alternated: Q5_0
// 1.01 / 1.08, Q8_0 0.96 / 1.01, Q4_0 1.00 / 1.04, Q4_K 1.02 / 1.01, Q6_K 0.99 / 0.99; Q8_0
// 151936 x 1536 1.02 / 1.04).
int64_t pair_rows() {
#ifdef PANEL_X86
  static const int64_t rows = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid(0, &a, &b, &c, &d)) return INT64_MAX;
    if (b == 0x756e6547 && d == 0x49656e69 && c == 0x6c65746e) return PAIR_ROWS;  // "GenuineIntel"
    const bool amd = b == 0x68747541 && d == 0x69746e65 && c == 0x444d4163;  // "AuthenticAMD"
    if (!amd || !__get_cpuid(1, &a, &b, &c, &d)) return INT64_MAX;
    const unsigned base = (a >> 8) & 0xF, family = base == 0xF ? base + ((a >> 20) & 0xFF) : base;
    return family >= 0x1A ? int64_t{1} : INT64_MAX;
  }();
  return rows;
#else
  return INT64_MAX;
#endif
}

bool vnni() {  // within the library's ISA limit (isa.h)
  static const bool has = cpu_has_vnni();
  return has && isa::limit() >= 2;
}

bool avx2() { return !vnni() && a8::use_avx2(0); }  // impl 0 runs the AVX2 code

// the weight rows of a panel, to fetch towards L2 (a panel is unpacked once and computed for a
// while: fetching the next one meanwhile hides most of its memory latency)
void ahead_of(at::TensorList ws, std::pair<int64_t, int64_t> panel, int64_t nr, ahead::Ranges& next) {
  const at::Tensor& w = ws[panel.first];
  const int64_t rb = w.size(1), rows = std::min<int64_t>(nr, w.size(0) - panel.second);
  next.add(w.data_ptr<uint8_t>() + panel.second * rb, rows * rb);
}

// A call's activations, quantized once: per 32 (xq, d, s, each block's integer sum) where a
// segment is not a km type, the half sums where one is Q6_K or Q3_K, and per 256 (kq, kd, ks;
// ks16 for Q2_K) where a segment is a km type. Built in place (acts points into the vectors).
struct Prep {
  std::vector<int8_t> xq, kq;
  std::vector<float> xds, kd;  // xds: d, then s
  std::vector<int32_t> xsum, ks, ks16, hb[2], xb[2];
  Acts acts;
  Prep(const at::Tensor& x, at::IntArrayRef qtypes, int64_t impl) {
    const int64_t T = x.size(0), K = x.size(1), nb = K / QK, nsb = nb / 8;
    if (!std::all_of(qtypes.begin(), qtypes.end(), km)) {
      xq.resize(T * K), xds.resize(2 * T * nb), xsum.resize(T * nb);
      a8::quantize_blocks(x.data_ptr<float>(), xq.data(), xds.data(), xds.data() + T * nb, T * nb, impl, xsum.data());
      for (int h = 0; h < 2; ++h)  // each block's -bias * sum, once a call (not in the panels' loops)
        if (std::find(qtypes.begin(), qtypes.end(), h ? Q5_0 : Q4_0) != qtypes.end()) {
          xb[h].resize(T * nb);
          for (int64_t i = 0; i < T * nb; ++i) xb[h][i] = -bias(h ? Q5_0 : Q4_0) * xsum[i];
        }
    }
    if (std::any_of(qtypes.begin(), qtypes.end(), km)) {
      std::vector<int16_t> bs(16 * T * nsb);
      kq.resize(T * K), kd.resize(T * nsb), ks.resize(4 * T * nsb);
      a8::quantize_sb(x.data_ptr<float>(), kq.data(), kd.data(), bs.data(), T * nsb, impl == 1 ? 1 : 0);
      for (int64_t i = 0; i < 4 * T * nsb; ++i) {  // chunk sums 2k, 2k + 1 of each super-block, paired
        const int32_t s0 = bs[4 * i] + bs[4 * i + 1], s1 = bs[4 * i + 2] + bs[4 * i + 3];
        ks[i] = pair(s0, s1);
      }
      for (int h = 0; h < 2; ++h)  // the halves' sums times -hbias: Q6_K's, Q3_K's
        if (std::find(qtypes.begin(), qtypes.end(), h ? Q3_K : Q6_K) != qtypes.end()) {
          hb[h].resize(2 * T * nb);
          for (int64_t i = 0; i < 2 * T * nb; ++i) hb[h][i] = -hbias(h ? Q3_K : Q6_K) * bs[i];
        }
      if (std::any_of(qtypes.begin(), qtypes.end(), [](int64_t q) { return q == Q2_K || q == Q3_K; })) {
        ks16.resize(8 * T * nsb);  // each 16 elements' sum, paired (Q2_K; Q3_K's AVX2 offsets)
        for (int64_t i = 0; i < 8 * T * nsb; ++i) ks16[i] = pair(bs[2 * i], bs[2 * i + 1]);
      }
    }
    acts = {xq.data(), xds.data(), xq.empty() ? nullptr : xds.data() + T * nb, xsum.data(), K, nb,
            kq.data(), kd.data(), ks.data(), ks16.data(), {hb[0].data(), hb[1].data()}, {xb[0].data(), xb[1].data()}};
  }
  static int32_t pair(int32_t lo, int32_t hi) {  // two int16 values in a dword (lo | hi << 16)
    return static_cast<int32_t>((static_cast<uint32_t>(lo) & 0xFFFF) | static_cast<uint32_t>(hi) << 16);
  }
  Prep(const Prep&) = delete;
};

void panel(const at::Tensor& x, at::TensorList ws, at::IntArrayRef qtypes, at::Tensor& out, int64_t impl) {
  const std::vector<int64_t> first = a8::check_segments(x, ws, qtypes, out, /*panel=*/true);
  const int64_t T = x.size(0), K = x.size(1), nb = K / QK, N = first.back();
  if (T == 0 || N == 0) return;
  const Prep prep(x, qtypes, impl);
  const Acts& acts = prep.acts;
  const bool fast = (impl == 0 || impl == 3) && vnni();
  const bool pairs = fast && (impl == 3 || T >= pair_rows());  // rows_vnni2
  const bool avx2 = !fast && a8::use_avx2(impl);
  const int64_t nr = avx2 ? NR2 : NR;  // rows per panel
  // the panels: (segment, first row), never across segments
  std::vector<std::pair<int64_t, int64_t>> panels;
  for (size_t i = 0; i < ws.size(); ++i)
    for (int64_t n = 0; n < ws[i].size(0); n += nr) panels.emplace_back(static_cast<int64_t>(i), n);
  float* op = out.data_ptr<float>();
  const int64_t np = static_cast<int64_t>(panels.size());
  struct Bufs {
    Buf a, b;
  };
  const bool stream = out_store::stream(T, N);
  auto buffer = [&] {
    Bufs b;
    b.a.size(nb);
    b.b.size(nb);
    b.a.stream = b.b.stream = stream;
    return b;
  };
  auto run = [&](Bufs& bufs, int64_t p0, int64_t p1) {
    Buf& buf = bufs.a;
    for (int64_t pi = p0; pi < p1; ++pi) {
      const auto [seg, n0] = panels[pi];
      const at::Tensor& w = ws[seg];
      const int64_t rb = w.size(1), cols = std::min<int64_t>(nr, w.size(0) - n0);
      const uint8_t* base = w.data_ptr<uint8_t>();
      float* o = op + first[seg] + n0;
      auto rows_from = [&](int64_t r0, int64_t c, const uint8_t** out) {  // past the segment's end: its last row again
        for (int64_t n = 0; n < nr; ++n) out[n] = base + (r0 + std::min(n, c - 1)) * rb;
      };
      const uint8_t* rows[NR];
      rows_from(n0, cols, rows);
      const bool vnni_ok = fast && NR * rb <= INT32_MAX;  // (Rows' gathers take int32 offsets)
      // two panels of one segment at once, the first whole: VNNI pairs, the AVX2 pair types
      const bool two = cols == nr && pi + 1 < p1 && panels[pi + 1].first == seg &&
                       (vnni_ok ? pairs : avx2 && pair_avx2(qtypes[seg]));
      const int64_t n1 = two ? panels[pi + 1].second : 0, cols_b = two ? std::min<int64_t>(nr, w.size(0) - n1) : 0;
      const uint8_t* rows_b[NR];
      if (two) rows_from(n1, cols_b, rows_b);
      float* o_b = op + first[seg] + n1;
      ahead::Ranges next;  // the next panel (two) from memory while this one (two) compute
      for (int64_t k = pi + 1 + two; k < std::min(p1, pi + 2 + 2 * two); ++k) ahead_of(ws, panels[k], nr, next);
#ifdef PANEL_X86
      if (vnni_ok) {
        if (two) panel_vnni2(qtypes[seg], rows, rows_b, T, acts, o, o_b, N, cols_b, bufs.a, bufs.b, next);
        else panel_vnni(qtypes[seg], rows, T, acts, o, N, cols, buf, next);
        pi += two;
        continue;
      }
#endif
#ifdef PQ_AVX2
      if (avx2) {
        if (two) panel_avx2x2(qtypes[seg], rows, rows_b, T, acts, o, o_b, N, cols_b, bufs.a, bufs.b, next);
        else panel_avx2(qtypes[seg], rows, T, acts, o, N, cols, buf, next);
        pi += two;
        continue;
      }
#endif
      unpack_scalar(qtypes[seg], base + n0 * rb, rb, cols, nb, buf);
      if (km(qtypes[seg])) rows_scalar_km(qtypes[seg], buf, nb, T, acts, o, N, cols);
      else rows_scalar(qtypes[seg], buf, nb, T, acts.q, acts.d, acts.s, acts.sum, K, o, N, cols);
    }
    out_store::fence(stream);
  };
  split::chunks(np, split::chunk_for(np, 8), buffer, run);
}

// --- r16 ops ---------------------------------------------------------------------------------------

bool r16_type(int64_t qt) { return qt == Q4_K || qt == Q5_K || qt == Q6_K; }

inline int64_t r16_block(int64_t qt) {
  return qt == Q4_K ? sizeof(BlockQ4_K) : qt == Q5_K ? sizeof(BlockQ5_K) : sizeof(BlockQ6_K);
}

// w [N, rb] u8 (rows of an r16 type) -> [ceil(N / 16), super-blocks * 16 * block bytes] u8, each
// panel of 16 rows laid out as HDR / QB above (rows past N: zero bytes, never stored by r16)
at::Tensor r16_pack(const at::Tensor& w, int64_t qt) {
  TORCH_CHECK(r16_type(qt), "r16_pack: not an r16 type: ", qt);
  const int64_t B = r16_block(qt);
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous() && w.size(1) > 0 &&
                  w.size(1) % B == 0,
              "r16_pack: w must be a contiguous uint8 [N, super-blocks * ", B, "] tensor");
  const int64_t N = w.size(0), rb = w.size(1), nsb = rb / B, P = (N + NR - 1) / NR;
  // a block's 4 header dwords (from byte h0) and its quant dwords (from byte q0); Q6_K's d at 208
  const bool q6 = qt == Q6_K;
  const int64_t h0 = q6 ? 192 : 0, q0 = q6 ? 0 : 16, nq = (B - 16 - (q6 ? 2 : 0)) / 4;
  const int64_t hdr = q6 ? HDR<Q6_K> : HDR<Q4_K>;
  at::Tensor out = at::empty({P, nsb * NR * B}, w.options());
  const uint8_t* src = w.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    static const uint8_t zeros[256] = {};
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t sb = 0; sb < nsb; ++sb) {
        uint8_t* h = dst + p * nsb * NR * B + sb * hdr;
        uint8_t* q = dst + p * nsb * NR * B + nsb * hdr + sb * NR * 4 * nq;
        for (int64_t n = 0; n < NR; ++n) {
          const int64_t row = p * NR + n;
          const uint8_t* b = row < N ? src + row * rb + sb * B : zeros;
          for (int64_t k = 0; k < 4; ++k) std::memcpy(h + (NR * k + n) * 4, b + h0 + 4 * k, 4);
          if (q6) std::memcpy(h + NR * 16 + 2 * n, b + 208, 2);
          for (int64_t k = 0; k < nq; ++k) {
            const int64_t at = q6 ? q6_pos(static_cast<int>(k)) : k;
            std::memcpy(q + (NR * at + n) * 4, b + q0 + 4 * k, 4);
          }
        }
      }
  });
  return out;
}

// out [T, sum ns] = x W^T in int8 for weights kept as r16 records (packs[i]: r16_pack of a
// segment of ns[i] rows of type qtypes[i]): panel()'s results, bit for bit. AVX-512 VNNI only.
void matmul_r16(const at::Tensor& x, at::TensorList packs, at::IntArrayRef qtypes, at::IntArrayRef ns, at::Tensor& out) {
  TORCH_CHECK(vnni(), "panel_r16: this CPU (or the ISA limit) has no AVX-512 VNNI");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.size(1) > 0 &&
                  x.size(1) % QK_K == 0,
              "x must be a contiguous float32 [T, K] tensor, K a multiple of 256");
  TORCH_CHECK(!packs.empty() && packs.size() == qtypes.size() && packs.size() == ns.size(),
              "panel_r16: one qtype and row count per segment");
  const int64_t T = x.size(0), K = x.size(1), nsb = K / QK_K;
  std::vector<int64_t> first{0};
  for (size_t i = 0; i < packs.size(); ++i) {
    TORCH_CHECK(r16_type(qtypes[i]), "panel_r16: not an r16 type: ", qtypes[i]);
    TORCH_CHECK(ns[i] >= 0 && packs[i].dim() == 2 && packs[i].scalar_type() == at::kByte && packs[i].is_contiguous() &&
                    packs[i].size(0) == (ns[i] + NR - 1) / NR && packs[i].size(1) == nsb * NR * r16_block(qtypes[i]),
                "panel_r16: segment ", i, " is not the r16 records of ", ns[i], " rows of ", K, " elements");
    first.push_back(first.back() + ns[i]);
  }
  const int64_t N = first.back();
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == at::kFloat && out.is_contiguous() && out.size(0) == T &&
                  out.size(1) == N,
              "out must be a contiguous float32 [T, N] tensor");
  if (T == 0 || N == 0) return;
#ifdef PANEL_X86
  const Prep prep(x, qtypes, 0);
  std::vector<std::pair<int64_t, int64_t>> panels;  // (segment, panel)
  for (size_t i = 0; i < packs.size(); ++i)
    for (int64_t p = 0; p < packs[i].size(0); ++p) panels.emplace_back(static_cast<int64_t>(i), p);
  auto recs_of = [&](std::pair<int64_t, int64_t> pp) {
    const at::Tensor& w = packs[pp.first];
    return w.data_ptr<uint8_t>() + pp.second * w.size(1);
  };
  float* op = out.data_ptr<float>();
  const int64_t np = static_cast<int64_t>(panels.size()), nb = K / QK;
  const bool stream = out_store::stream(T, N);
  auto buffer = [&] {
    Buf b;
    b.scales(nb);
    b.stream = stream;
    return b;
  };
  auto run = [&](Buf& buf, int64_t p0, int64_t p1) {
    for (int64_t pi = p0; pi < p1; ++pi) {
      const auto [seg, p] = panels[pi];
      ahead::Ranges next;  // from memory while this one computes
      if (pi + 1 < p1) next.add(recs_of(panels[pi + 1]), packs[panels[pi + 1].first].size(1));
      const int64_t cols = std::min<int64_t>(NR, ns[seg] - p * NR);
      panel_r16(qtypes[seg], recs_of(panels[pi]), T, prep.acts, op + first[seg] + p * NR, N, cols, buf, next);
    }
    out_store::fence(stream);
  };
  split::chunks(np, split::chunk_for(np, 8), buffer, run);
#endif
}
}  // namespace panel

TORCH_LIBRARY_FRAGMENT(pagedkv_a8, m) {
  m.def("panel(Tensor x, Tensor[] ws, int[] qtypes, Tensor(a!) out, int impl) -> ()");
  m.def("panel_vnni() -> bool", &panel::vnni);
  m.def("r16_pack(Tensor w, int qtype) -> Tensor");
  m.def("panel_r16(Tensor x, Tensor[] packs, int[] qtypes, int[] ns, Tensor(a!) out) -> ()");
  m.def("panel_avx2() -> bool", &panel::avx2);
}

TORCH_LIBRARY_IMPL(pagedkv_a8, CPU, m) {
  m.impl("panel", &panel::panel);
  m.impl("r16_pack", &panel::r16_pack);
  m.impl("panel_r16", &panel::matmul_r16);
}
