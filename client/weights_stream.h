#pragma once

#include <grpcpp/grpcpp.h>

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>

#include "absl/status/statusor.h"
#include "rollout/v1/rollout.pb.h"

// RolloutClient's UpdateWeights stream on raw messages (RolloutClient::UpdateWeightsFromTensors):
// a data chunk goes to gRPC as a few bytes of message fields followed by a slice over the
// caller's memory, instead of being copied into a TensorData and serialized again -- two
// copies of every byte on the one thread that writes a stream. The wire format is the proto's.
namespace rollout::client_internal {

// A TensorData chunk whose bytes the caller keeps alive until gRPC lets go of them (see
// StreamUpdateWeights).
struct RawChunk {
  std::string name;
  uint64_t offset = 0;
  const uint8_t* data = nullptr;
  size_t size = 0;
};

class SliceTracker;

// Writes `header`, then one data chunk per next_chunk call that returns true, on
// `context` (prepared by the caller: deadline, token); then half-closes and returns the
// server's answer. A write that fails because the call ended (the server refused something)
// stops the stream and the server's status is returned unchanged; INTERNAL when the server
// answered OK before the whole stream was written.
//
// gRPC may still hold slices over chunks it had not sent when the call ended, until `context`
// is destroyed; each is registered with `tracker`. So a chunk's bytes are free once the caller
// has destroyed `context` and then tracker->WaitForNone() has returned. (Waiting while `context`
// lives would wait for ever after an early refusal.)
absl::StatusOr<rollout::v1::UpdateWeightsResponse> StreamUpdateWeights(
    const std::shared_ptr<grpc::Channel>& channel, grpc::ClientContext* context,
    SliceTracker* tracker, const rollout::v1::WeightsHeader& header,
    const std::function<bool(RawChunk*)>& next_chunk);

// Counts the chunk slices gRPC still holds, so that the caller's bytes are known to be free.
// Thread-safe: gRPC drops slices on its own threads.
class SliceTracker {
 public:
  void Add();
  void Release();
  void WaitForNone();  // until every slice added was released

 private:
  std::mutex mu_;
  std::condition_variable none_;
  int64_t held_ = 0;  // guarded by mu_
};

// The serialized WeightsChunk {data: {name, offset, data}} of `chunk`: its fields, then the
// bytes, as a buffer of two slices, the second over chunk.data (not copied; registered with
// `tracker` until gRPC drops it). What StreamUpdateWeights writes.
grpc::ByteBuffer DataChunkMessage(const RawChunk& chunk, SliceTracker* tracker);

}  // namespace rollout::client_internal
