#include "client/rollout_client.h"

#include <algorithm>
#include <fstream>
#include <optional>
#include <random>
#include <sstream>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/weights_stream.h"

namespace rollout {
namespace {

using rollout::v1::GenerateRequest;
using rollout::v1::GenerateResponse;
using rollout::v1::TensorData;
using rollout::v1::UpdateWeightsResponse;
using rollout::v1::WeightsChunk;
using rollout::v1::WeightsHeader;

// The contents of a PEM file the options name; `what` says which one in errors. An empty file
// is refused: gRPC would silently treat an empty root PEM as "use the default roots" and an
// empty client cert as "no client cert", neither of which a caller naming a file asked for.
absl::StatusOr<std::string> ReadPemFile(const std::string& path, absl::string_view what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open ", what, " file ", path));
  std::ostringstream contents;
  contents << in.rdbuf();
  if (in.bad()) return absl::DataLossError(absl::StrCat("cannot read ", what, " file ", path));
  if (contents.str().empty()) {
    return absl::InvalidArgumentError(absl::StrCat(what, " file ", path, " is empty"));
  }
  return contents.str();
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeCredentials(
    const ClientOptions& options) {
  const bool has_cert = options.tls_client_cert_path.has_value();
  const bool has_key = options.tls_client_key_path.has_value();
  // Either alone fails the handshake later with an obscure message; say so now.
  if (has_cert != has_key) {
    return absl::InvalidArgumentError(
        has_cert ? "a TLS client certificate needs its private key as well (tls_client_key_path)"
                 : "a TLS client key needs its certificate as well (tls_client_cert_path)");
  }
  if (!options.tls_root_cert_path.has_value() && !has_cert) {
    return grpc::InsecureChannelCredentials();
  }
  grpc::SslCredentialsOptions ssl;
  if (options.tls_root_cert_path.has_value()) {
    absl::StatusOr<std::string> pem = ReadPemFile(*options.tls_root_cert_path, "TLS root cert");
    if (!pem.ok()) return pem.status();
    ssl.pem_root_certs = *std::move(pem);
  }
  if (has_cert) {
    absl::StatusOr<std::string> cert =
        ReadPemFile(*options.tls_client_cert_path, "TLS client cert");
    if (!cert.ok()) return cert.status();
    absl::StatusOr<std::string> key = ReadPemFile(*options.tls_client_key_path, "TLS client key");
    if (!key.ok()) return key.status();
    ssl.pem_cert_chain = *std::move(cert);
    ssl.pem_private_key = *std::move(key);
  }
  return grpc::SslCredentials(ssl);
}

}  // namespace

absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

absl::StatusOr<std::unique_ptr<RolloutClient>> RolloutClient::Connect(
    const std::string& target, const ClientOptions& options) {
  if (target.empty()) return absl::InvalidArgumentError("empty server address");
  if (options.connect_timeout.count() <= 0) {
    return absl::InvalidArgumentError("connect_timeout must be positive");
  }
  if (options.call_timeout.has_value() && options.call_timeout->count() <= 0) {
    return absl::InvalidArgumentError("call_timeout must be positive when set");
  }
  // -1 is gRPC's "unlimited"; 0 would reject every message.
  if (options.max_receive_message_bytes == 0 || options.max_receive_message_bytes < -1) {
    return absl::InvalidArgumentError("max_receive_message_bytes must be positive or -1");
  }
  absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> credentials = MakeCredentials(options);
  if (!credentials.ok()) return credentials.status();

  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(options.max_receive_message_bytes);
  std::shared_ptr<grpc::Channel> channel = grpc::CreateCustomChannel(target, *credentials, args);
  // Without this wait a wrong address only shows up as a vague failure of the first call.
  const auto deadline = std::chrono::system_clock::now() + options.connect_timeout;
  if (!channel->WaitForConnected(deadline)) {
    // A TLS mismatch looks the same as nothing listening: name what could be wrong.
    const char* hint =
        !options.tls_root_cert_path.has_value() && !options.tls_client_cert_path.has_value()
            ? "is a server listening there? (a server with TLS needs a TLS client: its CA's "
              "certificate, rollout-cli --tls_root_cert)"
        : !options.tls_client_cert_path.has_value()
            ? "is a TLS server listening there, with a certificate this CA signed? (a server "
              "that verifies clients needs a client certificate and key: --tls_client_cert, "
              "--tls_client_key)"
        : options.tls_root_cert_path.has_value()
            ? "is a TLS server listening there, with a certificate this CA signed, that trusts "
              "this client certificate's CA? (and is the key the certificate's?)"
            : "is a TLS server listening there, with a certificate the default roots trust (else "
              "give its CA: --tls_root_cert), that trusts this client certificate's CA? (and is "
              "the key the certificate's?)";
    return absl::UnavailableError(
        absl::StrFormat("could not connect to %s within %g s: %s", target,
                        std::chrono::duration<double>(options.connect_timeout).count(), hint));
  }
  return std::unique_ptr<RolloutClient>(
      new RolloutClient(target, options, *std::move(credentials), std::move(channel)));
}

RolloutClient::RolloutClient(std::string target, ClientOptions options,
                             std::shared_ptr<grpc::ChannelCredentials> credentials,
                             std::shared_ptr<grpc::Channel> channel)
    : target_(std::move(target)),
      options_(std::move(options)),
      credentials_(std::move(credentials)),
      channel_(std::move(channel)),
      stub_(rollout::v1::RolloutService::NewStub(channel_)) {}

void RolloutClient::PrepareContext(grpc::ClientContext* context) const {
  if (options_.call_timeout.has_value()) {
    context->set_deadline(std::chrono::system_clock::now() + *options_.call_timeout);
  }
  if (options_.bearer_token.has_value() && !options_.bearer_token->empty()) {
    // Plain metadata rather than grpc::AccessTokenCredentials: call credentials are refused on
    // insecure channels, and a loopback deployment may still want the token checked.
    context->AddMetadata("authorization", absl::StrCat("Bearer ", *options_.bearer_token));
  }
}

absl::Status RolloutClient::Generate(
    const GenerateRequest& request,
    const std::function<void(const GenerateResponse&)>& on_response) {
  grpc::ClientContext context;
  PrepareContext(&context);
  std::unique_ptr<grpc::ClientReader<GenerateResponse>> reader = stub_->Generate(&context, request);
  GenerateResponse response;
  while (reader->Read(&response)) {
    on_response(response);
  }
  return FromGrpcStatus(reader->Finish());
}

absl::StatusOr<GenerateResult> RolloutClient::GenerateAll(const GenerateRequest& request) {
  GenerateResult result;
  // The shape the server must fill: num_samples 0 means 1.
  result.completions.resize(request.rollouts_size());
  std::vector<std::vector<bool>> done(request.rollouts_size());
  for (int r = 0; r < request.rollouts_size(); ++r) {
    const uint32_t n = std::max<uint32_t>(1, request.rollouts(r).num_samples());
    result.completions[r].resize(n);
    done[r].assign(n, false);
  }
  auto in_range = [&](uint32_t rollout_index, uint32_t sample_index) {
    return rollout_index < done.size() && sample_index < done[rollout_index].size();
  };

  // The first protocol violation is kept and the rest of the stream drained, so that a server
  // error status (the likelier root cause) still wins over it.
  absl::Status violation;
  absl::Status stream_status = Generate(request, [&](const GenerateResponse& response) {
    if (!violation.ok()) return;
    switch (response.item_case()) {
      case GenerateResponse::kChunk: {
        const rollout::v1::TokenChunk& chunk = response.chunk();
        if (!in_range(chunk.rollout_index(), chunk.sample_index())) {
          violation = absl::InternalError(
              absl::StrFormat("chunk for rollout %d sample %d, outside the request",
                              chunk.rollout_index(), chunk.sample_index()));
        } else if (done[chunk.rollout_index()][chunk.sample_index()]) {
          violation = absl::InternalError(
              absl::StrFormat("chunk for rollout %d sample %d after its completion",
                              chunk.rollout_index(), chunk.sample_index()));
        } else {
          result.chunks.push_back(chunk);
        }
        return;
      }
      case GenerateResponse::kCompletion: {
        const rollout::v1::Completion& completion = response.completion();
        const uint32_t r = completion.rollout_index();
        const uint32_t s = completion.sample_index();
        if (!in_range(r, s)) {
          violation = absl::InternalError(
              absl::StrFormat("completion for rollout %d sample %d, outside the request", r, s));
        } else if (done[r][s]) {
          violation = absl::InternalError(
              absl::StrFormat("second completion for rollout %d sample %d", r, s));
        } else {
          done[r][s] = true;
          result.completions[r][s] = completion;
        }
        return;
      }
      case GenerateResponse::ITEM_NOT_SET:
        // A kind of item added to the API after this client was built: skipping it keeps old
        // clients working against newer servers.
        return;
    }
  });
  if (!stream_status.ok()) return stream_status;
  if (!violation.ok()) return violation;
  for (size_t r = 0; r < done.size(); ++r) {
    for (size_t s = 0; s < done[r].size(); ++s) {
      if (!done[r][s]) {
        return absl::InternalError(
            absl::StrFormat("stream ended OK without a completion for rollout %d sample %d", r, s));
      }
    }
  }
  return result;
}

template <typename Request, typename Response>
absl::StatusOr<Response> RolloutClient::CallUnary(
    grpc::Status (rollout::v1::RolloutService::Stub::*method)(grpc::ClientContext*, const Request&,
                                                              Response*),
    const Request& request) {
  grpc::ClientContext context;
  PrepareContext(&context);
  Response response;
  grpc::Status status = (stub_.get()->*method)(&context, request, &response);
  if (!status.ok()) return FromGrpcStatus(status);
  return response;
}

absl::StatusOr<rollout::v1::ServerInfo> RolloutClient::GetServerInfo() {
  return CallUnary(&rollout::v1::RolloutService::Stub::GetServerInfo,
                   rollout::v1::GetServerInfoRequest());
}

absl::StatusOr<rollout::v1::ScoreResponse> RolloutClient::Score(
    const rollout::v1::ScoreRequest& request) {
  return CallUnary(&rollout::v1::RolloutService::Stub::Score, request);
}

absl::StatusOr<rollout::v1::AbortResponse> RolloutClient::Abort(
    const rollout::v1::AbortRequest& request) {
  return CallUnary(&rollout::v1::RolloutService::Stub::Abort, request);
}

absl::StatusOr<rollout::v1::FlushCacheResponse> RolloutClient::FlushCache() {
  return CallUnary(&rollout::v1::RolloutService::Stub::FlushCache,
                   rollout::v1::FlushCacheRequest());
}

absl::StatusOr<UpdateWeightsResponse> RolloutClient::UpdateWeights(
    const WeightsHeader& header, const std::function<bool(TensorData*)>& next_chunk) {
  grpc::ClientContext context;
  PrepareContext(&context);
  UpdateWeightsResponse response;
  std::unique_ptr<grpc::ClientWriter<WeightsChunk>> writer =
      stub_->UpdateWeights(&context, &response);

  // One message reused for every chunk, so a chunk's buffer is allocated once, not per chunk.
  WeightsChunk message;
  *message.mutable_header() = header;
  bool write_ok = writer->Write(message);
  TensorData* data = message.mutable_data();  // drops the header
  while (write_ok) {
    data->Clear();
    if (!next_chunk(data)) break;
    write_ok = writer->Write(message);
  }
  // A failed write means the call has ended, nearly always because the server answered early
  // with an error; Finish returns that answer. Half-closing first lets the server see the end
  // of a complete stream.
  if (write_ok) writer->WritesDone();
  grpc::Status status = writer->Finish();
  if (!status.ok()) return FromGrpcStatus(status);
  if (!write_ok) {
    // Not expected from a correct server: it must read the whole stream before answering OK.
    return absl::InternalError(
        "the server answered OK before the whole update stream was sent; the update may be "
        "incomplete");
  }
  return response;
}

std::vector<std::vector<size_t>> SplitByBytes(const std::vector<uint64_t>& nbytes, int parts) {
  const size_t count = std::min<size_t>(std::max(parts, 1), std::max<size_t>(nbytes.size(), 1));
  std::vector<size_t> order(nbytes.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return nbytes[a] > nbytes[b]; });
  std::vector<std::vector<size_t>> split(count);
  std::vector<uint64_t> load(count, 0);
  for (size_t i : order) {
    const size_t lightest = std::min_element(load.begin(), load.end()) - load.begin();
    split[lightest].push_back(i);
    load[lightest] += nbytes[i];
  }
  for (std::vector<size_t>& part : split) std::sort(part.begin(), part.end());
  return split;
}

absl::StatusOr<std::shared_ptr<grpc::Channel>> RolloutClient::OwnConnection() const {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(options_.max_receive_message_bytes);
  // Channels with equal arguments share gRPC's global subchannel pool, so one connection; a
  // local pool gives this channel its own.
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  std::shared_ptr<grpc::Channel> channel = grpc::CreateCustomChannel(target_, credentials_, args);
  if (!channel->WaitForConnected(std::chrono::system_clock::now() + options_.connect_timeout)) {
    return absl::UnavailableError(
        absl::StrFormat("could not open another connection to %s within %g s", target_,
                        std::chrono::duration<double>(options_.connect_timeout).count()));
  }
  return channel;
}

absl::StatusOr<UpdateWeightsResponse> RolloutClient::StreamTensors(
    const std::shared_ptr<grpc::Channel>& channel, grpc::ClientContext* context,
    client_internal::SliceTracker* tracker, const WeightsHeader& header,
    const std::vector<TensorSource>& tensors, const std::vector<size_t>& indices,
    size_t chunk_bytes, const UploadProgress& progress, uint64_t total, uint64_t* sent,
    std::mutex* progress_mu) {
  size_t next = 0;      // into indices: the tensor being sent
  uint64_t offset = 0;  // next byte of it
  uint64_t handed = 0;  // bytes handed out by the last call; written, since we are called again
  // The chunks' bytes go to gRPC where they are, not copied into messages (weights_stream.h).
  return client_internal::StreamUpdateWeights(
      channel, context, tracker, header, [&](client_internal::RawChunk* chunk) {
        if (handed > 0) {
          std::lock_guard<std::mutex> lock(*progress_mu);
          *sent += handed;
          if (progress) progress(*sent, total);
          handed = 0;
        }
        // Tensors of zero bytes are declared but get no chunk: the server refuses empty chunks.
        while (next < indices.size() && offset >= tensors[indices[next]].nbytes) {
          ++next;
          offset = 0;
        }
        if (next == indices.size()) return false;
        const TensorSource& tensor = tensors[indices[next]];
        const size_t n =
            static_cast<size_t>(std::min<uint64_t>(chunk_bytes, tensor.nbytes - offset));
        chunk->name = tensor.name;
        chunk->offset = offset;
        chunk->data = tensor.data + offset;
        chunk->size = n;
        offset += n;
        handed = n;
        return true;
      });
}

absl::StatusOr<UpdateWeightsResponse> RolloutClient::UpdateWeightsFromTensors(
    const std::string& version, rollout::v1::InFlightPolicy policy,
    const std::vector<TensorSource>& tensors, size_t chunk_bytes, const UploadProgress& progress,
    int streams) {
  if (chunk_bytes == 0 || chunk_bytes > kMaxWeightsChunkBytes) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "a chunk of %u bytes: give 1 to %u (63 MiB: the server takes messages of up to 64 MiB, "
        "a chunk's fields included)",
        chunk_bytes, kMaxWeightsChunkBytes));
  }
  if (streams < 1 || streams > kMaxWeightsStreams) {
    return absl::InvalidArgumentError(
        absl::StrFormat("streams is %d; give 1 to %d (the server takes up to %d parts)", streams,
                        kMaxWeightsStreams, kMaxWeightsStreams));
  }
  uint64_t total = 0;
  std::vector<uint64_t> nbytes;
  for (const TensorSource& tensor : tensors) {
    if (tensor.data == nullptr && tensor.nbytes > 0) {
      return absl::InvalidArgumentError(
          absl::StrFormat("tensor '%s' has %d bytes but no data", tensor.name, tensor.nbytes));
    }
    total += tensor.nbytes;
    nbytes.push_back(tensor.nbytes);
  }
  const std::vector<std::vector<size_t>> split = SplitByBytes(nbytes, streams);
  const int parts = static_cast<int>(split.size());
  // A new name for every attempt, so that a stray part of an earlier one never joins this one.
  std::random_device random;
  const std::string update_id =
      absl::StrFormat("%s/%08x%08x", version.substr(0, 64), random(), random());
  std::vector<WeightsHeader> headers(parts);
  for (int p = 0; p < parts; ++p) {
    headers[p].set_version(version);
    headers[p].set_policy(policy);
    if (parts > 1) {
      headers[p].set_update_id(update_id);
      headers[p].set_part_index(p);
      headers[p].set_part_count(parts);
    }
    for (size_t i : split[p]) {
      rollout::v1::TensorDecl* decl = headers[p].add_tensors();
      decl->set_name(tensors[i].name);
      decl->set_dtype(tensors[i].dtype);
      decl->mutable_shape()->Add(tensors[i].shape.begin(), tensors[i].shape.end());
    }
  }
  // Stream 0 on the client's channel, every other on a connection of its own.
  std::vector<std::shared_ptr<grpc::Channel>> channels = {channel_};
  for (int p = 1; p < parts; ++p) {
    absl::StatusOr<std::shared_ptr<grpc::Channel>> channel = OwnConnection();
    if (!channel.ok()) return channel.status();
    channels.push_back(*std::move(channel));
  }

  std::mutex progress_mu;
  uint64_t sent = 0;
  if (progress) progress(0, total);
  client_internal::SliceTracker tracker;
  std::vector<absl::StatusOr<UpdateWeightsResponse>> results(parts, absl::UnknownError("not sent"));
  std::mutex failure_mu;
  std::optional<absl::Status> first_failure;  // guarded by failure_mu
  {
    std::vector<grpc::ClientContext> contexts(parts);
    for (grpc::ClientContext& context : contexts) PrepareContext(&context);
    auto run_part = [&](int p) {
      results[p] = StreamTensors(channels[p], &contexts[p], &tracker, headers[p], tensors, split[p],
                                 chunk_bytes, progress, total, &sent, &progress_mu);
      if (results[p].ok()) return;
      std::lock_guard<std::mutex> lock(failure_mu);
      if (first_failure.has_value()) return;
      first_failure = results[p].status();
      // The server fails every part anyway; the others need not send on.
      for (int q = 0; q < parts; ++q) {
        if (q != p) contexts[q].TryCancel();
      }
    };
    std::vector<std::thread> threads;
    for (int p = 1; p < parts; ++p) threads.emplace_back(run_part, p);
    run_part(0);
    for (std::thread& t : threads) t.join();
  }
  // The calls are gone with their contexts, and gRPC with them lets go of the slices over
  // chunks it had not sent; after this the caller's bytes are free.
  tracker.WaitForNone();
  if (first_failure.has_value()) return *first_failure;
  return results[0];
}

absl::StatusOr<UpdateWeightsResponse> RolloutClient::UpdateWeightsFromPath(
    const rollout::v1::UpdateWeightsFromPathRequest& request) {
  return CallUnary(&rollout::v1::RolloutService::Stub::UpdateWeightsFromPath, request);
}

absl::StatusOr<UpdateWeightsResponse> RolloutClient::UpdateWeightsFromIpc(
    const rollout::v1::UpdateWeightsFromIpcRequest& request) {
  return CallUnary(&rollout::v1::RolloutService::Stub::UpdateWeightsFromIpc, request);
}

absl::StatusOr<rollout::v1::PauseResponse> RolloutClient::Pause(bool abort_in_flight) {
  rollout::v1::PauseRequest request;
  request.set_abort_in_flight(abort_in_flight);
  return CallUnary(&rollout::v1::RolloutService::Stub::Pause, request);
}

absl::StatusOr<rollout::v1::ResumeResponse> RolloutClient::Resume() {
  return CallUnary(&rollout::v1::RolloutService::Stub::Resume, rollout::v1::ResumeRequest());
}

absl::StatusOr<rollout::v1::ReleaseMemoryResponse> RolloutClient::ReleaseMemory(
    bool abort_in_flight, bool weights) {
  rollout::v1::ReleaseMemoryRequest request;
  request.set_abort_in_flight(abort_in_flight);
  request.set_weights(weights);
  return CallUnary(&rollout::v1::RolloutService::Stub::ReleaseMemory, request);
}

absl::StatusOr<rollout::v1::ResumeMemoryResponse> RolloutClient::ResumeMemory() {
  return CallUnary(&rollout::v1::RolloutService::Stub::ResumeMemory,
                   rollout::v1::ResumeMemoryRequest());
}

}  // namespace rollout
