// rollout-cli: call the rollout service from the command line.
//
//   rollout-cli --prompt "1,2,3" --samples 2 --seed 7 generate
//   rollout-cli --tokens 1,2,3,4 --start 2 --top_logprobs 3 score
//   rollout-cli --json --prompt 1,2,3 --return_routing generate      (MoE: Completion.routing)
//   rollout-cli --json --tokens 1,2,3,4 --start 2 --routing 5,1,0,3 score   (routing replay)
//   rollout-cli --request_ids cli-1-2,cli-1-3 abort      (or: rollout-cli --all abort)
//   rollout-cli flush
//   rollout-cli --json info
//   rollout-cli update-weights --from /ckpt/step-100 --version step-100 --policy continue
//   rollout-cli update-weights --from /ckpt/step-100 --version step-100 --streams 4
//   rollout-cli update-weights-from-path --path /srv/ckpt/step-100 --version step-100
//   rollout-cli update-weights-from-ipc --ipc_tensors handles.json --version step-100
//   rollout-cli pause --abort_in_flight       (then: rollout-cli resume)
//   rollout-cli release-memory --weights      (then: rollout-cli resume-memory)

#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/checkpoint_upload.h"
#include "client/cli_format.h"
#include "client/rollout_client.h"
#include "common/command_line.h"
#include "common/regular_file.h"

ABSL_FLAG(std::string, server, "127.0.0.1:50051", "Address of the rollout server.");
ABSL_FLAG(std::string, prompt, "", "Prompt token ids, \"1,2,3\" or \"1 2 3\" (generate).");
ABSL_FLAG(uint32_t, samples, 1, "Samples of the prompt (num_samples).");
ABSL_FLAG(uint64_t, seed, 0, "Seed of the rollout; sample j derives its seed from (seed, j).");
// Sampling knobs are optional so that, when not given, the field stays unset and the server's
// default applies instead of a second copy of it living here.
ABSL_FLAG(std::optional<float>, temperature, std::nullopt,
          "Temperature. generate: sampling, 0 = greedy; score: the logprobs' temperature, "
          "0 = 1. Server default: 1.0.");
ABSL_FLAG(std::optional<int32_t>, top_k, std::nullopt, "Top-k; 0 = off. Server default: off.");
ABSL_FLAG(std::optional<float>, top_p, std::nullopt, "Top-p in (0, 1]. Server default: 1.0.");
ABSL_FLAG(std::optional<float>, min_p, std::nullopt, "Min-p in [0, 1]. Server default: 0.");
ABSL_FLAG(uint32_t, max_new_tokens, 16, "Most tokens to generate per sample.");
ABSL_FLAG(std::string, stop, "", "Stop token ids, \"1,2\" or \"1 2\".");
ABSL_FLAG(bool, ignore_eos, false, "Keep generating past EOS tokens.");
ABSL_FLAG(uint32_t, top_logprobs, 0,
          "Top-N logprobs per generated (generate) or scored (score) position; 0 = none.");
ABSL_FLAG(std::string, request_id, "", "Request id (generate); default cli-<pid>-<unix ms>.");
ABSL_FLAG(std::string, tokens, "", "Token ids of the sequence to score, \"1,2,3\" or \"1 2 3\".");
ABSL_FLAG(bool, return_routing, false,
          "MoE models: also return the experts each token's row used (generate: "
          "Completion.routing; score: ScoredSequence.routing; docs/api.md, \"Routing replay\"): "
          "an experts column, each token's ids of every MoE layer, layers ascending.");
ABSL_FLAG(std::string, routing, "",
          "score, MoE models: replay this routing (ScoreSequence.routing: for each token from "
          "--start, the expert ids of every MoE layer, as Completion.routing), \"5,1,0,3\".");
ABSL_FLAG(uint32_t, start, 1,
          "score: index of the first token of --tokens to score (>= 1); each is scored given "
          "the tokens before it.");
ABSL_FLAG(std::string, request_ids, "", "abort: request ids of the rollouts to abort, \"a,b\".");
ABSL_FLAG(bool, all, false, "abort: abort every in-flight rollout instead of --request_ids.");
ABSL_FLAG(bool, json, false,
          "Print the response (every streamed one for generate) as one JSON line instead of a "
          "table.");
ABSL_FLAG(std::string, auth_token_file, "",
          "File whose first line is the bearer token, sent as authorization metadata (as the "
          "server's --auth_token_file).");
ABSL_FLAG(std::string, auth_token, "",
          "The bearer token itself (visible in the process list; prefer --auth_token_file).");
ABSL_FLAG(std::string, token, "", "Deprecated spelling of --auth_token.");
ABSL_FLAG(std::optional<double>, timeout_s, std::nullopt, "Deadline of the call in seconds.");
ABSL_FLAG(double, connect_timeout_s, 10.0, "How long to wait for the server to be reachable.");
ABSL_FLAG(std::string, tls_root_cert, "",
          "PEM file of root certificates; when set the connection uses TLS.");
ABSL_FLAG(std::string, tls_client_cert, "",
          "PEM file of this client's certificate chain, for servers that verify clients (mutual "
          "TLS); needs --tls_client_key, and turns TLS on (default roots without "
          "--tls_root_cert).");
ABSL_FLAG(std::string, tls_client_key, "", "PEM file of the private key of --tls_client_cert.");
ABSL_FLAG(std::string, from, "",
          "update-weights: local checkpoint directory (config.json + safetensors) to stream.");
ABSL_FLAG(std::string, path, "",
          "update-weights-from-path: checkpoint directory on the server's disk.");
ABSL_FLAG(std::string, ipc_tensors, "",
          "update-weights-from-ipc: JSON file of the tensors' CUDA IPC handles, {\"tensors\": "
          "[{\"name\", \"dtype\", \"shape\", \"ipc_handle\" (base64 of 64 bytes), "
          "\"offset_bytes\", \"device_uuid\"}, ...]} (docs/api.md); the process that exported "
          "them must keep them alive until this returns.");
// Abseil owns --version (print the binary's version and exit); main rewrites "--version V" to
// this flag before parsing, so both spellings work.
ABSL_FLAG(std::string, weight_version, "",
          "update-weights, update-weights-from-path, update-weights-from-ipc: the new weight "
          "version (--version V works too).");
ABSL_FLAG(std::string, policy, "drain",
          "update-weights*: what happens to samples in flight: drain "
          "(finish them on the old weights first), abort (end them now) or continue (go on with "
          "the new weights).");
ABSL_FLAG(uint32_t, chunk_mb, 4,
          "update-weights: MiB of tensor data per message, 1 to 63 (the server accepts "
          "messages up to 64 MiB).");
ABSL_FLAG(int32_t, streams, 1,
          "update-weights: concurrent streams (each on its own connection) the update is spread "
          "over, its tensors split by bytes; the server swaps once, when all arrived (1 to 64; "
          "a server predating multi-part updates needs 1).");
ABSL_FLAG(bool, abort_in_flight, false,
          "pause, release-memory: also end the running samples (FINISH_REASON_ABORT) instead of "
          "holding them.");
ABSL_FLAG(bool, weights, false,
          "release-memory: release the weights' GPU memory too (kept in the server's host "
          "memory; weight updates are refused until resume-memory).");

namespace rollout {
namespace {

[[noreturn]] void Fail(const absl::Status& status) {
  std::cerr << "error: " << absl::StatusCodeToString(status.code()) << ": " << status.message()
            << std::endl;
  std::exit(1);
}

void CheckOk(const absl::Status& status) {
  if (!status.ok()) Fail(status);
}

// The ids in flag --name's text ("1,2,3" or "1 2 3"); a usage error naming the flag otherwise.
std::vector<uint32_t> IdsFlag(const std::string& text, const char* name) {
  absl::StatusOr<std::vector<uint32_t>> ids = ParseTokenIds(text);
  if (!ids.ok()) {
    Fail(absl::InvalidArgumentError(absl::StrCat("--", name, ": ", ids.status().message())));
  }
  return *std::move(ids);
}

std::chrono::milliseconds SecondsFlag(double seconds, const char* name) {
  if (!(seconds > 0)) {
    Fail(absl::InvalidArgumentError(absl::StrCat("--", name, " must be positive")));
  }
  return std::chrono::duration_cast<std::chrono::milliseconds>(
      std::chrono::duration<double>(seconds));
}

// --auth_token_file, else --auth_token, else the deprecated --token; surrounding whitespace
// (a "\r" left by a CRLF --flagfile, say) is not part of a token.
std::string BearerTokenFromFlags() {
  if (const std::string file = absl::GetFlag(FLAGS_auth_token_file); !file.empty()) {
    absl::StatusOr<std::string> token = ReadTokenFile(file);
    CheckOk(token.status());
    return *std::move(token);
  }
  std::string token = absl::GetFlag(FLAGS_auth_token);
  if (token.empty() && !absl::GetFlag(FLAGS_token).empty()) {
    std::fprintf(stderr,
                 "rollout-cli: --token is deprecated; use --auth_token_file (or "
                 "--auth_token)\n");
    token = absl::GetFlag(FLAGS_token);
  }
  return std::string(absl::StripAsciiWhitespace(token));
}

std::unique_ptr<RolloutClient> ConnectFromFlags() {
  ClientOptions options;
  options.connect_timeout =
      SecondsFlag(absl::GetFlag(FLAGS_connect_timeout_s), "connect_timeout_s");
  if (std::optional<double> timeout = absl::GetFlag(FLAGS_timeout_s)) {
    options.call_timeout = SecondsFlag(*timeout, "timeout_s");
  }
  options.bearer_token = BearerTokenFromFlags();
  if (std::string cert = absl::GetFlag(FLAGS_tls_root_cert); !cert.empty()) {
    options.tls_root_cert_path = std::move(cert);
  }
  if (std::string cert = absl::GetFlag(FLAGS_tls_client_cert); !cert.empty()) {
    options.tls_client_cert_path = std::move(cert);
  }
  if (std::string key = absl::GetFlag(FLAGS_tls_client_key); !key.empty()) {
    options.tls_client_key_path = std::move(key);
  }
  absl::StatusOr<std::unique_ptr<RolloutClient>> client =
      RolloutClient::Connect(absl::GetFlag(FLAGS_server), options);
  CheckOk(client.status());
  return *std::move(client);
}

rollout::v1::GenerateRequest RequestFromFlags() {
  const std::string prompt = absl::GetFlag(FLAGS_prompt);
  if (prompt.empty()) Fail(absl::InvalidArgumentError("--prompt is required for generate"));
  const std::vector<uint32_t> prompt_ids = IdsFlag(prompt, "prompt");

  rollout::v1::GenerateRequest request;
  rollout::v1::RolloutRequest* rollout = request.add_rollouts();
  std::string request_id = absl::GetFlag(FLAGS_request_id);
  if (request_id.empty()) {
    const auto now = std::chrono::system_clock::now().time_since_epoch();
    request_id = absl::StrCat("cli-", getpid(), "-",
                              std::chrono::duration_cast<std::chrono::milliseconds>(now).count());
  }
  rollout->set_request_id(request_id);
  rollout->mutable_prompt_token_ids()->Add(prompt_ids.begin(), prompt_ids.end());
  rollout->set_seed(absl::GetFlag(FLAGS_seed));
  rollout->set_num_samples(absl::GetFlag(FLAGS_samples));

  rollout::v1::SamplingParams* sampling = rollout->mutable_sampling();
  if (auto v = absl::GetFlag(FLAGS_temperature)) sampling->set_temperature(*v);
  if (auto v = absl::GetFlag(FLAGS_top_k)) sampling->set_top_k(*v);
  if (auto v = absl::GetFlag(FLAGS_top_p)) sampling->set_top_p(*v);
  if (auto v = absl::GetFlag(FLAGS_min_p)) sampling->set_min_p(*v);
  sampling->set_max_new_tokens(absl::GetFlag(FLAGS_max_new_tokens));
  if (const std::string stop = absl::GetFlag(FLAGS_stop); !stop.empty()) {
    const std::vector<uint32_t> stop_ids = IdsFlag(stop, "stop");
    sampling->mutable_stop_token_ids()->Add(stop_ids.begin(), stop_ids.end());
  }
  sampling->set_ignore_eos(absl::GetFlag(FLAGS_ignore_eos));
  sampling->set_top_logprobs(absl::GetFlag(FLAGS_top_logprobs));
  request.set_return_routing(absl::GetFlag(FLAGS_return_routing));
  return request;
}

void RunGenerate() {
  // The request is built first so a typo in --prompt fails without waiting on the network.
  const rollout::v1::GenerateRequest request = RequestFromFlags();
  std::unique_ptr<RolloutClient> client = ConnectFromFlags();
  if (absl::GetFlag(FLAGS_json)) {
    // Flushed per line so a consumer piping the output sees tokens as they arrive.
    CheckOk(client->Generate(request, [](const rollout::v1::GenerateResponse& response) {
      std::cout << FormatJson(response) << std::endl;
    }));
    return;
  }
  absl::StatusOr<GenerateResult> result = client->GenerateAll(request);
  CheckOk(result.status());
  std::cout << FormatCompletionTable(*result);
}

rollout::v1::ScoreRequest ScoreRequestFromFlags() {
  const std::string tokens = absl::GetFlag(FLAGS_tokens);
  if (tokens.empty()) {
    // --token (singular) is the bearer token; a dropped "s" would otherwise fail confusingly.
    Fail(
        absl::InvalidArgumentError("--tokens is required for score (--token is the bearer token)"));
  }
  const std::vector<uint32_t> token_ids = IdsFlag(tokens, "tokens");
  // The server checks this too; checking here fails a typo without a round trip, and a start at
  // or past the end would score nothing, which no one asks for on purpose.
  if (token_ids.size() < 2) {
    Fail(absl::InvalidArgumentError(
        "--tokens needs at least 2 tokens: the first has no context to be scored in"));
  }
  const uint32_t start = absl::GetFlag(FLAGS_start);
  if (start < 1 || start >= token_ids.size()) {
    Fail(absl::InvalidArgumentError(absl::StrCat("--start must be in [1, ", token_ids.size() - 1,
                                                 "] for ", token_ids.size(), " tokens")));
  }

  rollout::v1::ScoreRequest request;
  rollout::v1::ScoreSequence* sequence = request.add_sequences();
  sequence->mutable_token_ids()->Add(token_ids.begin(), token_ids.end());
  sequence->set_start(start);
  if (auto v = absl::GetFlag(FLAGS_temperature)) sequence->set_temperature(*v);
  sequence->set_top_logprobs(absl::GetFlag(FLAGS_top_logprobs));
  sequence->set_return_routing(absl::GetFlag(FLAGS_return_routing));
  if (const std::string routing = absl::GetFlag(FLAGS_routing); !routing.empty()) {
    // The server checks the length and the ids (naming the sequence and the index).
    const std::vector<uint32_t> ids = IdsFlag(routing, "routing");
    sequence->mutable_routing()->Add(ids.begin(), ids.end());
  }
  return request;
}

rollout::v1::AbortRequest AbortRequestFromFlags() {
  const std::string request_ids = absl::GetFlag(FLAGS_request_ids);
  const bool all = absl::GetFlag(FLAGS_all);
  // Both set is ambiguous (all would silently win on the server), neither is a no-op.
  if (all == !request_ids.empty()) {
    Fail(absl::InvalidArgumentError("abort needs exactly one of --request_ids or --all"));
  }
  rollout::v1::AbortRequest request;
  if (all) {
    request.set_all(true);
    return request;
  }
  absl::StatusOr<std::vector<std::string>> ids = ParseRequestIds(request_ids);
  if (!ids.ok()) {
    Fail(absl::InvalidArgumentError(absl::StrCat("--request_ids: ", ids.status().message())));
  }
  request.mutable_request_ids()->Add(ids->begin(), ids->end());
  return request;
}

// Prints a unary call's response as JSON or with the command's formatter.
template <typename Response>
void PrintResponse(const absl::StatusOr<Response>& response,
                   const std::function<std::string(const Response&)>& format) {
  CheckOk(response.status());
  if (absl::GetFlag(FLAGS_json)) {
    std::cout << FormatJson(*response) << std::endl;
  } else {
    std::cout << format(*response);
  }
}

void RunScore() {
  const rollout::v1::ScoreRequest request = ScoreRequestFromFlags();
  std::unique_ptr<RolloutClient> client = ConnectFromFlags();
  PrintResponse<rollout::v1::ScoreResponse>(client->Score(request),
                                            [&](const rollout::v1::ScoreResponse& response) {
                                              return FormatScoreTable(request, response);
                                            });
}

void RunAbort() {
  const rollout::v1::AbortRequest request = AbortRequestFromFlags();
  std::unique_ptr<RolloutClient> client = ConnectFromFlags();
  PrintResponse<rollout::v1::AbortResponse>(client->Abort(request),
                                            [&](const rollout::v1::AbortResponse& response) {
                                              return FormatAbortResult(request, response);
                                            });
}

void RunFlush() {
  std::unique_ptr<RolloutClient> client = ConnectFromFlags();
  PrintResponse<rollout::v1::FlushCacheResponse>(client->FlushCache(), FormatFlushCacheResult);
}

void RunInfo() {
  std::unique_ptr<RolloutClient> client = ConnectFromFlags();
  PrintResponse<rollout::v1::ServerInfo>(client->GetServerInfo(), FormatServerInfoTable);
}

std::string RequiredFlag(const std::string& value, const char* name, const char* command) {
  if (value.empty()) {
    Fail(absl::InvalidArgumentError(absl::StrCat("--", name, " is required for ", command)));
  }
  return value;
}

std::string WeightVersionFromFlags(const char* command) {
  const std::string version = absl::GetFlag(FLAGS_weight_version);
  if (version.empty()) {
    Fail(absl::InvalidArgumentError(
        absl::StrCat("--version (or --weight_version) is required for ", command)));
  }
  return version;
}

rollout::v1::InFlightPolicy PolicyFromFlags() {
  absl::StatusOr<rollout::v1::InFlightPolicy> policy =
      ParseInFlightPolicy(absl::GetFlag(FLAGS_policy));
  if (!policy.ok()) {
    Fail(absl::InvalidArgumentError(absl::StrCat("--policy: ", policy.status().message())));
  }
  return *policy;
}

// Progress of an upload on stderr: redrawn in place at most 10 times a second on a terminal;
// elsewhere (a log file) only the final line, so logs do not fill with carriage returns.
class ProgressLine {
 public:
  ProgressLine() : tty_(isatty(STDERR_FILENO) == 1) {}

  void Update(uint64_t sent, uint64_t total) {
    const auto now = std::chrono::steady_clock::now();
    if (!started_) {
      started_ = true;
      start_ = now;
    }
    const bool done = sent == total;
    if (!done && (!tty_ || now - last_draw_ < std::chrono::milliseconds(100))) return;
    last_draw_ = now;
    const std::string line =
        FormatUploadProgress(sent, total, std::chrono::duration<double>(now - start_).count());
    // Padding covers the tail of a longer previous line.
    std::cerr << (tty_ ? "\r" : "") << absl::StrFormat("%-60s", line) << (done ? "\n" : "")
              << std::flush;
    drawn_ = !done;
  }

  // Ends a line left open by an upload that failed part way.
  void Close() {
    if (drawn_) std::cerr << std::endl;
    drawn_ = false;
  }

 private:
  const bool tty_;
  bool started_ = false;
  bool drawn_ = false;
  std::chrono::steady_clock::time_point start_, last_draw_;
};

void RunUpdateWeights() {
  const std::string dir = RequiredFlag(absl::GetFlag(FLAGS_from), "from", "update-weights");
  const std::string version = WeightVersionFromFlags("update-weights");
  const rollout::v1::InFlightPolicy policy = PolicyFromFlags();
  const uint32_t chunk_mb = absl::GetFlag(FLAGS_chunk_mb);
  if (chunk_mb == 0 || chunk_mb > (kMaxWeightsChunkBytes >> 20)) {
    Fail(absl::InvalidArgumentError(absl::StrFormat(
        "--chunk_mb %u: give 1 to %u (the server accepts messages up to 64 MiB, a chunk's "
        "fields included)",
        chunk_mb, kMaxWeightsChunkBytes >> 20)));
  }
  const int32_t streams = absl::GetFlag(FLAGS_streams);
  if (streams < 1 || streams > kMaxWeightsStreams) {
    Fail(absl::InvalidArgumentError(
        absl::StrFormat("--streams %d: give 1 to %d (the server takes up to %d parts)", streams,
                        kMaxWeightsStreams, kMaxWeightsStreams)));
  }
  std::unique_ptr<RolloutClient> client = ConnectFromFlags();
  ProgressLine progress;
  absl::StatusOr<rollout::v1::UpdateWeightsResponse> response = UpdateWeightsFromCheckpoint(
      *client, dir, version, policy, static_cast<size_t>(chunk_mb) << 20,
      [&](uint64_t sent, uint64_t total) { progress.Update(sent, total); }, streams);
  progress.Close();
  PrintResponse<rollout::v1::UpdateWeightsResponse>(response, FormatUpdateWeightsResult);
}

void RunUpdateWeightsFromPath() {
  rollout::v1::UpdateWeightsFromPathRequest request;
  request.set_path(RequiredFlag(absl::GetFlag(FLAGS_path), "path", "update-weights-from-path"));
  request.set_version(WeightVersionFromFlags("update-weights-from-path"));
  request.set_policy(PolicyFromFlags());
  std::unique_ptr<RolloutClient> client = ConnectFromFlags();
  PrintResponse<rollout::v1::UpdateWeightsResponse>(client->UpdateWeightsFromPath(request),
                                                    FormatUpdateWeightsResult);
}

void RunUpdateWeightsFromIpc() {
  const std::string file =
      RequiredFlag(absl::GetFlag(FLAGS_ipc_tensors), "ipc_tensors", "update-weights-from-ipc");
  absl::StatusOr<std::string> json = ReadSmallFile(file, uint64_t{64} << 20, "IPC tensors file");
  CheckOk(json.status());
  absl::StatusOr<rollout::v1::UpdateWeightsFromIpcRequest> request = ParseIpcTensorsJson(*json);
  if (!request.ok()) {
    Fail(absl::InvalidArgumentError(absl::StrCat(file, ": ", request.status().message())));
  }
  request->set_version(WeightVersionFromFlags("update-weights-from-ipc"));
  request->set_policy(PolicyFromFlags());
  std::unique_ptr<RolloutClient> client = ConnectFromFlags();
  PrintResponse<rollout::v1::UpdateWeightsResponse>(client->UpdateWeightsFromIpc(*request),
                                                    FormatUpdateWeightsResult);
}

void RunPause() {
  std::unique_ptr<RolloutClient> client = ConnectFromFlags();
  PrintResponse<rollout::v1::PauseResponse>(client->Pause(absl::GetFlag(FLAGS_abort_in_flight)),
                                            FormatPauseResult);
}

void RunResume() {
  std::unique_ptr<RolloutClient> client = ConnectFromFlags();
  PrintResponse<rollout::v1::ResumeResponse>(client->Resume(), FormatResumeResult);
}

void RunReleaseMemory() {
  std::unique_ptr<RolloutClient> client = ConnectFromFlags();
  PrintResponse<rollout::v1::ReleaseMemoryResponse>(
      client->ReleaseMemory(absl::GetFlag(FLAGS_abort_in_flight), absl::GetFlag(FLAGS_weights)),
      FormatReleaseMemoryResult);
}

void RunResumeMemory() {
  std::unique_ptr<RolloutClient> client = ConnectFromFlags();
  PrintResponse<rollout::v1::ResumeMemoryResponse>(client->ResumeMemory(),
                                                   FormatResumeMemoryResult);
}

}  // namespace
}  // namespace rollout

int main(int argc, char** argv) {
  constexpr char kUsage[] =
      "Talks to a rollout server.\n"
      "Usage: rollout-cli [flags] COMMAND [flags]\n"
      "  generate  stream one rollout of --prompt (table at the end, or JSON lines with --json)\n"
      "            [--return_routing]\n"
      "  score     logprobs of --tokens from --start on, teacher-forced [--temperature, "
      "--top_logprobs,\n"
      "            --routing ids, --return_routing]\n"
      "  abort     end the rollouts of --request_ids a,b (or --all) in flight\n"
      "  flush     empty the server's prefix cache\n"
      "  info      print the server's model, limits, counters and cache hit rate\n"
      "  update-weights --from DIR --version V [--policy drain|abort|continue] [--chunk_mb N]\n"
      "                 [--streams N]\n"
      "            stream the checkpoint in the local DIR (of the served model: its config\n"
      "            and every tensor) to the server as weight version V\n"
      "  update-weights-from-path --path DIR --version V [--policy drain|abort|continue]\n"
      "            have the server load the checkpoint in DIR on its own disk\n"
      "  update-weights-from-ipc --ipc_tensors FILE --version V [--policy ...]\n"
      "            have the server copy a colocated process's GPU tensors (CUDA IPC handles)\n"
      "  pause [--abort_in_flight]  stop scheduling; new requests are held, not failed\n"
      "  resume    start scheduling again\n"
      "  release-memory [--weights] [--abort_in_flight]\n"
      "            give the KV cache's GPU memory (and the weights') back for a colocated "
      "trainer;\n"
      "            requests are held, running samples requeued (the same bits later)\n"
      "  resume-memory  take the memory back and serve again\n"
      "Mutual TLS: --tls_client_cert and --tls_client_key (with --tls_root_cert for the "
      "server's CA). The bearer token: --auth_token_file (or --auth_token).";
  std::vector<std::string> raw_args(argv, argv + argc);
  absl::StatusOr<std::vector<std::string>> rewritten =
      rollout::RewriteVersionFlag(raw_args, "weight_version");
  if (!rewritten.ok()) rollout::Fail(rewritten.status());
  std::vector<char*> rewritten_argv;
  for (std::string& arg : *rewritten) rewritten_argv.push_back(arg.data());
  rewritten_argv.push_back(nullptr);
  std::vector<char*> args = rollout::ParseCommandLine(static_cast<int>(rewritten->size()),
                                                      rewritten_argv.data(), kUsage, "cli_main.cc");
  constexpr char kCommands[] =
      "generate, score, abort, flush, info, update-weights, update-weights-from-path, "
      "update-weights-from-ipc, pause, resume, release-memory or resume-memory";
  if (args.size() != 2) {
    rollout::Fail(absl::InvalidArgumentError(
        absl::StrCat("expected exactly one command: ", kCommands, " (see --help)")));
  }
  const std::string command = args[1];
  // What each command reads (keep beside the Run* functions): a flag given to a command that
  // does not read it is named in a warning, not silently ignored. A warning, not an error, so
  // that scripts passing one set of flags to several commands (deploy/push-weights.sh's "--
  // FLAGS") keep working.
  const rollout::CommandFlagTable flags = {
      {"server", "json", "auth_token_file", "auth_token", "token", "timeout_s", "connect_timeout_s",
       "tls_root_cert", "tls_client_cert", "tls_client_key"},
      {{"generate",
        {"prompt", "samples", "seed", "temperature", "top_k", "top_p", "min_p", "max_new_tokens",
         "stop", "ignore_eos", "top_logprobs", "request_id", "return_routing"}},
       {"score", {"tokens", "start", "temperature", "top_logprobs", "routing", "return_routing"}},
       {"abort", {"request_ids", "all"}},
       {"update-weights", {"from", "version", "weight_version", "policy", "chunk_mb", "streams"}},
       {"update-weights-from-path", {"path", "version", "weight_version", "policy"}},
       {"update-weights-from-ipc", {"ipc_tensors", "version", "weight_version", "policy"}},
       {"pause", {"abort_in_flight"}},
       {"release-memory", {"weights", "abort_in_flight"}}}};
  // On the command line as typed, so that a warning names the spelling the user gave.
  if (const absl::Status applies = rollout::CheckFlagsApply(raw_args, command, flags);
      !applies.ok()) {
    std::cerr << "warning: " << applies.message() << std::endl;
  }
  if (command == "generate") {
    rollout::RunGenerate();
  } else if (command == "score") {
    rollout::RunScore();
  } else if (command == "abort") {
    rollout::RunAbort();
  } else if (command == "flush") {
    rollout::RunFlush();
  } else if (command == "info") {
    rollout::RunInfo();
  } else if (command == "update-weights") {
    rollout::RunUpdateWeights();
  } else if (command == "update-weights-from-path") {
    rollout::RunUpdateWeightsFromPath();
  } else if (command == "update-weights-from-ipc") {
    rollout::RunUpdateWeightsFromIpc();
  } else if (command == "pause") {
    rollout::RunPause();
  } else if (command == "resume") {
    rollout::RunResume();
  } else if (command == "release-memory") {
    rollout::RunReleaseMemory();
  } else if (command == "resume-memory") {
    rollout::RunResumeMemory();
  } else {
    rollout::Fail(absl::InvalidArgumentError(
        absl::StrCat("unknown command '", command, "'; expected ", kCommands)));
  }
  return 0;
}
