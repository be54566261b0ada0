#include "runner/cpu/cpu_model_runner.h"

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status.h"
#include "glog/logging.h"
#include "model/dtype_cast.h"
#include "model/random_model.h"
#include "runner/cpu/cpu_runner_internal.h"

namespace rollout {
namespace {

using cpu_runner_internal::LayerName;

// A layer without qkv_bias holds empty biases; the kernels take that as nullptr.
const float* BiasOrNull(const std::vector<float>& bias) {
  return bias.empty() ? nullptr : bias.data();
}

// The negative control's RMSNorm: the sum of squares runs forwards or backwards depending on
// how many rows the batch has -- exactly the kind of batch dependence the contract forbids.
void BatchVariantRmsNorm(float* x, const float* weight, int64_t rows, int64_t dim, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    float* row = x + r * dim;
    float ss = 0.0f;
    if (rows % 2 == 0) {
      for (int64_t i = 0; i < dim; ++i) ss += row[i] * row[i];
    } else {
      for (int64_t i = dim - 1; i >= 0; --i) ss += row[i] * row[i];
    }
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(dim) + eps);
    for (int64_t i = 0; i < dim; ++i) row[i] = row[i] * inv * weight[i];
  }
}

}  // namespace

// Ranks 1..n-1 on threads of their own, rank 0 on the caller's: Run(fn) calls fn(rank) for every
// rank at once (they meet in collectives, so each needs its own thread) and returns when all
// are done.
class CpuModelRunner::RankThreads {
 public:
  explicit RankThreads(int num_ranks) {
    for (int r = 1; r < num_ranks; ++r) threads_.emplace_back([this, r] { Loop(r); });
  }
  ~RankThreads() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    work_cv_.notify_all();
    for (std::thread& t : threads_) t.join();
  }

  void Run(const std::function<void(int)>& fn) {
    if (threads_.empty()) {
      fn(0);
      return;
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      fn_ = &fn;
      pending_ = static_cast<int>(threads_.size());
      ++generation_;
    }
    work_cv_.notify_all();
    fn(0);
    std::unique_lock<std::mutex> lock(mu_);
    done_cv_.wait(lock, [&] { return pending_ == 0; });
    fn_ = nullptr;
  }

 private:
  void Loop(int rank) {
    uint64_t seen = 0;
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      work_cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      const std::function<void(int)>* fn = fn_;
      lock.unlock();
      (*fn)(rank);
      lock.lock();
      if (--pending_ == 0) done_cv_.notify_one();
    }
  }

  std::vector<std::thread> threads_;
  std::mutex mu_;
  std::condition_variable work_cv_, done_cv_;
  // Protected by mu_.
  const std::function<void(int)>* fn_ = nullptr;
  uint64_t generation_ = 0;
  int pending_ = 0;
  bool stop_ = false;
};

CpuModelRunner::CpuModelRunner(ModelConfig config, CpuRunnerOptions options)
    : config_(std::move(config)),
      options_(options),
      rope_(ComputeRopeFrequencies(config_.rope_scaling, config_.rope_theta, config_.head_dim)),
      served_dtype_(ServedDType(config_)) {
  const int tp = options_.tensor_parallel;
  // The cores are shared: tp ranks of total / tp threads each (thread counts never change bits).
  const int total = options_.num_threads > 0
                        ? options_.num_threads
                        : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const int per_rank = tp == 1 ? options_.num_threads : std::max(1, total / tp);
  std::vector<std::unique_ptr<Communicator>> comms = CreateInProcessGroup(tp);
  ranks_.resize(tp);
  for (int r = 0; r < tp; ++r) {
    ranks_[r].index = r;
    ranks_[r].comm = std::move(comms[r]);
    ranks_[r].pool = std::make_unique<cpu::ThreadPool>(per_rank);
  }
  threads_ = std::make_unique<RankThreads>(tp);
}

CpuModelRunner::~CpuModelRunner() = default;

MemoryPlan PlanHostMemory(const ModelConfig& c, const CpuRunnerOptions& options) {
  const int64_t tp = options.tensor_parallel, t = std::max(options.max_batch_tokens, 1);
  const int64_t hd = c.head_dim, h = c.hidden_size;
  const int64_t kv_block = 2ll * c.num_layers * options.kv_block_size * c.num_key_value_heads * hd *
                           static_cast<int64_t>(sizeof(float));
  // One Forward's activations on every rank (CpuModelRunner::Activations) and its logits.
  const RankShard shard = ShardOf(c, static_cast<int32_t>(tp), 0, (c.vocab_size + tp - 1) / tp);
  int64_t per_token = 3 * h + 2 * shard.heads * hd + 2 * shard.kv_heads * hd +
                      3 * shard.inter + (tp > 1 ? tp * h : 0);
  if (c.is_moe()) {
    // MoeBlock's buffers: router logits, per (token, rank) its expert's output (and the
    // gathered partials), one expert's rows at a time, and the routing.
    const int64_t k = c.num_experts_per_tok;
    per_token += c.num_experts + k * h * (1 + (tp > 1 ? tp : 0)) + 2 * h + 3 * shard.moe_inter +
                 2 * k + c.RoutingSize();
  }
  const int64_t workspace = (tp * t * per_token + t * c.vocab_size * (tp > 1 ? 2 : 1)) *
                            static_cast<int64_t>(sizeof(float));
  MemoryPlan plan;
  plan.where = "host memory";
  plan.items = {
      {"weights (fp32)", ParameterCount(c) * static_cast<int64_t>(sizeof(float)), ""},
      {"KV cache", options.kv_cache_bytes / std::max<int64_t>(kv_block, 1) * kv_block,
       "--kv_cache_mb"},
      {absl::StrFormat("step workspace at %d tokens", t), workspace, "--max_batch_tokens"},
  };
  plan.available = AvailableHostMemory();
  return plan;
}

absl::StatusOr<std::unique_ptr<CpuModelRunner>> CpuModelRunner::Create(
    const Checkpoint& checkpoint, const CpuRunnerOptions& options) {
  absl::StatusOr<ModelConfig> config = ReadModelConfig(checkpoint);
  if (!config.ok()) return config.status();
  if (options.kv_block_size <= 0 || options.attention_split_size <= 0 ||
      options.attention_split_size % options.kv_block_size != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "attention split size (%d) must be a positive multiple of the KV block size (%d)",
        options.attention_split_size, options.kv_block_size));
  }
  if (absl::Status s = CheckTensorParallel(*config, options.tensor_parallel); !s.ok()) return s;
  const MemoryPlan plan = PlanHostMemory(*config, options);
  LOG(INFO) << "memory plan, " << plan.ToString();
  ROLLOUT_RETURN_IF_ERROR(plan.Check());
  auto runner = std::unique_ptr<CpuModelRunner>(new CpuModelRunner(*std::move(config), options));
  if (absl::Status s = runner->Load(checkpoint); !s.ok()) return s;
  return runner;
}

namespace {

// Copies the pieces of a full tensor whose element i is get(i) into their ranks.
template <typename Pieces, typename Get>
void CopyPieces(const Pieces& pieces, int64_t row_length, Get get) {
  for (const auto& p : pieces) {
    float* out = p.dest->data() + p.offset;
    for (int64_t r = 0; r < p.rows; ++r) {
      const int64_t src = (p.row_begin + r) * row_length + p.col_begin;
      for (int64_t c = 0; c < p.cols; ++c) out[r * p.cols + c] = get(src + c);
    }
  }
}

}  // namespace

absl::Status CpuModelRunner::Load(const Checkpoint& checkpoint) {
  // Checking against the full list first gives one clear error for a missing tensor even when
  // it is one this backend would read late.
  for (const TensorSpec& spec : ExpectedTensors(config_)) {
    if (checkpoint.Find(spec.name) == nullptr) {
      return absl::NotFoundError(
          absl::StrCat(checkpoint.dir(), ": checkpoint lacks tensor ", spec.name));
    }
  }
  const int tp = options_.tensor_parallel;
  vocab_per_rank_ = (config_.vocab_size + tp - 1) / tp;
  for (Rank& rk : ranks_) {
    static_cast<RankShard&>(rk) = ShardOf(config_, tp, rk.index, vocab_per_rank_);
    rk.layers.resize(config_.num_layers);
    int32_t moe_index = 0;
    for (int32_t i = 0; i < config_.num_layers; ++i) {
      rk.layers[i].moe = config_.IsMoeLayer(i);
      if (rk.layers[i].moe) rk.layers[i].moe_index = moe_index++;
    }
  }
  BindWeights(checkpoint);
  ROLLOUT_RETURN_IF_ERROR(ReadWeights(checkpoint));
  return ReserveKvCache();
}

void CpuModelRunner::Bind(const Checkpoint& checkpoint, const std::string& name,
                          std::vector<int64_t> shape, const PieceOf& piece) {
  const int64_t rows = shape[0];
  int64_t cols = 1;
  for (size_t d = 1; d < shape.size(); ++d) cols *= shape[d];
  Binding& b = bindings_[name];
  b.count = rows * cols;
  b.row_length = cols;
  for (Rank& rk : ranks_) {
    Piece p = piece(rk, rows, cols);
    const size_t end = static_cast<size_t>(p.offset + p.rows * p.cols);
    if (p.dest->size() < end) p.dest->resize(end);
    b.pieces.push_back(p);
  }
  weight_specs_.push_back(WeightSpec{name, served_dtype_, std::move(shape)});
}

void CpuModelRunner::BindWeights(const Checkpoint& checkpoint) {
  const int64_t h = config_.hidden_size, vocab = config_.vocab_size;
  // The rank's vocab rows [vocab_begin, vocab_end) of embed or lm_head.
  auto vocab_rows = [](std::vector<float> Rank::*m) {
    return [m](Rank& rk, int64_t, int64_t cols) {
      return Piece{&(rk.*m), 0, rk.vocab_begin, rk.vocab_end - rk.vocab_begin, 0, cols};
    };
  };
  Bind(checkpoint, "model.embed_tokens.weight", {vocab, h}, vocab_rows(&Rank::embed));
  Bind(checkpoint, "model.norm.weight", {h}, [](Rank& rk, int64_t rows, int64_t cols) {
    return Piece{&rk.final_norm, 0, 0, rows, 0, cols};
  });
  if (!config_.tie_word_embeddings) {
    Bind(checkpoint, "lm_head.weight", {vocab, h}, vocab_rows(&Rank::lm_head));
  }
  for (int i = 0; i < config_.num_layers; ++i) BindLayer(checkpoint, i);
}

void CpuModelRunner::BindLayer(const Checkpoint& checkpoint, int i) {
  const ModelConfig& c = config_;
  const int64_t h = c.hidden_size, hd = c.head_dim, nh = c.num_attention_heads,
                nkv = c.num_key_value_heads, inter = c.intermediate_size;
  auto bind = [&](const char* suffix, std::vector<int64_t> shape, const PieceOf& piece) {
    Bind(checkpoint, LayerName(i, suffix), std::move(shape), piece);
  };
  // The shapes of a piece: all of it, the rank's rows, or its columns.
  using Member = std::vector<float> Layer::*;
  auto whole = [i](Member m) {
    return [i, m](Rank& rk, int64_t rows, int64_t cols) {
      return Piece{&(rk.layers[i].*m), 0, 0, rows, 0, cols};
    };
  };
  // Rows of the rank's heads (q) or KV heads (k, v): head_dim rows each.
  auto heads = [i, hd](Member m, bool kv) {
    return [i, m, kv, hd](Rank& rk, int64_t, int64_t cols) {
      const int64_t first = kv ? rk.kv_head_begin : rk.index * rk.heads;
      const int64_t count = kv ? rk.kv_heads : rk.heads;
      return Piece{&(rk.layers[i].*m), 0, first * hd, count * hd, 0, cols};
    };
  };
  // Columns [begin, begin + width) of a row-parallel weight: the rank's K slice.
  auto k_slice = [i, hd](Member m, bool attention) {
    return [i, m, attention, hd](Rank& rk, int64_t rows, int64_t) {
      const int64_t width = attention ? rk.heads * hd : rk.inter;
      return Piece{&(rk.layers[i].*m), 0, 0, rows, rk.index * width, width};
    };
  };
  bind("input_layernorm.weight", {h}, whole(&Layer::input_norm));
  bind("self_attn.q_proj.weight", {nh * hd, h}, heads(&Layer::q, false));
  bind("self_attn.k_proj.weight", {nkv * hd, h}, heads(&Layer::k, true));
  bind("self_attn.v_proj.weight", {nkv * hd, h}, heads(&Layer::v, true));
  bind("self_attn.o_proj.weight", {h, nh * hd}, k_slice(&Layer::o, true));
  bind("post_attention_layernorm.weight", {h}, whole(&Layer::post_norm));
  if (c.IsMoeLayer(i)) {
    BindMoeLayer(checkpoint, i);
  } else {
    // One [2 * inter, hidden] matrix per rank: the MLP's two input projections in one pass
    // over x -- the rank's gate rows, then its up rows.
    bind("mlp.gate_proj.weight", {inter, h}, [i](Rank& rk, int64_t, int64_t cols) {
      return Piece{&rk.layers[i].gate_up, 0, rk.index * rk.inter, rk.inter, 0, cols};
    });
    bind("mlp.up_proj.weight", {inter, h}, [i](Rank& rk, int64_t, int64_t cols) {
      return Piece{&rk.layers[i].gate_up, rk.inter * cols, rk.index * rk.inter, rk.inter, 0,
                   cols};
    });
    bind("mlp.down_proj.weight", {h, inter}, k_slice(&Layer::down, false));
  }
  if (c.qkv_bias) {
    bind("self_attn.q_proj.bias", {nh * hd}, heads(&Layer::q_bias, false));
    bind("self_attn.k_proj.bias", {nkv * hd}, heads(&Layer::k_bias, true));
    bind("self_attn.v_proj.bias", {nkv * hd}, heads(&Layer::v_bias, true));
  }
  if (c.qk_norm) {
    bind("self_attn.q_norm.weight", {hd}, whole(&Layer::q_norm));
    bind("self_attn.k_norm.weight", {hd}, whole(&Layer::k_norm));
  }
}

absl::Status CpuModelRunner::ReadWeights(const Checkpoint& checkpoint) {
  // In name order, as weight_specs() lists them.
  std::sort(weight_specs_.begin(), weight_specs_.end(),
            [](const WeightSpec& a, const WeightSpec& b) { return a.name < b.name; });
  for (const WeightSpec& spec : weight_specs_) {
    absl::StatusOr<std::vector<float>> t = checkpoint.ReadF32(spec.name, spec.shape);
    if (!t.ok()) return t.status();
    // A tensor in another float dtype serves as its cast to the served one (model/dtype_cast.h).
    if (checkpoint.Find(spec.name)->dtype != served_dtype_) {
      ROLLOUT_RETURN_IF_ERROR(RoundToDType(spec.name, served_dtype_, t->data(), t->size()));
    }
    const Binding& b = bindings_.at(spec.name);
    const float* src = t->data();
    CopyPieces(b.pieces, b.row_length, [src](int64_t i) { return src[i]; });
  }
  return absl::OkStatus();
}

absl::Status CpuModelRunner::ReserveKvCache() {
  const int64_t hd = config_.head_dim, nkv = config_.num_key_value_heads;
  // Sized as for the unsharded model, so the block count (and with it every scheduling
  // decision) is the same at every tensor-parallel degree.
  const int64_t kv_bytes_per_block = 2ll * config_.num_layers * options_.kv_block_size * nkv * hd *
                                     static_cast<int64_t>(sizeof(float));
  num_kv_blocks_ = static_cast<int32_t>(options_.kv_cache_bytes / kv_bytes_per_block);
  if (num_kv_blocks_ < 1) {
    return absl::InvalidArgumentError(
        absl::StrFormat("KV cache of %d bytes holds no block of %d tokens (%d bytes each): "
                        "give the server more (--kv_cache_mb)",
                        options_.kv_cache_bytes, options_.kv_block_size, kv_bytes_per_block));
  }
  for (Rank& rk : ranks_) {
    const int64_t cache_floats =
        static_cast<int64_t>(num_kv_blocks_) * options_.kv_block_size * rk.kv_heads * hd;
    absl::StatusOr<ReleasableHostMemory> kv = ReleasableHostMemory::Allocate(
        2 * rk.layers.size() * cache_floats * sizeof(float));
    if (!kv.ok()) {
      return absl::ResourceExhaustedError(
          absl::StrCat("allocating the KV cache (lower --kv_cache_mb): ", kv.status().message()));
    }
    rk.kv = *std::move(kv);
    float* next = rk.kv.get<float>();
    for (Layer& l : rk.layers) {
      l.k_cache = next;
      l.v_cache = next + cache_floats;
      next += 2 * cache_floats;
    }
  }
  return absl::OkStatus();
}

int64_t CpuModelRunner::kv_cache_bytes() const {
  int64_t bytes = 0;
  for (const Rank& rk : ranks_) bytes += static_cast<int64_t>(rk.kv.bytes());
  return bytes;
}

absl::StatusOr<int64_t> CpuModelRunner::ResidentKvCacheBytes() const {
  int64_t bytes = 0;
  for (const Rank& rk : ranks_) {
    absl::StatusOr<int64_t> resident = rk.kv.ResidentBytes();
    if (!resident.ok()) return resident.status();
    bytes += *resident;
  }
  return bytes;
}

absl::StatusOr<ReleasedMemory> CpuModelRunner::ReleaseMemory(bool /*weights*/) {
  ReleasedMemory freed;
  for (Rank& rk : ranks_) {
    if (rk.kv.released()) continue;
    ROLLOUT_RETURN_IF_ERROR(rk.kv.Release());
    freed.kv_cache_bytes += static_cast<int64_t>(rk.kv.bytes());
  }
  return freed;
}

absl::StatusOr<ReleasedMemory> CpuModelRunner::ResumeMemory() {
  ReleasedMemory taken;
  for (const Rank& rk : ranks_) {
    if (rk.kv.released()) taken.kv_cache_bytes += static_cast<int64_t>(rk.kv.bytes());
  }
  if (taken.kv_cache_bytes == 0) return taken;
  const int64_t available = options_.available_host_memory ? options_.available_host_memory()
                                                           : AvailableHostMemory();
  if (available > 0 && available < taken.kv_cache_bytes) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "ResumeMemory needs %.2f GiB of host memory for the KV cache and the host has %.2f GiB "
        "available; free memory (the trainer's) and call ResumeMemory again (the memory stays "
        "released)",
        taken.kv_cache_bytes / 1073741824.0, available / 1073741824.0));
  }
  for (size_t r = 0; r < ranks_.size(); ++r) {
    if (absl::Status s = ranks_[r].kv.Reacquire(); !s.ok()) {
      for (size_t q = 0; q < r; ++q) (void)ranks_[q].kv.Release();  // all or nothing
      return absl::ResourceExhaustedError(absl::StrCat(
          "ResumeMemory: ", s.message(), "; free memory and call ResumeMemory again (the "
          "memory stays released)"));
    }
  }
  return taken;
}

absl::Status CpuModelRunner::UpdateWeights(const std::vector<HostTensorView>& tensors) {
  for (const HostTensorView& t : tensors) {
    if (absl::Status s = CheckTensorAgainstSpec(weight_specs_, t.name, t.dtype, t.shape); !s.ok()) {
      return s;
    }
    const Binding& b = bindings_.at(t.name);
    if (t.nbytes != static_cast<size_t>(b.count) * DTypeSize(t.dtype)) {
      return absl::InvalidArgumentError(
          absl::StrFormat("tensor '%s': %d bytes given, expected %d", t.name, t.nbytes,
                          static_cast<size_t>(b.count) * DTypeSize(t.dtype)));
    }
  }
  // Each full tensor is sliced into the ranks' shards as Load did.
  for (const HostTensorView& t : tensors) {
    const Binding& b = bindings_.at(t.name);
    const uint8_t* in = t.data;
    switch (t.dtype) {
      case DType::kF32:
        CopyPieces(b.pieces, b.row_length, [in](int64_t i) {
          float v;
          std::memcpy(&v, in + 4 * i, 4);
          return v;
        });
        break;
      case DType::kBF16:
        CopyPieces(b.pieces, b.row_length, [in](int64_t i) {
          uint16_t v;
          std::memcpy(&v, in + 2 * i, 2);
          return BF16ToF32(v);
        });
        break;
      case DType::kF16:
        CopyPieces(b.pieces, b.row_length, [in](int64_t i) {
          uint16_t v;
          std::memcpy(&v, in + 2 * i, 2);
          return F16ToF32(v);
        });
        break;
    }
  }
  return absl::OkStatus();
}

absl::Status CpuModelRunner::Forward(const ForwardBatch& batch, std::vector<float>* logits) {
  std::vector<std::vector<int32_t>> routing;
  return ForwardWithRouting(batch, logits, &routing);
}

absl::Status CpuModelRunner::CheckRouting(const ForwardBatch& batch) const {
  const ModelConfig& c = config_;
  if (!batch.asks_routing()) return absl::OkStatus();
  if (!c.is_moe()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "routing replay needs a mixture-of-experts model; %s has no experts", c.architecture));
  }
  if (batch.forced_routing.empty()) return absl::OkStatus();
  if (batch.forced_routing.size() != batch.logit_rows.size()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("forced routing for %d logits rows, the batch has %d",
                        batch.forced_routing.size(), batch.logit_rows.size()));
  }
  const int32_t k = c.num_experts_per_tok;
  for (size_t r = 0; r < batch.forced_routing.size(); ++r) {
    const std::vector<int32_t>& ids = batch.forced_routing[r];
    if (ids.empty()) continue;
    if (static_cast<int64_t>(ids.size()) != c.RoutingSize()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "forced routing of logits row %d: %d expert ids, expected %d (%d MoE layers x %d)", r,
          ids.size(), c.RoutingSize(), c.NumMoeLayers(), k));
    }
    for (size_t i = 0; i < ids.size(); ++i) {
      if (ids[i] < 0 || ids[i] >= c.num_experts) {
        return absl::InvalidArgumentError(
            absl::StrFormat("forced routing of logits row %d: expert id %d outside [0, %d)", r,
                            ids[i], c.num_experts));
      }
      for (size_t j = i - i % k; j < i; ++j) {
        if (ids[j] == ids[i]) {
          return absl::InvalidArgumentError(absl::StrFormat(
              "forced routing of logits row %d: expert %d twice in MoE layer %d", r, ids[i],
              static_cast<int64_t>(i) / k));
        }
      }
    }
  }
  return absl::OkStatus();
}

absl::Status CpuModelRunner::ForwardWithRouting(const ForwardBatch& batch,
                                                std::vector<float>* logits,
                                                std::vector<std::vector<int32_t>>* routing) {
  const ModelConfig& c = config_;
  const int64_t t = batch.num_tokens();
  const int64_t vocab = c.vocab_size;
  const int64_t max_blocks = num_kv_blocks_;
  // Everything that could fail is checked here, before the ranks start: a rank that returned
  // early would leave its peers waiting in a collective.
  if (!batch.fed_tokens.empty()) {
    return absl::InvalidArgumentError("fed tokens outside a launched step (LaunchStep)");
  }
  if (ranks_[0].kv.released()) {
    return absl::FailedPreconditionError("the KV cache is released (ResumeMemory first)");
  }
  for (int64_t i = 0; i < t; ++i) {
    const int32_t id = batch.token_ids[i];
    const int32_t pos = batch.positions[i];
    const std::vector<int32_t>& table = batch.block_tables[batch.token_seq[i]];
    if (id < 0 || id >= vocab) return absl::InvalidArgumentError(absl::StrCat("token id ", id));
    if (pos < 0 || pos / options_.kv_block_size >= static_cast<int64_t>(table.size())) {
      return absl::InternalError(absl::StrCat("position ", pos, " outside its block table"));
    }
    for (int32_t b : table) {
      if (b < 0 || b >= max_blocks) return absl::InternalError(absl::StrCat("KV block ", b));
    }
  }
  for (int32_t row : batch.logit_rows) {
    if (row < 0 || row >= t) return absl::InternalError(absl::StrCat("logit row ", row));
  }
  ROLLOUT_RETURN_IF_ERROR(CheckRouting(batch));
  StepRouting step_routing;
  step_routing.forced.assign(t, nullptr);
  for (size_t r = 0; r < batch.forced_routing.size(); ++r) {
    if (!batch.forced_routing[r].empty()) {
      step_routing.forced[batch.logit_rows[r]] = batch.forced_routing[r].data();
    }
  }
  step_routing.used.resize(t * c.RoutingSize());

  std::vector<const int32_t*> tables(t);
  for (int64_t i = 0; i < t; ++i) tables[i] = batch.block_tables[batch.token_seq[i]].data();
  const cpu::TokenSlots slots{batch.positions.data(), tables.data(), t};
  std::vector<absl::Status> status(ranks_.size());
  threads_->Run(
      [&](int r) { status[r] = RankForward(ranks_[r], batch, slots, &step_routing, logits); });
  for (const absl::Status& s : status) {
    if (!s.ok()) return s;
  }
  routing->clear();
  if (batch.return_routing) {
    const int64_t size = c.RoutingSize();
    for (int32_t row : batch.logit_rows) {
      routing->emplace_back(step_routing.used.begin() + row * size,
                            step_routing.used.begin() + (row + 1) * size);
    }
  }
  return absl::OkStatus();
}

// One rank's activations during one Forward of t tokens, and the buffer its collectives
// gather into. Shapes use the rank's own heads, KV heads and intermediate features.
absl::Status CpuModelRunner::RankForward(Rank& rk, const ForwardBatch& batch,
                                         const cpu::TokenSlots& slots, StepRouting* routing,
                                         std::vector<float>* logits) {
  Activations a(batch.num_tokens(), config_, rk, options_.tensor_parallel);
  const int64_t half = config_.head_dim / 2;
  for (int64_t i = 0; i < a.t; ++i) {
    RopeCosSin(rope_, batch.positions[i], &a.rope_cos[i * half], &a.rope_sin[i * half]);
  }
  ROLLOUT_RETURN_IF_ERROR(EmbedTokens(rk, batch, &a));
  for (Layer& l : rk.layers) {
    ROLLOUT_RETURN_IF_ERROR(AttentionBlock(rk, l, batch, slots, &a));
    ROLLOUT_RETURN_IF_ERROR(l.moe ? MoeBlock(rk, l, routing, &a) : MlpBlock(rk, l, &a));
  }
  return ComputeLogits(rk, batch, a.x, logits);
}

absl::Status CpuModelRunner::EmbedTokens(Rank& rk, const ForwardBatch& batch,
                                         Activations* a) const {
  const int tp = options_.tensor_parallel;
  const int64_t t = a->t, h = config_.hidden_size;
  std::vector<float>& x = a->x;
  if (tp == 1) {
    for (int64_t i = 0; i < t; ++i) {
      std::memcpy(&x[i * h], &rk.embed[static_cast<int64_t>(batch.token_ids[i]) * h],
                  h * sizeof(float));
    }
    return absl::OkStatus();
  }
  // Vocab-parallel embedding: each rank fills the rows of the tokens it owns; the gathered
  // rows are selected (never summed), so x is the exact embedding row at every degree.
  std::vector<float>& proj = a->proj;
  std::fill(proj.begin(), proj.end(), 0.0f);
  for (int64_t i = 0; i < t; ++i) {
    const int64_t id = batch.token_ids[i];
    if (id >= rk.vocab_begin && id < rk.vocab_end) {
      std::memcpy(&proj[i * h], &rk.embed[(id - rk.vocab_begin) * h], h * sizeof(float));
    }
  }
  ROLLOUT_RETURN_IF_ERROR(rk.comm->AllGather(proj.data(), t * h, a->gathered.data()));
  for (int64_t i = 0; i < t; ++i) {
    const int64_t owner = batch.token_ids[i] / vocab_per_rank_;
    std::memcpy(&x[i * h], &a->gathered[(owner * t + i) * h], h * sizeof(float));
  }
  return absl::OkStatus();
}

absl::Status CpuModelRunner::RowParallel(Rank& rk, const float* in, int64_t k_full, const float* w,
                                         Activations* a) const {
  const int tp = options_.tensor_parallel;
  const int64_t t = a->t, h = config_.hidden_size;
  if (tp == 1) {
    cpu::SegmentedMatMul(rk.pool.get(), in, t, k_full, w, h, nullptr, a->proj.data());
    return absl::OkStatus();
  }
  // The rank's node of the canonical K tree.
  const int seg_begin = rk.index * cpu::kNumKSegments / tp;
  const int seg_end = (rk.index + 1) * cpu::kNumKSegments / tp;
  cpu::SegmentedPartialMatMul(rk.pool.get(), in, t, w, h, k_full, seg_begin, seg_end,
                              a->proj.data());
  ROLLOUT_RETURN_IF_ERROR(rk.comm->AllGather(a->proj.data(), t * h, a->gathered.data()));
  cpu::CombinePartials(a->gathered.data(), tp, t * h, a->proj.data());
  return absl::OkStatus();
}

absl::Status CpuModelRunner::AttentionBlock(Rank& rk, Layer& l, const ForwardBatch& batch,
                                            const cpu::TokenSlots& slots, Activations* a) const {
  const ModelConfig& c = config_;
  const int64_t t = a->t, h = c.hidden_size, hd = c.head_dim, nh = rk.heads, nkv = rk.kv_heads;
  cpu::ThreadPool* pool = rk.pool.get();
  float *x = a->x.data(), *xn = a->xn.data(), *q = a->q.data(), *k = a->k.data(), *v = a->v.data(),
        *attn = a->attn.data();
  cpu::RmsNorm(x, l.input_norm.data(), t, h, c.rms_norm_eps, xn);
  cpu::MatMul(pool, xn, t, h, l.q.data(), nh * hd, BiasOrNull(l.q_bias), q);
  cpu::MatMul(pool, xn, t, h, l.k.data(), nkv * hd, BiasOrNull(l.k_bias), k);
  cpu::MatMul(pool, xn, t, h, l.v.data(), nkv * hd, BiasOrNull(l.v_bias), v);
  if (c.qk_norm) {
    cpu::RmsNorm(q, l.q_norm.data(), t * nh, hd, c.rms_norm_eps, q);
    cpu::RmsNorm(k, l.k_norm.data(), t * nkv, hd, c.rms_norm_eps, k);
  }
  cpu::ApplyRope(q, a->rope_cos.data(), a->rope_sin.data(), t, nh, hd);
  cpu::ApplyRope(k, a->rope_cos.data(), a->rope_sin.data(), t, nkv, hd);
  cpu::KvCacheLayer cache{l.k_cache, l.v_cache, options_.kv_block_size, nkv, hd};
  cpu::WriteKv(k, v, slots, cache);
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  cpu::PagedAttention(pool, q, slots, nh, cache, scale, attn);
  ROLLOUT_RETURN_IF_ERROR(RowParallel(rk, attn, c.num_attention_heads * hd, l.o.data(), a));
  cpu::Add(x, a->proj.data(), t * h);
  return absl::OkStatus();
}

absl::Status CpuModelRunner::MlpBlock(Rank& rk, const Layer& l, Activations* a) const {
  const ModelConfig& c = config_;
  const int64_t t = a->t, h = c.hidden_size, inter = rk.inter;
  float *x = a->x.data(), *xn = a->xn.data(), *gate_up = a->gate_up.data(), *act = a->act.data();
  cpu::RmsNorm(x, l.post_norm.data(), t, h, c.rms_norm_eps, xn);
  cpu::MatMul(rk.pool.get(), xn, t, h, l.gate_up.data(), 2 * inter, nullptr, gate_up);
  cpu::SiluMul(gate_up, t, inter, act);
  ROLLOUT_RETURN_IF_ERROR(RowParallel(rk, act, c.intermediate_size, l.down.data(), a));
  cpu::Add(x, a->proj.data(), t * h);
  return absl::OkStatus();
}

absl::Status CpuModelRunner::ComputeLogits(Rank& rk, const ForwardBatch& batch,
                                           const std::vector<float>& x,
                                           std::vector<float>* logits) const {
  const ModelConfig& c = config_;
  const int tp = options_.tensor_parallel;
  const int64_t h = c.hidden_size, vocab = c.vocab_size;
  cpu::ThreadPool* pool = rk.pool.get();
  const int64_t r = static_cast<int64_t>(batch.logit_rows.size());
  std::vector<float> rows(r * h);  // [logit rows, hidden]
  for (int64_t i = 0; i < r; ++i) {
    std::memcpy(&rows[i * h], &x[static_cast<int64_t>(batch.logit_rows[i]) * h], h * sizeof(float));
  }
  if (options_.batch_variant_for_testing) {
    BatchVariantRmsNorm(rows.data(), rk.final_norm.data(), r, h, c.rms_norm_eps);
  } else {
    cpu::RmsNorm(rows.data(), rk.final_norm.data(), r, h, c.rms_norm_eps, rows.data());
  }
  const float* head = rk.lm_head.empty() ? rk.embed.data() : rk.lm_head.data();
  if (tp == 1) {
    logits->resize(r * vocab);
    cpu::MatMul(pool, rows.data(), r, h, head, vocab, nullptr, logits->data());
    return absl::OkStatus();
  }
  // Vocab-parallel lm_head: every logit is one Dot over the full hidden size wherever it is
  // computed; the ranks' columns (padded to vocab_per_rank_) are gathered into full rows.
  const int64_t vpr = vocab_per_rank_;
  const int64_t mine = rk.vocab_end - rk.vocab_begin;
  std::vector<float> local(r * mine), padded(r * vpr, 0.0f), all(tp * r * vpr);
  cpu::MatMul(pool, rows.data(), r, h, head, mine, nullptr, local.data());
  for (int64_t i = 0; i < r; ++i) {
    std::memcpy(&padded[i * vpr], &local[i * mine], mine * sizeof(float));
  }
  ROLLOUT_RETURN_IF_ERROR(rk.comm->AllGather(padded.data(), r * vpr, all.data()));
  if (rk.index != 0) return absl::OkStatus();
  logits->resize(r * vocab);
  for (int src = 0; src < tp; ++src) {
    const int64_t begin = std::min(vocab, src * vpr);
    const int64_t width = std::min(vocab, (src + 1) * vpr) - begin;
    for (int64_t i = 0; i < r; ++i) {
      std::memcpy(&(*logits)[i * vocab + begin], &all[(src * r + i) * vpr], width * sizeof(float));
    }
  }
  return absl::OkStatus();
}

}  // namespace rollout
