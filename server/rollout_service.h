#pragma once

#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "rollout/v1/rollout.grpc.pb.h"

namespace rollout {

// Facts about the served model that the engine does not know.
struct ServedModel {
  std::string source;  // checkpoint directory
};

// The RolloutService over one engine, on gRPC's callback API: every handler returns at once;
// work happens on the engine thread and results are written by reactors. Thread-safe.
class RolloutServiceImpl final : public v1::RolloutService::CallbackService {
 public:
  // `engine` is borrowed and must outlive the service and every call it started.
  RolloutServiceImpl(Engine* engine, ServedModel model);

  grpc::ServerWriteReactor<v1::GenerateResponse>* Generate(
      grpc::CallbackServerContext* context, const v1::GenerateRequest* request) override;
  grpc::ServerUnaryReactor* GetServerInfo(grpc::CallbackServerContext* context,
                                          const v1::GetServerInfoRequest* request,
                                          v1::ServerInfo* response) override;

  // Claims the request ids of a call; ALREADY_EXISTS if one is in flight already. Empty ids
  // are not tracked.
  absl::Status ClaimRequestIds(const std::vector<std::string>& ids);
  void ReleaseRequestIds(const std::vector<std::string>& ids);

  Engine* engine() const { return engine_; }

 private:
  Engine* const engine_;
  const ServedModel model_;
  std::mutex mu_;
  std::set<std::string> in_flight_ids_;  // guarded by mu_
};

}  // namespace rollout
