// One weight update spread over several concurrent UpdateWeights streams (header.part_count > 1)
// through the real gRPC stack: the same digest and bits as one stream, and every failure of one
// part failing every part's call with nothing applied.
#include <chrono>
#include <functional>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/reliability_util.h"
#include "tests/test_server.h"

namespace rollout::testing {
namespace {

using reliability::FetchServerInfo;
using reliability::MakeDataChunks;
using reliability::MakeWeightsHeader;
using reliability::ReadCheckpointTensor;
using reliability::ScaledBf16;

const std::vector<std::string> kTensors = {"model.layers.0.mlp.down_proj.weight",
                                           "model.layers.1.mlp.down_proj.weight",
                                           "model.layers.1.mlp.up_proj.weight"};
const std::vector<uint32_t> kPrompt = {21, 8, 1000, 77, 3, 512, 64};
constexpr auto kPartTimeout = std::chrono::milliseconds(1500);

// One part's call as the test sends it.
struct Part {
  v1::WeightsHeader header;
  std::vector<v1::WeightsChunk> data;
  // Cancel the call after this many data chunks (and a pause, so that the server has the
  // header and those chunks); -1: never.
  int cancel_after = -1;
};

struct Outcome {
  grpc::Status status;
  v1::UpdateWeightsResponse response;
};

Outcome PushPart(v1::RolloutService::Stub* stub, const Part& part) {
  Outcome out;
  grpc::ClientContext context;
  // Each part opens a connection of its own: a connect that fails on a loaded machine is tried
  // again instead of failing the part UNAVAILABLE (seen once: "failed to connect ... No such
  // file or directory" on a CI-like run).
  context.set_wait_for_ready(true);
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  auto writer = stub->UpdateWeights(&context, &out.response);
  v1::WeightsChunk first;
  *first.mutable_header() = part.header;
  bool ok = writer->Write(first);
  for (size_t i = 0; ok && i < part.data.size(); ++i) {
    if (static_cast<int>(i) == part.cancel_after) {
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      context.TryCancel();
      break;
    }
    ok = writer->Write(part.data[i]);
  }
  writer->WritesDone();
  out.status = writer->Finish();
  return out;
}

// Every part on its own channel (so on its own connection, as the clients send them), at once.
std::vector<Outcome> PushParts(const std::string& address, const std::vector<Part>& parts) {
  std::vector<std::future<Outcome>> calls;
  for (const Part& part : parts) {
    calls.push_back(std::async(std::launch::async, [&address, &part] {
      grpc::ChannelArguments args;
      args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
      auto channel = grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args);
      auto stub = v1::RolloutService::NewStub(channel);
      return PushPart(stub.get(), part);
    }));
  }
  std::vector<Outcome> outcomes;
  for (auto& call : calls) outcomes.push_back(call.get());
  return outcomes;
}

// `tensors` split into `count` parts of update `id`: tensor i goes to part i % count.
std::vector<Part> SplitUpdate(const std::string& version, const std::string& id, int count,
                              const std::vector<HostTensor>& tensors) {
  std::vector<std::vector<HostTensor>> subsets(count);
  for (size_t i = 0; i < tensors.size(); ++i) subsets[i % count].push_back(tensors[i]);
  std::vector<Part> parts;
  for (int p = 0; p < count; ++p) {
    Part& part = parts.emplace_back();
    part.header = MakeWeightsHeader(version, v1::IN_FLIGHT_POLICY_DRAIN, subsets[p]);
    part.header.set_update_id(id);
    part.header.set_part_index(p);
    part.header.set_part_count(count);
    part.data = MakeDataChunks(subsets[p], 4096);
  }
  return parts;
}

std::string Generate(v1::RolloutService::Stub* stub) {
  v1::GenerateRequest request;
  *request.add_rollouts() = MakeRollout(kPrompt, 5, 10, 0.8f);
  GenerateOutcome out = RunGenerate(stub, request);
  EXPECT_TRUE(out.status.ok()) << out.status.error_message();
  return out.completions.empty() ? "" : Fingerprint(out.completions[0][0]);
}

class WeightsMultipartE2eTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ServerOptions options;
    options.update_limits.part_timeout = kPartTimeout;
    options.metrics_port = reliability::PickFreePort();
    ASSERT_GT(options.metrics_port, 0);
    metrics_port_ = options.metrics_port;
    server_ = StartTestServer(options);
    ASSERT_NE(server_, nullptr);
    for (const std::string& name : kTensors) {
      original_.push_back(ReadCheckpointTensor(server_->server->model_dir(), name));
      changed_.push_back(ScaledBf16(original_.back(), 2.5f));
    }
    const v1::ServerInfo info = FetchServerInfo(stub());
    served_version_ = info.weight_version();
    served_digest_ = info.weight_digest();
    served_bits_ = Generate(stub());
  }
  v1::RolloutService::Stub* stub() { return server_->stub.get(); }
  std::string address() const { return server_->address(); }

  // The served version, digest and generated bits are those of the start.
  void ExpectUnchanged(const std::string& what) {
    const v1::ServerInfo info = FetchServerInfo(stub());
    EXPECT_EQ(info.weight_version(), served_version_) << what;
    EXPECT_EQ(info.weight_digest(), served_digest_) << what;
    EXPECT_EQ(Generate(stub()), served_bits_) << what;
  }
  // Every call failed with `code`, its message containing `expect`.
  static void ExpectAllFailed(const std::vector<Outcome>& outcomes, grpc::StatusCode code,
                              const std::string& expect, const std::string& what) {
    for (size_t i = 0; i < outcomes.size(); ++i) {
      EXPECT_EQ(outcomes[i].status.error_code(), code)
          << what << ", part " << i << ": " << outcomes[i].status.error_message();
      EXPECT_NE(outcomes[i].status.error_message().find(expect), std::string::npos)
          << what << ", part " << i << ": " << outcomes[i].status.error_message();
    }
  }

  // rollout_weight_updates_total{outcome="failed"} now.
  uint64_t FailedUpdates() const {
    return reliability::MetricValue(reliability::HttpGet(metrics_port_, "/metrics"),
                                    "rollout_weight_updates_total{outcome=\"failed\"}");
  }

  std::unique_ptr<TestServer> server_;
  int metrics_port_ = 0;
  std::vector<HostTensor> original_, changed_;
  std::string served_version_, served_digest_, served_bits_;
};

TEST_F(WeightsMultipartE2eTest, ThreePartsGiveTheDigestAndBitsOfOneStream) {
  // One stream first, then back to the original bytes, then the same bytes in three parts.
  std::vector<Part> one = SplitUpdate("one-stream", "", 1, changed_);
  one[0].header.clear_part_count();
  const Outcome single = PushPart(stub(), one[0]);
  ASSERT_TRUE(single.status.ok()) << single.status.error_message();
  EXPECT_EQ(single.response.part_count(), 1u);
  const std::string single_bits = Generate(stub());
  EXPECT_NE(single_bits, served_bits_);
  ASSERT_TRUE(PushPart(stub(), SplitUpdate("back", "", 1, original_)[0]).status.ok());
  ASSERT_EQ(FetchServerInfo(stub()).weight_digest(), served_digest_);

  const std::vector<Outcome> parts =
      PushParts(address(), SplitUpdate("three-parts", "update-3", 3, changed_));
  ASSERT_EQ(parts.size(), 3u);
  for (const Outcome& part : parts) {
    ASSERT_TRUE(part.status.ok()) << part.status.error_message();
    // Every call answers for the whole update.
    EXPECT_EQ(part.response.version(), "three-parts");
    EXPECT_EQ(part.response.part_count(), 3u);
    EXPECT_EQ(part.response.tensors_updated(), 3u);
    EXPECT_EQ(part.response.bytes_received(), single.response.bytes_received());
    EXPECT_EQ(part.response.weight_digest(), single.response.weight_digest());
    EXPECT_EQ(part.response.previous_version(), "back");
  }
  const v1::ServerInfo info = FetchServerInfo(stub());
  EXPECT_EQ(info.weight_version(), "three-parts");
  EXPECT_EQ(info.weight_digest(), single.response.weight_digest());
  EXPECT_EQ(Generate(stub()), single_bits);
}

TEST_F(WeightsMultipartE2eTest, ABadChunkInOnePartFailsEveryPartAndAppliesNothing) {
  std::vector<Part> parts = SplitUpdate("bad-chunk", "bad-chunk", 3, changed_);
  parts[1].data.at(2).mutable_data()->set_offset(parts[1].data.at(2).data().offset() - 10);
  ExpectAllFailed(PushParts(address(), parts), grpc::StatusCode::INVALID_ARGUMENT,
                  "part 1 of the 3 of update 'bad-chunk'", "bad chunk");
  ExpectUnchanged("bad chunk");
}

TEST_F(WeightsMultipartE2eTest, ACancelledPartFailsEveryPartAndAppliesNothing) {
  std::vector<Part> parts = SplitUpdate("cancelled", "cancelled", 3, changed_);
  parts[2].cancel_after = 3;
  const std::vector<Outcome> outcomes = PushParts(address(), parts);
  ExpectAllFailed(outcomes, grpc::StatusCode::CANCELLED, "", "cancelled part");
  EXPECT_NE(outcomes[0].status.error_message().find("cancelled"), std::string::npos)
      << outcomes[0].status.error_message();
  ExpectUnchanged("cancelled part");
}

TEST_F(WeightsMultipartE2eTest, OverlappingTensorSetsFailEveryPart) {
  std::vector<Part> parts = SplitUpdate("overlap", "overlap", 3, changed_);
  // Part 2 also declares (and sends) part 0's tensor.
  *parts[2].header.add_tensors() = parts[0].header.tensors(0);
  for (const v1::WeightsChunk& c : parts[0].data) parts[2].data.push_back(c);
  ExpectAllFailed(PushParts(address(), parts), grpc::StatusCode::INVALID_ARGUMENT,
                  "declared by another part too", "overlapping tensors");
  ExpectUnchanged("overlapping tensors");
}

TEST_F(WeightsMultipartE2eTest, MismatchedHeadersFailEveryPart) {
  struct Case {
    std::string name;
    std::function<void(v1::WeightsHeader*)> tamper;
    std::string expect;
  };
  const std::vector<Case> cases = {
      {"version", [](v1::WeightsHeader* h) { h->set_version("other"); }, "differs"},
      {"policy", [](v1::WeightsHeader* h) { h->set_policy(v1::IN_FLIGHT_POLICY_ABORT); },
       "differs"},
      {"part_count", [](v1::WeightsHeader* h) { h->set_part_count(4); }, "part_count"},
      {"index twice", [](v1::WeightsHeader* h) { h->set_part_index(0); }, "a second time"},
      {"index beyond", [](v1::WeightsHeader* h) { h->set_part_index(7); }, "not below"},
  };
  for (const Case& c : cases) {
    const std::string id = "mismatch-" + c.name;
    std::vector<Part> parts = SplitUpdate("mismatch", id, 3, changed_);
    c.tamper(&parts[1].header);
    ExpectAllFailed(PushParts(address(), parts), grpc::StatusCode::INVALID_ARGUMENT, c.expect,
                    c.name);
    ExpectUnchanged(c.name);
  }
}

TEST_F(WeightsMultipartE2eTest, AMissingPartFailsEveryPartAtThePartTimeout) {
  std::vector<Part> parts = SplitUpdate("missing", "missing", 3, changed_);
  parts.pop_back();
  const auto start = std::chrono::steady_clock::now();
  ExpectAllFailed(PushParts(address(), parts), grpc::StatusCode::DEADLINE_EXCEEDED,
                  "only 2 of its 3 parts arrived", "missing part");
  EXPECT_GE(std::chrono::steady_clock::now() - start, kPartTimeout);
  ExpectUnchanged("missing part");
  // The slot and the staging are free again: a whole update is staged at once.
  for (const Outcome& o : PushParts(address(), SplitUpdate("retry", "retry", 3, changed_))) {
    EXPECT_TRUE(o.status.ok()) << o.status.error_message();
  }
  EXPECT_EQ(FetchServerInfo(stub()).weight_version(), "retry");
}

TEST_F(WeightsMultipartE2eTest, ABadHeaderInOnePartFailsItsSiblings) {
  // Part 0 is refused on its own (an unknown tensor) before it could join: its siblings, which
  // come later, are refused with its status instead of waiting for it.
  std::vector<Part> parts = SplitUpdate("bad-header", "bad-header", 3, changed_);
  parts[0].header.mutable_tensors(0)->set_name("model.layers.1.mlp.missing.weight");
  const Outcome first = PushPart(stub(), parts[0]);
  EXPECT_EQ(first.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(first.status.error_message().find("not a weight of the served model"),
            std::string::npos);
  const std::vector<Outcome> rest = PushParts(address(), {parts[1], parts[2]});
  ExpectAllFailed(rest, grpc::StatusCode::INVALID_ARGUMENT, "not a weight of the served model",
                  "siblings of a bad header");
  ExpectUnchanged("bad header");
}

TEST_F(WeightsMultipartE2eTest, AnotherUpdateIsRefusedWhileOneAssemblesAndALatePartToo) {
  std::vector<Part> parts = SplitUpdate("assembling", "assembling", 2, changed_);
  // Part 0 alone: the update waits for part 1 (up to the part timeout).
  std::future<Outcome> first =
      std::async(std::launch::async, [&] { return PushParts(address(), {parts[0]})[0]; });
  while (!FetchServerInfo(stub()).weight_update_in_progress()) {  // part 0 has joined
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  grpc::Status other;
  for (int i = 0; i < 50; ++i) {
    other = PushPart(stub(), SplitUpdate("single", "", 1, changed_)[0]).status;
    if (other.error_code() == grpc::StatusCode::ABORTED) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(other.error_code(), grpc::StatusCode::ABORTED);
  EXPECT_NE(other.error_message().find("another weight update (update_id 'assembling'"),
            std::string::npos)
      << other.error_message();
  // Part 1 comes; the update applies.
  const Outcome second = PushParts(address(), {parts[1]})[0];
  const Outcome first_outcome = first.get();
  ASSERT_TRUE(first_outcome.status.ok()) << first_outcome.status.error_message();
  ASSERT_TRUE(second.status.ok()) << second.status.error_message();
  EXPECT_EQ(first_outcome.response.weight_digest(), second.response.weight_digest());
  // A part of the update that ended is refused, and changes nothing.
  const Outcome late = PushPart(stub(), parts[1]);
  EXPECT_EQ(late.status.error_code(), grpc::StatusCode::ABORTED);
  EXPECT_NE(late.status.error_message().find("has ended already"), std::string::npos)
      << late.status.error_message();
  EXPECT_EQ(FetchServerInfo(stub()).weight_version(), "assembling");
}

// A failed multi-part update is one failed update on /metrics however many of its parts hear
// of it: parts that failed together, a part refused on its own before any joined (and a second
// one like it), the siblings refused after it, and a part missing at the timeout.
TEST_F(WeightsMultipartE2eTest, AFailedUpdateCountsOnceAsFailedHoweverManyPartsFail) {
  struct Case {
    std::string name;
    std::function<void(const std::string& id)> push;
  };
  const std::vector<Case> cases = {
      {"mismatched header",
       [&](const std::string& id) {
         std::vector<Part> parts = SplitUpdate("mismatch", id, 3, changed_);
         parts[1].header.set_version("other");
         ExpectAllFailed(PushParts(address(), parts), grpc::StatusCode::INVALID_ARGUMENT, "differs",
                         id);
       }},
      {"bad chunk",
       [&](const std::string& id) {
         std::vector<Part> parts = SplitUpdate("bad-chunk", id, 3, changed_);
         parts[1].data.at(2).mutable_data()->set_offset(parts[1].data.at(2).data().offset() - 10);
         ExpectAllFailed(PushParts(address(), parts), grpc::StatusCode::INVALID_ARGUMENT,
                         "overlaps", id);
       }},
      {"two bad headers, then the sibling",
       [&](const std::string& id) {
         std::vector<Part> parts = SplitUpdate("bad-header", id, 3, changed_);
         for (int p : {0, 1}) {
           parts[p].header.mutable_tensors(0)->set_name("model.layers.1.mlp.missing.weight");
         }
         ExpectAllFailed(
             {PushPart(stub(), parts[0]), PushPart(stub(), parts[1]), PushPart(stub(), parts[2])},
             grpc::StatusCode::INVALID_ARGUMENT, "not a weight of the served model", id);
       }},
      {"missing part",
       [&](const std::string& id) {
         std::vector<Part> parts = SplitUpdate("missing", id, 3, changed_);
         parts.pop_back();
         ExpectAllFailed(PushParts(address(), parts), grpc::StatusCode::DEADLINE_EXCEEDED,
                         "only 2 of its 3 parts arrived", id);
       }},
  };
  for (const Case& c : cases) {
    const uint64_t before = FailedUpdates();
    c.push(c.name);
    EXPECT_EQ(FailedUpdates(), before + 1) << c.name;
    // A late part of the failed update is refused with its failure and counts no second time.
    const Outcome late = PushPart(stub(), SplitUpdate("late", c.name, 3, changed_)[2]);
    EXPECT_NE(late.status.error_message().find("has ended already"), std::string::npos)
        << c.name << ": " << late.status.error_message();
    EXPECT_EQ(FailedUpdates(), before + 1) << c.name << ", after a late part";
  }
  ExpectUnchanged("failed updates");
}

}  // namespace
}  // namespace rollout::testing
