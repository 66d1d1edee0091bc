// What work_done.cpp and collective_hooks.cpp share: torch's c10d objects read from Python
// through pybind11, the clock of their stamps, and C++ errors turned into Python ones.
#pragma once

#include <Python.h>
#include <pybind11/pybind11.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <time.h>

#include <cstdint>
#include <exception>

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

}  // namespace stepscope_c10d
