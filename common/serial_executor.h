#pragma once

#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace rollout {

// Runs posted closures one at a time, in the order posted, on a thread of its own. Thread-safe:
// any thread may Post. The engine hands each step's event sinks to one (so that building and
// writing a step's responses overlaps the next step), the service its checkpoint loads (so that
// no gRPC reaction blocks on a disk).
class SerialExecutor {
 public:
  SerialExecutor();
  ~SerialExecutor();  // runs what is queued, then joins
  SerialExecutor(const SerialExecutor&) = delete;
  SerialExecutor& operator=(const SerialExecutor&) = delete;

  void Post(std::function<void()> fn);
  // Returns once everything posted before the call has run.
  // REQUIRES: not called from a closure this executor runs.
  void WaitIdle();

 private:
  void Loop();

  std::mutex mu_;
  std::condition_variable cv_;                // work posted, or stop
  std::condition_variable idle_cv_;           // the queue ran empty
  std::vector<std::function<void()>> queue_;  // guarded by mu_
  bool running_ = false;                      // guarded by mu_: a batch taken off queue_ is running
  bool stop_ = false;                         // guarded by mu_
  std::thread thread_;                        // last: starts once the members above exist
};

}  // namespace rollout
