// ReadTensorDataChunk against protobuf's own parse: whatever it accepts, protobuf parses to the
// same fields; the rest it leaves to protobuf.
#include "server/weights_chunk_reader.h"

#include <random>
#include <string>
#include <vector>

#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "gtest/gtest.h"
#include "rollout/v1/rollout.pb.h"

namespace rollout {
namespace {

// `bytes` cut into slices at the given offsets (sorted, inside).
std::vector<grpc::Slice> Sliced(const std::string& bytes, std::vector<size_t> cuts) {
  std::vector<grpc::Slice> slices;
  size_t begin = 0;
  cuts.push_back(bytes.size());
  for (size_t cut : cuts) {
    slices.emplace_back(bytes.data() + begin, cut - begin);
    begin = cut;
  }
  return slices;
}

std::string DataChunk(const std::string& name, uint64_t offset, const std::string& data) {
  v1::WeightsChunk chunk;
  chunk.mutable_data()->set_name(name);
  chunk.mutable_data()->set_offset(offset);
  chunk.mutable_data()->set_data(data);
  return chunk.SerializeAsString();
}

// Checks `chunk` against protobuf's parse of `bytes`: the same name, offset and data.
void ExpectSameAsProtobuf(const std::string& bytes, const TensorDataChunk& chunk,
                          const std::vector<grpc::Slice>& slices) {
  v1::WeightsChunk parsed;
  ASSERT_TRUE(parsed.ParseFromString(bytes)) << "accepted what protobuf refuses";
  ASSERT_TRUE(parsed.has_data());
  EXPECT_EQ(chunk.name, parsed.data().name());
  EXPECT_EQ(chunk.offset, parsed.data().offset());
  ASSERT_EQ(chunk.data_size, parsed.data().data().size());
  std::string copied(chunk.data_size, '\0');
  CopyMessageBytes(slices, chunk.data_begin, chunk.data_size,
                   reinterpret_cast<uint8_t*>(copied.data()));
  EXPECT_EQ(copied, parsed.data().data());
}

TEST(WeightsChunkReaderTest, ReadsAProtobufSerializedChunkInAnySlicing) {
  std::string data(100'000, '\0');
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<char>(i * 131 + 7);
  const std::string bytes = DataChunk("model.layers.0.mlp.up_proj.weight", 1 << 30, data);
  for (const std::vector<size_t>& cuts : std::vector<std::vector<size_t>>{
           {}, {1}, {2, 3, 40}, {50, 50'000}, {bytes.size() - 1}, {10, 11, 12, 13, 99'000}}) {
    const std::vector<grpc::Slice> slices = Sliced(bytes, cuts);
    TensorDataChunk chunk;
    ASSERT_TRUE(ReadTensorDataChunk(slices, &chunk)) << cuts.size() << " cuts";
    ExpectSameAsProtobuf(bytes, chunk, slices);
  }
}

// A chunk written field by field, in any order, with extra fields.
class ChunkWriter {
 public:
  ChunkWriter& Field(int number, int wire_type, const std::string& payload) {
    google::protobuf::io::StringOutputStream stream(&inner_);
    google::protobuf::io::CodedOutputStream out(&stream);
    out.WriteTag(static_cast<uint32_t>(number << 3 | wire_type));
    if (wire_type == 2) out.WriteVarint64(payload.size());
    out.WriteRaw(payload.data(), static_cast<int>(payload.size()));
    return *this;
  }
  ChunkWriter& Varint(int number, uint64_t value) {
    google::protobuf::io::StringOutputStream stream(&inner_);
    google::protobuf::io::CodedOutputStream out(&stream);
    out.WriteTag(static_cast<uint32_t>(number << 3));
    out.WriteVarint64(value);
    return *this;
  }
  // The WeightsChunk: `prefix` (raw top-level bytes), then the data item holding the fields.
  std::string Build(const std::string& prefix = "", int item = 2) const {
    std::string out = prefix;
    google::protobuf::io::StringOutputStream stream(&out);
    google::protobuf::io::CodedOutputStream coded(&stream);
    coded.WriteTag(static_cast<uint32_t>(item << 3 | 2));
    coded.WriteVarint64(inner_.size());
    coded.WriteRaw(inner_.data(), static_cast<int>(inner_.size()));
    return out;
  }

 private:
  std::string inner_;
};

TEST(WeightsChunkReaderTest, FieldsInAnyOrderRepeatedOrUnknownReadAsProtobufReadsThem) {
  const std::vector<std::string> messages = {
      // Reverse order.
      ChunkWriter().Field(3, 2, "bytes").Varint(2, 77).Field(1, 2, "x").Build(),
      // The last of each field wins.
      ChunkWriter()
          .Field(1, 2, "first")
          .Field(3, 2, "old")
          .Varint(2, 1)
          .Field(1, 2, "second")
          .Varint(2, 2)
          .Field(3, 2, "new")
          .Build(),
      // Unknown fields of every wire type, inside and at the top level.
      ChunkWriter()
          .Varint(9, 5)
          .Field(10, 2, "skip me")
          .Field(11, 5, "abcd")
          .Field(12, 1, "abcdefgh")
          .Field(1, 2, "y")
          .Field(3, 2, "zz")
          .Build(std::string("\x48\x01")),  // top level: field 9, varint 1
      // No offset (0), no data (empty).
      ChunkWriter().Field(1, 2, "n").Build(),
  };
  for (size_t i = 0; i < messages.size(); ++i) {
    const std::vector<grpc::Slice> slices = Sliced(messages[i], {messages[i].size() / 2});
    TensorDataChunk chunk;
    ASSERT_TRUE(ReadTensorDataChunk(slices, &chunk)) << i;
    ExpectSameAsProtobuf(messages[i], chunk, slices);
  }
}

TEST(WeightsChunkReaderTest, LeavesHeadersMergesAndMalformedMessagesToProtobuf) {
  v1::WeightsChunk header;
  header.mutable_header()->set_version("v");
  const std::string data = DataChunk("t", 4, "abcdefgh");
  const std::vector<std::string> messages = {
      header.SerializeAsString(),
      data + data,                                    // two data items: protobuf merges them
      header.SerializeAsString() + data,              // both items: the last wins
      data.substr(0, data.size() - 1),                // truncated
      ChunkWriter().Varint(1, 5).Build(),             // name with another wire type
      ChunkWriter().Field(2, 2, "x").Build(),         // offset with another wire type
      ChunkWriter().Varint(3, 5).Build(),             // data with another wire type
      std::string("\x12\x7f") + "short",              // item longer than the message
      std::string("\x12\x03\x0a\x05x"),               // name longer than the item
      std::string("\x12\x00\x00", 3),                 // a zero tag
      ChunkWriter().Field(1, 2, "\xc3\x28").Build(),  // a name that is not UTF-8
      "",                                             // nothing
  };
  for (size_t i = 0; i < messages.size(); ++i) {
    TensorDataChunk chunk;
    EXPECT_FALSE(ReadTensorDataChunk(Sliced(messages[i], {}), &chunk)) << "message " << i;
  }
}

TEST(WeightsChunkReaderTest, NeverAcceptsAMutatedMessageThatProtobufReadsOtherwise) {
  std::mt19937 rng(17);
  const std::string base = DataChunk("model.norm.weight", 123456, std::string(300, 'q'));
  int accepted = 0;
  for (int trial = 0; trial < 20'000; ++trial) {
    std::string bytes = base;
    const int flips = 1 + static_cast<int>(rng() % 3);
    for (int f = 0; f < flips; ++f) bytes[rng() % bytes.size()] = static_cast<char>(rng());
    if (rng() % 4 == 0) bytes.resize(rng() % bytes.size());
    std::vector<size_t> cuts;
    if (!bytes.empty() && rng() % 2 == 0) cuts.push_back(rng() % bytes.size());
    const std::vector<grpc::Slice> slices = Sliced(bytes, cuts);
    TensorDataChunk chunk;
    if (!ReadTensorDataChunk(slices, &chunk)) continue;
    ++accepted;
    ExpectSameAsProtobuf(bytes, chunk, slices);
    if (::testing::Test::HasFailure()) {
      ADD_FAILURE() << "trial " << trial;
      return;
    }
  }
  EXPECT_GT(accepted, 1000) << "most single-byte changes in the data keep a valid message";
}

}  // namespace
}  // namespace rollout
