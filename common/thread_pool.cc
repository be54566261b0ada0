#include "common/thread_pool.h"

#include <algorithm>

namespace rollout::cpu {
namespace {

// Chunks per thread: a few more than one so uneven chunks (attention rows of different lengths)
// balance, few enough that claiming a chunk under the lock stays cheap.
constexpr int64_t kChunksPerThread = 4;

// True on a thread that is running a chunk. A ParallelFor issued from inside a chunk runs
// inline: the pool serves one loop at a time, and waiting for itself would deadlock.
thread_local bool tls_in_parallel_for = false;

}  // namespace

ThreadPool::ThreadPool(int num_threads) {
  if (num_threads <= 0) {
    num_threads = static_cast<int>(std::thread::hardware_concurrency());
  }
  num_threads = std::max(num_threads, 1);
  workers_.reserve(num_threads - 1);
  for (int i = 0; i < num_threads - 1; ++i) {
    workers_.emplace_back([this, i] { WorkerLoop(i); });
  }
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  work_cv_.notify_all();
  for (std::thread& worker : workers_) worker.join();
}

void ThreadPool::ParallelFor(int64_t n, int64_t grain,
                             const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  grain = std::max<int64_t>(grain, 1);
  if (n <= grain || workers_.empty() || tls_in_parallel_for) {
    fn(0, n);
    return;
  }
  const int64_t target_chunks = kChunksPerThread * num_threads();
  const int64_t chunk = std::max(grain, (n + target_chunks - 1) / target_chunks);
  // Floor, not ceil: the last chunk absorbs the remainder, so every chunk has >= grain indices.
  const int64_t num_chunks = n / chunk;
  if (num_chunks <= 1) {
    fn(0, n);
    return;
  }

  std::unique_lock<std::mutex> lock(mu_);
  fn_ = &fn;
  n_ = n;
  chunk_ = chunk;
  num_chunks_ = num_chunks;
  next_chunk_ = 0;
  pending_chunks_ = num_chunks;
  ++generation_;
  lock.unlock();
  work_cv_.notify_all();

  lock.lock();
  RunChunks(lock);
  done_cv_.wait(lock, [this] { return pending_chunks_ == 0; });
  // Workers that wake late find next_chunk_ == num_chunks_ and go back to sleep; none of them
  // can still hold fn_, because every claimed chunk has finished.
  fn_ = nullptr;
}

void ThreadPool::RunChunks(std::unique_lock<std::mutex>& lock) {
  while (next_chunk_ < num_chunks_) {
    const int64_t c = next_chunk_++;
    const std::function<void(int64_t, int64_t)>* fn = fn_;
    const int64_t begin = c * chunk_;
    const int64_t end = c + 1 == num_chunks_ ? n_ : begin + chunk_;
    lock.unlock();
    tls_in_parallel_for = true;
    (*fn)(begin, end);
    tls_in_parallel_for = false;
    lock.lock();
    if (--pending_chunks_ == 0) done_cv_.notify_one();
  }
}

void ThreadPool::WorkerLoop(int worker_index) {
  (void)worker_index;
  uint64_t seen_generation = 0;
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    // The predicate is read under mu_, so a notify between two waits is never lost.
    work_cv_.wait(lock, [&] { return stop_ || generation_ != seen_generation; });
    if (stop_) return;
    seen_generation = generation_;
    RunChunks(lock);
  }
}

}  // namespace rollout::cpu
