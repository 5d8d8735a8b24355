#include "python/codec.h"

#include "python/gil.h"
#include "python/segments.h"

namespace moolib::binding {

Codec& codec() {
  static auto* c = new Codec();  // leaked: lives as long as the interpreter
  return *c;
}

void initCodec() {
  Codec& c = codec();
  auto pickle = py::module_::import("pickle");
  c.pickleDumps = pickle.attr("dumps");
  c.pickleLoads = pickle.attr("loads");
  c.emptyCall = c.pickleDumps(py::make_tuple(py::tuple(), py::dict()), 5).cast<std::string>();
  c.noneValue = c.pickleDumps(py::none(), 5).cast<std::string>();
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

std::vector<OutSegment> encodeCall(PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
  if (nargs == 0 && nkw == 0) {
    std::vector<OutSegment> segs;
    segs.push_back(constantSegment(codec().emptyCall));
    return segs;
  }
  py::tuple callArgs(nargs);
  for (Py_ssize_t i = 0; i != nargs; ++i) {
    PyTuple_SET_ITEM(callArgs.ptr(), i, py::handle(args[i]).inc_ref().ptr());
  }
  py::dict callKwargs;
  for (Py_ssize_t i = 0; i != nkw; ++i) {
    if (PyDict_SetItem(callKwargs.ptr(), PyTuple_GET_ITEM(kwnames, i), args[nargs + i]) != 0) {
      throw py::error_already_set();
    }
  }
  return encodeValue(py::make_tuple(callArgs, callKwargs));
}

Call decodeCall(const std::vector<BufferPtr>& segs) {
  Call call;
  if (segs.size() == 1 && segmentIs(*segs[0], codec().emptyCall)) {
    call.args = py::tuple();
    return call;
  }
  py::object decoded = decodeValue(segs);
  py::tuple pair = py::reinterpret_steal<py::tuple>(PySequence_Tuple(decoded.ptr()));
  if (!pair) throw py::error_already_set();
  if (pair.size() != 2) {
    PyErr_Format(PyExc_ValueError, "expected (args, kwargs), got %zd values",
                 Py_ssize_t(pair.size()));
    throw py::error_already_set();
  }
  call.args = py::reinterpret_steal<py::object>(PySequence_Tuple(pair[0].ptr()));
  if (!call.args) throw py::error_already_set();
  if (PyDict_CheckExact(pair[1].ptr())) {
    if (PyDict_GET_SIZE(pair[1].ptr()) != 0) call.kwargs = pair[1];
  } else {
    call.kwargs = py::dict();
    if (PyDict_Update(call.kwargs.ptr(), pair[1].ptr()) != 0) throw py::error_already_set();
  }
  return call;
}

std::vector<OutSegment> encodeValue(py::handle value) {
  Codec& c = codec();
  std::vector<OutSegment> segs;
  if (value.is_none()) {
    segs.push_back(constantSegment(c.noneValue));
  } else if (isPlain(value.ptr(), 3)) {
    py::object data = callOrThrow(c.pickleDumps, value, py::int_(5));
    char* p;
    Py_ssize_t n;
    PyBytes_AsStringAndSize(data.ptr(), &p, &n);
    segs.push_back(ownedSegment(std::string(p, size_t(n))));
  } else {
    py::tuple encoded = callOrThrow(c.dumps, value);
    segs = exportSegments(encoded[0], encoded[1].cast<py::list>());
  }
  return segs;
}

py::object decodeValue(const std::vector<BufferPtr>& segs) {
  Codec& c = codec();
  if (segs.empty()) return py::none();
  if (segs.size() == 1 && segmentIs(*segs[0], c.noneValue)) return py::none();
  if (segs.size() == 1 && segs[0]->size() <= 65536) {
    // No out-of-band buffers: what c.loads would do, without its frame.
    return callOrThrow(c.pickleLoads,
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
  return callOrThrow(c.loads, stream, buffers);
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
    return callOrThrow(codec().describe, exc).cast<std::string>();
  } catch (py::error_already_set& inner) {
    return inner.what();
  }
}

void bindCodec(py::module_& m) {
  m.def(
      "_is_plain", [](py::handle obj, int depth) { return isPlain(obj.ptr(), depth); },
      py::arg("obj"), py::arg("depth"),
      "Whether obj is a small nest of scalars (at most depth levels of tuples, lists and "
      "dicts with str keys, 16 items each): the codec pickles those with pickle alone.");
  m.def(
      "set_codec",
      [](py::object dumps, py::object loads, py::object describe) {
        Codec& c = codec();
        c.dumps = std::move(dumps);
        c.loads = std::move(loads);
        c.describe = std::move(describe);
      },
      py::arg("dumps"), py::arg("loads"), py::arg("describe"),
      "Registers dumps(obj) -> (bytes, [buffers]) and loads(data, buffers), which encode and "
      "decode what is not plain, and describe(exception) -> str, the error text of a call "
      "that failed in Python.");
}

}  // namespace moolib::binding
