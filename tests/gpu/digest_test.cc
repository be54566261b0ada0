// The device weight digest (kernels/cuda/device_digest.h) against the host's
// (model/weight_digest.h), bitwise: every padding edge of SHA-256 and of the 64 KiB leaves,
// misaligned bytes, batches across launches, a tensor hashed in chunks; SHA-256's known answers
// (FIPS 180-2, appendix B) for single leaves; bad arguments refused before any launch.
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "gtest/gtest.h"
#include "kernels/cuda/device_digest.h"
#include "model/weight_digest.h"
#include "tests/gpu/gpu_test_util.h"

namespace rollout {
namespace {

using cuda::DeviceBuffer;
using cuda::kDigestBytes;
using cuda::kDigestLeafSize;

std::vector<uint8_t> RandomBytes(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<uint8_t> bytes(n);
  for (uint8_t& b : bytes) b = static_cast<uint8_t>(rng() >> 56);
  return bytes;
}

std::string HostDigest(const std::vector<uint8_t>& bytes) {
  return TensorDigest(bytes.data(), bytes.size());
}

std::string Hex(const std::string& raw) { return absl::BytesToHexString(raw); }

// Device copies of host tensors, tensor i at a 256-byte boundary plus misalign[i] bytes (0 when
// misalign is empty), all in one buffer, as a staging buffer holds a model.
struct DeviceTensors {
  DeviceBuffer buffer;
  std::vector<cuda::DeviceDigestTensor> tensors;
};

DeviceTensors Place(const std::vector<std::vector<uint8_t>>& host,
                    const std::vector<size_t>& misalign = {}) {
  std::vector<size_t> offsets;
  size_t end = 0;
  for (size_t i = 0; i < host.size(); ++i) {
    const size_t offset = (end + 255) / 256 * 256 + (misalign.empty() ? 0 : misalign[i]);
    offsets.push_back(offset);
    end = offset + host[i].size();
  }
  DeviceTensors d;
  EXPECT_EQ(cudaSuccess, d.buffer.Allocate(end + 1));
  for (size_t i = 0; i < host.size(); ++i) {
    uint8_t* p = d.buffer.get<uint8_t>() + offsets[i];
    if (!host[i].empty()) {
      EXPECT_EQ(cudaSuccess, cudaMemcpy(p, host[i].data(), host[i].size(), cudaMemcpyHostToDevice));
    }
    d.tensors.push_back({host[i].empty() ? nullptr : p, host[i].size()});
  }
  return d;
}

// The 32-byte digests DeviceTensorDigests gives for `tensors`, in one call on a side stream.
std::vector<std::string> DeviceDigests(const std::vector<cuda::DeviceDigestTensor>& tensors) {
  const size_t ws_bytes = cuda::DeviceDigestWorkspaceBytes(tensors.data(), tensors.size());
  DeviceBuffer ws, out;
  EXPECT_EQ(cudaSuccess, ws.Allocate(ws_bytes));
  EXPECT_EQ(cudaSuccess, out.Allocate(kDigestBytes * tensors.size()));
  cudaStream_t stream;
  EXPECT_EQ(cudaSuccess, cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  EXPECT_EQ(cudaSuccess, cuda::DeviceTensorDigests(tensors.data(), tensors.size(), ws.get(),
                                                   ws_bytes, out.get<uint8_t>(), stream));
  std::vector<char> host(kDigestBytes * tensors.size());
  EXPECT_EQ(cudaSuccess,
            cudaMemcpyAsync(host.data(), out.get(), host.size(), cudaMemcpyDeviceToHost, stream));
  EXPECT_EQ(cudaSuccess, cudaStreamSynchronize(stream));
  cudaStreamDestroy(stream);
  std::vector<std::string> digests;
  for (size_t i = 0; i < tensors.size(); ++i) {
    digests.emplace_back(host.data() + kDigestBytes * i, kDigestBytes);
  }
  return digests;
}

// The SHA-256 of one leaf's bytes (< 64 KiB), by DeviceLeafDigests.
std::string DeviceLeaf(const std::string& message) {
  DeviceBuffer data, leaf;
  EXPECT_EQ(cudaSuccess, data.Allocate(message.size() + 1));
  EXPECT_EQ(cudaSuccess, leaf.Allocate(kDigestBytes));
  cudaMemcpy(data.get(), message.data(), message.size(), cudaMemcpyHostToDevice);
  const cuda::DeviceLeafRange range{data.get(), message.size(), leaf.get<uint8_t>()};
  EXPECT_EQ(cudaSuccess, cuda::DeviceLeafDigests(&range, 1, nullptr));
  std::string out(kDigestBytes, '\0');
  EXPECT_EQ(cudaSuccess, cudaMemcpy(out.data(), leaf.get(), kDigestBytes, cudaMemcpyDeviceToHost));
  return out;
}

class DeviceDigestTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!gpu_test::HaveGpu()) GTEST_SKIP() << "no CUDA device";
  }
};

TEST_F(DeviceDigestTest, LeafDigestsAreFips180KnownAnswers) {
  // One block; two blocks because the length does not fit after 56 bytes; two data blocks.
  EXPECT_EQ(Hex(DeviceLeaf("abc")),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(Hex(DeviceLeaf("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq")),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  EXPECT_EQ(Hex(DeviceLeaf("abcdefghbcdefghicdefghijdefghijkefghijklfghijklmghijklmnhijklmno"
                           "ijklmnopjklmnopqklmnopqrlmnopqrsmnopqrstnopqrstu")),
            "cf5b16a778af8380036ce59e7b0492370b249b11e8f07a51afac45037afee9d1");
  // The empty message: an empty tensor has no leaf, and its digest is the SHA-256 of nothing.
  DeviceBuffer out;
  ASSERT_CUDA_OK(out.Allocate(kDigestBytes));
  const cuda::DeviceLeafList none{nullptr, 0};
  ASSERT_CUDA_OK(cuda::DeviceCombineLeafDigests(&none, 1, out.get<uint8_t>(), nullptr));
  std::string empty(kDigestBytes, '\0');
  ASSERT_CUDA_OK(cudaMemcpy(empty.data(), out.get(), kDigestBytes, cudaMemcpyDeviceToHost));
  EXPECT_EQ(Hex(empty), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(empty, TensorDigest(nullptr, 0));
}

TEST_F(DeviceDigestTest, TensorDigestsEqualTheHostsAtEveryPaddingAndLeafEdge) {
  // SHA-256 block edges (55/56: the length fits or not; 63/64/65), leaf edges (65535..65537),
  // several leaves with a short last one, and a few MiB.
  const std::vector<size_t> sizes = {
      0,   1,    3,     55,    56,    63,    64,    65,     119,    120,           127,
      128, 1000, 65535, 65536, 65537, 65591, 65592, 131072, 196663, (5 << 20) + 3, 7 << 20};
  std::vector<std::vector<uint8_t>> host;
  for (size_t i = 0; i < sizes.size(); ++i) host.push_back(RandomBytes(sizes[i], 100 + i));
  const DeviceTensors d = Place(host);
  // One call per tensor (the per-tensor form), then all of them in one batch.
  for (size_t i = 0; i < sizes.size(); ++i) {
    EXPECT_EQ(Hex(DeviceDigests({d.tensors[i]})[0]), Hex(HostDigest(host[i])))
        << "size " << sizes[i];
  }
  const std::vector<std::string> batch = DeviceDigests(d.tensors);
  for (size_t i = 0; i < sizes.size(); ++i) {
    EXPECT_EQ(Hex(batch[i]), Hex(HostDigest(host[i]))) << "size " << sizes[i] << " in a batch";
  }
}

TEST_F(DeviceDigestTest, MisalignedTensorsHashTheirBytes) {
  // A bf16 tensor at an odd element, or bytes at any offset: the byte-load path.
  std::vector<std::vector<uint8_t>> host;
  std::vector<size_t> misalign;
  for (size_t size : {1, 64, 100, 65536, 65537, 200000}) {
    for (size_t offset : {1, 2, 3, 4, 7, 8, 15}) {
      host.push_back(RandomBytes(size, size * 31 + offset));
      misalign.push_back(offset);
    }
  }
  const DeviceTensors d = Place(host, misalign);
  const std::vector<std::string> got = DeviceDigests(d.tensors);
  for (size_t i = 0; i < host.size(); ++i) {
    EXPECT_EQ(Hex(got[i]), Hex(HostDigest(host[i])))
        << "size " << host[i].size() << " at offset " << misalign[i];
  }
}

TEST_F(DeviceDigestTest, ABatchOfMixedSizesAcrossLaunchesGivesTheHostsWeightsDigest) {
  // 1100 tensors: three launches of at most kDigestTensorsPerLaunch; empty ones, one-leaf ones,
  // multi-leaf ones, a few misaligned; then the weights' digest from either side.
  std::mt19937_64 rng(7);
  std::vector<std::vector<uint8_t>> host;
  std::vector<size_t> misalign;
  for (int i = 0; i < 1100; ++i) {
    const int kind = static_cast<int>(rng() % 10);
    const size_t size = kind == 0  ? 0
                        : kind < 6 ? rng() % 4096
                        : kind < 9 ? rng() % (4 * kDigestLeafSize)
                                   : rng() % (40 * kDigestLeafSize);
    host.push_back(RandomBytes(size, 1000 + i));
    misalign.push_back(rng() % 8 == 0 ? 1 + rng() % 15 : 0);
  }
  ASSERT_GT(host.size(), 2 * cuda::kDigestTensorsPerLaunch);
  const DeviceTensors d = Place(host, misalign);
  const std::vector<std::string> got = DeviceDigests(d.tensors);
  std::vector<HostTensor> tensors;
  std::vector<WeightSpec> specs;
  TensorDigests device_digests;
  for (size_t i = 0; i < host.size(); ++i) {
    ASSERT_EQ(Hex(got[i]), Hex(HostDigest(host[i])))
        << "tensor " << i << ", " << host[i].size() << " bytes at offset " << misalign[i];
    const std::string name = "t" + std::to_string(1000 + i);
    // Dtype and shape do not enter the digest: only the name and the bytes do.
    tensors.push_back({name, DType::kBF16, {1}, host[i]});
    specs.push_back({name, DType::kBF16, {1}});
    device_digests[name] = got[i];
  }
  const std::string served = WeightsDigest(specs, DigestTensors(tensors));
  ASSERT_FALSE(served.empty());
  EXPECT_EQ(WeightsDigest(specs, device_digests), served);
}

TEST_F(DeviceDigestTest, ChunksHashedAsTheyArriveGiveTheWholeTensorsDigest) {
  // A streamed update: 1 MiB chunks (16 leaves) land one by one, each hashed into its part of
  // the tensor's leaf array; the tensor's digest after the last (short) chunk.
  const std::vector<uint8_t> host = RandomBytes((5 << 20) + 123, 5);
  const DeviceTensors d = Place({host});
  const uint64_t leaves = cuda::DigestLeafCount(host.size());
  ASSERT_EQ(leaves, 81u);
  DeviceBuffer leaf_digests, out;
  ASSERT_CUDA_OK(leaf_digests.Allocate(kDigestBytes * leaves));
  ASSERT_CUDA_OK(out.Allocate(kDigestBytes));
  const uint8_t* data = static_cast<const uint8_t*>(d.tensors[0].data);
  const size_t chunk = 16 * kDigestLeafSize;
  for (size_t begin = 0; begin < host.size(); begin += chunk) {
    const cuda::DeviceLeafRange range{
        data + begin, std::min(chunk, host.size() - begin),
        leaf_digests.get<uint8_t>() + kDigestBytes * (begin / kDigestLeafSize)};
    ASSERT_CUDA_OK(cuda::DeviceLeafDigests(&range, 1, nullptr));
  }
  const cuda::DeviceLeafList list{leaf_digests.get<uint8_t>(), leaves};
  ASSERT_CUDA_OK(cuda::DeviceCombineLeafDigests(&list, 1, out.get<uint8_t>(), nullptr));
  std::string got(kDigestBytes, '\0');
  ASSERT_CUDA_OK(cudaMemcpy(got.data(), out.get(), kDigestBytes, cudaMemcpyDeviceToHost));
  EXPECT_EQ(Hex(got), Hex(HostDigest(host)));
  // Leaf by leaf, the leaf array is the host's leaves' SHA-256s.
  std::vector<char> leaf_bytes(kDigestBytes * leaves);
  ASSERT_CUDA_OK(
      cudaMemcpy(leaf_bytes.data(), leaf_digests.get(), leaf_bytes.size(), cudaMemcpyDeviceToHost));
  for (uint64_t i = 0; i < leaves; ++i) {
    const size_t begin = i * kDigestLeafSize;
    ASSERT_EQ(std::string(leaf_bytes.data() + kDigestBytes * i, kDigestBytes),
              Sha256(host.data() + begin, std::min<size_t>(kDigestLeafSize, host.size() - begin)))
        << "leaf " << i;
  }
}

TEST_F(DeviceDigestTest, BadArgumentsAreRefusedBeforeAnyLaunch) {
  const std::vector<uint8_t> host = RandomBytes(3 * kDigestLeafSize, 9);
  const DeviceTensors d = Place({host, host});
  const size_t needed = cuda::DeviceDigestWorkspaceBytes(d.tensors.data(), 2);
  ASSERT_EQ(needed, 6 * kDigestBytes);
  DeviceBuffer ws, out;
  ASSERT_CUDA_OK(ws.Allocate(needed + 16));
  ASSERT_CUDA_OK(out.Allocate(2 * kDigestBytes + 16));
  ASSERT_CUDA_OK(cudaMemset(out.get(), 0xab, out.bytes()));
  uint8_t* digests = out.get<uint8_t>();
  EXPECT_EQ(cudaErrorInvalidValue,
            cuda::DeviceTensorDigests(d.tensors.data(), 2, ws.get(), needed - 1, digests, nullptr))
      << "workspace too small";
  EXPECT_EQ(cudaErrorInvalidValue,
            cuda::DeviceTensorDigests(d.tensors.data(), 2, ws.get<uint8_t>() + 4, needed, digests,
                                      nullptr))
      << "workspace misaligned";
  EXPECT_EQ(cudaErrorInvalidValue,
            cuda::DeviceTensorDigests(d.tensors.data(), 2, ws.get(), needed, digests + 8, nullptr))
      << "digests misaligned";
  const std::vector<cuda::DeviceDigestTensor> null_data = {d.tensors[0], {nullptr, 5}};
  EXPECT_EQ(cudaErrorInvalidValue,
            cuda::DeviceTensorDigests(null_data.data(), 2, ws.get(), needed, digests, nullptr))
      << "null data with bytes behind it";
  EXPECT_EQ(cudaErrorInvalidValue,
            cuda::DeviceTensorDigests(nullptr, 2, ws.get(), needed, digests, nullptr));
  const cuda::DeviceLeafRange bad_range{d.tensors[0].data, 100, digests + 4};
  EXPECT_EQ(cudaErrorInvalidValue, cuda::DeviceLeafDigests(&bad_range, 1, nullptr));
  const cuda::DeviceLeafList bad_list{nullptr, 3};
  EXPECT_EQ(cudaErrorInvalidValue, cuda::DeviceCombineLeafDigests(&bad_list, 1, digests, nullptr));
  // Nothing ran: the output is as it was, and no CUDA error is pending.
  ASSERT_CUDA_OK(cudaDeviceSynchronize());
  std::vector<uint8_t> after(out.bytes());
  ASSERT_CUDA_OK(cudaMemcpy(after.data(), out.get(), after.size(), cudaMemcpyDeviceToHost));
  EXPECT_EQ(after, std::vector<uint8_t>(out.bytes(), 0xab));
  EXPECT_EQ(cudaSuccess, cudaGetLastError());
  // Nothing to do is fine; then the valid call gives the host's digests.
  EXPECT_EQ(cudaSuccess, cuda::DeviceTensorDigests(nullptr, 0, nullptr, 0, nullptr, nullptr));
  const std::vector<std::string> got = DeviceDigests(d.tensors);
  EXPECT_EQ(got[0], HostDigest(host));
  EXPECT_EQ(got[1], HostDigest(host));
}

}  // namespace
}  // namespace rollout
