// The collective ops that the C++ hooks (collective_hooks.cpp) and kernels (c10d_kernels.cpp)
// note, kept here until the profiler takes them (part of module _stepscope_kineto).
//
//   take_ops()   the ops finished since the last call: a list of tuples (start ns, end ns, op
//                code, input bytes, dtype name, owner, where the end is (Op::ended), group
//                size, group name)
//   in_flight()  works whose completion callback has not run yet
#define PY_SSIZE_T_CLEAN  // take_ops() builds "s#" values
#include <Python.h>

#if __has_include(<torch/csrc/distributed/c10d/Work.hpp>)
#include <atomic>
#include <cctype>
#include <mutex>
#include <utility>
#include <vector>

#include "c10d_glue.h"

namespace stepscope_c10d {

namespace {

struct Done {
  std::mutex mu;
  std::vector<Op> ops;
};
// Never freed: a callback may run on a backend's thread while the process exits.
Done* const g_done = new Done();
std::atomic<int64_t> g_in_flight{0};  // callbacks added, not yet run

std::string dtype_name(c10::ScalarType t) {  // as Python's str(torch.<dtype>) names it
  switch (t) {
    case c10::ScalarType::Byte: return "uint8";
    case c10::ScalarType::Char: return "int8";
    case c10::ScalarType::Short: return "int16";
    case c10::ScalarType::Int: return "int32";
    case c10::ScalarType::Long: return "int64";
    case c10::ScalarType::Half: return "float16";
    case c10::ScalarType::Float: return "float32";
    case c10::ScalarType::Double: return "float64";
    case c10::ScalarType::ComplexHalf: return "complex32";
    case c10::ScalarType::ComplexFloat: return "complex64";
    case c10::ScalarType::ComplexDouble: return "complex128";
    case c10::ScalarType::Bool: return "bool";
    case c10::ScalarType::BFloat16: return "bfloat16";
    case c10::ScalarType::Undefined: return "";
    default: {  // Float8_e4m3fn -> float8_e4m3fn, as torch names it
      std::string s = c10::toString(t);
      for (auto& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
      return s;
    }
  }
}

}  // namespace

void add_input(Op& op, const at::Tensor& t) {
  if (!t.defined()) return;
  op.nbytes += static_cast<int64_t>(t.nbytes());
  if (op.dtype == c10::ScalarType::Undefined) {
    op.dtype = t.scalar_type();
    op.on_device = !t.is_cpu();
  }
}

void finish(Op op) {
  std::lock_guard<std::mutex> lock(g_done->mu);
  g_done->ops.push_back(std::move(op));
}

void finish_at_completion(Op op, const c10::intrusive_ptr<c10d::Work>& work) {
  c10::intrusive_ptr<c10::ivalue::Future> fut;
  try {
    fut = work->getFuture();
  } catch (const std::exception&) {  // gloo's send/recv: no future
  }
  if (!fut || on_stream(*fut)) {
    op.t1 = monotonic_ns();
    op.ended = fut ? 2 : 1;
    finish(std::move(op));
    return;
  }
  g_in_flight++;
  // runs at once where the future has completed already; the GIL is not needed
  fut->addCallback([op = std::move(op)](c10::ivalue::Future&) mutable {
    op.t1 = monotonic_ns();
    finish(std::move(op));
    g_in_flight--;
  });
}

namespace {

PyObject* in_flight(PyObject*, PyObject*) { return PyLong_FromLongLong(g_in_flight.load()); }

PyObject* take_ops(PyObject*, PyObject*) {
  std::vector<Op> done;
  {
    std::lock_guard<std::mutex> lock(g_done->mu);
    done.swap(g_done->ops);
  }
  PyObject* out = PyList_New(static_cast<Py_ssize_t>(done.size()));
  if (out == nullptr) return nullptr;
  for (size_t i = 0; i < done.size(); i++) {
    const Op& op = done[i];
    const std::string dt = dtype_name(op.dtype);
    PyObject* item = Py_BuildValue(
        "(LLLLs#LLLs#)", static_cast<long long>(op.t0), static_cast<long long>(op.t1),
        static_cast<long long>(op.name), static_cast<long long>(op.nbytes), dt.data(),
        static_cast<Py_ssize_t>(dt.size()), static_cast<long long>(op.owner),
        static_cast<long long>(op.ended), static_cast<long long>(op.size), op.group.data(),
        static_cast<Py_ssize_t>(op.group.size()));
    if (item == nullptr) {
      Py_DECREF(out);
      return nullptr;
    }
    PyList_SET_ITEM(out, static_cast<Py_ssize_t>(i), item);
  }
  return out;
}

}  // namespace

}  // namespace stepscope_c10d

PyMethodDef collective_ops_methods[] = {
    {"take_ops", stepscope_c10d::take_ops, METH_NOARGS,
     "The ops the C++ hooks and kernels saw finish since the last call."},
    {"in_flight", stepscope_c10d::in_flight, METH_NOARGS,
     "Works whose completion callback has not run yet."},
    {nullptr, nullptr, 0, nullptr}};

#else  // a torch built without torch.distributed: no such functions
PyMethodDef collective_ops_methods[] = {{nullptr, nullptr, 0, nullptr}};
#endif
