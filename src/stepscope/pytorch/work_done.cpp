// Collectives' completion times stamped in C++ (part of module _stepscope_kineto, built with
// kineto_reader.cpp by `stepscope build-torch`).
//
// Why: a Python done callback on a work's future runs on gloo's or NCCL's thread and must take
// the GIL, per op: a hand-over that costs tens of µs, and while the program's own Python holds
// the GIL, the op's completion (and gloo's marking the work complete, which waits for its
// callbacks) waits up to the switch interval. Here the callback is C++: it stamps the time and
// the op's slot into a list, GIL-free; the profiler takes the list at step ends.
//
//   watch(work, slot)  stamp the time `work` completes, under `slot` (TypeError: not a
//                      c10d Work this module can read; RuntimeError: the work has no future);
//                      True, and no stamp to come, where it is a device stream's op
//                      (c10d_glue.h's on_stream: its time is its kernel's)
//   drain()            the (slot, CLOCK_MONOTONIC ns) pairs stamped since the last drain, as
//                      int64 bytes
#include <Python.h>

#if __has_include(<torch/csrc/distributed/c10d/Work.hpp>)
#include <cstdint>
#include <mutex>
#include <vector>

#include "c10d_glue.h"

namespace {

using stepscope_c10d::monotonic_ns;

struct Stamps {
  std::mutex mu;
  std::vector<int64_t> pairs;  // slot, time, slot, time...
};
// Never freed: a callback may run on a backend's thread while the process exits.
Stamps* const g_stamps = new Stamps();

PyObject* watch(PyObject*, PyObject* args) {
  PyObject* obj;
  long long slot;
  if (!PyArg_ParseTuple(args, "OL", &obj, &slot)) return nullptr;
  c10::intrusive_ptr<c10::ivalue::Future> fut;
  if (!stepscope_c10d::from_python([&] {
        auto work = pybind11::handle(obj).cast<c10::intrusive_ptr<c10d::Work>>();
        fut = work->getFuture();  // gloo's send/recv: none (throws)
      })) {
    return nullptr;
  }
  if (stepscope_c10d::on_stream(*fut)) Py_RETURN_TRUE;
  // runs at once where the future has completed already; the GIL is not needed
  fut->addCallback([slot = static_cast<int64_t>(slot)](c10::ivalue::Future&) {
    const int64_t t = monotonic_ns();
    std::lock_guard<std::mutex> lock(g_stamps->mu);
    g_stamps->pairs.push_back(slot);
    g_stamps->pairs.push_back(t);
  });
  Py_RETURN_FALSE;
}

PyObject* drain(PyObject*, PyObject*) {
  std::vector<int64_t> pairs;
  {
    std::lock_guard<std::mutex> lock(g_stamps->mu);
    pairs.swap(g_stamps->pairs);
  }
  return PyBytes_FromStringAndSize(reinterpret_cast<const char*>(pairs.data()),
                                   static_cast<Py_ssize_t>(pairs.size() * sizeof(int64_t)));
}

}  // namespace

PyMethodDef work_done_methods[] = {
    {"watch", watch, METH_VARARGS, "Stamp the time a c10d Work completes, under a slot."},
    {"drain", drain, METH_NOARGS, "The (slot, ns) pairs stamped since the last drain."},
    {nullptr, nullptr, 0, nullptr}};

#else  // a torch built without torch.distributed: no such functions
PyMethodDef work_done_methods[] = {{nullptr, nullptr, 0, nullptr}};
#endif
