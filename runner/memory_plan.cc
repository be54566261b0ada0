#include "runner/memory_plan.h"

#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <sstream>

#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace rollout {
namespace {

std::string GiB(int64_t bytes) { return absl::StrFormat("%.2f GiB", bytes / 1073741824.0); }

}  // namespace

int64_t MemoryPlan::total() const {
  int64_t sum = 0;
  for (const Item& item : items) sum += item.bytes;
  return sum;
}

std::string MemoryPlan::ItemsString() const {
  std::vector<std::string> parts;
  for (const Item& item : items) parts.push_back(item.what + " " + GiB(item.bytes));
  return absl::StrCat(where, ": ", absl::StrJoin(parts, " + "), " = ", GiB(total()));
}

std::string MemoryPlan::ToString() const {
  std::string line = ItemsString();
  if (available > 0) {
    absl::StrAppend(&line, " of ", GiB(available), ", ", GiB(available - total()), " left free");
  }
  return line;
}

absl::Status MemoryPlan::Check() const {
  if (available <= 0 || total() <= available) return absl::OkStatus();
  // The settings that lower the largest items first.
  std::vector<const Item*> limited;
  for (const Item& item : items) {
    if (!item.limit.empty()) limited.push_back(&item);
  }
  std::sort(limited.begin(), limited.end(),
            [](const Item* a, const Item* b) { return a->bytes > b->bytes; });
  std::vector<std::string> lower;
  for (const Item* item : limited) {
    lower.push_back(absl::StrFormat("%s (%s %s)", item->limit, item->what, GiB(item->bytes)));
  }
  return absl::ResourceExhaustedError(
      absl::StrFormat("the engine's limits do not fit in %s (%s): %s more than the %s available%s",
                      where, ItemsString(), GiB(total() - available), GiB(available),
                      lower.empty() ? "" : absl::StrCat(": lower ", absl::StrJoin(lower, " or "))));
}

int64_t AvailableHostMemory() {
  std::ifstream meminfo("/proc/meminfo");
  std::string line;
  while (std::getline(meminfo, line)) {
    std::istringstream fields(line);
    std::string key;
    int64_t kib = 0;
    if (fields >> key >> kib && key == "MemAvailable:") return kib * 1024;
  }
  const long pages = sysconf(_SC_AVPHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  return pages > 0 && page > 0 ? static_cast<int64_t>(pages) * page : 0;
}

}  // namespace rollout
