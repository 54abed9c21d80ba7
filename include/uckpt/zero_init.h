// ZeRO stage 3 construction of a C++ model too large for one rank
// (DeepSpeed's deepspeed.zero.Init, for libtorch modules): the model is built
// one unit at a time, and each unit is partitioned across the ranks as soon
// as it is built, so a rank never holds more than its partitions plus the
// unit being built.
//
//   uckpt::Config config = uckpt::Config::FromFile("ds_config.json");  // stage 3
//   uckpt::EngineOptions options;
//   std::shared_ptr<Net> net;
//   {
//     uckpt::ZeroInit init(config, options);  // this thread's construction scope
//     // Net's constructor wraps each block in ZeroInit::Built; this partitions the rest.
//     net = uckpt::ZeroInit::Built(std::make_shared<Net>());
//     init.AddTo(options);  // the partitions and the communicator, for the engine
//   }
//   options.gather_units = net->gather_units();  // its blocks
//   uckpt::Engine engine(net, config, std::move(options));
//
// Every call is collective: all ranks build the same modules in the same
// order. See docs/engine.md, "Building a model partitioned".
#pragma once

#include <torch/nn/module.h>

#include <cstdint>
#include <memory>
#include <set>
#include <vector>

#include "uckpt/comm.h"
#include "uckpt/engine.h"

namespace uckpt {

class ZeroInit {
 public:
  // Enters the construction scope of this thread (one at a time: a second
  // one on the same thread is a std::logic_error). `config` must set
  // zero_optimization.stage 3 (else std::invalid_argument naming the stage).
  // The communicator is options.comm, else one made from the environment as
  // the Engine makes it (options.device says whether for CUDA); AddTo hands
  // it to the Engine, which then ends it as one it made.
  explicit ZeroInit(const Config& config, const EngineOptions& options = {});
  ~ZeroInit();  // leaves the scope
  ZeroInit(const ZeroInit&) = delete;
  ZeroInit& operator=(const ZeroInit&) = delete;

  // The scope entered on this thread, or null.
  static ZeroInit* Current();

  // For model code: partitions `unit` (a std::shared_ptr to a module or a
  // torch::nn::ModuleHolder such as torch::nn::Linear) in this thread's
  // scope and returns it; outside a scope it returns `unit` untouched, so
  // the same constructor builds the model whole.
  template <class Unit>
  static Unit Built(Unit unit) {
    if (ZeroInit* scope = Current()) scope->Partition(*unit);
    return unit;
  }

  // Partitions every parameter of `module` (its submodules' included) that
  // is not partitioned yet, in named_parameters() order: rank 0's value
  // (broadcast, as the Engine broadcasts a whole build's), of which this rank
  // keeps elements [rank*P, (rank+1)*P) of the flattened value, P =
  // ceil(numel / world size), zeros past the end, on the CPU, a floating-point
  // one in the config's model dtype (bf16/fp16 when enabled, as zero.Init's).
  // The parameter keeps its shape and requires_grad, takes the partition's
  // dtype and loses its storage: its values must not be read or written until
  // the engine gathers it. Buffers stay whole. A parameter on the meta device or
  // without storage is a std::invalid_argument naming it. Collective.
  void Partition(torch::nn::Module& module);

  // Hands the partitions to the engine: appends them to options.partitioned
  // and sets options.comm (and options.finish_comm when the scope made the
  // communicator). Once; the scope partitions nothing after it.
  void AddTo(EngineOptions& options);

  // What this rank holds now: the partitioned parameters and their
  // partitions' bytes.
  size_t num_partitioned() const { return partitions_.size(); }
  int64_t partition_bytes() const { return partition_bytes_; }
  Comm& comm() { return *comm_; }

 private:
  std::shared_ptr<Comm> comm_;
  bool made_comm_ = false;
  bool handed_over_ = false;
  std::vector<PartitionedParameter> partitions_;
  std::set<const void*> seen_;  // TensorImpls partitioned (a parameter shared by two units once)
  int64_t partition_bytes_ = 0;
  at::ScalarType dtype_ = at::kFloat;  // the config's model dtype: floating-point partitions
  int64_t freed_since_trim_ = 0;
};

}  // namespace uckpt
