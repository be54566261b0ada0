#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace rollout::cpu {

// A fixed set of worker threads that run index ranges of one loop at a time. Used by the CPU
// kernels to split independent rows, heads or output columns -- never one reduction -- so the
// number of threads cannot change any result bit. One caller at a time (the engine thread).
class ThreadPool {
 public:
  // num_threads = 0 picks std::thread::hardware_concurrency().
  explicit ThreadPool(int num_threads = 0);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const { return static_cast<int>(workers_.size()) + 1; }

  // Calls fn(begin, end) over disjoint ranges covering [0, n), at least `grain` indices each,
  // on the workers and the calling thread; returns when all are done.
  void ParallelFor(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);

 private:
  void WorkerLoop(int worker_index);
  // Claims and runs chunks of the current loop until none is left. REQUIRES: lock holds mu_;
  // it is released while a chunk runs.
  void RunChunks(std::unique_lock<std::mutex>& lock);

  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable work_cv_;
  std::condition_variable done_cv_;
  // Protected by mu_.
  const std::function<void(int64_t, int64_t)>* fn_ = nullptr;
  int64_t n_ = 0;
  int64_t chunk_ = 0;
  int64_t num_chunks_ = 0;
  int64_t next_chunk_ = 0;
  int64_t pending_chunks_ = 0;
  uint64_t generation_ = 0;
  bool stop_ = false;
};

}  // namespace rollout::cpu
