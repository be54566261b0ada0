// UpdateWeightsFromIpc through the real gRPC stack: the request's validation (INVALID_ARGUMENT
// naming the field, before any backend is asked), the cpu backend's refusal, access control, the
// update slot, and rollout-cli's JSON file of handles. On the cuda backend
// (ROLLOUT_TEST_BACKEND=cuda) the handles that cannot be opened are checked instead of the
// refusal; the copy itself is proved by tests/gpu/ipc_update.sh with a torch trainer.
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "client/rollout_client.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "model/safetensors.h"
#include "tests/reliability_util.h"
#include "tests/test_server.h"

namespace rollout::testing {
namespace {

namespace rel = ::rollout::testing::reliability;

constexpr char kTensor[] = "model.layers.1.mlp.down_proj.weight";
constexpr char kOtherGpu[] = "GPU-00000000-0000-0000-0000-000000000000";
const std::vector<uint32_t> kPrompt = {21, 8, 1000, 77, 3, 512, 64};

bool Contains(const std::string& text, const std::string& needle) {
  return text.find(needle) != std::string::npos;
}

// A well-formed tensor of the served model: the right name, dtype and shape, a 64-byte handle
// that no process exported.
v1::IpcTensor WellFormed(const std::string& model_dir, const std::string& uuid = kOtherGpu) {
  const HostTensor t = rel::ReadCheckpointTensor(model_dir, kTensor);
  v1::IpcTensor ipc;
  ipc.set_name(t.name);
  ipc.set_dtype(DTypeName(t.dtype));
  for (int64_t d : t.shape) ipc.add_shape(static_cast<uint64_t>(d));
  ipc.set_ipc_handle(std::string(64, '\xab'));
  ipc.set_offset_bytes(0);
  ipc.set_device_uuid(uuid);
  return ipc;
}

v1::UpdateWeightsFromIpcRequest Request(std::vector<v1::IpcTensor> tensors,
                                        const std::string& version = "ipc-1") {
  v1::UpdateWeightsFromIpcRequest request;
  request.set_version(version);
  request.set_policy(v1::IN_FLIGHT_POLICY_CONTINUE);
  for (v1::IpcTensor& t : tensors) *request.add_tensors() = std::move(t);
  return request;
}

grpc::Status Call(v1::RolloutService::Stub* stub, const v1::UpdateWeightsFromIpcRequest& request,
                  const std::string& token = "") {
  grpc::ClientContext context;
  if (!token.empty()) context.AddMetadata("authorization", "Bearer " + token);
  v1::UpdateWeightsResponse response;
  return stub->UpdateWeightsFromIpc(&context, request, &response);
}

std::string Generate(v1::RolloutService::Stub* stub) {
  v1::GenerateRequest request;
  *request.add_rollouts() = MakeRollout(kPrompt, 5, 8, 0.8f);
  GenerateOutcome out = RunGenerate(stub, request);
  EXPECT_TRUE(out.status.ok()) << out.status.error_message();
  return out.status.ok() ? Fingerprint(out.completions[0][0]) : "";
}

class WeightsIpcE2eTest : public SharedServerTest {
 protected:
  static std::string ModelDir() { return server_->server->model_dir(); }
  static std::string Backend() { return rel::FetchServerInfo(stub()).backend(); }
};

TEST_F(WeightsIpcE2eTest, MalformedRequestsAreInvalidArgumentNamingTheFieldAndChangeNothing) {
  const std::string before = Generate(stub());
  const v1::IpcTensor ok = WellFormed(ModelDir());
  struct Case {
    v1::UpdateWeightsFromIpcRequest request;
    std::string expected;
  };
  std::vector<Case> cases;
  cases.push_back({Request({ok}, ""), "version"});
  cases.push_back({Request({}), "tensors is empty"});
  v1::IpcTensor t = ok;
  t.set_name("model.layers.1.mlp.nonexistent.weight");
  cases.push_back({Request({t}),
                   "tensors[0]: tensor 'model.layers.1.mlp.nonexistent.weight' is "
                   "not a weight of the served model"});
  t = ok;
  t.set_shape(0, t.shape(0) + 1);
  cases.push_back({Request({t}), "shape"});
  t = ok;
  t.set_dtype("I64");
  cases.push_back({Request({t}), "dtype 'I64' is not BF16, F16 or F32"});
  t = ok;
  t.set_dtype(ok.dtype() == "F32" ? "BF16" : "F32");
  cases.push_back({Request({t}), "the served tensor is"});
  t = ok;
  t.set_ipc_handle(std::string(66, 'c'));
  cases.push_back({Request({t}), "ipc_handle has 66 bytes; a cudaIpcMemHandle_t has 64"});
  t = ok;
  t.set_device_uuid("cuda:0");
  cases.push_back({Request({t}), "device_uuid 'cuda:0' is not a GPU UUID"});
  cases.push_back({Request({ok, ok}),
                   "tensors[1] ('model.layers.1.mlp.down_proj.weight') is "
                   "given twice"});
  for (const Case& c : cases) {
    const grpc::Status s = Call(stub(), c.request);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
    EXPECT_TRUE(Contains(s.error_message(), c.expected)) << s.error_message();
  }
  const v1::ServerInfo info = rel::FetchServerInfo(stub());
  EXPECT_EQ(info.weight_version(), "0");
  EXPECT_FALSE(info.weight_update_in_progress()) << "every refusal gave the update slot back";
  EXPECT_EQ(Generate(stub()), before);
}

TEST_F(WeightsIpcE2eTest, TheCpuBackendRefusesAWellFormedRequestWithFailedPrecondition) {
  if (Backend() != "cpu") GTEST_SKIP() << "the cpu backend's answer";
  const std::string before = Generate(stub());
  const std::string digest = rel::FetchServerInfo(stub()).weight_digest();
  // Through the C++ client, twice: the second is answered the same, not ABORTED (the first gave
  // the update slot back).
  auto client = RolloutClient::Connect(server_->address(), {});
  ASSERT_TRUE(client.ok()) << client.status();
  for (int i = 0; i < 2; ++i) {
    absl::StatusOr<v1::UpdateWeightsResponse> r =
        (*client)->UpdateWeightsFromIpc(Request({WellFormed(ModelDir())}));
    EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << r.status();
    EXPECT_EQ(r.status().message(),
              "the cpu backend cannot read CUDA IPC handles; use UpdateWeights or "
              "UpdateWeightsFromPath");
  }
  const v1::ServerInfo info = rel::FetchServerInfo(stub());
  EXPECT_EQ(info.weight_version(), "0");
  EXPECT_EQ(info.weight_digest(), digest);
  EXPECT_EQ(info.counters().weight_updates(), 0u);
  EXPECT_EQ(Generate(stub()), before);
}

TEST_F(WeightsIpcE2eTest, OnTheCudaBackendHandlesThatCannotBeReadAreInvalidArgumentNamingThem) {
  if (Backend() != "cuda") GTEST_SKIP() << "the cuda backend's answers";
  const grpc::Status other = Call(stub(), Request({WellFormed(ModelDir(), kOtherGpu)}));
  EXPECT_EQ(other.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << other.error_message();
  EXPECT_TRUE(Contains(other.error_message(), absl::StrCat("tensor '", kTensor, "' is on GPU")))
      << other.error_message();
  // The server's own GPU (nvidia-smi -L; tests/gpu/ipc_update.sh sets it) with a handle no
  // process exported.
  if (const char* uuid = std::getenv("ROLLOUT_TEST_GPU_UUID"); uuid != nullptr && *uuid) {
    const grpc::Status unopened = Call(stub(), Request({WellFormed(ModelDir(), uuid)}));
    EXPECT_EQ(unopened.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
        << unopened.error_message();
    EXPECT_TRUE(Contains(unopened.error_message(),
                         absl::StrCat("tensor '", kTensor, "': its ipc_handle does not open")))
        << unopened.error_message();
  }
  EXPECT_EQ(rel::FetchServerInfo(stub()).weight_version(), "0");
}

TEST(WeightsIpcAccessE2eTest, TheCallNeedsTheControlToken) {
  ServerOptions options;
  options.auth_token = "s3cret";
  std::unique_ptr<TestServer> server = StartTestServer(options);
  ASSERT_NE(server, nullptr);
  const v1::UpdateWeightsFromIpcRequest request =
      Request({WellFormed(server->server->model_dir())});
  for (const std::string& token : {std::string(), std::string("wrong")}) {
    const grpc::Status s = Call(server->stub.get(), request, token);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED) << token;
  }
  const grpc::Status s = Call(server->stub.get(), request, "s3cret");
  EXPECT_NE(s.error_code(), grpc::StatusCode::UNAUTHENTICATED) << s.error_message();
}

#if defined(ROLLOUT_CLI_BIN)
struct CliRun {
  int exit_code = -1;
  std::string output;
};

std::string CliPath() { return rel::BinaryPath("ROLLOUT_CLI_BIN", ROLLOUT_CLI_BIN); }

CliRun RunCli(const std::vector<std::string>& args) {
  std::vector<std::string> argv = {CliPath()};
  argv.insert(argv.end(), args.begin(), args.end());
  CliRun run;
  std::unique_ptr<rel::ChildProcess> child = rel::ChildProcess::Start(argv, {});
  if (child == nullptr) return run;
  const int status = child->Wait(std::chrono::seconds(60));
  child->WaitForOutput("\x01", std::chrono::milliseconds(200));  // the output is complete at EOF
  run.output = child->output();
  if (status != -1 && WIFEXITED(status)) run.exit_code = WEXITSTATUS(status);
  return run;
}

std::string WriteFile(const std::string& name, const std::string& text) {
  const std::string path = ::testing::TempDir() + "weights-ipc-e2e-" + name;
  std::ofstream(path, std::ios::binary) << text;
  return path;
}

TEST_F(WeightsIpcE2eTest, RolloutCliSendsTheTensorsOfAJsonFile) {
  if (access(CliPath().c_str(), X_OK) != 0) GTEST_SKIP() << CliPath() << " is not here";
  const v1::IpcTensor t = WellFormed(ModelDir());
  std::string shape;
  for (uint64_t d : t.shape()) absl::StrAppend(&shape, shape.empty() ? "" : ", ", d);
  const std::string file = WriteFile(
      "tensors.json",
      absl::StrCat(R"({"tensors": [{"name": ")", t.name(), R"(", "dtype": ")", t.dtype(),
                   R"(", "shape": [)", shape, R"(], "ipc_handle": ")",
                   absl::Base64Escape(t.ipc_handle()), R"(", "offset_bytes": 0, "device_uuid": ")",
                   t.device_uuid(), R"("}]})"));
  const std::string server = "--server=" + server_->address();
  const CliRun run =
      RunCli({server, "update-weights-from-ipc", "--ipc_tensors=" + file, "--version=ipc-1"});
  EXPECT_EQ(run.exit_code, 1) << run.output;
  // The request reached the server whole: the backend's own answer, past the validation.
  EXPECT_TRUE(Contains(run.output, Backend() == "cpu"
                                       ? "FAILED_PRECONDITION: the cpu backend cannot read CUDA IPC"
                                       : "INVALID_ARGUMENT: tensor '"))
      << run.output;

  const CliRun no_version = RunCli({server, "update-weights-from-ipc", "--ipc_tensors=" + file});
  EXPECT_EQ(no_version.exit_code, 1);
  EXPECT_TRUE(Contains(no_version.output, "--version (or --weight_version) is required"))
      << no_version.output;
  const std::string junk = WriteFile("junk.json", R"({"tensors": [{"name": 7}]})");
  const CliRun bad =
      RunCli({server, "update-weights-from-ipc", "--ipc_tensors=" + junk, "--version=v"});
  EXPECT_EQ(bad.exit_code, 1);
  EXPECT_TRUE(Contains(bad.output, "not an UpdateWeightsFromIpcRequest in proto3 JSON"))
      << bad.output;
  EXPECT_EQ(rel::FetchServerInfo(stub()).weight_version(), "0");
}
#endif

}  // namespace
}  // namespace rollout::testing
