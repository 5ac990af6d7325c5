// qmatmul's vector kernels 16 lanes wide (AVX-512): qmatmul_simd.inc with vec::V16, namespace z.
// Compiled under a target pragma and chosen at run time (qmatmul.cpp: has_avx512), so the build
// flags (and the build cache's name) stay AVX2's. Empty in a build without AVX2/FMA/F16C.

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "ggml_blocks.h"
#include "isa.h"
#include "out_store.h"
#include "qmatmul_simd.h"
#include "vec.h"
#include "work_split.h"

#ifdef PQ_AVX2
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl")
namespace z {
using V = vec::V16;
#include "qmatmul_simd.inc"
}  // namespace z
#pragma GCC pop_options
#endif
