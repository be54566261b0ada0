#include "client/weights_stream.h"

#include <grpcpp/generic/generic_stub.h>

#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "google/protobuf/wire_format_lite.h"

namespace rollout::client_internal {
namespace {

using google::protobuf::internal::WireFormatLite;

constexpr char kUpdateWeightsMethod[] = "/rollout.v1.RolloutService/UpdateWeights";

absl::Status FromGrpc(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

void ReleaseSlice(void* tracker) { static_cast<SliceTracker*>(tracker)->Release(); }

// Runs the generic call's operations one at a time: start one, then Wait for it.
class Ops {
 public:
  ~Ops() {
    cq_.Shutdown();
    void* tag;
    bool ok;
    while (cq_.Next(&tag, &ok)) {
    }
  }
  grpc::CompletionQueue* cq() { return &cq_; }
  void* tag() { return this; }
  // Whether the operation started last succeeded.
  bool Wait() {
    void* tag;
    bool ok = false;
    return cq_.Next(&tag, &ok) && ok;
  }

 private:
  grpc::CompletionQueue cq_;
};

}  // namespace

void SliceTracker::Add() {
  std::lock_guard<std::mutex> lock(mu_);
  ++held_;
}

void SliceTracker::Release() {
  std::lock_guard<std::mutex> lock(mu_);
  if (--held_ == 0) none_.notify_all();
}

void SliceTracker::WaitForNone() {
  std::unique_lock<std::mutex> lock(mu_);
  none_.wait(lock, [this] { return held_ == 0; });
}

grpc::ByteBuffer DataChunkMessage(const RawChunk& chunk, SliceTracker* tracker) {
  // TensorData's name and offset as protobuf writes them, then the data field's tag and length;
  // the data bytes follow in their own slice.
  rollout::v1::TensorData fields;
  fields.set_name(chunk.name);
  fields.set_offset(chunk.offset);
  const std::string name_and_offset = fields.SerializeAsString();
  const size_t data_field_prefix =
      1 + google::protobuf::io::CodedOutputStream::VarintSize64(chunk.size);
  std::string prefix;
  {
    google::protobuf::io::StringOutputStream stream(&prefix);
    google::protobuf::io::CodedOutputStream out(&stream);
    constexpr int kDataItem = 2, kDataField = 3;  // WeightsChunk.data, TensorData.data
    out.WriteTag(WireFormatLite::MakeTag(kDataItem, WireFormatLite::WIRETYPE_LENGTH_DELIMITED));
    out.WriteVarint64(name_and_offset.size() + data_field_prefix + chunk.size);
    out.WriteRaw(name_and_offset.data(), static_cast<int>(name_and_offset.size()));
    out.WriteTag(WireFormatLite::MakeTag(kDataField, WireFormatLite::WIRETYPE_LENGTH_DELIMITED));
    out.WriteVarint64(chunk.size);
  }
  tracker->Add();
  grpc::Slice slices[2] = {grpc::Slice(prefix), grpc::Slice(const_cast<uint8_t*>(chunk.data),
                                                            chunk.size, &ReleaseSlice, tracker)};
  return grpc::ByteBuffer(slices, 2);
}

absl::StatusOr<rollout::v1::UpdateWeightsResponse> StreamUpdateWeights(
    const std::shared_ptr<grpc::Channel>& channel, grpc::ClientContext* context,
    SliceTracker* tracker, const rollout::v1::WeightsHeader& header,
    const std::function<bool(RawChunk*)>& next_chunk) {
  grpc::Status status;
  grpc::ByteBuffer answer;
  bool answered = false, write_ok = false;
  {
    Ops ops;
    grpc::GenericStub stub(channel);
    std::unique_ptr<grpc::GenericClientAsyncReaderWriter> call =
        stub.PrepareCall(context, kUpdateWeightsMethod, ops.cq());
    call->StartCall(ops.tag());
    if (ops.Wait()) {
      rollout::v1::WeightsChunk first;
      *first.mutable_header() = header;
      grpc::Slice bytes(first.SerializeAsString());
      call->Write(grpc::ByteBuffer(&bytes, 1), ops.tag());
      write_ok = ops.Wait();
      RawChunk chunk;
      while (write_ok) {
        chunk = RawChunk{};
        if (!next_chunk(&chunk)) break;
        call->Write(DataChunkMessage(chunk, tracker), ops.tag());
        write_ok = ops.Wait();
      }
      // A failed write means the call has ended, nearly always because the server answered
      // early with an error; Finish returns that answer. Half-closing first lets the server see
      // the end of a complete stream.
      if (write_ok) {
        call->WritesDone(ops.tag());
        ops.Wait();
      }
      call->Read(&answer, ops.tag());
      answered = ops.Wait();
    }
    call->Finish(&status, ops.tag());
    ops.Wait();
  }
  if (!status.ok()) return FromGrpc(status);
  if (!write_ok) {
    // Not expected from a correct server: it must read the whole stream before answering OK.
    return absl::InternalError(
        "the server answered OK before the whole update stream was sent; the update may be "
        "incomplete");
  }
  if (!answered) return absl::InternalError("the server answered OK without a response message");
  grpc::Slice flat;
  rollout::v1::UpdateWeightsResponse response;
  if (!answer.DumpToSingleSlice(&flat).ok() ||
      !response.ParseFromArray(flat.begin(), static_cast<int>(flat.size()))) {
    return absl::InternalError("the server's UpdateWeightsResponse does not parse");
  }
  return response;
}

}  // namespace rollout::client_internal
