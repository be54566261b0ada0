#pragma once

#include <chrono>

#include "absl/status/status.h"
#include "grpcpp/server_context.h"
#include "grpcpp/support/status.h"

namespace rollout {

// absl and gRPC share the canonical status codes; this keeps code and message.
inline grpc::Status ToGrpcStatus(const absl::Status& status) {
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

// Whether the caller gave up on a call the server is still working on: cancelled, or past its
// deadline by the server's own clock (so that a long load stops at its next check whenever the
// transport delivers the cancellation).
inline bool CallerGaveUp(const grpc::CallbackServerContext* context) {
  return context->IsCancelled() || std::chrono::system_clock::now() >= context->deadline();
}

}  // namespace rollout
