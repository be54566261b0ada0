#include "model/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <set>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/regular_file.h"
#include "common/status.h"
#include "nlohmann/json.hpp"

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "safetensors data is little-endian; this code reads it in place"
#endif

namespace rollout {
namespace {

using json = nlohmann::json;

// The safetensors reference implementation refuses larger headers; so do we, which also bounds
// the work a corrupt length field can cause.
constexpr uint64_t kMaxHeaderBytes = 100ull << 20;

// JSON files of a checkpoint (config.json, the shard index) are small; a larger one is a wrong
// path (or /dev/zero behind a link), refused before it is read into memory.
constexpr uint64_t kMaxJsonFileBytes = 64ull << 20;
// One pread of a tensor reads at most this much, so a cancelled load stops within one chunk.
constexpr size_t kReadChunkBytes = 64ull << 20;

std::string ErrnoText() { return std::strerror(errno); }

uint32_t FloatBits(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  return bits;
}

float BitsToFloat(uint32_t bits) {
  float x;
  std::memcpy(&x, &bits, sizeof(x));
  return x;
}

// A non-negative JSON integer, or false.
bool GetU64(const json& value, uint64_t* out) {
  if (value.is_number_unsigned()) {
    *out = value.get<uint64_t>();
    return true;
  }
  if (value.is_number_integer() && value.get<int64_t>() >= 0) {
    *out = static_cast<uint64_t>(value.get<int64_t>());
    return true;
  }
  return false;
}

// A tensor of one file: its view (pointing into the file's mapping) and where its bytes start
// in the file.
struct ParsedTensor {
  std::string name;
  TensorView view;
  uint64_t file_offset = 0;
};

// Parses one file's header, `header_text` (the JSON after the 8-byte length), of a file of
// `file_size` bytes whose mapping starts at `mapped` (views point into it), appending its
// tensors to `out`. Every error names `path`.
absl::Status ParseSafetensors(const std::string& path, const std::string& header_text,
                              uint64_t file_size, const uint8_t* mapped,
                              std::vector<ParsedTensor>* out) {
  const uint64_t buffer_start = 8 + header_text.size();
  const uint8_t* buffer = mapped == nullptr ? nullptr : mapped + buffer_start;
  const uint64_t buffer_size = file_size - buffer_start;
  const size_t first = out->size();

  // nlohmann keeps the last of duplicate keys silently; a duplicated tensor name is corruption.
  std::set<std::string> keys;
  std::string duplicate;
  json::parser_callback_t on_event = [&](int depth, json::parse_event_t event, json& parsed) {
    if (event == json::parse_event_t::key && depth == 1 &&
        !keys.insert(parsed.get<std::string>()).second && duplicate.empty()) {
      duplicate = parsed.get<std::string>();
    }
    return true;
  };
  json header = json::parse(header_text, on_event, /*allow_exceptions=*/false);
  if (header.is_discarded() || !header.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": header is not a valid JSON object"));
  }
  if (!duplicate.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": tensor '", duplicate, "' appears twice in the header"));
  }

  struct Range {
    uint64_t begin, end;
    const std::string* name;
  };
  std::vector<Range> ranges;
  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") continue;
    const std::string where = absl::StrCat(path, ": tensor '", name, "'");
    if (!entry.is_object() || !entry.contains("dtype") || !entry["dtype"].is_string() ||
        !entry.contains("shape") || !entry["shape"].is_array() || !entry.contains("data_offsets") ||
        !entry["data_offsets"].is_array()) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": entry needs a string \"dtype\", an array \"shape\" and \"data_offsets\""));
    }
    absl::StatusOr<DType> dtype = ParseDType(entry["dtype"].get<std::string>());
    if (!dtype.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": ", dtype.status().message()));
    }
    TensorView view;
    view.dtype = *dtype;
    uint64_t expected_bytes = DTypeSize(*dtype);
    for (const json& dim : entry["shape"]) {
      uint64_t d;
      if (!GetU64(dim, &d) || d > static_cast<uint64_t>(INT64_MAX) ||
          __builtin_mul_overflow(expected_bytes, d, &expected_bytes)) {
        return absl::InvalidArgumentError(
            absl::StrCat(where, ": bad shape ", entry["shape"].dump()));
      }
      view.shape.push_back(static_cast<int64_t>(d));
    }
    const json& offsets = entry["data_offsets"];
    uint64_t begin, end;
    if (offsets.size() != 2 || !GetU64(offsets[0], &begin) || !GetU64(offsets[1], &end)) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": data_offsets must be two non-negative integers, got ", offsets.dump()));
    }
    if (end < begin) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": data_offsets end ", end, " is before begin ", begin));
    }
    if (end > buffer_size) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": data_offsets [", begin, ", ", end,
                                                     "] run past the data buffer of ", buffer_size,
                                                     " bytes"));
    }
    if (end - begin != expected_bytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": holds ", end - begin, " bytes but shape ", ShapeToString(view.shape), " x ",
          DTypeName(*dtype), " needs ", expected_bytes));
    }
    view.data = buffer == nullptr ? nullptr : buffer + begin;
    view.nbytes = end - begin;
    out->push_back(ParsedTensor{name, std::move(view), buffer_start + begin});
    ranges.push_back({begin, end, nullptr});
  }
  for (size_t i = 0; i < ranges.size(); ++i) ranges[i].name = &(*out)[first + i].name;

  std::sort(ranges.begin(), ranges.end(), [](const Range& a, const Range& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  const Range* previous = nullptr;
  for (const Range& range : ranges) {
    if (range.begin == range.end) continue;  // empty ranges cannot overlap anything
    if (previous != nullptr && range.begin < previous->end) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": tensor '", *range.name, "' bytes [", range.begin, ", ", range.end,
                       ") overlap tensor '", *previous->name, "' bytes [", previous->begin, ", ",
                       previous->end, ")"));
    }
    previous = &range;
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> ReadJsonFile(const std::string& path) {
  return ReadSmallFile(path, kMaxJsonFileBytes, "checkpoint's JSON file");
}

// Reads of tensor data: a short read means the file changed under the reader, which the caller
// should hear how to avoid.
absl::Status ReadAt(int fd, const std::string& path, uint64_t offset, size_t size, uint8_t* out) {
  absl::Status s = ReadFileAt(fd, path, offset, size, out);
  if (!absl::IsAborted(s)) return s;
  return absl::AbortedError(absl::StrCat(
      s.message(), "; write a new checkpoint to a directory of its own and update from that"));
}

bool FileExists(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0;
}

// Whether the directory holds an entry named `path`, however it resolves: a symlink loop or a
// dangling link where the weights belong is then opened, and its error names it ("Too many
// levels of symbolic links"), not "no weights in DIR".
bool EntryExists(const std::string& path) {
  struct stat st;
  return ::lstat(path.c_str(), &st) == 0;
}

}  // namespace

// One opened file of the checkpoint. The descriptor stays open for Read; the mapping serves
// TensorView::data. The size and modification time at open tell whether it changed since.
struct Checkpoint::File {
  std::string path;
  int fd = -1;
  const uint8_t* data = nullptr;
  uint64_t size = 0;
  struct timespec mtime = {};

  File() = default;
  File(const File&) = delete;
  File& operator=(const File&) = delete;
  ~File() {
    if (data != nullptr) ::munmap(const_cast<uint8_t*>(data), size);
    if (fd >= 0) ::close(fd);
  }

  static absl::StatusOr<std::unique_ptr<File>> Open(const std::string& path) {
    struct stat st;
    absl::StatusOr<int> fd = OpenRegularFile(path, &st);
    if (!fd.ok()) return fd.status();
    auto file = std::make_unique<File>();
    file->path = path;
    file->fd = *fd;
    file->size = static_cast<uint64_t>(st.st_size);
    file->mtime = st.st_mtim;
    // mmap rejects length 0; such a file is reported as too short by the parser.
    if (file->size > 0) {
      void* p = ::mmap(nullptr, file->size, PROT_READ, MAP_PRIVATE, file->fd, 0);
      if (p == MAP_FAILED) return absl::InternalError(absl::StrCat(path, ": mmap: ", ErrnoText()));
      file->data = static_cast<const uint8_t*>(p);
    }
    return file;
  }

  // The header's JSON text, read (not mapped) after checking its length against the file.
  absl::StatusOr<std::string> ReadHeader() const {
    if (size < 8) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": file is ", size, " bytes, shorter than the 8-byte header length"));
    }
    uint64_t header_len;
    if (absl::Status s = ReadAt(fd, path, 0, 8, reinterpret_cast<uint8_t*>(&header_len)); !s.ok()) {
      return s;
    }
    if (header_len > size - 8 || header_len > kMaxHeaderBytes) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": header length ", header_len, " exceeds the file size ", size));
    }
    std::string header(header_len, '\0');
    if (absl::Status s = ReadAt(fd, path, 8, header_len, reinterpret_cast<uint8_t*>(header.data()));
        !s.ok()) {
      return s;
    }
    return header;
  }
};

Checkpoint::~Checkpoint() = default;

absl::StatusOr<std::unique_ptr<Checkpoint>> Checkpoint::Open(const std::string& dir) {
  if (dir.empty()) {
    return absl::InvalidArgumentError(
        "the checkpoint path is empty; give a checkpoint directory containing config.json and "
        "model.safetensors (or model.safetensors.index.json and its shards)");
  }
  struct stat st;
  if (::stat(dir.c_str(), &st) == 0 && !S_ISDIR(st.st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat(
        dir, S_ISREG(st.st_mode) ? " is a file" : " is not a directory",
        "; expected a checkpoint directory containing config.json and model.safetensors (or "
        "model.safetensors.index.json and its shards)"));
  }
  std::unique_ptr<Checkpoint> checkpoint(new Checkpoint());
  checkpoint->dir_ = dir;
  const std::string config_path = dir + "/config.json";
  absl::StatusOr<std::string> config = ReadJsonFile(config_path);
  if (!config.ok()) return config.status();
  checkpoint->config_json_ = std::move(*config);
  // Optional: its EOS ids join config.json's (ReadModelConfig).
  const std::string generation_path = dir + "/generation_config.json";
  if (FileExists(generation_path)) {
    absl::StatusOr<std::string> generation = ReadJsonFile(generation_path);
    if (!generation.ok()) return generation.status();
    checkpoint->generation_config_json_ = std::move(*generation);
  }

  const std::string single_path = dir + "/model.safetensors";
  const std::string index_path = dir + "/model.safetensors.index.json";
  // shard file -> one tensor the index places there (for the "missing shard" message)
  std::map<std::string, std::string> shards;
  json weight_map;
  if (EntryExists(single_path)) {
    shards.emplace("model.safetensors", "");
  } else if (EntryExists(index_path)) {
    absl::StatusOr<std::string> index_text = ReadJsonFile(index_path);
    if (!index_text.ok()) return index_text.status();
    json index = json::parse(*index_text, nullptr, /*allow_exceptions=*/false);
    if (index.is_discarded() || !index.is_object() || !index.contains("weight_map") ||
        !index["weight_map"].is_object()) {
      return absl::InvalidArgumentError(
          absl::StrCat(index_path, ": not a JSON object with a \"weight_map\" object"));
    }
    weight_map = std::move(index["weight_map"]);
    for (const auto& [name, file] : weight_map.items()) {
      if (!file.is_string() || file.get<std::string>().empty() ||
          file.get<std::string>()[0] == '/' ||
          file.get<std::string>().find("..") != std::string::npos) {
        return absl::InvalidArgumentError(
            absl::StrCat(index_path, ": tensor '", name, "' maps to ", file.dump(),
                         ", not a file name inside the checkpoint directory"));
      }
      shards.emplace(file.get<std::string>(), name);
    }
  } else {
    return absl::NotFoundError(
        absl::StrCat("no weights in ", dir, ": looked for ", single_path, " and ", index_path));
  }

  for (const auto& [file_name, example_tensor] : shards) {
    const std::string path = dir + "/" + file_name;
    absl::StatusOr<std::unique_ptr<File>> file = File::Open(path);
    if (!file.ok()) {
      if (absl::IsNotFound(file.status()) && !example_tensor.empty()) {
        return absl::NotFoundError(absl::StrCat("shard ", path, " (holding tensor '",
                                                example_tensor, "' per ", index_path,
                                                ") is missing"));
      }
      return file.status();
    }
    absl::StatusOr<std::string> header = (*file)->ReadHeader();
    if (!header.ok()) return header.status();
    std::vector<ParsedTensor> tensors;
    absl::Status parsed = ParseSafetensors(path, *header, (*file)->size, (*file)->data, &tensors);
    if (!parsed.ok()) return parsed;
    for (ParsedTensor& t : tensors) {
      if (checkpoint->tensors_.count(t.name) != 0) {
        return absl::InvalidArgumentError(
            absl::StrCat(path, ": tensor '", t.name, "' also appears in another shard of ", dir));
      }
      checkpoint->tensors_.emplace(
          t.name, Entry{std::move(t.view), checkpoint->files_.size(), t.file_offset});
    }
    checkpoint->files_.push_back(std::move(*file));
  }

  for (const auto& [name, file] : weight_map.items()) {
    if (checkpoint->tensors_.count(name) == 0) {
      return absl::InvalidArgumentError(absl::StrCat(index_path, " places tensor '", name, "' in ",
                                                     dir, "/", file.get<std::string>(),
                                                     ", which does not contain it"));
    }
  }
  ROLLOUT_RETURN_IF_ERROR(checkpoint->SplitFusedExperts());
  return checkpoint;
}

absl::Status Checkpoint::SplitFusedExperts() {
  const absl::string_view kGateUp = "mlp.experts.gate_up_proj";
  const absl::string_view kDown = "mlp.experts.down_proj";
  std::vector<std::string> fused;
  for (const auto& [name, entry] : tensors_) {
    if (absl::EndsWith(name, kGateUp) || absl::EndsWith(name, kDown)) fused.push_back(name);
  }
  for (const std::string& name : fused) {
    const Entry entry = tensors_.at(name);
    const std::vector<int64_t>& shape = entry.view.shape;
    const bool gate_up = absl::EndsWith(name, kGateUp);
    if (shape.size() != 3 || (gate_up && shape[1] % 2 != 0)) {
      return absl::InvalidArgumentError(absl::StrCat(
          dir_, ": fused expert tensor '", name, "' has shape ", ShapeToString(shape),
          gate_up ? ", expected [experts, 2 * moe_intermediate_size, hidden]"
                  : ", expected [experts, hidden, moe_intermediate_size]"));
    }
    const std::string prefix =
        name.substr(0, name.size() - (gate_up ? kGateUp.size() : kDown.size())) + "mlp.experts.";
    // Expert e's slice of [E, rows, cols] is contiguous; gate_up's rows are its gate rows,
    // then its up rows (transformers 5 concatenates them in that order).
    const int64_t rows = gate_up ? shape[1] / 2 : shape[1], cols = shape[2];
    const size_t part_bytes = static_cast<size_t>(rows * cols) * DTypeSize(entry.view.dtype);
    std::vector<std::pair<std::string, size_t>> parts;  // name, byte offset in the fused tensor
    for (int64_t e = 0; e < shape[0]; ++e) {
      const std::string expert = absl::StrCat(prefix, e, ".");
      if (gate_up) {
        parts.emplace_back(expert + "gate_proj.weight", (2 * e) * part_bytes);
        parts.emplace_back(expert + "up_proj.weight", (2 * e + 1) * part_bytes);
      } else {
        parts.emplace_back(expert + "down_proj.weight", e * part_bytes);
      }
    }
    for (const auto& [part, offset] : parts) {
      if (tensors_.count(part) != 0) {
        return absl::InvalidArgumentError(absl::StrCat(dir_, ": tensor '", part,
                                                       "' is given twice: on its own and in the "
                                                       "fused expert tensor '",
                                                       name, "'"));
      }
      Entry split = entry;
      split.view.shape = {rows, cols};
      split.view.data = entry.view.data == nullptr ? nullptr : entry.view.data + offset;
      split.view.nbytes = part_bytes;
      split.file_offset = entry.file_offset + offset;
      tensors_.emplace(part, std::move(split));
    }
    tensors_.erase(name);
  }
  return absl::OkStatus();
}

const TensorView* Checkpoint::Find(const std::string& name) const {
  auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : &it->second.view;
}

std::vector<std::string> Checkpoint::TensorNames() const {
  std::vector<std::string> names;
  names.reserve(tensors_.size());
  for (const auto& entry : tensors_) names.push_back(entry.first);
  return names;
}

absl::Status Checkpoint::Read(const std::string& name, uint8_t* out,
                              const std::function<bool()>& cancelled) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) {
    return absl::NotFoundError(absl::StrCat("tensor ", name, ": not in the checkpoint at ", dir_));
  }
  const Entry& entry = it->second;
  const File& file = *files_[entry.file];
  for (size_t done = 0; done < entry.view.nbytes; done += kReadChunkBytes) {
    if (cancelled && cancelled()) {
      return absl::CancelledError(absl::StrCat("cancelled while ", file.path, " was read"));
    }
    const size_t n = std::min(kReadChunkBytes, entry.view.nbytes - done);
    if (absl::Status s = ReadAt(file.fd, file.path, entry.file_offset + done, n, out + done);
        !s.ok()) {
      return s;
    }
  }
  return absl::OkStatus();
}

absl::Status Checkpoint::CheckUnchanged() const {
  for (const std::unique_ptr<File>& file : files_) {
    struct stat st;
    if (::fstat(file->fd, &st) != 0) {
      return absl::InternalError(absl::StrCat(file->path, ": fstat: ", ErrnoText()));
    }
    if (static_cast<uint64_t>(st.st_size) != file->size ||
        st.st_mtim.tv_sec != file->mtime.tv_sec || st.st_mtim.tv_nsec != file->mtime.tv_nsec) {
      return absl::AbortedError(
          absl::StrCat(file->path, " changed while it was read (", file->size,
                       " bytes when opened, ", st.st_size,
                       " now); write a new checkpoint to a directory of its own and update from "
                       "that"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<float>> Checkpoint::ReadF32(const std::string& name,
                                                       const std::vector<int64_t>& shape) const {
  const TensorView* view = Find(name);
  if (view == nullptr) {
    return absl::NotFoundError(absl::StrCat("tensor ", name, ": not in the checkpoint at ", dir_));
  }
  if (view->shape != shape) {
    return absl::InvalidArgumentError(absl::StrCat("tensor ", name, ": expected shape ",
                                                   ShapeToString(shape), ", checkpoint has ",
                                                   ShapeToString(view->shape)));
  }
  const size_t count = view->nbytes / DTypeSize(view->dtype);
  std::vector<float> out(count);
  if (view->dtype == DType::kF32) {
    if (absl::Status s = Read(name, reinterpret_cast<uint8_t*>(out.data())); !s.ok()) return s;
    return out;
  }
  std::vector<uint16_t> half(count);
  if (absl::Status s = Read(name, reinterpret_cast<uint8_t*>(half.data())); !s.ok()) return s;
  for (size_t i = 0; i < count; ++i) {
    out[i] = view->dtype == DType::kBF16 ? BF16ToF32(half[i]) : F16ToF32(half[i]);
  }
  return out;
}

const char* DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return "F32";
    case DType::kF16:
      return "F16";
    case DType::kBF16:
      return "BF16";
  }
  return "?";
}

size_t DTypeSize(DType dtype) { return dtype == DType::kF32 ? 4 : 2; }

absl::StatusOr<DType> ParseDType(std::string_view name) {
  for (DType dtype : {DType::kF32, DType::kF16, DType::kBF16}) {
    if (name == DTypeName(dtype)) return dtype;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unsupported dtype '", std::string(name), "' (supported: F32, F16, BF16)"));
}

std::string ShapeToString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

absl::Status WriteSafetensorsStreaming(const std::string& path, std::vector<TensorMeta> tensors,
                                       const TensorProducer& produce) {
  std::sort(tensors.begin(), tensors.end(),
            [](const TensorMeta& a, const TensorMeta& b) { return a.name < b.name; });
  json header = json::object();
  header["__metadata__"] = {{"format", "pt"}};
  std::vector<uint64_t> sizes;
  uint64_t offset = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const TensorMeta& t = tensors[i];
    if (t.name.empty() || t.name == "__metadata__" || (i > 0 && t.name == tensors[i - 1].name)) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": tensor name '", t.name, "' is empty, reserved or repeated"));
    }
    uint64_t bytes = DTypeSize(t.dtype);
    for (int64_t d : t.shape) {
      if (d < 0 || __builtin_mul_overflow(bytes, static_cast<uint64_t>(d), &bytes)) {
        return absl::InvalidArgumentError(
            absl::StrCat(path, ": tensor '", t.name, "' has bad shape ", ShapeToString(t.shape)));
      }
    }
    header[t.name] = {{"dtype", DTypeName(t.dtype)},
                      {"shape", t.shape},
                      {"data_offsets", {offset, offset + bytes}}};
    sizes.push_back(bytes);
    offset += bytes;
  }
  std::string header_text = header.dump();
  // Pad so the data buffer starts 8-byte aligned in the file (and so in the mapping).
  header_text.append((8 - (8 + header_text.size()) % 8) % 8, ' ');
  const uint64_t header_len = header_text.size();

  const std::string temp_path = absl::StrCat(path, ".tmp.", ::getpid());
  std::FILE* f = std::fopen(temp_path.c_str(), "wb");
  if (f == nullptr) return absl::InternalError(absl::StrCat(temp_path, ": ", ErrnoText()));
  auto fail = [&](const absl::Status& status) {
    std::fclose(f);
    std::remove(temp_path.c_str());
    return status;
  };
  auto write_error = [&]() {
    return absl::InternalError(absl::StrCat(temp_path, ": write failed: ", ErrnoText()));
  };
  if (std::fwrite(&header_len, sizeof(header_len), 1, f) != 1 ||
      std::fwrite(header_text.data(), 1, header_len, f) != header_len) {
    return fail(write_error());
  }
  for (size_t i = 0; i < tensors.size(); ++i) {
    uint64_t written = 0;
    ByteSink sink = [&](const uint8_t* data, size_t size) -> absl::Status {
      if (written + size > sizes[i]) {
        return absl::InternalError(absl::StrCat("tensor '", tensors[i].name, "': producer wrote ",
                                                written + size, " bytes, expected ", sizes[i]));
      }
      if (size > 0 && std::fwrite(data, 1, size, f) != size) return write_error();
      written += size;
      return absl::OkStatus();
    };
    absl::Status status = produce(tensors[i], sink);
    if (!status.ok()) return fail(status);
    if (written != sizes[i]) {
      return fail(
          absl::InternalError(absl::StrCat("tensor '", tensors[i].name, "': producer wrote ",
                                           written, " bytes, expected ", sizes[i])));
    }
  }
  if (std::fflush(f) != 0 || ::fsync(::fileno(f)) != 0) return fail(write_error());
  if (std::fclose(f) != 0) {
    std::remove(temp_path.c_str());
    return write_error();
  }
  if (std::rename(temp_path.c_str(), path.c_str()) != 0) {
    const std::string message = absl::StrCat("rename ", temp_path, " -> ", path, ": ", ErrnoText());
    std::remove(temp_path.c_str());
    return absl::InternalError(message);
  }
  return absl::OkStatus();
}

std::vector<HostTensorView> ViewsOf(const std::vector<HostTensor>& tensors) {
  return std::vector<HostTensorView>(tensors.begin(), tensors.end());
}

absl::Status WriteSafetensors(const std::string& path, const std::vector<HostTensor>& tensors) {
  std::vector<TensorMeta> metas;
  std::map<std::string, const HostTensor*> by_name;
  for (const HostTensor& t : tensors) {
    metas.push_back({t.name, t.dtype, t.shape});
    by_name.emplace(t.name, &t);
  }
  return WriteSafetensorsStreaming(
      path, std::move(metas), [&](const TensorMeta& meta, const ByteSink& sink) {
        const HostTensor& t = *by_name.at(meta.name);
        return sink(t.bytes.data(), t.bytes.size());  // a wrong byte count fails in the writer
      });
}

uint16_t F32ToBF16(float x) {
  const uint32_t bits = FloatBits(x);
  if ((bits & 0x7fffffffu) > 0x7f800000u) {
    // NaN: keep the sign and force a quiet-NaN mantissa bit so truncation cannot make it inf.
    return static_cast<uint16_t>((bits >> 16) | 0x0040u);
  }
  // Round to nearest even: add 0x7fff plus the lowest kept bit, then truncate. Overflow past the
  // largest finite bf16 carries into the exponent and correctly yields inf.
  const uint32_t lsb = (bits >> 16) & 1u;
  return static_cast<uint16_t>((bits + 0x7fffu + lsb) >> 16);
}

float BF16ToF32(uint16_t x) { return BitsToFloat(static_cast<uint32_t>(x) << 16); }

uint16_t F32ToF16(float x) {
  const uint32_t bits = FloatBits(x);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t abs = bits & 0x7fffffffu;
  if (abs > 0x7f800000u) return sign | 0x7e00u;  // NaN (quiet)
  // 65520 is halfway between the largest f16 (65504, odd mantissa) and 65536: ties-to-even
  // rounds it, and everything above, to inf.
  if (abs >= 0x477ff000u) return sign | 0x7c00u;
  const int32_t exponent = static_cast<int32_t>(abs >> 23) - 127;
  uint32_t mantissa = abs & 0x7fffffu;
  if (exponent >= -14) {
    // Normal f16: keep 10 mantissa bits, round to nearest even on the 13 dropped bits. A
    // mantissa carry bumps the exponent, which is the correct result (up to inf, handled above).
    uint32_t half = (static_cast<uint32_t>(exponent + 15) << 10) | (mantissa >> 13);
    const uint32_t rest = mantissa & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (half & 1u))) ++half;
    return sign | static_cast<uint16_t>(half);
  }
  if (exponent < -25) return sign;  // below half the smallest subnormal: rounds to zero
  // Subnormal f16: value = m * 2^-24 with m = full_mantissa * 2^(exponent - 23 + 24).
  mantissa |= 0x800000u;            // implicit leading one
  const int shift = -exponent - 1;  // 14..24: bits dropped from the 24-bit significand
  uint32_t half = mantissa >> shift;
  const uint32_t rest = mantissa & ((1u << shift) - 1);
  const uint32_t halfway = 1u << (shift - 1);
  if (rest > halfway || (rest == halfway && (half & 1u))) ++half;  // may become the min normal
  return sign | static_cast<uint16_t>(half);
}

float F16ToF32(uint16_t x) {
  const uint32_t sign = static_cast<uint32_t>(x & 0x8000u) << 16;
  const uint32_t exponent = (x >> 10) & 0x1fu;
  uint32_t mantissa = x & 0x3ffu;
  if (exponent == 0x1f) return BitsToFloat(sign | 0x7f800000u | (mantissa << 13));
  if (exponent != 0) return BitsToFloat(sign | ((exponent + 112) << 23) | (mantissa << 13));
  if (mantissa == 0) return BitsToFloat(sign);
  // Subnormal: normalise so the leading one becomes implicit.
  int32_t e = -14;
  while ((mantissa & 0x400u) == 0) {
    mantissa <<= 1;
    --e;
  }
  mantissa &= 0x3ffu;
  return BitsToFloat(sign | (static_cast<uint32_t>(e + 127) << 23) | (mantissa << 13));
}

}  // namespace rollout
