#include "server/rollout_service.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <optional>
#include <set>
#include <thread>
#include <utility>

#include "absl/strings/str_format.h"
#include "common/build_info.h"
#include "glog/logging.h"
#include "server/generate_reactor.h"
#include "server/score_reactor.h"
#include "server/status_util.h"
#include "server/update_weights_reactor.h"
#include "server/weights_staging.h"

namespace rollout {

// One worker thread that runs checkpoint loads in the order they were posted. One is enough:
// the update slot admits one update at a time. Reused for every load, so a server that takes a
// checkpoint path every training step keeps one thread, not one per update. Thread-safe.
RolloutServiceImpl::RolloutServiceImpl(Engine* engine, ServedModel model, AccessPolicy access,
                                       ServiceMetrics* metrics, int64_t max_unfinished_samples,
                                       StreamLimits stream_limits, UpdateLimits update_limits)
    : engine_(engine),
      model_(std::move(model)),
      access_(std::move(access)),
      metrics_(metrics),
      max_unfinished_samples_(max_unfinished_samples),
      stream_limits_(stream_limits),
      weights_arena_(engine->weight_specs(),
                     [engine](size_t bytes) { return engine->AllocateHostStaging(bytes); }),
      loader_(std::make_unique<SerialExecutor>()),
      update_limits_(update_limits) {}

void RolloutServiceImpl::StopAdmission() { admitting_ = false; }

absl::Status RolloutServiceImpl::CheckAdmission() const {
  if (admitting_) return absl::OkStatus();
  return absl::UnavailableError(
      "the server is shutting down and takes no new work; retry on another replica");
}

RolloutServiceImpl::~RolloutServiceImpl() {
  // Before the members a load touches (mu_, the update slot) go away.
  loader_.reset();
}

absl::StatusOr<CallerScope> RolloutServiceImpl::Authenticate(
    const grpc::CallbackServerContext* context, bool control) const {
  if (access_.bearer_token.empty()) return CallerScope::kTrusted;
  const auto& metadata = context->client_metadata();
  auto it = metadata.find("authorization");
  absl::Status denied;
  if (it == metadata.end()) {
    denied = absl::UnauthenticatedError(
        "this call needs 'authorization: Bearer <token>' metadata (the server was started with "
        "a token)");
  } else {
    const std::string given(it->second.data(), it->second.size());
    const std::string expected = "Bearer " + access_.bearer_token;
    // Constant time in the token's content, so timing does not reveal a matching prefix.
    unsigned char diff = given.size() == expected.size() ? 0 : 1;
    for (size_t i = 0; i < expected.size(); ++i) {
      diff |= static_cast<unsigned char>(expected[i] ^ (i < given.size() ? given[i] : 0));
    }
    if (diff == 0) return CallerScope::kTrusted;
    denied = absl::UnauthenticatedError("the bearer token is not valid");
  }
  if (control || access_.all_rpcs) return denied;
  return CallerScope::kAnonymous;
}

absl::Status RolloutServiceImpl::CheckAccess(const grpc::CallbackServerContext* context,
                                             bool control) const {
  return Authenticate(context, control).status();
}

absl::Status RolloutServiceImpl::ClaimUpdateSlot() {
  std::lock_guard<std::mutex> lock(mu_);
  if (update_in_progress_) {
    return absl::AbortedError(
        "another weight update is in progress; one update at a time (retry when it ends)");
  }
  update_in_progress_ = true;
  return absl::OkStatus();
}

void RolloutServiceImpl::ReleaseUpdateSlot() {
  std::lock_guard<std::mutex> lock(mu_);
  update_in_progress_ = false;
}

namespace {

constexpr size_t kEndedUpdatesKept = 16;

}  // namespace

absl::StatusOr<std::shared_ptr<UpdateAssembly>> RolloutServiceImpl::JoinUpdate(
    const v1::WeightsHeader& header) {
  const bool multi_part = header.part_count() > 1;
  std::lock_guard<std::mutex> lock(mu_);
  if (multi_part && assembly_ != nullptr && assembly_->update_id() == header.update_id()) {
    return assembly_;
  }
  if (update_in_progress_) {
    if (assembly_ != nullptr && assembly_->part_count() > 1) {
      return absl::AbortedError(absl::StrFormat(
          "another weight update (update_id '%s', %d of %d parts so far) is in progress; one "
          "update at a time (retry when it ends)",
          assembly_->update_id(), assembly_->parts_joined(), assembly_->part_count()));
    }
    return absl::AbortedError(
        "another weight update is in progress; one update at a time (retry when it ends)");
  }
  if (multi_part) {
    for (const auto& [id, outcome] : ended_updates_) {
      if (id != header.update_id()) continue;
      // A late part of a failed update hears why, with the failure's code.
      if (!outcome.ok()) {
        return absl::Status(outcome.code(), absl::StrFormat("update '%s' has ended already: %s", id,
                                                            outcome.message()));
      }
      return absl::AbortedError(absl::StrFormat(
          "update '%s' has ended already (applied); send a new update under a new update_id", id));
    }
  }
  update_in_progress_ = true;
  assembly_ = std::make_shared<UpdateAssembly>(this, multi_part ? header.update_id() : "",
                                               multi_part ? header.part_count() : 1);
  if (multi_part) assembly_->ArmPartTimeout(update_limits_.part_timeout);
  return assembly_;
}

bool RolloutServiceImpl::FailUpdatePart(const v1::WeightsHeader& header,
                                        const absl::Status& status) {
  if (header.part_count() <= 1 || !CheckPartFields(header).ok()) return false;
  const absl::Status failure(
      status.code(), absl::StrFormat("part %d of the %d of update '%s': %s", header.part_index(),
                                     header.part_count(), header.update_id(), status.message()));
  std::shared_ptr<UpdateAssembly> assembly;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (assembly_ != nullptr && assembly_->update_id() == header.update_id()) {
      assembly = assembly_;
    } else {
      // An update that ended already (a sibling refused alike, or a retry of an applied one)
      // keeps its first outcome, which JoinUpdate tells its late parts, and is counted once.
      for (const auto& [id, outcome] : ended_updates_) {
        if (id == header.update_id()) return true;
      }
      ended_updates_.emplace_back(header.update_id(), failure);
      if (ended_updates_.size() > kEndedUpdatesKept) ended_updates_.pop_front();
    }
  }
  if (assembly != nullptr) {
    assembly->Fail(nullptr, failure);  // counts the failure, unless the update ended already
  } else if (metrics_ != nullptr) {
    metrics_->RecordUpdate(0, false);  // no part joined: nothing was received
  }
  return true;
}

void RolloutServiceImpl::EndUpdate(const UpdateAssembly* assembly, absl::StatusCode code,
                                   const std::string& message) {
  std::shared_ptr<UpdateAssembly> ended;  // destroyed outside the lock
  std::lock_guard<std::mutex> lock(mu_);
  if (assembly_.get() != assembly) return;
  ended = std::move(assembly_);
  update_in_progress_ = false;
  if (assembly->part_count() > 1) {
    ended_updates_.emplace_back(assembly->update_id(), absl::Status(code, message));
    if (ended_updates_.size() > kEndedUpdatesKept) ended_updates_.pop_front();
  }
}

namespace {

// A unary reactor finished at once with an access error, or nullptr when access is granted.
grpc::ServerUnaryReactor* DenyUnless(const absl::Status& access,
                                     grpc::CallbackServerContext* context) {
  if (access.ok()) return nullptr;
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(ToGrpcStatus(access));
  return reactor;
}

}  // namespace

grpc::ServerReadReactor<grpc::ByteBuffer>* RolloutServiceImpl::UpdateWeights(
    grpc::CallbackServerContext* context, grpc::ByteBuffer* response) {
  // The update slot is claimed by the header (JoinUpdate): the parts of one update share it.
  return new UpdateWeightsReactor(this, context, response, CheckAccess(context, /*control=*/true));
}

grpc::ServerUnaryReactor* RolloutServiceImpl::UpdateWeightsFromPath(
    grpc::CallbackServerContext* context, const v1::UpdateWeightsFromPathRequest* request,
    v1::UpdateWeightsResponse* response) {
  absl::Status admission = CheckAccess(context, /*control=*/true);
  if (admission.ok()) admission = CheckPolicy(request->policy(), "policy");
  if (admission.ok()) admission = ClaimUpdateSlot();
  if (grpc::ServerUnaryReactor* denied = DenyUnless(admission, context)) return denied;
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  // Reading a checkpoint can take minutes; it runs on the loader thread, not a gRPC one. The
  // context and response live until reactor->Finish, which only this load calls.
  loader_->Post([this, context, reactor, response, path = request->path(),
                 version = request->version(), policy = request->policy()] {
    if (CallerGaveUp(context)) {
      ReleaseUpdateSlot();
      reactor->Finish(grpc::Status(
          grpc::StatusCode::CANCELLED,
          "the call was cancelled (or past its deadline) before the checkpoint was read; "
          "nothing was applied"));
      return;
    }
    const auto start = std::chrono::steady_clock::now();
    // The caller's deadline and cancel (and a shutdown, which cancels every call) stop the read
    // between two bounded reads, so the slot is never held for a caller that gave up.
    CheckpointLoadTimes times;
    absl::StatusOr<WeightUpdate> update = LoadUpdateFromCheckpoint(
        engine_->weight_specs(), &engine_->model_config(), &weights_arena_, path, version,
        FromProto(policy), [context] { return CallerGaveUp(context); }, &times);
    if (!update.ok()) {
      LOG(WARNING) << "weight update from path '" << path << "' failed: " << update.status();
      if (metrics_ != nullptr) metrics_->RecordUpdate(0, false);
      ReleaseUpdateSlot();
      reactor->Finish(ToGrpcStatus(update.status()));
      return;
    }
    uint64_t bytes = 0;
    for (const HostTensorView& t : update->tensors) bytes += t.nbytes;
    response->set_version(update->version);
    response->set_tensors_updated(static_cast<uint32_t>(update->tensors.size()));
    response->set_bytes_received(bytes);
    response->set_digest_wait_seconds(times.digest_seconds);
    response->set_staging_setup_seconds(times.setup_seconds);
    response->set_receive_seconds(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() -
        times.digest_seconds);
    const auto swap_start = std::chrono::steady_clock::now();
    engine_->UpdateWeights(
        *std::move(update),
        [this, reactor, response, swap_start](UpdateResult r) {
          response->set_previous_version(r.previous_version);
          response->set_weight_digest(r.digest);
          response->set_aborted_samples(static_cast<uint32_t>(r.aborted_samples));
          response->set_swap_seconds(
              std::chrono::duration<double>(std::chrono::steady_clock::now() - swap_start).count());
          response->set_engine_wait_seconds(r.wait_seconds);
          response->set_device_copy_seconds(r.copy_seconds);
          if (metrics_ != nullptr) {
            metrics_->RecordUpdate(response->receive_seconds() + response->digest_wait_seconds() +
                                       response->swap_seconds(),
                                   r.status.ok());
          }
          if (!r.status.ok()) {
            LOG(WARNING) << "weight update to '" << response->version() << "' failed: " << r.status;
          }
          ReleaseUpdateSlot();
          reactor->Finish(ToGrpcStatus(r.status));
        },
        // A caller that gave up (deadline, cancel) before the swap gets nothing applied.
        [context] { return CallerGaveUp(context); });
  });
  return reactor;
}

grpc::ServerUnaryReactor* RolloutServiceImpl::Pause(grpc::CallbackServerContext* context,
                                                    const v1::PauseRequest* request,
                                                    v1::PauseResponse* response) {
  if (auto* denied = DenyUnless(CheckAccess(context, true), context)) return denied;
  const absl::StatusOr<bool> was = engine_->Pause(request->abort_in_flight());
  if (auto* denied = DenyUnless(was.status(), context)) return denied;
  response->set_was_paused(*was);
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerUnaryReactor* RolloutServiceImpl::Resume(grpc::CallbackServerContext* context,
                                                     const v1::ResumeRequest* request,
                                                     v1::ResumeResponse* response) {
  if (auto* denied = DenyUnless(CheckAccess(context, true), context)) return denied;
  response->set_was_paused(engine_->Resume());
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerUnaryReactor* RolloutServiceImpl::ReleaseMemory(grpc::CallbackServerContext* context,
                                                            const v1::ReleaseMemoryRequest* request,
                                                            v1::ReleaseMemoryResponse* response) {
  if (auto* denied = DenyUnless(CheckAccess(context, true), context)) return denied;
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  const auto start = std::chrono::steady_clock::now();
  // Runs between two engine steps; the response lives until Finish.
  engine_->ReleaseMemory(
      MemoryReleaseOptions{request->abort_in_flight(), request->weights()},
      [reactor, response, start](MemoryResult r) {
        response->set_was_released(r.was_released);
        response->set_kv_cache_bytes(static_cast<uint64_t>(r.changed.kv_cache_bytes));
        response->set_weight_bytes(static_cast<uint64_t>(r.changed.weight_bytes));
        response->set_preempted_samples(static_cast<uint32_t>(r.requeued_samples));
        response->set_aborted_samples(static_cast<uint32_t>(r.aborted_samples));
        response->set_seconds(
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
        reactor->Finish(ToGrpcStatus(r.status));
      });
  return reactor;
}

grpc::ServerUnaryReactor* RolloutServiceImpl::ResumeMemory(grpc::CallbackServerContext* context,
                                                           const v1::ResumeMemoryRequest* request,
                                                           v1::ResumeMemoryResponse* response) {
  if (auto* denied = DenyUnless(CheckAccess(context, true), context)) return denied;
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  const auto start = std::chrono::steady_clock::now();
  engine_->ResumeMemory([reactor, response, start](MemoryResult r) {
    response->set_was_released(r.was_released);
    response->set_kv_cache_bytes(static_cast<uint64_t>(r.changed.kv_cache_bytes));
    response->set_weight_bytes(static_cast<uint64_t>(r.changed.weight_bytes));
    response->set_seconds(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    reactor->Finish(ToGrpcStatus(r.status));
  });
  return reactor;
}

grpc::ServerWriteReactor<v1::GenerateResponse>* RolloutServiceImpl::Generate(
    grpc::CallbackServerContext* context, const v1::GenerateRequest* request) {
  return new GenerateReactor(this, request, Authenticate(context, /*control=*/false));
}

grpc::ServerUnaryReactor* RolloutServiceImpl::Score(grpc::CallbackServerContext* context,
                                                    const v1::ScoreRequest* request,
                                                    v1::ScoreResponse* response) {
  absl::Status access = CheckAccess(context, false);
  if (access.ok()) access = CheckAdmission();
  if (auto* denied = DenyUnless(access, context)) return denied;
  return new ScoreReactor(this, request, response);
}

grpc::ServerUnaryReactor* RolloutServiceImpl::GetServerInfo(grpc::CallbackServerContext* context,
                                                            const v1::GetServerInfoRequest* request,
                                                            v1::ServerInfo* response) {
  if (auto* denied = DenyUnless(CheckAccess(context, false), context)) return denied;
  const ModelConfig& c = engine_->model_config();
  v1::ModelInfo* m = response->mutable_model();
  m->set_architecture(c.architecture);
  m->set_tie_word_embeddings(c.tie_word_embeddings);
  m->set_num_layers(c.num_layers);
  m->set_hidden_size(c.hidden_size);
  m->set_vocab_size(c.vocab_size);
  m->set_max_context(static_cast<uint32_t>(engine_->max_context()));
  m->set_num_attention_heads(c.num_attention_heads);
  m->set_num_key_value_heads(c.num_key_value_heads);
  m->set_head_dim(c.head_dim);
  m->set_intermediate_size(c.intermediate_size);
  m->set_num_experts(static_cast<uint32_t>(c.num_experts));
  m->set_num_experts_per_tok(static_cast<uint32_t>(c.num_experts_per_tok));
  m->set_moe_intermediate_size(static_cast<uint32_t>(c.moe_intermediate_size));
  for (int32_t layer : c.MoeLayers()) m->add_moe_layers(static_cast<uint32_t>(layer));
  m->set_routing_replay(c.is_moe() && engine_->routing_replay());
  for (int32_t eos : c.eos_token_ids) m->add_eos_token_ids(static_cast<uint32_t>(eos));
  m->set_source(model_.source);
  response->set_weight_version(engine_->weight_version());
  response->set_weight_digest(engine_->weight_digest());
  response->set_paused(engine_->paused());
  if (const std::optional<ReleasedMemory> released = engine_->memory_released()) {
    v1::ReleasedMemory* m = response->mutable_memory_released();
    m->set_kv_cache_bytes(static_cast<uint64_t>(released->kv_cache_bytes));
    m->set_weight_bytes(static_cast<uint64_t>(released->weight_bytes));
    m->set_weights(released->weights);
  }
  response->set_auth_required_for_generate(!access_.bearer_token.empty() && access_.all_rpcs);
  {
    std::lock_guard<std::mutex> lock(mu_);
    response->set_weight_update_in_progress(update_in_progress_);
  }
  response->set_backend(engine_->backend_name());
  if (std::optional<WeightSyncGroupInfo> group = engine_->weight_sync_group()) {
    response->mutable_weight_sync_group()->set_rank(static_cast<uint32_t>(group->rank));
    response->mutable_weight_sync_group()->set_world_size(static_cast<uint32_t>(group->world_size));
  }
  {
    v1::NumericsContract* n = response->mutable_numerics();
    n->set_backend(engine_->backend_name());
    n->set_architecture(c.architecture);
    n->set_compute_dtype(model_.numerics.compute_dtype);
    n->set_served_dtype(c.torch_dtype);
    n->set_tensor_parallel(static_cast<uint32_t>(model_.tensor_parallel));
    n->set_row_parallel_reduction(model_.numerics.row_parallel_reduction);
    n->set_kernels(model_.numerics.kernels);
    n->set_rope_type(RopeTypeName(c.rope_scaling.type));
    const RunnerNumerics& r = model_.numerics.runner;
    n->set_gpu_model(r.gpu_model);
    n->set_compute_capability(r.compute_capability);
    n->set_cuda_runtime(r.cuda_runtime);
    n->set_cublaslt_version(r.cublaslt_version);
    for (const std::string& line : r.gemm_algorithms) n->add_gemm_algorithms(line);
    n->set_gemm_pin_m(r.gemm_pin_m);
    n->set_gemm_ladder(r.gemm_ladder);
    n->set_attention_kernel(r.attention_kernel);
    n->set_attention_split_size(static_cast<uint32_t>(r.attention_split_size));
    n->set_attention_tile(static_cast<uint32_t>(r.attention_tile));
  }
  v1::EngineLimits* l = response->mutable_limits();
  l->set_max_running_samples(engine_->options().max_running_samples);
  l->set_max_batch_tokens(engine_->options().max_batch_tokens);
  l->set_kv_block_size(engine_->kv_block_size());
  l->set_attention_split_size(engine_->attention_split_size());
  l->set_tensor_parallel(static_cast<uint32_t>(model_.tensor_parallel));
  l->set_admission(AdmissionPolicyName(engine_->options().admission));
  const EngineCounters counters = engine_->counters();
  v1::EngineCounters* k = response->mutable_counters();
  k->set_running_samples(counters.running);
  k->set_paused_samples(static_cast<uint32_t>(counters.paused));
  k->set_waiting_samples(counters.waiting);
  k->set_kv_blocks_free(counters.kv_blocks_free);
  k->set_kv_blocks_total(counters.kv_blocks_total);
  k->set_generated_tokens(counters.generated_tokens);
  k->set_prefilled_tokens(counters.prefilled_tokens);
  k->set_engine_steps(counters.steps);
  k->set_preemptions(counters.preemptions);
  k->set_recomputed_tokens(counters.recomputed_tokens);
  k->set_kv_blocks_cached(static_cast<uint32_t>(counters.kv_blocks_cached));
  k->set_prompt_tokens(counters.prompt_tokens);
  k->set_cache_hit_tokens(counters.cache_hit_tokens);
  k->set_scored_tokens(counters.scored_tokens);
  k->set_weight_updates(counters.weight_updates);
  k->set_nonfinite_logit_rows(counters.nonfinite_logit_rows);
  response->set_server_version(GetBuildInfo().version);
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

absl::StatusOr<uint64_t> RolloutServiceImpl::StartGenerate(
    CallerScope caller, const std::vector<std::string>& request_ids,
    std::vector<SampleSpec> samples, EventSink sink) {
  // One lock over check, submit and record, so two calls cannot both claim an id and an Abort
  // never sees an id without its job.
  std::lock_guard<std::mutex> lock(mu_);
  if (absl::Status s = CheckQueueLocked(samples.size()); !s.ok()) return s;
  for (const std::string& id : request_ids) {
    if (!id.empty() && in_flight_ids_.count({caller, id}) != 0) {
      return absl::AlreadyExistsError(absl::StrFormat(
          "request_id '%s' is already in flight; request ids must be unique among running "
          "requests",
          id));
    }
  }
  InFlightJob rollouts{caller, request_ids, std::vector<uint32_t>(request_ids.size(), 0)};
  for (const SampleSpec& spec : samples) ++rollouts.samples_left.at(spec.rollout_index);
  absl::StatusOr<uint64_t> job = engine_->SubmitValidated(std::move(samples), std::move(sink));
  if (!job.ok()) return job.status();
  for (size_t i = 0; i < request_ids.size(); ++i) {
    if (!request_ids[i].empty()) {
      in_flight_ids_[{caller, request_ids[i]}] = InFlight{*job, static_cast<int32_t>(i)};
    }
  }
  in_flight_jobs_[*job] = std::move(rollouts);
  return job;
}

void RolloutServiceImpl::EndRolloutLocked(uint64_t job_id, InFlightJob* job, int32_t rollout) {
  job->samples_left[rollout] = 0;
  const std::string& id = job->request_ids[rollout];
  if (id.empty()) return;
  auto it = in_flight_ids_.find({job->caller, id});
  if (it != in_flight_ids_.end() && it->second.job_id == job_id &&
      it->second.rollout_index == rollout) {
    in_flight_ids_.erase(it);
  }
}

void RolloutServiceImpl::EndSamples(uint64_t job_id, const std::vector<SampleEvent>& events) {
  // Most deliveries carry tokens only: they need no lock.
  if (std::none_of(events.begin(), events.end(),
                   [](const SampleEvent& e) { return e.completion.has_value(); })) {
    return;
  }
  std::lock_guard<std::mutex> lock(mu_);
  auto job = in_flight_jobs_.find(job_id);
  if (job == in_flight_jobs_.end()) return;
  for (const SampleEvent& event : events) {
    if (!event.completion.has_value()) continue;
    uint32_t& left = job->second.samples_left.at(event.rollout_index);
    if (left > 0 && --left == 0) EndRolloutLocked(job_id, &job->second, event.rollout_index);
  }
}

absl::StatusOr<uint64_t> RolloutServiceImpl::StartScore(std::vector<SampleSpec> samples,
                                                        EventSink sink) {
  std::lock_guard<std::mutex> lock(mu_);
  if (absl::Status s = CheckQueueLocked(samples.size()); !s.ok()) return s;
  absl::StatusOr<uint64_t> job = engine_->SubmitValidated(std::move(samples), std::move(sink));
  if (job.ok()) in_flight_scores_.insert(*job);
  return job;
}

void RolloutServiceImpl::EndScore(uint64_t job_id) {
  std::lock_guard<std::mutex> lock(mu_);
  in_flight_scores_.erase(job_id);
}

absl::Status RolloutServiceImpl::CheckQueueLocked(size_t num_samples) const {
  if (absl::Status s = CheckAdmission(); !s.ok()) return s;
  const int64_t unfinished = engine_->unfinished_samples();
  if (unfinished + static_cast<int64_t>(num_samples) > max_unfinished_samples_) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "the server holds %d unfinished samples and this request adds %d, beyond its limit of "
        "%d; retry later or on another replica",
        unfinished, num_samples, max_unfinished_samples_));
  }
  return absl::OkStatus();
}

void RolloutServiceImpl::EndGenerate(CallerScope caller, uint64_t job_id,
                                     const std::vector<std::string>& request_ids) {
  std::lock_guard<std::mutex> lock(mu_);
  for (const std::string& id : request_ids) {
    auto it = in_flight_ids_.find({caller, id});
    if (it != in_flight_ids_.end() && it->second.job_id == job_id) in_flight_ids_.erase(it);
  }
  in_flight_jobs_.erase(job_id);
}

grpc::ServerUnaryReactor* RolloutServiceImpl::Abort(grpc::CallbackServerContext* context,
                                                    const v1::AbortRequest* request,
                                                    v1::AbortResponse* response) {
  if (auto* denied = DenyUnless(CheckAccess(context, true), context)) return denied;
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (request->all() == !request->request_ids().empty()) {
    reactor->Finish(
        grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                     "name the rollouts to abort in request_ids, or set all (not both)"));
    return reactor;
  }
  std::lock_guard<std::mutex> lock(mu_);
  // Counted: the rollouts still running (not those of a call that ended already, nor one named
  // twice). An aborted rollout's id is free at once, for its resubmission.
  if (request->all()) {
    uint32_t rollouts = 0;
    for (auto& [job_id, job] : in_flight_jobs_) {
      for (size_t r = 0; r < job.samples_left.size(); ++r) {
        if (job.samples_left[r] == 0) continue;
        ++rollouts;
        EndRolloutLocked(job_id, &job, static_cast<int32_t>(r));
      }
    }
    response->set_aborted_rollouts(rollouts);
    // Each ends ABORTED; counted once (a second Abort of all does not count them again).
    response->set_aborted_score_calls(static_cast<uint32_t>(in_flight_scores_.size()));
    in_flight_scores_.clear();
    engine_->AbortAll();
  } else {
    // Abort is a control RPC: its caller carries the token, and reaches the ids of callers
    // that did (those of calls without it are theirs alone).
    std::set<std::string> seen;
    for (const std::string& id : request->request_ids()) {
      if (!seen.insert(id).second) continue;
      auto it = in_flight_ids_.find({CallerScope::kTrusted, id});
      if (it == in_flight_ids_.end()) {
        response->add_unknown_request_ids(id);
        continue;
      }
      const InFlight rollout = it->second;
      engine_->Abort(rollout.job_id, rollout.rollout_index);
      response->set_aborted_rollouts(response->aborted_rollouts() + 1);
      auto job = in_flight_jobs_.find(rollout.job_id);
      if (job != in_flight_jobs_.end()) {
        EndRolloutLocked(rollout.job_id, &job->second, rollout.rollout_index);
      }
    }
  }
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerUnaryReactor* RolloutServiceImpl::FlushCache(grpc::CallbackServerContext* context,
                                                         const v1::FlushCacheRequest* request,
                                                         v1::FlushCacheResponse* response) {
  if (auto* denied = DenyUnless(CheckAccess(context, true), context)) return denied;
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  // Runs between two engine steps; the response lives until Finish.
  engine_->FlushCache([reactor, response](FlushResult result) {
    response->set_freed_blocks(static_cast<uint32_t>(result.freed_blocks));
    response->set_detached_blocks(static_cast<uint32_t>(result.detached_blocks));
    reactor->Finish(grpc::Status::OK);
  });
  return reactor;
}

}  // namespace rollout
