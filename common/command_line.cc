#include "common/command_line.h"

#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/build_info.h"
#include "common/regular_file.h"
#include "glog/logging.h"

namespace rollout {
namespace {

// A token is a line; a file this large is a wrong path.
constexpr uint64_t kMaxTokenFileBytes = 64 << 10;

}  // namespace

std::vector<char*> ParseCommandLine(int argc, char** argv, absl::string_view usage,
                                    absl::string_view main_file) {
  absl::SetProgramUsageMessage(usage);
  absl::FlagsUsageConfig config;
  const std::string file(main_file);
  config.contains_help_flags = [file](absl::string_view path) {
    return absl::EndsWith(path, file) || absl::EndsWith(path, "common/log_flags.cc");
  };
  config.contains_helpshort_flags = config.contains_help_flags;
  config.version_string = [] { return BuildInfoLine() + "\n"; };
  absl::SetFlagsUsageConfig(config);
  std::vector<char*> args = absl::ParseCommandLine(argc, argv);
  FLAGS_v = LogVerbosityFlag();
  return args;
}

absl::StatusOr<std::string> ReadTokenFile(const std::string& path) {
  absl::StatusOr<std::string> text = ReadSmallFile(path, kMaxTokenFileBytes, "token file");
  if (!text.ok()) return text.status();
  const std::string line = text->substr(0, text->find('\n'));
  // A file written on Windows (or by some secret stores) ends its line in "\r\n".
  const std::string token(absl::StripAsciiWhitespace(line));
  if (token.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("the token file ", path, " holds no token on its first line"));
  }
  return token;
}

}  // namespace rollout
