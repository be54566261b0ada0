#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "engine/model_runner.h"
#include "model/weight_spec.h"

namespace rollout {

// The host memory weight updates are staged in, reused by every update (streamed or read from a
// path). Each served tensor has a fixed place in one buffer, which the backend allocates on the
// first update (Engine::AllocateHostStaging: page-locked on CUDA, so that a swap copies at the
// bus rate) and which is never zero-filled, freed or allocated again: one model's worth of host
// memory, held from the first update on. One update holds it at a time (the service's update
// slot admits one), through a Lease, until the engine has copied its bytes or it failed.
// Thread-safe; the leases may outlive it.
class WeightsArena {
 public:
  using Allocator = std::function<absl::StatusOr<std::unique_ptr<HostStagingBuffer>>(size_t bytes)>;
  class Lease;

  // Places for every tensor of `specs`; `allocate` is called (from Acquire) once, for all.
  WeightsArena(const std::vector<WeightSpec>& specs, Allocator allocate);
  WeightsArena(const WeightsArena&) = delete;
  WeightsArena& operator=(const WeightsArena&) = delete;

  // The arena for one update, which has it until the lease is destroyed. The first call
  // allocates the buffer, and says how long that took in *setup_seconds (0 afterwards).
  // ABORTED while another lease lives (the update slot makes that a bug); RESOURCE_EXHAUSTED
  // when the memory cannot be had (the next call tries again).
  absl::StatusOr<std::shared_ptr<Lease>> Acquire(double* setup_seconds = nullptr);

  size_t capacity() const;  // bytes, every tensor's place included
  int allocations() const;  // calls to the allocator that succeeded: 0, then 1 for good
  bool pinned() const;      // the buffer is page-locked (false before the first Acquire)

 private:
  struct State;
  std::shared_ptr<State> state_;
};

// One update's hold on the arena. Not thread-safe: the update that holds it writes it, then
// the engine reads it.
class WeightsArena::Lease {
 public:
  ~Lease();
  Lease(const Lease&) = delete;
  Lease& operator=(const Lease&) = delete;

  // Where tensor `name`'s bytes are staged (its spec's nbytes), or nullptr for a name that is
  // not in the specs.
  uint8_t* TensorBytes(absl::string_view name) const;

 private:
  friend class WeightsArena;
  explicit Lease(std::shared_ptr<State> state) : state_(std::move(state)) {}
  const std::shared_ptr<State> state_;
};

}  // namespace rollout
