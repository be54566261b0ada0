#include "server/generate_reactor.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_format.h"
#include "glog/logging.h"
#include "server/proto_convert.h"
#include "server/status_util.h"

namespace rollout {
namespace {

void RecordSamples(const std::vector<SampleEvent>& events, ServiceMetrics* metrics) {
  for (const SampleEvent& event : events) {
    if (event.completion.has_value()) metrics->RecordSample(event.completion->finish_reason);
  }
}

}  // namespace

GenerateReactor::GenerateReactor(RolloutServiceImpl* service, const v1::GenerateRequest* request,
                                 const absl::StatusOr<CallerScope>& caller)
    : service_(service), stream_(std::make_shared<Stream>()) {
  stream_->reactor = this;
  const absl::Status allowed =
      caller.ok() ? ValidateStreamOptions(request->stream()) : caller.status();
  absl::StatusOr<std::vector<SampleSpec>> specs =
      allowed.ok() ? ToSampleSpecs(*request, *service_->engine()) : allowed;
  if (!specs.ok()) {
    // No other thread knows this call yet.
    stream_->finished = true;
    Finish(ToGrpcStatus(specs.status()));
    return;
  }
  caller_ = *caller;
  std::vector<uint32_t> samples_per_rollout;
  for (const v1::RolloutRequest& r : request->rollouts()) {
    request_ids_.push_back(r.request_id());
    samples_per_rollout.push_back(std::max<uint32_t>(1, r.num_samples()));
  }
  stream_->completions_left = specs->size();
  stream_->shaper.emplace(request->stream(), samples_per_rollout, StreamShaper::Clock::now());
  // The sink holds the stream, not the reactor: the reactor may be gone when an event comes.
  // Samples are counted there, so those that end after the call did (a cancelled stream's
  // aborts) are counted too; the metrics outlive the engine (RolloutServer's teardown order).
  std::shared_ptr<Stream> stream = stream_;
  ServiceMetrics* metrics = service_->metrics();
  absl::StatusOr<uint64_t> job;
  {
    // Held across the submission so that OnCancel sees the job id and events wait for it.
    std::lock_guard<std::mutex> lock(stream_->mu);
    job = service_->StartGenerate(caller_, request_ids_, *std::move(specs),
                                  [stream, metrics](std::vector<SampleEvent> events) {
                                    if (metrics != nullptr) RecordSamples(events, metrics);
                                    std::lock_guard<std::mutex> lock(stream->mu);
                                    if (stream->reactor == nullptr) return;
                                    stream->reactor->OnEvents(std::move(events));
                                  });
    if (job.ok()) {
      job_id_ = *job;
      submitted_ = true;
      return;
    }
    stream_->finished = true;
  }
  Finish(ToGrpcStatus(job.status()));
}

void GenerateReactor::OnEvents(std::vector<SampleEvent> events) {
  // Called with stream_->mu held, on the engine's delivery thread.
  service_->EndSamples(job_id_, events);
  Stream& s = *stream_;
  if (s.finished || s.cancelled || s.stalled.has_value()) return;
  std::vector<v1::GenerateResponse> responses;
  const StreamShaper::Clock::time_point now = StreamShaper::Clock::now();
  for (SampleEvent& event : events) {
    if (event.completion.has_value()) --s.completions_left;
    s.shaper->Append(std::move(event), now, &responses);
  }
  for (v1::GenerateResponse& r : responses) {
    const int64_t bytes = static_cast<int64_t>(r.SpaceUsedLong());
    s.queued_bytes += bytes;
    s.queue.push_back(Queued{std::move(r), bytes});
  }
  if (!s.writing && !s.queue.empty()) {
    s.writing = true;
    StartWrite(&s.queue.front().message);
  }
  ApplyBackpressure();
}

void GenerateReactor::ApplyBackpressure() {
  Stream& s = *stream_;
  const StreamLimits& limits = service_->stream_limits();
  if (!s.paused && s.queued_bytes > limits.max_buffered_bytes && s.completions_left > 0) {
    s.paused = true;
    service_->engine()->PauseJob(job_id_);
    s.last_read = std::chrono::steady_clock::now();  // the stall timeout runs from here
    ArmStallAlarmLocked(limits.max_paused);
  } else if (s.paused && s.queued_bytes <= limits.max_buffered_bytes / 2) {
    s.paused = false;
    service_->engine()->ResumeJob(job_id_);
  }
}

void GenerateReactor::ArmStallAlarmLocked(std::chrono::steady_clock::duration after) {
  Stream& s = *stream_;
  const uint64_t alarm = ++s.alarms;
  std::shared_ptr<Stream> stream = stream_;
  // Replacing the alarm cancels the one before (its callback sees rang == false, or, if it
  // rang already, an older alarm number); one that is ringing keeps its own reference.
  stall_alarm_ = std::make_unique<grpc::Alarm>();
  stall_alarm_->Set(std::chrono::system_clock::now() +
                        std::chrono::duration_cast<std::chrono::system_clock::duration>(after),
                    [stream, alarm](bool rang) {
                      if (rang) OnStallAlarm(stream, alarm);  // not when cancelled
                    });
}

void GenerateReactor::OnStallAlarm(const std::shared_ptr<Stream>& stream, uint64_t alarm) {
  std::lock_guard<std::mutex> lock(stream->mu);
  if (stream->reactor == nullptr || stream->alarms != alarm || stream->finished) return;
  if (!stream->paused && !stream->stalled.has_value()) return;
  GenerateReactor* reactor = stream->reactor;
  const std::chrono::steady_clock::duration limit = reactor->service_->stream_limits().max_paused;
  const std::chrono::steady_clock::duration quiet =
      std::chrono::steady_clock::now() - stream->last_read;
  if (quiet < limit) {
    reactor->ArmStallAlarmLocked(limit - quiet);  // the client read since: the timeout runs on
  } else if (!stream->stalled.has_value()) {
    reactor->EndStalledLocked();
  } else {
    // Stalled, and nothing read of the queue for another timeout: the client is not coming
    // back for it. Only the message in flight stays (gRPC holds it until the client reads or
    // goes), then the status.
    while (stream->queue.size() > 1) {
      stream->queued_bytes -= stream->queue.back().bytes;
      stream->queue.pop_back();
    }
  }
}

void GenerateReactor::EndStalledLocked() {
  Stream& s = *stream_;
  if (s.finished || s.cancelled || s.stalled.has_value()) return;
  const StreamLimits& limits = service_->stream_limits();
  s.stalled = grpc::Status(
      grpc::StatusCode::RESOURCE_EXHAUSTED,
      absl::StrFormat("the client did not read this Generate stream: its samples paused with "
                      "%.1f MiB of unread messages queued (the bound, --stream_buffer_mb) and "
                      "the client read nothing for %.1f s (--stream_stall_timeout_s), so they "
                      "were aborted; read the stream as it comes, or ask for fewer messages "
                      "(GenerateRequest.stream: coalesced chunks or completions only)",
                      static_cast<double>(limits.max_buffered_bytes) / (1 << 20),
                      static_cast<double>(limits.max_paused.count()) / 1000));
  LOG(WARNING) << "Generate job " << job_id_ << ": " << s.stalled->error_message();
  service_->engine()->Abort(job_id_);
  // What is queued (at most the bound) stays for the client, the status after it, while it
  // reads; after another timeout without a read, the queue is dropped (OnStallAlarm).
  if (!s.writing) {
    FinishLocked(*s.stalled);
    return;
  }
  s.last_read = std::chrono::steady_clock::now();
  ArmStallAlarmLocked(limits.max_paused);
}

void GenerateReactor::OnWriteDone(bool ok) {
  std::lock_guard<std::mutex> lock(stream_->mu);
  Stream& s = *stream_;
  s.queued_bytes -= s.queue.front().bytes;
  s.queue.pop_front();
  s.writing = false;
  if (!ok || s.cancelled) {
    // The client is gone; nothing more can be delivered.
    s.cancelled = true;
    if (submitted_ && !s.stalled.has_value()) service_->engine()->Abort(job_id_);
    FinishLocked(
        s.stalled.value_or(grpc::Status(grpc::StatusCode::CANCELLED, "the client went away")));
    return;
  }
  if (!s.queue.empty()) {
    s.writing = true;
    StartWrite(&s.queue.front().message);
  } else if (s.stalled.has_value()) {
    FinishLocked(*s.stalled);
  } else if (s.completions_left == 0) {
    FinishLocked(grpc::Status::OK);
  }
  // A paused (or stalled) stream whose client reads is not stalled: its timeout runs from the
  // last read (OnStallAlarm).
  s.last_read = std::chrono::steady_clock::now();
  if (s.stalled.has_value() || s.finished) return;
  ApplyBackpressure();
}

void GenerateReactor::OnCancel() {
  std::lock_guard<std::mutex> lock(stream_->mu);
  Stream& s = *stream_;
  s.cancelled = true;
  if (submitted_) service_->engine()->Abort(job_id_);
  if (!s.writing) FinishLocked(grpc::Status(grpc::StatusCode::CANCELLED, "cancelled"));
}

void GenerateReactor::FinishLocked(const grpc::Status& status) {
  if (stream_->finished) return;
  stream_->finished = true;
  Finish(status);
}

void GenerateReactor::OnDone() {
  {
    std::lock_guard<std::mutex> lock(stream_->mu);
    stream_->reactor = nullptr;
    // A call that ended early (write failure) must not leave samples running.
    if (submitted_ && stream_->completions_left > 0) service_->engine()->Abort(job_id_);
  }
  if (submitted_) service_->EndGenerate(caller_, job_id_, request_ids_);
  delete this;
}

}  // namespace rollout
