// The binding of the replay table; moolib/replay/table.py adds the Python API
// (nests, dtypes and shapes, errors that name leaves, timeouts).
#include <pybind11/stl.h>

#include "python/gil.h"
#include "python/segments.h"
#include "replay/table.h"
#include "runtime/error.h"

namespace moolib::binding {

using namespace pybind11::literals;

namespace {

ReplaySelector selectorFromName(const std::string& name) {
  if (name == "uniform") return ReplaySelector::kUniform;
  if (name == "prioritized") return ReplaySelector::kPrioritized;
  if (name == "fifo") return ReplaySelector::kFifo;
  throw std::invalid_argument("unknown replay selector '" + name +
                              "': expected 'uniform', 'prioritized' or 'fifo'");
}

const char* selectorToName(ReplaySelector s) {
  switch (s) {
    case ReplaySelector::kUniform:
      return "uniform";
    case ReplaySelector::kPrioritized:
      return "prioritized";
    case ReplaySelector::kFifo:
      return "fifo";
  }
  return "?";
}

// Buffers of caller memory, held (with their Python exports) while the core
// works on them without the GIL.
struct Spans {
  std::vector<OutSegment> held;
  std::vector<ReplaySpan> spans;
  ReplaySpan add(py::handle h, bool writable) {
    held.push_back(exportSegment(h, writable));
    ReplaySpan s{const_cast<uint8_t*>(held.back().data), held.back().size};
    spans.push_back(s);
    return s;
  }
};

py::dict configDict(const ReplayConfig& c) {
  return py::dict("capacity"_a = c.capacity, "selector"_a = selectorToName(c.selector),
                  "alpha"_a = c.alpha, "min_size"_a = c.minSize,
                  "samples_per_insert"_a = c.samplesPerInsert, "error_buffer"_a = c.errorBuffer);
}

}  // namespace

void bindReplay(py::module_& m) {
  py::class_<Replay, std::shared_ptr<Replay>>(m, "Replay",
                                              "The native replay table; see moolib.Replay.")
      .def(py::init([](int64_t capacity, const std::string& selector, double alpha, int64_t minSize,
                       double samplesPerInsert, double errorBuffer, uint64_t seed) {
             ReplayConfig c;
             c.capacity = capacity;
             c.selector = selectorFromName(selector);
             c.alpha = alpha;
             c.minSize = minSize;
             c.samplesPerInsert = samplesPerInsert;
             c.errorBuffer = errorBuffer;
             return std::make_shared<Replay>(c, seed);
           }),
           py::arg("capacity"), py::arg("selector"), py::arg("alpha"), py::arg("min_size"),
           py::arg("samples_per_insert"), py::arg("error_buffer"), py::arg("seed"))
      .def(
          "set_schema",
          [](Replay& r, const std::vector<int64_t>& itemBytes, const std::vector<int64_t>& frames,
             const std::string& meta) {
            MOO_ENFORCE(itemBytes.size() == frames.size(), "set_schema: length mismatch");
            std::vector<ReplayLeaf> leaves(itemBytes.size());
            for (size_t i = 0; i < leaves.size(); ++i) leaves[i] = {itemBytes[i], frames[i]};
            r.setSchema(leaves, meta);
          },
          py::arg("item_bytes"), py::arg("frames"), py::arg("meta"),
          "Fixes the byte size of each leaf of an item (frames > 0: a dedup leaf of that many "
          "frames).")
      .def("has_schema", &Replay::hasSchema)
      .def("set_meta", [](Replay& r, py::bytes meta) { r.setMeta(std::string(meta)); })
      .def("meta", [](const Replay& r) { return py::bytes(r.meta()); })
      .def(
          "insert",
          [](Replay& r, py::list leaves, py::object priorities, py::object keysOut, double wait) {
            Spans in;
            for (auto l : leaves) in.add(l, false);
            Spans out;
            ReplaySpan keys = out.add(keysOut, true);
            int64_t n = int64_t(keys.size / sizeof(int64_t));
            const double* prio = nullptr;
            if (!priorities.is_none()) {
              ReplaySpan p = out.add(priorities, false);
              MOO_ENFORCE(p.size == size_t(n) * sizeof(double),
                          "replay insert: priorities do not match the batch");
              prio = reinterpret_cast<const double*>(p.data);
            }
            ReplayProgress progress;
            {
              GilRelease nogil;
              progress = r.insert(n, in.spans, prio, reinterpret_cast<int64_t*>(keys.data), wait);
            }
            return py::make_tuple(progress.done, progress.waited, progress.size);
          },
          py::arg("leaves"), py::arg("priorities"), py::arg("keys_out"), py::arg("wait"),
          "Inserts len(keys_out) items; returns (inserted, why it stopped early or '', size).")
      .def(
          "sample",
          [](Replay& r, int64_t n, py::list outs, py::object keysOut, py::object probsOut,
             double wait) {
            Spans o;
            for (auto l : outs) o.add(l, true);
            Spans kp;
            ReplaySpan keys = kp.add(keysOut, true);
            ReplaySpan probs = kp.add(probsOut, true);
            MOO_ENFORCE(keys.size == size_t(n) * 8 && probs.size == size_t(n) * 8,
                        "replay sample: key and probability outputs do not match the batch");
            ReplayProgress progress;
            {
              GilRelease nogil;
              progress = r.sample(n, o.spans, reinterpret_cast<int64_t*>(keys.data),
                                  reinterpret_cast<double*>(probs.data), wait);
            }
            return py::make_tuple(progress.done, progress.waited, progress.size,
                                  progress.needOutputs);
          },
          py::arg("n"), py::arg("outs"), py::arg("keys_out"), py::arg("probs_out"), py::arg("wait"),
          "Samples n items into outs; returns (sampled, why it stopped early or '', size, "
          "needs outputs).")
      .def(
          "update_priorities",
          [](Replay& r, py::object keys, py::object priorities) {
            Spans in;
            ReplaySpan k = in.add(keys, false);
            ReplaySpan p = in.add(priorities, false);
            MOO_ENFORCE(k.size % 8 == 0 && k.size == p.size,
                        "replay update_priorities: keys and priorities differ in length");
            GilRelease nogil;
            return r.updatePriorities(int64_t(k.size / 8), reinterpret_cast<const int64_t*>(k.data),
                                      reinterpret_cast<const double*>(p.data));
          },
          py::arg("keys"), py::arg("priorities"))
      .def("reconfigure", &Replay::reconfigure, py::arg("alpha"), py::arg("min_size"),
           py::arg("samples_per_insert"), py::arg("error_buffer"))
      .def("reseed", &Replay::reseed, py::arg("seed"))
      .def("config", [](const Replay& r) { return configDict(r.config()); })
      .def(
          "layout",
          [](const Replay& r) {
            std::vector<std::pair<int64_t, int64_t>> out;
            for (auto& l : r.layout()) out.emplace_back(l.itemBytes, l.frames);
            return out;
          },
          "[(item bytes, frames)] per leaf; empty before the first insert.")
      .def("size", &Replay::size)
      .def("priority_mass", &Replay::priorityMass)
      .def("info",
           [](const Replay& r) {
             ReplayInfo i = r.info();
             return py::dict("size"_a = i.size, "capacity"_a = i.capacity, "inserts"_a = i.inserts,
                             "samples"_a = i.samples, "evictions"_a = i.evictions,
                             "priority_mass"_a = i.priorityMass, "stored_bytes"_a = i.storedBytes,
                             "frames"_a = i.frames, "frame_bytes"_a = i.frameBytes,
                             "waiting_inserters"_a = i.waitingInserters,
                             "waiting_samplers"_a = i.waitingSamplers,
                             "incarnation"_a = i.incarnation);
           })
      .def("close", &Replay::close, py::call_guard<GilRelease>(),
           "Fails every waiting and later call.")
      .def("save", &Replay::save, py::arg("path"), py::call_guard<GilRelease>())
      .def_static(
          "load",
          [](const std::string& path) {
            std::unique_ptr<Replay> r;
            {
              GilRelease nogil;
              r = Replay::load(path);
            }
            return std::shared_ptr<Replay>(std::move(r));
          },
          py::arg("path"));
}

}  // namespace moolib::binding
