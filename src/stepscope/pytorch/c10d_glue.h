// What work_done.cpp, collective_ops.cpp, collective_hooks.cpp and c10d_kernels.cpp share:
// torch's c10d objects read from Python through pybind11, the clock of their stamps, C++ errors
// turned into Python ones, and the list of finished ops that the C++ hooks and kernels fill.
#pragma once

#include <Python.h>
#include <pybind11/pybind11.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <time.h>

#include <cstdint>
#include <exception>
#include <string>

// torch's Python objects hold their C++ objects by intrusive_ptr (torch/csrc/utils/pybind.h)
PYBIND11_DECLARE_HOLDER_TYPE(T, c10::intrusive_ptr<T>, true);

namespace stepscope_c10d {

inline int64_t monotonic_ns() {  // the clock of Python's time.perf_counter_ns() on Linux
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

// Runs f() (which reads Python objects as torch's C++ ones); false with a Python error set:
// TypeError where an object is not what torch's bindings make, RuntimeError for the rest.
template <typename F>
bool from_python(F&& f) {
  try {
    f();
    return true;
  } catch (const pybind11::cast_error& e) {
    PyErr_SetString(PyExc_TypeError, e.what());
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  }
  return false;
}

// One collective op noted in C++ (collective_ops.cpp keeps them until take_ops()).
struct Op {
  int64_t t0 = 0, t1 = 0;  // issued, completed (CLOCK_MONOTONIC ns)
  int64_t name = 0;        // the op's code: a HookOpName (hooks) or the profiler's index (kernels)
  int64_t nbytes = 0;      // its input tensors' bytes
  int64_t owner = 0;       // the profiler's id of who noted it (a hooked group, the kernels)
  // where t1 is: 0 its completion; 1 it has no completion to wait for and ended when issued;
  // 2 it was enqueued on a device stream (NCCL), whose future completed when it was issued;
  // 3 it has no completion to wait for and ended when the program's wait() on its work
  // returned, later than its issue (its completion at the latest)
  int64_t ended = 0;
  bool on_device = false;  // its first input tensor is on a device (not the CPU)
  int64_t size = 0;        // its process group's size and name
  std::string group;
  c10::ScalarType dtype = c10::ScalarType::Undefined;  // its first input tensor's
};

void add_input(Op& op, const at::Tensor& t);  // (throws for a sparse tensor)
void finish(Op op);                           // it ended at op.t1
// it ends when the work's future completes (a C++ callback, on the backend's thread), or now
// with `ended` set where the work has no future (gloo's send/recv) or is a device stream's
void finish_at_completion(Op op, const c10::intrusive_ptr<c10d::Work>& work);

// A future of a device (its devices() set: CUDA's, NCCL's) that is complete right when its op
// is issued: the backend enqueued the op on a device stream and completed the future at once
// (ProcessGroupNCCL does); the op's time is its kernel's, not the future's. gloo's future,
// also on CUDA tensors, completes on gloo's thread when the op is done.
inline bool on_stream(const c10::ivalue::Future& fut) {
  return !fut.devices().empty() && fut.completed();
}

// `ended` of an op that returned no work: a device backend's synchronous op (NCCL's with
// async_op=False, on the caller's current stream) was enqueued there; any other `otherwise`.
inline int64_t ended_without_work(const Op& op, int64_t otherwise) {
  return op.on_device ? 2 : otherwise;
}

}  // namespace stepscope_c10d
