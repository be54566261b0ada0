#include "model/weight_digest.h"

#include <chrono>
#include <filesystem>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "gtest/gtest.h"

namespace rollout {
namespace {

TEST(WeightDigestTest, TensorDigestIsTheSha256OfItsLeavesSha256s) {
  const std::string abc = "abc";
  const uint8_t* p = reinterpret_cast<const uint8_t*>(abc.data());
  EXPECT_EQ(absl::BytesToHexString(Sha256(p, 3)),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  const std::string one_leaf = Sha256(p, 3);
  EXPECT_EQ(TensorDigest(p, 3), Sha256(reinterpret_cast<const uint8_t*>(one_leaf.data()), 32));
  // Two and a half leaves: three leaf digests, the last over the remainder.
  std::vector<uint8_t> big(kDigestLeafBytes * 5 / 2);
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<uint8_t>(i * 7 + 1);
  std::string leaves;
  for (size_t begin = 0; begin < big.size(); begin += kDigestLeafBytes) {
    leaves += Sha256(big.data() + begin, std::min(kDigestLeafBytes, big.size() - begin));
  }
  EXPECT_EQ(TensorDigest(big.data(), big.size()),
            Sha256(reinterpret_cast<const uint8_t*>(leaves.data()), leaves.size()));
  // The parallel path gives the same digests, whatever the thread count.
  const std::vector<HostTensor> tensors = {{"big", DType::kBF16, {1}, big},
                                           {"empty", DType::kBF16, {0}, {}},
                                           {"abc", DType::kBF16, {1}, {'a', 'b', 'c'}}};
  for (int threads : {1, 3, 8}) {
    const TensorDigests digests = DigestTensors(tensors, threads);
    EXPECT_EQ(digests.at("big"), TensorDigest(big.data(), big.size())) << threads;
    EXPECT_EQ(digests.at("empty"), TensorDigest(nullptr, 0)) << threads;
    EXPECT_EQ(digests.at("abc"), TensorDigest(p, 3)) << threads;
  }
}

TEST(WeightDigestTest, WeightsDigestNeedsEveryTensorAndChangesWithAnyOfThem) {
  const std::vector<WeightSpec> specs = {{"a", DType::kBF16, {2}}, {"b", DType::kBF16, {2}}};
  const uint8_t one[4] = {1, 2, 3, 4}, other[4] = {1, 2, 3, 5};
  TensorDigests digests = {{"a", TensorDigest(one, 4)}};
  EXPECT_EQ(WeightsDigest(specs, digests), "") << "b is unknown";
  digests["b"] = TensorDigest(one, 4);
  const std::string base = WeightsDigest(specs, digests);
  EXPECT_EQ(base.rfind("sha256:", 0), 0u);
  EXPECT_EQ(base.size(), 7u + 64u);
  EXPECT_EQ(WeightsDigest(specs, digests), base) << "a pure function of the bytes";
  digests["b"] = TensorDigest(other, 4);
  EXPECT_NE(WeightsDigest(specs, digests), base);
  // The names take part: the same bytes under swapped names are other weights.
  const std::vector<WeightSpec> swapped = {{"a", DType::kBF16, {2}}, {"c", DType::kBF16, {2}}};
  digests = {{"a", TensorDigest(one, 4)}, {"c", TensorDigest(one, 4)}};
  EXPECT_NE(WeightsDigest(swapped, digests), base);
}

TEST(WeightDigestTest, ACheckpointsDigestIsItsTensorsBytes) {
  const std::string dir = ::testing::TempDir() + "/weight_digest_ckpt";
  std::filesystem::create_directories(dir);
  std::vector<HostTensor> tensors = {{"x", DType::kBF16, {2, 2}, {1, 2, 3, 4, 5, 6, 7, 8}},
                                     {"y", DType::kF32, {1}, {0, 0, 128, 63}}};
  ASSERT_TRUE(WriteSafetensors(dir + "/model.safetensors", tensors).ok());
  {
    std::FILE* f = std::fopen((dir + "/config.json").c_str(), "w");
    ASSERT_NE(f, nullptr);
    std::fputs("{}", f);
    std::fclose(f);
  }
  auto checkpoint = Checkpoint::Open(dir);
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status();
  const std::vector<WeightSpec> specs = {{"x", DType::kBF16, {2, 2}}, {"y", DType::kF32, {1}}};
  const TensorDigests digests = DigestCheckpoint(**checkpoint, specs, 2);
  ASSERT_EQ(digests.size(), 2u);
  EXPECT_EQ(digests.at("x"), TensorDigest(tensors[0].bytes.data(), 8));
  EXPECT_EQ(digests.at("y"), TensorDigest(tensors[1].bytes.data(), 4));
  // Served in another dtype: the digest of the served (cast) bytes. y = 1.0f is 0x3f80 in bf16.
  const std::vector<WeightSpec> converted = {{"x", DType::kBF16, {2, 2}},
                                             {"y", DType::kBF16, {1}}};
  const TensorDigests cast = DigestCheckpoint(**checkpoint, converted);
  ASSERT_EQ(cast.size(), 2u);
  const uint8_t one_bf16[2] = {0x80, 0x3f};
  EXPECT_EQ(cast.at("y"), TensorDigest(one_bf16, 2));
  EXPECT_NE(WeightsDigest(converted, cast), "");
  // Absent (a tensor the runner derives): unknown, not guessed.
  std::vector<WeightSpec> absent = converted;
  absent.push_back({"z", DType::kBF16, {1}});
  EXPECT_EQ(DigestCheckpoint(**checkpoint, absent).size(), 2u);
  EXPECT_EQ(WeightsDigest(absent, DigestCheckpoint(**checkpoint, absent)), "");
}

TEST(DigestQueueTest, CancelDropsQueuedWorkAndTheQueueServesTheNextTensors) {
  std::vector<uint8_t> big(size_t{64} << 20, 3), small(1000, 4);
  DigestQueue queue(1);
  auto seconds_since = [](std::chrono::steady_clock::time_point t) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
  };
  // What hashing 512 MiB takes here, for scale.
  for (int i = 0; i < 8; ++i) queue.Add("big" + std::to_string(i), big.data(), big.size());
  auto start = std::chrono::steady_clock::now();
  EXPECT_EQ(queue.Finish().size(), 8u);
  const double all = seconds_since(start);
  for (int i = 0; i < 8; ++i) queue.Add("big" + std::to_string(i), big.data(), big.size());
  start = std::chrono::steady_clock::now();
  queue.Cancel();  // waits only for the run being hashed (at most 4 MiB of the 512)
  EXPECT_LT(seconds_since(start), all / 4) << "Cancel hashed what was queued";
  queue.Add("small", small.data(), small.size());
  const TensorDigests digests = queue.Finish();
  ASSERT_EQ(digests.size(), 1u) << "the cancelled tensors are gone";
  EXPECT_EQ(digests.at("small"), TensorDigest(small.data(), small.size()));
}

}  // namespace
}  // namespace rollout
