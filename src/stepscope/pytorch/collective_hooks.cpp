// Process groups' pre/post collective hooks in C++ (part of module _stepscope_kineto, built by
// `stepscope build-torch`; a torch with c10d/Hooks.hpp: 2.14 has it, 2.11 does not).
//
// Why: hooks registered from Python run Python for every op on the thread that issues it (for
// DDP, its reducer's: the GIL to take while the main thread runs), and a Python done callback
// on every work. Here the pre-hook notes the op, the post-hook puts a C++ callback on its work's
// future that notes the completion (work_done.cpp's way), and the profiler takes the finished
// ops at each flush: no Python and no GIL per op.
//
//   hook_group(pg, hook_id, group)  register both hooks on a ProcessGroup; `group`: the
//                                   profiler's id of that group (its size and name)
//   take_ops()                      the ops finished since the last call: a list of tuples
//                                   (start ns, end ns, HookOpName value, input bytes, dtype
//                                   name, group, ended when issued: 0/1)
//   in_flight()                     works whose completion callback has not run yet
#define PY_SSIZE_T_CLEAN  // take_ops() builds "s#" values
#include <Python.h>

#if __has_include(<torch/csrc/distributed/c10d/Hooks.hpp>)
#include <torch/csrc/distributed/c10d/Hooks.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <atomic>
#include <cctype>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "c10d_glue.h"

namespace {

using stepscope_c10d::monotonic_ns;

struct Op {
  int64_t t0 = 0, t1 = 0, name = 0, nbytes = 0, group = 0, issued = 0;
  c10::ScalarType dtype = c10::ScalarType::Undefined;
};

struct Ops {
  std::mutex mu;
  std::map<std::pair<int64_t, int64_t>, Op> open;  // (group, op id) -> pre-hook's part
  std::vector<Op> done;
};
// Never freed: a callback may run on a backend's thread while the process exits.
Ops* const g_ops = new Ops();
constexpr size_t kMaxOpen = 100000;  // pre-hooks without their post-hook (a failed issue)
std::atomic<int64_t> g_in_flight{0};  // callbacks added, not yet run

void finish(Op op) {
  std::lock_guard<std::mutex> lock(g_ops->mu);
  g_ops->done.push_back(std::move(op));
}

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

void post(int64_t g, const c10d::PostHookArgs& a) {
  Op op;
  {
    std::lock_guard<std::mutex> lock(g_ops->mu);
    auto it = g_ops->open.find({g, a.op_id});
    if (it == g_ops->open.end()) return;
    op = it->second;
    g_ops->open.erase(it);
  }
  c10::intrusive_ptr<c10::ivalue::Future> fut;
  if (a.work) {
    try {
      fut = a.work->getFuture();
    } catch (const std::exception&) {  // gloo's send/recv: no future
    }
  }
  if (!fut) {  // no work (a synchronous op) or no future: it ended when issued
    op.t1 = monotonic_ns();
    op.issued = 1;
    finish(std::move(op));
    return;
  }
  g_in_flight++;
  fut->addCallback([op](c10::ivalue::Future&) mutable {
    op.t1 = monotonic_ns();
    finish(std::move(op));
    g_in_flight--;
  });
}

PyObject* hook_group(PyObject*, PyObject* args) {
  PyObject* obj;
  long long hook_id, group;
  if (!PyArg_ParseTuple(args, "OLL", &obj, &hook_id, &group)) return nullptr;
  const bool ok = stepscope_c10d::from_python([&] {
    auto pg = pybind11::handle(obj).cast<c10::intrusive_ptr<c10d::ProcessGroup>>();
    const int64_t g = group;
    // nothing may throw into the collective: an op the hooks cannot note is left out
    pg->registerPreHook(hook_id, [g](const c10d::PreHookArgs& a) noexcept {
      try {
        Op op;
        op.t0 = monotonic_ns();
        op.name = static_cast<int64_t>(a.name);
        op.group = g;
        for (const auto& t : a.input_tensors) {
          if (!t.defined()) continue;
          op.nbytes += static_cast<int64_t>(t.nbytes());  // (throws for a sparse tensor)
          if (op.dtype == c10::ScalarType::Undefined) op.dtype = t.scalar_type();
        }
        std::lock_guard<std::mutex> lock(g_ops->mu);
        if (g_ops->open.size() >= kMaxOpen) g_ops->open.clear();
        g_ops->open[{g, a.op_id}] = op;
      } catch (...) {
      }
    });
    pg->registerPostHook(hook_id, [g](const c10d::PostHookArgs& a) noexcept {
      try {
        post(g, a);
      } catch (...) {
      }
    });
  });
  if (!ok) return nullptr;
  Py_RETURN_NONE;
}

PyObject* in_flight(PyObject*, PyObject*) { return PyLong_FromLongLong(g_in_flight.load()); }

PyObject* take_ops(PyObject*, PyObject*) {
  std::vector<Op> done;
  {
    std::lock_guard<std::mutex> lock(g_ops->mu);
    done.swap(g_ops->done);
  }
  PyObject* out = PyList_New(static_cast<Py_ssize_t>(done.size()));
  if (out == nullptr) return nullptr;
  for (size_t i = 0; i < done.size(); i++) {
    const Op& op = done[i];
    const std::string dt = dtype_name(op.dtype);
    PyObject* item = Py_BuildValue("(LLLLs#LL)", static_cast<long long>(op.t0),
                                   static_cast<long long>(op.t1),
                                   static_cast<long long>(op.name),
                                   static_cast<long long>(op.nbytes), dt.data(),
                                   static_cast<Py_ssize_t>(dt.size()),
                                   static_cast<long long>(op.group),
                                   static_cast<long long>(op.issued));
    if (item == nullptr) {
      Py_DECREF(out);
      return nullptr;
    }
    PyList_SET_ITEM(out, static_cast<Py_ssize_t>(i), item);
  }
  return out;
}

}  // namespace

PyMethodDef collective_hooks_methods[] = {
    {"hook_group", hook_group, METH_VARARGS,
     "Register C++ pre/post collective hooks on a ProcessGroup."},
    {"take_ops", take_ops, METH_NOARGS, "The ops finished since the last call."},
    {"in_flight", in_flight, METH_NOARGS, "Works whose completion callback has not run yet."},
    {nullptr, nullptr, 0, nullptr}};

#else  // a torch without process-group hooks (2.11 and older): no such functions
PyMethodDef collective_hooks_methods[] = {{nullptr, nullptr, 0, nullptr}};
#endif
