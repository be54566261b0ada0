// Weight updates by NCCL broadcast on one GPU (runner/cuda/weight_sync_port.cc,
// weight_sync_member.cc). NCCL cannot put two ranks on one GPU, so the receive path is proved
// here in two halves: the device staging, its bucket-by-bucket device digests and the swap, with
// a stand-in broadcaster that copies device to device (bits and digests must equal a host update
// of the same bytes); and the NCCL member itself, a one-rank group (non-blocking init, the
// all-gather, a broadcast) plus a two-rank group whose other rank never comes (the timeout and
// abort). Several GPUs prove the whole: tests/gpu/nccl_broadcast.sh.
#include <cuda_runtime.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "engine/broadcast_plan.h"
#include "engine/weight_sync.h"
#include "gtest/gtest.h"
#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/nccl_library.h"
#include "model/random_model.h"
#include "model/weight_digest.h"
#include "runner/cuda/cuda_model_runner.h"
#include "runner/cuda/weight_sync_member.h"
#include "tests/gpu/forward_script.h"
#include "tests/gpu/gpu_test_util.h"

namespace rollout {
namespace {

using gpu_test::MakeBatch;
using gpu_test::RandomTokens;
using gpu_test::Seq;

// The source's stream on the device; "broadcasting" a bucket copies it device to device into
// the receiver's staging, as ncclBroadcast would, and can stop after a number of buckets.
class DeviceCopyMember final : public WeightSyncMember {
 public:
  DeviceCopyMember(const BroadcastPlan& plan, const std::string& stream) : plan_(plan) {
    EXPECT_EQ(source_.Allocate(stream.size()), cudaSuccess);
    cudaMemcpy(source_.get(), stream.data(), stream.size(), cudaMemcpyHostToDevice);
  }
  int32_t rank() const override { return 1; }
  int32_t world_size() const override { return 2; }
  bool broken() const override { return broken_; }
  absl::Status AllGather(const void* mine, size_t bytes, void* all, std::chrono::milliseconds,
                         const GiveUp&) override {
    const std::string source =
        EncodeHandshake({HandshakeRole::kSource, true, 0, plan_.total_bytes, plan_.digest});
    std::memcpy(all, source.data(), bytes);
    std::memcpy(static_cast<char*>(all) + bytes, mine, bytes);
    return absl::OkStatus();
  }
  absl::Status Receive(void* dst, size_t bytes, int32_t root, std::chrono::milliseconds,
                       const GiveUp&) override {
    if (sent_ == stop_after_) {
      broken_ = true;
      return absl::DeadlineExceededError("the source stopped");
    }
    const BroadcastBucket& b = plan_.buckets[sent_++];
    EXPECT_EQ(b.size, bytes);
    const cudaError_t e =
        cudaMemcpy(dst, source_.get<char>() + b.stream_offset, bytes, cudaMemcpyDeviceToDevice);
    return e == cudaSuccess ? absl::OkStatus() : absl::InternalError(cudaGetErrorName(e));
  }
  void StopAfter(size_t buckets) { stop_after_ = buckets; }

 private:
  const BroadcastPlan plan_;
  cuda::DeviceBuffer source_;
  size_t sent_ = 0, stop_after_ = SIZE_MAX;
  bool broken_ = false;
};

class WeightSyncTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!gpu_test::HaveGpu()) GTEST_SKIP() << "no CUDA device";
  }
  static CudaRunnerOptions Options(bool staging) {
    CudaRunnerOptions o;
    o.kv_cache_bytes = 128ll << 20;
    o.max_batch_tokens = 1024;
    o.device_weight_staging = staging;
    return o;
  }
  static std::string WriteModel(const std::string& name, uint64_t seed) {
    const std::string dir =
        ::testing::TempDir() + "/rollout_gpu_sync_" + name + "_" + std::to_string(getpid());
    std::filesystem::remove_all(dir);
    RandomModelOptions write;
    write.preset = "small";
    write.seed = seed;
    EXPECT_TRUE(WriteRandomModel(write, dir).ok());
    return dir;
  }
  static std::unique_ptr<CudaModelRunner> Runner(const std::string& dir, bool staging) {
    auto ck = Checkpoint::Open(dir);
    EXPECT_TRUE(ck.ok()) << ck.status();
    auto runner = CudaModelRunner::Create(**ck, Options(staging));
    EXPECT_TRUE(runner.ok()) << runner.status();
    return runner.ok() ? *std::move(runner) : nullptr;
  }
  // Every tensor of checkpoint `dir`, in a broadcast order of the trainer's (not by name).
  static std::vector<HostTensor> AllTensors(const std::string& dir) {
    auto ck = Checkpoint::Open(dir);
    std::vector<HostTensor> out;
    for (const std::string& name : (*ck)->TensorNames()) {
      const TensorView* v = (*ck)->Find(name);
      out.push_back({name, v->dtype, v->shape, std::vector<uint8_t>(v->data, v->data + v->nbytes)});
    }
    std::reverse(out.begin(), out.end());
    return out;
  }
  static std::vector<float> Logits(CudaModelRunner* runner) {
    std::vector<Seq> seqs(2);
    seqs[0].tokens = RandomTokens(70, 4096, 3);
    seqs[1].tokens = RandomTokens(33, 4096, 4);
    int32_t next = 0;
    for (Seq& s : seqs) {
      for (size_t i = 0; i < (s.tokens.size() + 31) / 32; ++i) s.blocks.push_back(next++);
    }
    std::vector<float> logits;
    const absl::Status st =
        runner->ForwardToHost(MakeBatch(seqs, {{0, 0, 70, true}, {1, 0, 33, true}}), &logits);
    EXPECT_TRUE(st.ok()) << st;
    return logits;
  }
};

TEST_F(WeightSyncTest, AStagedBroadcastHasTheHostDigestsAndServesTheBitsOfAHostUpdate) {
  const std::string a = WriteModel("a", 1), b = WriteModel("b", 2);
  std::unique_ptr<CudaModelRunner> broadcast = Runner(a, true), host = Runner(a, false);
  ASSERT_NE(broadcast, nullptr);
  ASSERT_NE(host, nullptr);
  const std::vector<HostTensor> tensors = AllTensors(b);
  std::vector<BroadcastTensor> declared;
  for (const HostTensor& t : tensors) declared.push_back({t.name, t.dtype, t.shape});
  // Buckets that cut tensors and digest leaves anywhere (a multiple of 256 bytes).
  for (uint64_t bucket_bytes : {uint64_t{3} << 20, uint64_t{65536 + 768}}) {
    SCOPED_TRACE(bucket_bytes);
    const BroadcastPlan plan = PlanBroadcast(declared, bucket_bytes);
    absl::StatusOr<std::unique_ptr<WeightSyncPort>> port = broadcast->CreateWeightSyncPort();
    ASSERT_TRUE(port.ok()) << port.status();
    DeviceCopyMember member(plan, [&] {
      std::string stream(plan.total_bytes, '\0');
      for (size_t i = 0; i < tensors.size(); ++i) {
        std::memcpy(stream.data() + plan.offsets[i], tensors[i].bytes.data(),
                    tensors[i].bytes.size());
      }
      return stream;
    }());
    absl::StatusOr<std::unique_ptr<StagedWeights>> staged =
        ReceiveBroadcast(&plan, 0, absl::OkStatus(), &member, (*port)->sink(),
                         std::chrono::milliseconds(10'000), nullptr);
    ASSERT_TRUE(staged.ok()) << staged.status();
    for (const HostTensor& t : tensors) {
      EXPECT_EQ((*staged)->digests().at(t.name), TensorDigest(t.bytes.data(), t.bytes.size()))
          << t.name << ": the device's bucket-by-bucket digest is the host's";
    }
    // While the staged weights live, the staging is taken.
    EXPECT_EQ((*port)->sink()->Begin(plan).code(), absl::StatusCode::kAborted);
    ASSERT_TRUE(broadcast->UpdateWeightsFromStaging(**staged).ok());
    staged->reset();
    EXPECT_TRUE((*port)->sink()->Begin(plan).ok()) << "free again once they are gone";
    (*port)->sink()->Abandon();
  }
  ASSERT_TRUE(host->UpdateWeights(ViewsOf(tensors)).ok());
  const std::vector<float> got = Logits(broadcast.get()), want = Logits(host.get());
  ASSERT_EQ(got.size(), want.size());
  EXPECT_EQ(std::memcmp(got.data(), want.data(), got.size() * 4), 0)
      << "served bits after the staged swap differ from a host update of the same bytes";
  // And they are B's: a runner loaded from B gives the same logits.
  std::unique_ptr<CudaModelRunner> fresh = Runner(b, false);
  const std::vector<float> b_logits = Logits(fresh.get());
  EXPECT_EQ(std::memcmp(got.data(), b_logits.data(), got.size() * 4), 0);
}

TEST_F(WeightSyncTest, ABroadcastThatStopsHalfWayLeavesTheServedWeightsAsTheyWere) {
  const std::string a = WriteModel("half_a", 1), b = WriteModel("half_b", 2);
  std::unique_ptr<CudaModelRunner> runner = Runner(a, true);
  ASSERT_NE(runner, nullptr);
  const std::vector<float> before = Logits(runner.get());
  const std::vector<HostTensor> tensors = AllTensors(b);
  std::vector<BroadcastTensor> declared;
  for (const HostTensor& t : tensors) declared.push_back({t.name, t.dtype, t.shape});
  const BroadcastPlan plan = PlanBroadcast(declared, 1 << 20);
  absl::StatusOr<std::unique_ptr<WeightSyncPort>> port = runner->CreateWeightSyncPort();
  ASSERT_TRUE(port.ok()) << port.status();
  DeviceCopyMember member(plan, std::string(plan.total_bytes, '\x11'));
  member.StopAfter(plan.buckets.size() / 2);
  absl::StatusOr<std::unique_ptr<StagedWeights>> staged =
      ReceiveBroadcast(&plan, 0, absl::OkStatus(), &member, (*port)->sink(),
                       std::chrono::milliseconds(1000), nullptr);
  EXPECT_EQ(staged.status().code(), absl::StatusCode::kDeadlineExceeded) << staged.status();
  EXPECT_TRUE((*port)->sink()->Begin(plan).ok()) << "the claim was given up";
  (*port)->sink()->Abandon();
  const std::vector<float> after = Logits(runner.get());
  EXPECT_EQ(std::memcmp(before.data(), after.data(), before.size() * 4), 0);
}

TEST_F(WeightSyncTest, WithoutStagingThePortIsRefusedNamingTheFlag) {
  std::unique_ptr<CudaModelRunner> runner = Runner(WriteModel("nostaging", 1), false);
  ASSERT_NE(runner, nullptr);
  const absl::StatusOr<std::unique_ptr<WeightSyncPort>> port = runner->CreateWeightSyncPort();
  EXPECT_EQ(port.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(port.status().message().find("--device_weight_staging"), std::string::npos)
      << port.status();
}

// NCCL itself, where one GPU allows it.
class NcclWeightSyncTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!gpu_test::HaveGpu()) GTEST_SKIP() << "no CUDA device";
    nccl_ = std::make_shared<cuda::NcclLibrary>();
    const cuda::GroupStatus loaded = nccl_->Load("");
    if (!loaded.ok()) GTEST_SKIP() << "NCCL does not load: " << loaded.message();
    ASSERT_TRUE(nccl_->has_nonblocking()) << nccl_->name();
  }
  WeightSyncGroupSpec Spec(int32_t rank, int32_t world, std::chrono::milliseconds timeout) {
    cuda::NcclUniqueId id;
    EXPECT_TRUE(nccl_->Check(nccl_->GetUniqueId(&id), "ncclGetUniqueId").ok());
    WeightSyncGroupSpec spec;
    spec.unique_id.assign(id.internal, sizeof(id.internal));
    spec.rank = rank;
    spec.world_size = world;
    spec.timeout = timeout;
    return spec;
  }
  std::shared_ptr<cuda::NcclLibrary> nccl_;
};

TEST_F(NcclWeightSyncTest, AOneRankGroupJoinsGathersAndBroadcastsThroughNonBlockingCalls) {
  absl::StatusOr<std::unique_ptr<CudaWeightSyncMember>> member =
      CudaWeightSyncMember::Join(nccl_, 0, Spec(0, 1, std::chrono::milliseconds(30'000)), nullptr);
  ASSERT_TRUE(member.ok()) << member.status();
  EXPECT_FALSE((*member)->broken());
  const std::string mine(64, 'r');
  std::string all(64, '\0');
  absl::Status s =
      (*member)->AllGather(mine.data(), 64, all.data(), std::chrono::milliseconds(10'000), nullptr);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(all, mine);
  // The root's own buffer stays what it was (in place).
  const std::string bytes(3 << 20, '\x5c');
  cuda::DeviceBuffer buffer = gpu_test::Upload(std::vector<char>(bytes.begin(), bytes.end()));
  s = (*member)->Receive(buffer.get(), bytes.size(), 0, std::chrono::milliseconds(10'000), nullptr);
  ASSERT_TRUE(s.ok()) << s;
  const std::vector<char> back = gpu_test::Download<char>(buffer, bytes.size());
  EXPECT_EQ(std::string(back.begin(), back.end()), bytes);
}

TEST_F(NcclWeightSyncTest, AGroupWhoseOtherRankNeverJoinsTimesOutAndIsAborted) {
  const auto start = std::chrono::steady_clock::now();
  absl::StatusOr<std::unique_ptr<CudaWeightSyncMember>> member =
      CudaWeightSyncMember::Join(nccl_, 0, Spec(1, 2, std::chrono::milliseconds(1500)), nullptr);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(member.status().code(), absl::StatusCode::kDeadlineExceeded) << member.status();
  EXPECT_NE(member.status().message().find("was not complete within"), std::string::npos);
  EXPECT_GE(seconds, 1.4);
  EXPECT_LT(seconds, 20.0) << "the abort returned";
  // Given up instead: CANCELLED, at once.
  member = CudaWeightSyncMember::Join(nccl_, 0, Spec(1, 2, std::chrono::milliseconds(60'000)),
                                      [] { return true; });
  EXPECT_EQ(member.status().code(), absl::StatusCode::kCancelled) << member.status();
}

}  // namespace
}  // namespace rollout
