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
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace split {

// fn(state, b, e) for consecutive chunks [b, e) of [0, n), each at most `chunk` long, in any
// order and on any thread; state = make() once per thread that takes part.
template <class Make, class Fn>
void chunks(int64_t n, int64_t chunk, const Make& make, const Fn& fn) {
  if (n <= 0) return;
  chunk = std::max<int64_t>(1, chunk);
  const int64_t count = (n + chunk - 1) / chunk;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), count);
  if (threads <= 1 || at::in_parallel_region()) {
    auto state = make();
    for (int64_t b = 0; b < n; b += chunk) fn(state, b, std::min(n, b + chunk));
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    auto state = make();
    for (int64_t c = next.fetch_add(1, std::memory_order_relaxed); c < count; c = next.fetch_add(1, std::memory_order_relaxed))
      fn(state, c * chunk, std::min(n, (c + 1) * chunk));
  });
}

// the chunk length that gives each of torch's threads about `per_thread` chunks of [0, n)
inline int64_t chunk_for(int64_t n, int64_t per_thread) {
  const int64_t parts = std::max<int64_t>(1, at::get_num_threads() * per_thread);
  return std::max<int64_t>(1, (n + parts - 1) / parts);
}

}  // namespace split
