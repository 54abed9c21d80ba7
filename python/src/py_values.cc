#include "py_values.h"

#include <torch/csrc/autograd/python_variable.h>

#include <fstream>

namespace uckpt::python {

ClientState ToIValue(py::handle v, const std::string& what) {
  if (v.is_none()) return c10::IValue();
  if (py::isinstance<py::bool_>(v)) return c10::IValue(v.cast<bool>());
  if (py::isinstance<py::int_>(v)) return c10::IValue(v.cast<int64_t>());
  if (py::isinstance<py::float_>(v)) return c10::IValue(v.cast<double>());
  if (py::isinstance<py::str>(v)) return c10::IValue(v.cast<std::string>());
  if (THPVariable_Check(v.ptr())) return c10::IValue(THPVariable_Unpack(v.ptr()));
  if (py::isinstance<py::dict>(v)) {
    c10::impl::GenericDict d(c10::StringType::get(), c10::AnyType::get());
    for (auto item : v.cast<py::dict>()) {
      if (!py::isinstance<py::str>(item.first))
        throw py::type_error(what + ": dict keys must be str, got " +
                             py::str(py::type::handle_of(item.first)).cast<std::string>());
      const std::string key = item.first.cast<std::string>();
      d.insert(key, ToIValue(item.second, what + "['" + key + "']"));
    }
    return d;
  }
  if (py::isinstance<py::list>(v) || py::isinstance<py::tuple>(v)) {
    std::vector<c10::IValue> items;
    size_t i = 0;
    for (auto item : v) items.push_back(ToIValue(item, what + "[" + std::to_string(i++) + "]"));
    if (py::isinstance<py::tuple>(v)) return c10::ivalue::Tuple::create(std::move(items));
    c10::impl::GenericList l(c10::AnyType::get());
    for (auto& x : items) l.push_back(std::move(x));
    return l;
  }
  // numpy scalars (numpy.generic: np.float64(1.5), np.int64(3)): as int or float where Python can say which.
  const std::string type_module = py::str(py::type::handle_of(v).attr("__module__")).cast<std::string>();
  if (type_module == "numpy" && py::isinstance(v, py::module_::import("numpy").attr("generic")))
    return ToIValue(v.attr("item")(), what);
  // Anything else (a numpy array, an object of the script's): its pickle, as DeepSpeed's torch.save writes it.
  py::bytes pickled = py::module_::import("uckpt._client_pickle").attr("dumps")(v, what);
  return c10::IValue::make_capsule(c10::make_intrusive<PickledObject>(std::string(pickled)));
}

py::object FromIValue(const c10::IValue& v) {
  if (v.isNone()) return py::none();
  if (v.isBool()) return py::bool_(v.toBool());
  if (v.isInt()) return py::int_(v.toInt());
  if (v.isDouble()) return py::float_(v.toDouble());
  if (v.isString()) return py::str(v.toStringRef());
  if (v.isTensor()) return py::reinterpret_steal<py::object>(THPVariable_Wrap(v.toTensor()));
  if (v.isGenericDict()) {
    py::dict d;
    for (const auto& e : v.toGenericDict()) d[FromIValue(e.key())] = FromIValue(e.value());
    return d;
  }
  if (v.isTuple()) {
    const auto& elems = v.toTupleRef().elements();
    py::tuple t(elems.size());
    for (size_t i = 0; i < elems.size(); ++i) t[i] = FromIValue(elems[i]);
    return t;
  }
  if (v.isList()) {
    py::list l;
    for (const auto& e : v.toListRef()) l.append(FromIValue(e));
    return l;
  }
  if (v.isCapsule()) {
    auto pickled = c10::dynamic_intrusive_pointer_cast<PickledObject>(v.toCapsule());
    if (pickled)
      return py::module_::import("uckpt._client_pickle").attr("loads")(py::bytes(pickled->pickle), "client_state");
  }
  if (v.isIntList()) return py::cast(v.toIntVector());
  if (v.isDoubleList()) return py::cast(v.toDoubleVector());
  throw py::type_error(std::string("client_state holds a value of kind ") + v.tagKind() + " that Python cannot take");
}

std::string TypeName(py::handle h) { return py::str(py::type::handle_of(h).attr("__name__")).cast<std::string>(); }

std::string FsPath(py::handle path, const std::string& what) {
  if (!py::isinstance<py::str>(path) && !py::hasattr(path, "__fspath__"))
    throw py::type_error(what + " must be a str or a path, got " +
                         py::str(py::type::handle_of(path)).cast<std::string>());
  return py::str(py::module_::import("os").attr("fspath")(path)).cast<std::string>();
}

namespace {

// A value json.loads made (dict, list, str, int, float, bool, None) as nlohmann::json, inf and NaN kept.
nlohmann::json PyJsonToJson(py::handle v) {
  if (v.is_none()) return nullptr;
  if (py::isinstance<py::bool_>(v)) return v.cast<bool>();
  if (py::isinstance<py::int_>(v)) {
    try {
      return v.cast<int64_t>();
    } catch (const py::cast_error&) {
      return v.cast<double>();  // beyond int64: as nlohmann's parser would read it
    }
  }
  if (py::isinstance<py::float_>(v)) return v.cast<double>();
  if (py::isinstance<py::str>(v)) return v.cast<std::string>();
  if (py::isinstance<py::dict>(v)) {
    nlohmann::json o = nlohmann::json::object();
    for (auto item : v.cast<py::dict>()) o[item.first.cast<std::string>()] = PyJsonToJson(item.second);
    return o;
  }
  nlohmann::json a = nlohmann::json::array();
  for (auto item : v) a.push_back(PyJsonToJson(item));
  return a;
}

}  // namespace

nlohmann::json ConfigToJson(py::handle config, std::string& source, const std::string& caller) {
  if (py::isinstance<py::str>(config) || py::hasattr(config, "__fspath__")) {
    source = FsPath(config, "config");
    std::ifstream in(source);
    if (!in) throw py::value_error(caller + ": cannot read the config file " + source);
    try {
      return nlohmann::json::parse(in);
    } catch (const nlohmann::json::exception& e) {
      throw py::value_error(source + ": not valid JSON: " + e.what());
    }
  }
  if (!py::isinstance<py::dict>(config))
    throw py::type_error(caller + ": config must be a dict or the path of a JSON file, got " +
                         py::str(py::type::handle_of(config)).cast<std::string>());
  source = "config";
  // json's round trip normalizes as DeepSpeed's dict use would see it (keys to str, tuples to lists); the
  // numbers go over as Python floats: JSON text has no inf/NaN, which Accelerate puts in (steps_per_print).
  const py::object json = py::module_::import("json");
  return PyJsonToJson(json.attr("loads")(json.attr("dumps")(config)));
}

py::object JsonToPy(const nlohmann::json& j) { return py::module_::import("json").attr("loads")(j.dump()); }

}  // namespace uckpt::python
