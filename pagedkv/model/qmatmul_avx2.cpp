// qmatmul's vector kernels 8 lanes wide (AVX2): qmatmul_simd.inc with vec::V8, namespace y.
// Empty in a build without AVX2/FMA/F16C (qmatmul.cpp then runs its scalar paths only).

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
namespace y {
using V = vec::V8;
#include "qmatmul_simd.inc"
}  // namespace y
#endif
