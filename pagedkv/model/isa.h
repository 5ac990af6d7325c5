// The widest vector ISA this library's kernels may use, one limit shared by all of them (qmatmul's
// AVX-512 kernels, the int8 row kernels' and the panel's AVX-512 VNNI code): 2 = AVX-512 where
// the CPU has it (the default), 1 = AVX2 at most. Set by pagedkv_q.limit_isa (defined in
// qmatmul.cpp): tests compare the paths with it, and PAGEDKV_MAX_ISA=avx2 (qkernel.py) runs a
// process as an AVX2-only CPU would. Read on every call: a kernel never caches it.
#pragma once

#include <cstdint>

namespace isa {
int64_t limit();
}  // namespace isa

// Whether the exact gemm (qgemm) sums in the row kernel's order, so that a row's result does not
// depend on its call's row count (PAGEDKV_BATCH_INVARIANT, qkernel.py; off by default: it costs
// 10-18% of a 9-40-row step on a Zen 2). Set by pagedkv_q.batch_invariant; read on every call.
namespace order {
bool invariant();
}  // namespace order
