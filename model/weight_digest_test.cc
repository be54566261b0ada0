#include "model/weight_digest.h"

#include <filesystem>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "gtest/gtest.h"

namespace rollout {
namespace {

TEST(WeightDigestTest, TensorDigestIsSha256) {
  const std::string abc = "abc";
  EXPECT_EQ(absl::BytesToHexString(
                TensorDigest(reinterpret_cast<const uint8_t*>(abc.data()), abc.size())),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
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
  // Served in another dtype (converted by the runner), or absent: unknown, not guessed.
  const std::vector<WeightSpec> converted = {{"x", DType::kBF16, {2, 2}},
                                             {"y", DType::kBF16, {1}},
                                             {"z", DType::kBF16, {1}}};
  EXPECT_EQ(DigestCheckpoint(**checkpoint, converted).size(), 1u);
  EXPECT_EQ(WeightsDigest(converted, DigestCheckpoint(**checkpoint, converted)), "");
}

}  // namespace
}  // namespace rollout
