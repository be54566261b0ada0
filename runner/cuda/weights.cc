// CudaModelRunner's weights: each rank's allocations laid out, every checkpoint tensor bound to
// the pieces the ranks hold of it (weight_binding.h), and the writes through those bindings --
// from a checkpoint, generated on the GPU (synthetic models), or a weight update.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/cuda_device_scope.h"
#include "common/cuda_status.h"
#include "common/status.h"
#include "glog/logging.h"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/tensor_parallel.h"
#include "model/dtype_cast.h"
#include "model/model_config.h"
#include "model/random_model.h"
#include "model/safetensors.h"
#include "model/weight_spec.h"
#include "runner/cuda/cuda_model_runner.h"
#include "runner/cuda/cuda_runner_state.h"

namespace rollout {
namespace {

using cuda::bf16;
using cuda_runner_internal::Binding;
using cuda_runner_internal::LayerWeights;
using cuda_runner_internal::Piece;
using cuda_runner_internal::RankState;

int64_t NumElements(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// Hands out 256-byte aligned pieces of one allocation; first a sizing pass, then the real one.
class Arena {
 public:
  explicit Arena(char* base) : base_(base) {}
  template <typename T>
  T* Take(int64_t count) {
    const int64_t offset = used_;
    used_ += (count * static_cast<int64_t>(sizeof(T)) + 255) / 256 * 256;
    return base_ == nullptr ? nullptr : reinterpret_cast<T*>(base_ + offset);
  }
  int64_t used() const { return used_; }

 private:
  char* base_;
  int64_t used_ = 0;
};

// One rank's weights out of two arenas (bf16 matrices, fp32 vectors). LayOutWeights runs it
// twice over the same sequence of Take() calls: sizes, then pointers.
void LayOutRank(const ModelConfig& c, int64_t vocab_rows, RankState& rk, Arena* mats, Arena* vecs) {
  const int64_t h = c.hidden_size, hd = c.head_dim;
  const int64_t qkv_rows = (rk.heads + 2 * rk.kv_heads) * hd;
  rk.embed = mats->Take<bf16>(vocab_rows * h);
  rk.lm_head = c.tie_word_embeddings ? rk.embed : mats->Take<bf16>(vocab_rows * h);
  rk.final_norm = vecs->Take<float>(h);
  rk.layers.assign(c.num_layers, LayerWeights{});
  int32_t moe_layers = 0;
  for (int32_t i = 0; i < c.num_layers; ++i) {
    LayerWeights& l = rk.layers[i];
    l.qkv = mats->Take<bf16>(qkv_rows * h);
    l.o = mats->Take<bf16>(h * rk.heads * hd);
    if (c.IsMoeLayer(i)) {  // tp = 1 only (CheckSupported): every expert whole
      const int64_t e = c.num_experts, mi = c.moe_intermediate_size;
      l.router = mats->Take<bf16>(e * h);
      l.expert_gate_up = mats->Take<bf16>(e * 2 * mi * h);
      l.expert_down = mats->Take<bf16>(e * h * mi);
      l.moe_layer = moe_layers++;
    } else {
      l.gate_up = mats->Take<bf16>(2 * rk.inter * h);
      l.down = mats->Take<bf16>(h * rk.inter);
    }
    l.input_norm = vecs->Take<float>(h);
    l.post_norm = vecs->Take<float>(h);
    if (c.qk_norm) {
      l.q_norm = vecs->Take<float>(hd);
      l.k_norm = vecs->Take<float>(hd);
    }
    if (c.qkv_bias) l.qkv_bias = vecs->Take<float>(qkv_rows);
  }
}

// Binds every tensor to the pieces of it each rank holds (one whole piece each at tp = 1, at the
// same places as ever, except o/down's K segments with the canonical tree).
class TensorBinder {
 public:
  TensorBinder(const ModelConfig& config, int tp, bool canonical, bool multi_device,
               std::map<std::string, Binding>* bindings)
      : c_(config),
        local_segments_(cuda::kNumKSegments / tp),
        canonical_(canonical),
        multi_device_(multi_device),
        bindings_(bindings) {}

  void BindRank(RankState& rk) {
    const int64_t h = c_.hidden_size, hd = c_.head_dim, nh = c_.num_attention_heads,
                  nkv = c_.num_key_value_heads, inter = c_.intermediate_size, vocab = c_.vocab_size;
    piece_device_ = multi_device_ ? std::optional<int>(rk.device) : std::nullopt;
    const int64_t r = rk.index, rh = rk.heads, rkv = rk.kv_heads, kvb = rk.kv_head_begin;
    Add("model.embed_tokens.weight", false, vocab, h,
        Piece{rk.embed, rk.vocab_begin, rk.vocab_end - rk.vocab_begin, 0, h});
    if (!c_.tie_word_embeddings) {
      Add("lm_head.weight", false, vocab, h,
          Piece{rk.lm_head, rk.vocab_begin, rk.vocab_end - rk.vocab_begin, 0, h});
    }
    Add("model.norm.weight", true, h, 1, Piece{rk.final_norm, 0, h, 0, 1});
    for (int i = 0; i < c_.num_layers; ++i) {
      const std::string p = absl::StrCat("model.layers.", i, ".");
      LayerWeights& l = rk.layers[i];
      Add(p + "input_layernorm.weight", true, h, 1, Piece{l.input_norm, 0, h, 0, 1});
      Add(p + "post_attention_layernorm.weight", true, h, 1, Piece{l.post_norm, 0, h, 0, 1});
      // The rank's q heads, then its KV heads' k and v rows: one fused qkv GEMM per rank.
      Add(p + "self_attn.q_proj.weight", false, nh * hd, h,
          Piece{l.qkv, r * rh * hd, rh * hd, 0, h});
      Add(p + "self_attn.k_proj.weight", false, nkv * hd, h,
          Piece{l.qkv + rh * hd * h, kvb * hd, rkv * hd, 0, h});
      Add(p + "self_attn.v_proj.weight", false, nkv * hd, h,
          Piece{l.qkv + (rh + rkv) * hd * h, kvb * hd, rkv * hd, 0, h});
      AddKSlices(p + "self_attn.o_proj.weight", rk, l.o, nh * hd);
      if (l.moe()) {
        BindExperts(p, l);
      } else {
        Add(p + "mlp.gate_proj.weight", false, inter, h,
            Piece{l.gate_up, r * rk.inter, rk.inter, 0, h});
        Add(p + "mlp.up_proj.weight", false, inter, h,
            Piece{l.gate_up + rk.inter * h, r * rk.inter, rk.inter, 0, h});
        AddKSlices(p + "mlp.down_proj.weight", rk, l.down, inter);
      }
      if (c_.qk_norm) {
        Add(p + "self_attn.q_norm.weight", true, hd, 1, Piece{l.q_norm, 0, hd, 0, 1});
        Add(p + "self_attn.k_norm.weight", true, hd, 1, Piece{l.k_norm, 0, hd, 0, 1});
      }
      if (c_.qkv_bias) {
        Add(p + "self_attn.q_proj.bias", true, nh * hd, 1,
            Piece{l.qkv_bias, r * rh * hd, rh * hd, 0, 1});
        Add(p + "self_attn.k_proj.bias", true, nkv * hd, 1,
            Piece{l.qkv_bias + rh * hd, kvb * hd, rkv * hd, 0, 1});
        Add(p + "self_attn.v_proj.bias", true, nkv * hd, 1,
            Piece{l.qkv_bias + (rh + rkv) * hd, kvb * hd, rkv * hd, 0, 1});
      }
    }
  }

 private:
  void Add(const std::string& name, bool f32, int64_t rows, int64_t cols, Piece piece) {
    piece.device = piece_device_;
    Binding& b = (*bindings_)[name];
    b.f32 = f32;
    b.rows = rows;
    b.cols = cols;
    if (piece.rows > 0 && piece.cols > 0) b.pieces.push_back(piece);
  }
  // A MoE layer's router and experts (the Hub's per-expert tensors, the served names), each
  // whole: expert e's gate and up rows at e * 2 * moe_inter rows of the fused gate/up, its down
  // at e * hidden rows of the experts' down.
  void BindExperts(const std::string& p, LayerWeights& l) {
    const int64_t h = c_.hidden_size, mi = c_.moe_intermediate_size;
    Add(p + "mlp.gate.weight", false, c_.num_experts, h, Piece{l.router, 0, c_.num_experts, 0, h});
    for (int64_t e = 0; e < c_.num_experts; ++e) {
      const std::string x = absl::StrCat(p, "mlp.experts.", e, ".");
      bf16* gate = l.expert_gate_up + e * 2 * mi * h;
      Add(x + "gate_proj.weight", false, mi, h, Piece{gate, 0, mi, 0, h});
      Add(x + "up_proj.weight", false, mi, h, Piece{gate + mi * h, 0, mi, 0, h});
      Add(x + "down_proj.weight", false, h, mi, Piece{l.expert_down + e * h * mi, 0, h, 0, mi});
    }
  }
  // A row-parallel weight [hidden, k_full]: whole, or the rank's K segments, each [hidden,
  // k_full / 8] contiguous, so a segment GEMM reads the same weight layout at every degree.
  void AddKSlices(const std::string& name, RankState& rk, bf16* w, int64_t k_full) {
    const int64_t h = c_.hidden_size;
    if (!canonical_) {
      Add(name, false, h, k_full, Piece{w, 0, h, 0, k_full});
      return;
    }
    const int64_t seg = k_full / cuda::kNumKSegments;
    for (int j = 0; j < local_segments_; ++j) {
      Add(name, false, h, k_full,
          Piece{w + j * h * seg, 0, h, (rk.index * local_segments_ + j) * seg, seg});
    }
  }

  const ModelConfig& c_;
  const int local_segments_;
  const bool canonical_, multi_device_;
  std::map<std::string, Binding>* bindings_;
  std::optional<int> piece_device_;  // the device of the rank being bound, when ranks span devices
};

// Copies a piece of a [b.rows, b.cols] tensor of `elem` bytes per element from `src` (host or
// device memory, per `kind`) to where it lives.
cudaError_t CopyPiece(const Binding& b, const Piece& p, const void* src, size_t elem,
                      cudaMemcpyKind kind, cudaStream_t stream) {
  const char* from = static_cast<const char*>(src) + (p.row_begin * b.cols + p.col_begin) * elem;
  return cudaMemcpy2DAsync(p.ptr, p.cols * elem, from, b.cols * elem, p.cols * elem, p.rows, kind,
                           stream);
}

// Copies one tensor of `count` elements in `dtype` (host bytes) to its pieces: bf16 matrices
// are rounded to nearest even, fp32 vectors widened. Synchronous.
absl::Status Upload(const Binding& dst, DType dtype, const uint8_t* data, int64_t count,
                    const std::string& name) {
  auto value = [&](int64_t i) {
    uint16_t half;
    float f;
    switch (dtype) {
      case DType::kF32:
        std::memcpy(&f, data + 4 * i, 4);
        return f;
      case DType::kF16:
        std::memcpy(&half, data + 2 * i, 2);
        return F16ToF32(half);
      case DType::kBF16:
        break;
    }
    std::memcpy(&half, data + 2 * i, 2);
    return BF16ToF32(half);
  };
  const std::string what = absl::StrCat("uploading ", name);
  // The tensor in the device's element type, on the host.
  std::vector<float> values;
  std::vector<uint16_t> converted;
  const void* src = data;
  if (dst.f32) {
    values.resize(count);
    for (int64_t i = 0; i < count; ++i) values[i] = value(i);
    src = values.data();
  } else if (dtype != DType::kBF16) {
    converted.resize(count);
    for (int64_t i = 0; i < count; ++i) converted[i] = F32ToBF16(value(i));
    src = converted.data();
  }
  const size_t elem = dst.f32 ? sizeof(float) : 2;
  if (dst.whole()) {
    return CudaError(cudaMemcpy(dst.pieces[0].ptr, src, count * elem, cudaMemcpyHostToDevice),
                     what);
  }
  for (const Piece& p : dst.pieces) {
    if (p.device.has_value()) {  // ranks on several devices: each piece with its device current
      CudaDeviceScope scope;
      ROLLOUT_RETURN_IF_ERROR(CudaError(cudaSetDevice(*p.device), what));
      ROLLOUT_RETURN_IF_ERROR(
          CudaError(CopyPiece(dst, p, src, elem, cudaMemcpyHostToDevice, 0), what));
      ROLLOUT_RETURN_IF_ERROR(CudaError(cudaStreamSynchronize(0), what));
      continue;
    }
    ROLLOUT_RETURN_IF_ERROR(
        CudaError(CopyPiece(dst, p, src, elem, cudaMemcpyHostToDevice, 0), what));
  }
  return CudaError(cudaStreamSynchronize(0), what);
}

// A tensor generated whole in `full` (count * elem bytes, on rank 0's device, by `stream`) copied
// to its pieces: on rank 0's device from `full`, on the others through the host.
absl::Status SliceIntoPieces(const Binding& dst, const cuda::DeviceBuffer& full, int64_t count,
                             size_t elem, int rank0_device, cudaStream_t stream,
                             const std::string& name) {
  std::vector<char> host;
  for (const Piece& p : dst.pieces) {
    if (p.device.has_value() && *p.device != rank0_device) {
      if (host.empty()) {
        host.resize(count * elem);
        ROLLOUT_RETURN_IF_ERROR(CudaError(cudaStreamSynchronize(stream), "generating weights"));
        ROLLOUT_RETURN_IF_ERROR(
            CudaError(cudaMemcpy(host.data(), full.get(), count * elem, cudaMemcpyDeviceToHost),
                      absl::StrCat("staging ", name)));
      }
      CudaDeviceScope scope;
      ROLLOUT_RETURN_IF_ERROR(CudaError(cudaSetDevice(*p.device), "cudaSetDevice"));
      ROLLOUT_RETURN_IF_ERROR(
          CudaError(CopyPiece(dst, p, host.data(), elem, cudaMemcpyHostToDevice, 0),
                    absl::StrCat("slicing ", name)));
      ROLLOUT_RETURN_IF_ERROR(CudaError(cudaStreamSynchronize(0), absl::StrCat("slicing ", name)));
      continue;
    }
    ROLLOUT_RETURN_IF_ERROR(
        CudaError(CopyPiece(dst, p, full.get(), elem, cudaMemcpyDeviceToDevice, stream),
                  absl::StrCat("slicing ", name)));
  }
  return absl::OkStatus();
}

// Whether a tensor given in `dtype` is stored on the device in another type (fp32 norms and
// biases; a matrix given in F16 or F32): converted on the host first.
bool NeedsConversion(const Binding& dst, DType dtype) { return dst.f32 || dtype != DType::kBF16; }

// Enqueues the copies of a bf16 tensor at `data` (host memory) to its pieces on the legacy
// stream of each piece's device, without waiting, and adds those devices to *devices. From
// pinned memory the copies run asynchronously; from pageable memory each returns once staged.
absl::Status EnqueueUpload(const Binding& dst, const uint8_t* data, const std::string& name,
                           std::vector<int>* devices) {
  const std::string what = absl::StrCat("uploading ", name);
  constexpr size_t kElem = 2;
  for (const Piece& p : dst.pieces) {
    if (!p.device.has_value()) {  // on the current device (rank 0's)
      ROLLOUT_RETURN_IF_ERROR(
          CudaError(CopyPiece(dst, p, data, kElem, cudaMemcpyHostToDevice, 0), what));
      continue;
    }
    CudaDeviceScope scope;
    ROLLOUT_RETURN_IF_ERROR(CudaError(cudaSetDevice(*p.device), what));
    ROLLOUT_RETURN_IF_ERROR(
        CudaError(CopyPiece(dst, p, data, kElem, cudaMemcpyHostToDevice, 0), what));
    if (std::find(devices->begin(), devices->end(), *p.device) == devices->end()) {
      devices->push_back(*p.device);
    }
  }
  return absl::OkStatus();
}

// Page-locked host memory from cudaHostAlloc, portable to every device's context.
class PinnedHostStaging final : public HostStagingBuffer {
 public:
  PinnedHostStaging(void* data, size_t size) : data_(static_cast<uint8_t*>(data)), size_(size) {}
  ~PinnedHostStaging() override { cudaFreeHost(data_); }
  PinnedHostStaging(const PinnedHostStaging&) = delete;
  PinnedHostStaging& operator=(const PinnedHostStaging&) = delete;
  uint8_t* data() const override { return data_; }
  size_t size() const override { return size_; }
  bool pinned() const override { return true; }

 private:
  uint8_t* const data_;
  const size_t size_;
};

void SortSpecs(std::vector<WeightSpec>* specs) {
  std::sort(specs->begin(), specs->end(),
            [](const WeightSpec& a, const WeightSpec& b) { return a.name < b.name; });
}

}  // namespace

// Each rank's two weight allocations (bf16 matrices, fp32 vectors) on its device.
absl::Status CudaModelRunner::LayOutWeights() {
  State& s = *state_;
  for (RankState& rk : s.ranks) {
    ROLLOUT_RETURN_IF_ERROR(s.SetDevice(rk));
    Arena size_mats(nullptr), size_vecs(nullptr);
    LayOutRank(config_, s.vocab_rows, rk, &size_mats, &size_vecs);
    ROLLOUT_RETURN_IF_ERROR(
        CudaError(rk.weights_bf16.Allocate(size_mats.used()),
                  absl::StrCat("allocating ", size_mats.used(), " bytes of bf16 weights")));
    ROLLOUT_RETURN_IF_ERROR(
        CudaError(rk.weights_f32.Allocate(size_vecs.used()), "allocating fp32 weights"));
    if (s.tp > 1) {  // the vocab shards' padding rows stay zero
      ROLLOUT_RETURN_IF_ERROR(CudaError(
          cudaMemset(rk.weights_bf16.get(), 0, rk.weights_bf16.bytes()), "clearing weights"));
    }
    s.weight_bytes += size_mats.used() + size_vecs.used();
    Arena mats(rk.weights_bf16.get<char>()), vecs(rk.weights_f32.get<char>());
    LayOutRank(config_, s.vocab_rows, rk, &mats, &vecs);
  }
  return s.SetDevice(s.ranks[0]);
}

absl::Status CudaModelRunner::BindTensors() {
  State& s = *state_;
  TensorBinder binder(config_, s.tp, s.canonical, s.multi_device, &s.bindings);
  for (RankState& rk : s.ranks) binder.BindRank(rk);
  for (const TensorSpec& spec : ExpectedTensors(config_)) {
    auto it = s.bindings.find(spec.name);
    if (it == s.bindings.end() || it->second.pieces.empty()) {
      return absl::InternalError(absl::StrCat("no device destination for tensor ", spec.name));
    }
  }
  return absl::OkStatus();
}

absl::Status CudaModelRunner::LoadCheckpoint(const Checkpoint& checkpoint) {
  State& s = *state_;
  for (const TensorSpec& spec : ExpectedTensors(config_)) {
    const TensorView* view = checkpoint.Find(spec.name);
    if (view == nullptr) {
      return absl::NotFoundError(
          absl::StrCat(checkpoint.dir(), ": checkpoint lacks tensor ", spec.name));
    }
    if (view->shape != spec.shape) {
      return absl::InvalidArgumentError(absl::StrCat(checkpoint.dir(), ": tensor ", spec.name,
                                                     " has shape ", ShapeToString(view->shape),
                                                     ", expected ", ShapeToString(spec.shape)));
    }
    // The served dtype (model/dtype_cast.h): a tensor in another float dtype is cast first, so
    // that a vector of an F32 checkpoint served as BF16 holds BF16 values like its matrices.
    const DType served = ServedDType(config_);
    s.weight_specs.push_back(WeightSpec{spec.name, served, spec.shape});
    const uint8_t* data = view->data;
    std::vector<uint8_t> cast;
    if (view->dtype != served) {
      cast.resize(NumElements(spec.shape) * DTypeSize(served));
      ROLLOUT_RETURN_IF_ERROR(CastFloats(spec.name, view->dtype, view->data,
                                         NumElements(spec.shape), served, cast.data()));
      data = cast.data();
    }
    ROLLOUT_RETURN_IF_ERROR(Upload(s.bindings.at(spec.name), served, data,
                                   NumElements(spec.shape), spec.name));
  }
  SortSpecs(&s.weight_specs);
  // cudaMemcpy from pageable memory may return before its DMA lands.
  return CudaError(cudaDeviceSynchronize(), "uploading weights");
}

absl::Status CudaModelRunner::LoadSynthetic(uint64_t seed) {
  State& s = *state_;
  cuda::DeviceBuffer full;  // a whole tensor, when it is split into pieces
  for (const TensorSpec& spec : ExpectedTensors(config_)) {
    // What WriteRandomModel writes for this tensor (model/random_model.h), on the GPU.
    const RandomTensorInit init = RandomInitFor(config_, seed, spec.name, spec.shape);
    const Binding& dst = s.bindings.at(spec.name);
    const int64_t count = NumElements(spec.shape);
    const size_t elem = dst.f32 ? sizeof(float) : 2;
    s.weight_specs.push_back(WeightSpec{spec.name, DType::kBF16, spec.shape});
    void* out = dst.pieces[0].ptr;
    if (!dst.whole()) {
      if (full.bytes() < count * elem) {
        ROLLOUT_RETURN_IF_ERROR(CudaError(cudaStreamSynchronize(s.stream), "generating weights"));
        ROLLOUT_RETURN_IF_ERROR(CudaError(full.Allocate(count * elem), "generating weights"));
      }
      out = full.get();
    }
    ROLLOUT_RETURN_IF_ERROR(
        CudaError(cuda::FillRandomWeights(init.key, init.scale, init.norm_weight ? 1 : 0, count,
                                          dst.f32 ? nullptr : static_cast<bf16*>(out),
                                          dst.f32 ? static_cast<float*>(out) : nullptr, s.stream),
                  absl::StrCat("generating ", spec.name)));
    if (!dst.whole()) {
      ROLLOUT_RETURN_IF_ERROR(
          SliceIntoPieces(dst, full, count, elem, s.ranks[0].device, s.stream, spec.name));
    }
  }
  SortSpecs(&s.weight_specs);
  return CudaError(cudaStreamSynchronize(s.stream), "generating synthetic weights");
}

const std::vector<WeightSpec>& CudaModelRunner::weight_specs() const {
  return state_->weight_specs;
}

absl::Status CudaModelRunner::UpdateWeights(const std::vector<HostTensorView>& tensors) {
  State& s = *state_;
  for (const HostTensorView& t : tensors) {
    ROLLOUT_RETURN_IF_ERROR(CheckTensorAgainstSpec(s.weight_specs, t.name, t.dtype, t.shape));
    const size_t expected = FindWeightSpec(s.weight_specs, t.name)->nbytes();
    if (t.nbytes != expected) {
      return absl::InvalidArgumentError(
          absl::StrFormat("tensor '%s': %d bytes given, expected %d", t.name, t.nbytes, expected));
    }
  }
  ROLLOUT_RETURN_IF_ERROR(CudaError(cudaSetDevice(s.ranks[0].device), "cudaSetDevice"));
  // Between steps: nothing of ours is in flight, but be explicit.
  ROLLOUT_RETURN_IF_ERROR(CudaError(cudaStreamSynchronize(s.stream), "weight update"));
  // What the host converts (norms, biases: a small part) goes synchronously, first. Then every
  // bf16 tensor's copies are enqueued straight from its bytes -- from pinned staging they run
  // back to back at the bus rate while this thread enqueues the next -- and waited for once.
  for (const HostTensorView& t : tensors) {
    const Binding& dst = s.bindings.at(t.name);
    if (!NeedsConversion(dst, t.dtype)) continue;
    ROLLOUT_RETURN_IF_ERROR(Upload(dst, t.dtype, t.data, NumElements(t.shape), t.name));
  }
  std::vector<int> devices = {s.ranks[0].device};
  for (const HostTensorView& t : tensors) {
    const Binding& dst = s.bindings.at(t.name);
    if (NeedsConversion(dst, t.dtype)) continue;
    ROLLOUT_RETURN_IF_ERROR(EnqueueUpload(dst, t.data, t.name, &devices));
  }
  for (int device : devices) {
    ROLLOUT_RETURN_IF_ERROR(CudaError(cudaSetDevice(device), "cudaSetDevice"));
    ROLLOUT_RETURN_IF_ERROR(CudaError(cudaDeviceSynchronize(), "weight update"));
  }
  return CudaError(cudaSetDevice(s.ranks[0].device), "cudaSetDevice");
}

absl::StatusOr<std::unique_ptr<HostStagingBuffer>> CudaModelRunner::AllocateHostStaging(
    size_t bytes) const {
  // On any thread: rank 0's device current for the call only (its context exists already).
  CudaDeviceScope scope;
  void* data = nullptr;
  cudaError_t error = cudaSetDevice(state_->ranks[0].device);
  if (error == cudaSuccess) error = cudaHostAlloc(&data, bytes, cudaHostAllocPortable);
  if (error == cudaSuccess) {
    return std::unique_ptr<HostStagingBuffer>(new PinnedHostStaging(data, bytes));
  }
  cudaGetLastError();  // not sticky; clear it for the next call on this thread
  LOG(WARNING) << absl::StrFormat(
      "cannot page-lock %.2f GiB of host memory to stage weight updates (cudaHostAlloc: %s); "
      "staging them in pageable memory, so each swap copies at the pageable rate",
      bytes / 1073741824.0, cudaGetErrorString(error));
  return AllocatePlainHostStaging(bytes);
}

}  // namespace rollout
