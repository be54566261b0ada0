#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace rollout {

// What a runner will hold in one memory (host memory for the CPU backend, a GPU for the CUDA
// one) at the engine's limits, planned at load before anything large is allocated: the runner
// then allocates exactly this, and nothing on the step path can run out. Plain data; any thread.
struct MemoryPlan {
  struct Item {
    std::string what;  // "weights", "KV cache", "step workspace", ...
    int64_t bytes = 0;
    std::string limit;  // the setting that lowers it ("--kv_cache_mb"); empty if none
  };
  std::string where;  // "host memory", "GPU 0", ...
  std::vector<Item> items;
  int64_t available = 0;  // bytes `where` has for all of it

  int64_t total() const;
  // OK when the items fit in `available` (or it is unknown: 0); otherwise RESOURCE_EXHAUSTED
  // with the plan, what is missing and the settings that lower the largest items, e.g. "the
  // engine's limits do not fit in host memory (...): 3.20 GiB more than the 20.00 GiB available:
  // lower --kv_cache_mb (KV cache 16.00 GiB) or --max_batch_tokens (step workspace 6.00 GiB)".
  absl::Status Check() const;
  // One line for the start-up log: "host memory: weights 0.1 GiB + KV cache 0.3 GiB + ... =
  // 0.4 GiB of 20.0 GiB, 19.6 GiB left free".
  std::string ToString() const;

 private:
  std::string ItemsString() const;  // "where: a 1 GiB + b 2 GiB = 3 GiB"
};

// The host memory this process may still take (MemAvailable of /proc/meminfo, else the free
// physical pages), in bytes; 0 when unknown (then nothing is refused).
int64_t AvailableHostMemory();

}  // namespace rollout
