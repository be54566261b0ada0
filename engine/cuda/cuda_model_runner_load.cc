// CudaModelRunner: construction, weights (checkpoint or synthetic), workspace, pinned GEMMs and
// the KV pool. The forward pass is in cuda_model_runner.cc.
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string_view>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "engine/cuda/cuda_model_runner.h"
#include "engine/cuda/cuda_runner_state.h"
#include "glog/logging.h"

namespace rollout {
namespace {

using cuda::bf16;
using cuda_runner_internal::CublasError;
using cuda_runner_internal::CudaError;
using cuda_runner_internal::Destination;
using cuda_runner_internal::LayerWeights;

uint64_t Fnv1a64(std::string_view s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char ch : s) {
    h ^= ch;
    h *= 0x100000001b3ull;
  }
  return h;
}

uint64_t Mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// engine/random_model.cc's InitFor: kind 1 = norm weight, else normal with this std.
struct RandomInit {
  int kind;
  double std;
};

RandomInit InitFor(const ModelConfig& config, const TensorSpec& t) {
  constexpr double kLogitStd = 3.0;
  constexpr double kBiasStd = 0.02;
  const double h = config.hidden_size;
  if (absl::EndsWith(t.name, "norm.weight")) return {1, 0.0};
  if (absl::EndsWith(t.name, ".bias")) return {0, kBiasStd};
  if (t.name == "lm_head.weight") return {0, kLogitStd / std::sqrt(h)};
  if (t.name == "model.embed_tokens.weight") {
    return {0, config.tie_word_embeddings ? kLogitStd / std::sqrt(h) : 1.0};
  }
  return {0, 1.0 / std::sqrt(static_cast<double>(t.shape.back()))};
}

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

// Copies one tensor of `count` elements in `dtype` (host bytes) to its destination: bf16
// matrices are rounded to nearest even, fp32 vectors widened.
absl::Status Upload(const Destination& dst, DType dtype, const uint8_t* data, int64_t count,
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
  if (dst.f32) {
    std::vector<float> values(count);
    for (int64_t i = 0; i < count; ++i) values[i] = value(i);
    return CudaError(
        cudaMemcpy(dst.ptr, values.data(), count * sizeof(float), cudaMemcpyHostToDevice), what);
  }
  if (dtype == DType::kBF16) {
    return CudaError(cudaMemcpy(dst.ptr, data, count * 2, cudaMemcpyHostToDevice), what);
  }
  std::vector<uint16_t> converted(count);
  for (int64_t i = 0; i < count; ++i) converted[i] = F32ToBF16(value(i));
  return CudaError(cudaMemcpy(dst.ptr, converted.data(), count * 2, cudaMemcpyHostToDevice), what);
}

void SortSpecs(std::vector<WeightSpec>* specs) {
  std::sort(specs->begin(), specs->end(),
            [](const WeightSpec& a, const WeightSpec& b) { return a.name < b.name; });
}

}  // namespace

CudaModelRunner::CudaModelRunner(ModelConfig config, CudaRunnerOptions options)
    : config_(std::move(config)), options_(options), state_(std::make_unique<State>()) {}

CudaModelRunner::~CudaModelRunner() {
  if (state_ != nullptr && state_->stream != nullptr) cudaStreamSynchronize(state_->stream);
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
  State& s = *state_;
  ROLLOUT_RETURN_IF_ERROR(CudaError(cudaSetDevice(o.device), "cudaSetDevice"));
  ROLLOUT_RETURN_IF_ERROR(
      CudaError(cudaStreamCreateWithFlags(&s.stream, cudaStreamNonBlocking), "cudaStreamCreate"));
  ROLLOUT_RETURN_IF_ERROR(CublasError(cublasLtCreate(&s.lt), "cublasLtCreate"));

  // Two passes over the same sequence of Take() calls: sizes, then pointers.
  const int64_t h = c.hidden_size, hd = c.head_dim, nh = c.num_attention_heads,
                nkv = c.num_key_value_heads, inter = c.intermediate_size, vocab = c.vocab_size;
  const int64_t qkv_rows = (nh + 2 * nkv) * hd;
  auto layout = [&](Arena* mats, Arena* vecs) {
    s.embed = mats->Take<bf16>(vocab * h);
    s.lm_head = c.tie_word_embeddings ? s.embed : mats->Take<bf16>(vocab * h);
    s.final_norm = vecs->Take<float>(h);
    s.layers.assign(c.num_layers, LayerWeights{});
    for (LayerWeights& l : s.layers) {
      l.qkv = mats->Take<bf16>(qkv_rows * h);
      l.o = mats->Take<bf16>(h * nh * hd);
      l.gate_up = mats->Take<bf16>(2 * inter * h);
      l.down = mats->Take<bf16>(h * inter);
      l.input_norm = vecs->Take<float>(h);
      l.post_norm = vecs->Take<float>(h);
      if (c.qk_norm) {
        l.q_norm = vecs->Take<float>(hd);
        l.k_norm = vecs->Take<float>(hd);
      }
      if (c.qkv_bias) l.qkv_bias = vecs->Take<float>(qkv_rows);
    }
  };
  Arena size_mats(nullptr), size_vecs(nullptr);
  layout(&size_mats, &size_vecs);
  ROLLOUT_RETURN_IF_ERROR(
      CudaError(s.weights_bf16.Allocate(size_mats.used()),
                absl::StrCat("allocating ", size_mats.used(), " bytes of bf16 weights")));
  ROLLOUT_RETURN_IF_ERROR(
      CudaError(s.weights_f32.Allocate(size_vecs.used()), "allocating fp32 weights"));
  s.weight_bytes = size_mats.used() + size_vecs.used();
  Arena mats(s.weights_bf16.get<char>()), vecs(s.weights_f32.get<char>());
  layout(&mats, &vecs);

  for (int i = 0; i < c.num_layers; ++i) {
    const std::string p = absl::StrCat("model.layers.", i, ".");
    LayerWeights& l = s.layers[i];
    auto mat = [](bf16* base, int64_t offset) { return Destination{base + offset, false}; };
    auto vec = [](float* base, int64_t offset) { return Destination{base + offset, true}; };
    s.destinations[p + "input_layernorm.weight"] = vec(l.input_norm, 0);
    s.destinations[p + "post_attention_layernorm.weight"] = vec(l.post_norm, 0);
    s.destinations[p + "self_attn.q_proj.weight"] = mat(l.qkv, 0);
    s.destinations[p + "self_attn.k_proj.weight"] = mat(l.qkv, nh * hd * h);
    s.destinations[p + "self_attn.v_proj.weight"] = mat(l.qkv, (nh + nkv) * hd * h);
    s.destinations[p + "self_attn.o_proj.weight"] = mat(l.o, 0);
    s.destinations[p + "mlp.gate_proj.weight"] = mat(l.gate_up, 0);
    s.destinations[p + "mlp.up_proj.weight"] = mat(l.gate_up, inter * h);
    s.destinations[p + "mlp.down_proj.weight"] = mat(l.down, 0);
    if (c.qk_norm) {
      s.destinations[p + "self_attn.q_norm.weight"] = vec(l.q_norm, 0);
      s.destinations[p + "self_attn.k_norm.weight"] = vec(l.k_norm, 0);
    }
    if (c.qkv_bias) {
      s.destinations[p + "self_attn.q_proj.bias"] = vec(l.qkv_bias, 0);
      s.destinations[p + "self_attn.k_proj.bias"] = vec(l.qkv_bias, nh * hd);
      s.destinations[p + "self_attn.v_proj.bias"] = vec(l.qkv_bias, (nh + nkv) * hd);
    }
  }
  s.destinations["model.embed_tokens.weight"] = Destination{s.embed, false};
  s.destinations["model.norm.weight"] = Destination{s.final_norm, true};
  if (!c.tie_word_embeddings) s.destinations["lm_head.weight"] = Destination{s.lm_head, false};
  for (const TensorSpec& spec : ExpectedTensors(c)) {
    if (s.destinations.count(spec.name) == 0) {
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
    ROLLOUT_RETURN_IF_ERROR(Upload(s.destinations.at(spec.name), view->dtype, view->data,
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
  ROLLOUT_RETURN_IF_ERROR(CudaError(cudaSetDevice(options_.device), "cudaSetDevice"));
  // Between steps: nothing of ours is in flight, but be explicit.
  ROLLOUT_RETURN_IF_ERROR(CudaError(cudaStreamSynchronize(s.stream), "weight update"));
  for (const HostTensor& t : tensors) {
    ROLLOUT_RETURN_IF_ERROR(
        Upload(s.destinations.at(t.name), t.dtype, t.bytes.data(), NumElements(t.shape), t.name));
  }
  return CudaError(cudaDeviceSynchronize(), "weight update");
}

absl::Status CudaModelRunner::LoadSynthetic(uint64_t seed) {
  State& s = *state_;
  const uint64_t seed_key = Mix64(seed);
  for (const TensorSpec& spec : ExpectedTensors(config_)) {
    const RandomInit init = InitFor(config_, spec);
    // The sum of four uniforms on {0, ..., 65535} has variance 4 * (65536^2 - 1) / 12.
    const double scale = init.std / std::sqrt((65536.0 * 65536.0 - 1.0) / 3.0);
    const uint64_t key = Mix64(seed_key ^ Fnv1a64(spec.name));
    const Destination& dst = s.destinations.at(spec.name);
    s.weight_specs.push_back(WeightSpec{spec.name, DType::kBF16, spec.shape});
    ROLLOUT_RETURN_IF_ERROR(CudaError(
        cuda::FillRandomWeights(key, scale, init.kind, NumElements(spec.shape),
                                dst.f32 ? nullptr : static_cast<bf16*>(dst.ptr),
                                dst.f32 ? static_cast<float*>(dst.ptr) : nullptr, s.stream),
        absl::StrCat("generating ", spec.name)));
  }
  SortSpecs(&s.weight_specs);
  return CudaError(cudaStreamSynchronize(s.stream), "generating synthetic weights");
}

// RoPE tables, workspace, pinned GEMMs, then the KV pool from what memory is left.
absl::Status CudaModelRunner::Finish() {
  const ModelConfig& c = config_;
  State& s = *state_;
  const int64_t h = c.hidden_size, hd = c.head_dim, nh = c.num_attention_heads,
                nkv = c.num_key_value_heads, inter = c.intermediate_size, vocab = c.vocab_size;

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
  }

  const int64_t t = options_.max_batch_tokens, r = options_.max_logit_rows;
  const int64_t qkv_cols = (nh + 2 * nkv) * hd;
  for (auto [buffer, bytes] : std::vector<std::pair<cuda::DeviceBuffer*, int64_t>>{
           {&s.x, t * h * 4},
           {&s.xn, t * h * 2},
           {&s.qkv, t * qkv_cols * 4},
           {&s.q, t * nh * hd * 4},
           {&s.attn, t * nh * hd * 2},
           {&s.gate_up, t * 2 * inter * 2},
           {&s.act, t * inter * 2},
           {&s.final_rows, r * h * 2},
           {&s.logits, r * vocab * 4},
           {&s.row_specs, r * static_cast<int64_t>(sizeof(cuda::LogitsRowSpec))},
           {&s.row_results, r * static_cast<int64_t>(sizeof(cuda::LogitsRowResult))},
       }) {
    ROLLOUT_RETURN_IF_ERROR(CudaError(buffer->Allocate(bytes), "allocating activations"));
  }
  ROLLOUT_RETURN_IF_ERROR(CudaError(
      s.row_specs_host.Allocate(r * sizeof(cuda::LogitsRowSpec)), "allocating sampling specs"));
  ROLLOUT_RETURN_IF_ERROR(CudaError(
      s.row_results_host.Allocate(r * sizeof(cuda::LogitsRowResult)), "allocating results"));

  const int64_t pin_m = options_.gemm_pin_m;
  struct GemmSpec {
    const char* name;
    int64_t n, k;
    cuda::GemmOutput output;
    std::unique_ptr<cuda::PinnedGemm>* gemm;
  };
  for (const GemmSpec& g : std::vector<GemmSpec>{
           {"qkv", qkv_cols, h, cuda::GemmOutput::kF32, &s.gemm_qkv},
           {"o", h, nh * hd, cuda::GemmOutput::kF32Accumulate, &s.gemm_o},
           {"gate_up", 2 * inter, h, cuda::GemmOutput::kBf16, &s.gemm_gate_up},
           {"down", h, inter, cuda::GemmOutput::kF32Accumulate, &s.gemm_down},
           {"lm_head", vocab, h, cuda::GemmOutput::kF32, &s.gemm_lm_head},
       }) {
    std::string why = "gemm_pin_m <= 0 asks for the heuristic";
    if (pin_m <= 0 || cuda::PinnedGemm::Create(s.lt, g.n, g.k, g.output, pin_m, g.gemm, &why) !=
                          CUBLAS_STATUS_SUCCESS) {
      if (pin_m > 0) {
        LOG(WARNING) << absl::StrFormat(
            "no split-K-free cuBLASLt algorithm could be pinned for %s [%d x %d]; using the "
            "no-workspace heuristic per m (tests/gpu/gemm_test.cc checks its row invariance):\n%s",
            g.name, g.n, g.k, why);
      }
      ROLLOUT_RETURN_IF_ERROR(
          CublasError(cuda::PinnedGemm::CreateHeuristic(s.lt, g.n, g.k, g.output, g.gemm),
                      absl::StrCat("creating the GEMM for ", g.name)));
    }
    s.gemm_descriptions.push_back(
        absl::StrFormat("%-8s n=%-6d k=%-6d %s", g.name, g.n, g.k, (*g.gemm)->Describe()));
  }

  // The KV pool.
  size_t free_bytes = 0, total_bytes = 0;
  ROLLOUT_RETURN_IF_ERROR(CudaError(cudaMemGetInfo(&free_bytes, &total_bytes), "cudaMemGetInfo"));
  const int64_t block_elems = static_cast<int64_t>(options_.kv_block_size) * nkv * hd;
  const int64_t bytes_per_block = 2 * c.num_layers * block_elems * 2;
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
        "free", budget,
        options_.kv_block_size, bytes_per_block, free_bytes));
  }
  ROLLOUT_RETURN_IF_ERROR(CudaError(cudaDeviceSynchronize(), "uploading RoPE tables"));
  num_kv_blocks_ = static_cast<int32_t>(blocks - 1);
  s.pad_block = static_cast<int32_t>(blocks - 1);
  s.kv_layer_elems = blocks * block_elems;
  ROLLOUT_RETURN_IF_ERROR(
      CudaError(s.kv.Allocate(blocks * bytes_per_block),
                absl::StrCat("allocating a KV cache of ", blocks * bytes_per_block, " bytes")));
  return absl::OkStatus();
}

const std::vector<std::string>& CudaModelRunner::gemm_descriptions() const {
  return state_->gemm_descriptions;
}

int64_t CudaModelRunner::weight_bytes() const { return state_->weight_bytes; }

int64_t CudaModelRunner::kv_cache_bytes() const { return static_cast<int64_t>(state_->kv.bytes()); }

}  // namespace rollout
