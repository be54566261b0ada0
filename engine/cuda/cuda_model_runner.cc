#include "engine/cuda/cuda_model_runner.h"

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <string_view>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "glog/logging.h"
#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/ops.h"

namespace rollout {
namespace {

using cuda::bf16;

absl::Status CudaError(cudaError_t err, const std::string& what) {
  if (err == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorName(err), " (",
                                          cudaGetErrorString(err), ")"));
}

absl::Status CublasError(cublasStatus_t status, const std::string& what) {
  if (status == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": ", cuda::CublasStatusName(status)));
}

#define ROLLOUT_RETURN_IF_ERROR(expr)      \
  do {                                     \
    absl::Status _status = (expr);         \
    if (!_status.ok()) return _status;     \
  } while (0)

// engine/random_model.cc's name hash and mixer, so synthetic weights equal its files bitwise.
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

struct LayerWeights {
  bf16* qkv = nullptr;      // [(heads + 2 * kv_heads) * head_dim, hidden]: q rows, k rows, v rows
  bf16* o = nullptr;        // [hidden, heads * head_dim]
  bf16* gate_up = nullptr;  // [2 * intermediate, hidden]: gate rows then up rows
  bf16* down = nullptr;     // [hidden, intermediate]
  float* input_norm = nullptr;  // [hidden]
  float* post_norm = nullptr;   // [hidden]
  float* q_norm = nullptr;      // [head_dim]; nullptr unless qk_norm
  float* k_norm = nullptr;      // [head_dim]; nullptr unless qk_norm
  float* qkv_bias = nullptr;    // [(heads + 2 * kv_heads) * head_dim]; nullptr unless qkv_bias
};

// Where a checkpoint tensor goes on the device.
struct Destination {
  void* ptr = nullptr;
  bool f32 = false;  // fp32 (norms, biases) or bf16 (matrices)
};

enum Family {
  kMeta,
  kEmbed,
  kNorm,
  kGemmQkv,
  kQkvRope,
  kAttention,
  kGemmO,
  kGemmGateUp,
  kSiluMul,
  kGemmDown,
  kLmHead,
  kLogitsCopy,
  kNumFamilies
};
constexpr const char* kFamilyNames[kNumFamilies] = {
    "metadata h2d", "embedding",     "rmsnorm",   "gemm qkv",  "qk-norm+rope+kv write",
    "attention",    "gemm o (+res)", "gemm gate_up", "silu*up", "gemm down (+res)",
    "lm_head (+final norm)", "logits d2h"};

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
  return CudaError(cudaMemcpy(dst.ptr, converted.data(), count * 2, cudaMemcpyHostToDevice),
                   what);
}

void SortSpecs(std::vector<WeightSpec>* specs) {
  std::sort(specs->begin(), specs->end(),
            [](const WeightSpec& a, const WeightSpec& b) { return a.name < b.name; });
}

}  // namespace

struct CudaModelRunner::State {
  ~State() {
    for (cudaEvent_t e : events) cudaEventDestroy(e);
    gemm_qkv.reset();
    gemm_o.reset();
    gemm_gate_up.reset();
    gemm_down.reset();
    gemm_lm_head.reset();
    if (lt != nullptr) cublasLtDestroy(lt);
    if (stream != nullptr) cudaStreamDestroy(stream);
  }

  cudaStream_t stream = nullptr;
  cublasLtHandle_t lt = nullptr;

  cuda::DeviceBuffer weights_bf16;
  cuda::DeviceBuffer weights_f32;
  int64_t weight_bytes = 0;
  bf16* embed = nullptr;    // [vocab, hidden]
  bf16* lm_head = nullptr;  // [vocab, hidden]; == embed when tied
  float* final_norm = nullptr;  // [hidden]
  std::vector<LayerWeights> layers;
  std::map<std::string, Destination> destinations;
  std::vector<WeightSpec> weight_specs;  // sorted by name

  cuda::DeviceBuffer rope_cos;  // [max_position, head_dim / 2]
  cuda::DeviceBuffer rope_sin;  // [max_position, head_dim / 2]
  cuda::DeviceBuffer kv;        // [layers, 2 (k, v), num_blocks, block_size, kv_heads, head_dim]
  int64_t kv_layer_elems = 0;   // elements of one layer's K (or V)

  // Activations for max_batch_tokens tokens.
  cuda::DeviceBuffer x;           // [tokens, hidden] fp32: the residual stream
  cuda::DeviceBuffer xn;          // [tokens, hidden] bf16: normed GEMM input
  cuda::DeviceBuffer qkv;         // [tokens, (heads + 2 * kv_heads) * head_dim] fp32
  cuda::DeviceBuffer q;           // [tokens, heads, head_dim] fp32
  cuda::DeviceBuffer attn;        // [tokens, heads * head_dim] bf16
  cuda::DeviceBuffer gate_up;     // [tokens, 2 * intermediate] bf16
  cuda::DeviceBuffer act;         // [tokens, intermediate] bf16
  cuda::DeviceBuffer final_rows;  // [max_logit_rows, hidden] bf16
  cuda::DeviceBuffer logits;      // [max_logit_rows, vocab] fp32
  cuda::DeviceBuffer meta;        // int32 batch metadata (see ForwardSlice)
  cuda::DeviceBuffer partials;    // [tokens, heads, splits, head_dim + 2] fp32
  cuda::PinnedHostBuffer meta_host;

  std::unique_ptr<cuda::PinnedGemm> gemm_qkv, gemm_o, gemm_gate_up, gemm_down, gemm_lm_head;
  std::vector<std::string> gemm_descriptions;

  bool profiling = false;
  std::vector<cudaEvent_t> events;  // recorded in order during one Forward
  std::vector<int> event_family;    // family of the work that ends at events[i]
  size_t num_events = 0;
  double family_ms[kNumFamilies] = {};
  int64_t profiled_forwards = 0;

  absl::Status Mark(int family) {
    if (!profiling) return absl::OkStatus();
    if (num_events == events.size()) {
      cudaEvent_t e;
      ROLLOUT_RETURN_IF_ERROR(CudaError(cudaEventCreate(&e), "cudaEventCreate"));
      events.push_back(e);
      event_family.push_back(0);
    }
    event_family[num_events] = family;
    ROLLOUT_RETURN_IF_ERROR(
        CudaError(cudaEventRecord(events[num_events], stream), "cudaEventRecord"));
    ++num_events;
    return absl::OkStatus();
  }
};

CudaModelRunner::CudaModelRunner(ModelConfig config, CudaRunnerOptions options)
    : config_(std::move(config)), options_(options), state_(std::make_unique<State>()) {}

CudaModelRunner::~CudaModelRunner() {
  if (state_ != nullptr && state_->stream != nullptr) cudaStreamSynchronize(state_->stream);
}

absl::StatusOr<std::unique_ptr<CudaModelRunner>> CudaModelRunner::Create(
    const Checkpoint& checkpoint, const CudaRunnerOptions& options) {
  absl::StatusOr<ModelConfig> config = ParseModelConfig(checkpoint.config_json());
  if (!config.ok()) {
    return absl::Status(config.status().code(), absl::StrCat(checkpoint.dir(), "/config.json: ",
                                                             config.status().message()));
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
    return absl::InvalidArgumentError("max_batch_tokens must be in [1, 65535], max_logit_rows >= 1");
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
  ROLLOUT_RETURN_IF_ERROR(CudaError(s.weights_bf16.Allocate(size_mats.used()),
                                    absl::StrCat("allocating ", size_mats.used(),
                                                 " bytes of bf16 weights")));
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
      return absl::InvalidArgumentError(absl::StrCat(
          checkpoint.dir(), ": tensor ", spec.name, " has shape ", ShapeToString(view->shape),
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
      return absl::InvalidArgumentError(absl::StrFormat(
          "tensor '%s': %d bytes given, expected %d", t.name, t.bytes.size(), expected));
    }
  }
  ROLLOUT_RETURN_IF_ERROR(CudaError(cudaSetDevice(options_.device), "cudaSetDevice"));
  // Between steps: nothing of ours is in flight, but be explicit.
  ROLLOUT_RETURN_IF_ERROR(CudaError(cudaStreamSynchronize(s.stream), "weight update"));
  for (const HostTensor& t : tensors) {
    ROLLOUT_RETURN_IF_ERROR(Upload(s.destinations.at(t.name), t.dtype, t.bytes.data(),
                                   NumElements(t.shape), t.name));
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
      inv_freq[i] = std::pow(static_cast<double>(c.rope_theta), -(2.0 * static_cast<double>(i)) / hd);
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
       }) {
    ROLLOUT_RETURN_IF_ERROR(CudaError(buffer->Allocate(bytes), "allocating activations"));
  }

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
  const int64_t blocks = std::min(budget / bytes_per_block, max_blocks);
  if (blocks < 1) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "KV cache of %d bytes holds no block of %d tokens (%d bytes each); %d bytes free",
        budget, options_.kv_block_size, bytes_per_block, free_bytes));
  }
  ROLLOUT_RETURN_IF_ERROR(CudaError(cudaDeviceSynchronize(), "uploading RoPE tables"));
  num_kv_blocks_ = static_cast<int32_t>(blocks);
  s.kv_layer_elems = blocks * block_elems;
  ROLLOUT_RETURN_IF_ERROR(CudaError(s.kv.Allocate(blocks * bytes_per_block),
                                    absl::StrCat("allocating a KV cache of ",
                                                 blocks * bytes_per_block, " bytes")));
  return absl::OkStatus();
}

void CudaModelRunner::EnableProfiling(bool on) { state_->profiling = on; }

void CudaModelRunner::ResetProfile() {
  std::fill(std::begin(state_->family_ms), std::end(state_->family_ms), 0.0);
  state_->profiled_forwards = 0;
}

CudaForwardProfile CudaModelRunner::profile() const {
  CudaForwardProfile p;
  for (int f = 0; f < kNumFamilies; ++f) {
    p.names.push_back(kFamilyNames[f]);
    p.ms.push_back(state_->family_ms[f]);
  }
  p.forwards = state_->profiled_forwards;
  return p;
}

const std::vector<std::string>& CudaModelRunner::gemm_descriptions() const {
  return state_->gemm_descriptions;
}

int64_t CudaModelRunner::weight_bytes() const { return state_->weight_bytes; }

int64_t CudaModelRunner::kv_cache_bytes() const {
  return static_cast<int64_t>(state_->kv.bytes());
}

absl::Status CudaModelRunner::Forward(const ForwardBatch& batch, std::vector<float>* logits) {
  const ModelConfig& c = config_;
  const int64_t t = batch.num_tokens();
  if (static_cast<int64_t>(batch.positions.size()) != t ||
      static_cast<int64_t>(batch.token_seq.size()) != t) {
    return absl::InvalidArgumentError("token_ids, positions and token_seq differ in length");
  }
  for (int64_t i = 0; i < t; ++i) {
    const int32_t id = batch.token_ids[i];
    const int32_t pos = batch.positions[i];
    const int32_t seq = batch.token_seq[i];
    if (id < 0 || id >= c.vocab_size) return absl::InvalidArgumentError(absl::StrCat("token id ", id));
    if (seq < 0 || seq >= static_cast<int32_t>(batch.block_tables.size())) {
      return absl::InternalError(absl::StrCat("token_seq ", seq, " has no block table"));
    }
    const std::vector<int32_t>& table = batch.block_tables[seq];
    if (pos < 0 || pos >= c.max_position_embeddings ||
        pos / options_.kv_block_size >= static_cast<int64_t>(table.size())) {
      return absl::InternalError(absl::StrCat("position ", pos, " outside its block table"));
    }
  }
  for (const std::vector<int32_t>& table : batch.block_tables) {
    for (int32_t b : table) {
      if (b < 0 || b >= num_kv_blocks_) return absl::InternalError(absl::StrCat("KV block ", b));
    }
  }
  for (size_t i = 0; i < batch.logit_rows.size(); ++i) {
    if (batch.logit_rows[i] < 0 || batch.logit_rows[i] >= t ||
        (i > 0 && batch.logit_rows[i] <= batch.logit_rows[i - 1])) {
      return absl::InvalidArgumentError("logit_rows must be ascending token indices");
    }
  }
  ROLLOUT_RETURN_IF_ERROR(CudaError(cudaSetDevice(options_.device), "cudaSetDevice"));
  if (logits != nullptr) logits->resize(batch.logit_rows.size() * c.vocab_size);
  State& s = *state_;
  s.num_events = 0;
  ROLLOUT_RETURN_IF_ERROR(s.Mark(kMeta));
  for (int64_t begin = 0; begin < t; begin += options_.max_batch_tokens) {
    ROLLOUT_RETURN_IF_ERROR(
        ForwardSlice(batch, begin, std::min<int64_t>(t, begin + options_.max_batch_tokens), logits));
  }
  ROLLOUT_RETURN_IF_ERROR(CudaError(cudaStreamSynchronize(s.stream), "forward pass"));
  if (s.profiling && s.num_events > 1) {
    for (size_t i = 1; i < s.num_events; ++i) {
      float ms = 0.0f;
      ROLLOUT_RETURN_IF_ERROR(CudaError(
          cudaEventElapsedTime(&ms, s.events[i - 1], s.events[i]), "cudaEventElapsedTime"));
      s.family_ms[s.event_family[i]] += ms;
    }
    ++s.profiled_forwards;
  }
  return absl::OkStatus();
}

// Tokens [begin, end) of the batch through every layer, then their logit rows.
absl::Status CudaModelRunner::ForwardSlice(const ForwardBatch& batch, int64_t begin, int64_t end,
                                           std::vector<float>* logits) {
  const ModelConfig& c = config_;
  State& s = *state_;
  const int64_t n = end - begin;
  const int64_t h = c.hidden_size, hd = c.head_dim, nh = c.num_attention_heads,
                nkv = c.num_key_value_heads, inter = c.intermediate_size, vocab = c.vocab_size;
  const int32_t bs = options_.kv_block_size;
  const int group = static_cast<int>(nh / nkv);
  const int item_tokens = cuda::AttentionItemTokens(group);

  // Logit rows inside this slice: [row_begin, row_end) of batch.logit_rows (ascending).
  const auto row_begin = std::lower_bound(batch.logit_rows.begin(), batch.logit_rows.end(),
                                          static_cast<int32_t>(begin)) -
                         batch.logit_rows.begin();
  const auto row_end = std::lower_bound(batch.logit_rows.begin(), batch.logit_rows.end(),
                                        static_cast<int32_t>(end)) -
                       batch.logit_rows.begin();
  const int64_t num_rows = row_end - row_begin;

  // Work items: runs of consecutive tokens of one sequence, cut into pieces of item_tokens.
  std::vector<int32_t> items_one, items_many;  // (first token, count) pairs, slice-relative
  for (int64_t i = begin; i < end;) {
    int64_t j = i + 1;
    while (j < end && j - i < item_tokens && batch.token_seq[j] == batch.token_seq[i]) ++j;
    std::vector<int32_t>& items = j - i == 1 ? items_one : items_many;
    items.push_back(static_cast<int32_t>(i - begin));
    items.push_back(static_cast<int32_t>(j - i));
    i = j;
  }
  // Attention split partials, [n, heads, max_splits, head_dim + 2] fp32: for every token with
  // the tensor-core kernel, for the one-token items with the SIMT kernel's split-parallel decode.
  const bool mma = options_.attention_kernel == CudaAttentionKernel::kTensorCore;
  int32_t max_splits = 1;
  for (int64_t i = begin; i < end; ++i) {
    const bool one_token = (i == begin || batch.token_seq[i - 1] != batch.token_seq[i]) &&
                           (i + 1 == end || batch.token_seq[i + 1] != batch.token_seq[i]);
    if (mma || one_token) {
      max_splits = std::max(max_splits, batch.positions[i] / options_.attention_split_size + 1);
    }
  }
  if (mma || options_.split_parallel_decode) {
    const size_t bytes = static_cast<size_t>(n) * nh * max_splits * (hd + 2) * sizeof(float);
    if (s.partials.bytes() < bytes) {
      ROLLOUT_RETURN_IF_ERROR(
          CudaError(s.partials.Allocate(bytes + bytes / 2), "allocating attention partials"));
    }
  }
  // Block tables of the sequences in the slice, concatenated in order of first use.
  std::map<int32_t, int32_t> table_offset_of;
  int64_t tables_size = 0;
  for (int64_t i = begin; i < end; ++i) {
    if (table_offset_of.emplace(batch.token_seq[i], static_cast<int32_t>(tables_size)).second) {
      tables_size += static_cast<int64_t>(batch.block_tables[batch.token_seq[i]].size());
    }
  }

  // Metadata, int32, one upload: token_ids [n], positions [n], kv_slots [n], table_offsets [n],
  // logit rows [num_rows], items_one [2 * k1], items_many [2 * k2], tables [tables_size]; the
  // item arrays start on even offsets (int2 loads).
  auto even = [](int64_t x) { return (x + 1) / 2 * 2; };
  const int64_t off_tokens = 0, off_pos = n, off_slots = 2 * n, off_tab = 3 * n, off_rows = 4 * n;
  const int64_t off_one = even(off_rows + num_rows);
  const int64_t off_many = even(off_one + static_cast<int64_t>(items_one.size()));
  const int64_t off_tables = off_many + static_cast<int64_t>(items_many.size());
  const int64_t meta_ints = off_tables + tables_size;
  if (s.meta.bytes() < static_cast<size_t>(meta_ints) * 4) {
    const size_t bytes = static_cast<size_t>(meta_ints) * 4 * 2;  // headroom against regrowth
    ROLLOUT_RETURN_IF_ERROR(CudaError(s.meta.Allocate(bytes), "allocating batch metadata"));
    ROLLOUT_RETURN_IF_ERROR(CudaError(s.meta_host.Allocate(bytes), "allocating batch metadata"));
  }
  int32_t* m = s.meta_host.get<int32_t>();
  for (int64_t i = 0; i < n; ++i) {
    const int32_t pos = batch.positions[begin + i];
    const std::vector<int32_t>& table = batch.block_tables[batch.token_seq[begin + i]];
    m[off_tokens + i] = batch.token_ids[begin + i];
    m[off_pos + i] = pos;
    m[off_slots + i] = table[pos / bs] * bs + pos % bs;
    m[off_tab + i] = table_offset_of.at(batch.token_seq[begin + i]);
  }
  for (int64_t r = 0; r < num_rows; ++r) {
    m[off_rows + r] = static_cast<int32_t>(batch.logit_rows[row_begin + r] - begin);
  }
  std::copy(items_one.begin(), items_one.end(), m + off_one);
  std::copy(items_many.begin(), items_many.end(), m + off_many);
  for (const auto& [seq, offset] : table_offset_of) {
    const std::vector<int32_t>& table = batch.block_tables[seq];
    std::copy(table.begin(), table.end(), m + off_tables + offset);
  }
  ROLLOUT_RETURN_IF_ERROR(CudaError(cudaMemcpyAsync(s.meta.get(), m, meta_ints * 4,
                                                    cudaMemcpyHostToDevice, s.stream),
                                    "uploading batch metadata"));
  const int32_t* d = s.meta.get<int32_t>();
  ROLLOUT_RETURN_IF_ERROR(s.Mark(kMeta));

  float* x = s.x.get<float>();
  bf16* xn = s.xn.get<bf16>();
  bf16* attn = s.attn.get<bf16>();
  bf16* gate_up = s.gate_up.get<bf16>();
  bf16* act = s.act.get<bf16>();
  ROLLOUT_RETURN_IF_ERROR(CudaError(
      cuda::EmbeddingGather(d + off_tokens, n, s.embed, h, x, s.stream), "embedding gather"));
  ROLLOUT_RETURN_IF_ERROR(s.Mark(kEmbed));

  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  for (int layer = 0; layer < c.num_layers; ++layer) {
    const LayerWeights& l = s.layers[layer];
    bf16* k_cache = s.kv.get<bf16>() + 2 * layer * s.kv_layer_elems;
    const cuda::KvCacheView cache{k_cache, k_cache + s.kv_layer_elems, bs,
                                  static_cast<int32_t>(nkv), static_cast<int32_t>(hd)};

    ROLLOUT_RETURN_IF_ERROR(CudaError(
        cuda::RmsNorm(x, nullptr, n, h, l.input_norm, c.rms_norm_eps, xn, s.stream), "rmsnorm"));
    ROLLOUT_RETURN_IF_ERROR(s.Mark(kNorm));
    ROLLOUT_RETURN_IF_ERROR(
        CublasError(s.gemm_qkv->Run(xn, n, l.qkv, s.qkv.get(), s.stream), "qkv projection"));
    ROLLOUT_RETURN_IF_ERROR(s.Mark(kGemmQkv));

    cuda::QkvParams qp;
    qp.qkv = s.qkv.get<float>();
    qp.num_tokens = n;
    qp.positions = d + off_pos;
    qp.kv_slots = d + off_slots;
    if (l.qkv_bias != nullptr) {
      qp.q_bias = l.qkv_bias;
      qp.k_bias = l.qkv_bias + nh * hd;
      qp.v_bias = l.qkv_bias + (nh + nkv) * hd;
    }
    qp.q_norm = l.q_norm;
    qp.k_norm = l.k_norm;
    qp.eps = c.rms_norm_eps;
    qp.rope_cos = s.rope_cos.get<float>();
    qp.rope_sin = s.rope_sin.get<float>();
    qp.num_heads = static_cast<int32_t>(nh);
    qp.q_out = s.q.get<float>();
    ROLLOUT_RETURN_IF_ERROR(
        CudaError(cuda::QkvNormRopeWriteKv(qp, cache, s.stream), "qk norm, rope and KV write"));
    ROLLOUT_RETURN_IF_ERROR(s.Mark(kQkvRope));

    cuda::AttentionParams ap;
    ap.q = s.q.get<float>();
    ap.positions = d + off_pos;
    ap.table_offsets = d + off_tab;
    ap.tables = d + off_tables;
    ap.num_heads = static_cast<int32_t>(nh);
    ap.split_size = options_.attention_split_size;
    ap.scale = scale;
    ap.out = attn;
    ap.items = reinterpret_cast<const int2*>(d + off_one);
    ap.num_items = static_cast<int32_t>(items_one.size() / 2);
    if (mma) {
      ap.partials = s.partials.get<float>();
      ap.max_splits = max_splits;
      ROLLOUT_RETURN_IF_ERROR(CudaError(
          cuda::PagedAttentionMma(ap, cuda::AttentionBlockShape::kOneToken, cache, s.stream),
          "attention (one-token items)"));
      ap.items = reinterpret_cast<const int2*>(d + off_many);
      ap.num_items = static_cast<int32_t>(items_many.size() / 2);
      ROLLOUT_RETURN_IF_ERROR(CudaError(
          cuda::PagedAttentionMma(ap, cuda::AttentionBlockShape::kManyTokens, cache, s.stream),
          "attention (many-token items)"));
      ROLLOUT_RETURN_IF_ERROR(CudaError(
          cuda::MergeAttentionSplits(ap, n, static_cast<int32_t>(hd), s.stream),
          "attention split merge"));
    } else {
      if (options_.split_parallel_decode) {
        ap.partials = s.partials.get<float>();
        ap.max_splits = max_splits;
      }
      ROLLOUT_RETURN_IF_ERROR(CudaError(
          cuda::PagedAttention(ap, cuda::AttentionBlockShape::kOneToken, cache, s.stream),
          "attention (one-token items)"));
      ap.partials = nullptr;
      ap.max_splits = 0;
      ap.items = reinterpret_cast<const int2*>(d + off_many);
      ap.num_items = static_cast<int32_t>(items_many.size() / 2);
      ROLLOUT_RETURN_IF_ERROR(CudaError(
          cuda::PagedAttention(ap, cuda::AttentionBlockShape::kManyTokens, cache, s.stream),
          "attention (many-token items)"));
    }
    ROLLOUT_RETURN_IF_ERROR(s.Mark(kAttention));

    ROLLOUT_RETURN_IF_ERROR(
        CublasError(s.gemm_o->Run(attn, n, l.o, x, s.stream), "o projection"));
    ROLLOUT_RETURN_IF_ERROR(s.Mark(kGemmO));
    ROLLOUT_RETURN_IF_ERROR(CudaError(
        cuda::RmsNorm(x, nullptr, n, h, l.post_norm, c.rms_norm_eps, xn, s.stream), "rmsnorm"));
    ROLLOUT_RETURN_IF_ERROR(s.Mark(kNorm));
    ROLLOUT_RETURN_IF_ERROR(CublasError(s.gemm_gate_up->Run(xn, n, l.gate_up, gate_up, s.stream),
                                        "gate/up projection"));
    ROLLOUT_RETURN_IF_ERROR(s.Mark(kGemmGateUp));
    ROLLOUT_RETURN_IF_ERROR(
        CudaError(cuda::SiluMul(gate_up, n, inter, act, s.stream), "silu * up"));
    ROLLOUT_RETURN_IF_ERROR(s.Mark(kSiluMul));
    ROLLOUT_RETURN_IF_ERROR(
        CublasError(s.gemm_down->Run(act, n, l.down, x, s.stream), "down projection"));
    ROLLOUT_RETURN_IF_ERROR(s.Mark(kGemmDown));
  }

  // Logits, max_logit_rows rows at a time: final RMSNorm of the gathered rows, then lm_head.
  for (int64_t r0 = 0; r0 < num_rows; r0 += options_.max_logit_rows) {
    const int64_t rn = std::min<int64_t>(options_.max_logit_rows, num_rows - r0);
    ROLLOUT_RETURN_IF_ERROR(CudaError(cuda::RmsNorm(x, d + off_rows + r0, rn, h, s.final_norm,
                                                    c.rms_norm_eps, s.final_rows.get<bf16>(),
                                                    s.stream),
                                      "final rmsnorm"));
    ROLLOUT_RETURN_IF_ERROR(CublasError(
        s.gemm_lm_head->Run(s.final_rows.get<bf16>(), rn, s.lm_head, s.logits.get(), s.stream),
        "lm_head"));
    ROLLOUT_RETURN_IF_ERROR(s.Mark(kLmHead));
    if (logits != nullptr) {
      float* dst = logits->data() + (row_begin + r0) * vocab;
      ROLLOUT_RETURN_IF_ERROR(CudaError(cudaMemcpyAsync(dst, s.logits.get(), rn * vocab * 4,
                                                        cudaMemcpyDeviceToHost, s.stream),
                                        "copying logits"));
      ROLLOUT_RETURN_IF_ERROR(s.Mark(kLogitsCopy));
    }
  }
  // The pinned metadata buffer is rewritten by the next slice.
  return CudaError(cudaStreamSynchronize(s.stream), "forward pass");
}

}  // namespace rollout
