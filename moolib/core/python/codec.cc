#include "python/codec.h"

#include "python/gil.h"
#include "python/segments.h"

namespace moolib::binding {

Codec& codec() {
  static auto* c = new Codec();  // leaked: lives as long as the interpreter
  return *c;
}

FastCodec& fastCodec() {
  static auto* c = new FastCodec();  // leaked: lives as long as the interpreter
  return *c;
}

void initFastCodec() {
  FastCodec& f = fastCodec();
  auto pickle = py::module_::import("pickle");
  f.dumps = pickle.attr("dumps");
  f.loads = pickle.attr("loads");
  f.emptyCall = f.dumps(py::make_tuple(py::tuple(), py::dict()), 5).cast<std::string>();
  f.noneValue = f.dumps(py::none(), 5).cast<std::string>();
  f.handlersName = py::str("_handlers");
}

bool isPlain(PyObject* obj, int depth) {
  PyTypeObject* t = Py_TYPE(obj);
  if (obj == Py_None || t == &PyBool_Type || t == &PyLong_Type || t == &PyFloat_Type ||
      t == &PyComplex_Type || t == &PyUnicode_Type || t == &PyBytes_Type) {
    return true;
  }
  if (depth == 0) return false;
  if (t == &PyTuple_Type || t == &PyList_Type) {
    Py_ssize_t n = PySequence_Fast_GET_SIZE(obj);
    if (n > 16) return false;
    PyObject** items = PySequence_Fast_ITEMS(obj);
    for (Py_ssize_t i = 0; i != n; ++i) {
      if (!isPlain(items[i], depth - 1)) return false;
    }
    return true;
  }
  if (t == &PyDict_Type) {
    if (PyDict_GET_SIZE(obj) > 16) return false;
    Py_ssize_t pos = 0;
    PyObject *key, *value;
    while (PyDict_Next(obj, &pos, &key, &value)) {
      if (Py_TYPE(key) != &PyUnicode_Type || !isPlain(value, depth - 1)) return false;
    }
    return true;
  }
  return false;
}

std::vector<OutSegment> encodeValue(py::handle value) {
  FastCodec& fc = fastCodec();
  std::vector<OutSegment> segs;
  if (value.is_none()) {
    segs.push_back(constantSegment(fc.noneValue));
  } else if (isPlain(value.ptr(), 3)) {
    py::object data = callOrThrow(fc.dumps, value, py::int_(5));
    char* p;
    Py_ssize_t n;
    PyBytes_AsStringAndSize(data.ptr(), &p, &n);
    segs.push_back(ownedSegment(std::string(p, size_t(n))));
  } else {
    py::tuple encoded = callOrThrow(codec().dumps, value);
    segs = exportSegments(encoded[0], encoded[1].cast<py::list>());
  }
  return segs;
}

py::object decodeSegments(const std::vector<BufferPtr>& segs) {
  if (segs.empty()) return py::none();
  if (segs.size() == 1 && segmentIs(*segs[0], fastCodec().noneValue)) return py::none();
  if (segs.size() == 1 && segs[0]->size() <= 65536) {
    // No out-of-band buffers: what codec().loads would do, without its frame.
    return callOrThrow(fastCodec().loads,
                       py::bytes(reinterpret_cast<const char*>(segs[0]->data()), segs[0]->size()));
  }
  // The pickle stream is usually small: a bytes copy is cheaper than a
  // buffer object (and pickle reads it either way).
  py::object stream;
  if (segs[0]->size() <= 65536) {
    stream = py::bytes(reinterpret_cast<const char*>(segs[0]->data()), segs[0]->size());
  } else {
    stream = py::cast(PyBuffer{segs[0]});
  }
  py::list buffers(segs.size() - 1);
  for (size_t i = 1; i < segs.size(); ++i) buffers[i - 1] = py::cast(PyBuffer{segs[i]});
  return callOrThrow(codec().loads, stream, buffers);
}

std::string describeError(py::error_already_set& e) {
  e.restore();
  PyObject *type, *value, *trace;
  PyErr_Fetch(&type, &value, &trace);
  PyErr_NormalizeException(&type, &value, &trace);
  if (value && trace) PyException_SetTraceback(value, trace);
  py::object exc = py::reinterpret_steal<py::object>(value);
  Py_XDECREF(type);
  Py_XDECREF(trace);
  try {
    return callOrThrow(fastCodec().describe, exc).cast<std::string>();
  } catch (py::error_already_set& inner) {
    return inner.what();
  }
}

void bindCodec(py::module_& m) {
  m.def(
      "_is_plain", [](py::handle obj, int depth) { return isPlain(obj.ptr(), depth); },
      py::arg("obj"), py::arg("depth"),
      "The C verdict of moolib.serialization._is_plain, exposed so tests can hold the two "
      "together.");
  m.def(
      "set_dispatch",
      [](py::object plainType, py::object describe) {
        fastCodec().plainType = std::move(plainType);
        fastCodec().describe = std::move(describe);
      },
      "Registers the type of plain function handlers (its fn attribute is called with the "
      "call's arguments) and describe(exception) -> str, the error text of a failed call.");
  m.def(
      "set_codec",
      [](py::object dumps, py::object loads) {
        codec().dumps = std::move(dumps);
        codec().loads = std::move(loads);
      },
      "Registers dumps(obj) -> (bytes, [buffers]) and loads(data, buffers) for calls made from "
      "C++.");
}

}  // namespace moolib::binding
