#include "common/regular_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <future>
#include <string>

#include "gtest/gtest.h"

namespace rollout {
namespace {

namespace fs = std::filesystem;

std::string TestPath(const std::string& name) {
  const std::string dir =
      ::testing::TempDir() + "regular_file_test_" + std::to_string(::getpid()) + "/";
  fs::create_directories(dir);
  return dir + name;
}

TEST(ReadSmallFileTest, ReadsARegularFileWithinItsLimit) {
  const std::string path = TestPath("small");
  std::ofstream(path, std::ios::binary) << std::string("a\0b", 3);
  absl::StatusOr<std::string> text = ReadSmallFile(path, 3, "test file");
  ASSERT_TRUE(text.ok()) << text.status();
  EXPECT_EQ(*text, std::string("a\0b", 3));
  absl::StatusOr<std::string> over = ReadSmallFile(path, 2, "test file");
  EXPECT_EQ(over.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(over.status().message().find("beyond the 2 bytes a test file may have"),
            std::string::npos)
      << over.status();
}

// A FIFO would block the open (until a writer came), /dev/zero would be read without end, a
// directory or a symlink loop cannot be read: each is refused at once, naming the path.
TEST(ReadSmallFileTest, FifosDevicesDirectoriesAndLoopsAreRefusedAtOnce) {
  const std::string fifo = TestPath("fifo");
  fs::remove(fifo);
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  const std::string loop = TestPath("loop");
  fs::remove(loop);
  fs::create_symlink(loop, loop);
  for (const std::string& path : {fifo, std::string("/dev/zero"), TestPath(""), loop}) {
    auto read = std::async(std::launch::async, [&] { return ReadSmallFile(path, 1 << 20, "x"); });
    if (read.wait_for(std::chrono::seconds(10)) != std::future_status::ready) {
      ADD_FAILURE() << path << ": the read did not return";
      const int fd = ::open(fifo.c_str(), O_WRONLY | O_NONBLOCK);  // lets a blocked open go on
      if (fd >= 0) ::close(fd);
    }
    const absl::Status s = read.get().status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << path << ": " << s;
    EXPECT_NE(s.message().find(path), std::string::npos) << s;
  }
  EXPECT_EQ(ReadSmallFile(TestPath("missing"), 1, "x").status().code(),
            absl::StatusCode::kNotFound);
}

TEST(ReadFileAtTest, AFileThatEndsEarlyIsAborted) {
  const std::string path = TestPath("short");
  std::ofstream(path, std::ios::binary) << "abcd";
  struct stat st;
  absl::StatusOr<int> fd = OpenRegularFile(path, &st);
  ASSERT_TRUE(fd.ok()) << fd.status();
  uint8_t out[8];
  EXPECT_TRUE(ReadFileAt(*fd, path, 0, 4, out).ok());
  const absl::Status s = ReadFileAt(*fd, path, 2, 4, out);
  EXPECT_EQ(s.code(), absl::StatusCode::kAborted) << s;
  EXPECT_NE(s.message().find("ends at byte 4"), std::string::npos) << s;
  ::close(*fd);
}

}  // namespace
}  // namespace rollout
