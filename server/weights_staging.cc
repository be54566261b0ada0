#include "server/weights_staging.h"

#include <chrono>
#include <cstring>
#include <iterator>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status.h"
#include "glog/logging.h"
#include "model/dtype_cast.h"
#include "model/model_config.h"
#include "model/safetensors.h"
#include "model/weight_digest.h"

namespace rollout {

UpdatePolicy FromProto(v1::InFlightPolicy policy) {
  switch (policy) {
    case v1::IN_FLIGHT_POLICY_ABORT:
      return UpdatePolicy::kAbort;
    case v1::IN_FLIGHT_POLICY_CONTINUE:
      return UpdatePolicy::kContinue;
    default:
      return UpdatePolicy::kDrain;
  }
}

absl::Status CheckPolicy(v1::InFlightPolicy policy, absl::string_view field) {
  if (v1::InFlightPolicy_IsValid(policy)) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrFormat(
      "%s is %d, not an InFlightPolicy: give IN_FLIGHT_POLICY_ABORT (1), _DRAIN (2, also 0, "
      "unset) or _CONTINUE (3); nothing was applied",
      field, static_cast<int>(policy)));
}

absl::Status WeightsStaging::SetHeader(const v1::WeightsHeader& header) {
  ROLLOUT_RETURN_IF_ERROR(CheckHeader(header));
  // A valid header, and only then the arena: no byte of it is written before this update owns it.
  absl::StatusOr<std::shared_ptr<WeightsArena::Lease>> lease = arena_->Acquire(&setup_seconds_);
  if (!lease.ok()) {
    tensors_.clear();
    has_header_ = false;
    return lease.status();
  }
  lease_ = *std::move(lease);
  Bind(*lease_);
  return absl::OkStatus();
}

void WeightsStaging::Bind(const WeightsArena::Lease& lease) {
  for (auto& [name, staged] : tensors_) {
    staged.place = lease.TensorBytes(name);
    staged.tensor.data = staged.place;
  }
  bound_ = true;
}

absl::Status WeightsStaging::CheckHeader(const v1::WeightsHeader& header) {
  if (has_header_) {
    return absl::InvalidArgumentError("a second WeightsHeader; send exactly one, first");
  }
  if (absl::Status s = CheckWeightVersion(header.version()); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("header.", s.message()));
  }
  ROLLOUT_RETURN_IF_ERROR(CheckPolicy(header.policy(), "header.policy"));
  if (header.tensors().empty()) {
    return absl::InvalidArgumentError("header.tensors is empty; declare the tensors to replace");
  }
  std::map<std::string, Staged, std::less<>> tensors;
  for (int i = 0; i < header.tensors_size(); ++i) {
    const v1::TensorDecl& decl = header.tensors(i);
    absl::StatusOr<DType> dtype = ParseDType(decl.dtype());
    if (!dtype.ok()) {
      return absl::InvalidArgumentError(
          absl::StrFormat("header.tensors[%d] ('%s'): dtype '%s' is not BF16, F16 or F32", i,
                          decl.name(), decl.dtype()));
    }
    std::vector<int64_t> shape(decl.shape().begin(), decl.shape().end());
    // Any float dtype: one other than the served is cast on arrival.
    if (absl::Status s = CheckPushedTensor(*specs_, decl.name(), *dtype, shape); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrFormat("header.tensors[%d]: %s", i, s.message()));
    }
    if (tensors.count(decl.name()) != 0) {
      return absl::InvalidArgumentError(
          absl::StrFormat("header.tensors[%d]: '%s' is declared twice", i, decl.name()));
    }
    const WeightSpec& spec = *FindWeightSpec(*specs_, decl.name());
    Staged& staged = tensors[decl.name()];
    staged.tensor.name = decl.name();
    staged.tensor.dtype = spec.dtype;
    staged.tensor.shape = std::move(shape);
    staged.tensor.nbytes = spec.nbytes();
    staged.wire_dtype = *dtype;
    staged.wire_bytes = spec.nbytes() / DTypeSize(spec.dtype) * DTypeSize(*dtype);
  }
  tensors_ = std::move(tensors);
  version_ = header.version();
  policy_ = FromProto(header.policy());
  // Half the cores hash, shared by the parts of a multi-part update, so that receiving keeps
  // the others.
  const int parts = std::max<int>(1, static_cast<int>(header.part_count()));
  digests_ = std::make_unique<DigestQueue>(
      std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / 2 / parts));
  has_header_ = true;
  return absl::OkStatus();
}

absl::Status WeightsStaging::AddData(const v1::TensorData& data) {
  const std::string& bytes = data.data();
  return AddData(data.name(), data.offset(), bytes.size(), [&bytes](uint8_t* destination) {
    std::memcpy(destination, bytes.data(), bytes.size());
  });
}

absl::Status WeightsStaging::AddData(absl::string_view name, uint64_t offset, uint64_t size,
                                     const CopyTo& copy) {
  if (!has_header_) {
    return absl::InvalidArgumentError("TensorData before the WeightsHeader; send the header first");
  }
  if (!bound_) return absl::InternalError("weight staging: data before its places were bound");
  auto it = tensors_.find(name);
  if (it == tensors_.end()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("data for '%s', which the header did not declare", name));
  }
  Staged& staged = it->second;
  const uint64_t tensor_size = staged.wire_bytes;
  const uint64_t begin = offset, end = begin + size;
  if (size == 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("empty data chunk for '%s' at offset %d", name, begin));
  }
  if (begin >= tensor_size || end > tensor_size || end < begin) {
    // The range's end as a number, not wrapped past 2^64 (offset + size can overflow).
    return absl::InvalidArgumentError(absl::StrFormat(
        "data for '%s' covers bytes [%d, %d + %d), beyond its %d bytes", name, begin, begin, size,
        tensor_size));
  }
  // The first range starting at or after `end` bounds the search; its predecessor must end
  // before `begin`.
  auto next = staged.received.lower_bound(end);
  if (next != staged.received.begin()) {
    auto prev = std::prev(next);
    if (prev->second > begin) {
      return absl::InvalidArgumentError(
          absl::StrFormat("data for '%s' bytes [%d, %d) overlaps bytes [%d, %d) sent earlier", name,
                          begin, end, prev->first, prev->second));
    }
  }
  // Checked above: the bytes land inside the tensor, on no byte written before.
  ROLLOUT_RETURN_IF_ERROR(Place(staged, begin, size, copy));
  bytes_received_ += size;
  return absl::OkStatus();
}

absl::Status WeightsStaging::Place(Staged& staged, uint64_t begin, uint64_t size,
                                   const CopyTo& copy) {
  const DType served = staged.tensor.dtype, wire = staged.wire_dtype;
  const uint64_t in = DTypeSize(wire), out = DTypeSize(served);
  if (wire == served) {
    copy(staged.place + begin);
  } else if (begin % in == 0 && size % in == 0) {
    // Whole elements: cast now, so that the cost is spread over the stream.
    chunk_bytes_.resize(size);
    copy(chunk_bytes_.data());
    ROLLOUT_RETURN_IF_ERROR(CastFloats(staged.tensor.name, wire, chunk_bytes_.data(), size / in,
                                       served, staged.place + begin / in * out, begin / in));
  } else {
    // A chunk that cuts an element: its neighbours across the cut cut it too, so every byte of
    // the elements it touches comes through here.
    if (staged.unaligned.empty()) staged.unaligned.resize(staged.wire_bytes);
    copy(staged.unaligned.data() + begin);
    staged.unaligned_ranges.emplace_back(begin, begin + size);
  }
  staged.received[begin] = begin + size;
  staged.received_bytes += size;
  // Disjoint ranges inside the tensor: all of it arrived. Hashed on the digest workers while
  // the stream goes on.
  if (staged.received_bytes != staged.wire_bytes) return absl::OkStatus();
  for (const auto& [first, last] : staged.unaligned_ranges) {
    const uint64_t element = first / in, end_element = (last + in - 1) / in;
    ROLLOUT_RETURN_IF_ERROR(
        CastFloats(staged.tensor.name, wire, staged.unaligned.data() + element * in,
                   end_element - element, served, staged.place + element * out, element));
  }
  std::vector<uint8_t>().swap(staged.unaligned);
  staged.unaligned_ranges.clear();
  digests_->Add(staged.tensor.name, staged.tensor.data, staged.tensor.nbytes);
  return absl::OkStatus();
}

absl::StatusOr<WeightUpdate> WeightsStaging::Finish(double* digest_wait_seconds) {
  if (digest_wait_seconds != nullptr) *digest_wait_seconds = 0;
  if (!has_header_) {
    return absl::InvalidArgumentError("the stream ended without a WeightsHeader");
  }
  for (const auto& [name, staged] : tensors_) {
    uint64_t covered = 0;  // ranges are disjoint and sorted: a gap shows as a jump
    for (const auto& [begin, end] : staged.received) {
      if (begin != covered) break;
      covered = end;
    }
    if (covered != staged.wire_bytes) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "tensor '%s' is incomplete: bytes from %d on are missing (it has %d); nothing was "
          "applied",
          name, covered, staged.wire_bytes));
    }
  }
  WeightUpdate update;
  update.version = version_;
  update.policy = policy_;
  const auto wait_start = std::chrono::steady_clock::now();
  update.digests = digests_->Finish();
  if (digest_wait_seconds != nullptr) {
    *digest_wait_seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - wait_start).count();
  }
  for (auto& [name, staged] : tensors_) update.tensors.push_back(std::move(staged.tensor));
  tensors_.clear();
  update.bytes = std::move(lease_);
  return update;
}

void WeightsStaging::Abandon() {
  if (digests_ != nullptr) digests_->Cancel();
  tensors_.clear();
  lease_.reset();
}

absl::StatusOr<WeightUpdate> LoadUpdateFromCheckpoint(
    const std::vector<WeightSpec>& specs, const ModelConfig* served, WeightsArena* arena,
    const std::string& path, const std::string& version, UpdatePolicy policy,
    const std::function<bool()>& cancelled, CheckpointLoadTimes* times) {
  CheckpointLoadTimes unused;
  if (times == nullptr) times = &unused;
  *times = CheckpointLoadTimes{};
  if (absl::Status s = CheckWeightVersion(version); !s.ok()) return s;
  if (path.empty()) {
    return absl::InvalidArgumentError(
        "path is empty; give the checkpoint directory on the server's disk");
  }
  absl::StatusOr<std::unique_ptr<Checkpoint>> checkpoint = Checkpoint::Open(path);
  if (!checkpoint.ok()) return checkpoint.status();
  if (served != nullptr) {
    absl::StatusOr<ModelConfig> config = ReadModelConfig(**checkpoint);
    if (!config.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(config.status().message(), "; nothing was applied"));
    }
    if (absl::Status s = CheckSameModel(path, IdentityOf(*config), IdentityOf(*served)); !s.ok()) {
      return absl::FailedPreconditionError(absl::StrCat(s.message(), " (nothing was applied)"));
    }
  }
  for (const WeightSpec& spec : specs) {
    const TensorView* view = (*checkpoint)->Find(spec.name);
    if (view == nullptr) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: checkpoint lacks tensor '%s'; nothing was applied", path, spec.name));
    }
    if (absl::Status s = CheckPushedTensor(specs, spec.name, view->dtype, view->shape); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrFormat("%s: %s", path, s.message()));
    }
  }
  uint64_t bytes = 0;
  for (const WeightSpec& spec : specs) bytes += (*checkpoint)->Find(spec.name)->nbytes;
  LOG(INFO) << absl::StrFormat("reading weight version '%s' from %s: %d tensors, %.1f MiB", version,
                               path, specs.size(), bytes / 1048576.0);
  absl::StatusOr<std::shared_ptr<WeightsArena::Lease>> lease =
      arena->Acquire(&times->setup_seconds);
  if (!lease.ok()) return lease.status();
  WeightUpdate update;
  update.version = version;
  update.policy = policy;
  std::vector<uint8_t> cast_from;  // a tensor in another float dtype, before its cast
  for (const WeightSpec& spec : specs) {
    const TensorView* view = (*checkpoint)->Find(spec.name);
    uint8_t* place = (*lease)->TensorBytes(spec.name);
    update.tensors.emplace_back(spec.name, spec.dtype, spec.shape, place, spec.nbytes());
    // Read, not copied from the mapping: a file truncated meanwhile fails this update only.
    uint8_t* read_to = place;
    if (view->dtype != spec.dtype) {
      cast_from.resize(view->nbytes);
      read_to = cast_from.data();
    }
    if (absl::Status s = (*checkpoint)->Read(spec.name, read_to, cancelled); !s.ok()) {
      return absl::Status(s.code(), absl::StrCat(s.message(), "; nothing was applied"));
    }
    if (view->dtype != spec.dtype) {
      if (absl::Status s = CastFloats(spec.name, view->dtype, cast_from.data(),
                                      view->nbytes / DTypeSize(view->dtype), spec.dtype, place);
          !s.ok()) {
        return absl::InvalidArgumentError(absl::StrFormat("%s: %s", path, s.message()));
      }
    }
  }
  if (absl::Status s = (*checkpoint)->CheckUnchanged(); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat(s.message(), "; nothing was applied"));
  }
  // Hashed a bounded batch at a time on one set of workers (a checkpoint's digest takes as long
  // as its read), so that a caller that gave up meanwhile frees the update within one batch
  // here too.
  constexpr uint64_t kDigestBatchBytes = uint64_t{64} << 20;
  const auto digest_start = std::chrono::steady_clock::now();
  DigestQueue digests;
  for (size_t i = 0; i < update.tensors.size();) {
    if (cancelled && cancelled()) {
      return absl::CancelledError(absl::StrCat("cancelled while the tensors of ", path,
                                               " were hashed; nothing was applied"));
    }
    for (uint64_t batch_bytes = 0;
         i < update.tensors.size() &&
         (batch_bytes == 0 || batch_bytes + update.tensors[i].nbytes <= kDigestBatchBytes);
         ++i) {
      const HostTensorView& t = update.tensors[i];
      digests.Add(t.name, t.data, t.nbytes);
      batch_bytes += t.nbytes;
    }
    update.digests.merge(digests.Finish());
  }
  times->digest_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - digest_start).count();
  update.bytes = *std::move(lease);
  return update;
}

absl::Status CheckWeightVersion(const std::string& version) {
  if (version.empty()) {
    return absl::InvalidArgumentError("version is empty; name the new weight version");
  }
  if (version.size() > kMaxWeightVersionBytes) {
    return absl::InvalidArgumentError(
        absl::StrFormat("version is %d bytes, beyond the limit of %d (it is copied into every "
                        "completion)",
                        version.size(), kMaxWeightVersionBytes));
  }
  // It is written into logs and into /metrics' rollout_weight_version_info{version="..."} label:
  // no line breaks, NULs or other control characters there.
  for (size_t i = 0; i < version.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(version[i]);
    if (c < 0x20 || c == 0x7f) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "version holds the control character 0x%02x at byte %d; name it with printable "
          "characters (it is written into logs and /metrics labels)",
          c, i));
    }
  }
  return absl::OkStatus();
}

}  // namespace rollout
