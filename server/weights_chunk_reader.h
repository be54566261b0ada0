#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "grpcpp/support/slice.h"

namespace rollout {

// Where a TensorData chunk's fields are in a serialized WeightsChunk, read off the wire without
// copying its bytes: an update's gigabytes then go from gRPC's receive buffers to their staging
// place in one copy (CopyMessageBytes) instead of two (protobuf's parse into a string, then
// the staging copy).
struct TensorDataChunk {
  std::string name;
  uint64_t offset = 0;
  size_t data_begin = 0;  // byte offset of the data field's bytes in the message
  size_t data_size = 0;
};

// Reads `message` (one serialized WeightsChunk, in pieces) as a data chunk when it is one in
// the form protobuf serializers write: the `data` item once at the top level (unknown fields
// skipped), its name, offset and data fields in any order (the last of each wins, as in
// protobuf). Returns false for anything else -- a header, the item twice or both items, a known
// field with another wire type, a malformed or truncated message -- which the caller parses
// with protobuf, so every message it reads gets protobuf's answer. Every message it accepts
// parses with protobuf to the same fields.
bool ReadTensorDataChunk(const std::vector<grpc::Slice>& message, TensorDataChunk* chunk);

// Copies `size` bytes of `message` from byte `begin` to `out`.
// REQUIRES: begin + size <= the message's size.
void CopyMessageBytes(const std::vector<grpc::Slice>& message, size_t begin, size_t size,
                      uint8_t* out);

}  // namespace rollout
