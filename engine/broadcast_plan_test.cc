// The broadcast plan against the golden vectors the Python trainer side is tested against too
// (tests/testdata/broadcast_plan_golden.json), its invariants on other inputs, and the handshake.
#include "engine/broadcast_plan.h"

#include <algorithm>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "gtest/gtest.h"
#include "model/weight_digest.h"
#include "nlohmann/json.hpp"

namespace rollout {
namespace {

using json = nlohmann::json;

json Golden() {
  std::ifstream in(std::string(ROLLOUT_TESTDATA_DIR) + "/broadcast_plan_golden.json");
  EXPECT_TRUE(in.good()) << "tests/testdata/broadcast_plan_golden.json";
  std::stringstream text;
  text << in.rdbuf();
  return json::parse(text.str());
}

std::vector<BroadcastTensor> Tensors(const json& c) {
  std::vector<BroadcastTensor> tensors;
  for (const json& t : c["tensors"]) {
    tensors.push_back({t["name"].get<std::string>(), *ParseDType(t["dtype"].get<std::string>()),
                       t["shape"].get<std::vector<int64_t>>()});
  }
  return tensors;
}

TEST(BroadcastPlanTest, TheGoldenVectorsAreWhatBothSidesCompute) {
  const json golden = Golden();
  ASSERT_EQ(golden["alignment"].get<uint64_t>(), kBroadcastAlignment);
  ASSERT_GE(golden["cases"].size(), 3u);
  for (const json& c : golden["cases"]) {
    SCOPED_TRACE(c["description"].get<std::string>());
    const uint64_t bucket_bytes = c["bucket_bytes"].get<uint64_t>();
    const BroadcastPlan plan = PlanBroadcast(Tensors(c), bucket_bytes);
    EXPECT_EQ(BroadcastPlanText(plan.tensors, bucket_bytes), c["plan_text"].get<std::string>());
    EXPECT_EQ(absl::BytesToHexString(plan.digest), c["plan_digest"].get<std::string>());
    EXPECT_EQ(plan.offsets, c["offsets"].get<std::vector<uint64_t>>());
    EXPECT_EQ(plan.total_bytes, c["total_bytes"].get<uint64_t>());
    EXPECT_EQ(plan.payload_bytes, c["payload_bytes"].get<uint64_t>());
    ASSERT_EQ(plan.buckets.size(), c["buckets"].size());
    for (size_t j = 0; j < plan.buckets.size(); ++j) {
      const json& b = c["buckets"][j];
      EXPECT_EQ(plan.buckets[j].stream_offset, b["stream_offset"].get<uint64_t>()) << j;
      EXPECT_EQ(plan.buckets[j].size, b["size"].get<uint64_t>()) << j;
      std::vector<std::vector<uint64_t>> slices;
      for (const BroadcastSlice& s : plan.buckets[j].slices) {
        slices.push_back({s.tensor, s.tensor_offset, s.bucket_offset, s.size});
      }
      EXPECT_EQ(slices, b["slices"].get<std::vector<std::vector<uint64_t>>>()) << j;
      const BucketLeaves leaves = LeavesCompletedBy(plan, j);
      std::vector<std::vector<uint64_t>> runs;
      for (const LeafRun& r : leaves.runs) runs.push_back({r.tensor, r.first_leaf, r.num_leaves});
      EXPECT_EQ(runs, c["leaves"][j]["runs"].get<std::vector<std::vector<uint64_t>>>()) << j;
      EXPECT_EQ((std::vector<size_t>{leaves.first_completed, leaves.end_completed}),
                c["leaves"][j]["completed"].get<std::vector<size_t>>())
          << j;
    }
    EXPECT_EQ(absl::BytesToHexString(EncodeHandshake(
                  {HandshakeRole::kSource, true, 0, plan.total_bytes, plan.digest})),
              c["source_handshake_rank0"].get<std::string>());
    EXPECT_EQ(absl::BytesToHexString(EncodeHandshake(
                  {HandshakeRole::kReceiver, false, 2, plan.total_bytes, plan.digest})),
              c["receiver_handshake_refused_source2"].get<std::string>());
  }
}

// Tensors of odd sizes around the alignment, the leaf and the bucket (1, 255, 256, 257, 65535,
// 65536, 65537, ...), in buckets of several sizes.
std::vector<BroadcastTensor> OddTensors() {
  std::vector<BroadcastTensor> tensors;
  int i = 0;
  for (int64_t n : {1, 255, 256, 257, 65535, 65536, 65537, 131071, 3, 200000, 1}) {
    tensors.push_back({"t" + std::to_string(i++), i % 3 == 0 ? DType::kF32 : DType::kBF16, {n}});
  }
  return tensors;
}

TEST(BroadcastPlanTest, EveryTensorByteTravelsExactlyOnceAndTensorsStartAligned) {
  for (uint64_t bucket_bytes : {7ull, 256ull, 1000ull, 65536ull, 100000ull, 1ull << 30}) {
    SCOPED_TRACE(bucket_bytes);
    const BroadcastPlan plan = PlanBroadcast(OddTensors(), bucket_bytes);
    std::vector<std::vector<char>> seen(plan.tensors.size());
    for (size_t t = 0; t < plan.tensors.size(); ++t) {
      EXPECT_EQ(plan.offsets[t] % kBroadcastAlignment, 0u);
      seen[t].assign(plan.tensors[t].nbytes(), 0);
    }
    uint64_t stream = 0;
    for (const BroadcastBucket& b : plan.buckets) {
      EXPECT_EQ(b.stream_offset, stream);  // contiguous, in order
      EXPECT_LE(b.size, bucket_bytes);
      for (const BroadcastSlice& s : b.slices) {
        EXPECT_LE(s.bucket_offset + s.size, b.size);
        // The slice is where the tensor's bytes are in the stream.
        EXPECT_EQ(b.stream_offset + s.bucket_offset, plan.offsets[s.tensor] + s.tensor_offset);
        for (uint64_t k = 0; k < s.size; ++k) ++seen[s.tensor][s.tensor_offset + k];
      }
      stream += b.size;
    }
    EXPECT_EQ(stream, plan.total_bytes);
    for (size_t t = 0; t < seen.size(); ++t) {
      for (size_t k = 0; k < seen[t].size(); ++k) {
        ASSERT_EQ(seen[t][k], 1) << "tensor " << t << " byte " << k;
      }
    }
  }
}

TEST(BroadcastPlanTest, EveryLeafIsHashedAfterItsLastByteArrivedAndTensorsCompleteInOrder) {
  for (uint64_t bucket_bytes : {1000ull, 65536ull, 70000ull, 1ull << 20}) {
    SCOPED_TRACE(bucket_bytes);
    const BroadcastPlan plan = PlanBroadcast(OddTensors(), bucket_bytes);
    std::vector<std::vector<int>> leaf_seen(plan.tensors.size());
    for (size_t t = 0; t < plan.tensors.size(); ++t) {
      leaf_seen[t].assign((plan.tensors[t].nbytes() + kDigestLeafBytes - 1) / kDigestLeafBytes, 0);
    }
    size_t completed = 0;
    for (size_t j = 0; j < plan.buckets.size(); ++j) {
      const uint64_t reach = plan.buckets[j].stream_offset + plan.buckets[j].size;
      const BucketLeaves leaves = LeavesCompletedBy(plan, j);
      for (const LeafRun& r : leaves.runs) {
        for (uint64_t i = r.first_leaf; i < r.first_leaf + r.num_leaves; ++i) {
          ++leaf_seen[r.tensor][i];
          const uint64_t leaf_end =
              std::min<uint64_t>((i + 1) * kDigestLeafBytes, plan.tensors[r.tensor].nbytes());
          EXPECT_LE(plan.offsets[r.tensor] + leaf_end, reach) << "a leaf hashed before it arrived";
          EXPECT_GT(plan.offsets[r.tensor] + leaf_end, plan.buckets[j].stream_offset);
        }
      }
      EXPECT_EQ(leaves.first_completed, completed);
      EXPECT_GE(leaves.end_completed, leaves.first_completed);
      for (size_t t = leaves.first_completed; t < leaves.end_completed; ++t) {
        for (int seen : leaf_seen[t]) EXPECT_EQ(seen, 1) << "tensor " << t << " completed early";
      }
      completed = leaves.end_completed;
    }
    EXPECT_EQ(completed, plan.tensors.size());
    for (const auto& leaves : leaf_seen) {
      for (int seen : leaves) EXPECT_EQ(seen, 1);
    }
  }
}

TEST(BroadcastPlanTest, ThePlanDigestNamesTensorsOrderShapesDtypesAndTheBucketSize) {
  const std::vector<BroadcastTensor> base = {{"a", DType::kBF16, {4, 8}}, {"b", DType::kF32, {8}}};
  const std::string digest = PlanBroadcast(base, 4096).digest;
  ASSERT_EQ(digest.size(), 32u);
  EXPECT_EQ(PlanBroadcast(base, 4096).digest, digest);
  std::vector<std::vector<BroadcastTensor>> others = {base, base, base, base};
  std::swap(others[0][0], others[0][1]);  // order
  others[1][0].shape = {8, 4};            // shape, same size
  others[2][1].dtype = DType::kF16;       // dtype
  others[3][0].name = "c";                // name
  for (const auto& t : others) EXPECT_NE(PlanBroadcast(t, 4096).digest, digest);
  EXPECT_NE(PlanBroadcast(base, 8192).digest, digest) << "the bucket size";
}

std::string Gathered(const std::vector<HandshakeRecord>& records) {
  std::string all;
  for (const HandshakeRecord& r : records) all += EncodeHandshake(r);
  return all;
}

TEST(BroadcastPlanTest, TheHandshakeGoesAheadOnlyWhenEveryRankAgreesAndSaysWhoDoesNot) {
  const std::string plan(32, 'p'), other(32, 'q');
  const HandshakeRecord source{HandshakeRole::kSource, true, 0, 100, plan};
  const HandshakeRecord ready{HandshakeRole::kReceiver, true, 0, 100, plan};
  EXPECT_TRUE(HandshakeVerdict(Gathered({source, ready, ready}), 3, 1).ok());
  // The source need not be rank 0.
  HandshakeRecord ready2 = ready;
  ready2.source_rank = 2;
  HandshakeRecord source2 = source;
  source2.source_rank = 2;
  EXPECT_TRUE(HandshakeVerdict(Gathered({ready2, ready2, source2}), 3, 0).ok());

  HandshakeRecord refused = ready;
  refused.ready = false;
  absl::Status s = HandshakeVerdict(Gathered({source, ready, refused}), 3, 1);
  EXPECT_EQ(s.code(), absl::StatusCode::kAborted);
  EXPECT_NE(s.message().find("rank(s) 2"), std::string::npos) << s;

  HandshakeRecord mismatched = ready;
  mismatched.plan_digest = other;
  s = HandshakeVerdict(Gathered({source, mismatched, ready}), 3, 1);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("this server's"), std::string::npos) << s;

  HandshakeRecord wrong_source = ready;
  wrong_source.source_rank = 2;
  s = HandshakeVerdict(Gathered({source, wrong_source, ready}), 3, 2);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("expects rank 2"), std::string::npos) << s;

  s = HandshakeVerdict(Gathered({ready, ready}), 2, 1);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << "no source";
  s = HandshakeVerdict(Gathered({source, source}), 2, 1);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << "two sources";

  std::string garbage = Gathered({source, ready});
  garbage[kHandshakeBytes] = 'X';
  EXPECT_EQ(HandshakeVerdict(garbage, 2, 1).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(HandshakeVerdict(Gathered({source}), 2, 1).code(),
            absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace rollout
