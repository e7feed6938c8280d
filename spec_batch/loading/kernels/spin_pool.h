// A parallel_for for the native kernels: off the process's main thread on our own threads, which spin between the
// many short parallel regions of a decode step instead of sleeping; on it, at::parallel_for (spin_pool.cpp: why).
#pragma once
#include <cstdint>
#include <functional>

namespace spec_batch_kernels {
// f(lo, hi) over [begin, end) on at most at::get_num_threads() threads, in pieces of a multiple of `grain` (a few a
// thread) that the threads claim in turn. Runs on the calling thread alone when the range is one chunk, when called from
// inside another parallel_for, or while another thread's parallel_for holds the pool. The first exception a chunk
// throws is rethrown here.
void parallel_for(int64_t begin, int64_t end, int64_t grain, const std::function<void(int64_t, int64_t)>& f);
}  // namespace spec_batch_kernels
