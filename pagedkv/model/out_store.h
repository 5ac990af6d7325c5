// Where the many-row matmuls (the int8 panel, the exact qgemm) write a big output: past the
// caches, with streaming stores. An ordinary store to a line that is in no cache first reads the
// line from DRAM (a write miss), and the misses of a big output queue behind each other: the
// logits of a large vocabulary at many rows (Gemma 3's 262,144 x 40 float32 rows: 40 MiB) are
// written slower than the weights are read. Streamed, a line goes to DRAM whole, never read.
// Small outputs stay cached for the op that reads them next. Measured on Zen 4, 2 threads, ms,
// alternated medians, ordinary -> streamed: Gemma 3 270M's Q8_0 LM head (262,144 x 640), int8
// panel, 40 rows 31.7 -> 25.2 (16 rows 15.6 -> 13.1; 8 rows, 8 MiB, 11.4 -> 11.1), and its whole
// decode step at 40 rows 65.6 -> 56.5 (exact: 142.8 -> 138.7), at 16 rows 35.3 -> 32.6; the 1.5B
// file's Q6_K LM head (151,936 x 1,536) 36.5 -> 35.3, its step the same (238.3 / 238.3), as the
// 0.5B's and Llama 3.2 1B's shapes' (within 1%); its Q4_K gate_up at 256 rows (18 MiB) 20.4 -> 20.4.
#pragma once

#include <cstdint>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

namespace out_store {

constexpr int64_t STREAM_BYTES = int64_t{8} << 20;  // from this many bytes of output

// whether a call writing T rows of N float32 outputs streams them
inline bool stream(int64_t T, int64_t N) {
  return T > 0 && N > 0 && N >= (STREAM_BYTES / 4 + T - 1) / T;  // (T * N * 4 >= STREAM_BYTES, overflow-free)
}

// after one thread's streaming stores: they reach memory before its later stores (the counter or
// barrier that tells other threads the work is done), so a reader sees them
inline void fence(bool streamed) {
#if defined(__x86_64__) && defined(__GNUC__)
  if (streamed) _mm_sfence();
#else
  (void)streamed;
#endif
}

}  // namespace out_store
