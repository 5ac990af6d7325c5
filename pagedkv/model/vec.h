// Vector-width traits for the kernels written once over them (qmatmul_simd.inc): V8 is AVX2's
// 8 float lanes, V16 AVX-512's 16. A 32-weight chunk is NV = 32 / L vectors; vector k holds
// elements L k .. L k + L - 1. Byte-level unpacking (nibbles, high bits, lookups) is done on
// the 32 quants of a chunk at once in one __m256i (element order), shared by both widths, and
// widened to int32 lanes by i8 / u8.
//
// V16's functions carry AVX-512 target attributes; a translation unit that instantiates kernels
// with V16 compiles them under `#pragma GCC target` (qmatmul_avx512.cpp). Needs AVX2/FMA/F16C.
#pragma once

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "simd.inc"

#define PQ_AVX2 1

namespace vec {

#define PQ_INLINE __attribute__((always_inline)) inline

// 16 bytes -> their 32 nibbles as bytes 0..15 in element order (low nibbles, then high ones)
PQ_INLINE __m256i nibbles(const uint8_t* qs) {  // the 16 bytes in both halves, the upper shifted by 4
  const __m256i raw = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
  return _mm256_and_si256(_mm256_srlv_epi64(raw, _mm256_setr_epi64x(0, 0, 4, 4)), _mm256_set1_epi8(0x0F));
}

// 32 bytes at p, each shifted right by `shift` (0..7) and masked to `mask`
PQ_INLINE __m256i bits(const uint8_t* p, int shift, int mask) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm256_and_si256(_mm256_srl_epi16(raw, _mm_cvtsi32_si128(shift)), _mm256_set1_epi8(static_cast<char>(mask)));
}

// bit i of the 32-bit word `w` -> byte i: 0xFF where set, 0 where clear
PQ_INLINE __m256i bit_bytes(uint32_t w) {
  const __m256i rep = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(w)),
      _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303));
  const __m256i sel = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  return _mm256_cmpeq_epi8(_mm256_and_si256(rep, sel), sel);
}

// the bits from bit j (0..7) of each byte of v, moved to bit `to` of that byte and masked to `mask`
// (the field at its new place): one 16-bit shift and a mask (bits shifted in from a neighbouring
// byte land below `to` going left, above the field going right, outside the mask)
PQ_INLINE __m256i field(__m256i v, int j, int to, int mask) {
  const __m256i s = j < to ? _mm256_slli_epi16(v, to - j) : j > to ? _mm256_srli_epi16(v, j - to) : v;
  return _mm256_and_si256(s, _mm256_set1_epi8(static_cast<char>(mask)));
}

// bit j (0..7) of each of the 32 bytes at p, moved to bit `to` of its byte (1 << to where set, 0
// where clear)
PQ_INLINE __m256i bit_at(const uint8_t* p, int j, int to) {
  return field(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), j, to, 1 << to);
}

// the signed byte table t[16] indexed by 32 index bytes (each 0..15)
PQ_INLINE __m256i lookup16(const int8_t* t, __m256i idx) {
  return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(t))), idx);
}

// d and m of a block: two halves converted by one instruction
PQ_INLINE __m128 half2(const uint8_t* p) {
  int32_t dm;
  std::memcpy(&dm, p, 4);
  return _mm_cvtph_ps(_mm_cvtsi32_si128(dm));
}

struct V8 {
  using F = __m256;
  using I = __m256i;
  static constexpr int L = 8, NV = 4;
  static constexpr int RB = 6;  // gemm: activation rows per register block (12 of 16 ymm)
  static PQ_INLINE F zero() { return _mm256_setzero_ps(); }
  static PQ_INLINE F set1(float v) { return _mm256_set1_ps(v); }
  static PQ_INLINE F splat(__m128 v) { return _mm256_broadcastss_ps(v); }  // lane 0 of v
  static PQ_INLINE F load(const float* p) { return _mm256_loadu_ps(p); }
  static PQ_INLINE F bcast(const float* p) { return _mm256_broadcast_ss(p); }
  static PQ_INLINE void store(float* p, F v) { _mm256_storeu_ps(p, v); }
  static PQ_INLINE bool aligned(const float* p) { return (reinterpret_cast<uintptr_t>(p) & 31) == 0; }
  static PQ_INLINE void stream(float* p, F v) { _mm256_stream_ps(p, v); }  // past the caches; p aligned
  static PQ_INLINE F add(F a, F b) { return _mm256_add_ps(a, b); }
  static PQ_INLINE F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static PQ_INLINE F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static PQ_INLINE F cvt(I v) { return _mm256_cvtepi32_ps(v); }
  static PQ_INLINE I set1i(int v) { return _mm256_set1_epi32(v); }
  static PQ_INLINE I andi(I a, I b) { return _mm256_and_si256(a, b); }
  static PQ_INLINE I subi(I a, I b) { return _mm256_sub_epi32(a, b); }
  static PQ_INLINE I srli4(I a) { return _mm256_srli_epi32(a, 4); }
  static PQ_INLINE I load_u8(const uint8_t* p) {  // L bytes, zero-extended
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  }
  static PQ_INLINE I load_i8(const int8_t* p) {
    return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  }
  static PQ_INLINE __m128i part(__m256i q, int k) {  // bytes L k .. L k + L - 1 at the bottom
    const __m128i h = k < 2 ? _mm256_castsi256_si128(q) : _mm256_extracti128_si256(q, 1);
    return k % 2 ? _mm_unpackhi_epi64(h, h) : h;
  }
  static PQ_INLINE I u8(__m256i q, int k) { return _mm256_cvtepu8_epi32(part(q, k)); }
  static PQ_INLINE I i8(__m256i q, int k) { return _mm256_cvtepi8_epi32(part(q, k)); }
  // the 8 bytes at p widened by one instruction that reads them from memory (vpmovzxbd /
  // vpmovsxbd ymm, m64). A chunk's 32 bytes built in a register are stored once and widened from
  // there: taking each quarter out by shuffles (part) loaded the ports the FMAs share, the
  // exact row kernel's bottleneck on Zen 2 (1 thread, 2048 x 1536, 1 row, ns per weight: Q6_K
  // 0.135 -> 0.120, Q5_K 0.135 -> 0.113, Q3_K 0.130 -> 0.112, IQ4_NL 0.125 -> 0.103). In asm:
  // through intrinsics GCC forwards the store and is back at the shuffles; volatile, so that each
  // read stays where it is used (Q4_K's sub-blocks 2i and 2i + 1 read the same bytes: shared, the
  // widened vectors spilled, 0.094 against 0.089 ns per weight).
  template <bool SIGNED>
  static PQ_INLINE I widen_at(const uint8_t* p) {
    I v;
    if constexpr (SIGNED) asm volatile("vpmovsxbd %1, %0" : "=x"(v) : "m"(*reinterpret_cast<const uint64_t*>(p)));
    else asm volatile("vpmovzxbd %1, %0" : "=x"(v) : "m"(*reinterpret_cast<const uint64_t*>(p)));
    return v;
  }
  static PQ_INLINE F bcast_at(const float* p) {  // the float at p in every lane, from memory
    F v;
    asm volatile("vbroadcastss %1, %0" : "=x"(v) : "m"(*p));
    return v;
  }
  static PQ_INLINE F halves(const uint8_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static PQ_INLINE F bf16(const uint8_t* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static PQ_INLINE float reduce(F a, F b) { return simd::hsum(_mm256_add_ps(a, b)); }
  // 8 x 8 floats: r[i] (row i) -> r[j] (column j)
  static PQ_INLINE void transpose(F r[8]) {
    F t[8], u[8];
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
};

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl")

struct V16 {
  using F = __m512;
  using I = __m512i;
  static constexpr int L = 16, NV = 2;
  static constexpr int RB = 6;  // gemm: activation rows per register block (12 of 32 zmm)
  static PQ_INLINE F zero() { return _mm512_setzero_ps(); }
  static PQ_INLINE F set1(float v) { return _mm512_set1_ps(v); }
  static PQ_INLINE F splat(__m128 v) { return _mm512_broadcastss_ps(v); }
  static PQ_INLINE F load(const float* p) { return _mm512_loadu_ps(p); }
  static PQ_INLINE F bcast(const float* p) { return _mm512_set1_ps(*p); }
  static PQ_INLINE void store(float* p, F v) { _mm512_storeu_ps(p, v); }
  static PQ_INLINE bool aligned(const float* p) { return (reinterpret_cast<uintptr_t>(p) & 63) == 0; }
  static PQ_INLINE void stream(float* p, F v) { _mm512_stream_ps(p, v); }  // past the caches; p aligned
  static PQ_INLINE F add(F a, F b) { return _mm512_add_ps(a, b); }
  static PQ_INLINE F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static PQ_INLINE F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static PQ_INLINE F cvt(I v) { return _mm512_cvtepi32_ps(v); }
  static PQ_INLINE I set1i(int v) { return _mm512_set1_epi32(v); }
  static PQ_INLINE I andi(I a, I b) { return _mm512_and_si512(a, b); }
  static PQ_INLINE I subi(I a, I b) { return _mm512_sub_epi32(a, b); }
  static PQ_INLINE I srli4(I a) { return _mm512_srli_epi32(a, 4); }
  static PQ_INLINE I load_u8(const uint8_t* p) {
    return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static PQ_INLINE I load_i8(const int8_t* p) {
    return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  // V8's bcast_at and widen_at for the code written once: plain set1 and loads (the same values;
  // the memory forms were measured on AVX2 only)
  static PQ_INLINE F bcast_at(const float* p) { return _mm512_set1_ps(*p); }
  template <bool SIGNED>
  static PQ_INLINE I widen_at(const uint8_t* p) {
    return SIGNED ? load_i8(reinterpret_cast<const int8_t*>(p)) : load_u8(p);
  }
  static PQ_INLINE __m128i part(__m256i q, int k) {
    return k == 0 ? _mm256_castsi256_si128(q) : _mm256_extracti128_si256(q, 1);
  }
  static PQ_INLINE I u8(__m256i q, int k) { return _mm512_cvtepu8_epi32(part(q, k)); }
  static PQ_INLINE I i8(__m256i q, int k) { return _mm512_cvtepi8_epi32(part(q, k)); }
  static PQ_INLINE F halves(const uint8_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static PQ_INLINE F bf16(const uint8_t* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static PQ_INLINE float reduce(F a, F b) { return _mm512_reduce_add_ps(_mm512_add_ps(a, b)); }
  // 16 x 16 floats: r[i] (row i) -> r[j] (column j)
  static PQ_INLINE void transpose(F r[16]) {
    F t[16];
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
};

#pragma GCC pop_options

}  // namespace vec
#endif
