#include "format/strict_globals.h"

#include <algorithm>
#include <iterator>
#include <set>
#include <string>

namespace uckpt {
namespace {

using GlobalSet = std::set<std::string, std::less<>>;

// Globals named one by one.
const char* const kNamedGlobals[] = {
    // Containers and torch value types (PyTorch 2.x weights_only list).
    "collections.OrderedDict",
    "collections.Counter",
    "torch.nn.parameter.Parameter",
    "torch.serialization._get_layout",
    "torch.Size",
    "torch.Tensor",
    "torch.device",
    "_codecs.encode",
    "builtins.bytearray",
    "builtins.set",
    "builtins.complex",
    // Not in PyTorch's list, but how protocol 2 writes b'' and frozenset
    // values: plain data, no behaviour.
    "builtins.bytes",
    "builtins.frozenset",
    // Tensor rebuild functions.
    "torch._tensor._rebuild_from_type_v2",
    "torch._utils._rebuild_tensor",
    "torch._utils._rebuild_tensor_v2",
    "torch._utils._rebuild_tensor_v3",
    "torch._utils._rebuild_parameter",
    "torch._utils._rebuild_parameter_with_state",
    "torch._utils._rebuild_qtensor",
    "torch._utils._rebuild_sparse_tensor",
    "torch._utils._rebuild_meta_tensor_no_storage",
    "torch._utils._rebuild_wrapper_subclass",
    "torch._utils._rebuild_device_tensor_from_numpy",
    "torch._utils._rebuild_device_tensor_from_cpu_tensor",
    // Quantization schemes.
    "torch.per_tensor_affine",
    "torch.per_tensor_symmetric",
    "torch.per_channel_affine",
    "torch.per_channel_symmetric",
    "torch.per_channel_affine_float_qparams",
    // Untyped and typed storages.
    "torch.storage.UntypedStorage",
    "torch.storage.TypedStorage",
    // DeepSpeed checkpoint classes (DeepSpeed spec §9).
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
    "deepspeed.runtime.bf16_optimizer.fragment_address",
    "deepspeed.checkpoint.universal_checkpoint.SubparamShape",
    "argparse.Namespace",  // Megatron-DeepSpeed's `args` client key
    // NumPy RNG states (DeepSpeed's data_sampler, Megatron's rng_state).
    "numpy.core.multiarray._reconstruct",
    "numpy.core.multiarray.scalar",
    "numpy._core.multiarray._reconstruct",
    "numpy._core.multiarray.scalar",
    "numpy.ndarray",
    "numpy.dtype",
};

// Every dtype torch can pickle (str(dtype) of each).
const char* const kTorchDtypes[] = {"float32",
                                    "float64",
                                    "float16",
                                    "bfloat16",
                                    "complex32",
                                    "complex64",
                                    "complex128",
                                    "uint8",
                                    "int8",
                                    "int16",
                                    "int32",
                                    "int64",
                                    "bool",
                                    "uint16",
                                    "uint32",
                                    "uint64",
                                    "qint8",
                                    "quint8",
                                    "qint32",
                                    "quint4x2",
                                    "quint2x4",
                                    "float8_e4m3fn",
                                    "float8_e5m2",
                                    "float8_e4m3fnuz",
                                    "float8_e5m2fnuz",
                                    "float8_e8m0fnu",
                                    "float4_e2m1fn_x2",
                                    "bits1x8",
                                    "bits2x4",
                                    "bits4x2",
                                    "bits8",
                                    "bits16"};

void AddDtypes(GlobalSet& s) {
  for (const char* d : kTorchDtypes) s.insert(std::string("torch.") + d);
  for (int bits = 1; bits <= 7; ++bits) {
    s.insert("torch.uint" + std::to_string(bits));
    s.insert("torch.int" + std::to_string(bits));
  }
}

void AddLegacyClasses(GlobalSet& s) {
  // Legacy typed storage classes and tensor classes (CPU, CUDA, sparse).
  for (const char* e : {"Double", "Float", "Half", "BFloat16", "Long", "Int", "Short", "Char", "Byte", "Bool",
                        "ComplexDouble", "ComplexFloat", "QUInt8", "QInt8", "QInt32", "QUInt4x2", "QUInt2x4"}) {
    s.insert(std::string("torch.") + e + "Storage");
    s.insert(std::string("torch.cuda.") + e + "Storage");
  }
  for (const char* e : {"Double", "Float", "Half", "BFloat16", "Long", "Int", "Short", "Char", "Byte", "Bool"}) {
    for (const char* m : {"torch.", "torch.cuda.", "torch.sparse.", "torch.cuda.sparse."})
      s.insert(std::string(m) + e + "Tensor");
  }
}

GlobalSet BuildAllowList() {
  GlobalSet s(std::begin(kNamedGlobals), std::end(kNamedGlobals));
  AddDtypes(s);
  AddLegacyClasses(s);
  return s;
}

const GlobalSet& AllowList() {
  static const auto* list = new GlobalSet(BuildAllowList());
  return *list;
}

}  // namespace

bool StrictAllowsGlobal(std::string_view path) { return AllowList().count(path) > 0; }

bool StrictAllowsGetattr(std::string_view class_path, std::string_view attribute) {
  if (class_path != "deepspeed.runtime.zero.config.ZeroStageEnum") return false;
  return attribute == "disabled" || attribute == "optimizer_states" || attribute == "gradients" ||
         attribute == "weights";
}

std::vector<std::string> StrictAllowList() { return {AllowList().begin(), AllowList().end()}; }

}  // namespace uckpt
