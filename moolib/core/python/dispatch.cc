#include "python/dispatch.h"

#include <structmember.h>

#include <cstring>
#include <iterator>
#include <memory>
#include <vector>

#include "python/codec.h"
#include "python/gil.h"
#include "python/module.h"
#include "python/segments.h"

namespace moolib::binding {

namespace {

// moolib._core.Handler: a function and its kind. Garbage collected (it holds
// the function, which may hold its Rpc) and weakly referenceable (the core's
// reference to it).
struct HandlerObject {
  PyObject_HEAD PyObject* fn;
  PyObject* weakrefs;
  HandlerKind kind;
};
PyTypeObject* gHandlerType = nullptr;

constexpr const char* kKindNames[] = {"call", "responder", "encoded"};
constexpr int kKinds = int(std::size(kKindNames));

HandlerObject* asHandler(PyObject* o) { return reinterpret_cast<HandlerObject*>(o); }

PyObject* handlerNew(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  static const char* keywords[] = {"fn", "kind", nullptr};
  PyObject* fn;
  const char* kindName;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "Os:Handler", const_cast<char**>(keywords), &fn,
                                   &kindName)) {
    return nullptr;
  }
  if (!PyCallable_Check(fn)) {
    PyErr_Format(PyExc_TypeError, "Handler: fn must be callable, got %s", Py_TYPE(fn)->tp_name);
    return nullptr;
  }
  int kind = 0;
  while (kind != kKinds && std::strcmp(kindName, kKindNames[kind]) != 0) ++kind;
  if (kind == kKinds) {
    PyErr_Format(PyExc_ValueError,
                 "Handler: unknown kind '%s' (expected 'call', 'responder' or 'encoded')",
                 kindName);
    return nullptr;
  }
  PyObject* self = type->tp_alloc(type, 0);  // zeroed, and tracked by the collector
  if (!self) return nullptr;
  Py_INCREF(fn);
  asHandler(self)->fn = fn;
  asHandler(self)->kind = HandlerKind(kind);
  return self;
}

int handlerTraverse(PyObject* self, visitproc visit, void* arg) {
  Py_VISIT(asHandler(self)->fn);
  Py_VISIT(Py_TYPE(self));
  return 0;
}

int handlerClear(PyObject* self) {
  Py_CLEAR(asHandler(self)->fn);
  return 0;
}

void handlerDealloc(PyObject* self) {
  PyObject_GC_UnTrack(self);
  if (asHandler(self)->weakrefs) PyObject_ClearWeakRefs(self);
  handlerClear(self);
  PyTypeObject* type = Py_TYPE(self);
  type->tp_free(self);
  Py_DECREF(type);
}

PyObject* handlerKind(PyObject* self, void*) {
  return PyUnicode_FromString(kKindNames[int(asHandler(self)->kind)]);
}

PyMemberDef handlerMembers[] = {
    {"fn", T_OBJECT, offsetof(HandlerObject, fn), READONLY, "The function."},
    {"__weaklistoffset__", T_PYSSIZET, offsetof(HandlerObject, weakrefs), READONLY, nullptr},
    {nullptr, 0, 0, 0, nullptr}};

PyGetSetDef handlerGetSet[] = {
    {"kind", handlerKind, nullptr, "How the core calls fn: 'call', 'responder' or 'encoded'.",
     nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr}};

// Serves one call of fn as kind says and answers it (GIL held). The
// arguments' segments are released before fn runs, so that shared-memory
// segments are free for reuse by the time the caller's next call needs one.
void serve(HandlerKind kind, py::handle fn, const std::shared_ptr<Responder>& responder,
           std::vector<BufferPtr>& args) {
  std::vector<OutSegment> reply;
  try {
    Call call = decodeCall(args);
    args.clear();
    switch (kind) {
      case HandlerKind::kCall: {
        auto result = py::reinterpret_steal<py::object>(callParkingOnExit(
            fn.ptr(), call.args.ptr(), call.kwargs ? call.kwargs.ptr() : nullptr));
        if (!result) throw py::error_already_set();
        call = Call();
        reply = encodeValue(result);
        break;
      }
      case HandlerKind::kResponder: {
        py::object kwargs = call.kwargs ? call.kwargs : py::dict();
        callOrThrow(fn, py::cast(responder), call.args, kwargs);
        return;
      }
      case HandlerKind::kEncoded: {
        py::object kwargs = call.kwargs ? call.kwargs : py::dict();
        auto encoded = callOrThrow(fn, call.args, kwargs).cast<py::tuple>();
        reply = exportSegments(encoded[0], encoded[1].cast<py::list>());
        break;
      }
    }
  } catch (py::error_already_set& e) {
    responder->error(describeError(e));
    return;
  } catch (const std::exception& e) {
    responder->error(e.what());
    return;
  }
  responder->reply(std::move(reply));
}

}  // namespace

Rpc::Handler pythonDispatcher(py::handle handler, const std::string& name) {
  if (Py_TYPE(handler.ptr()) != gHandlerType) {
    throw py::type_error("expected a moolib._core.Handler");
  }
  HandlerKind kind = asHandler(handler.ptr())->kind;
  auto ref = py::reinterpret_steal<py::object>(PyWeakref_NewRef(handler.ptr(), nullptr));
  if (!ref) throw py::error_already_set();
  auto held = holdObject(ref);
  return [held, kind, name](std::shared_ptr<Responder> responder, std::vector<BufferPtr> args) {
    withPython([&] {
      py::object fn;
      {
        PyObject* h = PyWeakref_GetObject(held.get());  // borrowed; None once gone
        if (h != Py_None) fn = py::reinterpret_borrow<py::object>(asHandler(h)->fn);
      }  // a call in progress holds the function, not the Rpc that owns it
      if (!fn) {
        responder->error(concat("function '", name, "' is gone: its Rpc was deleted"));
        return;
      }
      serve(kind, fn, responder, args);
    });
  };
}

void bindHandler(py::module_& m) {
  static PyType_Slot slots[] = {
      {Py_tp_new, reinterpret_cast<void*>(handlerNew)},
      {Py_tp_dealloc, reinterpret_cast<void*>(handlerDealloc)},
      {Py_tp_free, reinterpret_cast<void*>(PyObject_GC_Del)},
      {Py_tp_traverse, reinterpret_cast<void*>(handlerTraverse)},
      {Py_tp_clear, reinterpret_cast<void*>(handlerClear)},
      {Py_tp_members, handlerMembers},
      {Py_tp_getset, handlerGetSet},
      {Py_tp_doc,
       const_cast<char*>("Handler(fn, kind)\n--\n\nA function defined on an Rpc and how the core "
                         "calls it: 'call', 'responder' or 'encoded' (moolib.Rpc._define).")},
      {0, nullptr}};
  static PyType_Spec spec = {"moolib._core.Handler", int(sizeof(HandlerObject)), 0,
                             Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC, slots};
  gHandlerType = addType(m, spec, "Handler");
}

}  // namespace moolib::binding
