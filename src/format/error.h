// Errors raised by the format layer. Every message names the file and, where
// it applies, the record or pickle offset that was wrong.
#pragma once

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

}  // namespace uckpt
