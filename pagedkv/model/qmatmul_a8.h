// What qmatmul_panel.cpp uses of qmatmul_a8.cpp (the activation quantizer and the argument
// checks, shared by both int8-activation ops).
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <vector>

namespace a8 {

// The activation quantizers' scalar steps, as their AVX2 code does them, so that both give the
// same bits for any input: d = NaN for a block holding a NaN (its max|x| taken over the other
// values), the reciprocal scale 1 / d only where d is a normal float (a block whose max|x| / 127
// is subnormal or zero quantizes to zeros; 1 / d would overflow to inf), and a value rounded to
// int32 as cvtps2dq does (NaN and out of range: INT32_MIN), then saturated to int8 as packs does.
// A NaN or an inf in x so reaches the outputs through d (NaN / inf), as in the exact mode.
inline float inv_scale(float d) { return d >= FLT_MIN ? 1.f / d : 0.f; }
inline int32_t round_i32(float v) {
  const float r = std::nearbyint(v);
  return r >= -2147483648.f && r < 2147483648.f ? static_cast<int32_t>(r) : INT32_MIN;
}
inline int8_t sat8(int32_t v) { return static_cast<int8_t>(std::clamp(v, -128, 127)); }
// int32 sums that wrap as the vector adds do (no signed overflow)
inline int32_t wrap_add(int32_t a, int32_t b) {
  return static_cast<int32_t>(static_cast<uint32_t>(a) + static_cast<uint32_t>(b));
}

// bytes per block of a 32-element weight type of qmatmul_a8.cpp's row kernel (Q4_0, Q4_1, Q8_0,
// Q5_0, Q5_1, IQ4_NL), 0 for any other type
int64_t block_bytes(int64_t t);

// the panel kernel's types (qmatmul_panel.cpp): the 32-element types, the K-quants with one
// scale per 32 (Q4_K, Q5_K, IQ4_XS) and Q6_K (one per 16)
bool panel_type(int64_t t);

// whether the row kernels run their AVX-512 VNNI tiles (impl 0): a CPU with AVX-512 F/BW/VL +
// VNNI, and the library's ISA limit (isa.h) at AVX-512
bool vnni512();

// the super-block types of the int8 row kernel (qmatmul_a8x.cpp): Q2_K, Q3_K, Q4_K, Q5_K, Q6_K,
// IQ4_XS
bool x_type(int64_t t);

// bytes of a K-element weight row of type t, 0 when the int8 row kernel does not multiply t or
// K is not a whole number of t's blocks
int64_t row_bytes(int64_t t, int64_t K);

// whether impl runs AVX2 code (0 = fastest available, 2 = AVX2) in a build with AVX2
bool use_avx2(int64_t impl);

// nblocks 32-element blocks of x -> q int8, d = max|x| / 127, s = d * sum(q) per block; isum
// (optional): each block's integer sum of q. impl: 0 = fastest available, 1 = scalar.
void quantize_blocks(const float* xp, int8_t* qp, float* dp, float* sp, int64_t nblocks, int64_t impl,
                     int32_t* isum = nullptr);

// nsb 256-element blocks of x -> q int8 (dK = max|x| / 127 per block, q = nearbyint(x * (1 / dK)))
// and bs[16 b + k] = the integer sum of q over elements 16 k .. 16 k + 15 of block b (int16): the
// activations of x_range. impl: 0 = fastest available, 1 = scalar (same results).
void quantize_sb(const float* x, int8_t* q, float* d, int16_t* bs, int64_t nsb, int64_t impl);

// weight rows [n0, n1) of an x_type t (rows of rb bytes, nsb = K / 256 super-blocks) against T
// activation rows quantized by quantize_sb -> out[r * ldo + n]. impl as above. xu: xq in the
// unit order of Q4_K / Q5_K's VNNI tile (unit_order), made once per call by the caller; required
// where reads_units(t, T, impl), else unused (may be null).
void x_range(int64_t t, const uint8_t* w, int64_t rb, int64_t n0, int64_t n1, int64_t nsb, int64_t T,
             const int8_t* xq, const float* xd, const int16_t* bs, int64_t K, float* out, int64_t ldo,
             int64_t impl, const int8_t* xu);

// x (n int8, n a multiple of 256) with each super-block's 32-element chunks in the order 0 2 1 3
// 4 6 5 7 (the units of Q4_K / Q5_K's VNNI tile); whether x_range(t, ..., impl) reads that order
void unit_order(const int8_t* x, int8_t* out, int64_t n);
bool reads_units(int64_t t, int64_t T, int64_t impl);

// The arguments of linear (and panel): x [T, K] f32 (K a multiple of 32), weight segments of
// the int8 row kernel's types with row_bytes(t, K) per row (the panel: block_bytes types only),
// out [T, sum N_i]; returns each segment's first output column (and the total last).
std::vector<int64_t> check_segments(const at::Tensor& x, at::TensorList ws, at::IntArrayRef qtypes,
                                    const at::Tensor& out, bool panel = false);

}  // namespace a8
