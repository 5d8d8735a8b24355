#include "python/dispatch.h"

#include "python/codec.h"
#include "python/gil.h"
#include "python/segments.h"

namespace moolib::binding {

namespace {

// Runs a function defined with Rpc.define (a moolib.rpc._Plain) on a call's
// arguments and answers it, as moolib.rpc._serve does, without its Python
// frames and without a Python Responder and segment objects per call.
void servePlain(py::handle plain, Responder& responder, std::vector<BufferPtr>& args) {
  FastCodec& fc = fastCodec();
  std::vector<OutSegment> reply;
  py::object result;
  try {
    py::object fn = plain.attr("fn");
    py::object callArgs, callKwargs;
    if (args.size() == 1 && segmentIs(*args[0], fc.emptyCall)) {
      callArgs = py::tuple();
    } else {
      py::object decoded = decodeSegments(args);
      py::tuple pair = py::reinterpret_steal<py::tuple>(PySequence_Tuple(decoded.ptr()));
      if (!pair) throw py::error_already_set();
      if (pair.size() != 2) {
        PyErr_Format(PyExc_ValueError, "expected (args, kwargs), got %zd values",
                     Py_ssize_t(pair.size()));
        throw py::error_already_set();
      }
      callArgs = py::reinterpret_steal<py::object>(PySequence_Tuple(pair[0].ptr()));
      if (!callArgs) throw py::error_already_set();
      if (PyDict_CheckExact(pair[1].ptr())) {
        if (PyDict_GET_SIZE(pair[1].ptr()) != 0) callKwargs = pair[1];
      } else {
        callKwargs = py::dict();
        if (PyDict_Update(callKwargs.ptr(), pair[1].ptr()) != 0) throw py::error_already_set();
      }
    }
    // The reply goes out after the arguments are released, so shared-memory
    // segments are free for reuse by the time the caller's next call needs one.
    args.clear();
    result = py::reinterpret_steal<py::object>(
        callParkingOnExit(fn.ptr(), callArgs.ptr(), callKwargs ? callKwargs.ptr() : nullptr));
    if (!result) throw py::error_already_set();
    callArgs = py::object();
    callKwargs = py::object();
    reply = encodeValue(result);
  } catch (py::error_already_set& e) {
    responder.error(describeError(e));
    return;
  }
  responder.reply(std::move(reply));
}

}  // namespace

void callHandler(py::handle handler, const std::shared_ptr<Responder>& responder,
                 std::vector<BufferPtr>& args) {
  try {
    py::object reply;
    {
      py::object r = py::cast(responder);
      py::list segments = wrapSegments(args);
      args.clear();
      reply = callFromCore(handler.ptr(), {r, segments});
    }
    if (!reply) throw py::error_already_set();
    if (!reply.is_none()) {
      auto tuple = reply.cast<py::tuple>();
      auto segs = exportSegments(tuple[0], tuple[1].cast<py::list>());
      responder->reply(std::move(segs));
    }
  } catch (py::error_already_set& e) {
    responder->error(e.what());
  } catch (const std::exception& e) {
    responder->error(e.what());
  }
}

Rpc::Handler pythonDispatcher(py::handle ownerRef, const std::string& name) {
  if (!PyWeakref_CheckRef(ownerRef.ptr())) throw py::type_error("expected a weak reference");
  auto ref = holdObject(ownerRef);
  auto key = holdObject(py::str(name));
  return [ref, key, name](std::shared_ptr<Responder> responder, std::vector<BufferPtr> args) {
    withPython([&] {
      try {
        py::object handler;
        {
          py::handle owner = PyWeakref_GetObject(ref.get());  // borrowed; None once dead
          if (!owner.is_none()) {
            py::object handlers = owner.attr(fastCodec().handlersName);
            PyObject* h = PyDict_GetItemWithError(handlers.ptr(), key.get());
            if (!h && PyErr_Occurred()) throw py::error_already_set();
            handler = py::reinterpret_borrow<py::object>(h);
          }
        }  // a call in progress does not keep the Rpc alive
        if (!handler) {
          responder->error(concat("function '", name, "' is gone: its Rpc was deleted"));
          return;
        }
        if (Py_TYPE(handler.ptr()) ==
            reinterpret_cast<PyTypeObject*>(fastCodec().plainType.ptr())) {
          servePlain(handler, *responder, args);
        } else {
          callHandler(handler, responder, args);
        }
      } catch (py::error_already_set& e) {
        responder->error(e.what());
      }
    });
  };
}

}  // namespace moolib::binding
