// What qmatmul_panel.cpp uses of qmatmul_a8.cpp (the activation quantizer and the argument
// checks, shared by both int8-activation ops).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace a8 {

// bytes per block of an int8-kernel weight type (Q4_0, Q4_1, Q8_0), 0 for any other type
int64_t block_bytes(int64_t t);

// nblocks 32-element blocks of x -> q int8, d = max|x| / 127, s = d * sum(q) per block; isum
// (optional): each block's integer sum of q. impl: 0 = fastest available, 1 = scalar.
void quantize_blocks(const float* xp, int8_t* qp, float* dp, float* sp, int64_t nblocks, int64_t impl,
                     int32_t* isum = nullptr);

// The arguments of linear (and panel): x [T, K] f32 (K a multiple of 32), weight segments of
// the int8 types with K / 32 blocks per row, out [T, sum N_i]; returns each segment's first
// output column (and the total last).
std::vector<int64_t> check_segments(const at::Tensor& x, at::TensorList ws, at::IntArrayRef qtypes,
                                    const at::Tensor& out);

}  // namespace a8
