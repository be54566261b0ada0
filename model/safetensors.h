#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace rollout {

enum class DType { kF32, kF16, kBF16 };

// "F32", "F16", "BF16" as written in safetensors headers.
const char* DTypeName(DType dtype);
size_t DTypeSize(DType dtype);
// The inverse of DTypeName; anything else (e.g. "I64") is INVALID_ARGUMENT naming it.
absl::StatusOr<DType> ParseDType(std::string_view name);
// "[a, b]", as used in error messages.
std::string ShapeToString(const std::vector<int64_t>& shape);

// A tensor inside a mapped checkpoint file. Borrowed: valid while its Checkpoint lives.
struct TensorView {
  DType dtype;
  std::vector<int64_t> shape;
  // Little-endian, row-major, in the file's mapping: touching it after the file was truncated
  // raises SIGBUS. Code that must survive files changing under it (weight updates) uses
  // Checkpoint::Read instead.
  const uint8_t* data = nullptr;
  size_t nbytes = 0;
};

// A Hugging Face checkpoint directory: config.json (and optionally generation_config.json) plus
// either model.safetensors or model.safetensors.index.json with its shards. Every file must be
// a regular file (a FIFO or a device is refused, never waited on) and the JSON files at most
// 64 MiB. Files stay open and memory-mapped read-only; headers are read, not mapped. Immutable
// after Open; safe to read from any thread.
class Checkpoint {
 public:
  // Opens `dir`. An empty path, a symlink loop, a directory or other non-regular file where a
  // file belongs, corrupt headers, offsets outside the file, overlapping tensors, unknown
  // dtypes, byte counts that disagree with shape x dtype, a missing shard, or a tensor named in
  // the index but absent from its shard are errors naming the file and tensor.
  // MoE experts fused as transformers 5 holds them in memory (and saves them with
  // save_original_format=False) -- "P.mlp.experts.gate_up_proj" [E, 2 * I, H] (each expert's
  // gate rows, then its up rows) and "P.mlp.experts.down_proj" [E, H, I] -- are listed and read
  // as the Hub's per-expert tensors they hold, "P.mlp.experts.e.{gate,up,down}_proj.weight"
  // (each a contiguous slice of its file), the names the engine serves. A fused tensor of
  // another rank, or a per-expert tensor also given on its own, is INVALID_ARGUMENT.
  static absl::StatusOr<std::unique_ptr<Checkpoint>> Open(const std::string& dir);

  ~Checkpoint();
  Checkpoint(const Checkpoint&) = delete;
  Checkpoint& operator=(const Checkpoint&) = delete;

  const std::string& dir() const { return dir_; }
  const std::string& config_json() const { return config_json_; }
  // generation_config.json's text; empty when the directory has none.
  const std::string& generation_config_json() const { return generation_config_json_; }
  // nullptr when absent.
  const TensorView* Find(const std::string& name) const;
  std::vector<std::string> TensorNames() const;  // sorted

  // Copies the named tensor's nbytes into `out` with bounded reads of its file, never through
  // the mapping: a file truncated meanwhile is ABORTED for this read, not a SIGBUS. `cancelled`
  // (optional) is asked before each read of at most 64 MiB: CANCELLED once it answers true.
  // NOT_FOUND for an unknown name.
  absl::Status Read(const std::string& name, uint8_t* out,
                    const std::function<bool()>& cancelled = nullptr) const;
  // ABORTED if a file's size or modification time changed since Open (so bytes read may mix
  // two versions of it).
  absl::Status CheckUnchanged() const;

  // Converts the named tensor to fp32 (read as Read does), checking that it exists and has
  // `shape`. NOT_FOUND / INVALID_ARGUMENT name the tensor and the expected vs actual shape.
  absl::StatusOr<std::vector<float>> ReadF32(const std::string& name,
                                             const std::vector<int64_t>& shape) const;

 private:
  struct File;
  struct Entry {
    TensorView view;
    size_t file;           // index into files_
    uint64_t file_offset;  // of its first byte
  };
  Checkpoint() = default;
  // Replaces fused expert tensors with their per-expert slices (see Open).
  absl::Status SplitFusedExperts();

  std::string dir_;
  std::string config_json_;
  std::string generation_config_json_;
  std::vector<std::unique_ptr<File>> files_;
  std::map<std::string, Entry> tensors_;
};

// A tensor to write, held in host memory.
struct HostTensor {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;  // exactly prod(shape) * DTypeSize(dtype)
};

// A tensor in host memory that something else owns (a weight update's staging, a HostTensor),
// borrowed for as long as the owner keeps it: what a weight update hands the model runner. Like
// std::string_view, it converts implicitly from what it views.
struct HostTensorView {
  HostTensorView() = default;
  HostTensorView(std::string name, DType dtype, std::vector<int64_t> shape, const uint8_t* data,
                 size_t nbytes)
      : name(std::move(name)), dtype(dtype), shape(std::move(shape)), data(data), nbytes(nbytes) {}
  HostTensorView(const HostTensor& t)  // NOLINT(google-explicit-constructor): a view
      : HostTensorView(t.name, t.dtype, t.shape, t.bytes.data(), t.bytes.size()) {}

  std::string name;
  DType dtype = DType::kBF16;
  std::vector<int64_t> shape;
  const uint8_t* data = nullptr;  // nbytes bytes, row-major, little-endian
  size_t nbytes = 0;              // prod(shape) * DTypeSize(dtype) for a valid tensor
};

// Views of `tensors`, which must outlive them.
std::vector<HostTensorView> ViewsOf(const std::vector<HostTensor>& tensors);

// Writes one .safetensors file (header sorted by name, 8-byte aligned data). The file appears
// atomically (temp file + rename).
absl::Status WriteSafetensors(const std::string& path, const std::vector<HostTensor>& tensors);

// A tensor's header entry, for writers that produce the bytes on the fly.
struct TensorMeta {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
};

// Receives the next `size` bytes of the tensor being written.
using ByteSink = std::function<absl::Status(const uint8_t* data, size_t size)>;
// Writes all prod(shape) * DTypeSize(dtype) bytes of `tensor` into `sink`, in any number of
// calls. Called once per tensor, in name order.
using TensorProducer = std::function<absl::Status(const TensorMeta& tensor, const ByteSink& sink)>;

// WriteSafetensors without holding the tensors in memory (multi-GB checkpoints): the header is
// written from `tensors`, then `produce` streams each tensor's bytes. Also writes to a temp file
// and renames it, so an error or crash never leaves a partial `path`.
absl::Status WriteSafetensorsStreaming(const std::string& path, std::vector<TensorMeta> tensors,
                                       const TensorProducer& produce);

// fp32 <-> bf16 (round to nearest even) and fp16 conversions.
uint16_t F32ToBF16(float x);
float BF16ToF32(uint16_t x);
uint16_t F32ToF16(float x);
float F16ToF32(uint16_t x);

}  // namespace rollout
