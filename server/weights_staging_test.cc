// The staging arena and WeightsStaging on their own: memory reused across updates, one update at
// a time, and the arena back as soon as an update ends either way.
#include "server/weights_staging.h"

#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "model/weight_digest.h"
#include "server/weights_arena.h"

namespace rollout {
namespace {

const std::vector<WeightSpec>& Specs() {
  // Odd sizes, so that places are not multiples of the alignment by accident.
  static const std::vector<WeightSpec> specs = {
      {"a", DType::kBF16, {3, 5}}, {"b", DType::kF32, {7}}, {"c", DType::kBF16, {4099}}};
  return specs;
}

// Plain memory, counting the calls; fails the first `failures` of them.
struct CountingAllocator {
  int calls = 0;
  int failures = 0;
  WeightsArena::Allocator Get() {
    return [this](size_t bytes) -> absl::StatusOr<std::unique_ptr<HostStagingBuffer>> {
      if (calls++ < failures) return absl::ResourceExhaustedError("no memory today");
      return AllocatePlainHostStaging(bytes);
    };
  }
};

TEST(WeightsArenaTest, OnlyTheFirstUpdateAllocatesAndEveryOneGetsTheSamePlaces) {
  CountingAllocator allocator;
  WeightsArena arena(Specs(), allocator.Get());
  EXPECT_EQ(arena.allocations(), 0) << "nothing before the first update";
  std::vector<uint8_t*> places;
  for (int update = 0; update < 3; ++update) {
    double setup = -1;
    absl::StatusOr<std::shared_ptr<WeightsArena::Lease>> lease = arena.Acquire(&setup);
    ASSERT_TRUE(lease.ok()) << lease.status();
    if (update > 0) {
      EXPECT_EQ(setup, 0.0) << "update " << update << " allocated nothing";
    }
    for (const WeightSpec& spec : Specs()) {
      uint8_t* place = (*lease)->TensorBytes(spec.name);
      ASSERT_NE(place, nullptr) << spec.name;
      if (update == 0) {
        places.push_back(place);
      } else {
        EXPECT_EQ(place, places[&spec - Specs().data()]) << spec.name << ", update " << update;
      }
    }
    EXPECT_EQ((*lease)->TensorBytes("not-a-weight"), nullptr);
  }
  EXPECT_EQ(allocator.calls, 1);
  EXPECT_EQ(arena.allocations(), 1);
  EXPECT_FALSE(arena.pinned()) << "plain memory";
}

TEST(WeightsArenaTest, PlacesArePageAlignedDisjointAndInsideTheBuffer) {
  WeightsArena arena(Specs(), AllocatePlainHostStaging);
  absl::StatusOr<std::shared_ptr<WeightsArena::Lease>> lease = arena.Acquire();
  ASSERT_TRUE(lease.ok());
  const uint8_t* base = (*lease)->TensorBytes(Specs()[0].name);
  size_t end_of_previous = 0;
  for (const WeightSpec& spec : Specs()) {  // sorted by name, laid out in that order
    const size_t offset = (*lease)->TensorBytes(spec.name) - base;
    EXPECT_EQ(offset % 4096, 0u) << spec.name;
    EXPECT_GE(offset, end_of_previous) << spec.name;
    end_of_previous = offset + spec.nbytes();
  }
  EXPECT_LE(end_of_previous, arena.capacity());
}

TEST(WeightsArenaTest, OneUpdateHoldsItAtATime) {
  WeightsArena arena(Specs(), AllocatePlainHostStaging);
  absl::StatusOr<std::shared_ptr<WeightsArena::Lease>> first = arena.Acquire();
  ASSERT_TRUE(first.ok());
  absl::StatusOr<std::shared_ptr<WeightsArena::Lease>> second = arena.Acquire();
  EXPECT_EQ(second.status().code(), absl::StatusCode::kAborted);
  EXPECT_NE(second.status().message().find("one update at a time"), std::string::npos);
  first->reset();
  EXPECT_TRUE(arena.Acquire().ok()) << "free again once the lease is gone";
}

TEST(WeightsArenaTest, AFailedAllocationKeepsNothingAndTheNextUpdateTriesAgain) {
  CountingAllocator allocator;
  allocator.failures = 1;
  WeightsArena arena(Specs(), allocator.Get());
  absl::StatusOr<std::shared_ptr<WeightsArena::Lease>> failed = arena.Acquire();
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(failed.status().message().find("nothing was applied"), std::string::npos);
  EXPECT_TRUE(arena.Acquire().ok());
  EXPECT_EQ(allocator.calls, 2);
}

TEST(WeightsArenaTest, ALeaseOutlivingTheArenaKeepsItsMemory) {
  std::shared_ptr<WeightsArena::Lease> lease;
  {
    WeightsArena arena(Specs(), AllocatePlainHostStaging);
    lease = *arena.Acquire();
  }
  std::memset(lease->TensorBytes("c"), 7, Specs()[2].nbytes());  // ASan: no use after free
}

v1::WeightsHeader HeaderFor(const std::vector<std::string>& names) {
  v1::WeightsHeader header;
  header.set_version("v1");
  for (const std::string& name : names) {
    const WeightSpec* spec = FindWeightSpec(Specs(), name);
    v1::TensorDecl* decl = header.add_tensors();
    decl->set_name(name);
    decl->set_dtype(DTypeName(spec->dtype));
    for (int64_t d : spec->shape) decl->add_shape(d);
  }
  return header;
}

v1::TensorData Data(const std::string& name, uint64_t offset, const std::string& bytes) {
  v1::TensorData data;
  data.set_name(name);
  data.set_offset(offset);
  data.set_data(bytes);
  return data;
}

bool ArenaIsFree(WeightsArena* arena) { return arena->Acquire().ok(); }

TEST(WeightsStagingTest, TheArenaIsHeldFromAValidHeaderUntilAbandon) {
  WeightsArena arena(Specs(), AllocatePlainHostStaging);
  WeightsStaging staging(&Specs(), &arena);
  v1::WeightsHeader bad = HeaderFor({"a"});
  bad.mutable_tensors(0)->set_shape(0, 4);
  EXPECT_FALSE(staging.SetHeader(bad).ok());
  EXPECT_TRUE(ArenaIsFree(&arena)) << "a refused header takes nothing";
  ASSERT_TRUE(staging.SetHeader(HeaderFor({"a", "c"})).ok());
  EXPECT_FALSE(ArenaIsFree(&arena));
  // A tensor complete (its hashing queued), then the update fails.
  ASSERT_TRUE(staging.AddData(Data("a", 0, std::string(Specs()[0].nbytes(), 'x'))).ok());
  EXPECT_FALSE(staging.AddData(Data("a", 0, "y")).ok()) << "overlap";
  staging.Abandon();
  EXPECT_TRUE(ArenaIsFree(&arena)) << "back at once, for a caller who retries";
}

// A policy that is not an InFlightPolicy value is refused naming the field (it ran as DRAIN:
// review26 finding 5); the defined ones, and 0 (unset, DRAIN), pass.
TEST(WeightsStagingTest, AHeaderWhosePolicyIsNotAnInFlightPolicyIsRefusedNamingIt) {
  WeightsArena arena(Specs(), AllocatePlainHostStaging);
  for (const int policy : {4, 9, -1}) {
    WeightsStaging staging(&Specs(), &arena);
    v1::WeightsHeader header = HeaderFor({"a"});
    header.set_policy(static_cast<v1::InFlightPolicy>(policy));
    const absl::Status s = staging.SetHeader(header);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << policy << ": " << s;
    EXPECT_NE(s.message().find(absl::StrCat("header.policy is ", policy)), std::string::npos) << s;
    EXPECT_TRUE(ArenaIsFree(&arena)) << "a refused header takes nothing";
  }
  for (const int policy : {0, 1, 2, 3}) {
    EXPECT_TRUE(CheckPolicy(static_cast<v1::InFlightPolicy>(policy), "policy").ok()) << policy;
  }
}

// A chunk whose offset + size passes 2^64 is refused with its range as given, not wrapped
// ("[18446744073709551614, 2)": review26 finding 8).
TEST(WeightsStagingTest, AnOverflowingChunkIsRefusedWithItsRangeAsGiven) {
  WeightsArena arena(Specs(), AllocatePlainHostStaging);
  WeightsStaging staging(&Specs(), &arena);
  ASSERT_TRUE(staging.SetHeader(HeaderFor({"a"})).ok());
  const absl::Status s = staging.AddData(Data("a", ~uint64_t{0} - 1, "abcd"));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("[18446744073709551614, 18446744073709551614 + 4)"),
            std::string::npos)
      << s;
  staging.Abandon();
}

TEST(WeightsStagingTest, FinishHandsTheStagedBytesAndTheArenaToTheUpdate) {
  WeightsArena arena(Specs(), AllocatePlainHostStaging);
  const std::string c_bytes(Specs()[2].nbytes(), 'c');
  for (int update = 0; update < 2; ++update) {  // the second reuses the first's memory
    WeightsStaging staging(&Specs(), &arena);
    ASSERT_TRUE(staging.SetHeader(HeaderFor({"c"})).ok());
    // Out of order, in uneven chunks.
    ASSERT_TRUE(staging.AddData(Data("c", 4000, c_bytes.substr(4000))).ok());
    ASSERT_TRUE(staging.AddData(Data("c", 0, c_bytes.substr(0, 4000))).ok());
    double digest_wait = -1;
    absl::StatusOr<WeightUpdate> update_or = staging.Finish(&digest_wait);
    ASSERT_TRUE(update_or.ok()) << update_or.status();
    WeightUpdate& u = *update_or;
    EXPECT_GE(digest_wait, 0.0);
    ASSERT_EQ(u.tensors.size(), 1u);
    EXPECT_EQ(std::string(reinterpret_cast<const char*>(u.tensors[0].data), u.tensors[0].nbytes),
              c_bytes);
    EXPECT_EQ(u.digests.at("c"),
              TensorDigest(reinterpret_cast<const uint8_t*>(c_bytes.data()), c_bytes.size()));
    EXPECT_FALSE(ArenaIsFree(&arena)) << "the update holds it";
    u.bytes.reset();
    EXPECT_TRUE(ArenaIsFree(&arena));
  }
}

TEST(WeightsStagingTest, AnIncompleteStreamFailsAndGivesTheArenaBack) {
  WeightsArena arena(Specs(), AllocatePlainHostStaging);
  {
    WeightsStaging staging(&Specs(), &arena);
    ASSERT_TRUE(staging.SetHeader(HeaderFor({"b"})).ok());
    ASSERT_TRUE(staging.AddData(Data("b", 4, std::string(24, 'b'))).ok());
    absl::StatusOr<WeightUpdate> update = staging.Finish();
    EXPECT_EQ(update.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(update.status().message().find("bytes from 0 on are missing"), std::string::npos);
  }  // destroyed: as Abandon
  EXPECT_TRUE(ArenaIsFree(&arena));
}

TEST(WeightsStagingTest, ASecondStagingIsRefusedWhileTheFirstHoldsTheArena) {
  WeightsArena arena(Specs(), AllocatePlainHostStaging);
  WeightsStaging first(&Specs(), &arena), second(&Specs(), &arena);
  ASSERT_TRUE(first.SetHeader(HeaderFor({"a"})).ok());
  EXPECT_EQ(second.SetHeader(HeaderFor({"a"})).code(), absl::StatusCode::kAborted);
  first.Abandon();
  EXPECT_TRUE(second.SetHeader(HeaderFor({"a"})).ok());
}

std::string F32Bytes(const std::vector<float>& values) {
  return std::string(reinterpret_cast<const char*>(values.data()), values.size() * 4);
}

std::vector<float> Ramp(size_t n) {  // values whose bf16 rounding is visible
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = 0.1f * static_cast<float>(i) + 1.0f / 3.0f;
  return v;
}

// An F32 push to a BF16 weight is cast on arrival (round to nearest even) and hashed as served,
// whether its chunks are whole elements or cut them anywhere, in any order.
TEST(WeightsStagingTest, AnotherFloatDtypeIsCastToTheServedOneAndHashedAsServed) {
  WeightsArena arena(Specs(), AllocatePlainHostStaging);
  const std::vector<float> values = Ramp(15);  // "a": BF16 [3, 5]
  const std::string wire = F32Bytes(values);
  std::string served(30, '\0');
  for (size_t i = 0; i < values.size(); ++i) {
    const uint16_t h = F32ToBF16(values[i]);
    std::memcpy(&served[2 * i], &h, 2);
  }
  // Whole elements; elements cut at odd offsets, out of order; one byte at a time.
  const std::vector<std::vector<std::pair<size_t, size_t>>> chunkings = {
      {{0, 20}, {20, 60}}, {{33, 60}, {0, 7}, {7, 33}}, {}};
  for (size_t k = 0; k < chunkings.size(); ++k) {
    std::vector<std::pair<size_t, size_t>> chunks = chunkings[k];
    if (chunks.empty()) {
      for (size_t b = 60; b-- > 0;) chunks.push_back({b, b + 1});
    }
    WeightsStaging staging(&Specs(), &arena);
    v1::WeightsHeader header = HeaderFor({"a"});
    header.mutable_tensors(0)->set_dtype("F32");
    ASSERT_TRUE(staging.SetHeader(header).ok()) << k;
    for (const auto& [begin, end] : chunks) {
      ASSERT_TRUE(staging.AddData(Data("a", begin, wire.substr(begin, end - begin))).ok()) << k;
    }
    absl::StatusOr<WeightUpdate> u = staging.Finish();
    ASSERT_TRUE(u.ok()) << k << ": " << u.status();
    ASSERT_EQ(u->tensors.size(), 1u);
    EXPECT_EQ(u->tensors[0].dtype, DType::kBF16);
    EXPECT_EQ(u->tensors[0].nbytes, 30u);
    EXPECT_EQ(std::string(reinterpret_cast<const char*>(u->tensors[0].data), 30), served) << k;
    EXPECT_EQ(u->digests.at("a"),
              TensorDigest(reinterpret_cast<const uint8_t*>(served.data()), served.size()))
        << k;
    EXPECT_EQ(staging.bytes_received(), 60u);
  }
  // The other way: BF16 bytes widened exactly into the F32 weight "b" [7].
  WeightsStaging staging(&Specs(), &arena);
  v1::WeightsHeader header = HeaderFor({"b"});
  header.mutable_tensors(0)->set_dtype("BF16");
  ASSERT_TRUE(staging.SetHeader(header).ok());
  std::string bf16(14, '\0');
  std::vector<float> widened(7);
  for (int i = 0; i < 7; ++i) {
    const uint16_t h = F32ToBF16(values[i]);
    std::memcpy(&bf16[2 * i], &h, 2);
    widened[i] = BF16ToF32(h);
  }
  ASSERT_TRUE(staging.AddData(Data("b", 0, bf16)).ok());
  absl::StatusOr<WeightUpdate> u = staging.Finish();
  ASSERT_TRUE(u.ok()) << u.status();
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(u->tensors[0].data), 28), F32Bytes(widened));
}

TEST(WeightsStagingTest, ACastTensorIsCheckedInItsDeclaredBytesAndOverflowIsRefused) {
  WeightsArena arena(Specs(), AllocatePlainHostStaging);
  {
    // Declared F32, sent as many bytes as the served BF16 has: half of it is missing.
    WeightsStaging staging(&Specs(), &arena);
    v1::WeightsHeader header = HeaderFor({"a"});
    header.mutable_tensors(0)->set_dtype("F32");
    ASSERT_TRUE(staging.SetHeader(header).ok());
    ASSERT_TRUE(staging.AddData(Data("a", 0, std::string(30, 'x'))).ok());
    const absl::Status s = staging.Finish().status();
    EXPECT_NE(s.message().find("bytes from 30 on are missing (it has 60)"), std::string::npos) << s;
    EXPECT_FALSE(staging.AddData(Data("a", 60, "x")).ok()) << "beyond its 60 bytes";
  }
  {
    // A value no BF16 can hold (the largest float rounds up to infinity): refused, by name.
    WeightsStaging staging(&Specs(), &arena);
    v1::WeightsHeader header = HeaderFor({"a"});
    header.mutable_tensors(0)->set_dtype("F32");
    ASSERT_TRUE(staging.SetHeader(header).ok());
    std::vector<float> values = Ramp(15);
    values[9] = std::numeric_limits<float>::max();
    const absl::Status s = staging.AddData(Data("a", 0, F32Bytes(values)));
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find("tensor 'a': element 9"), std::string::npos) << s;
    EXPECT_NE(s.message().find("BF16"), std::string::npos) << s;
  }
  EXPECT_TRUE(ArenaIsFree(&arena));
}

// A checkpoint read from disk is hashed a bounded batch at a time, and a caller that gave up
// after the reads stops the update there (the digest takes as long as the read: unchecked, it
// held the update slot that long past the caller's deadline).
TEST(WeightsStagingTest, ACheckpointLoadStopsBeforeHashingWhenTheCallerGaveUp) {
  const std::string dir = ::testing::TempDir() + "weights-staging-hash-cancel";
  std::filesystem::create_directories(dir);
  std::vector<HostTensor> tensors;
  for (const WeightSpec& spec : Specs()) {
    tensors.push_back({spec.name, spec.dtype, spec.shape, std::vector<uint8_t>(spec.nbytes(), 7)});
  }
  ASSERT_TRUE(WriteSafetensors(dir + "/model.safetensors", tensors).ok());
  std::ofstream(dir + "/config.json") << "{}";
  WeightsArena arena(Specs(), AllocatePlainHostStaging);
  // Every tensor here is one read chunk: the caller gives up once all three were read.
  int checks = 0;
  absl::StatusOr<WeightUpdate> update =
      LoadUpdateFromCheckpoint(Specs(), /*served=*/nullptr, &arena, dir, "v1", UpdatePolicy::kDrain,
                               [&checks] { return ++checks > 3; });
  ASSERT_FALSE(update.ok());
  EXPECT_EQ(update.status().code(), absl::StatusCode::kCancelled) << update.status();
  EXPECT_NE(update.status().message().find("hashed"), std::string::npos) << update.status();
  // The arena is free again, and a caller that stays gets every tensor with its digest.
  update = LoadUpdateFromCheckpoint(Specs(), /*served=*/nullptr, &arena, dir, "v2",
                                    UpdatePolicy::kDrain, [] { return false; });
  ASSERT_TRUE(update.ok()) << update.status();
  EXPECT_EQ(update->digests, DigestTensors(tensors));
}

}  // namespace
}  // namespace rollout
