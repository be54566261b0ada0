#include "common/command_line.h"

#include <unistd.h>

#include <fstream>
#include <string>

#include "gtest/gtest.h"

namespace rollout {
namespace {

std::string WriteTokenFile(const std::string& name, const std::string& text) {
  const std::string path =
      ::testing::TempDir() + "command_line_test_" + name + "_" + std::to_string(::getpid());
  std::ofstream(path, std::ios::binary) << text;
  return path;
}

// The token is the first line without its line end: a file written on Windows (CRLF) once kept
// the '\r', so a correct token was refused.
TEST(ReadTokenFileTest, TheTokenIsTheFirstLineWithoutItsLineEndOrSurroundingSpace) {
  for (const std::string& text :
       {std::string("s3cret"), std::string("s3cret\n"), std::string("s3cret\r\n"),
        std::string("s3cret\r\nsecond line\r\n"), std::string("  s3cret \t\r\n")}) {
    absl::StatusOr<std::string> token = ReadTokenFile(WriteTokenFile("ok", text));
    ASSERT_TRUE(token.ok()) << token.status();
    EXPECT_EQ(*token, "s3cret");
  }
}

TEST(ReadTokenFileTest, AnEmptyFirstLineOrAMissingFileIsAnError) {
  for (const std::string& text : {std::string(""), std::string("\r\n"), std::string("\ns3cret")}) {
    absl::StatusOr<std::string> token = ReadTokenFile(WriteTokenFile("empty", text));
    EXPECT_EQ(token.status().code(), absl::StatusCode::kInvalidArgument) << token.status();
  }
  EXPECT_EQ(ReadTokenFile("/nonexistent/token").status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace rollout
