#include "server/weights_staging.h"

#include <cstring>
#include <iterator>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "glog/logging.h"
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

absl::Status WeightsStaging::SetHeader(const v1::WeightsHeader& header) {
  if (has_header_) {
    return absl::InvalidArgumentError("a second WeightsHeader; send exactly one, first");
  }
  if (absl::Status s = CheckWeightVersion(header.version()); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("header.", s.message()));
  }
  if (header.tensors().empty()) {
    return absl::InvalidArgumentError("header.tensors is empty; declare the tensors to replace");
  }
  for (int i = 0; i < header.tensors_size(); ++i) {
    const v1::TensorDecl& decl = header.tensors(i);
    absl::StatusOr<DType> dtype = ParseDType(decl.dtype());
    if (!dtype.ok()) {
      return absl::InvalidArgumentError(
          absl::StrFormat("header.tensors[%d] ('%s'): dtype '%s' is not BF16, F16 or F32", i,
                          decl.name(), decl.dtype()));
    }
    std::vector<int64_t> shape(decl.shape().begin(), decl.shape().end());
    if (absl::Status s = CheckTensorAgainstSpec(*specs_, decl.name(), *dtype, shape); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrFormat("header.tensors[%d]: %s", i, s.message()));
    }
    if (tensors_.count(decl.name()) != 0) {
      return absl::InvalidArgumentError(
          absl::StrFormat("header.tensors[%d]: '%s' is declared twice", i, decl.name()));
    }
    Staged& staged = tensors_[decl.name()];
    staged.tensor.name = decl.name();
    staged.tensor.dtype = *dtype;
    staged.tensor.shape = std::move(shape);
    staged.tensor.bytes.resize(FindWeightSpec(*specs_, decl.name())->nbytes());
  }
  version_ = header.version();
  policy_ = FromProto(header.policy());
  has_header_ = true;
  return absl::OkStatus();
}

absl::Status WeightsStaging::AddData(const v1::TensorData& data) {
  if (!has_header_) {
    return absl::InvalidArgumentError("TensorData before the WeightsHeader; send the header first");
  }
  auto it = tensors_.find(data.name());
  if (it == tensors_.end()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("data for '%s', which the header did not declare", data.name()));
  }
  Staged& staged = it->second;
  const uint64_t size = staged.tensor.bytes.size();
  const uint64_t begin = data.offset(), end = begin + data.data().size();
  if (data.data().empty()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("empty data chunk for '%s' at offset %d", data.name(), begin));
  }
  if (begin >= size || end > size || end < begin) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "data for '%s' covers bytes [%d, %d), beyond its %d bytes", data.name(), begin, end, size));
  }
  // The first range starting at or after `end` bounds the search; its predecessor must end
  // before `begin`.
  auto next = staged.received.lower_bound(end);
  if (next != staged.received.begin()) {
    auto prev = std::prev(next);
    if (prev->second > begin) {
      return absl::InvalidArgumentError(
          absl::StrFormat("data for '%s' bytes [%d, %d) overlaps bytes [%d, %d) sent earlier",
                          data.name(), begin, end, prev->first, prev->second));
    }
  }
  std::memcpy(staged.tensor.bytes.data() + begin, data.data().data(), data.data().size());
  staged.received[begin] = end;
  bytes_received_ += end - begin;
  staged.received_bytes += end - begin;
  // Disjoint ranges inside the tensor: all of it arrived. Hashed on the digest workers while
  // the stream goes on.
  if (staged.received_bytes == size) digests_.Add(data.name(), staged.tensor.bytes.data(), size);
  return absl::OkStatus();
}

absl::StatusOr<WeightUpdate> WeightsStaging::Finish() {
  if (!has_header_) {
    return absl::InvalidArgumentError("the stream ended without a WeightsHeader");
  }
  WeightUpdate update;
  update.version = version_;
  update.policy = policy_;
  update.digests = digests_.Finish();
  for (auto& [name, staged] : tensors_) {
    uint64_t covered = 0;  // ranges are disjoint and sorted: a gap shows as a jump
    for (const auto& [begin, end] : staged.received) {
      if (begin != covered) break;
      covered = end;
    }
    if (covered != staged.tensor.bytes.size()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "tensor '%s' is incomplete: bytes from %d on are missing (it has %d); nothing was "
          "applied",
          name, covered, staged.tensor.bytes.size()));
    }
    update.tensors.push_back(std::move(staged.tensor));
  }
  tensors_.clear();
  return update;
}

absl::StatusOr<WeightUpdate> LoadUpdateFromCheckpoint(const std::vector<WeightSpec>& specs,
                                                      const std::string& path,
                                                      const std::string& version,
                                                      UpdatePolicy policy,
                                                      const std::function<bool()>& cancelled) {
  if (absl::Status s = CheckWeightVersion(version); !s.ok()) return s;
  if (path.empty()) {
    return absl::InvalidArgumentError(
        "path is empty; give the checkpoint directory on the server's disk");
  }
  absl::StatusOr<std::unique_ptr<Checkpoint>> checkpoint = Checkpoint::Open(path);
  if (!checkpoint.ok()) return checkpoint.status();
  WeightUpdate update;
  update.version = version;
  update.policy = policy;
  for (const WeightSpec& spec : specs) {
    const TensorView* view = (*checkpoint)->Find(spec.name);
    if (view == nullptr) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: checkpoint lacks tensor '%s'; nothing was applied", path, spec.name));
    }
    if (absl::Status s = CheckTensorAgainstSpec(specs, spec.name, view->dtype, view->shape);
        !s.ok()) {
      return absl::InvalidArgumentError(absl::StrFormat("%s: %s", path, s.message()));
    }
  }
  uint64_t bytes = 0;
  for (const WeightSpec& spec : specs) bytes += (*checkpoint)->Find(spec.name)->nbytes;
  LOG(INFO) << absl::StrFormat("reading weight version '%s' from %s: %d tensors, %.1f MiB", version,
                               path, specs.size(), bytes / 1048576.0);
  for (const WeightSpec& spec : specs) {
    const TensorView* view = (*checkpoint)->Find(spec.name);
    HostTensor& t = update.tensors.emplace_back(
        HostTensor{spec.name, view->dtype, view->shape, std::vector<uint8_t>(view->nbytes)});
    // Read, not copied from the mapping: a file truncated meanwhile fails this update only.
    if (absl::Status s = (*checkpoint)->Read(spec.name, t.bytes.data(), cancelled); !s.ok()) {
      return absl::Status(s.code(), absl::StrCat(s.message(), "; nothing was applied"));
    }
  }
  if (absl::Status s = (*checkpoint)->CheckUnchanged(); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat(s.message(), "; nothing was applied"));
  }
  update.digests = DigestTensors(update.tensors);
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
  return absl::OkStatus();
}

}  // namespace rollout
