// The GGUF block formats every kernel reads: type ids, block structs (their sizes are the ggml
// ones, checked below), `half`, and the scalar dequantizer of each type with exactly the float32
// arithmetic of the `gguf` package's numpy code (the vector paths in qmatmul_simd.inc compute the
// same values; the kernels are built with -ffp-contract=off so no product is fused by accident).
//
// Adding a type: its block struct, its entry in TYPES, one scalar dequantizer here and one chunk
// dequantizer in qmatmul_simd.inc. quant.py reads TYPES through pagedkv_q.types() at load and
// checks it against the gguf package's GGML_QUANT_SIZES.
#pragma once

#include <c10/util/Half.h>
#ifdef __F16C__
#include <immintrin.h>
#endif

#include <cstdint>
#include <cstring>

namespace ggml {

// ggml type ids (gguf.GGMLQuantizationType)
enum Type : int64_t {
  F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11,
  Q4_K = 12, Q5_K = 13, Q6_K = 14, IQ4_NL = 20, IQ4_XS = 23, BF16 = 30
};

constexpr int QK = 32;    // elements of a legacy block, and of one kernel chunk
constexpr int QK_K = 256;  // elements of a K-quant super-block

// Every field is bytes (fp16 values included), so a struct has alignment 1 and no padding: its
// sizeof is the file's block size.
struct BlockQ4_0 { uint8_t d[2], qs[16]; };
struct BlockQ4_1 { uint8_t d[2], m[2], qs[16]; };
struct BlockQ5_0 { uint8_t d[2], qh[4], qs[16]; };
struct BlockQ5_1 { uint8_t d[2], m[2], qh[4], qs[16]; };
struct BlockQ8_0 { uint8_t d[2]; int8_t qs[32]; };
struct BlockQ2_K { uint8_t scales[16], qs[64], d[2], dmin[2]; };
struct BlockQ3_K { uint8_t hmask[32], qs[64], scales[12], d[2]; };
struct BlockQ4_K { uint8_t d[2], dmin[2], scales[12], qs[128]; };
struct BlockQ5_K { uint8_t d[2], dmin[2], scales[12], qh[32], qs[128]; };
struct BlockQ6_K { uint8_t ql[128], qh[64]; int8_t scales[16]; uint8_t d[2]; };
struct BlockIQ4_NL { uint8_t d[2], qs[16]; };
struct BlockIQ4_XS { uint8_t d[2], scales_h[2], scales_l[4], qs[128]; };

struct TypeInfo {
  int64_t type;
  int64_t block;  // elements per block
  int64_t bytes;  // bytes per block
};

// the types the kernels read (quant.py: KERNEL_TYPES, checked against this table at load)
constexpr TypeInfo TYPES[] = {
    {F32, 1, 4}, {F16, 1, 2}, {BF16, 1, 2},
    {Q4_0, QK, sizeof(BlockQ4_0)}, {Q4_1, QK, sizeof(BlockQ4_1)},
    {Q5_0, QK, sizeof(BlockQ5_0)}, {Q5_1, QK, sizeof(BlockQ5_1)},
    {Q8_0, QK, sizeof(BlockQ8_0)}, {IQ4_NL, QK, sizeof(BlockIQ4_NL)},
    {Q2_K, QK_K, sizeof(BlockQ2_K)}, {Q3_K, QK_K, sizeof(BlockQ3_K)},
    {Q4_K, QK_K, sizeof(BlockQ4_K)}, {Q5_K, QK_K, sizeof(BlockQ5_K)},
    {Q6_K, QK_K, sizeof(BlockQ6_K)}, {IQ4_XS, QK_K, sizeof(BlockIQ4_XS)},
};
static_assert(sizeof(BlockQ4_0) == 18 && sizeof(BlockQ4_1) == 20 && sizeof(BlockQ5_0) == 22 &&
              sizeof(BlockQ5_1) == 24 && sizeof(BlockQ8_0) == 34 && sizeof(BlockQ2_K) == 84 &&
              sizeof(BlockQ3_K) == 110 && sizeof(BlockQ4_K) == 144 && sizeof(BlockQ5_K) == 176 &&
              sizeof(BlockQ6_K) == 210 && sizeof(BlockIQ4_NL) == 18 && sizeof(BlockIQ4_XS) == 136,
              "block sizes are ggml's");

// the type's entry, or nullptr when no kernel reads it
constexpr const TypeInfo* type_info(int64_t t) {
  for (const TypeInfo& i : TYPES)
    if (i.type == t) return &i;
  return nullptr;
}

constexpr bool is_super_block(int64_t t) {  // 256-element blocks
  const TypeInfo* i = type_info(t);
  return i && i->block == QK_K;
}

inline float half(const uint8_t* p) {  // exact either way; F16C is one instruction
  uint16_t h;
  std::memcpy(&h, p, 2);
#ifdef __F16C__
  return _cvtsh_ss(h);
#else
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
#endif
}

inline uint32_t u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// IQ4_NL / IQ4_XS: the 16 non-linear levels a nibble indexes
alignas(16) constexpr int8_t IQ4_LEVELS[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                               1, 13, 25, 38, 53, 69, 89, 113};

// nibble i of a 16-byte run holding 32 values: elements 0-15 are the low nibbles, 16-31 the high
inline int nibble(const uint8_t* qs, int i) { return i < 16 ? qs[i] & 0x0F : qs[i - 16] >> 4; }

// Q4_K / Q5_K: the 6-bit scale and min of sub-block j (of 8), packed in 12 bytes
inline void scale_min_k4(const uint8_t* s, int j, int& sc, int& mn) {
  if (j < 4) {
    sc = s[j] & 0x3F;
    mn = s[j + 4] & 0x3F;
  } else {
    sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 2) & 0x30);
    mn = (s[j + 4] >> 4) | ((s[j] >> 2) & 0x30);
  }
}

// Q3_K: the signed 6-bit scale of 16-element group s (of 16)
inline int scale_q3_k(const uint8_t* sc, int s) {
  const int lo = (sc[s % 8] >> (4 * (s / 8))) & 0x0F;
  const int hi = (sc[8 + s % 4] >> (2 * (s / 4))) & 0x03;
  return (lo | (hi << 4)) - 32;
}

// IQ4_XS: the signed 6-bit scale of sub-block j (of 8)
inline int scale_iq4_xs(const BlockIQ4_XS& b, int j) {
  const int h = (b.scales_h[0] | (b.scales_h[1] << 8)) >> (2 * j) & 0x03;
  return ((b.scales_l[j / 2] >> (4 * (j % 2))) & 0x0F | (h << 4)) - 32;
}

// --- one block -> floats (the gguf package's formulas, operation for operation) -----------------

inline void deq(const BlockQ4_0& b, float* y) {
  const float d = half(b.d);
  for (int i = 0; i < QK; ++i) y[i] = d * static_cast<float>(nibble(b.qs, i) - 8);
}

inline void deq(const BlockQ4_1& b, float* y) {
  const float d = half(b.d), m = half(b.m);
  for (int i = 0; i < QK; ++i) y[i] = d * static_cast<float>(nibble(b.qs, i)) + m;
}

inline void deq(const BlockQ5_0& b, float* y) {
  const float d = half(b.d);
  const uint32_t qh = u32(b.qh);
  for (int i = 0; i < QK; ++i) y[i] = d * static_cast<float>((nibble(b.qs, i) | static_cast<int>((qh >> i) & 1) << 4) - 16);
}

inline void deq(const BlockQ5_1& b, float* y) {
  const float d = half(b.d), m = half(b.m);
  const uint32_t qh = u32(b.qh);
  for (int i = 0; i < QK; ++i) y[i] = d * static_cast<float>(nibble(b.qs, i) | static_cast<int>((qh >> i) & 1) << 4) + m;
}

inline void deq(const BlockQ8_0& b, float* y) {
  const float d = half(b.d);
  for (int i = 0; i < QK; ++i) y[i] = d * static_cast<float>(b.qs[i]);
}

inline void deq(const BlockIQ4_NL& b, float* y) {
  const float d = half(b.d);
  for (int i = 0; i < QK; ++i) y[i] = d * static_cast<float>(IQ4_LEVELS[nibble(b.qs, i)]);
}

// element e of a K-quant block: e = 32 j + i (sub-block j); 2-bit fields are in 128-element
// halves h = e / 128 of 32 bytes, field s = (e / 32) % 4 at bit 2 s of byte 32 h + e % 32
inline void deq(const BlockQ2_K& b, float* y) {
  const float d = half(b.d), dmin = half(b.dmin);
  for (int e = 0; e < QK_K; ++e) {
    const float dl = d * static_cast<float>(b.scales[e / 16] & 0x0F);
    const float ml = dmin * static_cast<float>(b.scales[e / 16] >> 4);
    const int q = (b.qs[32 * (e / 128) + e % 32] >> (2 * ((e / 32) % 4))) & 0x03;
    y[e] = dl * static_cast<float>(q) - ml;
  }
}

inline void deq(const BlockQ3_K& b, float* y) {
  const float d = half(b.d);
  for (int e = 0; e < QK_K; ++e) {
    const float dl = d * static_cast<float>(scale_q3_k(b.scales, e / 16));
    const int ql = (b.qs[32 * (e / 128) + e % 32] >> (2 * ((e / 32) % 4))) & 0x03;
    const int hbit = (b.hmask[e % 32] >> (e / 32)) & 1;
    y[e] = dl * static_cast<float>(ql - ((hbit ^ 1) << 2));
  }
}

inline void deq(const BlockQ4_K& b, float* y) {
  const float d = half(b.d), dmin = half(b.dmin);
  for (int j = 0; j < 8; ++j) {
    int sc, mn;
    scale_min_k4(b.scales, j, sc, mn);
    const float dj = d * static_cast<float>(sc), mj = dmin * static_cast<float>(mn);
    const uint8_t* q = b.qs + 32 * (j / 2);
    for (int i = 0; i < 32; ++i) y[32 * j + i] = dj * static_cast<float>((q[i] >> (4 * (j % 2))) & 0x0F) - mj;
  }
}

inline void deq(const BlockQ5_K& b, float* y) {
  const float d = half(b.d), dmin = half(b.dmin);
  for (int j = 0; j < 8; ++j) {
    int sc, mn;
    scale_min_k4(b.scales, j, sc, mn);
    const float dj = d * static_cast<float>(sc), mj = dmin * static_cast<float>(mn);
    const uint8_t* q = b.qs + 32 * (j / 2);
    for (int i = 0; i < 32; ++i) {
      const int v = ((q[i] >> (4 * (j % 2))) & 0x0F) | (((b.qh[i] >> j) & 1) << 4);
      y[32 * j + i] = dj * static_cast<float>(v) - mj;
    }
  }
}

inline void deq(const BlockQ6_K& b, float* y) {
  const float d = half(b.d);
  for (int e = 0; e < QK_K; ++e) {
    const int h = e / 128, r = e % 128;
    const int lo = (b.ql[64 * h + r % 64] >> (4 * (r / 64))) & 0x0F;
    const int hi = (b.qh[32 * h + r % 32] >> (2 * (r / 32))) & 0x03;
    y[e] = d * static_cast<float>(b.scales[e / 16]) * static_cast<float>((lo | (hi << 4)) - 32);
  }
}

inline void deq(const BlockIQ4_XS& b, float* y) {
  const float d = half(b.d);
  for (int j = 0; j < 8; ++j) {
    const float dl = d * static_cast<float>(scale_iq4_xs(b, j));
    for (int i = 0; i < 32; ++i) y[32 * j + i] = dl * static_cast<float>(IQ4_LEVELS[nibble(b.qs + 16 * j, i)]);
  }
}

template <class B>
inline void deq_blocks(const uint8_t* row, int64_t K, int64_t block, float* y) {
  for (int64_t i = 0; i < K / block; ++i) deq(*reinterpret_cast<const B*>(row + sizeof(B) * i), y + block * i);
}

// One weight row (K elements of type t) -> floats; false for a type no kernel reads.
inline bool deq_row(const uint8_t* row, int64_t t, int64_t K, float* y) {
  switch (t) {
    case F32: std::memcpy(y, row, K * sizeof(float)); return true;
    case F16:
      for (int64_t i = 0; i < K; ++i) y[i] = half(row + 2 * i);
      return true;
    case BF16:
      for (int64_t i = 0; i < K; ++i) {
        const uint32_t w = static_cast<uint32_t>(row[2 * i] | (row[2 * i + 1] << 8)) << 16;
        std::memcpy(y + i, &w, 4);
      }
      return true;
    case Q4_0: deq_blocks<BlockQ4_0>(row, K, QK, y); return true;
    case Q4_1: deq_blocks<BlockQ4_1>(row, K, QK, y); return true;
    case Q5_0: deq_blocks<BlockQ5_0>(row, K, QK, y); return true;
    case Q5_1: deq_blocks<BlockQ5_1>(row, K, QK, y); return true;
    case Q8_0: deq_blocks<BlockQ8_0>(row, K, QK, y); return true;
    case IQ4_NL: deq_blocks<BlockIQ4_NL>(row, K, QK, y); return true;
    case Q2_K: deq_blocks<BlockQ2_K>(row, K, QK_K, y); return true;
    case Q3_K: deq_blocks<BlockQ3_K>(row, K, QK_K, y); return true;
    case Q4_K: deq_blocks<BlockQ4_K>(row, K, QK_K, y); return true;
    case Q5_K: deq_blocks<BlockQ5_K>(row, K, QK_K, y); return true;
    case Q6_K: deq_blocks<BlockQ6_K>(row, K, QK_K, y); return true;
    case IQ4_XS: deq_blocks<BlockIQ4_XS>(row, K, QK_K, y); return true;
    default: return false;
  }
}

}  // namespace ggml
