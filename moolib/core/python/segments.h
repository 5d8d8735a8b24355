// Segments between Python and the core: Python memory the core sends (a
// buffer export, released from whichever thread the send ends on) and
// received memory as the Python object moolib._core.Buffer.
#pragma once

#include <pybind11/pybind11.h>

#include <string>
#include <vector>

#include "runtime/buffer.h"

namespace moolib::binding {

namespace py = pybind11;

// Takes a buffer export of a Python object; the view stays valid until the
// returned segment (and every copy of its keepalive) is gone. With writable,
// the object must allow writing through it.
OutSegment exportSegment(py::handle h, bool writable = false);

// data and then each of buffers, exported.
std::vector<OutSegment> exportSegments(py::handle data, const py::list& buffers);

// A received segment as a writable Python buffer.
struct PyBuffer {
  BufferPtr buffer;
};

// Each segment as a moolib._core.Buffer.
py::list wrapSegments(const std::vector<BufferPtr>& segs);

// A segment over bytes that outlive every send (a codec constant).
OutSegment constantSegment(const std::string& bytes);

// Whether the received segment holds exactly bytes.
bool segmentIs(const Buffer& b, const std::string& bytes);

// Binds moolib._core.Buffer.
void bindBuffer(py::module_& m);

}  // namespace moolib::binding
