// Helpers of the determinism suite (tests/determinism_test.cc): sampling modes, bitwise
// fingerprints, the "count unique outputs per rollout over trials" counter, random prompts and
// thin wrappers of the unary RPCs and of an interruptible streamed Generate.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "grpcpp/grpcpp.h"
#include "rollout/v1/rollout.grpc.pb.h"

namespace rollout::testing {

// How a rollout samples. The suite runs every mode greedy and sampled.
struct SamplingMode {
  std::string name;
  float temperature = 0.0f;
  std::optional<float> top_p;
};
SamplingMode Greedy();   // T = 0
SamplingMode Sampled();  // T = 0.7, top_p = 0.9
std::vector<SamplingMode> BothModes();

// A rollout in `mode` with ignore_eos set (so every sample has max_new_tokens tokens and the
// comparisons cover all of them).
v1::RolloutRequest ModeRollout(const std::vector<uint32_t>& prompt, uint64_t seed,
                               uint32_t max_new_tokens, const SamplingMode& mode,
                               uint32_t num_samples = 1, std::string request_id = "");

// Token ids, the bit pattern of every logprob and of every top-logprob entry. Two outputs are
// "the same" iff their fingerprints are equal.
std::string BitsFingerprint(const std::vector<uint32_t>& token_ids,
                            const std::vector<float>& logprobs,
                            const std::vector<v1::TopLogprobs>& top_logprobs = {});
// Of a completion: tokens, logprob bits, top-logprob bits (finish reason left out, so a
// concatenation of partial rollouts compares with an uninterrupted one).
std::string CompletionBits(const v1::Completion& c);
// Logprob and top-logprob bits only (no tokens), for Score vs Generate.
std::string LogprobBits(const google::protobuf::RepeatedField<float>& logprobs,
                        const google::protobuf::RepeatedPtrField<v1::TopLogprobs>& tops);

// Counts the distinct fingerprints each rollout (named by a key) produced over its trials. The
// only passing count is 1 per key.
class UniqueOutputs {
 public:
  void Add(const std::string& key, const std::string& fingerprint);
  void Merge(const UniqueOutputs& other);
  size_t Unique(const std::string& key) const;
  // The largest count over every key (0 when nothing was added).
  size_t MaxUnique() const;
  size_t NumKeys() const { return seen_.size(); }
  size_t NumObservations() const { return observations_; }
  // Keys with more than one distinct output.
  std::vector<std::string> Offenders() const;
  // "name: K rollouts, M observations, max unique U (offenders: ...)".
  std::string Summary(const std::string& name) const;

 private:
  std::map<std::string, std::set<std::string>> seen_;
  size_t observations_ = 0;
};

// Runs trial(t, &outputs) for t in [0, trials) and returns what every trial added.
UniqueOutputs CountUniqueOverTrials(int trials,
                                    const std::function<void(int trial, UniqueOutputs*)>& trial);

int RandomInt(std::mt19937_64& rng, int lo, int hi);  // uniform in [lo, hi]
std::vector<uint32_t> RandomPrompt(std::mt19937_64& rng, int length, uint32_t vocab = 4096);

// A channel of its own (own subchannel pool, so its own TCP connection) to `address`.
std::shared_ptr<grpc::Channel> NewSeparateChannel(const std::string& address);

v1::ServerInfo GetInfo(v1::RolloutService::Stub* stub);
grpc::Status FlushCache(v1::RolloutService::Stub* stub, v1::FlushCacheResponse* response = nullptr);
grpc::Status Score(v1::RolloutService::Stub* stub, const v1::ScoreRequest& request,
                   v1::ScoreResponse* response);
grpc::Status Abort(v1::RolloutService::Stub* stub, const std::vector<std::string>& request_ids,
                   v1::AbortResponse* response);

// The sample derivation of docs/api.md, computed independently of the server.
uint64_t SplitMix64(uint64_t x);
uint64_t DerivedSampleSeed(uint64_t seed, uint32_t j);

// A Generate call read response by response. `on_response` runs after every response with the
// call's context (so it may TryCancel) and the number of tokens streamed so far (all samples).
struct StreamedOutcome {
  grpc::Status status;
  // completions[rollout][sample] (rollout_index() of an unset one is 0 and token_ids empty);
  // has_completion[rollout][sample] says which arrived.
  std::vector<std::vector<v1::Completion>> completions;
  std::vector<std::vector<bool>> has_completion;
  // Concatenation of the streamed chunks per [rollout][sample].
  std::vector<std::vector<std::vector<uint32_t>>> streamed_tokens;
  std::vector<std::vector<std::vector<float>>> streamed_logprobs;
  int num_responses = 0;
};
StreamedOutcome RunGenerateStreamed(
    v1::RolloutService::Stub* stub, const v1::GenerateRequest& request,
    const std::function<void(const v1::GenerateResponse&, int tokens_so_far, grpc::ClientContext*)>&
        on_response = nullptr);

}  // namespace rollout::testing
