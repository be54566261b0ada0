#include "runner/cpu/communicator.h"

#include <condition_variable>
#include <cstring>
#include <mutex>

#include "absl/strings/str_format.h"

namespace rollout {
namespace {

// What the ranks of one in-process group share.
struct InProcessState {
  explicit InProcessState(int n) : world_size(n), sends(n, nullptr), counts(n, 0) {}

  const int world_size;
  std::mutex mu;
  std::condition_variable cv;
  // Protected by mu.
  int arrived = 0;
  uint64_t generation = 0;
  // Written by each rank for its own slot before the first barrier of an AllGather, read by
  // all after it, stable until the second barrier.
  std::vector<const float*> sends;
  std::vector<int64_t> counts;

  void Wait() {
    std::unique_lock<std::mutex> lock(mu);
    const uint64_t gen = generation;
    if (++arrived == world_size) {
      arrived = 0;
      ++generation;
      cv.notify_all();
      return;
    }
    cv.wait(lock, [&] { return generation != gen; });
  }
};

class InProcessCommunicator final : public Communicator {
 public:
  InProcessCommunicator(std::shared_ptr<InProcessState> state, int rank)
      : state_(std::move(state)), rank_(rank) {}

  int rank() const override { return rank_; }
  int world_size() const override { return state_->world_size; }
  const char* kind() const override { return "in-process"; }

  absl::Status AllGather(const float* send, int64_t count, float* recv) override {
    InProcessState& s = *state_;
    s.sends[rank_] = send;
    s.counts[rank_] = count;
    s.Wait();  // every rank's pointer is published
    absl::Status status;
    for (int i = 0; i < s.world_size; ++i) {
      if (s.counts[i] != count) {
        status = absl::InternalError(absl::StrFormat(
            "AllGather: rank %d sends %d floats, rank %d sends %d", i, s.counts[i], rank_, count));
        break;
      }
    }
    if (status.ok()) {
      for (int i = 0; i < s.world_size; ++i) {
        float* dst = recv + static_cast<int64_t>(i) * count;
        if (dst != s.sends[i] && count > 0) {
          std::memcpy(dst, s.sends[i], count * sizeof(float));
        }
      }
    }
    s.Wait();  // nobody reads a send buffer any more
    return status;
  }

  absl::Status Barrier() override {
    state_->Wait();
    return absl::OkStatus();
  }

 private:
  const std::shared_ptr<InProcessState> state_;
  const int rank_;
};

}  // namespace

std::vector<std::unique_ptr<Communicator>> CreateInProcessGroup(int world_size) {
  auto state = std::make_shared<InProcessState>(world_size);
  std::vector<std::unique_ptr<Communicator>> group;
  for (int r = 0; r < world_size; ++r) {
    group.push_back(std::make_unique<InProcessCommunicator>(state, r));
  }
  return group;
}

}  // namespace rollout
