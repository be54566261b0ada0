// A 1 GB weight update through the streaming RPC, with its throughput reported.
#include <chrono>
#include <cstdio>

#include "client/checkpoint_upload.h"
#include "client/rollout_client.h"
#include "gtest/gtest.h"
#include "model/random_model.h"
#include "tests/test_server.h"

namespace rollout::testing {
namespace {

TEST(WeightsThroughputTest, AOneGigabyteModelStreamsThroughUpdateWeightsAndServesTheSameBits) {
  // The "medium" preset: ~0.5 B parameters, ~1 GB in bf16 -- the whole model is pushed.
  const std::string dir = ::testing::TempDir() + "weights-throughput-medium";
  RandomModelOptions model;
  model.preset = "medium";
  model.seed = 2;
  ASSERT_TRUE(WriteRandomModel(model, dir).ok());
  ServerOptions options;
  options.model_dir = dir;
  options.kv_cache_bytes = 64ll << 20;
  std::unique_ptr<TestServer> server = StartTestServer(options);
  ASSERT_NE(server, nullptr);

  v1::GenerateRequest request;
  *request.add_rollouts() = MakeRollout({5, 6, 7, 8}, 3, 4, 0.7f);
  const std::string before =
      Fingerprint(RunGenerate(server->stub.get(), request).completions[0][0]);

  absl::StatusOr<std::unique_ptr<RolloutClient>> client =
      RolloutClient::Connect(server->address(), ClientOptions());
  ASSERT_TRUE(client.ok()) << client.status();
  const auto start = std::chrono::steady_clock::now();
  absl::StatusOr<v1::UpdateWeightsResponse> pushed = UpdateWeightsFromCheckpoint(
      **client, dir, "pushed", v1::IN_FLIGHT_POLICY_DRAIN, /*chunk_bytes=*/4 << 20);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_TRUE(pushed.ok()) << pushed.status();
  EXPECT_GT(pushed->bytes_received(), 900ull << 20) << "the whole ~1 GB model was pushed";
  const double mb = pushed->bytes_received() / 1048576.0;
  std::printf(
      "1 GB update: %.0f MiB in %.2f s = %.0f MiB/s end to end (server: receive %.2f s, "
      "swap %.2f s), 4 MiB chunks, loopback, CPU backend\n",
      mb, seconds, mb / seconds, pushed->receive_seconds(), pushed->swap_seconds());
  RecordProperty("update_mib", static_cast<int>(mb));
  RecordProperty("update_mib_per_s", static_cast<int>(mb / seconds));

  // Same bytes, new version: the served bits are exactly those before the push.
  GenerateOutcome after = RunGenerate(server->stub.get(), request);
  EXPECT_EQ(after.completions[0][0].weight_version(), "pushed");
  EXPECT_EQ(Fingerprint(after.completions[0][0]), before);
}

}  // namespace
}  // namespace rollout::testing
