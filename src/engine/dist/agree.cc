#include "engine/dist/agree.h"

#include <cstring>
#include <iostream>
#include <stdexcept>

namespace uckpt::engine {
namespace {

// [status][dir]\0[tag]\0 in a fixed-size message: one collective, no length exchange.
constexpr int64_t kMessageBytes = 8192;
constexpr uint8_t kFits = 1, kTooLong = 2;

std::string Quoted(const std::string& s) { return "'" + s + "'"; }

}  // namespace

CheckpointPlace AgreeOnCheckpointPlace(Comm& comm, const std::string& dir, const std::string& tag,
                                       const std::string& what, bool tags_must_match) {
  if (comm.world_size() <= 1) return {dir, tag};
  at::Tensor msg = at::zeros({kMessageBytes}, at::kByte);
  auto* bytes = msg.data_ptr<uint8_t>();
  if (comm.rank() == 0) {
    const bool fits = static_cast<int64_t>(dir.size() + tag.size()) + 3 <= kMessageBytes;
    bytes[0] = fits ? kFits : kTooLong;
    if (fits) {
      std::memcpy(bytes + 1, dir.data(), dir.size());
      std::memcpy(bytes + 2 + dir.size(), tag.data(), tag.size());
    }
  }
  comm.Broadcast(msg, 0);
  if (bytes[0] != kFits)
    throw std::invalid_argument(what + ": rank 0's checkpoint folder and tag are longer than " +
                                std::to_string(kMessageBytes - 3) + " bytes");
  CheckpointPlace agreed;
  agreed.dir = reinterpret_cast<const char*>(bytes + 1);
  agreed.tag = reinterpret_cast<const char*>(bytes + 2 + agreed.dir.size());
  if (tags_must_match) {  // every rank learns whether any differs, and all stop together
    at::Tensor differs = at::full({1}, agreed.tag != tag ? 1.0f : 0.0f);
    comm.AllReduceMax(differs);
    if (differs.item<float>() > 0)
      throw std::invalid_argument(what + ": the checkpoint tag is not the same on every rank (rank " +
                                  std::to_string(comm.rank()) + ": " + Quoted(tag) + ", rank 0: " + Quoted(agreed.tag) +
                                  "), and the config's checkpoint.tag_validation is \"Fail\"");
  }
  if (agreed.dir != dir || agreed.tag != tag) {
    std::cerr << "uckpt: warning: " << what << ": rank " << comm.rank() << " was given folder " << Quoted(dir)
              << (tag.empty() ? std::string() : " tag " + Quoted(tag)) << ", rank 0 folder " << Quoted(agreed.dir)
              << (agreed.tag.empty() ? std::string() : " tag " + Quoted(agreed.tag)) << "; every rank uses rank 0's"
              << " (the ranks must agree for the checkpoint to be whole)\n";
  }
  return agreed;
}

}  // namespace uckpt::engine
