// CudaModelRunner: construction, weights (checkpoint or synthetic), workspace, pinned GEMMs and
// the KV pool. The forward pass is in cuda_model_runner.cc.
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/cuda_device_scope.h"
#include "common/cuda_status.h"
#include "common/status.h"
#include "glog/logging.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/rank_group.h"
#include "kernels/cuda/sampling.h"
#include "kernels/cuda/tensor_parallel.h"
#include "model/random_model.h"
#include "model/tensor_parallel.h"
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

// CudaRunnerOptions::devices: empty, or one distinct, existing device per rank.
absl::Status CheckDevices(const CudaRunnerOptions& o) {
  if (o.devices.empty()) return absl::OkStatus();
  if (static_cast<int64_t>(o.devices.size()) != o.tensor_parallel) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "devices lists %d device(s) for tensor_parallel %d: give one device per rank (or none "
        "for every rank on device %d)",
        o.devices.size(), o.tensor_parallel, o.device));
  }
  for (size_t i = 0; i < o.devices.size(); ++i) {
    for (size_t j = 0; j < i; ++j) {
      if (o.devices[i] == o.devices[j]) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "devices lists device %d twice (ranks %d and %d): ranks on separate devices need "
            "distinct devices (leave devices empty to put every rank on one device)",
            o.devices[i], j, i));
      }
    }
  }
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) return CudaError(err, "cudaGetDeviceCount");
  for (size_t r = 0; r < o.devices.size(); ++r) {
    if (o.devices[r] < 0 || o.devices[r] >= count) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "devices: rank %d's device %d does not exist (%d CUDA device(s) visible: 0..%d)", r,
          o.devices[r], count, count - 1));
    }
  }
  return absl::OkStatus();
}

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

void SortSpecs(std::vector<WeightSpec>* specs) {
  std::sort(specs->begin(), specs->end(),
            [](const WeightSpec& a, const WeightSpec& b) { return a.name < b.name; });
}

// The canonical K tree is what every tensor-parallel degree computes.
CudaRunnerOptions WithCanonicalTree(CudaRunnerOptions options) {
  if (options.tensor_parallel > 1) options.canonical_k_tree = true;
  return options;
}

}  // namespace

CudaModelRunner::CudaModelRunner(ModelConfig config, CudaRunnerOptions options)
    : config_(std::move(config)),
      options_(WithCanonicalTree(options)),
      state_(std::make_unique<State>()) {}

// Drains every rank's stream; State's members then release their resources in the order it
// states, rank 0's with its device current (RankList makes the other ranks' current).
CudaModelRunner::~CudaModelRunner() {
  if (state_ == nullptr) return;
  for (const RankState& rk : state_->ranks) {
    if (rk.stream.get() != nullptr) cudaStreamSynchronize(rk.stream.get());
  }
  if (state_->multi_device && !state_->ranks.empty()) cudaSetDevice(state_->ranks[0].device);
  state_.reset();
}

absl::StatusOr<std::unique_ptr<CudaModelRunner>> CudaModelRunner::Create(
    const Checkpoint& checkpoint, const CudaRunnerOptions& options) {
  absl::StatusOr<ModelConfig> config = ParseModelConfig(checkpoint.config_json());
  if (!config.ok()) {
    return absl::Status(
        config.status().code(),
        absl::StrCat(checkpoint.dir(), "/config.json: ", config.status().message()));
  }
  auto runner = std::unique_ptr<CudaModelRunner>(new CudaModelRunner(*std::move(config), options));
  ROLLOUT_RETURN_IF_ERROR(runner->Init());
  ROLLOUT_RETURN_IF_ERROR(runner->LoadCheckpoint(checkpoint));
  ROLLOUT_RETURN_IF_ERROR(runner->Finish());
  return runner;
}

absl::StatusOr<std::unique_ptr<CudaModelRunner>> CudaModelRunner::CreateSynthetic(
    const ModelConfig& config, uint64_t seed, const CudaRunnerOptions& options) {
  // What a checkpoint of this config must parse to; catches hand-built inconsistent configs.
  absl::StatusOr<ModelConfig> reparsed = ParseModelConfig(ModelConfigToJson(config));
  if (!reparsed.ok()) return reparsed.status();
  auto runner = std::unique_ptr<CudaModelRunner>(new CudaModelRunner(config, options));
  ROLLOUT_RETURN_IF_ERROR(runner->Init());
  ROLLOUT_RETURN_IF_ERROR(runner->LoadSynthetic(seed));
  ROLLOUT_RETURN_IF_ERROR(runner->Finish());
  return runner;
}

// Checks the options and the model against what the kernels support, creates the stream and
// cuBLASLt handle, and lays out the weights.
absl::Status CudaModelRunner::Init() {
  const ModelConfig& c = config_;
  const CudaRunnerOptions& o = options_;
  if (o.kv_block_size <= 0 || o.attention_split_size <= 0 ||
      o.attention_split_size % cuda::kAttentionTile != 0 ||
      o.attention_split_size % o.kv_block_size != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "attention split size (%d) must be a positive multiple of 32 and of the KV block size "
        "(%d)",
        o.attention_split_size, o.kv_block_size));
  }
  if (o.max_batch_tokens < 1 || o.max_batch_tokens > 65535 || o.max_logit_rows < 1) {
    return absl::InvalidArgumentError(
        "max_batch_tokens must be in [1, 65535], max_logit_rows >= 1");
  }
  if (c.head_dim != 32 && c.head_dim != 64 && c.head_dim != 128) {
    return absl::InvalidArgumentError(
        absl::StrCat("the CUDA backend supports head_dim 32, 64 or 128, not ", c.head_dim));
  }
  const int group = c.num_attention_heads / c.num_key_value_heads;
  if (group > 64) {
    return absl::InvalidArgumentError(
        absl::StrCat("the CUDA backend supports up to 64 query heads per kv head, not ", group));
  }
  if (c.hidden_size % 8 != 0 || c.intermediate_size % 8 != 0) {
    return absl::InvalidArgumentError("hidden and intermediate sizes must be multiples of 8");
  }
  const int tp = o.tensor_parallel;
  ROLLOUT_RETURN_IF_ERROR(CheckTensorParallel(c, tp));
  ROLLOUT_RETURN_IF_ERROR(CheckDevices(o));
  if (o.canonical_k_tree) {
    // Segment offsets of K / 8 elements stay 16-byte aligned for the GEMMs, at every degree.
    if ((c.num_attention_heads * c.head_dim) % 64 != 0 || c.intermediate_size % 64 != 0) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "the canonical K tree (tensor parallelism) needs heads * head_dim (%d) and the "
          "intermediate size (%d) to be multiples of 64",
          c.num_attention_heads * c.head_dim, c.intermediate_size));
    }
    if (o.gemm_pin_m <= 0) {
      return absl::InvalidArgumentError(
          "the canonical K tree (tensor parallelism) needs pinned GEMM algorithms "
          "(gemm_pin_m > 0): a rank's slice must run the algorithm of the full shape");
    }
  }
  State& s = *state_;
  const int64_t h = c.hidden_size, hd = c.head_dim, nh = c.num_attention_heads,
                nkv = c.num_key_value_heads, inter = c.intermediate_size, vocab = c.vocab_size;
  s.tp = tp;
  s.canonical = o.canonical_k_tree;
  // Vocab shards of ceil(vocab / tp) rows rounded up to 64, so that every rank's lm_head GEMM
  // has one shape and its logits rows stay aligned; the last shards are shorter (or empty).
  s.vocab_rows = tp == 1 ? vocab : ((vocab + tp - 1) / tp + 63) / 64 * 64;
  s.multi_device = o.devices.size() > 1;
  s.ranks.Create(tp, s.multi_device);
  for (int r = 0; r < tp; ++r) {
    RankState& rk = s.ranks[r];
    rk.index = r;
    rk.device = o.devices.empty() ? o.device : o.devices[r];
    static_cast<RankShard&>(rk) = ShardOf(c, tp, r, s.vocab_rows);
  }

  // Each rank's stream and event on its device (all on one device unless o.devices is set);
  // rank 0's device is current from here on, between enqueues for other ranks.
  std::vector<cudaStream_t> streams;
  std::vector<int> devices;
  for (RankState& rk : s.ranks) {
    ROLLOUT_RETURN_IF_ERROR(CudaError(cudaSetDevice(rk.device), "cudaSetDevice"));
    ROLLOUT_RETURN_IF_ERROR(CudaError(
        cudaStreamCreateWithFlags(rk.stream.Receive(), cudaStreamNonBlocking), "cudaStreamCreate"));
    streams.push_back(rk.stream.get());
    devices.push_back(rk.device);
    if (rk.index > 0) {
      ROLLOUT_RETURN_IF_ERROR(CudaError(
          cudaEventCreateWithFlags(rk.done.Receive(), cudaEventDisableTiming), "cudaEventCreate"));
    }
  }
  ROLLOUT_RETURN_IF_ERROR(CudaError(cudaSetDevice(s.ranks[0].device), "cudaSetDevice"));
  s.stream = s.ranks[0].stream.get();
  if (tp > 1) {
    ROLLOUT_RETURN_IF_ERROR(CudaError(
        cudaEventCreateWithFlags(s.fork.Receive(), cudaEventDisableTiming), "cudaEventCreate"));
    if (!s.multi_device) {
      const cuda::GroupStatus group = cuda::CreateSameDeviceGroup(streams, &s.group);
      if (!group.ok()) return absl::InternalError(group.message());
    } else {
      // Ranks on separate devices exchange through NCCL, loaded at run time.
      int version = 0;
      const cuda::GroupStatus loaded = cuda::NcclLibraryVersion(o.nccl_library, &version);
      if (!loaded.ok()) {
        return absl::FailedPreconditionError(absl::StrCat(
            "tensor parallelism across devices needs NCCL (",
            o.nccl_library.empty() ? "libnccl.so.2" : o.nccl_library,
            ", loaded at run time), which did not load: ", loaded.message(),
            ". Install NCCL 2.x, or put the directory holding libnccl.so.2 (e.g. a PyTorch "
            "environment's site-packages/nvidia/nccl/lib) on LD_LIBRARY_PATH; or leave devices "
            "empty to run every rank on one device"));
      }
      const cuda::GroupStatus group =
          cuda::CreateNcclGroup(devices, streams, o.nccl_library, &s.group);
      if (!group.ok()) {
        return absl::InternalError(absl::StrCat("creating the NCCL group of devices ",
                                                absl::StrJoin(devices, ","), " (NCCL ", version,
                                                "): ", group.message()));
      }
      ROLLOUT_RETURN_IF_ERROR(CudaError(cudaSetDevice(s.ranks[0].device), "cudaSetDevice"));
    }
  }
  ROLLOUT_RETURN_IF_ERROR(CublasError(cublasLtCreate(s.lt.Receive()), "cublasLtCreate"));
  for (RankState& rk : s.ranks) {
    if (!s.OwnCopies(rk)) {
      rk.lt = s.lt.get();
      continue;
    }
    // cuBLASLt handles are per device.
    ROLLOUT_RETURN_IF_ERROR(s.SetDevice(rk));
    ROLLOUT_RETURN_IF_ERROR(CublasError(cublasLtCreate(rk.own_lt.Receive()), "cublasLtCreate"));
    rk.lt = rk.own_lt.get();
  }
  ROLLOUT_RETURN_IF_ERROR(s.SetDevice(s.ranks[0]));

  // Each rank's weights: two passes over the same sequence of Take() calls, sizes then pointers.
  auto layout = [&](RankState& rk, Arena* mats, Arena* vecs) {
    const int64_t qkv_rows = (rk.heads + 2 * rk.kv_heads) * hd;
    rk.embed = mats->Take<bf16>(s.vocab_rows * h);
    rk.lm_head = c.tie_word_embeddings ? rk.embed : mats->Take<bf16>(s.vocab_rows * h);
    rk.final_norm = vecs->Take<float>(h);
    rk.layers.assign(c.num_layers, LayerWeights{});
    for (LayerWeights& l : rk.layers) {
      l.qkv = mats->Take<bf16>(qkv_rows * h);
      l.o = mats->Take<bf16>(h * rk.heads * hd);
      l.gate_up = mats->Take<bf16>(2 * rk.inter * h);
      l.down = mats->Take<bf16>(h * rk.inter);
      l.input_norm = vecs->Take<float>(h);
      l.post_norm = vecs->Take<float>(h);
      if (c.qk_norm) {
        l.q_norm = vecs->Take<float>(hd);
        l.k_norm = vecs->Take<float>(hd);
      }
      if (c.qkv_bias) l.qkv_bias = vecs->Take<float>(qkv_rows);
    }
  };
  for (RankState& rk : s.ranks) {
    ROLLOUT_RETURN_IF_ERROR(s.SetDevice(rk));
    Arena size_mats(nullptr), size_vecs(nullptr);
    layout(rk, &size_mats, &size_vecs);
    ROLLOUT_RETURN_IF_ERROR(
        CudaError(rk.weights_bf16.Allocate(size_mats.used()),
                  absl::StrCat("allocating ", size_mats.used(), " bytes of bf16 weights")));
    ROLLOUT_RETURN_IF_ERROR(
        CudaError(rk.weights_f32.Allocate(size_vecs.used()), "allocating fp32 weights"));
    if (tp > 1) {  // the vocab shards' padding rows stay zero
      ROLLOUT_RETURN_IF_ERROR(CudaError(
          cudaMemset(rk.weights_bf16.get(), 0, rk.weights_bf16.bytes()), "clearing weights"));
    }
    s.weight_bytes += size_mats.used() + size_vecs.used();
    Arena mats(rk.weights_bf16.get<char>()), vecs(rk.weights_f32.get<char>());
    layout(rk, &mats, &vecs);
  }
  ROLLOUT_RETURN_IF_ERROR(s.SetDevice(s.ranks[0]));

  // Every tensor bound to the pieces of it each rank holds (one whole piece each at tp = 1,
  // at the same places as ever, except o/down's K segments with the canonical tree).
  // The device of the rank being bound, when ranks span devices.
  std::optional<int> piece_device;
  auto add = [&](const std::string& name, bool f32, int64_t rows, int64_t cols, Piece piece) {
    piece.device = piece_device;
    Binding& b = s.bindings[name];
    b.f32 = f32;
    b.rows = rows;
    b.cols = cols;
    if (piece.rows > 0 && piece.cols > 0) b.pieces.push_back(piece);
  };
  const int local_segments = cuda::kNumKSegments / tp;
  // A row-parallel weight [hidden, k_full]: whole, or the rank's K segments, each [hidden,
  // k_full / 8] contiguous, so a segment GEMM reads the same weight layout at every degree.
  auto add_k_slices = [&](const std::string& name, RankState& rk, bf16* w, int64_t k_full) {
    if (!s.canonical) {
      add(name, false, h, k_full, Piece{w, 0, h, 0, k_full});
      return;
    }
    const int64_t seg = k_full / cuda::kNumKSegments;
    for (int j = 0; j < local_segments; ++j) {
      add(name, false, h, k_full,
          Piece{w + j * h * seg, 0, h, (rk.index * local_segments + j) * seg, seg});
    }
  };
  for (RankState& rk : s.ranks) {
    piece_device = s.multi_device ? std::optional<int>(rk.device) : std::nullopt;
    const int64_t r = rk.index, rh = rk.heads, rkv = rk.kv_heads, kvb = rk.kv_head_begin;
    add("model.embed_tokens.weight", false, vocab, h,
        Piece{rk.embed, rk.vocab_begin, rk.vocab_end - rk.vocab_begin, 0, h});
    if (!c.tie_word_embeddings) {
      add("lm_head.weight", false, vocab, h,
          Piece{rk.lm_head, rk.vocab_begin, rk.vocab_end - rk.vocab_begin, 0, h});
    }
    add("model.norm.weight", true, h, 1, Piece{rk.final_norm, 0, h, 0, 1});
    for (int i = 0; i < c.num_layers; ++i) {
      const std::string p = absl::StrCat("model.layers.", i, ".");
      LayerWeights& l = rk.layers[i];
      add(p + "input_layernorm.weight", true, h, 1, Piece{l.input_norm, 0, h, 0, 1});
      add(p + "post_attention_layernorm.weight", true, h, 1, Piece{l.post_norm, 0, h, 0, 1});
      // The rank's q heads, then its KV heads' k and v rows: one fused qkv GEMM per rank.
      add(p + "self_attn.q_proj.weight", false, nh * hd, h,
          Piece{l.qkv, r * rh * hd, rh * hd, 0, h});
      add(p + "self_attn.k_proj.weight", false, nkv * hd, h,
          Piece{l.qkv + rh * hd * h, kvb * hd, rkv * hd, 0, h});
      add(p + "self_attn.v_proj.weight", false, nkv * hd, h,
          Piece{l.qkv + (rh + rkv) * hd * h, kvb * hd, rkv * hd, 0, h});
      add_k_slices(p + "self_attn.o_proj.weight", rk, l.o, nh * hd);
      add(p + "mlp.gate_proj.weight", false, inter, h,
          Piece{l.gate_up, r * rk.inter, rk.inter, 0, h});
      add(p + "mlp.up_proj.weight", false, inter, h,
          Piece{l.gate_up + rk.inter * h, r * rk.inter, rk.inter, 0, h});
      add_k_slices(p + "mlp.down_proj.weight", rk, l.down, inter);
      if (c.qk_norm) {
        add(p + "self_attn.q_norm.weight", true, hd, 1, Piece{l.q_norm, 0, hd, 0, 1});
        add(p + "self_attn.k_norm.weight", true, hd, 1, Piece{l.k_norm, 0, hd, 0, 1});
      }
      if (c.qkv_bias) {
        add(p + "self_attn.q_proj.bias", true, nh * hd, 1,
            Piece{l.qkv_bias, r * rh * hd, rh * hd, 0, 1});
        add(p + "self_attn.k_proj.bias", true, nkv * hd, 1,
            Piece{l.qkv_bias + rh * hd, kvb * hd, rkv * hd, 0, 1});
        add(p + "self_attn.v_proj.bias", true, nkv * hd, 1,
            Piece{l.qkv_bias + (rh + rkv) * hd, kvb * hd, rkv * hd, 0, 1});
      }
    }
  }
  for (const TensorSpec& spec : ExpectedTensors(c)) {
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
    s.weight_specs.push_back(WeightSpec{spec.name, view->dtype, spec.shape});
    ROLLOUT_RETURN_IF_ERROR(Upload(s.bindings.at(spec.name), view->dtype, view->data,
                                   NumElements(spec.shape), spec.name));
  }
  SortSpecs(&s.weight_specs);
  // cudaMemcpy from pageable memory may return before its DMA lands.
  return CudaError(cudaDeviceSynchronize(), "uploading weights");
}

const std::vector<WeightSpec>& CudaModelRunner::weight_specs() const {
  return state_->weight_specs;
}

absl::Status CudaModelRunner::UpdateWeights(const std::vector<HostTensor>& tensors) {
  State& s = *state_;
  for (const HostTensor& t : tensors) {
    ROLLOUT_RETURN_IF_ERROR(CheckTensorAgainstSpec(s.weight_specs, t.name, t.dtype, t.shape));
    const size_t expected = FindWeightSpec(s.weight_specs, t.name)->nbytes();
    if (t.bytes.size() != expected) {
      return absl::InvalidArgumentError(absl::StrFormat("tensor '%s': %d bytes given, expected %d",
                                                        t.name, t.bytes.size(), expected));
    }
  }
  ROLLOUT_RETURN_IF_ERROR(CudaError(cudaSetDevice(s.ranks[0].device), "cudaSetDevice"));
  // Between steps: nothing of ours is in flight, but be explicit.
  ROLLOUT_RETURN_IF_ERROR(CudaError(cudaStreamSynchronize(s.stream), "weight update"));
  for (const HostTensor& t : tensors) {
    ROLLOUT_RETURN_IF_ERROR(
        Upload(s.bindings.at(t.name), t.dtype, t.bytes.data(), NumElements(t.shape), t.name));
  }
  return CudaError(cudaDeviceSynchronize(), "weight update");
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
      // Pieces on other devices than rank 0's (ranks spanning devices) through the host.
      std::vector<char> host;
      for (const Piece& p : dst.pieces) {
        if (p.device.has_value() && *p.device != s.ranks[0].device) {
          if (host.empty()) {
            host.resize(count * elem);
            ROLLOUT_RETURN_IF_ERROR(
                CudaError(cudaStreamSynchronize(s.stream), "generating weights"));
            ROLLOUT_RETURN_IF_ERROR(
                CudaError(cudaMemcpy(host.data(), full.get(), count * elem, cudaMemcpyDeviceToHost),
                          absl::StrCat("staging ", spec.name)));
          }
          CudaDeviceScope scope;
          ROLLOUT_RETURN_IF_ERROR(CudaError(cudaSetDevice(*p.device), "cudaSetDevice"));
          ROLLOUT_RETURN_IF_ERROR(
              CudaError(CopyPiece(dst, p, host.data(), elem, cudaMemcpyHostToDevice, 0),
                        absl::StrCat("slicing ", spec.name)));
          ROLLOUT_RETURN_IF_ERROR(
              CudaError(cudaStreamSynchronize(0), absl::StrCat("slicing ", spec.name)));
          continue;
        }
        ROLLOUT_RETURN_IF_ERROR(
            CudaError(CopyPiece(dst, p, full.get(), elem, cudaMemcpyDeviceToDevice, s.stream),
                      absl::StrCat("slicing ", spec.name)));
      }
    }
  }
  SortSpecs(&s.weight_specs);
  return CudaError(cudaStreamSynchronize(s.stream), "generating synthetic weights");
}

// RoPE tables, workspace, pinned GEMMs, then the KV pool from what memory is left.
absl::Status CudaModelRunner::Finish() {
  const ModelConfig& c = config_;
  State& s = *state_;
  const int64_t h = c.hidden_size, hd = c.head_dim, nkv = c.num_key_value_heads,
                vocab = c.vocab_size;

  // cos/sin exactly as the CPU reference computes them (double, then rounded to float).
  const int64_t half = hd / 2, max_pos = c.max_position_embeddings;
  {
    std::vector<float> cos_table(max_pos * half), sin_table(max_pos * half);
    std::vector<double> inv_freq(half);
    for (int64_t i = 0; i < half; ++i) {
      inv_freq[i] =
          std::pow(static_cast<double>(c.rope_theta), -(2.0 * static_cast<double>(i)) / hd);
    }
    for (int64_t p = 0; p < max_pos; ++p) {
      for (int64_t i = 0; i < half; ++i) {
        const double angle = static_cast<double>(p) * inv_freq[i];
        cos_table[p * half + i] = static_cast<float>(std::cos(angle));
        sin_table[p * half + i] = static_cast<float>(std::sin(angle));
      }
    }
    const size_t bytes = cos_table.size() * sizeof(float);
    ROLLOUT_RETURN_IF_ERROR(CudaError(s.rope_cos.Allocate(bytes), "allocating RoPE tables"));
    ROLLOUT_RETURN_IF_ERROR(CudaError(s.rope_sin.Allocate(bytes), "allocating RoPE tables"));
    ROLLOUT_RETURN_IF_ERROR(CudaError(
        cudaMemcpy(s.rope_cos.get(), cos_table.data(), bytes, cudaMemcpyHostToDevice), "RoPE"));
    ROLLOUT_RETURN_IF_ERROR(CudaError(
        cudaMemcpy(s.rope_sin.get(), sin_table.data(), bytes, cudaMemcpyHostToDevice), "RoPE"));
    for (RankState& rk : s.ranks) {  // ranks on other devices: their own copies
      if (!s.OwnCopies(rk)) continue;
      ROLLOUT_RETURN_IF_ERROR(s.SetDevice(rk));
      ROLLOUT_RETURN_IF_ERROR(CudaError(rk.rope_cos.Allocate(bytes), "allocating RoPE tables"));
      ROLLOUT_RETURN_IF_ERROR(CudaError(rk.rope_sin.Allocate(bytes), "allocating RoPE tables"));
      ROLLOUT_RETURN_IF_ERROR(CudaError(
          cudaMemcpy(rk.rope_cos.get(), cos_table.data(), bytes, cudaMemcpyHostToDevice), "RoPE"));
      ROLLOUT_RETURN_IF_ERROR(CudaError(
          cudaMemcpy(rk.rope_sin.get(), sin_table.data(), bytes, cudaMemcpyHostToDevice), "RoPE"));
    }
    ROLLOUT_RETURN_IF_ERROR(s.SetDevice(s.ranks[0]));
  }

  const int tp = s.tp;
  const int64_t t = options_.max_batch_tokens, r = options_.max_logit_rows;
  // A rank's leaves of the canonical K tree: a separate buffer when it owns more than one.
  const int local_segments = cuda::kNumKSegments / tp;
  for (RankState& rk : s.ranks) {
    ROLLOUT_RETURN_IF_ERROR(s.SetDevice(rk));
    const int64_t qkv_cols = (rk.heads + 2 * rk.kv_heads) * hd;
    const int64_t leaves = s.canonical && local_segments > 1 ? local_segments * t * h * 4 : 0;
    const int64_t gathered = tp > 1 ? tp * std::max(t * h, r * s.vocab_rows) * 4 : 0;
    for (auto [buffer, bytes] : std::vector<std::pair<cuda::DeviceBuffer*, int64_t>>{
             {&rk.x, t * h * 4},
             {&rk.xn, t * h * 2},
             {&rk.qkv, t * qkv_cols * 4},
             {&rk.q, t * rk.heads * hd * 4},
             {&rk.attn, t * rk.heads * hd * 2},
             {&rk.gate_up, t * 2 * rk.inter * 2},
             {&rk.act, t * rk.inter * 2},
             {&rk.final_rows, r * h * 2},
             {&rk.leaves, leaves},
             {&rk.gathered, gathered},
         }) {
      ROLLOUT_RETURN_IF_ERROR(CudaError(buffer->Allocate(bytes), "allocating activations"));
    }
  }
  ROLLOUT_RETURN_IF_ERROR(s.SetDevice(s.ranks[0]));
  for (auto [buffer, bytes] : std::vector<std::pair<cuda::DeviceBuffer*, int64_t>>{
           {&s.logits, r * vocab * 4},
           {&s.row_specs, r * static_cast<int64_t>(sizeof(cuda::LogitsRowSpec))},
           {&s.row_results, r * static_cast<int64_t>(sizeof(cuda::LogitsRowResult))},
       }) {
    ROLLOUT_RETURN_IF_ERROR(CudaError(buffer->Allocate(bytes), "allocating activations"));
  }
  for (State::HostSlot& h : s.slots) {
    ROLLOUT_RETURN_IF_ERROR(
        CudaError(h.specs.Allocate(r * sizeof(cuda::LogitsRowSpec)), "allocating sampling specs"));
    ROLLOUT_RETURN_IF_ERROR(CudaError(h.results.Allocate(r * sizeof(cuda::LogitsRowResult)),
                                      "allocating sampling results"));
    ROLLOUT_RETURN_IF_ERROR(CudaError(
        cudaEventCreateWithFlags(h.done.Receive(), cudaEventDisableTiming), "cudaEventCreate"));
  }
  if (s.canonical) {
    ROLLOUT_RETURN_IF_ERROR(PinCanonicalGemms());
  } else {
    ROLLOUT_RETURN_IF_ERROR(PinGemms());
  }

  // The KV pool. kv_cache_bytes sizes it as for the unsharded model, so the block count (and
  // every scheduling decision) is the same at every degree; a fraction of the free memory is
  // shared by the ranks' shards (which hold more than the model's KV heads when replicated).
  size_t free_bytes = 0, total_bytes = 0;
  ROLLOUT_RETURN_IF_ERROR(CudaError(cudaMemGetInfo(&free_bytes, &total_bytes), "cudaMemGetInfo"));
  auto block_bytes = [&](int64_t kv_heads) {
    return 2 * c.num_layers * static_cast<int64_t>(options_.kv_block_size) * kv_heads * hd * 2;
  };
  int64_t bytes_per_block = block_bytes(nkv);
  if (options_.kv_cache_bytes <= 0 && !s.multi_device) {
    bytes_per_block = 0;
    for (const RankState& rk : s.ranks) bytes_per_block += block_bytes(rk.kv_heads);
  } else if (options_.kv_cache_bytes <= 0) {
    // Ranks on separate devices: each device holds one rank's shard, so the pool is what the
    // device with the least free memory can hold of the largest shard.
    bytes_per_block = 0;
    for (const RankState& rk : s.ranks) {
      bytes_per_block = std::max(bytes_per_block, block_bytes(rk.kv_heads));
      size_t rank_free = 0, rank_total = 0;
      ROLLOUT_RETURN_IF_ERROR(s.SetDevice(rk));
      ROLLOUT_RETURN_IF_ERROR(CudaError(cudaMemGetInfo(&rank_free, &rank_total), "cudaMemGetInfo"));
      free_bytes = std::min(free_bytes, rank_free);
    }
    ROLLOUT_RETURN_IF_ERROR(s.SetDevice(s.ranks[0]));
  }
  const int64_t budget = options_.kv_cache_bytes > 0
                             ? options_.kv_cache_bytes
                             : static_cast<int64_t>(free_bytes * options_.kv_cache_fraction);
  // Slots (block * block_size + offset) are int32 in the kernels.
  const int64_t max_blocks = (int64_t{1} << 31) / options_.kv_block_size - 1;
  // One block beyond the engine's pool is reserved for the padding rows of decode graphs.
  const int64_t blocks = std::min(budget / bytes_per_block, max_blocks);
  if (blocks < 2) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "KV cache of %d bytes holds fewer than 2 blocks of %d tokens (%d bytes each); %d bytes "
        "free",
        budget, options_.kv_block_size, bytes_per_block, free_bytes));
  }
  ROLLOUT_RETURN_IF_ERROR(CudaError(cudaDeviceSynchronize(), "uploading RoPE tables"));
  num_kv_blocks_ = static_cast<int32_t>(blocks - 1);
  s.pad_block = static_cast<int32_t>(blocks - 1);
  for (RankState& rk : s.ranks) {
    ROLLOUT_RETURN_IF_ERROR(s.SetDevice(rk));
    rk.kv_layer_elems = blocks * options_.kv_block_size * rk.kv_heads * hd;
    const int64_t bytes = blocks * block_bytes(rk.kv_heads);
    ROLLOUT_RETURN_IF_ERROR(CudaError(rk.kv.Allocate(bytes),
                                      absl::StrCat("allocating a KV cache of ", bytes, " bytes")));
  }
  return s.SetDevice(s.ranks[0]);
}

// The unsharded model's GEMMs: one algorithm pinned per weight shape, or the heuristic per m.
absl::Status CudaModelRunner::PinGemms() {
  const ModelConfig& c = config_;
  State& s = *state_;
  RankState& rk = s.ranks[0];
  const int64_t h = c.hidden_size, hd = c.head_dim, nh = c.num_attention_heads,
                nkv = c.num_key_value_heads, inter = c.intermediate_size, vocab = c.vocab_size;
  const int64_t pin_m = options_.gemm_pin_m;
  struct GemmSpec {
    const char* name;
    int64_t n, k;
    cuda::GemmOutput output;
    std::unique_ptr<cuda::PinnedGemm>* gemm;
  };
  for (const GemmSpec& g : std::vector<GemmSpec>{
           {"qkv", (nh + 2 * nkv) * hd, h, cuda::GemmOutput::kF32, &rk.gemm_qkv},
           {"o", h, nh * hd, cuda::GemmOutput::kF32Accumulate, &rk.gemm_o},
           {"gate_up", 2 * inter, h, cuda::GemmOutput::kBf16, &rk.gemm_gate_up},
           {"down", h, inter, cuda::GemmOutput::kF32Accumulate, &rk.gemm_down},
           {"lm_head", vocab, h, cuda::GemmOutput::kF32, &rk.gemm_lm_head},
       }) {
    std::string why = "gemm_pin_m <= 0 asks for the heuristic";
    if (pin_m <= 0 || cuda::PinnedGemm::Create(s.lt.get(), g.n, g.k, g.output, pin_m, g.gemm,
                                               &why) != CUBLAS_STATUS_SUCCESS) {
      if (pin_m > 0) {
        LOG(WARNING) << absl::StrFormat(
            "no split-K-free cuBLASLt algorithm could be pinned for %s [%d x %d]; using the "
            "no-workspace heuristic per m (tests/gpu/gemm_test.cc checks its row invariance):\n%s",
            g.name, g.n, g.k, why);
      }
      ROLLOUT_RETURN_IF_ERROR(
          CublasError(cuda::PinnedGemm::CreateHeuristic(s.lt.get(), g.n, g.k, g.output, g.gemm),
                      absl::StrCat("creating the GEMM for ", g.name)));
    } else if (options_.gemm_ladder) {
      ROLLOUT_RETURN_IF_ERROR(
          CublasError((*g.gemm)->BuildLadder(), absl::StrCat("the GEMM ladder for ", g.name)));
    }
    s.gemm_descriptions.push_back(
        absl::StrFormat("%-8s n=%-6d k=%-6d %s", g.name, g.n, g.k, (*g.gemm)->Describe()));
  }
  return absl::OkStatus();
}

// The canonical K tree's GEMMs, every rank's: a column-parallel GEMM runs, on the rank's slice,
// the algorithm pinned for the full weight's shape (so every output column has the bits of the
// unsliced GEMM); o_proj and down_proj are [hidden, K / 8] segment GEMMs, one algorithm pinned
// per segment shape -- the same pins at every degree. No heuristic fallback: an algorithm
// chosen per slice shape could differ between degrees.
absl::Status CudaModelRunner::PinCanonicalGemms() {
  const ModelConfig& c = config_;
  State& s = *state_;
  const int64_t h = c.hidden_size, hd = c.head_dim, nh = c.num_attention_heads,
                nkv = c.num_key_value_heads, inter = c.intermediate_size, vocab = c.vocab_size;
  using Member = std::unique_ptr<cuda::PinnedGemm> RankState::*;
  struct GemmSpec {
    const char* name;
    int64_t n, k;  // the shape pinned
    cuda::GemmOutput output;
    Member gemm;
    std::function<int64_t(const RankState&)> rank_n;  // the rank's slice of n
    int max_batch;                                    // leaves per RunBatched call
  };
  const int64_t seg_o = nh * hd / cuda::kNumKSegments, seg_down = inter / cuda::kNumKSegments;
  const std::vector<GemmSpec> specs = {
      {"qkv", (nh + 2 * nkv) * hd, h, cuda::GemmOutput::kF32, &RankState::gemm_qkv,
       [hd](const RankState& rk) { return (rk.heads + 2 * rk.kv_heads) * hd; }, 1},
      {"o leaf", h, seg_o, cuda::GemmOutput::kF32, &RankState::gemm_o,
       [h](const RankState&) { return h; }, cuda::kNumKSegments},
      {"gate_up", 2 * inter, h, cuda::GemmOutput::kBf16, &RankState::gemm_gate_up,
       [](const RankState& rk) { return 2 * rk.inter; }, 1},
      {"downleaf", h, seg_down, cuda::GemmOutput::kF32, &RankState::gemm_down,
       [h](const RankState&) { return h; }, cuda::kNumKSegments},
      {"lm_head", vocab, h, cuda::GemmOutput::kF32, &RankState::gemm_lm_head,
       [&s](const RankState&) { return s.vocab_rows; }, 1},
  };
  for (const GemmSpec& g : specs) {
    std::unique_ptr<cuda::PinnedGemm> full;
    std::string why;
    // The leaves run batched: the ladder is built (and probed) on the batched full shape.
    if (cuda::PinnedGemm::Create(s.lt.get(), g.n, g.k, g.output, options_.gemm_pin_m, &full, &why,
                                 g.max_batch) != CUBLAS_STATUS_SUCCESS) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "no split-K-free cuBLASLt algorithm could be pinned for %s [%d x %d], which the "
          "canonical K tree (tensor parallelism) needs:\n%s",
          g.name, g.n, g.k, why));
    }
    if (options_.gemm_ladder) {
      ROLLOUT_RETURN_IF_ERROR(
          CublasError(full->BuildLadder(), absl::StrCat("the GEMM ladder for ", g.name)));
    }
    for (RankState& rk : s.ranks) {
      const int64_t n = g.rank_n(rk);
      why.clear();
      ROLLOUT_RETURN_IF_ERROR(s.SetDevice(rk));
      if (cuda::PinnedGemm::CreateWithAlgo(rk.lt, n, g.k, g.output, full->algo(), &(rk.*g.gemm),
                                           &why, g.max_batch) != CUBLAS_STATUS_SUCCESS) {
        return absl::FailedPreconditionError(absl::StrFormat(
            "the algorithm pinned for %s [%d x %d] does not run rank %d's slice [%d x %d]:\n%s",
            g.name, g.n, g.k, rk.index, n, g.k, why));
      }
      if (options_.gemm_ladder) {
        ROLLOUT_RETURN_IF_ERROR(CublasError((rk.*g.gemm)->CopyLadder(*full),
                                            absl::StrCat("the GEMM ladder for ", g.name)));
      }
    }
    ROLLOUT_RETURN_IF_ERROR(s.SetDevice(s.ranks[0]));
    const int64_t slice = g.rank_n(s.ranks[0]);
    s.gemm_descriptions.push_back(absl::StrFormat(
        "%-8s n=%-6d k=%-6d %s%s", g.name, g.n, g.k, (s.ranks[0].*g.gemm)->Describe(),
        slice != g.n ? absl::StrFormat(" (rank slices n=%d)", slice) : ""));
  }
  return absl::OkStatus();
}

const std::vector<std::string>& CudaModelRunner::gemm_descriptions() const {
  return state_->gemm_descriptions;
}

int64_t CudaModelRunner::weight_bytes() const { return state_->weight_bytes; }

int64_t CudaModelRunner::kv_cache_bytes() const {
  int64_t bytes = 0;
  for (const RankState& rk : state_->ranks) bytes += static_cast<int64_t>(rk.kv.bytes());
  return bytes;
}

}  // namespace rollout
