// The libFuzzer entry of one target, chosen at compile time by ROLLOUT_FUZZ_TARGET_NAME (a name
// in rollout::fuzz::Targets(), which is also its corpus folder). Built only by tests/fuzz/run.sh.
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "tests/fuzz/fuzz_targets.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const auto run = [] {
    for (const rollout::fuzz::Target& t : rollout::fuzz::Targets()) {
      if (std::strcmp(t.name, ROLLOUT_FUZZ_TARGET_NAME) == 0) return t.run;
    }
    std::fprintf(stderr, "no fuzz target named %s\n", ROLLOUT_FUZZ_TARGET_NAME);
    std::abort();
  }();
  return run(data, size);
}
