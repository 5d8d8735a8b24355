// The binding of shared-memory regions (shm/shm_region.h) for the Python users of
// shared memory: the replay service's segments (moolib/replay/segments.py) and
// EnvPool's region (moolib/envpool.py, moolib/_envpool_worker.py).
#include "python/module.h"
#include "shm/shm_region.h"

namespace moolib::binding {

namespace {

// A failed system call raises the OSError subclass of its errno (so callers
// catch FileNotFoundError, PermissionError, ...); a refusal of moolib's own
// raises a plain OSError.
void translateShmError(std::exception_ptr p) {
  try {
    if (p) std::rethrow_exception(p);
  } catch (const ShmError& e) {
    if (e.error() == 0) {
      PyErr_SetString(PyExc_OSError, e.what());
      return;
    }
    PyObject* args = Py_BuildValue("(is)", e.error(), e.what());
    if (args) {
      PyErr_SetObject(PyExc_OSError, args);
      Py_DECREF(args);
    }
  }
}

ShmRegion::Access accessOf(bool writable) {
  return writable ? ShmRegion::Access::kReadWrite : ShmRegion::Access::kReadOnly;
}

}  // namespace

void bindShm(py::module_& m) {
  py::register_exception_translator(&translateShmError);

  py::class_<ShmRegion>(m, "ShmRegion", py::buffer_protocol(),
                        "Shared memory (a memfd) mapped into this process; see moolib/core/shm/"
                        "shm_region.h. Exposes its bytes through the buffer protocol: numpy and "
                        "torch view them with no copy, and every view keeps the mapping alive.")
      .def_static(
          "create",
          [](const std::string& name, size_t size, bool sealed) {
            return ShmRegion::create(name, size, sealed ? ShmRegion::kSealed : ShmRegion::kNone);
          },
          py::arg("name"), py::arg("size"), py::arg("sealed") = false,
          "A new memfd of size bytes named name (/proc shows '/memfd:<name>'), mapped "
          "read-write; it holds its fd (to pass to other processes) until close(). sealed: its "
          "size can never change, so whoever maps it cannot fault on pages taken away. Raises "
          "OSError naming the reason.")
      .def_static(
          "from_fd",
          [](int fd, size_t size, bool writable) {
            ShmRegion::MapOptions options;
            options.access = accessOf(writable);
            options.bytes = size;
            return ShmRegion::map(fd, options);
          },
          py::arg("fd"), py::arg("size") = 0, py::arg("writable") = true,
          "Maps size bytes (0: all) of the memfd fd, received from another process. The "
          "caller keeps fd (and closes it when it likes); the region holds only the mapping. "
          "Raises OSError naming the reason.")
      .def_static(
          "open_peer",
          [](uint32_t pid, int fd, const std::string& name, size_t size, bool writable) {
            return ShmRegion::openPeer(pid, fd, name, size, accessOf(writable));
          },
          py::arg("pid"), py::arg("fd"), py::arg("name"), py::arg("size"),
          py::arg("writable") = false,
          "Maps size bytes of the memfd that process pid holds as fd, through "
          "/proc/<pid>/fd/<fd>: only a memfd named name, of at least size bytes, sealed against "
          "shrinking (create(..., sealed=True)). Raises OSError "
          "naming the reason (FileNotFoundError: no such process or fd here, say on another "
          "host; PermissionError: another user's process).")
      .def_property_readonly("fd", &ShmRegion::fd,
                             "The memfd, or -1 when the region holds none (mapped from "
                             "another's fd, or closed).")
      .def_property_readonly("size", &ShmRegion::size)
      .def_property_readonly("writable", &ShmRegion::writable)
      .def("__len__", &ShmRegion::size)
      .def("close", &ShmRegion::closeFd,
           "Closes the fd. The memory stays mapped while this object or any view of it lives "
           "(and for other processes while they hold it).")
      .def("__repr__",
           [](const ShmRegion& r) {
             return concat("<moolib._core.ShmRegion of ", r.size(), " bytes, fd ", r.fd(),
                           r.writable() ? "" : ", read-only", ">");
           })
      .def_buffer([](ShmRegion& r) {
        return py::buffer_info(const_cast<uint8_t*>(r.at(0, r.size())), 1,
                               py::format_descriptor<uint8_t>::format(), 1, {py::ssize_t(r.size())},
                               {py::ssize_t(1)}, !r.writable());
      });
}

}  // namespace moolib::binding
