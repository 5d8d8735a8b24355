#include "python/segments.h"

#include <cstring>
#include <memory>

#include "python/gil.h"

namespace moolib::binding {

OutSegment exportSegment(py::handle h, bool writable) {
  auto view = std::make_unique<Py_buffer>();
  int flags = PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
  if (PyObject_GetBuffer(h.ptr(), view.get(), flags) != 0) throw py::error_already_set();
  OutSegment s;
  s.data = static_cast<const uint8_t*>(view->buf);
  s.size = size_t(view->len);
  Py_buffer* raw = view.release();
  s.keepalive = std::shared_ptr<const void>(raw, [](const void* p) {
    releaseFromAnyThread(const_cast<Py_buffer*>(static_cast<const Py_buffer*>(p)), nullptr);
  });
  return s;
}

std::vector<OutSegment> exportSegments(py::handle data, const py::list& buffers) {
  std::vector<OutSegment> segs;
  segs.reserve(1 + buffers.size());
  segs.push_back(exportSegment(data));
  for (auto b : buffers) segs.push_back(exportSegment(b));
  return segs;
}

py::list wrapSegments(const std::vector<BufferPtr>& segs) {
  py::list out(segs.size());
  for (size_t i = 0; i != segs.size(); ++i) out[i] = py::cast(PyBuffer{segs[i]});
  return out;
}

OutSegment constantSegment(const std::string& bytes) {
  OutSegment s;
  s.data = reinterpret_cast<const uint8_t*>(bytes.data());
  s.size = bytes.size();
  return s;
}

bool segmentIs(const Buffer& b, const std::string& bytes) {
  return b.size() == bytes.size() && std::memcmp(b.data(), bytes.data(), bytes.size()) == 0;
}

void bindBuffer(py::module_& m) {
  py::class_<PyBuffer>(m, "Buffer", py::buffer_protocol())
      .def_buffer([](PyBuffer& b) {
        return py::buffer_info(b.buffer->data(), 1, py::format_descriptor<uint8_t>::format(), 1,
                               {py::ssize_t(b.buffer->size())}, {py::ssize_t(1)}, false);
      })
      .def("__len__", [](const PyBuffer& b) { return b.buffer->size(); });
}

}  // namespace moolib::binding
