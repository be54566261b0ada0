#include "server/rollout_service.h"

#include <utility>

#include "absl/strings/str_format.h"
#include "server/generate_reactor.h"

namespace rollout {

RolloutServiceImpl::RolloutServiceImpl(Engine* engine, ServedModel model)
    : engine_(engine), model_(std::move(model)) {}

grpc::ServerWriteReactor<v1::GenerateResponse>* RolloutServiceImpl::Generate(
    grpc::CallbackServerContext* context, const v1::GenerateRequest* request) {
  return new GenerateReactor(this, request);
}

grpc::ServerUnaryReactor* RolloutServiceImpl::GetServerInfo(
    grpc::CallbackServerContext* context, const v1::GetServerInfoRequest* request,
    v1::ServerInfo* response) {
  const ModelConfig& c = engine_->model_config();
  v1::ModelInfo* m = response->mutable_model();
  m->set_architecture(c.architecture);
  m->set_num_layers(c.num_layers);
  m->set_hidden_size(c.hidden_size);
  m->set_vocab_size(c.vocab_size);
  m->set_max_context(static_cast<uint32_t>(engine_->max_context()));
  m->set_num_attention_heads(c.num_attention_heads);
  m->set_num_key_value_heads(c.num_key_value_heads);
  m->set_head_dim(c.head_dim);
  m->set_intermediate_size(c.intermediate_size);
  for (int32_t eos : c.eos_token_ids) m->add_eos_token_ids(static_cast<uint32_t>(eos));
  m->set_source(model_.source);
  response->set_weight_version(engine_->options().weight_version);
  response->set_backend(engine_->backend_name());
  v1::EngineLimits* l = response->mutable_limits();
  l->set_max_running_samples(engine_->options().max_running_samples);
  l->set_max_batch_tokens(engine_->options().max_batch_tokens);
  l->set_kv_block_size(engine_->kv_block_size());
  l->set_attention_split_size(engine_->attention_split_size());
  const EngineCounters counters = engine_->counters();
  v1::EngineCounters* k = response->mutable_counters();
  k->set_running_samples(counters.running);
  k->set_waiting_samples(counters.waiting);
  k->set_kv_blocks_free(counters.kv_blocks_free);
  k->set_kv_blocks_total(counters.kv_blocks_total);
  k->set_generated_tokens(counters.generated_tokens);
  k->set_prefilled_tokens(counters.prefilled_tokens);
  k->set_engine_steps(counters.steps);
  response->set_server_version(ROLLOUT_VERSION);
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

absl::Status RolloutServiceImpl::ClaimRequestIds(const std::vector<std::string>& ids) {
  std::lock_guard<std::mutex> lock(mu_);
  for (const std::string& id : ids) {
    if (in_flight_ids_.count(id) != 0) {
      return absl::AlreadyExistsError(absl::StrFormat(
          "request_id '%s' is already in flight; request ids must be unique among running "
          "requests",
          id));
    }
  }
  in_flight_ids_.insert(ids.begin(), ids.end());
  return absl::OkStatus();
}

void RolloutServiceImpl::ReleaseRequestIds(const std::vector<std::string>& ids) {
  std::lock_guard<std::mutex> lock(mu_);
  for (const std::string& id : ids) in_flight_ids_.erase(id);
}

}  // namespace rollout
