// Prefetch ahead for the int8 panel kernel (qmatmul_panel.cpp): the bytes of the weight panels
// a thread multiplies next, fetched towards L2 while it computes this one, in parts (Cursor
// below) rather than all at once. A burst of a whole panel's prefetches (a Q6_K pair:
// 640 lines) fills the core's miss queue, and the products behind them wait for DRAM. Zen 5
// EPYC, 2 threads, 151936 x 1536 (from DRAM), ps per multiply-add and thread, burst -> parts
// (alternated, min of 9): Q6_K 7.06-7.54 -> 5.17-5.23 at 40 rows, 12.7-12.9 -> 10.4-10.8 at 16;
// Q4_K 5.65-5.76 -> 4.21-4.26 at 40. The exact qgemm spreads its next panel's prefetch the same
// way (qmatmul_simd.inc: gemm; measured there: a gemm from DRAM 1.10 -> 1.05x its time in cache).
#pragma once

#include <cstdint>

#if defined(__x86_64__) && defined(__GNUC__)
#include <xmmintrin.h>
#endif

namespace ahead {

#if defined(__x86_64__) && defined(__GNUC__)
// one line towards L2, as an asm statement the compiler keeps: a loop whose body is only
// _mm_prefetch has no side effects in C++'s terms (forward progress), and GCC 12 at -O2 deleted
// part()'s loops whole, so no prefetch instruction reached the panel kernels (found in their
// disassembly). With it, 1 thread, Q8_0 65536 x 896 from DRAM (short rows the hardware
// prefetcher does not follow), 40 rows, ns per weight 0.365-0.39 -> 0.303 (in L2: 0.295); the
// 1.5B K-quant file's int8 step, Zen 4, alternated: 16 rows 167-170 -> 128 ms, 40 rows 276-295
// -> 264-271; the 0.5B mix at 40 rows 106-115 -> 101
inline void l2(const char* p) { asm volatile("prefetcht1 %0" : : "m"(*p)); }
#endif

// up to two byte ranges (the next panel, or the next pair's two)
struct Ranges {
  const char* p[2] = {nullptr, nullptr};
  int64_t n[2] = {0, 0};

  void add(const void* q, int64_t bytes) {
    const int k = p[0] == nullptr ? 0 : 1;
    p[k] = static_cast<const char*>(q), n[k] = bytes;
  }
};

// The lines of Ranges fetched a few at a time: `steps` calls of step() cover them all, the
// first ones fetching `per` lines each (set once; no division per call). A kernel steps it once
// per block of its products, so the prefetches go out at the pace of the compute: fetched a part
// per group of activation rows (as before), a panel of long rows (Q6_K 8,960 wide: 1,838
// lines, 184 a part) issued bursts that filled the core's miss queue, and 5.6% of the panel's
// time sat on its prefetch instructions (perf, 1 thread, 40 rows). Decode steps, int8, 2 threads,
// Zen 4, alternated medians, ms, a part per group -> a step per block: the 1.5B Q4_K + Q6_K file
// at 8 rows 102.6 -> 89.2, 16 rows 140.8 -> 131.5, 40 rows 249.9 -> 241.5; the 0.5B mix at 8
// rows 43.2 -> 38.1, 40 rows 95.0 -> 91.9; Llama 3.2 1B's shapes at 40 rows 201.7 -> 193.3.
struct Cursor {
  const char* p[2] = {nullptr, nullptr};
  int64_t lines[2] = {0, 0};
  int k = 0;
  int64_t at = 0, per = 0;
  Cursor(const Ranges& r, int64_t steps) {
    for (int i = 0; i < 2; ++i) p[i] = r.p[i], lines[i] = (r.n[i] + 63) / 64;
    k = lines[0] ? 0 : lines[1] ? 1 : 2;  // (2: nothing left)
    if (steps > 0) per = (lines[0] + lines[1] + steps - 1) / steps;
  }
  void step() {
#if defined(__x86_64__) && defined(__GNUC__)
    for (int64_t i = 0; i < per && k < 2; ++i) {
      l2(p[k] + 64 * at);
      if (++at == lines[k]) at = 0, k = k == 0 && lines[1] ? 1 : 2;
    }
#endif
  }
};

}  // namespace ahead
