// IPC weight updates on the GPU (runner/cuda/ipc_weights.cc): another process (the
// rollout-ipc-exporter beside this binary; cudaIpcOpenMemHandle cannot open a handle of its own
// process) exports an allocation holding new tensors; the runner opens, checks, hashes and
// copies them. The served logits and the digests must equal those of the same bytes given as
// host tensors, bitwise; exports that cannot be read are INVALID_ARGUMENT and change nothing.
// Also the two device pieces underneath: the device digest and the dtype conversion kernel.
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "engine/ipc_tensor.h"
#include "gtest/gtest.h"
#include "kernels/cuda/weight_convert.h"
#include "model/random_model.h"
#include "model/weight_digest.h"
#include "runner/cuda/cuda_model_runner.h"
#include "runner/cuda/device_tensor_digest.h"
#include "tests/gpu/forward_script.h"
#include "tests/gpu/gpu_test_util.h"

namespace rollout {
namespace {

using gpu_test::Chunk;
using gpu_test::MakeBatch;
using gpu_test::RandomTokens;
using gpu_test::Seq;

std::string ExporterPath() {
  if (const char* path = std::getenv("ROLLOUT_IPC_EXPORTER"); path != nullptr && *path) return path;
  return (std::filesystem::read_symlink("/proc/self/exe").parent_path() / "rollout-ipc-exporter")
      .string();
}

// A rollout-ipc-exporter child holding `bytes` in one device allocation.
class Exporter {
 public:
  explicit Exporter(const std::vector<uint8_t>& bytes) {
    const std::string exe = ExporterPath();
    if (access(exe.c_str(), X_OK) != 0) {
      ADD_FAILURE() << exe << " is not an executable (set ROLLOUT_IPC_EXPORTER to its path)";
      return;
    }
    int to_child[2] = {-1, -1}, from_child[2];
    if (pipe(to_child) != 0 || pipe(from_child) != 0) {
      ADD_FAILURE() << "pipe: " << std::strerror(errno);
      for (int fd : to_child) {
        if (fd >= 0) close(fd);
      }
      return;
    }
    const std::string file = ::testing::TempDir() + "/ipc_export_" + std::to_string(getpid()) +
                             "_" + std::to_string(counter_++);
    std::ofstream(file, std::ios::binary)
        .write(reinterpret_cast<const char*>(bytes.data()), bytes.size());
    // A child that died (a bad path, a crash) must fail the test, not end the binary: writes to
    // its pipe then return EPIPE instead of raising SIGPIPE.
    signal(SIGPIPE, SIG_IGN);
    pid_ = fork();
    if (pid_ == 0) {  // exec at once: the child touches nothing of this process's CUDA state
      signal(SIGPIPE, SIG_DFL);  // an ignored signal would stay ignored across the exec
      dup2(to_child[0], 0);
      dup2(from_child[1], 1);
      close(to_child[1]);
      close(from_child[0]);
      execl(exe.c_str(), exe.c_str(), file.c_str(), static_cast<char*>(nullptr));
      _exit(127);
    }
    close(to_child[0]);
    close(from_child[1]);
    in_ = fdopen(to_child[1], "w");
    out_ = fdopen(from_child[0], "r");
    const std::string line = ReadLine();
    char hex[129] = {}, uuid[37] = {};
    if (std::sscanf(line.c_str(), "handle %128s uuid %36s", hex, uuid) == 2) {
      handle_ = absl::HexStringToBytes(hex);
      uuid_ = uuid;
    } else {
      ADD_FAILURE() << exe << " (set ROLLOUT_IPC_EXPORTER to its path) said: '" << line << "'";
    }
    std::filesystem::remove(file);
  }
  ~Exporter() {
    if (in_ != nullptr) fclose(in_);  // EOF: the child frees and exits
    if (out_ != nullptr) fclose(out_);
    if (pid_ > 0) waitpid(pid_, nullptr, 0);
  }
  Exporter(const Exporter&) = delete;
  Exporter& operator=(const Exporter&) = delete;

  const std::string& handle() const { return handle_; }
  const std::string& uuid() const { return uuid_; }
  // Frees the exported allocation (the handle then names nothing).
  void Free() {
    if (in_ == nullptr || handle_.empty()) {
      ADD_FAILURE() << "the exporter holds no allocation to free";
      return;
    }
    std::fputs("free\n", in_);
    std::fflush(in_);
    EXPECT_EQ(ReadLine(), "freed");
  }

 private:
  std::string ReadLine() {
    char buf[512] = {};
    if (out_ == nullptr || std::fgets(buf, sizeof(buf), out_) == nullptr) return "";
    std::string line(buf);
    if (!line.empty() && line.back() == '\n') line.pop_back();
    return line;
  }
  static inline int counter_ = 0;
  pid_t pid_ = -1;
  FILE* in_ = nullptr;
  FILE* out_ = nullptr;
  std::string handle_, uuid_;
};

class IpcTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!gpu_test::HaveGpu()) GTEST_SKIP() << "no CUDA device";
  }
  static CudaRunnerOptions Options(bool canonical = false) {
    CudaRunnerOptions o;
    o.kv_cache_bytes = 128ll << 20;
    o.max_batch_tokens = 1024;
    o.canonical_k_tree = canonical;
    return o;
  }
  static std::string WriteModel(const std::string& name, uint64_t seed, DType dtype) {
    const std::string dir =
        ::testing::TempDir() + "/rollout_gpu_ipc_" + name + "_" + std::to_string(getpid());
    std::filesystem::remove_all(dir);
    RandomModelOptions write;
    write.preset = "small";
    write.seed = seed;
    write.dtype = dtype;
    EXPECT_TRUE(WriteRandomModel(write, dir).ok());
    return dir;
  }
  static std::vector<HostTensor> ReadTensors(const std::string& dir,
                                             const std::vector<std::string>& names) {
    auto ck = Checkpoint::Open(dir);
    EXPECT_TRUE(ck.ok()) << ck.status();
    std::vector<HostTensor> out;
    for (const std::string& name : names) {
      const TensorView* v = (*ck)->Find(name);
      out.push_back({name, v->dtype, v->shape, std::vector<uint8_t>(v->data, v->data + v->nbytes)});
    }
    return out;
  }
  // The tensors packed into one allocation at odd, 256-aligned offsets after `lead` bytes (as a
  // caching allocator's segment holds them); `sources` gets their IPC descriptions (no handle).
  static std::vector<uint8_t> Pack(const std::vector<HostTensor>& tensors,
                                   std::vector<IpcTensorSource>* sources, size_t lead = 768) {
    std::vector<uint8_t> allocation(lead, 0x5A);
    for (const HostTensor& t : tensors) {
      IpcTensorSource s;
      s.name = t.name;
      s.dtype = t.dtype;
      s.shape = t.shape;
      s.offset_bytes = allocation.size();
      allocation.insert(allocation.end(), t.bytes.begin(), t.bytes.end());
      allocation.resize((allocation.size() + 256 + 255) / 256 * 256, 0x5A);
      sources->push_back(std::move(s));
    }
    return allocation;
  }
  static void SetHandle(const Exporter& e, std::vector<IpcTensorSource>* sources) {
    for (IpcTensorSource& s : *sources) {
      s.ipc_handle = e.handle();
      s.device_uuid = e.uuid();
    }
  }
  // The logits of a fixed batch (two sequences, every row), for bitwise comparison.
  static std::vector<float> Logits(CudaModelRunner* runner) {
    std::vector<Seq> seqs(2);
    seqs[0].tokens = RandomTokens(70, 4096, 3);
    seqs[1].tokens = RandomTokens(33, 4096, 4);
    int32_t next = 0;
    for (Seq& s : seqs) {
      for (size_t i = 0; i < (s.tokens.size() + 31) / 32; ++i) s.blocks.push_back(next++);
    }
    std::vector<float> logits;
    const absl::Status st =
        runner->ForwardToHost(MakeBatch(seqs, {{0, 0, 70, true}, {1, 0, 33, true}}), &logits);
    EXPECT_TRUE(st.ok()) << st;
    return logits;
  }
  static bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
  }
};

TEST_F(IpcTest, TheDeviceDigestEqualsTheHostDigestAtOddSizes) {
  const std::vector<size_t> sizes = {0,     1,     65535,           65536,
                                     65537, 99999, (64u << 20) + 3, (150u << 20) + 1};
  std::vector<std::vector<uint8_t>> host;
  std::vector<cuda::DeviceBuffer> device(sizes.size());
  std::vector<DeviceBytes> bytes;
  std::mt19937_64 rng(7);
  for (size_t i = 0; i < sizes.size(); ++i) {
    host.emplace_back(sizes[i]);
    for (uint8_t& b : host.back()) b = static_cast<uint8_t>(rng());
    ASSERT_CUDA_OK(device[i].Allocate(std::max<size_t>(1, sizes[i])));
    ASSERT_CUDA_OK(cudaMemcpy(device[i].get(), host[i].data(), sizes[i], cudaMemcpyHostToDevice));
    bytes.push_back({device[i].get(), sizes[i]});
  }
  absl::StatusOr<std::vector<std::string>> digests = DigestDeviceTensors(bytes, nullptr);
  ASSERT_TRUE(digests.ok()) << digests.status();
  for (size_t i = 0; i < sizes.size(); ++i) {
    EXPECT_EQ((*digests)[i], TensorDigest(host[i].data(), host[i].size())) << sizes[i] << " bytes";
  }
}

TEST_F(IpcTest, WeightConversionOnTheDeviceEqualsTheHostsBitwise) {
  // Rows of 99 columns in wider rows (pitches 101 and 103), with every awkward value.
  const int64_t rows = 7, cols = 99, src_pitch = 101, dst_pitch = 103;
  std::vector<float> f32(rows * src_pitch);
  std::mt19937_64 rng(11);
  for (float& x : f32) {
    uint32_t bits = static_cast<uint32_t>(rng());
    std::memcpy(&x, &bits, 4);
  }
  const float specials[] = {0.0f,
                            -0.0f,
                            std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity(),
                            std::numeric_limits<float>::quiet_NaN(),
                            1e-40f,
                            -3.4e38f,
                            1.00390625f /* a bf16 tie */,
                            1.01171875f};
  for (size_t i = 0; i < std::size(specials); ++i) f32[i * 3] = specials[i];
  std::vector<uint16_t> f16(rows * src_pitch), bf16(rows * src_pitch);
  for (size_t i = 0; i < f16.size(); ++i) {
    f16[i] = static_cast<uint16_t>(rng());  // every bit pattern: subnormals, inf, NaN
    bf16[i] = static_cast<uint16_t>(rng());
  }
  struct Case {
    const void* host;
    size_t elem;
    cuda::WeightSourceType type;
    bool dst_f32;
  };
  const Case cases[] = {{f32.data(), 4, cuda::WeightSourceType::kF32, false},
                        {f16.data(), 2, cuda::WeightSourceType::kF16, false},
                        {f16.data(), 2, cuda::WeightSourceType::kF16, true},
                        {bf16.data(), 2, cuda::WeightSourceType::kBF16, true}};
  for (const Case& c : cases) {
    cuda::DeviceBuffer src, dst;
    ASSERT_CUDA_OK(src.Allocate(rows * src_pitch * c.elem));
    ASSERT_CUDA_OK(dst.Allocate(rows * dst_pitch * 4));
    ASSERT_CUDA_OK(cudaMemset(dst.get(), 0, rows * dst_pitch * 4));
    ASSERT_CUDA_OK(
        cudaMemcpy(src.get(), c.host, rows * src_pitch * c.elem, cudaMemcpyHostToDevice));
    ASSERT_CUDA_OK(cuda::ConvertWeightRows(src.get(), c.type, src_pitch, dst.get(), c.dst_f32,
                                           dst_pitch, rows, cols, nullptr));
    std::vector<uint8_t> got(rows * dst_pitch * 4);
    ASSERT_CUDA_OK(cudaMemcpy(got.data(), dst.get(), got.size(), cudaMemcpyDeviceToHost));
    int mismatches = 0;
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t k = 0; k < cols; ++k) {
        const int64_t i = r * src_pitch + k, o = r * dst_pitch + k;
        float v;
        switch (c.type) {
          case cuda::WeightSourceType::kF32:
            v = f32[i];
            break;
          case cuda::WeightSourceType::kF16:
            v = F16ToF32(f16[i]);
            break;
          default:
            v = BF16ToF32(bf16[i]);
        }
        bool same;
        if (c.dst_f32) {
          same = std::memcmp(&got[4 * o], &v, 4) == 0;
        } else {
          const uint16_t want = F32ToBF16(v);
          same = std::memcmp(&got[2 * o], &want, 2) == 0;
        }
        if (!same && ++mismatches <= 5) {
          ADD_FAILURE() << "type " << static_cast<int>(c.type) << " -> "
                        << (c.dst_f32 ? "f32" : "bf16") << ": element (" << r << ", " << k
                        << ") differs from the host's conversion";
        }
      }
    }
    EXPECT_EQ(mismatches, 0);
  }
}

// One allocation of another process holding a matrix, a norm and a row-parallel matrix (whose
// pieces are K segments with the canonical tree): the IPC update serves the logits of the same
// bytes sent from the host, bitwise, and hashes them as the host does.
TEST_F(IpcTest, AnIpcUpdateServesTheBitsAndDigestsOfTheSameBytesFromTheHost) {
  const std::string dir = WriteModel("bf16", 6, DType::kBF16);
  const std::vector<HostTensor> tensors = ReadTensors(
      dir, {"model.layers.1.mlp.up_proj.weight", "model.layers.2.input_layernorm.weight",
            "model.layers.0.self_attn.o_proj.weight", "model.norm.weight"});
  for (bool canonical : {false, true}) {
    auto ipc = CudaModelRunner::CreateSynthetic(*PresetConfig("small"), 5, Options(canonical));
    auto host = CudaModelRunner::CreateSynthetic(*PresetConfig("small"), 5, Options(canonical));
    ASSERT_TRUE(ipc.ok() && host.ok());
    const std::vector<float> before = Logits(ipc->get());
    std::vector<IpcTensorSource> sources;
    Exporter exporter(Pack(tensors, &sources));
    SetHandle(exporter, &sources);
    ASSERT_TRUE(CheckIpcTensors((*ipc)->weight_specs(), sources).ok());
    absl::StatusOr<std::unique_ptr<OpenedIpcTensors>> opened = (*ipc)->OpenIpcTensors(sources);
    ASSERT_TRUE(opened.ok()) << opened.status();
    for (const HostTensor& t : tensors) {
      EXPECT_EQ((*opened)->digests().at(t.name), TensorDigest(t.bytes.data(), t.bytes.size()))
          << t.name;
    }
    ASSERT_TRUE((*ipc)->UpdateWeightsFromIpc(**opened).ok());
    opened->reset();  // closed before the exporter goes
    ASSERT_TRUE((*host)->UpdateWeights(ViewsOf(tensors)).ok());
    const std::vector<float> after = Logits(ipc->get());
    EXPECT_FALSE(SameBits(after, before)) << "the update changed nothing";
    EXPECT_TRUE(SameBits(after, Logits(host->get()))) << "canonical K tree: " << canonical;
  }
  std::filesystem::remove_all(dir);
}

// A checkpoint in F32: the device's bf16 matrices are rounded from IPC bytes on the GPU as the
// host rounds streamed ones.
TEST_F(IpcTest, F32TensorsAreConvertedOnTheDeviceAsTheHostConvertsThem) {
  const std::string boot = WriteModel("f32_boot", 5, DType::kF32);
  const std::string next = WriteModel("f32_next", 8, DType::kF32);
  const std::vector<HostTensor> tensors = ReadTensors(
      next,
      {"model.layers.3.mlp.down_proj.weight", "model.layers.0.post_attention_layernorm.weight"});
  auto ck = Checkpoint::Open(boot);
  ASSERT_TRUE(ck.ok());
  auto ipc = CudaModelRunner::Create(**ck, Options());
  auto host = CudaModelRunner::Create(**ck, Options());
  ASSERT_TRUE(ipc.ok() && host.ok());
  std::vector<IpcTensorSource> sources;
  Exporter exporter(Pack(tensors, &sources));
  SetHandle(exporter, &sources);
  auto opened = (*ipc)->OpenIpcTensors(sources);
  ASSERT_TRUE(opened.ok()) << opened.status();
  ASSERT_TRUE((*ipc)->UpdateWeightsFromIpc(**opened).ok());
  opened->reset();
  ASSERT_TRUE((*host)->UpdateWeights(ViewsOf(tensors)).ok());
  EXPECT_TRUE(SameBits(Logits(ipc->get()), Logits(host->get())));
  std::filesystem::remove_all(boot);
  std::filesystem::remove_all(next);
}

TEST_F(IpcTest, ExportsThatCannotBeReadAreInvalidArgumentNamingTheTensorAndChangeNothing) {
  const std::string dir = WriteModel("bad", 6, DType::kBF16);
  const std::vector<HostTensor> tensors = ReadTensors(dir, {"model.layers.1.mlp.up_proj.weight"});
  const std::string name = tensors[0].name;
  auto runner = CudaModelRunner::CreateSynthetic(*PresetConfig("small"), 5, Options());
  ASSERT_TRUE(runner.ok());
  const std::vector<float> before = Logits(runner->get());
  std::vector<IpcTensorSource> good;
  Exporter exporter(Pack(tensors, &good));
  SetHandle(exporter, &good);

  struct Case {
    std::string what;
    std::vector<IpcTensorSource> sources;
    std::string expected;
  };
  std::vector<Case> cases;
  std::vector<IpcTensorSource> s = good;
  s[0].device_uuid = "00000000-0000-0000-0000-000000000000";
  cases.push_back({"another GPU", s, "is on GPU 00000000-0000-0000-0000-000000000000"});
  s = good;
  s[0].offset_bytes = uint64_t{1} << 32;  // past the allocation's end, whatever its rounding
  cases.push_back({"outside", s, "lie outside its exported allocation"});
  s = good;
  s[0].ipc_handle = std::string(kIpcHandleBytes, '\x11');
  cases.push_back({"garbage", s, "its ipc_handle does not open"});
  // A handle of this very process.
  cuda::DeviceBuffer mine;
  ASSERT_CUDA_OK(mine.Allocate(tensors[0].bytes.size()));
  cudaIpcMemHandle_t own;
  ASSERT_CUDA_OK(cudaIpcGetMemHandle(&own, mine.get()));
  s = good;
  s[0].ipc_handle.assign(reinterpret_cast<const char*>(&own), sizeof(own));
  s[0].offset_bytes = 0;
  cases.push_back({"own process", s, "its ipc_handle does not open"});
  for (const Case& c : cases) {
    absl::StatusOr<std::unique_ptr<OpenedIpcTensors>> opened = (*runner)->OpenIpcTensors(c.sources);
    EXPECT_EQ(opened.status().code(), absl::StatusCode::kInvalidArgument) << c.what;
    EXPECT_NE(opened.status().message().find(absl::StrCat("tensor '", name, "'")),
              std::string::npos)
        << c.what << ": " << opened.status();
    EXPECT_NE(opened.status().message().find(c.expected), std::string::npos)
        << c.what << ": " << opened.status();
  }
  // A freed export: the trainer let go of the tensor before the server opened it.
  exporter.Free();
  auto freed = (*runner)->OpenIpcTensors(good);
  EXPECT_EQ(freed.status().code(), absl::StatusCode::kInvalidArgument)
      << "a freed export opened: " << freed.status();
  EXPECT_TRUE(SameBits(Logits(runner->get()), before)) << "the runner serves on, unchanged";
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace rollout
