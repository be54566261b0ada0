#pragma once

#include "absl/status/status.h"
#include "grpcpp/support/status.h"

namespace rollout {

// absl and gRPC share the canonical status codes; this keeps code and message.
inline grpc::Status ToGrpcStatus(const absl::Status& status) {
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

}  // namespace rollout
