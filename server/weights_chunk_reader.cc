#include "server/weights_chunk_reader.h"

#include <algorithm>
#include <cstring>
#include <limits>

#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream.h"
#include "google/protobuf/wire_format_lite.h"

namespace rollout {
namespace {

using google::protobuf::internal::WireFormatLite;
using google::protobuf::io::CodedInputStream;

// Longer lengths than CodedInputStream can count: left to protobuf (which refuses them).
constexpr uint32_t kMaxLength = std::numeric_limits<int32_t>::max();

// The message's slices as one stream, without copying them.
class SliceInputStream final : public google::protobuf::io::ZeroCopyInputStream {
 public:
  explicit SliceInputStream(const std::vector<grpc::Slice>& slices) : slices_(slices) {}

  bool Next(const void** data, int* size) override {
    while (index_ < slices_.size() && at_ == slices_[index_].size()) {
      ++index_;
      at_ = 0;
    }
    if (index_ == slices_.size()) return false;
    *data = slices_[index_].begin() + at_;
    *size = static_cast<int>(slices_[index_].size() - at_);
    position_ += *size;
    at_ = slices_[index_].size();
    return true;
  }
  void BackUp(int count) override {
    at_ -= count;
    position_ -= count;
  }
  bool Skip(int count) override {
    const void* data;
    int size;
    while (count > 0) {
      if (!Next(&data, &size)) return false;
      if (size > count) {
        BackUp(size - count);
        return true;
      }
      count -= size;
    }
    return true;
  }
  int64_t ByteCount() const override { return position_; }

 private:
  const std::vector<grpc::Slice>& slices_;
  size_t index_ = 0;  // slice being read
  size_t at_ = 0;     // bytes of it consumed
  int64_t position_ = 0;
};

// Whether `s` is well-formed UTF-8 (no overlong forms, surrogates or code points past
// U+10FFFF), which protobuf requires of a proto3 string.
bool IsUtf8(const std::string& s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const auto* end = p + s.size();
  while (p < end) {
    const unsigned char c = *p;
    int n;
    uint32_t code, min;
    if (c < 0x80) {
      ++p;
      continue;
    } else if ((c & 0xE0) == 0xC0) {
      n = 1, code = c & 0x1F, min = 0x80;
    } else if ((c & 0xF0) == 0xE0) {
      n = 2, code = c & 0x0F, min = 0x800;
    } else if ((c & 0xF8) == 0xF0) {
      n = 3, code = c & 0x07, min = 0x10000;
    } else {
      return false;
    }
    if (end - p <= n) return false;
    for (int i = 1; i <= n; ++i) {
      if ((p[i] & 0xC0) != 0x80) return false;
      code = code << 6 | (p[i] & 0x3F);
    }
    if (code < min || code > 0x10FFFF || (code >= 0xD800 && code <= 0xDFFF)) return false;
    p += n + 1;
  }
  return true;
}

// TensorData's fields, up to the limit pushed on `in`.
bool ReadTensorData(CodedInputStream* in, TensorDataChunk* chunk) {
  constexpr uint32_t kName = 1, kOffset = 2, kData = 3;
  bool has_data = false;
  while (const uint32_t tag = in->ReadTag()) {
    const uint32_t field = WireFormatLite::GetTagFieldNumber(tag);
    const WireFormatLite::WireType type = WireFormatLite::GetTagWireType(tag);
    if (field == kName) {
      if (type != WireFormatLite::WIRETYPE_LENGTH_DELIMITED) return false;
      if (!WireFormatLite::ReadString(in, &chunk->name)) return false;
    } else if (field == kOffset) {
      if (type != WireFormatLite::WIRETYPE_VARINT) return false;
      if (!in->ReadVarint64(&chunk->offset)) return false;
    } else if (field == kData) {
      if (type != WireFormatLite::WIRETYPE_LENGTH_DELIMITED) return false;
      uint32_t size;
      if (!in->ReadVarint32(&size) || size > kMaxLength) return false;
      chunk->data_begin = static_cast<size_t>(in->CurrentPosition());
      chunk->data_size = size;
      if (!in->Skip(static_cast<int>(size))) return false;
      has_data = true;
    } else if (!WireFormatLite::SkipField(in, tag)) {
      return false;
    }
  }
  if (!has_data) chunk->data_size = 0;
  return in->ConsumedEntireMessage() && IsUtf8(chunk->name);
}

size_t TotalSize(const std::vector<grpc::Slice>& slices) {
  size_t size = 0;
  for (const grpc::Slice& slice : slices) size += slice.size();
  return size;
}

}  // namespace

bool ReadTensorDataChunk(const std::vector<grpc::Slice>& message, TensorDataChunk* chunk) {
  constexpr uint32_t kHeaderItem = 1, kDataItem = 2;
  *chunk = TensorDataChunk{};
  SliceInputStream stream(message);
  CodedInputStream in(&stream);
  bool has_item = false;
  while (const uint32_t tag = in.ReadTag()) {
    const uint32_t field = WireFormatLite::GetTagFieldNumber(tag);
    if (field == kHeaderItem) return false;
    if (field != kDataItem) {
      if (!WireFormatLite::SkipField(&in, tag)) return false;
      continue;
    }
    // A second data item would be merged into the first by protobuf: leave that to it.
    if (has_item ||
        WireFormatLite::GetTagWireType(tag) != WireFormatLite::WIRETYPE_LENGTH_DELIMITED) {
      return false;
    }
    uint32_t length;
    if (!in.ReadVarint32(&length) || length > kMaxLength) return false;
    // The input ending early looks like the end of the limit to ReadTag: check where it ended.
    const int64_t end = static_cast<int64_t>(in.CurrentPosition()) + length;
    const CodedInputStream::Limit limit = in.PushLimit(static_cast<int>(length));
    if (!ReadTensorData(&in, chunk) || in.CurrentPosition() != end) return false;
    in.PopLimit(limit);
    has_item = true;
  }
  return has_item && in.ConsumedEntireMessage() &&
         static_cast<size_t>(in.CurrentPosition()) == TotalSize(message);
}

void CopyMessageBytes(const std::vector<grpc::Slice>& message, size_t begin, size_t size,
                      uint8_t* out) {
  for (const grpc::Slice& slice : message) {
    if (size == 0) return;
    if (begin >= slice.size()) {
      begin -= slice.size();
      continue;
    }
    const size_t n = std::min(size, slice.size() - begin);
    std::memcpy(out, slice.begin() + begin, n);
    out += n;
    size -= n;
    begin = 0;
  }
}

}  // namespace rollout
