#include "common/command_line.h"

#include <fstream>

#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/build_info.h"
#include "glog/logging.h"

namespace rollout {

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
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read the token file ", path));
  std::string line;
  std::getline(in, line);
  // A file written on Windows (or by some secret stores) ends its line in "\r\n".
  const std::string token(absl::StripAsciiWhitespace(line));
  if (token.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("the token file ", path, " holds no token on its first line"));
  }
  return token;
}

}  // namespace rollout
