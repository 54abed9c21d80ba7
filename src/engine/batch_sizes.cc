// DeepSpeed's batch arithmetic (config.h: ResolveBatchSizes): train =
// micro batch x gradient accumulation x world size, any two given.
#include "engine/config.h"

#include <string>

namespace uckpt::engine {

BatchSizes ResolveBatchSizes(std::optional<int64_t> train, std::optional<int64_t> micro, std::optional<int64_t> ga,
                             int world_size) {
  const int64_t w = world_size;
  auto positive = [](const char* name, const std::optional<int64_t>& v) {
    if (v && *v <= 0) throw BatchSizeError(std::string(name) + " must be > 0, got " + std::to_string(*v));
  };
  positive("train_batch_size", train);
  positive("train_micro_batch_size_per_gpu", micro);
  positive("gradient_accumulation_steps", ga);
  BatchSizes b;
  if (train && micro && ga) {
    b = {*train, *micro, *ga};
  } else if (train && micro) {
    if (*train % (*micro * w) != 0)
      throw BatchSizeError("train_batch_size " + std::to_string(*train) + " is not a multiple of " +
                           "train_micro_batch_size_per_gpu " + std::to_string(*micro) + " * world size " +
                           std::to_string(w) + " = " + std::to_string(*micro * w));
    b = {*train, *micro, *train / (*micro * w)};
  } else if (train && ga) {
    if (*train % (*ga * w) != 0)
      throw BatchSizeError("train_batch_size " + std::to_string(*train) + " is not a multiple of " +
                           "gradient_accumulation_steps " + std::to_string(*ga) + " * world size " + std::to_string(w) +
                           " = " + std::to_string(*ga * w));
    b = {*train, *train / (*ga * w), *ga};
  } else if (micro && ga) {
    b = {*micro * *ga * w, *micro, *ga};
  } else if (train) {
    if (*train % w != 0)
      throw BatchSizeError("train_batch_size " + std::to_string(*train) + " is not a multiple of world size " +
                           std::to_string(w));
    b = {*train, *train / w, 1};
  } else if (micro) {
    b = {*micro * w, *micro, 1};
  } else {
    throw BatchSizeError(
        "give train_batch_size or train_micro_batch_size_per_gpu (any two of train_batch_size, "
        "train_micro_batch_size_per_gpu and gradient_accumulation_steps determine the third)");
  }
  if (b.train_batch_size != b.micro_batch * b.gradient_accumulation_steps * w)
    throw BatchSizeError("train_batch_size " + std::to_string(b.train_batch_size) +
                         " != train_micro_batch_size_per_gpu " + std::to_string(b.micro_batch) +
                         " * gradient_accumulation_steps " + std::to_string(b.gradient_accumulation_steps) +
                         " * world size " + std::to_string(w) + " = " +
                         std::to_string(b.micro_batch * b.gradient_accumulation_steps * w));
  return b;
}

}  // namespace uckpt::engine
