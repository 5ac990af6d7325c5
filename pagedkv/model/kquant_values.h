// The quant values of a K-quant (or IQ4_XS) super-block's sub-blocks, before any scale: the one
// decoder the int8-activation kernels share (qmatmul_a8x.cpp's row kernel, qmatmul_panel.cpp's
// panel). u_of: one element, scalar; chunk (AVX2): a sub-block's 32 values as bytes.
#pragma once

#include <cstdint>

#include "ggml_blocks.h"
#include "vec.h"

namespace kq {

using namespace ggml;

// u of element e (0..255) of a super-block
template <int64_t QT>
inline int u_of(const uint8_t* b, int e) {
  const int j = e / 32, i = e % 32;
  if constexpr (QT == Q4_K) {
    return (reinterpret_cast<const BlockQ4_K*>(b)->qs[32 * (j / 2) + i] >> (4 * (j % 2))) & 0x0F;
  } else if constexpr (QT == Q5_K) {
    const auto& h = *reinterpret_cast<const BlockQ5_K*>(b);
    return ((h.qs[32 * (j / 2) + i] >> (4 * (j % 2))) & 0x0F) | (((h.qh[i] >> j) & 1) << 4);
  } else if constexpr (QT == Q2_K) {
    return (reinterpret_cast<const BlockQ2_K*>(b)->qs[32 * (j / 4) + i] >> (2 * (j % 4))) & 0x03;
  } else if constexpr (QT == Q6_K) {
    const auto& h = *reinterpret_cast<const BlockQ6_K*>(b);
    const int hh = j / 4, jj = j % 4;
    const int lo = (h.ql[64 * hh + 32 * (jj % 2) + i] >> (4 * (jj / 2))) & 0x0F;
    return lo | (((h.qh[32 * hh + i] >> (2 * jj)) & 0x03) << 4);
  } else if constexpr (QT == Q3_K) {
    const auto& h = *reinterpret_cast<const BlockQ3_K*>(b);
    return ((h.qs[32 * (j / 4) + i] >> (2 * (j % 4))) & 0x03) | (((h.hmask[i] >> j) & 1) << 2);
  } else {
    return IQ4_LEVELS[nibble(reinterpret_cast<const BlockIQ4_XS*>(b)->qs + 16 * j, i)];
  }
}

#ifdef PQ_AVX2
// the 32 u of chunk j (0..7) of super-block b, bytes in element order (IQ4_XS: signed)
template <int64_t QT>
PQ_INLINE __m256i chunk(const uint8_t* b, int j) {
  if constexpr (QT == Q4_K) {
    return vec::bits(reinterpret_cast<const BlockQ4_K*>(b)->qs + 32 * (j / 2), 4 * (j % 2), 0x0F);
  } else if constexpr (QT == Q5_K) {
    const auto& h = *reinterpret_cast<const BlockQ5_K*>(b);
    return _mm256_or_si256(vec::bits(h.qs + 32 * (j / 2), 4 * (j % 2), 0x0F),
                           vec::bit_at(h.qh, j, 4));
  } else if constexpr (QT == Q2_K) {
    return vec::bits(reinterpret_cast<const BlockQ2_K*>(b)->qs + 32 * (j / 4), 2 * (j % 4), 0x03);
  } else if constexpr (QT == Q6_K) {
    const auto& h = *reinterpret_cast<const BlockQ6_K*>(b);
    const int hh = j / 4, jj = j % 4;
    const __m256i lo = vec::bits(h.ql + 64 * hh + 32 * (jj % 2), 4 * (jj / 2), 0x0F);
    return _mm256_or_si256(lo, _mm256_slli_epi16(vec::bits(h.qh + 32 * hh, 2 * jj, 0x03), 4));
  } else if constexpr (QT == Q3_K) {
    const auto& h = *reinterpret_cast<const BlockQ3_K*>(b);
    return _mm256_or_si256(vec::bits(h.qs + 32 * (j / 4), 2 * (j % 4), 0x03),
                           vec::bit_at(h.hmask, j, 2));
  } else {
    return vec::lookup16(IQ4_LEVELS, vec::nibbles(reinterpret_cast<const BlockIQ4_XS*>(b)->qs + 16 * j));
  }
}

#endif

}  // namespace kq
