// The raw data-chunk messages the client writes: protobuf reads them as the TensorData they
// stand for, and the caller's bytes are known free once gRPC lets go of them.
#include "client/weights_stream.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace rollout::client_internal {
namespace {

TEST(WeightsStreamTest, ADataChunkMessageParsesAsTheTensorDataItStandsFor) {
  std::string bytes(300'000, '\0');
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<char>(i * 29 + 3);
  auto p = reinterpret_cast<const uint8_t*>(bytes.data());
  for (const RawChunk& chunk : {RawChunk{"model.embed_tokens.weight", 0, p, bytes.size()},
                                RawChunk{"x", uint64_t{5} << 33, p + 7, 1},
                                RawChunk{std::string(200, 'n'), 300, p + 1, 127}}) {
    SliceTracker tracker;
    {
      grpc::ByteBuffer message = DataChunkMessage(chunk, &tracker);
      grpc::Slice flat;
      ASSERT_TRUE(message.DumpToSingleSlice(&flat).ok());
      rollout::v1::WeightsChunk parsed;
      ASSERT_TRUE(parsed.ParseFromArray(flat.begin(), static_cast<int>(flat.size())));
      ASSERT_TRUE(parsed.has_data());
      EXPECT_EQ(parsed.data().name(), chunk.name);
      EXPECT_EQ(parsed.data().offset(), chunk.offset);
      EXPECT_EQ(parsed.data().data(),
                std::string(reinterpret_cast<const char*>(chunk.data), chunk.size));
      // The same bytes protobuf would have written.
      rollout::v1::WeightsChunk typed;
      typed.mutable_data()->set_name(chunk.name);
      typed.mutable_data()->set_offset(chunk.offset);
      typed.mutable_data()->set_data(chunk.data, chunk.size);
      EXPECT_EQ(std::string(reinterpret_cast<const char*>(flat.begin()), flat.size()),
                typed.SerializeAsString());
    }
    tracker.WaitForNone();  // returns: the message and its copies are gone
  }
}

}  // namespace
}  // namespace rollout::client_internal
