// A parallel_for for the native kernels: off the process's main thread on our own threads, which spin between the
// many short parallel regions of a decode step instead of sleeping; on it, at::parallel_for, unless
// OMP_WAIT_POLICY=passive (spin_pool.cpp: why).
#pragma once
#include <cstdint>
#include <functional>

namespace spec_batch_kernels {
constexpr int64_t kPiecesPerThread = 4;  // the pieces a region is split into, a thread

// f(lo, hi) over [begin, end) on at most at::get_num_threads() threads, in pieces of a multiple of `grain`
// (kPiecesPerThread a thread) that the threads claim in turn. Runs on the calling thread alone when the range is one
// piece, when called from inside another parallel_for, or while another thread's parallel_for holds the pool. The
// first exception a piece throws is rethrown here.
void parallel_for(int64_t begin, int64_t end, int64_t grain, const std::function<void(int64_t, int64_t)>& f);
}  // namespace spec_batch_kernels
