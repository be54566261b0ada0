// The binaries' command lines, as a new user meets them: --help lists the binary's own flags
// (it once printed "No flags matched"), --version names the project version, commit and build
// type (it once printed "Debug build (NDEBUG not #defined)" on a Release build), --v=1 is
// accepted (it was refused), and the bearer token has one spelling, --auth_token_file, whose
// file may end its line in CRLF (the '\r' was once kept, so a correct token was refused).
#include <sys/wait.h>

#include <cctype>
#include <chrono>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "google/protobuf/descriptor.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/reliability_util.h"
#include "tests/test_server.h"

namespace rollout::testing {
namespace {

namespace rel = ::rollout::testing::reliability;

using std::chrono::seconds;

bool Contains(const std::string& text, const std::string& needle) {
  return text.find(needle) != std::string::npos;
}

struct BinaryRun {
  int exit_code = -1;  // -1: did not exit normally within the timeout
  std::string output;
};

BinaryRun RunBinary(const std::vector<std::string>& argv) {
  BinaryRun run;
  std::unique_ptr<rel::ChildProcess> child =
      rel::ChildProcess::Start(argv, {"ROLLOUT_CACHE_DIR=" + rel::TestModelCache()});
  if (child == nullptr) return run;
  const int status = child->Wait(seconds(60));
  // The reader thread may still be draining the pipe; the output is complete at its EOF.
  child->WaitForOutput("\x01", std::chrono::milliseconds(200));
  run.output = child->output();
  if (status != -1 && WIFEXITED(status)) run.exit_code = WEXITSTATUS(status);
  return run;
}

std::string WriteText(const std::string& name, const std::string& text) {
  const std::string path = ::testing::TempDir() + "reliability-command-line-" + name;
  std::ofstream(path, std::ios::binary) << text;
  return path;
}

#if defined(ROLLOUT_SERVER_BIN) && defined(ROLLOUT_CLI_BIN) && defined(ROLLOUT_MAKE_MODEL_BIN)
TEST(ReliabilityCommandLineTest, HelpListsEachBinarysOwnFlags) {
  struct Case {
    std::string binary;
    std::vector<std::string> flags;
  };
  const std::vector<Case> cases = {
      {ROLLOUT_SERVER_BIN, {"--model", "--port", "--auth_token_file", "--metrics_port", "--v "}},
      {ROLLOUT_CLI_BIN, {"--server", "--auth_token_file", "--prompt"}},
      {ROLLOUT_MAKE_MODEL_BIN, {"--out", "--preset"}},
  };
  for (const Case& c : cases) {
    const BinaryRun run = RunBinary({c.binary, "--help"});
    EXPECT_FALSE(Contains(run.output, "No flags matched")) << c.binary << ":\n" << run.output;
    for (const std::string& flag : c.flags) {
      EXPECT_TRUE(Contains(run.output, "    " + flag)) << c.binary << " lacks " << flag << ":\n"
                                                       << run.output;
    }
  }
}

// The words (RPC names among them) of one flag's entry in `help`: from "--flag (" to the next
// flag's entry.
std::set<std::string> FlagHelpWords(const std::string& help, const std::string& flag) {
  std::set<std::string> words;
  const size_t begin = help.find("    --" + flag + " (");
  if (begin == std::string::npos) return words;
  const size_t end = help.find("\n    --", begin + 1);
  std::string word;
  for (char c : help.substr(begin, end == std::string::npos ? std::string::npos : end - begin)) {
    if (std::isalnum(static_cast<unsigned char>(c)) || c == '_') {
      word += c;
    } else if (!word.empty()) {
      words.insert(word);
      word.clear();
    }
  }
  return words;
}

// --help names the RPCs the token guards as the server guards them: each RPC that a caller
// without the token is refused (UNAUTHENTICATED) in --auth_token_file's entry, each other one in
// --auth_all_rpcs's (it once left out ReleaseMemory and ResumeMemory).
TEST(ReliabilityCommandLineTest, TheTokenFlagsHelpNamesEveryRpcTheTokenGuards) {
  const BinaryRun run = RunBinary({ROLLOUT_SERVER_BIN, "--help"});
  const std::set<std::string> control = FlagHelpWords(run.output, "auth_token_file");
  const std::set<std::string> all = FlagHelpWords(run.output, "auth_all_rpcs");
  ASSERT_FALSE(control.empty()) << run.output;
  ASSERT_FALSE(all.empty()) << run.output;

  ServerOptions options;
  options.auth_token = "s3cret";
  std::unique_ptr<TestServer> server = StartTestServer(options);
  ASSERT_NE(server, nullptr);
  const google::protobuf::ServiceDescriptor* service =
      google::protobuf::DescriptorPool::generated_pool()->FindServiceByName(
          "rollout.v1.RolloutService");
  ASSERT_NE(service, nullptr);
  for (int m = 0; m < service->method_count(); ++m) {
    const std::string name = service->method(m)->name();
    // An empty request, without the token: the access check answers first.
    const grpc::Status status = rel::RawCall(
        server->channel, absl::StrCat("/rollout.v1.RolloutService/", name), "", seconds(30));
    if (status.error_code() == grpc::StatusCode::UNAUTHENTICATED) {
      EXPECT_EQ(control.count(name), 1u) << name << " needs the token; --auth_token_file's help:\n"
                                         << run.output;
    } else {
      EXPECT_EQ(all.count(name), 1u) << name << " is open without --auth_all_rpcs; its help:\n"
                                     << run.output;
      EXPECT_EQ(control.count(name), 0u) << name << " needs no token";
    }
  }
}

// --chunk_mb 64 read as allowed ("the server accepts messages up to 64 MiB"), then failed with
// gRPC's raw "Received message larger than max" on a tensor over 64 MiB (review24 finding 2).
// Refused before any connection, so no server is needed.
TEST(ReliabilityCommandLineTest, UpdateWeightsRefusesAChunkTheServerCouldNotTake) {
  for (const char* mb : {"64", "0"}) {
    const BinaryRun run = RunBinary({ROLLOUT_CLI_BIN, "--server=127.0.0.1:1",
                                     "--connect_timeout_s=1", "--from=/nonexistent", "--version=v",
                                     std::string("--chunk_mb=") + mb, "update-weights"});
    EXPECT_EQ(run.exit_code, 1) << run.output;
    EXPECT_TRUE(Contains(run.output, std::string("--chunk_mb ") + mb + ": give 1 to 63"))
        << run.output;
  }
  // --streams is named as typed (it said "streams is 0").
  const BinaryRun run = RunBinary({ROLLOUT_CLI_BIN, "--server=127.0.0.1:1", "--connect_timeout_s=1",
                                   "--from=/nonexistent", "--version=v", "--streams=0",
                                   "update-weights"});
  EXPECT_EQ(run.exit_code, 1) << run.output;
  EXPECT_TRUE(Contains(run.output, "--streams 0: give 1 to 64")) << run.output;
}

// A flag the command does not read is named in a warning, not silently ignored: "--samples 4
// score" scored once and said nothing (review24 finding 7e). The command still runs (scripts
// pass one set of flags to several commands).
TEST(ReliabilityCommandLineTest, TheCliWarnsOfAFlagTheCommandIgnores) {
  const BinaryRun ignored =
      RunBinary({ROLLOUT_CLI_BIN, "--server=127.0.0.1:1", "--connect_timeout_s=1", "--tokens=1,2",
                 "--samples", "4", "score"});
  EXPECT_EQ(ignored.exit_code, 1) << ignored.output;
  EXPECT_TRUE(Contains(ignored.output, "warning: --samples does not apply to score"))
      << ignored.output;
  EXPECT_TRUE(Contains(ignored.output, "could not connect")) << ignored.output;
  // The warning names the spelling given: --version, which rollout-cli takes as --weight_version.
  const BinaryRun version = RunBinary({ROLLOUT_CLI_BIN, "--server=127.0.0.1:1",
                                       "--connect_timeout_s=1", "--version", "v1", "info"});
  EXPECT_TRUE(Contains(version.output, "warning: --version does not apply to info"))
      << version.output;
  // --version alone prints the binary's version, as rollout-server --version does.
  const BinaryRun alone = RunBinary({ROLLOUT_CLI_BIN, "--version"});
  EXPECT_EQ(alone.exit_code, 0) << alone.output;
  EXPECT_TRUE(Contains(alone.output, "rollout ")) << alone.output;
  // The command's own and the common flags go through to the connection.
  const BinaryRun own = RunBinary({ROLLOUT_CLI_BIN, "--server=127.0.0.1:1", "--connect_timeout_s=1",
                                   "--json", "--tokens=1,2", "--temperature=0.5", "score"});
  EXPECT_EQ(own.exit_code, 1) << own.output;
  EXPECT_TRUE(Contains(own.output, "could not connect")) << own.output;
  EXPECT_FALSE(Contains(own.output, "warning")) << own.output;
}

TEST(ReliabilityCommandLineTest, VersionNamesTheProjectVersionCommitAndBuildType) {
  for (const char* binary : {ROLLOUT_SERVER_BIN, ROLLOUT_MAKE_MODEL_BIN}) {
    const BinaryRun run = RunBinary({binary, "--version"});
    EXPECT_EQ(run.exit_code, 0) << run.output;
    EXPECT_TRUE(Contains(run.output, "rollout 0.1.0 (commit ")) << run.output;
    EXPECT_TRUE(Contains(run.output, " build)")) << run.output;
    EXPECT_FALSE(Contains(run.output, "NDEBUG")) << run.output;
  }
}

// --v=1 starts the server (glog's verbosity), and the token file's CRLF is not part of the token:
// a client that sends the token itself, and rollout-cli reading the same CRLF file, are both let
// in; the CLI's old --token still works, with a deprecation warning.
TEST(ReliabilityCommandLineTest, VerbosityAndACrlfTokenFileWorkAcrossServerAndCli) {
  const std::string token_file = WriteText("token", "s3cret\r\n");
  rel::ServerProcess server = rel::StartServerProcess(
      {"--port=0", "--metrics_port=0", "--v=1", "--auth_token_file=" + token_file});
  ASSERT_GT(server.port, 0) << "the server did not start:\n" << server.child->output();

  auto stub = v1::RolloutService::NewStub(
      grpc::CreateChannel(server.address(), grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  context.AddMetadata("authorization", "Bearer s3cret");
  v1::ResumeResponse resumed;
  const grpc::Status status = stub->Resume(&context, {}, &resumed);
  EXPECT_TRUE(status.ok()) << status.error_code() << ": " << status.error_message();

  const std::string address = "--server=" + server.address();
  const BinaryRun with_file =
      RunBinary({ROLLOUT_CLI_BIN, address, "--auth_token_file=" + token_file, "resume"});
  EXPECT_EQ(with_file.exit_code, 0) << with_file.output;

  const std::string flagfile = WriteText("flags", "--token=s3cret\r\n");
  const BinaryRun deprecated =
      RunBinary({ROLLOUT_CLI_BIN, address, "--flagfile=" + flagfile, "resume"});
  EXPECT_EQ(deprecated.exit_code, 0) << deprecated.output;
  EXPECT_TRUE(Contains(deprecated.output, "--token is deprecated")) << deprecated.output;

  const BinaryRun wrong = RunBinary({ROLLOUT_CLI_BIN, address, "--auth_token=nope", "resume"});
  EXPECT_NE(wrong.exit_code, 0) << wrong.output;
  EXPECT_TRUE(Contains(wrong.output, "UNAUTHENTICATED")) << wrong.output;
}
#endif

}  // namespace
}  // namespace rollout::testing
