// The collectives' C++ files compiled as one unit (part of module _stepscope_kineto): the
// headers they share (torch's c10d, pybind11) take ~10 s each to parse, once here instead of
// once per file (21 s in all against 76 for the four apart, torch 2.14).
#define PY_SSIZE_T_CLEAN  // (before Python.h: collective_ops.cpp builds "s#" values)
#include "work_done.cpp"
#include "collective_ops.cpp"
#include "collective_hooks.cpp"
#include "c10d_kernels.cpp"
