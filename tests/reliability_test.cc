// Reliability: bad input on every RPC (with good traffic alongside that must stay bitwise
// unchanged), malformed and oversized messages, the queue limit, client faults (cancel,
// disconnect, deadline, a weight update cut off halfway), SIGTERM under load on the real
// binary, a soak with cancellations and weight updates, and the Prometheus endpoint.
// Everything runs against real servers on loopback through the real gRPC stack, and is bounded
// in time (every wait has a deadline).
#include <pthread.h>
#include <signal.h>
#include <sys/wait.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <limits>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "model/random_model.h"
#include "tests/reliability_util.h"
#include "tests/test_server.h"

namespace rollout::testing {
namespace {

namespace rel = ::rollout::testing::reliability;

using std::chrono::milliseconds;
using std::chrono::seconds;
using Clock = std::chrono::steady_clock;

constexpr char kService[] = "/rollout.v1.RolloutService/";
constexpr char kTensor[] = "model.layers.2.mlp.up_proj.weight";
const std::vector<uint32_t> kPrompt = {17, 4, 901, 33, 2048, 7, 250, 3999, 12};

std::string Method(const std::string& name) { return kService + name; }

std::string ScoreFingerprint(const v1::ScoreResponse& response) {
  std::string out;
  for (const v1::ScoredSequence& r : response.results()) {
    for (float lp : r.logprobs()) {
      uint32_t bits;
      std::memcpy(&bits, &lp, sizeof(bits));
      absl::StrAppend(&out, absl::Hex(bits), ",");
    }
    absl::StrAppend(&out, "|", r.weight_version(), ";");
  }
  return out;
}

std::string GenerateFingerprint(const GenerateOutcome& out) {
  std::string s = absl::StrCat(out.status.error_code(), ":");
  for (const auto& rollout : out.completions) {
    for (const v1::Completion& c : rollout) absl::StrAppend(&s, Fingerprint(c), "/");
  }
  return s;
}

// A request that exercises every sampling knob, two rollouts, n = 2.
v1::GenerateRequest GoodGenerateRequest() {
  v1::GenerateRequest request;
  *request.add_rollouts() = MakeRollout(kPrompt, 42, 12, 0.8f);
  request.mutable_rollouts(0)->set_num_samples(2);
  v1::SamplingParams* s = request.mutable_rollouts(0)->mutable_sampling();
  s->set_top_k(50);
  s->set_top_p(0.95f);
  s->set_min_p(0.01f);
  s->set_top_logprobs(3);
  *request.add_rollouts() = MakeRollout({5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, 7, 10, 0.0f);
  request.mutable_rollouts(1)->mutable_sampling()->set_ignore_eos(true);
  return request;
}

v1::ScoreRequest GoodScoreRequest() {
  v1::ScoreRequest request;
  v1::ScoreSequence* seq = request.add_sequences();
  for (uint32_t t : kPrompt) seq->add_token_ids(t);
  for (uint32_t t : {100u, 200u, 300u, 400u}) seq->add_token_ids(t);
  seq->set_start(kPrompt.size());
  seq->set_temperature(0.7f);
  seq->set_top_logprobs(2);
  return request;
}

// A Generate call as a client sees it, without assuming anything about the request (unlike
// RunGenerate, which sizes its result by num_samples).
struct RawOutcome {
  grpc::Status status;
  int responses = 0;
};
RawOutcome CallGenerate(v1::RolloutService::Stub* stub, const v1::GenerateRequest& request) {
  RawOutcome out;
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + seconds(120));
  auto reader = stub->Generate(&context, request);
  v1::GenerateResponse response;
  while (reader->Read(&response)) ++out.responses;
  out.status = reader->Finish();
  return out;
}

grpc::Status CallScore(v1::RolloutService::Stub* stub, const v1::ScoreRequest& request,
                       v1::ScoreResponse* response) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + seconds(60));
  return stub->Score(&context, request, response);
}

// Good requests run in a loop on their own thread (and channel) while something else happens;
// every answer must equal, bitwise, what the same request returned with the server to itself.
class GoodTraffic {
 public:
  explicit GoodTraffic(const std::string& address)
      : channel_(grpc::CreateChannel(address, grpc::InsecureChannelCredentials())),
        stub_(v1::RolloutService::NewStub(channel_)) {
    // Baselines, alone.
    GenerateOutcome g = RunGenerate(stub_.get(), GoodGenerateRequest());
    EXPECT_TRUE(g.status.ok()) << g.status.error_message();
    generate_baseline_ = GenerateFingerprint(g);
    v1::ScoreResponse s;
    EXPECT_TRUE(CallScore(stub_.get(), GoodScoreRequest(), &s).ok());
    score_baseline_ = ScoreFingerprint(s);
  }

  void Start() {
    thread_ = std::thread([this] {
      while (!stop_) {
        GenerateOutcome g = RunGenerate(stub_.get(), GoodGenerateRequest());
        Check("Generate", GenerateFingerprint(g), generate_baseline_, g.status);
        v1::ScoreResponse s;
        grpc::Status status = CallScore(stub_.get(), GoodScoreRequest(), &s);
        Check("Score", ScoreFingerprint(s), score_baseline_, status);
      }
    });
  }

  // Stops after at least `min_rounds` rounds ran (bounded by 60 s); returns how many ran.
  int Stop(int min_rounds = 1) {
    const auto deadline = Clock::now() + seconds(60);
    while (rounds_ < min_rounds && Clock::now() < deadline) {
      std::this_thread::sleep_for(milliseconds(10));
    }
    stop_ = true;
    if (thread_.joinable()) thread_.join();
    return rounds_;
  }

  std::vector<std::string> failures() {
    std::lock_guard<std::mutex> lock(mu_);
    return failures_;
  }

 private:
  void Check(const char* what, const std::string& got, const std::string& want,
             const grpc::Status& status) {
    ++rounds_;
    if (status.ok() && got == want) return;
    std::lock_guard<std::mutex> lock(mu_);
    failures_.push_back(absl::StrCat(what, ": status ", status.error_code(), " '",
                                     status.error_message(), "', bitwise ",
                                     got == want ? "equal" : "DIFFERENT"));
  }

  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::RolloutService::Stub> stub_;
  std::string generate_baseline_, score_baseline_;
  std::thread thread_;
  std::atomic<bool> stop_{false};
  std::atomic<int> rounds_{0};
  std::mutex mu_;
  std::vector<std::string> failures_;
};

// ---------------------------------------------------------------------------------------------
// Bad input on every RPC, with good traffic alongside.

class ReliabilityBadInputTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { server_ = StartTestServer().release(); }
  static void TearDownTestSuite() {
    delete server_;
    server_ = nullptr;
  }
  void SetUp() override {
    ASSERT_NE(server_, nullptr);
    traffic_ = std::make_unique<GoodTraffic>(server_->address());
    traffic_->Start();
  }
  void TearDown() override {
    const int rounds = traffic_->Stop(/*min_rounds=*/4);
    EXPECT_GE(rounds, 4);
    for (const std::string& f : traffic_->failures()) ADD_FAILURE() << "good traffic: " << f;
    EXPECT_TRUE(rel::IsServing(server_->channel));
    std::string last;
    EXPECT_TRUE(rel::WaitForQuiescence(stub(), seconds(30), &last)) << last;
    const v1::ServerInfo info = rel::FetchServerInfo(stub());
    EXPECT_EQ(info.weight_version(), "0");
    EXPECT_FALSE(info.paused());
    EXPECT_FALSE(info.weight_update_in_progress());
  }
  static v1::RolloutService::Stub* stub() { return server_->stub.get(); }
  static int32_t max_context() {
    return static_cast<int32_t>(rel::FetchServerInfo(stub()).model().max_context());
  }

  // Asserts the code and that every `needles` substring is in the message, then that the
  // server still answers health checks with SERVING.
  static void ExpectStatus(const std::string& name, const grpc::Status& status,
                           grpc::StatusCode code, const std::vector<std::string>& needles) {
    EXPECT_EQ(status.error_code(), code) << name << ": '" << status.error_message() << "'";
    for (const std::string& needle : needles) {
      EXPECT_NE(status.error_message().find(needle), std::string::npos)
          << name << ": message '" << status.error_message() << "' lacks '" << needle << "'";
    }
    EXPECT_TRUE(rel::IsServing(server_->channel)) << name;
  }

  static TestServer* server_;
  std::unique_ptr<GoodTraffic> traffic_;
};
TestServer* ReliabilityBadInputTest::server_ = nullptr;

TEST_F(ReliabilityBadInputTest, GenerateBoundariesNameTheRolloutAndField) {
  const int32_t context = max_context();
  struct Case {
    std::string name;
    std::function<void(v1::GenerateRequest*)> mutate;
    std::vector<std::string> expect;
  };
  auto sampling = [](v1::GenerateRequest* r, int i) {
    return r->mutable_rollouts(i)->mutable_sampling();
  };
  const std::vector<Case> cases = {
      {"one past the context",
       [&](v1::GenerateRequest* r) {
         sampling(r, 1)->set_max_new_tokens(context - static_cast<int>(kPrompt.size()) + 1);
       },
       {"rollouts[1].", "exceeds the maximum context", absl::StrCat(context)}},
      // Beyond int32 too, the field and the bound it exceeds (once "max_new_tokens = ... or
      // top_logprobs = 0 is out of range", blaming a field left unset).
      {"max_new_tokens wraps int32",
       [&](v1::GenerateRequest* r) { sampling(r, 0)->set_max_new_tokens(4294967295u); },
       {"rollouts[0].prompt (", "sampling.max_new_tokens (4294967295)",
        absl::StrCat("exceeds the maximum context of ", context, " tokens")}},
      {"max_new_tokens 2^31",
       [&](v1::GenerateRequest* r) { sampling(r, 1)->set_max_new_tokens(2147483648u); },
       {"rollouts[1].prompt (", "sampling.max_new_tokens (2147483648)",
        absl::StrCat("exceeds the maximum context of ", context, " tokens")}},
      {"top_logprobs one past 20",
       [&](v1::GenerateRequest* r) { sampling(r, 1)->set_top_logprobs(21); },
       {"rollouts[1].sampling.top_logprobs = 21; at most 20 are returned"}},
      // Past the wire check's old 1024 the bound is the same 20.
      {"top_logprobs 1025",
       [&](v1::GenerateRequest* r) { sampling(r, 1)->set_top_logprobs(1025); },
       {"rollouts[1].sampling.top_logprobs = 1025; at most 20 are returned"}},
      {"top_logprobs huge",
       [&](v1::GenerateRequest* r) { sampling(r, 0)->set_top_logprobs(4000000000u); },
       {"rollouts[0].sampling.top_logprobs = 4000000000; at most 20 are returned"}},
      {"infinite temperature",
       [&](v1::GenerateRequest* r) {
         sampling(r, 1)->set_temperature(std::numeric_limits<float>::infinity());
       },
       {"rollouts[1].sampling.temperature", "finite"}},
      {"nan top_p",
       [&](v1::GenerateRequest* r) { sampling(r, 0)->set_top_p(NAN); },
       {"rollouts[0].sampling.top_p", "(0, 1]"}},
      {"negative top_p",
       [&](v1::GenerateRequest* r) { sampling(r, 1)->set_top_p(-0.1f); },
       {"rollouts[1].sampling.top_p"}},
      {"negative min_p",
       [&](v1::GenerateRequest* r) { sampling(r, 1)->set_min_p(-0.01f); },
       {"rollouts[1].sampling.min_p", "[0, 1]"}},
      {"nan min_p",
       [&](v1::GenerateRequest* r) { sampling(r, 0)->set_min_p(NAN); },
       {"rollouts[0].sampling.min_p"}},
      {"most negative top_k",
       [&](v1::GenerateRequest* r) {
         sampling(r, 1)->set_top_k(std::numeric_limits<int32_t>::min());
       },
       {"rollouts[1].sampling.top_k", ">= 0"}},
      {"stop token = vocab size",
       [&](v1::GenerateRequest* r) {
         sampling(r, 1)->add_stop_token_ids(3);
         sampling(r, 1)->add_stop_token_ids(4096);
       },
       {"rollouts[1].sampling.stop_token_ids[1] = 4096", "[0, 4096)"}},
      {"prompt token in the second rollout",
       [&](v1::GenerateRequest* r) { r->mutable_rollouts(1)->add_prompt_token_ids(4096); },
       {"rollouts[1].prompt_token_ids[9] = 4096"}},
      {"empty prompt in the second rollout",
       [&](v1::GenerateRequest* r) { r->mutable_rollouts(1)->clear_prompt_token_ids(); },
       {"rollouts[1].prompt_token_ids is empty"}},
      {"sampling missing in the second rollout",
       [&](v1::GenerateRequest* r) { r->mutable_rollouts(1)->clear_sampling(); },
       {"rollouts[1].sampling is missing", "max_new_tokens"}},
      {"num_samples one past 1024",
       [&](v1::GenerateRequest* r) { r->mutable_rollouts(1)->set_num_samples(1025); },
       {"rollouts[1].num_samples = 1025", "at most 1024"}},
      {"num_samples max uint32",
       [&](v1::GenerateRequest* r) { r->mutable_rollouts(0)->set_num_samples(4294967295u); },
       {"rollouts[0].num_samples", "at most 1024"}},
      {"more than 16384 samples in all",
       [&](v1::GenerateRequest* r) {
         for (int i = 0; i < 2; ++i) r->mutable_rollouts(i)->set_num_samples(1024);
         for (int i = 0; i < 15; ++i) {
           *r->add_rollouts() = r->rollouts(0);
         }
       },
       {"more than 16384 samples", "split it"}},
      {"duplicate id, later rollout named",
       [&](v1::GenerateRequest* r) {
         r->mutable_rollouts(0)->set_request_id("dup");
         *r->add_rollouts() = r->rollouts(1);
         r->mutable_rollouts(2)->set_request_id("dup");
       },
       {"rollouts[2].request_id 'dup'", "earlier rollout"}},
      // Held as a key while the rollout runs: 100,000 bytes were taken.
      {"request id beyond 256 bytes",
       [&](v1::GenerateRequest* r) {
         r->mutable_rollouts(1)->set_request_id(std::string(257, 'x'));
       },
       {"rollouts[1].request_id is 257 bytes; at most 256"}},
  };
  for (const Case& c : cases) {
    v1::GenerateRequest request;
    *request.add_rollouts() = MakeRollout(kPrompt, 1, 8, 0.7f);
    *request.add_rollouts() = MakeRollout(kPrompt, 2, 8, 0.7f);
    c.mutate(&request);
    RawOutcome out = CallGenerate(stub(), request);
    ExpectStatus(c.name, out.status, grpc::StatusCode::INVALID_ARGUMENT, c.expect);
    EXPECT_EQ(out.responses, 0) << c.name << ": nothing streams for a bad request";
  }
  // The accepted side of a boundary: 20 top logprobs.
  v1::GenerateRequest edge;
  *edge.add_rollouts() = MakeRollout(kPrompt, 3, 2, 1.0f);
  edge.mutable_rollouts(0)->mutable_sampling()->set_top_logprobs(20);
  GenerateOutcome out = RunGenerate(stub(), edge);
  ASSERT_TRUE(out.status.ok()) << out.status.error_message();
  EXPECT_EQ(out.completions[0][0].top_logprobs(0).entries_size(), 20);
}

TEST_F(ReliabilityBadInputTest, ScoreBoundariesNameTheSequenceAndField) {
  const int32_t context = max_context();
  struct Case {
    std::string name;
    std::function<void(v1::ScoreRequest*)> mutate;
    std::vector<std::string> expect;
  };
  const std::vector<Case> cases = {
      {"empty token_ids",
       [](v1::ScoreRequest* r) {
         r->mutable_sequences(1)->clear_token_ids();
         r->mutable_sequences(1)->set_start(1);
       },
       {"sequences[1] has 0 tokens", "needs at least 2"}},
      {"single token",
       [](v1::ScoreRequest* r) {
         r->mutable_sequences(1)->clear_token_ids();
         r->mutable_sequences(1)->add_token_ids(5);
       },
       {"sequences[1] has 1 token;", "needs at least 2"}},
      {"start past the last token",
       [](v1::ScoreRequest* r) {
         r->mutable_sequences(1)->set_start(r->sequences(1).token_ids_size());
       },
       {"sequences[1].start = ", "it must be in [1, "}},
      {"nan temperature",
       [](v1::ScoreRequest* r) { r->mutable_sequences(1)->set_temperature(NAN); },
       {"sequences[1].temperature", "finite"}},
      {"infinite temperature",
       [](v1::ScoreRequest* r) {
         r->mutable_sequences(0)->set_temperature(std::numeric_limits<float>::infinity());
       },
       {"sequences[0].temperature"}},
      // ScoreSequence's own field (it has no `sampling`), and the bound.
      {"top_logprobs one past 20",
       [](v1::ScoreRequest* r) { r->mutable_sequences(1)->set_top_logprobs(21); },
       {"sequences[1].top_logprobs = 21; at most 20 are returned"}},
      {"top_logprobs 2000",
       [](v1::ScoreRequest* r) { r->mutable_sequences(0)->set_top_logprobs(2000); },
       {"sequences[0].top_logprobs = 2000; at most 20 are returned"}},
      {"top_logprobs max uint32",
       [](v1::ScoreRequest* r) { r->mutable_sequences(1)->set_top_logprobs(4294967295u); },
       {"sequences[1].top_logprobs = 4294967295; at most 20 are returned"}},
      {"max uint32 token",
       [](v1::ScoreRequest* r) { r->mutable_sequences(1)->set_token_ids(0, 4294967295u); },
       {"sequences[1].token_ids[0] = 4294967295", "outside the vocabulary"}},
      {"beyond the context",
       [&](v1::ScoreRequest* r) {
         for (int i = 0; i <= context; ++i) r->mutable_sequences(1)->add_token_ids(i % 4000);
       },
       {"sequences[1].", "maximum context"}},
      {"more than 16384 sequences",
       [](v1::ScoreRequest* r) {
         while (r->sequences_size() <= 16384) *r->add_sequences() = r->sequences(0);
       },
       {"more than 16384 sequences", "split it"}},
  };
  for (const Case& c : cases) {
    v1::ScoreRequest request = GoodScoreRequest();
    *request.add_sequences() = request.sequences(0);
    c.mutate(&request);
    v1::ScoreResponse response;
    grpc::Status status = CallScore(stub(), request, &response);
    ExpectStatus(c.name, status, grpc::StatusCode::INVALID_ARGUMENT, c.expect);
  }
}

TEST_F(ReliabilityBadInputTest, ControlRpcsAnswerOddRequestsPrecisely) {
  // Abort: ids that are not in flight are listed back, nothing else happens.
  {
    grpc::ClientContext context;
    v1::AbortRequest request;
    request.add_request_ids("");
    request.add_request_ids("never-started");
    for (int i = 0; i < 1000; ++i) request.add_request_ids(absl::StrCat("ghost-", i));
    v1::AbortResponse response;
    grpc::Status status = stub()->Abort(&context, request, &response);
    ASSERT_TRUE(status.ok()) << status.error_message();
    EXPECT_EQ(response.aborted_rollouts(), 0u);
    EXPECT_EQ(response.unknown_request_ids_size(), 1002);
    EXPECT_EQ(response.unknown_request_ids(1), "never-started");
  }
  {
    grpc::ClientContext context;
    v1::AbortResponse response;
    ExpectStatus("abort with nothing named", stub()->Abort(&context, {}, &response),
                 grpc::StatusCode::INVALID_ARGUMENT, {"request_ids", "all"});
  }
  // FlushCache under traffic: running samples keep their KV; results stay bitwise the same.
  for (int i = 0; i < 5; ++i) {
    grpc::ClientContext context;
    v1::FlushCacheResponse response;
    ASSERT_TRUE(stub()->FlushCache(&context, {}, &response).ok());
    std::this_thread::sleep_for(milliseconds(30));
  }
  // Pause / Resume are idempotent and report the previous state; held work resumes unchanged.
  {
    grpc::ClientContext c1, c2, c3, c4;
    v1::PauseResponse p1, p2;
    v1::ResumeResponse r1, r2;
    ASSERT_TRUE(stub()->Resume(&c1, {}, &r1).ok());
    EXPECT_FALSE(r1.was_paused());
    ASSERT_TRUE(stub()->Pause(&c2, {}, &p1).ok());
    EXPECT_FALSE(p1.was_paused());
    ASSERT_TRUE(stub()->Pause(&c3, {}, &p2).ok());
    EXPECT_TRUE(p2.was_paused());
    EXPECT_TRUE(rel::FetchServerInfo(stub()).paused());
    EXPECT_TRUE(rel::IsServing(server_->channel)) << "paused is still serving (requests are held)";
    std::this_thread::sleep_for(milliseconds(200));
    ASSERT_TRUE(stub()->Resume(&c4, {}, &r2).ok());
    EXPECT_TRUE(r2.was_paused());
  }
  // GetServerInfo ignores unknown fields (forward compatibility), sent as raw bytes.
  {
    v1::GetServerInfoRequest request;
    std::string payload;
    request.SerializeToString(&payload);
    payload += std::string("\xa0\x06\x07", 3);  // field 100, varint 7: unknown to this server
    EXPECT_TRUE(rel::RawCall(server_->channel, Method("GetServerInfo"), payload).ok());
  }
}

TEST_F(ReliabilityBadInputTest, BadWeightUpdatesAreRefusedAndTheSlotIsFreedEachTime) {
  const HostTensor original = rel::ReadCheckpointTensor(server_->server->model_dir(), kTensor);
  const std::vector<HostTensor> changed = {rel::ScaledBf16(original, 3.0f)};
  const v1::WeightsHeader header =
      rel::MakeWeightsHeader("bad", v1::IN_FLIGHT_POLICY_CONTINUE, changed);
  const std::vector<v1::WeightsChunk> data = rel::MakeDataChunks(changed, 8192);
  auto with_header = [&](const v1::WeightsHeader& h, std::vector<v1::WeightsChunk> d) {
    v1::WeightsChunk first;
    *first.mutable_header() = h;
    d.insert(d.begin(), first);
    return d;
  };
  struct Case {
    std::string name;
    std::vector<v1::WeightsChunk> chunks;
    std::vector<std::string> expect;
  };
  std::vector<Case> cases;
  cases.push_back({"empty stream", {}, {"without a WeightsHeader"}});
  cases.push_back({"data before the header", data, {"before the WeightsHeader"}});
  cases.push_back({"empty chunk", {v1::WeightsChunk()}, {"empty WeightsChunk"}});
  {
    v1::WeightsHeader h = header;
    h.clear_tensors();
    cases.push_back({"no tensors declared", with_header(h, {}), {"header.tensors is empty"}});
  }
  cases.push_back({"header only", with_header(header, {}), {"incomplete", kTensor}});
  {
    std::vector<v1::WeightsChunk> d = data;
    d[1].mutable_data()->clear_data();
    cases.push_back({"empty data chunk", with_header(header, d), {"empty data chunk", kTensor}});
  }
  {
    std::vector<v1::WeightsChunk> d = data;
    d[1].mutable_data()->set_offset(std::numeric_limits<uint64_t>::max() - 100);
    cases.push_back({"offset wraps uint64", with_header(header, d), {"beyond its", kTensor}});
  }
  {
    std::vector<v1::WeightsChunk> d = data;
    d[2] = d[1];
    cases.push_back({"chunk sent twice", with_header(header, d), {"overlaps", kTensor}});
  }
  {
    v1::WeightsHeader h = header;
    h.mutable_tensors(0)->clear_dtype();
    cases.push_back({"no dtype", with_header(h, data), {"header.tensors[0]", "dtype ''"}});
  }
  {
    v1::WeightsHeader h = header;
    h.mutable_tensors(0)->add_shape(1);
    cases.push_back({"extra dimension", with_header(h, data), {"header.tensors[0]", "shape"}});
  }
  {
    v1::WeightsHeader h = header;
    h.mutable_tensors(0)->clear_shape();
    cases.push_back({"no shape", with_header(h, data), {"header.tensors[0]", "shape"}});
  }
  {
    v1::WeightsHeader h = header;
    h.mutable_tensors(0)->set_shape(0, std::numeric_limits<uint64_t>::max());
    cases.push_back({"huge dimension", with_header(h, data), {"header.tensors[0]", "shape"}});
  }
  {
    v1::WeightsHeader h = header;
    h.mutable_tensors(0)->set_name("");
    cases.push_back({"empty name", with_header(h, data), {"header.tensors[0]"}});
  }
  for (const Case& c : cases) {
    v1::UpdateWeightsResponse response;
    grpc::Status status = rel::PushChunks(stub(), c.chunks, &response);
    ExpectStatus(c.name, status, grpc::StatusCode::INVALID_ARGUMENT, c.expect);
    EXPECT_EQ(rel::FetchServerInfo(stub()).weight_version(), "0") << c.name;
    // The single update slot was released: the next case is not refused with ABORTED.
    EXPECT_FALSE(rel::FetchServerInfo(stub()).weight_update_in_progress()) << c.name;
  }
}

TEST_F(ReliabilityBadInputTest, BadCheckpointPathsAreRefusedNamingTheFile) {
  namespace fs = std::filesystem;
  const std::string root = ::testing::TempDir() + "reliability-bad-checkpoints/";
  fs::remove_all(root);
  fs::create_directories(root);
  const std::string served = server_->server->model_dir();
  // config.json only.
  fs::create_directories(root + "no-weights");
  fs::copy_file(served + "/config.json", root + "no-weights/config.json");
  // A safetensors file whose header length runs past the file.
  fs::create_directories(root + "corrupt");
  fs::copy_file(served + "/config.json", root + "corrupt/config.json");
  {
    std::ofstream f(root + "corrupt/model.safetensors", std::ios::binary);
    const uint64_t len = 1ull << 40;
    f.write(reinterpret_cast<const char*>(&len), 8);
    f << "{}";
  }
  // A sharded index that escapes the directory.
  fs::create_directories(root + "escape");
  fs::copy_file(served + "/config.json", root + "escape/config.json");
  {
    std::ofstream f(root + "escape/model.safetensors.index.json");
    f << R"({"weight_map": {"model.norm.weight": "../corrupt/model.safetensors"}})";
  }
  // A valid checkpoint of a different model (the tiny preset): shapes do not match.
  RandomModelOptions tiny;
  tiny.preset = "tiny";
  ASSERT_TRUE(WriteRandomModel(tiny, root + "tiny").ok());
  // A truncated copy of the served weights.
  fs::create_directories(root + "truncated");
  fs::copy_file(served + "/config.json", root + "truncated/config.json");
  fs::copy_file(served + "/model.safetensors", root + "truncated/model.safetensors");
  fs::resize_file(root + "truncated/model.safetensors",
                  fs::file_size(root + "truncated/model.safetensors") / 2);

  struct Case {
    std::string name, path, version;
    grpc::StatusCode code;
    std::vector<std::string> expect;
  };
  const std::vector<Case> cases = {
      {"empty version", served, "", grpc::StatusCode::INVALID_ARGUMENT, {"version is empty"}},
      {"a line break in the version",
       served,
       "step\n7",
       grpc::StatusCode::INVALID_ARGUMENT,
       {"control character 0x0a at byte 4"}},
      {"a NUL in the version",
       served,
       std::string("a\0b", 3),
       grpc::StatusCode::INVALID_ARGUMENT,
       {"control character 0x00 at byte 1"}},
      {"missing directory", root + "nope", "x", grpc::StatusCode::NOT_FOUND, {root + "nope"}},
      {"no weights",
       root + "no-weights",
       "x",
       grpc::StatusCode::NOT_FOUND,
       {"no weights in", root + "no-weights"}},
      {"corrupt header",
       root + "corrupt",
       "x",
       grpc::StatusCode::INVALID_ARGUMENT,
       {root + "corrupt/model.safetensors", "header length"}},
      {"index escapes the directory",
       root + "escape",
       "x",
       grpc::StatusCode::INVALID_ARGUMENT,
       {"model.norm.weight", "not a file name inside"}},
      {"another model's config (and shapes)",
       root + "tiny",
       "x",
       grpc::StatusCode::FAILED_PRECONDITION,
       {root + "tiny/config.json", "has num_hidden_layers 2; the served model has 4"}},
      {"truncated file",
       root + "truncated",
       "x",
       grpc::StatusCode::INVALID_ARGUMENT,
       {root + "truncated/model.safetensors"}},
  };
  for (const Case& c : cases) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + seconds(120));
    v1::UpdateWeightsFromPathRequest request;
    request.set_path(c.path);
    request.set_version(c.version);
    request.set_policy(v1::IN_FLIGHT_POLICY_CONTINUE);
    v1::UpdateWeightsResponse response;
    grpc::Status status = stub()->UpdateWeightsFromPath(&context, request, &response);
    ExpectStatus(c.name, status, c.code, c.expect);
    EXPECT_FALSE(rel::FetchServerInfo(stub()).weight_update_in_progress()) << c.name;
  }
  fs::remove_all(root);
}

// A path that names a file rather than a checkpoint directory is the caller's mistake: not
// INTERNAL (which tells operators the server is broken; it once was, from ENOTDIR on
// "<path>/config.json"), but INVALID_ARGUMENT saying what to pass instead.
TEST_F(ReliabilityBadInputTest, ACheckpointPathThatIsAFileIsInvalidArgumentAskingForADirectory) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + seconds(60));
  v1::UpdateWeightsFromPathRequest request;
  request.set_path(server_->server->model_dir() + "/config.json");
  request.set_version("x");
  v1::UpdateWeightsResponse response;
  const grpc::Status status = stub()->UpdateWeightsFromPath(&context, request, &response);
  ExpectStatus("a file as the checkpoint path", status, grpc::StatusCode::INVALID_ARGUMENT,
               {request.path() + " is a file", "expected a checkpoint directory"});
  EXPECT_FALSE(rel::FetchServerInfo(stub()).weight_update_in_progress());
}

TEST_F(ReliabilityBadInputTest, MalformedProtobufBytesOnEveryMethodAreRejected) {
  // gRPC's callback API answers a request message it cannot deserialize with UNIMPLEMENTED and
  // an empty message (grpc 1.51: UnimplementedUnaryReactor) for unary and server-streaming
  // methods, before any handler runs; a client-streaming method (UpdateWeights) sees a failed
  // read and answers INVALID_ARGUMENT itself. What matters here: never OK, never a crash, the
  // server keeps serving and nothing changes (no pause, no update).
  //
  // Each payload is not a parseable message of any type: a length-delimited field whose
  // length runs past the end, an invalid wire type, a truncated varint, a group start with no
  // end.
  const std::vector<std::string> payloads = {std::string("\x0a\xff\xff\xff\xff\x0f", 6),
                                             std::string("\x0f", 1), std::string("\x08\x80", 2),
                                             std::string("\x0b\x10\x01", 3),
                                             std::string("\x12\x05\x01\x02", 4)};
  const std::vector<std::string> methods = {"Generate",
                                            "Score",
                                            "GetServerInfo",
                                            "Abort",
                                            "FlushCache",
                                            "UpdateWeights",
                                            "UpdateWeightsFromPath",
                                            "Pause",
                                            "Resume",
                                            "ReleaseMemory",
                                            "ResumeMemory",
                                            "JoinWeightSyncGroup",
                                            "LeaveWeightSyncGroup",
                                            "UpdateWeightsFromBroadcast"};
  for (const std::string& method : methods) {
    for (size_t p = 0; p < payloads.size(); ++p) {
      const std::string name = absl::StrCat(method, " payload ", p);
      grpc::Status status = rel::RawCall(server_->channel, Method(method), payloads[p]);
      EXPECT_FALSE(status.ok()) << name;
      EXPECT_TRUE(status.error_code() == grpc::StatusCode::INTERNAL ||
                  status.error_code() == grpc::StatusCode::INVALID_ARGUMENT ||
                  status.error_code() == grpc::StatusCode::UNIMPLEMENTED)
          << name << ": " << status.error_code() << " " << status.error_message();
      EXPECT_TRUE(rel::IsServing(server_->channel)) << name;
    }
  }
  const v1::ServerInfo info = rel::FetchServerInfo(stub());
  EXPECT_FALSE(info.paused()) << "a garbage Pause must not pause";
  EXPECT_FALSE(info.has_memory_released()) << "a garbage ReleaseMemory must not release";
  EXPECT_EQ(info.weight_version(), "0");
}

// Header and every byte arrive, then a message that does not parse, then the half-close: the
// call fails with INVALID_ARGUMENT naming the bad message and nothing is applied. (On a typed
// stream gRPC reports an unparseable message as it reports the half-close, so a complete update
// followed by garbage was once applied and answered OK.)
TEST_F(ReliabilityBadInputTest, AnUnparseableMessageAfterACompleteUpdateFailsItAndAppliesNothing) {
  const HostTensor original = rel::ReadCheckpointTensor(server_->server->model_dir(), kTensor);
  const std::vector<HostTensor> changed = {rel::ScaledBf16(original, 3.0f)};
  grpc::GenericStub generic(server_->channel);
  grpc::CompletionQueue cq;
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + seconds(60));
  auto call = generic.PrepareCall(&context, Method("UpdateWeights"), &cq);
  ASSERT_NE(call, nullptr);
  void* tag;
  bool ok;
  call->StartCall(nullptr);
  ASSERT_TRUE(cq.Next(&tag, &ok) && ok);
  std::vector<std::string> messages;
  {
    v1::WeightsChunk first;
    *first.mutable_header() =
        rel::MakeWeightsHeader("garbage-tail", v1::IN_FLIGHT_POLICY_CONTINUE, changed);
    messages.push_back(first.SerializeAsString());
    for (const v1::WeightsChunk& c : rel::MakeDataChunks(changed, 1 << 20)) {
      messages.push_back(c.SerializeAsString());
    }
    messages.push_back(std::string("\x0a\xff\xff\xff\xff\x0f", 6));
  }
  for (const std::string& m : messages) {
    grpc::Slice slice(m);
    grpc::ByteBuffer buffer(&slice, 1);
    call->Write(buffer, nullptr);
    if (!cq.Next(&tag, &ok) || !ok) break;
  }
  call->WritesDone(nullptr);
  cq.Next(&tag, &ok);
  grpc::ByteBuffer response;
  call->Read(&response, nullptr);
  cq.Next(&tag, &ok);
  grpc::Status status;
  call->Finish(&status, nullptr);
  cq.Next(&tag, &ok);
  cq.Shutdown();
  while (cq.Next(&tag, &ok)) {
  }
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
  EXPECT_NE(status.error_message().find(absl::StrCat("message ", messages.size(),
                                                     " of the stream is not a valid WeightsChunk")),
            std::string::npos)
      << status.error_message();
  // Either way, restore so the other tests of this suite see the original weights.
  const v1::ServerInfo info = rel::FetchServerInfo(stub());
  if (info.weight_version() != "0") {
    std::vector<v1::WeightsChunk> restore = rel::MakeDataChunks({original}, 1 << 20);
    v1::WeightsChunk first;
    *first.mutable_header() = rel::MakeWeightsHeader("0", v1::IN_FLIGHT_POLICY_DRAIN, {original});
    restore.insert(restore.begin(), first);
    ASSERT_TRUE(rel::PushChunks(stub(), restore).ok());
  }
  EXPECT_EQ(info.weight_version(), "0") << "the update was applied";
}

TEST_F(ReliabilityBadInputTest, MessagesOverTheReceiveLimitGetResourceExhausted) {
  constexpr size_t kOver = (64u << 20) + 1024;  // the server takes at most 64 MiB per message
  {
    v1::GenerateRequest request = GoodGenerateRequest();
    request.mutable_rollouts(0)->set_request_id(std::string(kOver, 'x'));
    GenerateOutcome out = RunGenerate(stub(), request);
    ExpectStatus("Generate", out.status, grpc::StatusCode::RESOURCE_EXHAUSTED, {});
    EXPECT_TRUE(out.responses.empty());
  }
  {
    // One TensorData chunk over the limit, after a valid header: nothing is applied.
    const HostTensor original = rel::ReadCheckpointTensor(server_->server->model_dir(), kTensor);
    std::vector<v1::WeightsChunk> chunks(2);
    *chunks[0].mutable_header() =
        rel::MakeWeightsHeader("huge", v1::IN_FLIGHT_POLICY_CONTINUE, {original});
    chunks[1].mutable_data()->set_name(kTensor);
    chunks[1].mutable_data()->set_data(std::string(kOver, '\0'));
    ExpectStatus("UpdateWeights", rel::PushChunks(stub(), chunks),
                 grpc::StatusCode::RESOURCE_EXHAUSTED, {});
    EXPECT_EQ(rel::FetchServerInfo(stub()).weight_version(), "0");
  }
  const std::string big(kOver, '\x01');
  for (const char* method : {"Score", "Abort", "UpdateWeightsFromPath", "GetServerInfo"}) {
    ExpectStatus(method, rel::RawCall(server_->channel, Method(method), big),
                 grpc::StatusCode::RESOURCE_EXHAUSTED, {});
  }
  std::string last;
  EXPECT_TRUE(rel::WaitForQuiescence(stub(), seconds(30), &last)) << last;
  // The update slot was released even though the stream was cut by the transport.
  const auto deadline = Clock::now() + seconds(10);
  while (rel::FetchServerInfo(stub()).weight_update_in_progress() && Clock::now() < deadline) {
    std::this_thread::sleep_for(milliseconds(20));
  }
}

// ---------------------------------------------------------------------------------------------
// Access control on every RPC (the weights suite covers a missing or wrong token on some).

TEST(ReliabilityAuthTest, EveryProtectedRpcRefusesMissingAndMalformedTokens) {
  ServerOptions options;
  options.auth_token = "s3cret";
  options.auth_all_rpcs = true;
  std::unique_ptr<TestServer> server = StartTestServer(options);
  ASSERT_NE(server, nullptr);
  v1::RolloutService::Stub* stub = server->stub.get();
  // Each RPC with a given authorization header value ("" = none); returns the status.
  const std::vector<std::pair<std::string, std::function<grpc::Status(grpc::ClientContext*)>>>
      rpcs = {
          {"Generate",
           [&](grpc::ClientContext* c) {
             v1::GenerateRequest r;
             *r.add_rollouts() = MakeRollout(kPrompt, 1, 2, 1.0f);
             auto reader = stub->Generate(c, r);
             v1::GenerateResponse response;
             while (reader->Read(&response)) {
             }
             return reader->Finish();
           }},
          {"Score",
           [&](grpc::ClientContext* c) {
             v1::ScoreResponse response;
             return stub->Score(c, GoodScoreRequest(), &response);
           }},
          {"GetServerInfo",
           [&](grpc::ClientContext* c) {
             v1::ServerInfo response;
             return stub->GetServerInfo(c, {}, &response);
           }},
          {"Abort",
           [&](grpc::ClientContext* c) {
             v1::AbortRequest r;
             r.add_request_ids("x");
             v1::AbortResponse response;
             return stub->Abort(c, r, &response);
           }},
          {"FlushCache",
           [&](grpc::ClientContext* c) {
             v1::FlushCacheResponse response;
             return stub->FlushCache(c, {}, &response);
           }},
          {"UpdateWeights",
           [&](grpc::ClientContext* c) {
             v1::UpdateWeightsResponse response;
             auto writer = stub->UpdateWeights(c, &response);
             writer->WritesDone();
             return writer->Finish();
           }},
          {"UpdateWeightsFromPath",
           [&](grpc::ClientContext* c) {
             v1::UpdateWeightsFromPathRequest r;
             r.set_path(server->server->model_dir());
             r.set_version("unauthorized");
             v1::UpdateWeightsResponse response;
             return stub->UpdateWeightsFromPath(c, r, &response);
           }},
          {"UpdateWeightsFromIpc",
           [&](grpc::ClientContext* c) {
             v1::UpdateWeightsFromIpcRequest r;
             r.set_version("unauthorized");
             v1::UpdateWeightsResponse response;
             return stub->UpdateWeightsFromIpc(c, r, &response);
           }},
          {"Pause",
           [&](grpc::ClientContext* c) {
             v1::PauseResponse response;
             return stub->Pause(c, {}, &response);
           }},
          {"Resume",
           [&](grpc::ClientContext* c) {
             v1::ResumeResponse response;
             return stub->Resume(c, {}, &response);
           }},
          {"ReleaseMemory",
           [&](grpc::ClientContext* c) {
             v1::ReleaseMemoryResponse response;
             return stub->ReleaseMemory(c, {}, &response);
           }},
          {"ResumeMemory",
           [&](grpc::ClientContext* c) {
             v1::ResumeMemoryResponse response;
             return stub->ResumeMemory(c, {}, &response);
           }},
          {"JoinWeightSyncGroup",
           [&](grpc::ClientContext* c) {
             v1::JoinWeightSyncGroupRequest r;
             r.set_unique_id(std::string(128, 'u'));
             r.set_rank(1);
             r.set_world_size(2);
             v1::JoinWeightSyncGroupResponse response;
             return stub->JoinWeightSyncGroup(c, r, &response);
           }},
          {"LeaveWeightSyncGroup",
           [&](grpc::ClientContext* c) {
             v1::LeaveWeightSyncGroupResponse response;
             return stub->LeaveWeightSyncGroup(c, {}, &response);
           }},
          {"UpdateWeightsFromBroadcast",
           [&](grpc::ClientContext* c) {
             v1::UpdateWeightsFromBroadcastRequest r;
             r.set_version("unauthorized");
             v1::UpdateWeightsResponse response;
             return stub->UpdateWeightsFromBroadcast(c, r, &response);
           }},
      };
  const std::vector<std::string> bad_values = {"",  // no header at all
                                               "Bearer wrong",
                                               "Bearer s3cre",
                                               "Bearer s3cret ",
                                               "Bearer s3cretx",
                                               "bearer s3cret",
                                               "s3cret",
                                               "Basic s3cret",
                                               "Bearer  s3cret",
                                               "Bearer"};
  for (const auto& [name, call] : rpcs) {
    for (const std::string& value : bad_values) {
      grpc::ClientContext context;
      context.set_deadline(std::chrono::system_clock::now() + seconds(30));
      if (!value.empty()) context.AddMetadata("authorization", value);
      const grpc::Status status = call(&context);
      EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAUTHENTICATED)
          << name << " with '" << value << "': " << status.error_message();
      EXPECT_NE(status.error_message().find(value.empty() ? "authorization" : "token"),
                std::string::npos)
          << name << ": " << status.error_message();
    }
  }
  EXPECT_TRUE(rel::IsServing(server->channel)) << "health needs no token";
  // Nothing changed, and the right token opens every RPC.
  grpc::ClientContext context;
  context.AddMetadata("authorization", "Bearer s3cret");
  v1::ServerInfo info;
  ASSERT_TRUE(stub->GetServerInfo(&context, {}, &info).ok());
  EXPECT_FALSE(info.paused());
  EXPECT_FALSE(info.has_memory_released());
  EXPECT_EQ(info.weight_version(), "0");
  for (const auto& [name, call] : rpcs) {
    if (name == "UpdateWeights" || name == "UpdateWeightsFromPath" || name == "Pause" ||
        name == "ReleaseMemory") {
      continue;
    }
    grpc::ClientContext c;
    c.set_deadline(std::chrono::system_clock::now() + seconds(60));
    c.AddMetadata("authorization", "Bearer s3cret");
    const grpc::Status status = call(&c);
    // Past the token: an empty request is refused, and the cpu backend joins no group.
    if (name == "UpdateWeightsFromIpc" || name == "UpdateWeightsFromBroadcast") {
      EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
      continue;
    }
    if (name == "JoinWeightSyncGroup") {
      EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION)
          << status.error_message();
      continue;
    }
    EXPECT_TRUE(status.ok()) << name << ": " << status.error_message();
  }
}

// ---------------------------------------------------------------------------------------------
// The queue limit.

TEST(ReliabilityQueueTest, BeyondMaxQueuedSamplesIsResourceExhaustedUntilTheQueueDrains) {
  ServerOptions options;
  options.max_queued_samples = 8;
  std::unique_ptr<TestServer> server = StartTestServer(options);
  ASSERT_NE(server, nullptr);
  v1::RolloutService::Stub* stub = server->stub.get();
  v1::GenerateRequest probe;
  *probe.add_rollouts() = MakeRollout(kPrompt, 11, 6, 0.9f);
  const GenerateOutcome baseline = RunGenerate(stub, probe);
  ASSERT_TRUE(baseline.status.ok());

  // One request larger than the whole queue is refused even on an idle server.
  v1::GenerateRequest nine;
  *nine.add_rollouts() = MakeRollout(kPrompt, 1, 4, 1.0f);
  nine.mutable_rollouts(0)->set_num_samples(9);
  GenerateOutcome refused = RunGenerate(stub, nine);
  EXPECT_EQ(refused.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(refused.status.error_message().find("limit of 8"), std::string::npos)
      << refused.status.error_message();
  EXPECT_TRUE(refused.responses.empty());

  // Two long calls of 5 and 3 samples fill the queue exactly.
  auto long_request = [](int n, uint64_t seed) {
    v1::GenerateRequest r;
    *r.add_rollouts() = MakeRollout(kPrompt, seed, 3000, 1.0f);
    r.mutable_rollouts(0)->set_num_samples(n);
    r.mutable_rollouts(0)->mutable_sampling()->set_ignore_eos(true);
    return r;
  };
  grpc::ClientContext c5, c3;
  c5.set_deadline(std::chrono::system_clock::now() + seconds(120));
  c3.set_deadline(std::chrono::system_clock::now() + seconds(120));
  auto r5 = stub->Generate(&c5, long_request(5, 1));
  auto r3 = stub->Generate(&c3, long_request(3, 2));
  v1::GenerateResponse response;
  ASSERT_TRUE(r5->Read(&response));
  ASSERT_TRUE(r3->Read(&response));

  for (int n : {1, 8}) {
    v1::GenerateRequest more;
    *more.add_rollouts() = MakeRollout(kPrompt, 3, 4, 1.0f);
    more.mutable_rollouts(0)->set_num_samples(n);
    GenerateOutcome out = RunGenerate(stub, more);
    EXPECT_EQ(out.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << n;
    EXPECT_NE(out.status.error_message().find("holds 8 unfinished samples"), std::string::npos)
        << out.status.error_message();
    EXPECT_NE(out.status.error_message().find("retry later"), std::string::npos);
    EXPECT_TRUE(out.responses.empty());
  }
  EXPECT_TRUE(rel::IsServing(server->channel));

  c5.TryCancel();
  c3.TryCancel();
  while (r5->Read(&response)) {
  }
  while (r3->Read(&response)) {
  }
  EXPECT_EQ(r5->Finish().error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_EQ(r3->Finish().error_code(), grpc::StatusCode::CANCELLED);
  std::string last;
  ASSERT_TRUE(rel::WaitForQuiescence(stub, seconds(30), &last)) << last;

  // Drained: the probe answers as before, and a request of exactly the limit is admitted.
  GenerateOutcome again = RunGenerate(stub, probe);
  ASSERT_TRUE(again.status.ok()) << again.status.error_message();
  EXPECT_EQ(GenerateFingerprint(again), GenerateFingerprint(baseline));
  v1::GenerateRequest eight;
  *eight.add_rollouts() = MakeRollout(kPrompt, 1, 4, 1.0f);
  eight.mutable_rollouts(0)->set_num_samples(8);
  EXPECT_TRUE(RunGenerate(stub, eight).status.ok());
}

// ---------------------------------------------------------------------------------------------
// Client faults.

class ReliabilityFaultTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { server_ = StartTestServer().release(); }
  static void TearDownTestSuite() {
    delete server_;
    server_ = nullptr;
  }
  void SetUp() override { ASSERT_NE(server_, nullptr); }
  static v1::RolloutService::Stub* stub() { return server_->stub.get(); }
  static TestServer* server_;
};
TestServer* ReliabilityFaultTest::server_ = nullptr;

v1::GenerateRequest LongRequest(uint64_t seed, int num_samples, const std::string& id = "") {
  v1::GenerateRequest r;
  *r.add_rollouts() = MakeRollout(kPrompt, seed, 3000, 1.0f, id);
  r.mutable_rollouts(0)->set_num_samples(num_samples);
  r.mutable_rollouts(0)->mutable_sampling()->set_ignore_eos(true);
  return r;
}

TEST_F(ReliabilityFaultTest, MissedDeadlineOnALongGenerationAbortsItAndFreesItsKv) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + milliseconds(400));
  const auto start = Clock::now();
  auto reader = stub()->Generate(&context, LongRequest(1, 4));
  v1::GenerateResponse response;
  int responses = 0;
  while (reader->Read(&response)) ++responses;
  const grpc::Status status = reader->Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << status.error_message();
  EXPECT_LT(Clock::now() - start, seconds(10));
  EXPECT_GT(responses, 0) << "it was running when the deadline hit";
  std::string last;
  EXPECT_TRUE(rel::WaitForQuiescence(stub(), seconds(30), &last)) << last;
}

TEST_F(ReliabilityFaultTest, CancelledAbandonedExpiredAndAbortedStreamsAllReturnTheirKv) {
  v1::GenerateRequest probe = GoodGenerateRequest();
  const std::string baseline = GenerateFingerprint(RunGenerate(stub(), probe));
  constexpr int kClients = 12;
  std::vector<std::string> errors(kClients);
  std::vector<std::thread> threads;
  std::atomic<int> started{0};
  for (int i = 0; i < kClients; ++i) {
    threads.emplace_back([&, i] {
      const std::string id = absl::StrCat("fault-", i);
      // Each client on its own channel, so an abandoned one closes a real connection.
      std::shared_ptr<grpc::Channel> channel =
          grpc::CreateChannel(server_->address(), grpc::InsecureChannelCredentials());
      auto own_stub = v1::RolloutService::NewStub(channel);
      auto context = std::make_unique<grpc::ClientContext>();
      const int kind = i % 4;
      // The deadline must hit mid-generation on a fast backend too (3000 tokens of the demo
      // model take about 0.6 s on an H200), so it is short; on a slow one it may hit before
      // the first token, which is an expiry as well.
      context->set_deadline(std::chrono::system_clock::now() +
                            (kind == 2 ? milliseconds(200 + 5 * i) : milliseconds(120000)));
      auto reader = own_stub->Generate(context.get(), LongRequest(100 + i, 1 + i % 3, id));
      v1::GenerateResponse response;
      if (!reader->Read(&response)) {
        const grpc::Status s = reader->Finish();
        if (kind == 2 && s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
          ++started;
          return;
        }
        errors[i] = "no first response: " + s.error_message();
        return;
      }
      ++started;
      std::this_thread::sleep_for(milliseconds(20 * (i % 5)));
      switch (kind) {
        case 0: {  // cancel
          context->TryCancel();
          while (reader->Read(&response)) {
          }
          const grpc::Status s = reader->Finish();
          if (s.error_code() != grpc::StatusCode::CANCELLED) {
            errors[i] = absl::StrCat("cancel: got ", s.error_code(), " ", s.error_message());
          }
          break;
        }
        case 1:  // disconnect: drop the call, its context and the channel without Finish
          reader.reset();
          context.reset();
          own_stub.reset();
          channel.reset();
          break;
        case 2: {  // deadline
          while (reader->Read(&response)) {
          }
          const grpc::Status s = reader->Finish();
          if (s.error_code() != grpc::StatusCode::DEADLINE_EXCEEDED) {
            errors[i] = absl::StrCat("deadline: got ", s.error_code(), " ", s.error_message());
          }
          break;
        }
        case 3: {  // Abort by id from another client: the stream ends OK with ABORT
          grpc::ClientContext abort_context;
          v1::AbortRequest abort;
          abort.add_request_ids(id);
          v1::AbortResponse aborted;
          grpc::Status s = stub()->Abort(&abort_context, abort, &aborted);
          int completions = 0, aborts = 0;
          while (reader->Read(&response)) {
            if (response.has_completion()) {
              ++completions;
              aborts += response.completion().finish_reason() == v1::FINISH_REASON_ABORT;
            }
          }
          const grpc::Status f = reader->Finish();
          if (!s.ok() || aborted.aborted_rollouts() != 1 || !f.ok() || completions != 1 + i % 3 ||
              aborts != completions) {
            errors[i] = absl::StrCat("abort: ", s.error_message(), " aborted ",
                                     aborted.aborted_rollouts(), ", finish ", f.error_code(),
                                     ", completions ", completions, ", aborts ", aborts);
          }
          break;
        }
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (int i = 0; i < kClients; ++i) EXPECT_EQ(errors[i], "") << "client " << i;
  EXPECT_EQ(started.load(), kClients);
  std::string last;
  EXPECT_TRUE(rel::WaitForQuiescence(stub(), seconds(30), &last)) << last;
  EXPECT_TRUE(rel::IsServing(server_->channel));
  // Nothing leaked into the results, and every request id is free again.
  EXPECT_EQ(GenerateFingerprint(RunGenerate(stub(), probe)), baseline);
  v1::GenerateRequest reuse;
  for (int i = 0; i < kClients; ++i) {
    *reuse.add_rollouts() = MakeRollout(kPrompt, i, 2, 1.0f, absl::StrCat("fault-", i));
  }
  const GenerateOutcome reused = RunGenerate(stub(), reuse);
  EXPECT_TRUE(reused.status.ok()) << reused.status.error_message();
}

TEST_F(ReliabilityFaultTest, WeightUpdatesCutOffHalfwayLeaveTheOldWeightsBitwise) {
  const HostTensor original = rel::ReadCheckpointTensor(server_->server->model_dir(), kTensor);
  const std::vector<HostTensor> changed = {rel::ScaledBf16(original, 2.0f)};
  const std::vector<v1::WeightsChunk> data = rel::MakeDataChunks(changed, 4096);
  GoodTraffic traffic(server_->address());
  traffic.Start();
  // The server may see a cancelled call start after the client already gave up on it, so
  // the slot must be seen free several times in a row (within 10 s).
  auto slot_free = [&] {
    const auto deadline = Clock::now() + seconds(10);
    int free_in_a_row = 0;
    while (free_in_a_row < 10 && Clock::now() < deadline) {
      free_in_a_row =
          rel::FetchServerInfo(stub()).weight_update_in_progress() ? 0 : free_in_a_row + 1;
      std::this_thread::sleep_for(milliseconds(20));
    }
    return free_in_a_row >= 10;
  };
  for (const std::string how : {"cancel", "deadline", "disconnect", "cancel-before-last-chunk"}) {
    auto channel = grpc::CreateChannel(server_->address(), grpc::InsecureChannelCredentials());
    auto own_stub = v1::RolloutService::NewStub(channel);
    auto context = std::make_unique<grpc::ClientContext>();
    context->set_deadline(std::chrono::system_clock::now() +
                          (how == "deadline" ? milliseconds(500) : seconds(60)));
    v1::UpdateWeightsResponse response;
    auto writer = own_stub->UpdateWeights(context.get(), &response);
    v1::WeightsChunk first;
    *first.mutable_header() = rel::MakeWeightsHeader(how, v1::IN_FLIGHT_POLICY_CONTINUE, changed);
    ASSERT_TRUE(writer->Write(first)) << how;
    // Half the bytes, or all but the last chunk.
    const size_t n = how == "cancel-before-last-chunk" ? data.size() - 1 : data.size() / 2;
    for (size_t i = 0; i < n; ++i) {
      if (!writer->Write(data[i])) break;
    }
    if (how.rfind("cancel", 0) == 0) {
      context->TryCancel();
      EXPECT_EQ(writer->Finish().error_code(), grpc::StatusCode::CANCELLED) << how;
    } else if (how == "deadline") {
      std::this_thread::sleep_for(milliseconds(800));
      writer->WritesDone();
      EXPECT_EQ(writer->Finish().error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << how;
    } else {
      writer.reset();
      context.reset();
      own_stub.reset();
      channel.reset();
    }
    EXPECT_TRUE(slot_free()) << how << ": the update slot stayed taken; "
                             << rel::FetchServerInfo(stub()).ShortDebugString();
    EXPECT_EQ(rel::FetchServerInfo(stub()).weight_version(), "0") << how;
  }
  // UpdateWeightsFromPath whose client gives up at once (the same checkpoint under the same
  // version, so whether or not the server still applies it, what is served stays identical):
  // the slot must come free and serving go on.
  for (int i = 0; i < 3; ++i) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + milliseconds(1 + 20 * i));
    v1::UpdateWeightsFromPathRequest request;
    request.set_path(server_->server->model_dir());
    request.set_version("0");
    v1::UpdateWeightsResponse response;
    const grpc::Status status = stub()->UpdateWeightsFromPath(&context, request, &response);
    EXPECT_TRUE(status.ok() || status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED)
        << status.error_code() << " " << status.error_message();
    EXPECT_TRUE(slot_free()) << "from path, deadline " << 1 + 20 * i << " ms";
  }
  EXPECT_GE(traffic.Stop(4), 4);
  for (const std::string& f : traffic.failures()) ADD_FAILURE() << "good traffic: " << f;

  // The slot works: a complete update applies, and the original bytes restore bitwise.
  const std::string before = GenerateFingerprint(RunGenerate(stub(), GoodGenerateRequest()));
  for (const auto& [tensors, version] :
       {std::pair<std::vector<HostTensor>, std::string>{changed, "changed"}, {{original}, "0"}}) {
    std::vector<v1::WeightsChunk> chunks = rel::MakeDataChunks(tensors, 1 << 20);
    v1::WeightsChunk first;
    *first.mutable_header() = rel::MakeWeightsHeader(version, v1::IN_FLIGHT_POLICY_DRAIN, tensors);
    chunks.insert(chunks.begin(), first);
    v1::UpdateWeightsResponse response;
    grpc::Status status = rel::PushChunks(stub(), chunks, &response);
    ASSERT_TRUE(status.ok()) << status.error_message();
    const std::string now = GenerateFingerprint(RunGenerate(stub(), GoodGenerateRequest()));
    if (version == "changed") {
      EXPECT_NE(now, before);
    } else {
      EXPECT_EQ(now, before);
    }
  }
  std::string last;
  EXPECT_TRUE(rel::WaitForQuiescence(stub(), seconds(30), &last)) << last;
}

// A client sends the header and every byte, then cancels instead of half-closing. Only the
// half-close completes an update, so nothing may be applied, ever. Not racy on the client's
// side: before a half-close the server can answer nothing but CANCELLED. The cancel comes at
// once (often while the server still reads) or after a pause (the server has read every byte
// and waits for the end of the stream: the case a reactor that took any failed read for the
// half-close got wrong, whenever gRPC ran OnReadDone(false) before OnCancel).
TEST_F(ReliabilityFaultTest, ACancelAfterEveryByteButBeforeTheHalfCloseNeverApplies) {
  const HostTensor original = rel::ReadCheckpointTensor(server_->server->model_dir(), kTensor);
  const std::vector<HostTensor> changed = {rel::ScaledBf16(original, 2.0f)};
  const std::vector<v1::WeightsChunk> data = rel::MakeDataChunks(changed, 4096);
  for (int attempt = 0; attempt < 20; ++attempt) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + seconds(60));
    v1::UpdateWeightsResponse response;
    auto writer = stub()->UpdateWeights(&context, &response);
    v1::WeightsChunk first;
    *first.mutable_header() = rel::MakeWeightsHeader(absl::StrCat("cancelled-", attempt),
                                                     v1::IN_FLIGHT_POLICY_CONTINUE, changed);
    ASSERT_TRUE(writer->Write(first));
    for (const v1::WeightsChunk& chunk : data) ASSERT_TRUE(writer->Write(chunk));
    std::this_thread::sleep_for(milliseconds(attempt % 2 == 0 ? 0 : 100));
    context.TryCancel();
    EXPECT_EQ(writer->Finish().error_code(), grpc::StatusCode::CANCELLED) << "attempt " << attempt;
    std::this_thread::sleep_for(milliseconds(200));
    const std::string version = rel::FetchServerInfo(stub()).weight_version();
    ASSERT_EQ(version, "0") << "attempt " << attempt << ": a cancelled update was applied";
  }
}

// A DRAIN update waits for in-flight work; its client cancels meanwhile. Nothing is applied,
// not when the in-flight work ends either, and the update lets go of the slot (and of work
// held behind it) at once instead of when that work ends.
TEST_F(ReliabilityFaultTest, ACancelWhileADrainUpdateWaitsAppliesNothingAndFreesTheSlot) {
  const HostTensor original = rel::ReadCheckpointTensor(server_->server->model_dir(), kTensor);
  const std::vector<HostTensor> changed = {rel::ScaledBf16(original, 2.0f)};
  grpc::ClientContext generate_context;
  generate_context.set_deadline(std::chrono::system_clock::now() + seconds(120));
  auto reader = stub()->Generate(&generate_context, LongRequest(3, 1, "held-by-drain"));
  v1::GenerateResponse first;
  ASSERT_TRUE(reader->Read(&first)) << "the long generation did not start";
  auto drain_generation = std::async(std::launch::async, [&] {
    v1::GenerateResponse response;
    while (reader->Read(&response)) {
    }
    return reader->Finish();
  });

  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + seconds(60));
  v1::UpdateWeightsResponse response;
  auto writer = stub()->UpdateWeights(&context, &response);
  v1::WeightsChunk header;
  *header.mutable_header() =
      rel::MakeWeightsHeader("cancelled-drain", v1::IN_FLIGHT_POLICY_DRAIN, changed);
  ASSERT_TRUE(writer->Write(header));
  for (const v1::WeightsChunk& chunk : rel::MakeDataChunks(changed, 1 << 20)) {
    ASSERT_TRUE(writer->Write(chunk));
  }
  ASSERT_TRUE(writer->WritesDone());
  // Time for the server to take the half-close and queue the update behind the generation (were
  // it slower, the cancel would come before the half-close, which must not apply either).
  std::this_thread::sleep_for(milliseconds(300));
  context.TryCancel();
  EXPECT_EQ(writer->Finish().error_code(), grpc::StatusCode::CANCELLED);

  const auto deadline = Clock::now() + seconds(10);
  while (rel::FetchServerInfo(stub()).weight_update_in_progress() && Clock::now() < deadline) {
    std::this_thread::sleep_for(milliseconds(20));
  }
  EXPECT_FALSE(rel::FetchServerInfo(stub()).weight_update_in_progress())
      << "the cancelled update kept the slot while the generation it waited for ran on";
  EXPECT_EQ(drain_generation.wait_for(milliseconds(0)), std::future_status::timeout)
      << "the generation ended before the check; the test proves nothing about 'at once'";

  grpc::ClientContext abort_context;
  v1::AbortRequest abort;
  abort.set_all(true);
  v1::AbortResponse aborted;
  ASSERT_TRUE(stub()->Abort(&abort_context, abort, &aborted).ok());
  EXPECT_TRUE(drain_generation.get().ok());
  std::string last;
  EXPECT_TRUE(rel::WaitForQuiescence(stub(), seconds(30), &last)) << last;
  EXPECT_EQ(rel::FetchServerInfo(stub()).weight_version(), "0") << "the cancelled update applied";
}

int CountDirEntries(const char* dir) {
  std::error_code ec;
  int n = 0;
  for (auto it = std::filesystem::directory_iterator(dir, ec);
       !ec && it != std::filesystem::directory_iterator(); it.increment(ec)) {
    ++n;
  }
  return n;
}

// Mappings that look like default-sized thread stacks (a finished thread that is never joined
// keeps its stack mapped; a joined one's stack is reused by the next thread).
int CountThreadStackMappings() {
  pthread_attr_t attr;
  size_t stack = 8 << 20;
  if (pthread_attr_init(&attr) == 0) {
    pthread_attr_getstacksize(&attr, &stack);
    pthread_attr_destroy(&attr);
  }
  std::ifstream maps("/proc/self/maps");
  std::string line;
  int n = 0;
  while (std::getline(maps, line)) {
    unsigned long begin = 0, end = 0;
    char perms[5] = {};
    if (std::sscanf(line.c_str(), "%lx-%lx %4s", &begin, &end, perms) != 3) continue;
    const size_t size = end - begin;
    if (std::string(perms) == "rw-p" && size <= stack && size + (64 << 10) >= stack) ++n;
  }
  return n;
}

// A trainer that pushes a checkpoint path every step must not cost the server a thread (and
// its stack) per update: the count stays flat over 16 updates. (Each call once started a
// std::thread that stayed joinable until the service was destroyed.)
TEST_F(ReliabilityFaultTest, UpdatesFromPathDoNotAccumulateThreads) {
  auto update = [&](const std::string& version) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + seconds(60));
    v1::UpdateWeightsFromPathRequest request;
    request.set_path(server_->server->model_dir());
    request.set_version(version);
    v1::UpdateWeightsResponse response;
    return stub()->UpdateWeightsFromPath(&context, request, &response);
  };
  ASSERT_TRUE(update("warm-up").ok());
  std::this_thread::sleep_for(milliseconds(200));
  const int before = CountThreadStackMappings();
  for (int i = 0; i < 16; ++i) ASSERT_TRUE(update(absl::StrCat("v", i)).ok());
  std::this_thread::sleep_for(milliseconds(200));
  const int after = CountThreadStackMappings();
  EXPECT_LE(after - before, 3) << before << " thread stacks mapped before 16 updates, " << after
                               << " after";
  ASSERT_TRUE(update("0").ok());
}

// ---------------------------------------------------------------------------------------------
// SIGTERM under load, on the real binary.

#ifdef ROLLOUT_SERVER_BIN
TEST(ReliabilityShutdownTest, SigtermUnderLoadEndsEveryRolloutAndExitsZero) {
  const std::string cache = ::testing::TempDir() + "rollout-test-cache";
  std::unique_ptr<rel::ChildProcess> child =
      // KV for every sample at once (12 long ones of ~3000 tokens at 2 KiB a token): under the
      // default admission a sample the pool cannot finish waits, and so would the probe below,
      // queued behind it (strict FCFS) until the grace period ends.
      rel::ChildProcess::Start(
          {rel::BinaryPath("ROLLOUT_SERVER_BIN", ROLLOUT_SERVER_BIN), "--port=0",
           "--address=127.0.0.1", "--metrics_port=0", "--shutdown_grace_s=1", "--kv_cache_mb=128"},
          {"ROLLOUT_CACHE_DIR=" + cache});
  ASSERT_NE(child, nullptr);
  const std::string needle = "rollout server listening on port ";
  const std::string line = child->WaitForOutput(needle, seconds(120));
  ASSERT_FALSE(line.empty()) << "the server did not start:\n" << child->output();
  const int port = std::atoi(line.c_str() + needle.size());
  ASSERT_GT(port, 0) << line;
  const std::string address = absl::StrCat("127.0.0.1:", port);
  auto channel = grpc::CreateChannel(address, grpc::InsecureChannelCredentials());
  ASSERT_TRUE(channel->WaitForConnected(std::chrono::system_clock::now() + seconds(30)));
  ASSERT_TRUE(rel::IsServing(channel));

  // Each client streams two rollouts: one short (finishes within the grace period), one long
  // (cut by the grace period and aborted), n = 2 each.
  constexpr int kClients = 6;
  struct Result {
    grpc::Status status;
    std::map<std::pair<int, int>, std::vector<uint32_t>> streamed;
    std::map<std::pair<int, int>, std::vector<v1::Completion>> completions;
  };
  std::vector<Result> results(kClients);
  std::atomic<int> running{0};
  std::vector<std::thread> clients;
  for (int i = 0; i < kClients; ++i) {
    clients.emplace_back([&, i] {
      auto stub = v1::RolloutService::NewStub(channel);
      v1::GenerateRequest request;
      *request.add_rollouts() = MakeRollout(kPrompt, i, 12 + i, 0.9f);
      *request.add_rollouts() = MakeRollout(kPrompt, 50 + i, 3000, 1.0f);
      for (int r = 0; r < 2; ++r) {
        request.mutable_rollouts(r)->set_num_samples(2);
        request.mutable_rollouts(r)->mutable_sampling()->set_ignore_eos(true);
      }
      grpc::ClientContext context;
      context.set_deadline(std::chrono::system_clock::now() + seconds(60));
      auto reader = stub->Generate(&context, request);
      v1::GenerateResponse response;
      bool first = true;
      while (reader->Read(&response)) {
        if (first) ++running;
        first = false;
        if (response.has_chunk()) {
          const v1::TokenChunk& c = response.chunk();
          auto& tokens = results[i].streamed[{c.rollout_index(), c.sample_index()}];
          tokens.insert(tokens.end(), c.token_ids().begin(), c.token_ids().end());
        } else {
          const v1::Completion& c = response.completion();
          results[i].completions[{c.rollout_index(), c.sample_index()}].push_back(c);
        }
      }
      if (first) ++running;
      results[i].status = reader->Finish();
    });
  }
  const auto wait_deadline = Clock::now() + seconds(60);
  while (running < kClients && Clock::now() < wait_deadline) {
    std::this_thread::sleep_for(milliseconds(10));
  }
  ASSERT_EQ(running.load(), kClients);
  ASSERT_TRUE(child->Signal(SIGTERM));

  // During the drain new work is refused with UNAVAILABLE (also once the port is closed).
  auto stub = v1::RolloutService::NewStub(channel);
  grpc::Status refused;
  bool saw_draining_message = false;
  const auto refuse_deadline = Clock::now() + seconds(10);
  while (Clock::now() < refuse_deadline) {
    v1::GenerateRequest request;
    *request.add_rollouts() = MakeRollout(kPrompt, 1, 2, 1.0f);
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + seconds(5));
    auto reader = stub->Generate(&context, request);
    v1::GenerateResponse response;
    while (reader->Read(&response)) {
    }
    refused = reader->Finish();
    if (!refused.ok()) {
      EXPECT_EQ(refused.error_code(), grpc::StatusCode::UNAVAILABLE) << refused.error_message();
      saw_draining_message = refused.error_message().find("shutting down") != std::string::npos;
      if (saw_draining_message) {
        EXPECT_FALSE(rel::IsServing(channel)) << "draining is NOT_SERVING";
        EXPECT_FALSE(rel::IsServing(channel, "rollout.v1.RolloutService"));
        v1::ScoreResponse score;
        grpc::ClientContext score_context;
        EXPECT_EQ(stub->Score(&score_context, GoodScoreRequest(), &score).error_code(),
                  grpc::StatusCode::UNAVAILABLE);
      }
      break;
    }
    std::this_thread::sleep_for(milliseconds(10));
  }
  EXPECT_FALSE(refused.ok()) << "new calls were still admitted 10 s after SIGTERM";
  EXPECT_TRUE(saw_draining_message)
      << "refused, but not by the draining server: " << refused.error_message();

  for (std::thread& t : clients) t.join();
  int aborted = 0, finished = 0;
  for (int i = 0; i < kClients; ++i) {
    const Result& r = results[i];
    if (!r.status.ok()) {
      // A clean error is allowed; a silent loss (OK without every completion) is not.
      EXPECT_TRUE(r.status.error_code() == grpc::StatusCode::UNAVAILABLE ||
                  r.status.error_code() == grpc::StatusCode::CANCELLED)
          << "client " << i << ": " << r.status.error_code() << " " << r.status.error_message();
      continue;
    }
    for (int rollout = 0; rollout < 2; ++rollout) {
      for (int sample = 0; sample < 2; ++sample) {
        const auto it = r.completions.find({rollout, sample});
        ASSERT_TRUE(it != r.completions.end())
            << "client " << i << " rollout " << rollout << " sample " << sample
            << ": the call ended OK without its completion";
        ASSERT_EQ(it->second.size(), 1u);
        const v1::Completion& c = it->second[0];
        const auto streamed = r.streamed.find({rollout, sample});
        EXPECT_EQ(std::vector<uint32_t>(c.token_ids().begin(), c.token_ids().end()),
                  streamed == r.streamed.end() ? std::vector<uint32_t>() : streamed->second);
        if (c.finish_reason() == v1::FINISH_REASON_ABORT) {
          ++aborted;
        } else {
          EXPECT_TRUE(c.finish_reason() == v1::FINISH_REASON_LENGTH ||
                      c.finish_reason() == v1::FINISH_REASON_STOP);
          ++finished;
        }
        if (rollout == 0) {
          EXPECT_NE(c.finish_reason(), v1::FINISH_REASON_ABORT)
              << "client " << i << ": a short rollout did not finish within the grace period";
        }
      }
    }
  }
  std::printf("[ shutdown ] %d samples finished, %d aborted at the end of the grace period\n",
              finished, aborted);
  const int status = child->Wait(seconds(30));
  ASSERT_NE(status, -1) << "rollout-server still running 30 s after SIGTERM:\n" << child->output();
  EXPECT_TRUE(WIFEXITED(status)) << "status " << status << "\n" << child->output();
  EXPECT_EQ(WEXITSTATUS(status), 0) << child->output();
}
#endif  // ROLLOUT_SERVER_BIN

// ---------------------------------------------------------------------------------------------
// Soak.

TEST(ReliabilitySoakTest, MixedTrafficWithCancellationsAndWeightUpdatesLosesNothing) {
  int total_requests = 2000;
  if (const char* env = std::getenv("ROLLOUT_SOAK_REQUESTS")) total_requests = std::atoi(env);
  constexpr int kThreads = 8;
  std::unique_ptr<TestServer> server = StartTestServer();
  ASSERT_NE(server, nullptr);
  v1::RolloutService::Stub* stub = server->stub.get();
  const HostTensor original = rel::ReadCheckpointTensor(server->server->model_dir(), kTensor);
  v1::GenerateRequest probe = GoodGenerateRequest();
  const std::string baseline = GenerateFingerprint(RunGenerate(stub, probe));

  const int fds_before = CountDirEntries("/proc/self/fd");
  const int threads_before = CountDirEntries("/proc/self/task");
  struct Tally {
    int ok = 0, cancelled_by_us = 0, cancelled_but_finished = 0, samples = 0, tokens = 0;
    std::vector<double> latency_ms;
    std::vector<std::string> errors;
    std::set<std::string> versions;
  };
  std::vector<Tally> tallies(kThreads);
  std::atomic<int> next{0};
  std::atomic<int> done{0};
  const auto start = Clock::now();
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 rng(1000 + t);
      Tally& tally = tallies[t];
      auto channel = grpc::CreateChannel(server->address(), grpc::InsecureChannelCredentials());
      auto own_stub = v1::RolloutService::NewStub(channel);
      for (int k = next++; k < total_requests; k = next++) {
        v1::GenerateRequest request;
        std::vector<uint32_t> prompt(4 + rng() % 44);
        for (uint32_t& x : prompt) x = 3 + rng() % 4000;
        const float temperature = (rng() % 4 == 0) ? 0.0f : 0.5f + (rng() % 100) / 100.0f;
        *request.add_rollouts() = MakeRollout(prompt, rng(), 4 + rng() % 21, temperature);
        const int n = 1 + rng() % 2;
        request.mutable_rollouts(0)->set_num_samples(n);
        if (rng() % 3 == 0) request.mutable_rollouts(0)->mutable_sampling()->set_top_k(20);
        // About one call in eight is cancelled, after 0-2 responses.
        const bool cancel = rng() % 8 == 0;
        const int cancel_after = rng() % 3;
        grpc::ClientContext context;
        context.set_deadline(std::chrono::system_clock::now() + seconds(120));
        const auto t0 = Clock::now();
        auto reader = own_stub->Generate(&context, request);
        v1::GenerateResponse response;
        std::map<int, std::vector<uint32_t>> streamed;
        std::map<int, std::vector<v1::Completion>> completions;
        int responses = 0;
        if (cancel && cancel_after == 0) context.TryCancel();
        while (reader->Read(&response)) {
          if (response.has_chunk()) {
            auto& s = streamed[response.chunk().sample_index()];
            s.insert(s.end(), response.chunk().token_ids().begin(),
                     response.chunk().token_ids().end());
          } else {
            completions[response.completion().sample_index()].push_back(response.completion());
          }
          if (cancel && ++responses == cancel_after) context.TryCancel();
        }
        const grpc::Status status = reader->Finish();
        const double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
        ++done;
        if (status.error_code() == grpc::StatusCode::CANCELLED && cancel) {
          ++tally.cancelled_by_us;
          continue;
        }
        if (!status.ok()) {
          tally.errors.push_back(
              absl::StrCat("request ", k, ": ", status.error_code(), " ", status.error_message()));
          continue;
        }
        if (cancel) ++tally.cancelled_but_finished;
        ++tally.ok;
        tally.latency_ms.push_back(ms);
        for (int j = 0; j < n; ++j) {
          const auto it = completions.find(j);
          if (it == completions.end() || it->second.size() != 1) {
            tally.errors.push_back(absl::StrCat("request ", k, " sample ", j, ": ",
                                                it == completions.end() ? 0 : it->second.size(),
                                                " completions"));
            continue;
          }
          const v1::Completion& c = it->second[0];
          ++tally.samples;
          tally.tokens += c.token_ids_size();
          if (std::vector<uint32_t>(c.token_ids().begin(), c.token_ids().end()) != streamed[j] ||
              c.logprobs_size() != c.token_ids_size() ||
              c.finish_reason() == v1::FINISH_REASON_ABORT ||
              c.finish_reason() == v1::FINISH_REASON_UNSPECIFIED) {
            tally.errors.push_back(absl::StrCat("request ", k, " sample ", j,
                                                ": inconsistent completion, reason ",
                                                c.finish_reason()));
          }
          // Version spans cover the tokens contiguously.
          uint32_t next_token = 0;
          for (const v1::VersionSpan& span : c.version_spans()) {
            tally.versions.insert(span.version());
            if (span.first_token() != next_token || span.last_token() < span.first_token()) {
              tally.errors.push_back(absl::StrCat("request ", k, ": bad version spans"));
            }
            next_token = span.last_token() + 1;
          }
          if (c.token_ids_size() > 0 && next_token != static_cast<uint32_t>(c.token_ids_size())) {
            tally.errors.push_back(absl::StrCat("request ", k, ": spans do not cover tokens"));
          }
        }
      }
    });
  }
  // Weight updates in the middle: a scaled tensor with DRAIN at a third, then the original
  // bytes back with CONTINUE at two thirds (so the probe must match its baseline at the end).
  std::vector<std::string> update_errors;
  for (const auto& [at, version, policy, scale] :
       {std::tuple<int, std::string, v1::InFlightPolicy, float>{total_requests / 3, "soak-drain",
                                                                v1::IN_FLIGHT_POLICY_DRAIN, 1.5f},
        {2 * total_requests / 3, "soak-continue", v1::IN_FLIGHT_POLICY_CONTINUE, 1.0f}}) {
    const auto deadline = Clock::now() + seconds(300);
    while (done < at && Clock::now() < deadline) std::this_thread::sleep_for(milliseconds(5));
    const std::vector<HostTensor> tensors = {rel::ScaledBf16(original, scale)};
    std::vector<v1::WeightsChunk> chunks = rel::MakeDataChunks(tensors, 256 << 10);
    v1::WeightsChunk first;
    *first.mutable_header() = rel::MakeWeightsHeader(version, policy, tensors);
    chunks.insert(chunks.begin(), first);
    v1::UpdateWeightsResponse response;
    grpc::Status status = rel::PushChunks(stub, chunks, &response);
    if (!status.ok()) update_errors.push_back(version + ": " + status.error_message());
  }
  for (std::thread& t : threads) t.join();
  const double seconds_taken = std::chrono::duration<double>(Clock::now() - start).count();

  Tally all;
  for (const Tally& t : tallies) {
    all.ok += t.ok;
    all.cancelled_by_us += t.cancelled_by_us;
    all.cancelled_but_finished += t.cancelled_but_finished;
    all.samples += t.samples;
    all.tokens += t.tokens;
    all.latency_ms.insert(all.latency_ms.end(), t.latency_ms.begin(), t.latency_ms.end());
    all.errors.insert(all.errors.end(), t.errors.begin(), t.errors.end());
    all.versions.insert(t.versions.begin(), t.versions.end());
  }
  for (const std::string& e : update_errors) ADD_FAILURE() << "weight update " << e;
  for (size_t i = 0; i < std::min<size_t>(all.errors.size(), 20); ++i) {
    ADD_FAILURE() << all.errors[i];
  }
  EXPECT_TRUE(all.errors.empty()) << all.errors.size() << " errors";
  EXPECT_EQ(all.ok + all.cancelled_by_us, total_requests) << "every call accounted for";
  EXPECT_GT(all.cancelled_by_us, 0);
  EXPECT_TRUE(all.versions.count("soak-drain") && all.versions.count("soak-continue"))
      << "both updates served tokens";

  const double rps = total_requests / seconds_taken;
  const double p50 = rel::Quantile(all.latency_ms, 0.5), p99 = rel::Quantile(all.latency_ms, 0.99);
  std::printf(
      "[ soak ] %d requests (%d ok, %d cancelled, %d cancel too late) from %d threads in %.1f s: "
      "%.1f req/s, %.0f tokens/s, latency p50 %.1f ms, p99 %.1f ms\n",
      total_requests, all.ok, all.cancelled_by_us, all.cancelled_but_finished, kThreads,
      seconds_taken, rps, all.tokens / seconds_taken, p50, p99);
  ::testing::Test::RecordProperty("soak_requests", total_requests);
  ::testing::Test::RecordProperty("soak_requests_per_second", absl::StrFormat("%.1f", rps));
  ::testing::Test::RecordProperty("soak_tokens_per_second",
                                  absl::StrFormat("%.0f", all.tokens / seconds_taken));
  ::testing::Test::RecordProperty("soak_latency_p50_ms", absl::StrFormat("%.1f", p50));
  ::testing::Test::RecordProperty("soak_latency_p99_ms", absl::StrFormat("%.1f", p99));
  ::testing::Test::RecordProperty("soak_cancelled", all.cancelled_by_us);

  std::string last;
  EXPECT_TRUE(rel::WaitForQuiescence(stub, seconds(30), &last)) << "KV leaked: " << last;
  EXPECT_EQ(server->server->engine()->unfinished_samples(), 0);
  // Per-call leaks of descriptors or threads would show as hundreds after 2000 calls; allow
  // for gRPC's pools settling.
  std::this_thread::sleep_for(milliseconds(500));
  const int fds_after = CountDirEntries("/proc/self/fd");
  const int threads_after = CountDirEntries("/proc/self/task");
  std::printf("[ soak ] open fds %d -> %d, threads %d -> %d\n", fds_before, fds_after,
              threads_before, threads_after);
  EXPECT_LE(fds_after - fds_before, 16) << "file descriptors leaked";
  EXPECT_LE(threads_after - threads_before, 32) << "threads leaked";
  EXPECT_TRUE(rel::IsServing(server->channel));
  EXPECT_EQ(rel::FetchServerInfo(stub).weight_version(), "soak-continue");
  EXPECT_EQ(GenerateFingerprint(RunGenerate(stub, probe)), baseline)
      << "the original bytes are back, so the results must be too";
}

// ---------------------------------------------------------------------------------------------
// Prometheus metrics.

// Runs in CUDA-enabled builds too (issue #7): no server or test binary links a CUDA library any
// more -- --backend cuda dlopen()s the backend's module (runner/cuda/cuda_backend.h), whose TLS is
// dynamic -- so libcublasLt's ~94 KB of TLS no longer comes out of the stacks of civetweb's
// small worker threads. (A server whose endpoint cannot start fails to start.)
TEST(ReliabilityMetricsTest, MetricsEndpointServesCountersHistogramsAndTheWeightVersion) {
  ServerOptions options;
  options.metrics_port = rel::PickFreePort();
  ASSERT_GT(options.metrics_port, 0);
  std::unique_ptr<TestServer> server = StartTestServer(options);
  ASSERT_NE(server, nullptr);
  v1::RolloutService::Stub* stub = server->stub.get();
  ASSERT_TRUE(RunGenerate(stub, GoodGenerateRequest()).status.ok());
  v1::GenerateRequest bad;
  bad.add_rollouts();
  EXPECT_EQ(RunGenerate(stub, bad).status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  // A weight update (the served checkpoint again, under a new version label).
  {
    grpc::ClientContext context;
    v1::UpdateWeightsFromPathRequest request;
    request.set_path(server->server->model_dir());
    request.set_version("metrics-v1");
    v1::UpdateWeightsResponse response;
    ASSERT_TRUE(stub->UpdateWeightsFromPath(&context, request, &response).ok());
  }
  const std::string page = rel::HttpGet(options.metrics_port, "/metrics");
  ASSERT_FALSE(page.empty()) << "no answer on port " << options.metrics_port;
  EXPECT_EQ(page.rfind("HTTP/1.1 200", 0), 0u) << page.substr(0, 200);
  EXPECT_NE(page.find("text/plain"), std::string::npos);
  for (const std::string& needle : {
           std::string("# TYPE rollout_rpcs_total counter"),
           std::string(
               "rollout_rpcs_total{method=\"/rollout.v1.RolloutService/Generate\",code=\"OK\"} 1"),
           std::string("rollout_rpcs_total{method=\"/rollout.v1.RolloutService/Generate\","
                       "code=\"INVALID_ARGUMENT\"} 1"),
           std::string("# TYPE rollout_samples_total counter"),
           std::string("rollout_samples_total{finish_reason=\"length\"}"),
           std::string("# TYPE rollout_prefill_step_seconds histogram"),
           std::string("rollout_prefill_step_seconds_bucket{le=\"+Inf\"}"),
           std::string("rollout_decode_step_seconds_bucket{le=\"0.001\"}"),
           std::string("rollout_decode_step_seconds_count"),
           std::string("rollout_kv_blocks_capacity"),
           std::string("rollout_weight_updates_total{outcome=\"ok\"} 1"),
           std::string("rollout_weight_version_info{version=\"metrics-v1\"} 1"),
       }) {
    EXPECT_NE(page.find(needle), std::string::npos) << "missing: " << needle << "\n" << page;
  }
  // The sample counts add up: 3 samples of GoodGenerateRequest, none aborted.
  uint64_t samples = 0;
  for (const char* reason : {"stop", "length", "abort"}) {
    const std::string key = absl::StrCat("rollout_samples_total{finish_reason=\"", reason, "\"} ");
    const size_t at = page.find(key);
    ASSERT_NE(at, std::string::npos) << key;
    samples += std::strtoull(page.c_str() + at + key.size(), nullptr, 10);
  }
  EXPECT_EQ(samples, 3u);
  EXPECT_EQ(rel::HttpGet(options.metrics_port, "/nothing-here").rfind("HTTP/1.1 404", 0), 0u);
}

// A client health watch ends when its channel closes (every trainer restart): gRPC's health
// service then sends UNKNOWN, which the metrics counted as a server error (review23 finding 5).
TEST(ReliabilityMetricsTest, AHealthWatchTheClientCancelsCountsAsCancelledNotAsAnError) {
  ServerOptions options;
  options.metrics_port = rel::PickFreePort();
  ASSERT_GT(options.metrics_port, 0);
  std::unique_ptr<TestServer> server = StartTestServer(options);
  ASSERT_NE(server, nullptr);
  auto health = grpc::health::v1::Health::NewStub(server->channel);
  for (int i = 0; i < 2; ++i) {
    grpc::ClientContext context;
    auto reader = health->Watch(&context, grpc::health::v1::HealthCheckRequest());
    grpc::health::v1::HealthCheckResponse response;
    ASSERT_TRUE(reader->Read(&response));
    EXPECT_EQ(response.status(), grpc::health::v1::HealthCheckResponse::SERVING);
    context.TryCancel();
    EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
  }
  const std::string key =
      "rollout_rpcs_total{method=\"/grpc.health.v1.Health/Watch\",code=\"CANCELLED\"} 2";
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  std::string page = rel::HttpGet(options.metrics_port, "/metrics");
  while (page.find(key) == std::string::npos && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));  // the server ends it after
    page = rel::HttpGet(options.metrics_port, "/metrics");
  }
  EXPECT_NE(page.find(key), std::string::npos) << page;
  EXPECT_EQ(page.find("Health/Watch\",code=\"UNKNOWN\""), std::string::npos) << page;
}

}  // namespace
}  // namespace rollout::testing
