// Replays every seed (tests/fuzz/corpus/<target>/) and every regression input
// (tests/fuzz/regressions/<target>/) through the fuzz entry points, in the ordinary build: a
// crash or property violation found by fuzzing stays fixed. tests/fuzz/run.sh replays the same
// files under ASan/UBSan.
#include <stdlib.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <ostream>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tests/fuzz/fuzz_targets.h"

namespace rollout::fuzz {
namespace {

namespace fs = std::filesystem;

std::vector<fs::path> FilesIn(const fs::path& dir) {
  std::vector<fs::path> files;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return files;
  for (const fs::directory_entry& e : fs::directory_iterator(dir)) {
    if (e.is_regular_file() && e.path().filename().string()[0] != '.' &&
        e.path().extension() != ".md") {
      files.push_back(e.path());
    }
  }
  std::sort(files.begin(), files.end());
  return files;
}

}  // namespace

// Test names show the target's name, not the bytes of the struct.
void PrintTo(const Target& target, std::ostream* os) { *os << target.name; }

namespace {

int Replay(const Target& target, const std::vector<fs::path>& files) {
  int n = 0;
  for (const fs::path& file : files) {
    std::ifstream in(file, std::ios::binary);
    const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    // Printed first: a violation aborts the process, and this names the input.
    std::fprintf(stderr, "replaying %s (%zu bytes)\n", file.c_str(), bytes.size());
    EXPECT_EQ(target.run(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()), 0);
    ++n;
  }
  return n;
}

class FuzzReplayTest : public ::testing::TestWithParam<Target> {};

TEST_P(FuzzReplayTest, SeedsAndRegressionInputsRunCleanly) {
  const fs::path root(ROLLOUT_FUZZ_DIR);
  const int seeds = Replay(GetParam(), FilesIn(root / "corpus" / GetParam().name));
  EXPECT_GT(seeds, 0) << "no seed corpus for " << GetParam().name;
  const int regressions = Replay(GetParam(), FilesIn(root / "regressions" / GetParam().name));
  ::testing::Test::RecordProperty("seeds", seeds);
  ::testing::Test::RecordProperty("regressions", regressions);
}

INSTANTIATE_TEST_SUITE_P(AllTargets, FuzzReplayTest, ::testing::ValuesIn(Targets()),
                         [](const ::testing::TestParamInfo<Target>& info) {
                           return std::string(info.param.name);
                         });

}  // namespace
}  // namespace rollout::fuzz
