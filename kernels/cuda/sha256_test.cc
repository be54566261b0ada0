// The device digest's SHA-256 (kernels/cuda/sha256.cuh), built for the host, against OpenSSL's
// (model/weight_digest.h's Sha256) and FIPS 180-2's known answers: every length through four
// blocks (each padding case), leaf lengths, and data at every offset from 16-byte alignment
// (the 16-byte-load path and the byte path). Runs without a GPU; rollout_gpu_test's
// DeviceDigestTest.* runs the same code on the device.
#include <random>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "gtest/gtest.h"
#include "kernels/cuda/sha256_host_test.h"
#include "model/weight_digest.h"

namespace rollout::cuda {
namespace {

std::string HostBuild(const uint8_t* data, size_t size) {
  std::string out(32, '\0');
  HostBuildSha256(data, size, reinterpret_cast<uint8_t*>(out.data()));
  return out;
}

std::string HostBuild(const std::string& s) {
  return HostBuild(reinterpret_cast<const uint8_t*>(s.data()), s.size());
}

TEST(Sha256HostBuildTest, GivesFips180KnownAnswers) {
  EXPECT_EQ(absl::BytesToHexString(HostBuild("")),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(absl::BytesToHexString(HostBuild("abc")),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(
      absl::BytesToHexString(HostBuild("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq")),
      "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  EXPECT_EQ(absl::BytesToHexString(std::string(HostBuild(std::string(1000000, 'a')))),
            "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

TEST(Sha256HostBuildTest, EqualsOpenSslAtEveryLengthAndOffset) {
  std::mt19937_64 rng(3);
  alignas(16) static uint8_t buffer[(1 << 16) + 64];
  for (uint8_t& b : buffer) b = static_cast<uint8_t>(rng());
  for (size_t offset = 0; offset < 16; ++offset) {
    for (size_t size = 0; size <= 4 * 64 + 1; ++size) {
      ASSERT_EQ(HostBuild(buffer + offset, size), Sha256(buffer + offset, size))
          << size << " bytes at offset " << offset;
    }
    for (size_t size : {size_t{65535}, size_t{65536}}) {
      ASSERT_EQ(HostBuild(buffer + offset, size), Sha256(buffer + offset, size))
          << size << " bytes at offset " << offset;
    }
  }
}

}  // namespace
}  // namespace rollout::cuda
