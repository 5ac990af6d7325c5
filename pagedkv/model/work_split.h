// Work split for the many-row matmul kernels (the int8 panel, the exact qgemm): chunks of an
// index range handed out to torch's intra-op threads through an atomic counter. at::parallel_for
// gives each thread one equal static range, so a thread preempted by another process (the
// server's event loop, a client on the same cores) holds up the whole op while the others idle
// at its end; with chunks the others take over its share. Alternated in one process, decode
// steps of the 0.5B Q4_K_M mix, 2 threads, a process beside them spinning 2 ms in every 10
// (medians, ms, static -> chunks): int8 16 rows 75.0 -> 72.6, 40 rows 132.8 -> 127.1; exact 16
// rows 181.9 -> 169.2, 40 rows 303.0 -> 281.7; on an idle machine the same within the noise.
// The row kernels (1-3 rows, memory-bound) keep static ranges: chunks there broke their
// prefetch streams (batch-1 step 25.5 -> 26.2 ms idle) and gained nothing beside that process.
// The chunks shrink as the range runs out (OpenMP's "guided"): a thread takes 1 / (2 threads) of
// what is left, at most `chunk`, at least 1, so the threads finish within one short chunk of each
// other, where equal chunks of n / 16 left one idle for half a chunk on average (about 3% of the
// op). Alternated step by step in one process, 1.5B Q4_K_M file, int8, 2 threads, idle Zen 4, ms,
// equal -> shrinking: 40 rows 251.2 -> 249.9, 251.2 -> 249.4; 8 rows 107.0 -> 105.8, 101.4 ->
// 100.3; its LM head alone (Q6_K 151936 x 1536) 22.5 -> 21.6 at 16 rows, 37.2 -> 36.6 at 40.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace split {

// fn(state, b, e) for consecutive chunks [b, e) of [0, n) that cover it once, each at most
// `chunk` long and shorter towards the end (see above), in any order and on any thread;
// state = make() once per thread that takes part.
template <class Make, class Fn>
void chunks(int64_t n, int64_t chunk, const Make& make, const Fn& fn) {
  if (n <= 0) return;
  chunk = std::max<int64_t>(1, chunk);
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), (n + chunk - 1) / chunk);
  if (threads <= 1 || at::in_parallel_region()) {
    auto state = make();
    for (int64_t b = 0; b < n; b += chunk) fn(state, b, std::min(n, b + chunk));
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    auto state = make();
    int64_t b = next.load(std::memory_order_relaxed);
    while (b < n) {  // (a failed exchange reloads b)
      const int64_t len = std::clamp<int64_t>((n - b) / (2 * threads), 1, chunk);
      if (next.compare_exchange_weak(b, b + len, std::memory_order_relaxed)) {
        fn(state, b, b + len);
        b = next.load(std::memory_order_relaxed);
      }
    }
  });
}

// the chunk length that gives each of torch's threads about `per_thread` chunks of [0, n)
inline int64_t chunk_for(int64_t n, int64_t per_thread) {
  const int64_t parts = std::max<int64_t>(1, at::get_num_threads() * per_thread);
  return std::max<int64_t>(1, (n + parts - 1) / parts);
}

}  // namespace split
