#include "tests/determinism_util.h"

#include <algorithm>
#include <chrono>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "grpcpp/create_channel.h"

namespace rollout::testing {

SamplingMode Greedy() { return {"greedy", 0.0f, std::nullopt}; }
SamplingMode Sampled() { return {"sampled", 0.7f, 0.9f}; }
std::vector<SamplingMode> BothModes() { return {Greedy(), Sampled()}; }

v1::RolloutRequest ModeRollout(const std::vector<uint32_t>& prompt, uint64_t seed,
                               uint32_t max_new_tokens, const SamplingMode& mode,
                               uint32_t num_samples, std::string request_id) {
  v1::RolloutRequest r;
  r.set_request_id(std::move(request_id));
  for (uint32_t t : prompt) r.add_prompt_token_ids(t);
  r.set_seed(seed);
  r.set_num_samples(num_samples);
  v1::SamplingParams* s = r.mutable_sampling();
  s->set_max_new_tokens(max_new_tokens);
  s->set_temperature(mode.temperature);
  if (mode.top_p.has_value()) s->set_top_p(*mode.top_p);
  s->set_ignore_eos(true);
  return r;
}

namespace {
uint32_t FloatBits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  return bits;
}
void AppendTops(std::string* out, const v1::TopLogprobs& top) {
  absl::StrAppend(out, "[");
  for (const v1::TopLogprob& e : top.entries()) {
    absl::StrAppend(out, e.token_id(), ":", absl::Hex(FloatBits(e.logprob())), ";");
  }
  absl::StrAppend(out, "]");
}
}  // namespace

std::string BitsFingerprint(const std::vector<uint32_t>& token_ids,
                            const std::vector<float>& logprobs,
                            const std::vector<v1::TopLogprobs>& top_logprobs) {
  std::string out;
  for (uint32_t t : token_ids) absl::StrAppend(&out, t, ",");
  absl::StrAppend(&out, "|");
  for (float lp : logprobs) absl::StrAppend(&out, absl::Hex(FloatBits(lp)), ",");
  absl::StrAppend(&out, "|");
  for (const v1::TopLogprobs& top : top_logprobs) AppendTops(&out, top);
  return out;
}

std::string CompletionBits(const v1::Completion& c) {
  return BitsFingerprint({c.token_ids().begin(), c.token_ids().end()},
                         {c.logprobs().begin(), c.logprobs().end()},
                         {c.top_logprobs().begin(), c.top_logprobs().end()});
}

std::string LogprobBits(const google::protobuf::RepeatedField<float>& logprobs,
                        const google::protobuf::RepeatedPtrField<v1::TopLogprobs>& tops) {
  return BitsFingerprint({}, {logprobs.begin(), logprobs.end()}, {tops.begin(), tops.end()});
}

void UniqueOutputs::Add(const std::string& key, const std::string& fingerprint) {
  seen_[key].insert(fingerprint);
  ++observations_;
}

void UniqueOutputs::Merge(const UniqueOutputs& other) {
  for (const auto& [key, prints] : other.seen_) seen_[key].insert(prints.begin(), prints.end());
  observations_ += other.observations_;
}

size_t UniqueOutputs::Unique(const std::string& key) const {
  auto it = seen_.find(key);
  return it == seen_.end() ? 0 : it->second.size();
}

size_t UniqueOutputs::MaxUnique() const {
  size_t max = 0;
  for (const auto& [key, prints] : seen_) max = std::max(max, prints.size());
  return max;
}

std::vector<std::string> UniqueOutputs::Offenders() const {
  std::vector<std::string> out;
  for (const auto& [key, prints] : seen_) {
    if (prints.size() > 1) out.push_back(absl::StrCat(key, "=", prints.size()));
  }
  return out;
}

std::string UniqueOutputs::Summary(const std::string& name) const {
  std::string s = absl::StrCat(name, ": ", seen_.size(), " rollouts, ", observations_,
                               " observations, max unique outputs per rollout ", MaxUnique());
  std::vector<std::string> bad = Offenders();
  if (!bad.empty()) {
    if (bad.size() > 8) bad.resize(8);
    absl::StrAppend(&s, " (offenders: ", absl::StrJoin(bad, ", "), ")");
  }
  return s;
}

UniqueOutputs CountUniqueOverTrials(int trials,
                                    const std::function<void(int, UniqueOutputs*)>& trial) {
  UniqueOutputs outputs;
  for (int t = 0; t < trials; ++t) trial(t, &outputs);
  return outputs;
}

int RandomInt(std::mt19937_64& rng, int lo, int hi) {
  return std::uniform_int_distribution<int>(lo, hi)(rng);
}

std::vector<uint32_t> RandomPrompt(std::mt19937_64& rng, int length, uint32_t vocab) {
  std::vector<uint32_t> p(length);
  for (uint32_t& t : p) t = static_cast<uint32_t>(RandomInt(rng, 0, static_cast<int>(vocab) - 1));
  return p;
}

std::shared_ptr<grpc::Channel> NewSeparateChannel(const std::string& address) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(256 << 20);
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  return grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args);
}

namespace {
void SetDeadline(grpc::ClientContext* context) {
  context->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
}
}  // namespace

v1::ServerInfo GetInfo(v1::RolloutService::Stub* stub) {
  grpc::ClientContext context;
  SetDeadline(&context);
  v1::ServerInfo info;
  grpc::Status status = stub->GetServerInfo(&context, v1::GetServerInfoRequest(), &info);
  (void)status;
  return info;
}

grpc::Status FlushCache(v1::RolloutService::Stub* stub, v1::FlushCacheResponse* response) {
  grpc::ClientContext context;
  SetDeadline(&context);
  v1::FlushCacheResponse ignored;
  return stub->FlushCache(&context, v1::FlushCacheRequest(), response ? response : &ignored);
}

grpc::Status Score(v1::RolloutService::Stub* stub, const v1::ScoreRequest& request,
                   v1::ScoreResponse* response) {
  grpc::ClientContext context;
  SetDeadline(&context);
  return stub->Score(&context, request, response);
}

grpc::Status Abort(v1::RolloutService::Stub* stub, const std::vector<std::string>& request_ids,
                   v1::AbortResponse* response) {
  grpc::ClientContext context;
  SetDeadline(&context);
  v1::AbortRequest request;
  for (const std::string& id : request_ids) request.add_request_ids(id);
  return stub->Abort(&context, request, response);
}

uint64_t SplitMix64(uint64_t x) {
  uint64_t z = x + 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

uint64_t DerivedSampleSeed(uint64_t seed, uint32_t j) {
  if (j == 0) return seed;
  return SplitMix64(seed + static_cast<uint64_t>(j) * 0x9E3779B97F4A7C15ull);
}

StreamedOutcome RunGenerateStreamed(v1::RolloutService::Stub* stub,
                                    const v1::GenerateRequest& request,
                                    const std::function<void(const v1::GenerateResponse&, int,
                                                             grpc::ClientContext*)>& on_response) {
  StreamedOutcome out;
  const int n = request.rollouts_size();
  out.completions.resize(n);
  out.has_completion.resize(n);
  out.streamed_tokens.resize(n);
  out.streamed_logprobs.resize(n);
  for (int i = 0; i < n; ++i) {
    const size_t samples = std::max<uint32_t>(1, request.rollouts(i).num_samples());
    out.completions[i].resize(samples);
    out.has_completion[i].resize(samples, false);
    out.streamed_tokens[i].resize(samples);
    out.streamed_logprobs[i].resize(samples);
  }
  grpc::ClientContext context;
  SetDeadline(&context);
  auto reader = stub->Generate(&context, request);
  v1::GenerateResponse response;
  int tokens = 0;
  while (reader->Read(&response)) {
    ++out.num_responses;
    if (response.has_chunk()) {
      const v1::TokenChunk& c = response.chunk();
      if (c.rollout_index() < static_cast<uint32_t>(n) &&
          c.sample_index() < out.streamed_tokens[c.rollout_index()].size()) {
        auto& t = out.streamed_tokens[c.rollout_index()][c.sample_index()];
        auto& l = out.streamed_logprobs[c.rollout_index()][c.sample_index()];
        t.insert(t.end(), c.token_ids().begin(), c.token_ids().end());
        l.insert(l.end(), c.logprobs().begin(), c.logprobs().end());
      }
      tokens += c.token_ids_size();
    } else if (response.has_completion()) {
      const v1::Completion& c = response.completion();
      if (c.rollout_index() < static_cast<uint32_t>(n) &&
          c.sample_index() < out.completions[c.rollout_index()].size()) {
        out.completions[c.rollout_index()][c.sample_index()] = c;
        out.has_completion[c.rollout_index()][c.sample_index()] = true;
      }
    }
    if (on_response) on_response(response, tokens, &context);
  }
  out.status = reader->Finish();
  return out;
}

}  // namespace rollout::testing
