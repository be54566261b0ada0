#include "runner/cuda/cuda_backend.h"

#include <dlfcn.h>

#include <cstdlib>
#include <filesystem>
#include <string>
#include <system_error>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace rollout {
namespace {

using Factory = decltype(&rollout_cuda_backend_create_v1);

#ifdef ROLLOUT_CUDA_BACKEND_FILE  // the module's file name; defined in builds that build it

constexpr char kOverrideVariable[] = "ROLLOUT_CUDA_BACKEND";

// Where the module may be, in the order tried.
std::vector<std::string> ModuleCandidates() {
  namespace fs = std::filesystem;
  if (const char* path = std::getenv(kOverrideVariable); path != nullptr && *path != '\0') {
    return {path};
  }
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (ec) return {};
  const fs::path dir = exe.parent_path();
  return {(dir.parent_path() / "lib" / ROLLOUT_CUDA_BACKEND_FILE).string(),
          (dir / ROLLOUT_CUDA_BACKEND_FILE).string()};
}

absl::StatusOr<Factory> LoadFactory() {
  const std::vector<std::string> candidates = ModuleCandidates();
  std::string path;
  for (const std::string& candidate : candidates) {
    std::error_code ec;
    if (std::filesystem::is_regular_file(candidate, ec)) {
      path = candidate;
      break;
    }
  }
  if (path.empty()) {
    if (const char* set = std::getenv(kOverrideVariable); set != nullptr && *set != '\0') {
      return absl::NotFoundError(absl::StrFormat(
          "backend 'cuda': %s=%s is not a file; point it at librollout_cuda_backend.so or unset "
          "it to use the module installed beside the executable",
          kOverrideVariable, set));
    }
    return absl::NotFoundError(absl::StrFormat(
        "backend 'cuda': the CUDA backend module %s was not found (looked for %s); build it "
        "(target rollout_cuda_backend, built with rollout-server), install it in the lib/ "
        "directory beside the executable's bin/, or set %s=/path/to/%s",
        ROLLOUT_CUDA_BACKEND_FILE, absl::StrJoin(candidates, ", "), kOverrideVariable,
        ROLLOUT_CUDA_BACKEND_FILE));
  }
  // RTLD_LOCAL: the module's symbols stay out of the global scope (it exports one anyway).
  // RTLD_NODELETE: never unloaded; runners it created may outlive any handle we keep.
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL | RTLD_NODELETE);
  if (handle == nullptr) {
    const char* why = dlerror();
    return absl::FailedPreconditionError(absl::StrFormat(
        "backend 'cuda': cannot load the CUDA backend module %s: %s (it needs the CUDA runtime "
        "libraries libcudart and libcublasLt of the toolkit it was built with: install them, "
        "or add their directory to LD_LIBRARY_PATH)",
        path, why != nullptr ? why : "unknown dlopen error"));
  }
  dlerror();
  void* symbol = dlsym(handle, kCudaBackendFactorySymbol);
  if (symbol == nullptr) {
    const char* why = dlerror();
    return absl::FailedPreconditionError(absl::StrFormat(
        "backend 'cuda': %s is not a CUDA backend module of this build (%s); rebuild it with "
        "this tree (target rollout_cuda_backend)",
        path, why != nullptr ? why : kCudaBackendFactorySymbol));
  }
  return reinterpret_cast<Factory>(symbol);
}

#else  // no CUDA backend in this build

absl::StatusOr<Factory> LoadFactory() {
  return absl::UnimplementedError(
      "backend 'cuda': this build has no CUDA backend; rebuild with -DROLLOUT_CUDA=ON (needs "
      "nvcc; deploy/build.sh and the container image do this when the CUDA toolkit is "
      "installed), or use --backend cpu");
}

#endif

}  // namespace

absl::Status LoadCudaBackend() { return LoadFactory().status(); }

absl::StatusOr<std::unique_ptr<ModelRunner>> CreateCudaModelRunner(
    const Checkpoint& checkpoint, const CudaRunnerOptions& options) {
  absl::StatusOr<Factory> factory = LoadFactory();
  if (!factory.ok()) return factory.status();
  const CudaBackendAbi abi;
  absl::StatusOr<std::unique_ptr<ModelRunner>> result =
      absl::InternalError("the CUDA backend module returned no result");
  (*factory)(&abi, &checkpoint, &options, &result);
  return result;
}

}  // namespace rollout
