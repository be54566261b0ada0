// End-to-end: a real server on loopback, driven through the real gRPC stack.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <set>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/naive_model.h"
#include "tests/test_server.h"

namespace rollout::testing {
namespace {

class GenerateE2eTest : public SharedServerTest {};

const std::vector<uint32_t> kPrompt = {11, 42, 7, 300, 1999, 5, 64, 812};

TEST_F(GenerateE2eTest, StreamedChunksConcatenateToTheCompletion) {
  v1::GenerateRequest request;
  *request.add_rollouts() = MakeRollout(kPrompt, 1, 24, 1.0f);
  request.mutable_rollouts(0)->set_num_samples(3);
  request.mutable_rollouts(0)->mutable_sampling()->set_top_logprobs(3);
  GenerateOutcome out = RunGenerate(stub(), request);
  ASSERT_TRUE(out.status.ok()) << out.status.error_message();
  std::vector<std::vector<uint32_t>> streamed(3);
  std::vector<std::vector<float>> streamed_lp(3);
  std::vector<int> completions(3, 0);
  for (const v1::GenerateResponse& r : out.responses) {
    if (r.has_chunk()) {
      ASSERT_EQ(completions[r.chunk().sample_index()], 0) << "chunk after its completion";
      ASSERT_EQ(r.chunk().token_ids_size(), r.chunk().logprobs_size());
      ASSERT_EQ(r.chunk().top_logprobs_size(), r.chunk().token_ids_size());
      for (uint32_t t : r.chunk().token_ids()) streamed[r.chunk().sample_index()].push_back(t);
      for (float lp : r.chunk().logprobs()) streamed_lp[r.chunk().sample_index()].push_back(lp);
    } else {
      ++completions[r.completion().sample_index()];
    }
  }
  for (int j = 0; j < 3; ++j) {
    const v1::Completion& c = out.completions[0][j];
    EXPECT_EQ(completions[j], 1);
    EXPECT_EQ(std::vector<uint32_t>(c.token_ids().begin(), c.token_ids().end()), streamed[j]);
    EXPECT_EQ(std::vector<float>(c.logprobs().begin(), c.logprobs().end()), streamed_lp[j]);
    EXPECT_EQ(c.top_logprobs_size(), c.token_ids_size());
    EXPECT_FALSE(c.weight_version().empty());
    EXPECT_NE(c.finish_reason(), v1::FINISH_REASON_UNSPECIFIED);
    if (c.finish_reason() == v1::FINISH_REASON_LENGTH) {
      EXPECT_EQ(c.token_ids_size(), 24);
    }
  }
}

TEST_F(GenerateE2eTest, LogprobsEqualAnIndependentNaiveForward) {
  absl::StatusOr<NaiveModel> naive = NaiveModel::Load(server_->server->model_dir());
  ASSERT_TRUE(naive.ok()) << naive.status();
  // The CPU backend computes in fp32; the CUDA backend (ROLLOUT_TEST_BACKEND=cuda) rounds
  // weights, activations and KV to bf16, so its logprobs sit within bf16 error of the
  // double-precision forward, and its greedy pick may differ only at near-ties.
  const char* backend = std::getenv("ROLLOUT_TEST_BACKEND");
  const bool bf16 = backend != nullptr && std::string(backend) == "cuda";
  const double tolerance = bf16 ? 5e-2 : 2e-3;
  for (float temperature : {0.0f, 0.7f, 1.0f, 1.3f}) {
    v1::GenerateRequest request;
    *request.add_rollouts() = MakeRollout(kPrompt, 9, 12, temperature);
    request.mutable_rollouts(0)->mutable_sampling()->set_ignore_eos(true);
    request.mutable_rollouts(0)->mutable_sampling()->set_top_logprobs(2);
    GenerateOutcome out = RunGenerate(stub(), request);
    ASSERT_TRUE(out.status.ok()) << out.status.error_message();
    const v1::Completion& c = out.completions[0][0];
    ASSERT_EQ(c.token_ids_size(), 12);
    std::vector<int32_t> seq(kPrompt.begin(), kPrompt.end());
    seq.insert(seq.end(), c.token_ids().begin(), c.token_ids().end());
    std::vector<std::vector<double>> logits = naive->Logits(seq);
    for (int i = 0; i < c.token_ids_size(); ++i) {
      const std::vector<double>& row = logits[kPrompt.size() - 1 + i];
      const float lp = c.logprobs(i);
      EXPECT_TRUE(std::isfinite(lp));
      EXPECT_LE(lp, 0.0f);
      EXPECT_NEAR(lp, NaiveLogprob(row, temperature, c.token_ids(i)), tolerance)
          << "T=" << temperature << " position " << i;
      if (temperature == 0.0f) {
        const int32_t argmax = std::max_element(row.begin(), row.end()) - row.begin();
        std::vector<double> sorted(row);
        std::partial_sort(sorted.begin(), sorted.begin() + 2, sorted.end(), std::greater<>());
        if (!bf16 || sorted[0] - sorted[1] > 2 * tolerance) {
          EXPECT_EQ(c.token_ids(i), argmax) << "greedy must pick the argmax at " << i;
        }
      }
      const v1::TopLogprobs& top = c.top_logprobs(i);
      ASSERT_EQ(top.entries_size(), 2);
      EXPECT_GE(top.entries(0).logprob(), top.entries(1).logprob());
      EXPECT_NEAR(top.entries(0).logprob(),
                  NaiveLogprob(row, temperature, top.entries(0).token_id()), tolerance);
    }
  }
}

TEST_F(GenerateE2eTest, SameRequestTwiceIsBitwiseIdentical) {
  v1::GenerateRequest request;
  *request.add_rollouts() = MakeRollout(kPrompt, 77, 20, 0.8f);
  request.mutable_rollouts(0)->set_num_samples(4);
  GenerateOutcome a = RunGenerate(stub(), request);
  GenerateOutcome b = RunGenerate(stub(), request);
  ASSERT_TRUE(a.status.ok() && b.status.ok());
  for (int j = 0; j < 4; ++j) {
    EXPECT_EQ(Fingerprint(a.completions[0][j]), Fingerprint(b.completions[0][j]));
  }
}

TEST_F(GenerateE2eTest, SamplesOfOneRequestDifferAtTemperatureOne) {
  v1::GenerateRequest request;
  *request.add_rollouts() = MakeRollout(kPrompt, 5, 16, 1.0f);
  request.mutable_rollouts(0)->set_num_samples(6);
  request.mutable_rollouts(0)->mutable_sampling()->set_ignore_eos(true);
  GenerateOutcome out = RunGenerate(stub(), request);
  ASSERT_TRUE(out.status.ok());
  std::set<std::string> distinct;
  std::set<uint64_t> seeds;
  for (const v1::Completion& c : out.completions[0]) {
    distinct.insert(Fingerprint(c));
    seeds.insert(c.sample_seed());
  }
  EXPECT_EQ(distinct.size(), 6u);
  EXPECT_EQ(seeds.size(), 6u);
  EXPECT_EQ(out.completions[0][0].sample_seed(), 5u) << "sample 0 keeps the request seed";
}

TEST_F(GenerateE2eTest, NSamplesEqualTheDerivedSeedsRequestedOneByOne) {
  v1::GenerateRequest together;
  *together.add_rollouts() = MakeRollout(kPrompt, 1234, 10, 0.9f);
  together.mutable_rollouts(0)->set_num_samples(3);
  GenerateOutcome all = RunGenerate(stub(), together);
  ASSERT_TRUE(all.status.ok());
  for (int j = 0; j < 3; ++j) {
    v1::GenerateRequest one;
    *one.add_rollouts() = MakeRollout(kPrompt, all.completions[0][j].sample_seed(), 10, 0.9f);
    GenerateOutcome single = RunGenerate(stub(), one);
    ASSERT_TRUE(single.status.ok());
    EXPECT_EQ(Fingerprint(single.completions[0][0]), Fingerprint(all.completions[0][j]));
  }
}

TEST_F(GenerateE2eTest, RolloutAloneEqualsRolloutInsideAMixedBatch) {
  for (float temperature : {0.0f, 0.7f}) {
    v1::GenerateRequest alone;
    *alone.add_rollouts() = MakeRollout(kPrompt, 31, 16, temperature);
    GenerateOutcome a = RunGenerate(stub(), alone);
    ASSERT_TRUE(a.status.ok());

    v1::GenerateRequest mixed;
    std::vector<uint32_t> long_prompt;
    for (int i = 0; i < 300; ++i) long_prompt.push_back((i * 37 + 11) % 4000);
    *mixed.add_rollouts() = MakeRollout(long_prompt, 3, 20, 1.0f);
    *mixed.add_rollouts() = MakeRollout({5}, 4, 30, 0.5f);
    mixed.mutable_rollouts(1)->set_num_samples(5);
    *mixed.add_rollouts() = MakeRollout(kPrompt, 31, 16, temperature);  // the same rollout
    *mixed.add_rollouts() = MakeRollout(kPrompt, 31, 16, temperature);  // and a copy
    *mixed.add_rollouts() =
        MakeRollout({9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9}, 8, 8, 0.0f);
    GenerateOutcome m = RunGenerate(stub(), mixed);
    ASSERT_TRUE(m.status.ok());
    EXPECT_EQ(Fingerprint(m.completions[2][0]), Fingerprint(a.completions[0][0]));
    EXPECT_EQ(Fingerprint(m.completions[3][0]), Fingerprint(a.completions[0][0]));
  }
}

TEST_F(GenerateE2eTest, EachBadInputGetsInvalidArgumentAndTheServerKeepsServing) {
  struct Case {
    std::string name;
    std::function<void(v1::GenerateRequest*)> mutate;
    std::string expect_in_message;
  };
  const std::vector<Case> cases = {
      {"no rollouts", [](v1::GenerateRequest* r) { r->clear_rollouts(); }, "rollouts is empty"},
      {"empty prompt",
       [](v1::GenerateRequest* r) { r->mutable_rollouts(0)->clear_prompt_token_ids(); },
       "prompt_token_ids is empty"},
      {"token outside vocabulary",
       [](v1::GenerateRequest* r) { r->mutable_rollouts(0)->set_prompt_token_ids(2, 4096); },
       "prompt_token_ids[2] = 4096"},
      {"huge token id",
       [](v1::GenerateRequest* r) { r->mutable_rollouts(0)->set_prompt_token_ids(0, 4294967295u); },
       "outside the vocabulary"},
      {"no sampling", [](v1::GenerateRequest* r) { r->mutable_rollouts(0)->clear_sampling(); },
       "sampling is missing"},
      {"max_new_tokens 0",
       [](v1::GenerateRequest* r) {
         r->mutable_rollouts(0)->mutable_sampling()->set_max_new_tokens(0);
       },
       "max_new_tokens"},
      {"beyond the context",
       [](v1::GenerateRequest* r) {
         r->mutable_rollouts(0)->mutable_sampling()->set_max_new_tokens(1000000);
       },
       "exceeds the maximum context"},
      {"negative temperature",
       [](v1::GenerateRequest* r) {
         r->mutable_rollouts(0)->mutable_sampling()->set_temperature(-0.5f);
       },
       "temperature"},
      {"nan temperature",
       [](v1::GenerateRequest* r) {
         r->mutable_rollouts(0)->mutable_sampling()->set_temperature(NAN);
       },
       "temperature"},
      {"top_p zero",
       [](v1::GenerateRequest* r) { r->mutable_rollouts(0)->mutable_sampling()->set_top_p(0); },
       "top_p"},
      {"top_p above one",
       [](v1::GenerateRequest* r) { r->mutable_rollouts(0)->mutable_sampling()->set_top_p(1.5f); },
       "top_p"},
      {"negative top_k",
       [](v1::GenerateRequest* r) { r->mutable_rollouts(0)->mutable_sampling()->set_top_k(-1); },
       "top_k"},
      {"min_p above one",
       [](v1::GenerateRequest* r) { r->mutable_rollouts(0)->mutable_sampling()->set_min_p(2); },
       "min_p"},
      {"stop token outside vocabulary",
       [](v1::GenerateRequest* r) {
         r->mutable_rollouts(0)->mutable_sampling()->add_stop_token_ids(99999);
       },
       "stop_token_ids[0]"},
      {"too many top logprobs",
       [](v1::GenerateRequest* r) {
         r->mutable_rollouts(0)->mutable_sampling()->set_top_logprobs(500);
       },
       "top_logprobs"},
      {"duplicate request ids",
       [](v1::GenerateRequest* r) {
         r->mutable_rollouts(0)->set_request_id("same");
         *r->add_rollouts() = r->rollouts(0);
       },
       "request_id 'same'"},
      {"too many samples",
       [](v1::GenerateRequest* r) { r->mutable_rollouts(0)->set_num_samples(100000); },
       "num_samples"},
  };
  v1::GenerateRequest good;
  *good.add_rollouts() = MakeRollout(kPrompt, 2, 6, 0.7f);
  const std::string expected = Fingerprint(RunGenerate(stub(), good).completions[0][0]);
  for (const Case& c : cases) {
    v1::GenerateRequest bad;
    *bad.add_rollouts() = MakeRollout(kPrompt, 2, 6, 0.7f);
    *bad.add_rollouts() = MakeRollout(kPrompt, 3, 6, 0.7f);
    c.mutate(&bad);
    GenerateOutcome out = RunGenerate(stub(), bad);
    EXPECT_EQ(out.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << c.name;
    EXPECT_NE(out.status.error_message().find(c.expect_in_message), std::string::npos)
        << c.name << ": " << out.status.error_message();
    EXPECT_TRUE(out.responses.empty()) << c.name << ": nothing runs for a bad request";
    // The server keeps serving, with unchanged results.
    EXPECT_EQ(Fingerprint(RunGenerate(stub(), good).completions[0][0]), expected) << c.name;
  }
}

TEST_F(GenerateE2eTest, ServerInfoReportsModelLimitsAndCounters) {
  grpc::ClientContext context;
  v1::ServerInfo info;
  ASSERT_TRUE(stub()->GetServerInfo(&context, v1::GetServerInfoRequest(), &info).ok());
  EXPECT_EQ(info.model().architecture(), "Qwen3ForCausalLM");
  EXPECT_EQ(info.model().vocab_size(), 4096u);
  EXPECT_EQ(info.model().num_layers(), 4u);
  EXPECT_GT(info.model().max_context(), 0u);
  const char* backend = std::getenv("ROLLOUT_TEST_BACKEND");
  EXPECT_EQ(info.backend(), backend != nullptr && *backend ? backend : "cpu");
  EXPECT_FALSE(info.weight_version().empty());
  EXPECT_GT(info.limits().max_batch_tokens(), 0u);
  EXPECT_GT(info.counters().kv_blocks_total(), 0u);
  EXPECT_LE(info.counters().kv_blocks_free(), info.counters().kv_blocks_total());
  // Limits left unset take the CPU backend's defaults (the harness keeps them on cuda too).
  EXPECT_EQ(info.limits().max_running_samples(), 64u);
  EXPECT_EQ(info.limits().max_batch_tokens(), 512u);
  EXPECT_EQ(info.limits().kv_block_size(), 16u);
  EXPECT_EQ(info.limits().attention_split_size(), 64u);
  EXPECT_EQ(info.limits().admission(), "estimate") << "the default --admission";
  // The numerics contract (docs/api.md): what a trainer-side forward must compute.
  const v1::NumericsContract& n = info.numerics();
  EXPECT_EQ(n.backend(), info.backend());
  EXPECT_EQ(n.architecture(), "Qwen3ForCausalLM");
  EXPECT_EQ(n.served_dtype(), "bfloat16");
  EXPECT_EQ(n.tensor_parallel(), 1u);
  EXPECT_EQ(n.rope_type(), "default");
  EXPECT_EQ(n.row_parallel_reduction(), "canonical_k_tree_8");  // --tp_invariant on cuda
  if (info.backend() == "cpu") {
    EXPECT_EQ(n.compute_dtype(), "float32");
    EXPECT_EQ(n.kernels(), "rollout-cpu-ref/1");
    EXPECT_EQ(n.gpu_model(), "");
    EXPECT_EQ(n.gemm_algorithms_size(), 0);
  }
}

// Engine limits left at 0 take their backend's defaults; limits that were set are kept.
TEST(ServerOptionsTest, UnsetLimitsTakeTheBackendsDefaults) {
  const ServerOptions cpu = WithBackendDefaults(ServerOptions());
  EXPECT_EQ(cpu.kv_cache_bytes, 256ll << 20);
  EXPECT_EQ(cpu.kv_block_size, 16);
  EXPECT_EQ(cpu.attention_split_size, 64);
  EXPECT_EQ(cpu.max_running_samples, 64);
  EXPECT_EQ(cpu.max_batch_tokens, 512);
  ServerOptions gpu;
  gpu.backend = "cuda";
  const ServerOptions cuda = WithBackendDefaults(gpu);
  EXPECT_EQ(cuda.kv_cache_bytes, 0) << "0: the CUDA runner sizes the pool from free memory";
  EXPECT_EQ(cuda.kv_block_size, 32);
  EXPECT_EQ(cuda.attention_split_size, 256);
  EXPECT_EQ(cuda.max_running_samples, 256);
  EXPECT_EQ(cuda.max_batch_tokens, 16384);
  gpu.kv_block_size = 16;
  gpu.max_batch_tokens = 1000;
  gpu.kv_cache_bytes = 1ll << 30;
  const ServerOptions set = WithBackendDefaults(gpu);
  EXPECT_EQ(set.kv_block_size, 16);
  EXPECT_EQ(set.max_batch_tokens, 1000);
  EXPECT_EQ(set.kv_cache_bytes, 1ll << 30);
  EXPECT_EQ(set.attention_split_size, 256);
}

TEST_F(GenerateE2eTest, HealthServiceAnswersServing) {
  auto health = grpc::health::v1::Health::NewStub(server_->channel);
  grpc::ClientContext context;
  grpc::health::v1::HealthCheckRequest request;
  grpc::health::v1::HealthCheckResponse response;
  ASSERT_TRUE(health->Check(&context, request, &response).ok());
  EXPECT_EQ(response.status(), grpc::health::v1::HealthCheckResponse::SERVING);
  // By the service's name too (grpc_health_probe -service, meshes): it was NOT_FOUND.
  grpc::ClientContext by_name;
  request.set_service("rollout.v1.RolloutService");
  const grpc::Status status = health->Check(&by_name, request, &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(response.status(), grpc::health::v1::HealthCheckResponse::SERVING);
}

v1::ServerInfo Info(v1::RolloutService::Stub* stub) {
  grpc::ClientContext context;
  v1::ServerInfo info;
  EXPECT_TRUE(stub->GetServerInfo(&context, v1::GetServerInfoRequest(), &info).ok());
  return info;
}

// Waits until every KV block is back in the pool (free, or held by the prefix cache where
// any request can reuse it), or gives up after 30 s.
bool AllKvBlocksReturn(v1::RolloutService::Stub* stub) {
  for (int i = 0; i < 300; ++i) {
    v1::ServerInfo info = Info(stub);
    if (info.counters().kv_blocks_free() + info.counters().kv_blocks_cached() ==
            info.counters().kv_blocks_total() &&
        info.counters().running_samples() == 0 && info.counters().waiting_samples() == 0) {
      return true;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return false;
}

TEST_F(GenerateE2eTest, ClientCancelAbortsItsSamplesAndFreesTheirKvBlocks) {
  v1::GenerateRequest request;
  *request.add_rollouts() = MakeRollout(kPrompt, 3, 2000, 1.0f, "to-cancel");
  request.mutable_rollouts(0)->set_num_samples(4);
  request.mutable_rollouts(0)->mutable_sampling()->set_ignore_eos(true);
  grpc::ClientContext context;
  auto reader = stub()->Generate(&context, request);
  v1::GenerateResponse response;
  ASSERT_TRUE(reader->Read(&response));  // it is running
  EXPECT_LT(Info(stub()).counters().kv_blocks_free(), Info(stub()).counters().kv_blocks_total());
  context.TryCancel();
  while (reader->Read(&response)) {
  }
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_TRUE(AllKvBlocksReturn(stub()));
  // The id is free again once the call is done.
  v1::GenerateRequest again;
  *again.add_rollouts() = MakeRollout(kPrompt, 3, 2, 1.0f, "to-cancel");
  bool ok = false;
  for (int i = 0; i < 50 && !ok; ++i) {
    ok = RunGenerate(stub(), again).status.ok();
    if (!ok) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_TRUE(ok);
}

TEST_F(GenerateE2eTest, RequestIdInFlightIsRejectedWithAlreadyExists) {
  v1::GenerateRequest request;
  *request.add_rollouts() = MakeRollout(kPrompt, 3, 2000, 1.0f, "busy-id");
  request.mutable_rollouts(0)->mutable_sampling()->set_ignore_eos(true);
  grpc::ClientContext context;
  auto reader = stub()->Generate(&context, request);
  v1::GenerateResponse response;
  ASSERT_TRUE(reader->Read(&response));
  v1::GenerateRequest second;
  *second.add_rollouts() = MakeRollout(kPrompt, 4, 4, 1.0f, "busy-id");
  GenerateOutcome out = RunGenerate(stub(), second);
  EXPECT_EQ(out.status.error_code(), grpc::StatusCode::ALREADY_EXISTS);
  EXPECT_NE(out.status.error_message().find("busy-id"), std::string::npos);
  context.TryCancel();
  while (reader->Read(&response)) {
  }
  reader->Finish();
  EXPECT_TRUE(AllKvBlocksReturn(stub()));
}

TEST_F(GenerateE2eTest, StopTokenEndsTheSampleWithStop) {
  // Greedy once to learn the third token, then make it a stop token.
  v1::GenerateRequest request;
  *request.add_rollouts() = MakeRollout(kPrompt, 0, 8, 0.0f);
  request.mutable_rollouts(0)->mutable_sampling()->set_ignore_eos(true);
  GenerateOutcome first = RunGenerate(stub(), request);
  ASSERT_TRUE(first.status.ok());
  ASSERT_EQ(first.completions[0][0].token_ids_size(), 8);
  const uint32_t stop = first.completions[0][0].token_ids(2);
  request.mutable_rollouts(0)->mutable_sampling()->add_stop_token_ids(stop);
  GenerateOutcome second = RunGenerate(stub(), request);
  ASSERT_TRUE(second.status.ok());
  const v1::Completion& c = second.completions[0][0];
  EXPECT_EQ(c.finish_reason(), v1::FINISH_REASON_STOP);
  ASSERT_GE(c.token_ids_size(), 1);
  EXPECT_EQ(c.token_ids(c.token_ids_size() - 1), stop);
  EXPECT_LE(c.token_ids_size(), 3);
}

}  // namespace
}  // namespace rollout::testing
