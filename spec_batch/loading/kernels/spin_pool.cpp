// The native kernels' threads.
//
// Why not OpenMP (at::parallel_for): a decode step of a small model is ~120 parallel regions of 5-50 us each.
// libgomp's workers spin between regions only while the process has no more OpenMP threads than CPUs; as soon as a
// second thread has run a parallel region (the server's engine thread after the main thread loaded the model, a
// worker thread beside the main one), it spins 100 iterations and then sleeps, and every region pays a futex wake-up
// (40-80 us on a VM, where it is an inter-processor interrupt): measured, a decode step on a second thread took
// 2.2x as long as on the main thread. Off the main thread, the workers here spin (with pause) for up to kSpinMicros
// after each job, then sleep until the next. On the process's main thread OpenMP's team is kept: there it spins
// (300,000 iterations, milliseconds), and two teams of spinners on the same cores were measured slower than either;
// unless OMP_WAIT_POLICY=passive (OpenMP's threads sleep at once), and then the pool serves the main thread too.
// Why that matters on a busy machine: an OpenMP region ends at a barrier that waits for every thread of the team,
// one the OS has descheduled included; the pool waits only for the pieces claimed, so a delayed worker's share is
// taken by the running threads. Beside a CPU burner on 2 cores (AVX2 Zen 3, plain decoding at batch 1): 1.65x the
// tokens/s of the OpenMP team; quiet, plain decoding the same, wider steps and Hugging Face's forward (ATen's
// regions, which then pay a wake-up each) slower: docs/weights.md.
// What each chunk computes does not depend on which thread runs it, so results are the same bits with any split.
//
// One job at a time: a job is published in one atomic word (its tag, its chunk count, the next chunk to claim), so
// a thread claims a chunk only of the job still running, and the job's fields stay valid until its last chunk is
// done. Threads are created on first use (at::get_num_threads() - 1) and never joined; a forked child starts a new
// pool (its parent's threads do not exist there).
#include "spin_pool.h"

#include <ATen/Parallel.h>
#include <strings.h>
#include <unistd.h>

#include <cstdlib>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

namespace spec_batch_kernels {
namespace {

constexpr int64_t kSpinMicros = 500;  // a step's regions are microseconds apart; steps, a millisecond or more

inline void relax() {
#if defined(__x86_64__) || defined(_M_X64)
  _mm_pause();
#else
  std::this_thread::yield();
#endif
}

// the job word: tag (32 bits) | chunks (16) | next chunk to claim (16)
constexpr uint64_t kChunkBits = 16, kChunkMask = (uint64_t{1} << kChunkBits) - 1;
inline uint64_t tag_of(uint64_t word) { return word >> (2 * kChunkBits); }
inline uint64_t chunks_of(uint64_t word) { return (word >> kChunkBits) & kChunkMask; }
inline uint64_t next_of(uint64_t word) { return word & kChunkMask; }

thread_local bool in_job = false;

// OMP_WAIT_POLICY=passive, as libgomp read it when torch loaded: OpenMP's threads then sleep between regions, and
// the main thread's regions run on the pool too
bool openmp_passive() {
  const char* policy = std::getenv("OMP_WAIT_POLICY");
  return policy != nullptr && strcasecmp(policy, "passive") == 0;
}

class SpinPool {
 public:
  static SpinPool& instance() {
    static std::mutex guard;
    static SpinPool* pool = nullptr;
    std::lock_guard<std::mutex> hold(guard);
    if (pool == nullptr || pool->pid_ != getpid()) pool = new SpinPool();  // leaked: its threads are never joined
    return *pool;
  }

  // Runs chunk(i) for i < chunks on this thread and `workers` others; false (nothing run) when the pool is busy.
  bool run(int64_t chunks, int64_t workers, const std::function<void(int64_t)>& chunk) {
    std::unique_lock<std::mutex> busy(busy_, std::try_to_lock);
    if (!busy.owns_lock()) return false;
    grow(workers);
    chunk_ = &chunk;
    error_ = nullptr;
    finished_.store(0, std::memory_order_relaxed);
    const uint64_t tag = (tag_of(job_.load(std::memory_order_relaxed)) + 1) & 0xFFFFFFFFu;
    job_.store((tag << (2 * kChunkBits)) | (static_cast<uint64_t>(chunks) << kChunkBits), std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> hold(sleep_);
      wake_.notify_all();
    }
    work(tag);
    while (finished_.load(std::memory_order_acquire) < chunks) relax();
    if (error_) std::rethrow_exception(error_);
    return true;
  }

 private:
  SpinPool() : pid_(getpid()) {}

  void grow(int64_t workers) {
    while (static_cast<int64_t>(threads_) < workers) {
      std::thread([this] { loop(); }).detach();
      ++threads_;
    }
  }

  // Claims and runs chunks of job `tag` until none is left.
  void work(uint64_t tag) {
    in_job = true;
    uint64_t word = job_.load(std::memory_order_acquire);
    while (tag_of(word) == tag && next_of(word) < chunks_of(word)) {
      if (!job_.compare_exchange_weak(word, word + 1, std::memory_order_acq_rel, std::memory_order_acquire)) continue;
      try {
        (*chunk_)(static_cast<int64_t>(next_of(word)));
      } catch (...) {
        std::lock_guard<std::mutex> hold(error_lock_);
        if (!error_) error_ = std::current_exception();
      }
      finished_.fetch_add(1, std::memory_order_acq_rel);
      word = job_.load(std::memory_order_acquire);
    }
    in_job = false;
  }

  void loop() {
    uint64_t seen = tag_of(job_.load(std::memory_order_acquire));
    for (;;) {
      auto since = std::chrono::steady_clock::now();
      uint64_t tag;
      for (int64_t i = 0; (tag = tag_of(job_.load(std::memory_order_acquire))) == seen; ++i) {
        relax();
        if ((i & 255) != 255) continue;
        const auto now = std::chrono::steady_clock::now();
        if (now - since < std::chrono::microseconds(kSpinMicros)) continue;
        std::unique_lock<std::mutex> lock(sleep_);
        sleepers_.fetch_add(1, std::memory_order_seq_cst);
        wake_.wait(lock, [&] { return tag_of(job_.load(std::memory_order_seq_cst)) != seen; });
        sleepers_.fetch_sub(1, std::memory_order_seq_cst);
        since = std::chrono::steady_clock::now();
      }
      seen = tag;
      work(tag);
    }
  }

  const pid_t pid_;
  std::mutex busy_, sleep_, error_lock_;
  std::condition_variable wake_;
  std::atomic<uint64_t> job_{0};
  std::atomic<int64_t> finished_{0};
  std::atomic<int64_t> sleepers_{0};
  const std::function<void(int64_t)>* chunk_ = nullptr;
  std::exception_ptr error_;
  size_t threads_ = 0;
};

}  // namespace

void parallel_for(int64_t begin, int64_t end, int64_t grain, const std::function<void(int64_t, int64_t)>& f) {
  const int64_t range = end - begin;
  if (range <= 0) return;
  grain = std::max<int64_t>(grain, 1);
  const int64_t most = (range + grain - 1) / grain;  // pieces of at least `grain`
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), most);
  if (threads <= 1 || in_job) {
    f(begin, end);
    return;
  }
  // kPiecesPerThread pieces a thread, each a multiple of `grain`, claimed in turn: a thread the machine delays
  // takes fewer, where one contiguous run per thread made every region wait for the slowest thread's whole share
  const int64_t wanted = std::min<int64_t>({threads * kPiecesPerThread, most, static_cast<int64_t>(kChunkMask)});
  const int64_t size = ((range + wanted - 1) / wanted + grain - 1) / grain * grain;
  const int64_t pieces = (range + size - 1) / size;
  const std::function<void(int64_t)> piece = [&](int64_t i) {
    const int64_t lo = begin + i * size, hi = std::min(end, lo + size);
    if (lo < hi) f(lo, hi);
  };
  static const bool passive = openmp_passive();
  if (!passive && gettid() == getpid()) {  // the process's main thread: OpenMP's team spins there (see the header)
    std::atomic<int64_t> next{0};
    at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
      for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < pieces;) piece(i);
    });
    return;
  }
  if (!SpinPool::instance().run(pieces, threads - 1, piece)) f(begin, end);
}

}  // namespace spec_batch_kernels
