#include "runner/cuda/cuda_backend.h"

#include <cstdlib>
#include <fstream>
#include <string>

#include "gtest/gtest.h"

namespace rollout {
namespace {

// Sets ROLLOUT_CUDA_BACKEND for one test and restores it.
class ScopedBackendPath {
 public:
  explicit ScopedBackendPath(const std::string& path) {
    if (const char* old = std::getenv("ROLLOUT_CUDA_BACKEND"); old != nullptr) old_ = old;
    setenv("ROLLOUT_CUDA_BACKEND", path.c_str(), 1);
  }
  ~ScopedBackendPath() {
    if (old_.empty()) {
      unsetenv("ROLLOUT_CUDA_BACKEND");
    } else {
      setenv("ROLLOUT_CUDA_BACKEND", old_.c_str(), 1);
    }
  }

 private:
  std::string old_;
};

bool BuildHasCudaBackend() {
  ScopedBackendPath none("/nonexistent/librollout_cuda_backend.so");
  return LoadCudaBackend().code() != absl::StatusCode::kUnimplemented;
}

TEST(CudaBackendTest, ABuildWithoutTheBackendSaysHowToGetIt) {
  if (BuildHasCudaBackend()) GTEST_SKIP() << "this build has the CUDA backend";
  const absl::Status s = LoadCudaBackend();
  EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented) << s;
  EXPECT_NE(s.message().find("this build has no CUDA backend; rebuild with -DROLLOUT_CUDA=ON"),
            std::string::npos)
      << s;
}

// engine_test lives in build/bin, the module in build/lib (the loader's <exe dir>/../lib);
// loading it needs no GPU, only the CUDA runtime libraries a CUDA build has anyway.
TEST(CudaBackendTest, TheBuiltModuleLoadsFromBesideTheExecutable) {
  if (!BuildHasCudaBackend()) GTEST_SKIP() << "this build has no CUDA backend";
  if (std::getenv("ROLLOUT_CUDA_BACKEND") != nullptr) GTEST_SKIP() << "ROLLOUT_CUDA_BACKEND set";
  const absl::Status s = LoadCudaBackend();
  EXPECT_TRUE(s.ok()) << s;
}

TEST(CudaBackendTest, AMissingModuleIsNotFoundAndNamesTheOverride) {
  if (!BuildHasCudaBackend()) GTEST_SKIP() << "this build has no CUDA backend";
  ScopedBackendPath missing("/nonexistent/librollout_cuda_backend.so");
  const absl::Status s = LoadCudaBackend();
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
  EXPECT_NE(s.message().find("ROLLOUT_CUDA_BACKEND=/nonexistent/librollout_cuda_backend.so"),
            std::string::npos)
      << s;
}

TEST(CudaBackendTest, AFileThatDoesNotLoadIsAFailedPreconditionQuotingDlerror) {
  if (!BuildHasCudaBackend()) GTEST_SKIP() << "this build has no CUDA backend";
  const std::string path = ::testing::TempDir() + "not_a_module.so";
  {
    std::ofstream out(path);
    for (int i = 0; i < 16; ++i) out << "not an ELF file\n";  // longer than an ELF header
  }
  ScopedBackendPath bogus(path);
  const absl::Status s = LoadCudaBackend();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("cannot load the CUDA backend module " + path), std::string::npos)
      << s;
  // dlerror() names the file and why ("invalid ELF header" here).
  EXPECT_NE(s.message().find("invalid ELF header"), std::string::npos) << s;
}

}  // namespace
}  // namespace rollout
