#include "model/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace rollout {
namespace {

using ::testing::HasSubstr;
using json = nlohmann::json;
namespace fs = std::filesystem;

// A fresh, empty directory per test.
std::string TestDir() {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  const std::string dir = absl::StrCat(::testing::TempDir(), "/rollout_", info->test_suite_name(),
                                       "_", info->name(), "_", ::getpid());
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

void WriteText(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary) << text;
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// A safetensors file with a hand-written header, for the corruption cases.
void WriteRaw(const std::string& path, const std::string& header, const std::string& data) {
  std::string bytes(8, '\0');
  const uint64_t n = header.size();
  std::memcpy(bytes.data(), &n, 8);
  WriteText(path, bytes + header + data);
}

HostTensor F32Tensor(const std::string& name, std::vector<int64_t> shape,
                     const std::vector<float>& values) {
  HostTensor t{name, DType::kF32, std::move(shape), {}};
  t.bytes.resize(values.size() * 4);
  std::memcpy(t.bytes.data(), values.data(), t.bytes.size());
  return t;
}

HostTensor HalfTensor(const std::string& name, DType dtype, std::vector<int64_t> shape,
                      const std::vector<uint16_t>& bits) {
  HostTensor t{name, dtype, std::move(shape), {}};
  t.bytes.resize(bits.size() * 2);
  std::memcpy(t.bytes.data(), bits.data(), t.bytes.size());
  return t;
}

// Three tensors of the three dtypes whose fp32 values are known exactly.
std::vector<HostTensor> SampleTensors() {
  return {
      F32Tensor("a.f32", {2, 3}, {1.0f, -2.5f, 0.0f, 3.25f, 1e-20f, -0.0f}),
      // bf16 0x3f80 = 1, 0xc040 = -3, 0x3e00 = 0.125, 0x7f80 = inf
      HalfTensor("b.bf16", DType::kBF16, {4}, {0x3f80, 0xc040, 0x3e00, 0x7f80}),
      // f16 0x3c00 = 1, 0xc500 = -5, 0x0001 = 2^-24 (smallest subnormal)
      HalfTensor("c.f16", DType::kF16, {3, 1}, {0x3c00, 0xc500, 0x0001}),
  };
}

void ExpectSampleValues(const Checkpoint& checkpoint) {
  EXPECT_EQ(*checkpoint.ReadF32("a.f32", {2, 3}),
            std::vector<float>({1.0f, -2.5f, 0.0f, 3.25f, 1e-20f, -0.0f}));
  EXPECT_EQ(*checkpoint.ReadF32("b.bf16", {4}),
            std::vector<float>({1.0f, -3.0f, 0.125f, std::numeric_limits<float>::infinity()}));
  EXPECT_EQ(*checkpoint.ReadF32("c.f16", {3, 1}),
            std::vector<float>({1.0f, -5.0f, std::ldexp(1.0f, -24)}));
}

std::string SingleFileCheckpoint(const std::string& dir) {
  WriteText(dir + "/config.json", "{}");
  EXPECT_TRUE(WriteSafetensors(dir + "/model.safetensors", SampleTensors()).ok());
  return dir + "/model.safetensors";
}

// Opens `dir` and returns the error; fails the test if it opened.
absl::Status OpenError(const std::string& dir) {
  absl::StatusOr<std::unique_ptr<Checkpoint>> checkpoint = Checkpoint::Open(dir);
  EXPECT_FALSE(checkpoint.ok());
  return checkpoint.status();
}

TEST(SafetensorsTest, WrittenFileOpensWithExactValuesOfEveryDtype) {
  const std::string dir = TestDir();
  WriteText(dir + "/config.json", R"({"hidden_size": 8})");
  ASSERT_TRUE(WriteSafetensors(dir + "/model.safetensors", SampleTensors()).ok());
  absl::StatusOr<std::unique_ptr<Checkpoint>> checkpoint = Checkpoint::Open(dir);
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status();
  EXPECT_EQ((*checkpoint)->config_json(), R"({"hidden_size": 8})");
  EXPECT_EQ((*checkpoint)->TensorNames(), std::vector<std::string>({"a.f32", "b.bf16", "c.f16"}));
  const TensorView* view = (*checkpoint)->Find("b.bf16");
  ASSERT_NE(view, nullptr);
  EXPECT_EQ(view->dtype, DType::kBF16);
  EXPECT_EQ(view->nbytes, 8u);
  EXPECT_EQ((*checkpoint)->Find("nope"), nullptr);
  ExpectSampleValues(**checkpoint);
}

TEST(SafetensorsTest, HeaderIsSortedPaddedAndDataIsAlignedInNameOrder) {
  const std::string dir = TestDir();
  std::vector<HostTensor> tensors = SampleTensors();
  std::swap(tensors[0], tensors[2]);  // the writer must sort, not trust the input order
  ASSERT_TRUE(WriteSafetensors(dir + "/m.safetensors", tensors).ok());
  const std::string bytes = ReadAll(dir + "/m.safetensors");
  uint64_t n;
  std::memcpy(&n, bytes.data(), 8);
  EXPECT_EQ((8 + n) % 8, 0u);
  const std::string header = bytes.substr(8, n);
  EXPECT_LT(header.find("\"a.f32\""), header.find("\"b.bf16\""));
  EXPECT_LT(header.find("\"b.bf16\""), header.find("\"c.f16\""));
  json j = json::parse(header);
  EXPECT_EQ(j["a.f32"]["data_offsets"], json({0, 24}));
  EXPECT_EQ(j["b.bf16"]["data_offsets"], json({24, 32}));
  EXPECT_EQ(j["c.f16"]["data_offsets"], json({32, 38}));
  EXPECT_EQ(j["c.f16"]["shape"], json({3, 1}));
  EXPECT_EQ(j["c.f16"]["dtype"], "F16");
  EXPECT_EQ(bytes.size(), 8 + n + 38);
}

TEST(SafetensorsTest, ShardedCheckpointReadsTheSameTensorsAsSingleFile) {
  const std::string dir = TestDir();
  std::vector<HostTensor> tensors = SampleTensors();
  ASSERT_TRUE(WriteSafetensors(dir + "/s1.safetensors", {tensors[0], tensors[2]}).ok());
  ASSERT_TRUE(WriteSafetensors(dir + "/s2.safetensors", {tensors[1]}).ok());
  WriteText(dir + "/config.json", "{}");
  WriteText(dir + "/model.safetensors.index.json",
            R"({"metadata": {"total_size": 62}, "weight_map": {"a.f32": "s1.safetensors",
                "c.f16": "s1.safetensors", "b.bf16": "s2.safetensors"}})");
  absl::StatusOr<std::unique_ptr<Checkpoint>> checkpoint = Checkpoint::Open(dir);
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status();
  EXPECT_EQ((*checkpoint)->TensorNames(), std::vector<std::string>({"a.f32", "b.bf16", "c.f16"}));
  ExpectSampleValues(**checkpoint);
}

// transformers 5's fused experts of one layer: E = 2, I = 2, H = 3; element value = its index
// in the fused tensor (gate_up [2, 4, 3]: 0..23; down [2, 3, 2]: 100..111).
TEST(SafetensorsTest, FusedExpertsOfTransformers5ReadAsThePerExpertTensors) {
  const std::string dir = TestDir();
  std::vector<float> gate_up(24), down(12);
  for (int i = 0; i < 24; ++i) gate_up[i] = static_cast<float>(i);
  for (int i = 0; i < 12; ++i) down[i] = 100.0f + static_cast<float>(i);
  WriteText(dir + "/config.json", "{}");
  ASSERT_TRUE(WriteSafetensors(dir + "/model.safetensors",
                               {F32Tensor("model.layers.1.mlp.experts.gate_up_proj", {2, 4, 3},
                                          gate_up),
                                F32Tensor("model.layers.1.mlp.experts.down_proj", {2, 3, 2}, down),
                                F32Tensor("model.layers.1.mlp.gate.weight", {2, 3}, {0, 1, 2, 3,
                                                                                      4, 5})})
                  .ok());
  absl::StatusOr<std::unique_ptr<Checkpoint>> checkpoint = Checkpoint::Open(dir);
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status();
  const std::string p = "model.layers.1.mlp.";
  EXPECT_EQ((*checkpoint)->TensorNames(),
            std::vector<std::string>({p + "experts.0.down_proj.weight",
                                      p + "experts.0.gate_proj.weight",
                                      p + "experts.0.up_proj.weight",
                                      p + "experts.1.down_proj.weight",
                                      p + "experts.1.gate_proj.weight",
                                      p + "experts.1.up_proj.weight", p + "gate.weight"}));
  auto read = [&](const std::string& name, std::vector<int64_t> shape) {
    absl::StatusOr<std::vector<float>> v = (*checkpoint)->ReadF32(p + name, shape);
    EXPECT_TRUE(v.ok()) << v.status();
    return v.ok() ? *v : std::vector<float>();
  };
  // Expert e's gate is rows [e * 4, e * 4 + 2) of the fused [8, 3], its up the next two.
  EXPECT_EQ(read("experts.0.gate_proj.weight", {2, 3}), std::vector<float>({0, 1, 2, 3, 4, 5}));
  EXPECT_EQ(read("experts.0.up_proj.weight", {2, 3}), std::vector<float>({6, 7, 8, 9, 10, 11}));
  EXPECT_EQ(read("experts.1.gate_proj.weight", {2, 3}),
            std::vector<float>({12, 13, 14, 15, 16, 17}));
  EXPECT_EQ(read("experts.1.up_proj.weight", {2, 3}),
            std::vector<float>({18, 19, 20, 21, 22, 23}));
  EXPECT_EQ(read("experts.0.down_proj.weight", {3, 2}),
            std::vector<float>({100, 101, 102, 103, 104, 105}));
  EXPECT_EQ(read("experts.1.down_proj.weight", {3, 2}),
            std::vector<float>({106, 107, 108, 109, 110, 111}));
  // The mapped view points at the same bytes.
  const TensorView* view = (*checkpoint)->Find(p + "experts.1.up_proj.weight");
  ASSERT_NE(view, nullptr);
  float first;
  std::memcpy(&first, view->data, 4);
  EXPECT_EQ(first, 18.0f);
  EXPECT_EQ(view->nbytes, 24u);
}

TEST(SafetensorsTest, MalformedOrDuplicatedFusedExpertsAreInvalidArgument) {
  {
    const std::string dir = TestDir();
    WriteText(dir + "/config.json", "{}");
    ASSERT_TRUE(WriteSafetensors(dir + "/model.safetensors",
                                 {F32Tensor("m.mlp.experts.gate_up_proj", {3, 3},
                                            std::vector<float>(9))})
                    .ok());
    absl::Status s = OpenError(dir);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(s.message(), HasSubstr("fused expert tensor 'm.mlp.experts.gate_up_proj' has "
                                       "shape [3, 3], expected [experts, 2 * "
                                       "moe_intermediate_size, hidden]"));
  }
  {
    const std::string dir = TestDir() + "_odd";
    fs::create_directories(dir);
    WriteText(dir + "/config.json", "{}");
    ASSERT_TRUE(WriteSafetensors(dir + "/model.safetensors",
                                 {F32Tensor("m.mlp.experts.gate_up_proj", {1, 3, 1},
                                            std::vector<float>(3))})
                    .ok());
    EXPECT_THAT(OpenError(dir).message(), HasSubstr("has shape [1, 3, 1]"));
  }
  {
    const std::string dir = TestDir() + "_dup";
    fs::create_directories(dir);
    WriteText(dir + "/config.json", "{}");
    ASSERT_TRUE(WriteSafetensors(dir + "/model.safetensors",
                                 {F32Tensor("m.mlp.experts.down_proj", {1, 1, 1}, {1.0f}),
                                  F32Tensor("m.mlp.experts.0.down_proj.weight", {1, 1}, {1.0f})})
                    .ok());
    absl::Status s = OpenError(dir);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(s.message(), HasSubstr("tensor 'm.mlp.experts.0.down_proj.weight' is given twice"));
  }
}

TEST(SafetensorsTest, ReadF32ReportsWrongShapeAndMissingTensorByName) {
  const std::string dir = TestDir();
  SingleFileCheckpoint(dir);
  std::unique_ptr<Checkpoint> checkpoint = *Checkpoint::Open(dir);
  absl::Status shape = checkpoint->ReadF32("a.f32", {3, 2}).status();
  EXPECT_EQ(shape.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(shape.message(),
              HasSubstr("tensor a.f32: expected shape [3, 2], checkpoint has [2, 3]"));
  absl::Status missing = checkpoint->ReadF32("lm_head.weight", {2}).status();
  EXPECT_EQ(missing.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(missing.message(), HasSubstr("lm_head.weight"));
}

TEST(SafetensorsTest, MissingConfigJsonIsNotFoundNamingThePath) {
  const std::string dir = TestDir();
  ASSERT_TRUE(WriteSafetensors(dir + "/model.safetensors", SampleTensors()).ok());
  absl::Status s = OpenError(dir);
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(s.message(), HasSubstr(dir + "/config.json"));
}

TEST(SafetensorsTest, APathThatIsAFileIsInvalidArgumentAskingForTheDirectory) {
  const std::string dir = TestDir();
  const std::string file = SingleFileCheckpoint(dir);
  for (const std::string& path : {file, dir + "/config.json"}) {
    absl::Status s = OpenError(path);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(s.message(), HasSubstr(path + " is a file"));
    EXPECT_THAT(s.message(), HasSubstr("expected a checkpoint directory containing config.json"));
  }
  // A path that runs through a file (ENOTDIR) does not lead to a checkpoint: NOT_FOUND.
  absl::Status through = OpenError(file + "/sub");
  EXPECT_EQ(through.code(), absl::StatusCode::kNotFound) << through;
  EXPECT_THAT(through.message(), HasSubstr(file + "/sub"));
}

TEST(SafetensorsTest, MissingWeightsIsNotFoundListingBothLayouts) {
  const std::string dir = TestDir();
  WriteText(dir + "/config.json", "{}");
  absl::Status s = OpenError(dir);
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(s.message(), HasSubstr("model.safetensors.index.json"));
  EXPECT_THAT(s.message(), HasSubstr(dir + "/model.safetensors "));
}

TEST(SafetensorsTest, TruncatedFilesAreInvalidArgumentNamingFileAndTensor) {
  const std::string dir = TestDir();
  const std::string path = SingleFileCheckpoint(dir);
  const std::string bytes = ReadAll(path);

  WriteText(path, bytes.substr(0, 5));
  absl::Status tiny = OpenError(dir);
  EXPECT_EQ(tiny.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(tiny.message(), HasSubstr(path));

  WriteText(path, bytes.substr(0, 40));  // cut inside the header
  absl::Status header = OpenError(dir);
  EXPECT_EQ(header.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(header.message(), HasSubstr(path));
  EXPECT_THAT(header.message(), HasSubstr("header length"));

  WriteText(path, bytes.substr(0, bytes.size() - 1));  // cut the last data byte of c.f16
  absl::Status data = OpenError(dir);
  EXPECT_EQ(data.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(data.message(), HasSubstr(path));
  EXPECT_THAT(data.message(), HasSubstr("'c.f16'"));
}

// A file truncated after Open (a trainer rewriting the checkpoint being loaded) is an error
// for that read, not a SIGBUS: tensor bytes are read from the file, never through the mapping.
TEST(SafetensorsTest, AFileTruncatedAfterOpenIsAbortedForThatReadNotACrash) {
  const std::string dir = TestDir();
  const std::string path = SingleFileCheckpoint(dir);
  std::unique_ptr<Checkpoint> checkpoint = *Checkpoint::Open(dir);
  fs::resize_file(path, 0);  // every page of the mapping now lies past the end of the file
  absl::StatusOr<std::vector<float>> values = checkpoint->ReadF32("a.f32", {2, 3});
  EXPECT_EQ(values.status().code(), absl::StatusCode::kAborted) << values.status();
  EXPECT_THAT(values.status().message(), HasSubstr(path));
  EXPECT_THAT(values.status().message(), HasSubstr("truncated or rewritten while it was read"));
  std::vector<uint8_t> bytes(checkpoint->Find("b.bf16")->nbytes);
  EXPECT_EQ(checkpoint->Read("b.bf16", bytes.data()).code(), absl::StatusCode::kAborted);
  EXPECT_EQ(checkpoint->CheckUnchanged().code(), absl::StatusCode::kAborted);
}

// Rewritten in place at the same size: reads succeed but may mix two versions, which
// CheckUnchanged reports (the file's modification time moved).
TEST(SafetensorsTest, AFileRewrittenAfterOpenIsReportedByCheckUnchanged) {
  const std::string dir = TestDir();
  const std::string path = SingleFileCheckpoint(dir);
  std::unique_ptr<Checkpoint> checkpoint = *Checkpoint::Open(dir);
  EXPECT_TRUE(checkpoint->CheckUnchanged().ok());
  {
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-1, std::ios::end);
    f.put('\x7f');
  }
  fs::last_write_time(path, fs::last_write_time(path) + std::chrono::seconds(1));
  absl::Status s = checkpoint->CheckUnchanged();
  EXPECT_EQ(s.code(), absl::StatusCode::kAborted) << s;
  EXPECT_THAT(s.message(), HasSubstr(path + " changed while it was read"));
}

TEST(SafetensorsTest, AReadStopsOnceItsCallerCancelled) {
  const std::string dir = TestDir();
  SingleFileCheckpoint(dir);
  std::unique_ptr<Checkpoint> checkpoint = *Checkpoint::Open(dir);
  std::vector<uint8_t> bytes(checkpoint->Find("a.f32")->nbytes);
  EXPECT_EQ(checkpoint->Read("a.f32", bytes.data(), [] { return true; }).code(),
            absl::StatusCode::kCancelled);
  EXPECT_TRUE(checkpoint->Read("a.f32", bytes.data(), [] { return false; }).ok());
  EXPECT_EQ(checkpoint->Read("nope", bytes.data()).code(), absl::StatusCode::kNotFound);
}

// What a caller got wrong in a path is INVALID_ARGUMENT naming it, never INTERNAL: an empty
// path (it once read /config.json), a directory or a symlink loop where a file belongs (the
// weights' file too).
TEST(SafetensorsTest, EmptyPathsDirectoriesAndSymlinkLoopsAreInvalidArgument) {
  EXPECT_EQ(OpenError("").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(OpenError("").message(), HasSubstr("the checkpoint path is empty"));
  struct Case {
    std::string name;
    std::function<void(const std::string& dir)> make;
    std::string file, expect;
  };
  const std::vector<Case> cases = {
      {"config.json a directory",
       [](const std::string& d) { fs::create_directory(d + "/config.json"); }, "config.json",
       "is a directory, not a file"},
      {"model.safetensors a directory",
       [](const std::string& d) {
         WriteText(d + "/config.json", "{}");
         fs::create_directory(d + "/model.safetensors");
       },
       "model.safetensors", "is a directory, not a file"},
      {"config.json a symlink loop",
       [](const std::string& d) {
         fs::create_symlink(d + "/loop-b", d + "/loop-a");
         fs::create_symlink(d + "/loop-a", d + "/loop-b");
         fs::create_symlink(d + "/loop-a", d + "/config.json");
       },
       "config.json", "symbolic links"},
      // It said NOT_FOUND "no weights in DIR: looked for ..." (review26 finding 7).
      {"model.safetensors a symlink loop",
       [](const std::string& d) {
         WriteText(d + "/config.json", "{}");
         fs::create_symlink(d + "/loop-b", d + "/loop-a");
         fs::create_symlink(d + "/loop-a", d + "/loop-b");
         fs::create_symlink(d + "/loop-a", d + "/model.safetensors");
       },
       "model.safetensors", "symbolic links"},
  };
  for (const Case& c : cases) {
    const std::string dir = TestDir() + "/" + std::to_string(&c - cases.data());
    fs::create_directories(dir);
    c.make(dir);
    absl::Status s = OpenError(dir);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.name << ": " << s;
    EXPECT_THAT(s.message(), HasSubstr(dir + "/" + c.file)) << c.name;
    EXPECT_THAT(s.message(), HasSubstr(c.expect)) << c.name;
  }
}

// Opening a FIFO for reading waits for a writer; reading /dev/zero never ends. Both are refused
// at once, as are JSON files beyond 64 MiB, before a byte is read into memory.
TEST(SafetensorsTest, NonRegularFilesAndHugeJsonFilesAreRefusedAtOnce) {
  const std::string fifo_dir = TestDir() + "/fifo";
  fs::create_directories(fifo_dir);
  ASSERT_EQ(::mkfifo((fifo_dir + "/config.json").c_str(), 0600), 0);
  auto opened = std::async(std::launch::async, [&] { return OpenError(fifo_dir); });
  if (opened.wait_for(std::chrono::seconds(10)) != std::future_status::ready) {
    ADD_FAILURE() << "opening a checkpoint whose config.json is a FIFO waits for a writer";
    const int fd = ::open((fifo_dir + "/config.json").c_str(), O_WRONLY | O_NONBLOCK);
    if (fd >= 0) ::close(fd);  // lets the blocked open go on (and see EOF)
  }
  absl::Status fifo = opened.get();
  EXPECT_EQ(fifo.code(), absl::StatusCode::kInvalidArgument) << fifo;
  EXPECT_THAT(fifo.message(), HasSubstr("is not a regular file"));

  const std::string shard_dir = TestDir() + "/shard";
  fs::create_directories(shard_dir);
  WriteText(shard_dir + "/config.json", "{}");
  fs::create_symlink("/dev/zero", shard_dir + "/model.safetensors");
  absl::Status shard = OpenError(shard_dir);
  EXPECT_EQ(shard.code(), absl::StatusCode::kInvalidArgument) << shard;
  EXPECT_THAT(shard.message(), HasSubstr(shard_dir + "/model.safetensors is not a regular file"));

  const std::string huge_dir = TestDir() + "/huge";
  fs::create_directories(huge_dir);
  WriteText(huge_dir + "/config.json", "{}");
  fs::resize_file(huge_dir + "/config.json", (64u << 20) + 1);  // sparse: no disk used
  absl::Status huge = OpenError(huge_dir);
  EXPECT_EQ(huge.code(), absl::StatusCode::kInvalidArgument) << huge;
  EXPECT_THAT(huge.message(), HasSubstr("beyond the 64 MiB"));
}

TEST(SafetensorsTest, CorruptHeaderJsonIsInvalidArgument) {
  const std::string dir = TestDir();
  const std::string path = SingleFileCheckpoint(dir);
  WriteRaw(path, R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4])", "abcd");
  absl::Status s = OpenError(dir);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr(path));
  EXPECT_THAT(s.message(), HasSubstr("JSON"));
}

// Each malformed entry must be reported with the file and tensor it concerns.
TEST(SafetensorsTest, MalformedEntriesAreInvalidArgumentNamingFileAndTensor) {
  struct Case {
    const char* header;
    const char* expect;
  };
  const Case cases[] = {
      {R"({"w": {"dtype": "I64", "shape": [1], "data_offsets": [0, 8]}})", "I64"},
      {R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}})", "before begin"},
      {R"({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}})", "past the data"},
      {R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 8]}})", "needs 4"},
      {R"({"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}})", "bad shape"},
      {R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0]}})", "data_offsets"},
      {R"({"w": {"dtype": "F32", "shape": [1]}})", "data_offsets"},
      {R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
           "w": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}})",
       "twice"},
  };
  const std::string dir = TestDir();
  const std::string path = SingleFileCheckpoint(dir);
  for (const Case& c : cases) {
    WriteRaw(path, c.header, "01234567");
    absl::Status s = OpenError(dir);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.header;
    EXPECT_THAT(s.message(), HasSubstr(path));
    EXPECT_THAT(s.message(), HasSubstr("'w'"));
    EXPECT_THAT(s.message(), HasSubstr(c.expect));
  }
}

TEST(SafetensorsTest, OverlappingTensorsAreInvalidArgumentNamingBoth) {
  const std::string dir = TestDir();
  const std::string path = SingleFileCheckpoint(dir);
  WriteRaw(path,
           R"({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
               "y": {"dtype": "F16", "shape": [2], "data_offsets": [6, 10]},
               "z": {"dtype": "F16", "shape": [0], "data_offsets": [2, 2]}})",
           "0123456789");
  absl::Status s = OpenError(dir);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr(path));
  EXPECT_THAT(s.message(), HasSubstr("'x'"));
  EXPECT_THAT(s.message(), HasSubstr("'y'"));
  EXPECT_THAT(s.message(), HasSubstr("overlap"));
}

TEST(SafetensorsTest, AdjacentAndEmptyTensorsAreNotOverlaps) {
  const std::string dir = TestDir();
  const std::string path = SingleFileCheckpoint(dir);
  WriteRaw(path,
           R"({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
               "y": {"dtype": "F16", "shape": [1], "data_offsets": [8, 10]},
               "z": {"dtype": "F16", "shape": [0, 5], "data_offsets": [4, 4]},
               "__metadata__": {"format": "pt"}})",
           "0123456789");
  absl::StatusOr<std::unique_ptr<Checkpoint>> checkpoint = Checkpoint::Open(dir);
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status();
  EXPECT_EQ((*checkpoint)->TensorNames(), std::vector<std::string>({"x", "y", "z"}));
  EXPECT_TRUE((*checkpoint)->ReadF32("z", {0, 5})->empty());
}

class ShardedErrorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = TestDir();
    std::vector<HostTensor> tensors = SampleTensors();
    ASSERT_TRUE(WriteSafetensors(dir_ + "/s1.safetensors", {tensors[0]}).ok());
    ASSERT_TRUE(WriteSafetensors(dir_ + "/s2.safetensors", {tensors[1], tensors[2]}).ok());
    WriteText(dir_ + "/config.json", "{}");
  }
  void WriteIndex(const std::string& weight_map) {
    WriteText(dir_ + "/model.safetensors.index.json",
              absl::StrCat(R"({"weight_map": )", weight_map, "}"));
  }
  std::string dir_;
};

TEST_F(ShardedErrorsTest, MissingShardIsNotFoundNamingShardAndTensor) {
  WriteIndex(R"({"a.f32": "s1.safetensors", "b.bf16": "s3.safetensors"})");
  absl::Status s = OpenError(dir_);
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(s.message(), HasSubstr(dir_ + "/s3.safetensors"));
  EXPECT_THAT(s.message(), HasSubstr("'b.bf16'"));
}

TEST_F(ShardedErrorsTest, IndexNamingATensorTheShardLacksIsInvalidArgument) {
  WriteIndex(R"({"a.f32": "s1.safetensors", "b.bf16": "s2.safetensors",
                 "c.f16": "s2.safetensors", "d.missing": "s1.safetensors"})");
  absl::Status s = OpenError(dir_);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("'d.missing'"));
  EXPECT_THAT(s.message(), HasSubstr("s1.safetensors"));
}

TEST_F(ShardedErrorsTest, TensorInTwoShardsIsInvalidArgumentNamingIt) {
  ASSERT_TRUE(WriteSafetensors(dir_ + "/s3.safetensors", {SampleTensors()[1]}).ok());
  WriteIndex(R"({"a.f32": "s1.safetensors", "b.bf16": "s3.safetensors",
                 "c.f16": "s2.safetensors"})");
  absl::Status s = OpenError(dir_);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("'b.bf16'"));
  EXPECT_THAT(s.message(), HasSubstr("another shard"));
}

TEST_F(ShardedErrorsTest, MalformedIndexIsInvalidArgumentNamingTheIndex) {
  for (const char* map : {R"("not an object")", R"({"a.f32": 3})", R"({"a.f32": "../x"})"}) {
    WriteIndex(map);
    absl::Status s = OpenError(dir_);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << map;
    EXPECT_THAT(s.message(), HasSubstr("model.safetensors.index.json"));
  }
}

TEST_F(ShardedErrorsTest, CorruptShardIsReportedWithItsPath) {
  WriteIndex(R"({"a.f32": "s1.safetensors", "b.bf16": "s2.safetensors"})");
  WriteText(dir_ + "/s2.safetensors", "xx");
  absl::Status s = OpenError(dir_);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr(dir_ + "/s2.safetensors"));
}

TEST(SafetensorsTest, FailedWriteLeavesNoFileBehind) {
  const std::string dir = TestDir();
  HostTensor bad = F32Tensor("w", {3}, {1.0f, 2.0f});  // 8 bytes for a 12-byte shape
  absl::Status s = WriteSafetensors(dir + "/m.safetensors", {bad});
  EXPECT_FALSE(s.ok());
  EXPECT_THAT(s.message(), HasSubstr("'w'"));
  EXPECT_TRUE(fs::is_empty(dir)) << "a partial or temp file was left";

  absl::Status duplicate = WriteSafetensors(dir + "/m.safetensors",
                                            {F32Tensor("w", {1}, {1}), F32Tensor("w", {1}, {2})});
  EXPECT_EQ(duplicate.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(fs::is_empty(dir));
}

TEST(SafetensorsTest, StreamingWriterRejectsProducerThatWritesTooMuch) {
  const std::string dir = TestDir();
  const uint8_t bytes[8] = {};
  absl::Status s = WriteSafetensorsStreaming(
      dir + "/m.safetensors", {{"w", DType::kF16, {2}}},
      [&](const TensorMeta&, const ByteSink& sink) { return sink(bytes, 8); });
  EXPECT_FALSE(s.ok());
  EXPECT_TRUE(fs::is_empty(dir));
}

TEST(SafetensorsTest, ParseDTypeNamesUnsupportedDtypes) {
  EXPECT_EQ(*ParseDType("BF16"), DType::kBF16);
  EXPECT_EQ(*ParseDType("F16"), DType::kF16);
  EXPECT_EQ(*ParseDType("F32"), DType::kF32);
  EXPECT_THAT(ParseDType("I64").status().message(), HasSubstr("'I64'"));
}

uint32_t Bits(float x) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  return b;
}

float FromBits(uint32_t b) {
  float x;
  std::memcpy(&x, &b, 4);
  return x;
}

TEST(BF16Test, RoundsToNearestWithTiesToEven) {
  EXPECT_EQ(F32ToBF16(1.0f), 0x3f80);
  EXPECT_EQ(F32ToBF16(FromBits(0x3f808000)), 0x3f80);  // tie, even stays down
  EXPECT_EQ(F32ToBF16(FromBits(0x3f818000)), 0x3f82);  // tie, odd goes up to even
  EXPECT_EQ(F32ToBF16(FromBits(0x3f808001)), 0x3f81);  // just above the tie
  EXPECT_EQ(F32ToBF16(FromBits(0x3f807fff)), 0x3f80);  // just below the tie
  EXPECT_EQ(F32ToBF16(FromBits(0xbf818000)), 0xbf82);  // sign does not matter
  EXPECT_EQ(F32ToBF16(FromBits(0x0000ffff)), 0x0001);  // subnormals round too
}

TEST(BF16Test, InfinityOverflowAndNaNAreHandled) {
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(F32ToBF16(inf), 0x7f80);
  EXPECT_EQ(F32ToBF16(-inf), 0xff80);
  EXPECT_EQ(F32ToBF16(std::numeric_limits<float>::max()), 0x7f80);  // rounds up to inf
  EXPECT_TRUE(std::isnan(BF16ToF32(F32ToBF16(std::nanf("")))));
  // Payload only in the low 16 bits: plain truncation would turn this NaN into inf.
  EXPECT_TRUE(std::isnan(BF16ToF32(F32ToBF16(FromBits(0x7f800001)))));
  EXPECT_EQ(F32ToBF16(FromBits(0xff800001)) & 0x8000, 0x8000);
}

TEST(BF16Test, EveryBF16ValueRoundTripsExactly) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float x = BF16ToF32(static_cast<uint16_t>(h));
    EXPECT_EQ(Bits(x), h << 16);
    if (!std::isnan(x)) {
      ASSERT_EQ(F32ToBF16(x), h) << std::hex << h;
    }
  }
}

TEST(F16Test, ConvertsNormalsSubnormalsAndSpecials) {
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(F32ToF16(1.0f), 0x3c00);
  EXPECT_EQ(F32ToF16(-2.0f), 0xc000);
  EXPECT_EQ(F32ToF16(65504.0f), 0x7bff);
  EXPECT_EQ(F32ToF16(65519.0f), 0x7bff);
  EXPECT_EQ(F32ToF16(65520.0f), 0x7c00);  // the tie past the largest finite value
  EXPECT_EQ(F32ToF16(1e9f), 0x7c00);
  EXPECT_EQ(F32ToF16(-inf), 0xfc00);
  EXPECT_EQ(F32ToF16(std::ldexp(1.0f, -14)), 0x0400);  // smallest normal
  EXPECT_EQ(F32ToF16(std::ldexp(1.0f, -24)), 0x0001);  // smallest subnormal
  EXPECT_EQ(F32ToF16(std::ldexp(1.0f, -25)), 0x0000);  // tie to even: zero
  EXPECT_EQ(F32ToF16(std::ldexp(1.5f, -25)), 0x0001);  // above the tie
  EXPECT_EQ(F32ToF16(std::ldexp(3.0f, -25)), 0x0002);  // tie 1.5 ulp -> even 2
  EXPECT_EQ(F32ToF16(std::ldexp(1.0f, -30)), 0x0000);
  EXPECT_EQ(F32ToF16(-std::ldexp(1.0f, -30)), 0x8000);
  EXPECT_EQ(F32ToF16(1.0f + std::ldexp(1.0f, -11)), 0x3c00);      // tie, even stays
  EXPECT_EQ(F32ToF16(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3c02);  // tie, odd rounds up
  EXPECT_TRUE(std::isnan(F16ToF32(F32ToF16(std::nanf("")))));
  EXPECT_EQ(F16ToF32(0x7c00), inf);
  EXPECT_TRUE(std::isnan(F16ToF32(0x7c01)));
  EXPECT_EQ(F16ToF32(0x0001), std::ldexp(1.0f, -24));
  EXPECT_EQ(F16ToF32(0x03ff), std::ldexp(1023.0f, -24));
  EXPECT_EQ(F16ToF32(0x8000), -0.0f);
  EXPECT_TRUE(std::signbit(F16ToF32(0x8000)));
}

TEST(F16Test, EveryF16ValueRoundTripsExactly) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float x = F16ToF32(static_cast<uint16_t>(h));
    if (!std::isnan(x)) {
      ASSERT_EQ(F32ToF16(x), h) << std::hex << h;
    }
  }
}

#if defined(__FLT16_MAX__)
// The compiler's _Float16 conversion (IEEE round-to-nearest-even) is an independent reference.
TEST(F16Test, MatchesCompilerFloat16OnManyFloats) {
  uint64_t state = 12345;
  for (int i = 0; i < 1000000; ++i) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    // Exponents concentrated around the f16 range, plus the full random range.
    uint32_t bits = static_cast<uint32_t>(state >> 32);
    if (i % 2 == 0) bits = (bits & 0x807fffffu) | ((95u + (bits >> 23) % 50u) << 23);
    const float x = FromBits(bits);
    if (std::isnan(x)) continue;
    const _Float16 h = static_cast<_Float16>(x);
    uint16_t expected;
    std::memcpy(&expected, &h, 2);
    ASSERT_EQ(F32ToF16(x), expected) << std::hex << bits;
  }
}
#endif

}  // namespace
}  // namespace rollout
