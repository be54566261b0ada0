// Weight updates from IPC exports (engine/ipc_tensor.h), driven offline through the engine with
// a runner whose "device memory" is host memory: the engine's half of UpdateWeightsFromIpc --
// validation before the runner is asked, the digest known before the policy acts, exports
// closed on every path before the reply -- without a GPU.
#include <atomic>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_format.h"
#include "engine/engine.h"
#include "engine/engine_test_util.h"
#include "engine/ipc_tensor.h"
#include "engine/sampler.h"
#include "gtest/gtest.h"
#include "model/random_model.h"
#include "runner/cpu/cpu_model_runner.h"

namespace rollout {
namespace {

constexpr char kDown[] = "model.layers.0.mlp.down_proj.weight";
constexpr char kUp[] = "model.layers.0.mlp.up_proj.weight";
constexpr char kGpu[] = "0a1b2c3d-0000-4000-8000-00000000abcd";
constexpr char kOtherGpu[] = "0a1b2c3d-0000-4000-8000-00000000ffff";

const std::string& ModelDir() {
  static const std::string dir = [] {
    std::string d = ::testing::TempDir() + "engine-ipc-test-small";
    RandomModelOptions options;
    options.preset = "small";  // slow enough on the CPU that a long sample is still running
    options.seed = 5;
    EXPECT_TRUE(WriteRandomModel(options, d).ok());
    return d;
  }();
  return dir;
}

// The other process's device memory, as this test plays it: allocations by handle. Counts what
// runners have open, so that a test can tell every export was closed.
struct FakeIpcHost {
  std::mutex mu;
  std::map<std::string, std::vector<uint8_t>> allocations;  // by handle
  int open = 0;                                             // handles mapped now
  int opens = 0;                                            // handles mapped, ever
  int open_calls = 0;                                       // OpenIpcTensors calls

  // Exports `bytes` as a new allocation; returns its handle.
  std::string Export(std::vector<uint8_t> bytes) {
    std::lock_guard<std::mutex> lock(mu);
    std::string handle = absl::StrFormat("fake-ipc-handle-%d", allocations.size());
    handle.resize(kIpcHandleBytes, '\0');
    allocations[handle] = std::move(bytes);
    return handle;
  }
  int open_now() {
    std::lock_guard<std::mutex> lock(mu);
    return open;
  }
};

class FakeOpened final : public OpenedIpcTensors {
 public:
  FakeOpened(std::shared_ptr<FakeIpcHost> host) : host_(std::move(host)) {}
  ~FakeOpened() override {
    std::lock_guard<std::mutex> lock(host_->mu);
    host_->open -= handles;
  }
  const TensorDigests& digests() const override { return digests_; }

  int handles = 0;
  TensorDigests digests_;
  std::vector<HostTensor> tensors;  // what a device copy would read

 private:
  std::shared_ptr<FakeIpcHost> host_;
};

// The CPU runner, reading "device memory" from a FakeIpcHost as the CUDA runner reads IPC
// exports: each distinct handle opened once, every tensor inside its allocation, hashed at open.
class FakeIpcRunner final : public WrappingRunner {
 public:
  FakeIpcRunner(std::unique_ptr<ModelRunner> inner, std::shared_ptr<FakeIpcHost> host)
      : WrappingRunner(std::move(inner)), host_(std::move(host)) {}

  const char* backend_name() const override { return "fake-ipc"; }

  absl::StatusOr<std::unique_ptr<OpenedIpcTensors>> OpenIpcTensors(
      const std::vector<IpcTensorSource>& tensors) override {
    auto opened = std::make_unique<FakeOpened>(host_);
    std::lock_guard<std::mutex> lock(host_->mu);
    ++host_->open_calls;
    std::map<std::string, const std::vector<uint8_t>*> mapped;
    for (const IpcTensorSource& t : tensors) {
      if (t.device_uuid != kGpu) {
        return absl::InvalidArgumentError(absl::StrFormat("tensor '%s': another GPU", t.name));
      }
      auto it = mapped.find(t.ipc_handle);
      if (it == mapped.end()) {
        auto a = host_->allocations.find(t.ipc_handle);
        if (a == host_->allocations.end()) {
          return absl::InvalidArgumentError(absl::StrFormat("tensor '%s': bad handle", t.name));
        }
        it = mapped.emplace(t.ipc_handle, &a->second).first;
        ++opened->handles;
        ++host_->open;
        ++host_->opens;
      }
      const std::vector<uint8_t>& a = *it->second;
      if (t.offset_bytes + t.nbytes() > a.size()) {
        return absl::InvalidArgumentError(absl::StrFormat("tensor '%s': outside", t.name));
      }
      const uint8_t* p = a.data() + t.offset_bytes;
      opened->digests_[t.name] = TensorDigest(p, t.nbytes());
      opened->tensors.push_back(
          HostTensor{t.name, t.dtype, t.shape, std::vector<uint8_t>(p, p + t.nbytes())});
    }
    return std::unique_ptr<OpenedIpcTensors>(std::move(opened));
  }
  absl::Status UpdateWeightsFromIpc(const OpenedIpcTensors& opened) override {
    return inner().UpdateWeights(ViewsOf(dynamic_cast<const FakeOpened&>(opened).tensors));
  }

 private:
  std::shared_ptr<FakeIpcHost> host_;
};

std::unique_ptr<CpuModelRunner> CpuRunner() {
  auto ck = Checkpoint::Open(ModelDir());
  EXPECT_TRUE(ck.ok());
  auto runner = CpuModelRunner::Create(**ck, {});
  EXPECT_TRUE(runner.ok());
  return *std::move(runner);
}

// An engine serving the model as "v0" with its load digests; on the fake IPC runner when `host`
// is set, else on the plain CPU runner.
std::unique_ptr<Engine> MakeEngine(std::shared_ptr<FakeIpcHost> host) {
  std::unique_ptr<CpuModelRunner> cpu = CpuRunner();
  EngineOptions options;
  options.weight_version = "v0";
  auto ck = Checkpoint::Open(ModelDir());
  options.weight_digests = DigestCheckpoint(**ck, cpu->weight_specs());
  std::unique_ptr<ModelRunner> runner = std::move(cpu);
  if (host != nullptr) runner = std::make_unique<FakeIpcRunner>(std::move(runner), host);
  auto engine = Engine::Create(std::move(runner), options);
  EXPECT_TRUE(engine.ok());
  return *std::move(engine);
}

// The checkpoint's bytes of `name`, each bf16 value times `scale`.
HostTensor Scaled(const std::string& name, float scale) {
  return ScaledCheckpointTensor(ModelDir(), name, scale);
}

// `tensors` exported as one allocation, at 256-byte aligned offsets after `lead` bytes (as a
// caching allocator packs them), as IPC sources.
std::vector<IpcTensorSource> ExportTogether(FakeIpcHost* host,
                                            const std::vector<HostTensor>& tensors,
                                            size_t lead = 512) {
  std::vector<uint8_t> allocation(lead, 0xEE);
  std::vector<IpcTensorSource> sources;
  for (const HostTensor& t : tensors) {
    IpcTensorSource s;
    s.name = t.name;
    s.dtype = t.dtype;
    s.shape = t.shape;
    s.offset_bytes = allocation.size();
    s.device_uuid = kGpu;
    allocation.insert(allocation.end(), t.bytes.begin(), t.bytes.end());
    allocation.resize((allocation.size() + 255) / 256 * 256, 0xEE);
    sources.push_back(std::move(s));
  }
  const std::string handle = host->Export(std::move(allocation));
  for (IpcTensorSource& s : sources) s.ipc_handle = handle;
  return sources;
}

SampleSpec Spec(int32_t max_new_tokens = 10) {
  SampleSpec s;
  s.prompt = {5, 17, 99, 3, 200, 41, 7};
  s.params.temperature = 0.8f;
  s.params.max_new_tokens = max_new_tokens;
  s.params.ignore_eos = true;
  s.sample_seed = 11;
  return s;
}

SampleCompletion RunOne(Engine* engine, SampleSpec spec = Spec()) {
  Collector collector(1);
  EXPECT_TRUE(engine->Submit({spec}, collector.Sink()).ok());
  return collector.Wait()[0];
}

// Updates and waits for the answer; `open_at_reply` (optional) gets how many exports the fake
// host had open when `done` ran.
UpdateResult Update(Engine* engine, WeightUpdate update, FakeIpcHost* host = nullptr,
                    int* open_at_reply = nullptr, std::function<bool()> cancelled = nullptr) {
  std::promise<UpdateResult> promise;
  engine->UpdateWeights(
      std::move(update),
      [&](UpdateResult r) {
        if (open_at_reply != nullptr) *open_at_reply = host->open_now();
        promise.set_value(std::move(r));
      },
      std::move(cancelled));
  return promise.get_future().get();
}

WeightUpdate IpcUpdate(std::string version, UpdatePolicy policy,
                       std::vector<IpcTensorSource> sources) {
  WeightUpdate u;
  u.version = std::move(version);
  u.policy = policy;
  u.ipc_tensors = std::move(sources);
  return u;
}

TEST(EngineIpcTest, AnIpcUpdateServesTheBitsAndDigestOfTheSameBytesStreamed) {
  auto host = std::make_shared<FakeIpcHost>();
  std::unique_ptr<Engine> ipc = MakeEngine(host);
  std::unique_ptr<Engine> streamed = MakeEngine(nullptr);
  const std::vector<HostTensor> tensors = {Scaled(kDown, 3.0f), Scaled(kUp, 0.5f)};
  int open_at_reply = -1;
  UpdateResult r =
      Update(ipc.get(), IpcUpdate("v1", UpdatePolicy::kDrain, ExportTogether(host.get(), tensors)),
             host.get(), &open_at_reply);
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(r.previous_version, "v0");
  EXPECT_EQ(host->opens, 1) << "two tensors of one allocation: its handle is opened once";
  EXPECT_EQ(open_at_reply, 0) << "exports are closed before the caller is answered";

  UpdateResult s = Update(streamed.get(), OwnedWeightUpdate("v1", UpdatePolicy::kDrain, tensors));
  ASSERT_TRUE(s.status.ok()) << s.status;
  EXPECT_EQ(r.digest, s.digest) << "the same bytes give the same digest along either path";
  EXPECT_EQ(ipc->weight_digest(), r.digest);
  EXPECT_EQ(ipc->weight_version(), "v1");
  EXPECT_EQ(Bits(RunOne(ipc.get())), Bits(RunOne(streamed.get())));
}

TEST(EngineIpcTest, ReusingTheServedNameForOtherBytesIsRefusedAndNothingStaysOpen) {
  auto host = std::make_shared<FakeIpcHost>();
  std::unique_ptr<Engine> engine = MakeEngine(host);
  const std::string boot = engine->weight_digest();
  ASSERT_FALSE(boot.empty());
  const std::string before = Bits(RunOne(engine.get()));
  int open_at_reply = -1;
  UpdateResult r = Update(
      engine.get(),
      IpcUpdate("v0", UpdatePolicy::kAbort, ExportTogether(host.get(), {Scaled(kDown, 3.0f)})),
      host.get(), &open_at_reply);
  EXPECT_EQ(r.status.code(), absl::StatusCode::kFailedPrecondition) << r.status;
  EXPECT_EQ(open_at_reply, 0);
  EXPECT_EQ(engine->weight_version(), "v0");
  EXPECT_EQ(engine->weight_digest(), boot);
  EXPECT_EQ(Bits(RunOne(engine.get())), before) << "served bits unchanged";
  // The served bytes under the served name are accepted (the digest does not change).
  UpdateResult same = Update(
      engine.get(),
      IpcUpdate("v0", UpdatePolicy::kDrain, ExportTogether(host.get(), {Scaled(kDown, 1.0f)})));
  EXPECT_TRUE(same.status.ok()) << same.status;
  EXPECT_EQ(same.digest, boot);
}

TEST(EngineIpcTest, ExportsTheRunnerCannotReadFailNamingTheTensorAndChangeNothing) {
  auto host = std::make_shared<FakeIpcHost>();
  std::unique_ptr<Engine> engine = MakeEngine(host);
  const std::string before = Bits(RunOne(engine.get()));
  auto good = [&] { return ExportTogether(host.get(), {Scaled(kUp, 2.0f)}); };
  std::vector<IpcTensorSource> freed = ExportTogether(host.get(), {Scaled(kDown, 2.0f)});
  freed[0].ipc_handle = std::string(kIpcHandleBytes, 'x');  // no such export
  std::vector<IpcTensorSource> outside = ExportTogether(host.get(), {Scaled(kDown, 2.0f)});
  outside[0].offset_bytes += 4096;
  std::vector<IpcTensorSource> other_gpu = ExportTogether(host.get(), {Scaled(kDown, 2.0f)});
  other_gpu[0].device_uuid = kOtherGpu;
  for (const std::vector<IpcTensorSource>& bad : {freed, outside, other_gpu}) {
    // A good tensor before the bad one is not applied either, and its export is closed.
    std::vector<IpcTensorSource> sources = good();
    sources.push_back(bad[0]);
    int open_at_reply = -1;
    UpdateResult r = Update(engine.get(), IpcUpdate("v1", UpdatePolicy::kContinue, sources),
                            host.get(), &open_at_reply);
    EXPECT_EQ(r.status.code(), absl::StatusCode::kInvalidArgument) << r.status;
    EXPECT_NE(r.status.message().find(kDown), std::string::npos) << r.status;
    EXPECT_EQ(open_at_reply, 0) << r.status;
    EXPECT_EQ(engine->weight_version(), "v0");
    EXPECT_EQ(Bits(RunOne(engine.get())), before) << r.status;
  }
}

TEST(EngineIpcTest, MalformedIpcTensorsAreRefusedBeforeTheRunnerIsAsked) {
  auto host = std::make_shared<FakeIpcHost>();
  std::unique_ptr<Engine> engine = MakeEngine(host);
  const IpcTensorSource ok = ExportTogether(host.get(), {Scaled(kDown, 2.0f)})[0];
  std::vector<std::pair<std::string, std::vector<IpcTensorSource>>> cases;
  IpcTensorSource t = ok;
  t.name = "model.layers.0.mlp.nonexistent.weight";
  cases.push_back({"is not a weight of the served model", {t}});
  t = ok;
  t.shape[0] -= 1;
  cases.push_back({"shape", {t}});
  t = ok;
  t.dtype = DType::kF32;
  cases.push_back({"dtype F32 given", {t}});
  t = ok;
  t.ipc_handle.resize(66);
  cases.push_back({"ipc_handle has 66 bytes", {t}});
  t = ok;
  t.device_uuid = "GPU-not-a-uuid";
  cases.push_back({"not a GPU UUID", {t}});
  cases.push_back({"given twice", {ok, ok}});
  for (const auto& [expected, sources] : cases) {
    UpdateResult r = Update(engine.get(), IpcUpdate("v1", UpdatePolicy::kDrain, sources));
    EXPECT_EQ(r.status.code(), absl::StatusCode::kInvalidArgument) << r.status;
    EXPECT_NE(r.status.message().find(expected), std::string::npos) << r.status;
  }
  EXPECT_EQ(host->open_calls, 0) << "the runner is never asked to open a malformed update";
  // (An engine update with no tensors at all is a host update of nothing; the server refuses an
  // IPC request without tensors through CheckIpcTensors.)
  EXPECT_EQ(CheckIpcTensors(engine->weight_specs(), {}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(engine->weight_version(), "v0");
}

TEST(EngineIpcTest, TheCpuBackendRefusesIpcUpdatesWithFailedPrecondition) {
  auto host = std::make_shared<FakeIpcHost>();
  std::unique_ptr<Engine> engine = MakeEngine(nullptr);
  UpdateResult r = Update(
      engine.get(),
      IpcUpdate("v1", UpdatePolicy::kDrain, ExportTogether(host.get(), {Scaled(kDown, 2.0f)})));
  EXPECT_EQ(r.status.code(), absl::StatusCode::kFailedPrecondition) << r.status;
  EXPECT_EQ(r.status.message(),
            "the cpu backend cannot read CUDA IPC handles; use UpdateWeights or "
            "UpdateWeightsFromPath");
  EXPECT_EQ(engine->weight_version(), "v0");
}

TEST(EngineIpcTest, ADrainIpcUpdateHoldsItsExportsWhileItWaitsAndClosesThemBeforeItsReply) {
  auto host = std::make_shared<FakeIpcHost>();
  std::unique_ptr<Engine> engine = MakeEngine(host);
  const std::string old_bits = Bits(RunOne(engine.get(), Spec(60)));
  Collector in_flight(1);
  ASSERT_TRUE(engine->Submit({Spec(60)}, in_flight.Sink()).ok());
  while (in_flight.num_streamed() < 2) std::this_thread::yield();
  std::promise<UpdateResult> promise;
  std::atomic<int> open_at_reply{-1};
  engine->UpdateWeights(
      IpcUpdate("v1", UpdatePolicy::kDrain, ExportTogether(host.get(), {Scaled(kDown, 3.0f)})),
      [&](UpdateResult r) {
        open_at_reply = host->open_now();
        promise.set_value(std::move(r));
      });
  while (host->opens == 0) std::this_thread::yield();
  const SampleCompletion drained = in_flight.Wait()[0];
  EXPECT_EQ(Bits(drained), old_bits) << "in-flight work finishes on the old weights";
  const UpdateResult r = promise.get_future().get();
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_GE(r.ipc_open_seconds, 0.0);
  EXPECT_EQ(open_at_reply.load(), 0);
  EXPECT_EQ(RunOne(engine.get()).weight_version, "v1");
}

TEST(EngineIpcTest, ACancelledDrainIpcUpdateAppliesNothingAndClosesItsExports) {
  auto host = std::make_shared<FakeIpcHost>();
  std::unique_ptr<Engine> engine = MakeEngine(host);
  Collector in_flight(1);
  ASSERT_TRUE(engine->Submit({Spec(400)}, in_flight.Sink()).ok());
  while (in_flight.num_streamed() < 2) std::this_thread::yield();
  std::atomic<bool> cancelled{false};
  std::promise<UpdateResult> promise;
  std::atomic<int> open_at_reply{-1};
  engine->UpdateWeights(
      IpcUpdate("v1", UpdatePolicy::kDrain, ExportTogether(host.get(), {Scaled(kDown, 3.0f)})),
      [&](UpdateResult r) {
        open_at_reply = host->open_now();
        promise.set_value(std::move(r));
      },
      [&cancelled] { return cancelled.load(); });
  while (host->open_now() == 0) std::this_thread::yield();
  cancelled = true;
  const UpdateResult r = promise.get_future().get();
  EXPECT_EQ(r.status.code(), absl::StatusCode::kCancelled) << r.status;
  EXPECT_EQ(open_at_reply.load(), 0);
  EXPECT_EQ(engine->weight_version(), "v0");
  engine->AbortAll();
  EXPECT_EQ(in_flight.Wait()[0].weight_version, "v0");
}

TEST(EngineIpcTest, AnAbortIpcUpdateEndsInFlightSamplesThenSwaps) {
  auto host = std::make_shared<FakeIpcHost>();
  std::unique_ptr<Engine> engine = MakeEngine(host);
  Collector in_flight(1);
  ASSERT_TRUE(engine->Submit({Spec(400)}, in_flight.Sink()).ok());
  while (in_flight.num_streamed() < 2) std::this_thread::yield();
  UpdateResult r = Update(
      engine.get(),
      IpcUpdate("v1", UpdatePolicy::kAbort, ExportTogether(host.get(), {Scaled(kDown, 3.0f)})));
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(r.aborted_samples, 1);
  EXPECT_EQ(in_flight.Wait()[0].finish_reason, FinishReason::kAbort);
  EXPECT_EQ(RunOne(engine.get()).weight_version, "v1");
}

TEST(GpuUuidTest, EitherSpellingBecomesTheCanonicalOneAndAnythingElseIsRefused) {
  EXPECT_EQ(*CanonicalGpuUuid("GPU-0A1B2C3D-0000-4000-8000-00000000ABCD"), kGpu);
  EXPECT_EQ(*CanonicalGpuUuid(kGpu), kGpu);
  for (const char* bad : {"", "GPU-", "0a1b2c3d00004000800000000000abcd",
                          "0a1b2c3d-0000-4000-8000-00000000abcg", "MIG-0a1b2c3d-0000-4000-8000"}) {
    EXPECT_EQ(CanonicalGpuUuid(bad).status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
  const unsigned char bytes[16] = {0x0a, 0x1b, 0x2c, 0x3d, 0, 0, 0x40, 0,
                                   0x80, 0,    0,    0,    0, 0, 0xab, 0xcd};
  EXPECT_EQ(FormatGpuUuid(bytes), kGpu);
}

}  // namespace
}  // namespace rollout
