#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"

namespace rollout {

// One rank's handle on the CPU backend's tensor-parallel group (the analogue of an ncclComm_t):
// collectives are called by every rank of the group, each from the thread that runs that rank,
// in the same sequence, on host memory. The only collectives are the ones that move bits without
// arithmetic: the ordered reductions of tensor parallelism are done by the caller on gathered
// partials (a fixed tree, kernels/cpu/ops.h), never inside the communicator, so nothing can
// depend on message size, algorithm or chunking.
//
// The CUDA backend has its own interface for the same rule, cuda::RankGroup
// (kernels/cuda/rank_group.h): there one host thread enqueues the collectives of every rank on
// the ranks' streams and nothing blocks, while here each rank is a thread that blocks in the
// collective. One interface for both would have to be one of those two models.
class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  virtual const char* kind() const = 0;  // "in-process", "nccl", ...

  // recv[i * count, (i + 1) * count) = rank i's `send` (count floats), for every rank i, in
  // rank order: exact copies. Every rank passes the same count (checked where possible). recv
  // holds world_size() * count floats; send may be recv + rank() * count (in place).
  virtual absl::Status AllGather(const float* send, int64_t count, float* recv) = 0;

  // Returns once every rank of the group has called it.
  virtual absl::Status Barrier() = 0;
};

// A group of `world_size` ranks that are threads of this process sharing memory (the CPU
// backend's tensor parallelism).
// Returns one communicator per rank, index = rank; each must be used only by its rank's thread.
// AllGather: every rank publishes its send pointer, a barrier, every rank copies all peers'
// buffers into its own recv in rank order, a barrier (so no rank reuses its send buffer while
// a peer still reads it). A rank that stops calling collectives blocks its peers: callers
// check their inputs before the ranks start.
std::vector<std::unique_ptr<Communicator>> CreateInProcessGroup(int world_size);

}  // namespace rollout
