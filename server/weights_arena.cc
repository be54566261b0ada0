#include "server/weights_arena.h"

#include <chrono>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "glog/logging.h"

namespace rollout {
namespace {

// Places start on page boundaries: whole pages for each DMA, and memcpy's aligned path.
constexpr size_t kPlaceAlignment = 4096;

}  // namespace

struct WeightsArena::State {
  // Constant after construction.
  std::map<std::string, size_t, std::less<>> offsets;  // by tensor name
  size_t capacity = 0;
  Allocator allocate;

  std::mutex mu;
  std::unique_ptr<HostStagingBuffer> buffer;  // guarded by mu; set once, then constant
  bool leased = false;                        // guarded by mu
  int allocations = 0;                        // guarded by mu
};

WeightsArena::WeightsArena(const std::vector<WeightSpec>& specs, Allocator allocate)
    : state_(std::make_shared<State>()) {
  for (const WeightSpec& spec : specs) {
    state_->offsets[spec.name] = state_->capacity;
    state_->capacity += (spec.nbytes() + kPlaceAlignment - 1) / kPlaceAlignment * kPlaceAlignment;
  }
  state_->allocate = std::move(allocate);
}

absl::StatusOr<std::shared_ptr<WeightsArena::Lease>> WeightsArena::Acquire(double* setup_seconds) {
  if (setup_seconds != nullptr) *setup_seconds = 0;
  State& s = *state_;
  std::lock_guard<std::mutex> lock(s.mu);
  if (s.leased) {
    return absl::AbortedError(
        "the weight staging memory is held by another update; one update at a time (retry "
        "when it ends)");
  }
  if (s.buffer == nullptr) {
    // Once per server, under the lock: nobody else can stage meanwhile anyway.
    const auto start = std::chrono::steady_clock::now();
    absl::StatusOr<std::unique_ptr<HostStagingBuffer>> buffer = s.allocate(s.capacity);
    if (!buffer.ok()) {
      return absl::Status(buffer.status().code(),
                          absl::StrCat(buffer.status().message(), "; nothing was applied"));
    }
    s.buffer = *std::move(buffer);
    ++s.allocations;
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (setup_seconds != nullptr) *setup_seconds = seconds;
    LOG(INFO) << absl::StrFormat(
        "weight update staging: %.2f GiB of %s host memory in %.2f s, kept for every update",
        s.capacity / 1073741824.0, s.buffer->pinned() ? "page-locked" : "pageable", seconds);
  }
  s.leased = true;
  return std::shared_ptr<Lease>(new Lease(state_));
}

size_t WeightsArena::capacity() const { return state_->capacity; }

int WeightsArena::allocations() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->allocations;
}

bool WeightsArena::pinned() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->buffer != nullptr && state_->buffer->pinned();
}

WeightsArena::Lease::~Lease() {
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->leased = false;
}

uint8_t* WeightsArena::Lease::TensorBytes(absl::string_view name) const {
  auto it = state_->offsets.find(name);
  // The buffer is constant while a lease lives: read without the lock.
  return it == state_->offsets.end() ? nullptr : state_->buffer->data() + it->second;
}

}  // namespace rollout
