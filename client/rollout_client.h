#pragma once

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "rollout/v1/rollout.grpc.pb.h"
#include "rollout/v1/rollout.pb.h"

namespace rollout {
namespace client_internal {
class SliceTracker;  // client/weights_stream.h
}  // namespace client_internal

inline constexpr int kDefaultMaxReceiveMessageBytes = 256 * 1024 * 1024;

struct ClientOptions {
  // Connect() blocks until the channel is ready or this elapses, so that a wrong address fails
  // at once with a clear message instead of on the first call.
  std::chrono::milliseconds connect_timeout{10'000};
  // Deadline of every RPC, measured from its start; unset = no deadline. Long generations can
  // legitimately take minutes, so there is none by default.
  std::optional<std::chrono::milliseconds> call_timeout;
  // A Generate stream carries one sample's chunk per message, but a Completion with many
  // top-logprobs can be large; gRPC's 4 MiB default is too small for that.
  int max_receive_message_bytes = kDefaultMaxReceiveMessageBytes;
  // Sent as "authorization: Bearer <token>" metadata on every call when set and not empty.
  std::optional<std::string> bearer_token;
  // PEM file of the root certificates to trust; when set the channel uses TLS, else plaintext.
  std::optional<std::string> tls_root_cert_path;
  // Mutual TLS: PEM files of this client's certificate chain and its private key, presented to
  // a server that verifies clients. Set both or neither. Setting them also turns TLS on; the
  // server is then checked against tls_root_cert_path, or gRPC's default roots when unset.
  std::optional<std::string> tls_client_cert_path;
  std::optional<std::string> tls_client_key_path;
};

// 4 MiB: measured fastest over loopback (docs/benchmarks.md: 110-267 MB/s with 1-8 MiB chunks,
// 30-57 MB/s with 32 MiB ones, whose messages gRPC copies and flow-controls in one piece); far
// under the server's 64 MiB message limit.
inline constexpr size_t kDefaultWeightsChunkBytes = size_t{4} << 20;
// The most tensor bytes one chunk may carry: the server takes messages of up to 64 MiB, and a
// chunk's fields add a few bytes (the Python client's bound too).
inline constexpr size_t kMaxWeightsChunkBytes = size_t{63} << 20;
// The most streams (parts) one update may be spread over: the server takes up to 64 parts.
inline constexpr int32_t kMaxWeightsStreams = 64;

// One tensor to upload, borrowed from memory the caller keeps alive during the call.
struct TensorSource {
  std::string name;
  std::string dtype;  // "BF16", "F16" or "F32"
  std::vector<uint64_t> shape;
  const uint8_t* data = nullptr;  // row-major, little-endian
  size_t nbytes = 0;
};

// Called with the bytes written to the stream so far and the total to write; once with
// (0, total) before the first chunk and once with (total, total) after the last.
using UploadProgress = std::function<void(uint64_t sent_bytes, uint64_t total_bytes)>;

// Everything a Generate stream delivered, arranged by sample.
struct GenerateResult {
  // completions[rollout_index][sample_index]; every sample of the request has exactly one.
  std::vector<std::vector<rollout::v1::Completion>> completions;
  // Every chunk in arrival order (none when the request's StreamOptions ask for completions
  // only; fewer, longer ones when they coalesce).
  std::vector<rollout::v1::TokenChunk> chunks;
};

// The tensors (indices into `nbytes`) of each of at most `parts` parts of a multi-stream update,
// balanced by bytes and deterministic: largest first (ties by index), each into the part with the
// fewest bytes so far (ties: the lowest part), then each part's tensors in index order. Never an
// empty part: fewer parts than tensors when there are fewer tensors.
std::vector<std::vector<size_t>> SplitByBytes(const std::vector<uint64_t>& nbytes, int parts);

// Same code, same message: gRPC and Abseil share the canonical status code numbering.
absl::Status FromGrpcStatus(const grpc::Status& status);

// A client of rollout.v1.RolloutService. Thread-safe: the channel and stub are, and every call
// uses its own ClientContext.
class RolloutClient {
 public:
  static absl::StatusOr<std::unique_ptr<RolloutClient>> Connect(const std::string& target,
                                                                const ClientOptions& options);

  RolloutClient(const RolloutClient&) = delete;
  RolloutClient& operator=(const RolloutClient&) = delete;

  // Calls on_response for every streamed message, in order, on the calling thread; returns the
  // final status of the stream with the server's code and message intact.
  absl::Status Generate(
      const rollout::v1::GenerateRequest& request,
      const std::function<void(const rollout::v1::GenerateResponse&)>& on_response);

  // Runs Generate to the end and arranges what came back. INTERNAL when the stream broke the
  // protocol: a sample with no or several completions, an index outside the request, or a
  // chunk after its sample's completion. Messages of an unknown kind are skipped.
  absl::StatusOr<GenerateResult> GenerateAll(const rollout::v1::GenerateRequest& request);

  absl::StatusOr<rollout::v1::ServerInfo> GetServerInfo();

  // The unary calls below return the server's status unchanged, UNIMPLEMENTED included (what a
  // server predating them answers), so callers can tell "not supported" from a real failure.

  // Teacher-forced logprobs of given sequences.
  absl::StatusOr<rollout::v1::ScoreResponse> Score(const rollout::v1::ScoreRequest& request);

  // Ends in-flight rollouts; their Generate streams get FINISH_REASON_ABORT completions.
  absl::StatusOr<rollout::v1::AbortResponse> Abort(const rollout::v1::AbortRequest& request);

  // Empties the server's prefix cache.
  absl::StatusOr<rollout::v1::FlushCacheResponse> FlushCache();

  // Streams `header`, then one TensorData per next_chunk call that returns true (next_chunk
  // fills the empty message it is given), then ends the stream and returns the server's answer.
  // When a write fails because the server ended the call early (it rejected the header or a
  // chunk), no more chunks are asked for and the server's status is returned unchanged.
  absl::StatusOr<rollout::v1::UpdateWeightsResponse> UpdateWeights(
      const rollout::v1::WeightsHeader& header,
      const std::function<bool(rollout::v1::TensorData*)>& next_chunk);

  // UpdateWeights of in-memory tensors: declares them all in the header, then sends every byte
  // exactly once, tensor by tensor in the given order, in chunks of at most chunk_bytes (which
  // never span two tensors). INVALID_ARGUMENT, before anything is sent, for chunk_bytes 0 or
  // above kMaxWeightsChunkBytes, or a tensor without data. progress, when set, is called as
  // documented at UploadProgress.
  //
  // streams > 1 spreads the update over that many concurrent calls (docs/api.md, "One update
  // over several streams"), each on a channel of its own, so on its own TCP connection: one
  // HTTP/2 connection is what limits one stream. The tensors are split by bytes (SplitByBytes);
  // the server swaps once, when every part arrived, and every part's answer is the same. When a
  // part fails the server fails them all; this returns the first failure (the others, cancelled
  // here, say CANCELLED). progress is then called from the parts' threads, one at a time.
  absl::StatusOr<rollout::v1::UpdateWeightsResponse> UpdateWeightsFromTensors(
      const std::string& version, rollout::v1::InFlightPolicy policy,
      const std::vector<TensorSource>& tensors, size_t chunk_bytes = kDefaultWeightsChunkBytes,
      const UploadProgress& progress = nullptr, int streams = 1);

  // The server loads a safetensors checkpoint from its own disk.
  absl::StatusOr<rollout::v1::UpdateWeightsResponse> UpdateWeightsFromPath(
      const rollout::v1::UpdateWeightsFromPathRequest& request);

  // A colocated trainer's device tensors by CUDA IPC handle (the caller keeps them alive and
  // unchanged until this returns): the server copies them device to device.
  absl::StatusOr<rollout::v1::UpdateWeightsResponse> UpdateWeightsFromIpc(
      const rollout::v1::UpdateWeightsFromIpcRequest& request);

  // Stops scheduling (arriving requests are held, not failed); with abort_in_flight, running
  // samples also end with FINISH_REASON_ABORT. Resume starts scheduling again. Both say whether
  // the server was paused before the call.
  absl::StatusOr<rollout::v1::PauseResponse> Pause(bool abort_in_flight);
  absl::StatusOr<rollout::v1::ResumeResponse> Resume();

  // Colocated memory: the server gives the KV cache's memory (and with `weights` the weights')
  // back to the GPU and holds new requests; samples in flight are requeued (recomputed later,
  // the same bits) or, with abort_in_flight, aborted. ResumeMemory takes it back
  // (RESOURCE_EXHAUSTED when the GPU lacks it: the server stays released, retry).
  absl::StatusOr<rollout::v1::ReleaseMemoryResponse> ReleaseMemory(bool abort_in_flight,
                                                                   bool weights);
  absl::StatusOr<rollout::v1::ResumeMemoryResponse> ResumeMemory();

  const std::string& target() const { return target_; }

 private:
  RolloutClient(std::string target, ClientOptions options,
                std::shared_ptr<grpc::ChannelCredentials> credentials,
                std::shared_ptr<grpc::Channel> channel);

  // Applies the per-call deadline and the bearer token.
  void PrepareContext(grpc::ClientContext* context) const;

  // One unary RPC through a stub method with a fresh, prepared context, so that every unary
  // call gets the same deadline, token and status handling.
  template <typename Request, typename Response>
  absl::StatusOr<Response> CallUnary(grpc::Status (rollout::v1::RolloutService::Stub::*method)(
                                         grpc::ClientContext*, const Request&, Response*),
                                     const Request& request);

  // One part of UpdateWeightsFromTensors: `header` and the bytes of `tensors[indices]`, on
  // `channel`, through `context` (prepared), the chunks' slices registered with `tracker`
  // (client_internal::StreamUpdateWeights); *sent counts the bytes written (guarded by
  // progress_mu, as the progress calls are).
  absl::StatusOr<rollout::v1::UpdateWeightsResponse> StreamTensors(
      const std::shared_ptr<grpc::Channel>& channel, grpc::ClientContext* context,
      client_internal::SliceTracker* tracker, const rollout::v1::WeightsHeader& header,
      const std::vector<TensorSource>& tensors, const std::vector<size_t>& indices,
      size_t chunk_bytes, const UploadProgress& progress, uint64_t total, uint64_t* sent,
      std::mutex* progress_mu);
  // A new channel to the server with a connection of its own; UNAVAILABLE if it does not connect
  // within the connect timeout.
  absl::StatusOr<std::shared_ptr<grpc::Channel>> OwnConnection() const;

  const std::string target_;
  const ClientOptions options_;
  const std::shared_ptr<grpc::ChannelCredentials> credentials_;
  const std::shared_ptr<grpc::Channel> channel_;
  const std::unique_ptr<rollout::v1::RolloutService::Stub> stub_;
};

}  // namespace rollout
