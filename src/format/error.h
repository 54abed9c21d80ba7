// Errors raised by the format layer. Every message names the file and, where
// it applies, the record or pickle offset that was wrong.
#pragma once

#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <string>

namespace uckpt {

// Input that is not what it claims to be (corrupt, truncated, hostile or
// unsupported). Catch this to turn bad input into a clean error exit.
class FormatError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A failure of the operating system: open, mmap, write, rename, fsync...
class IoError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Throws IoError "<what> <path>: <strerror(error)>", e.g. "cannot open x.pt: No such file or directory".
[[noreturn]] inline void ThrowErrno(const std::string& what, const std::string& path, int error = errno) {
  throw IoError(what + " " + path + ": " + std::strerror(error));
}

}  // namespace uckpt
