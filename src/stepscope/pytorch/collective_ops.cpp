// The collective ops that the C++ hooks (collective_hooks.cpp) and kernels (c10d_kernels.cpp)
// note, kept here until the profiler takes them (part of module _stepscope_kineto).
//
//   take_ops(all=False)  the ops finished since the last call: a list of tuples (start ns,
//                end ns, op code, input bytes, dtype name, owner, where the end is (Op::ended),
//                group size, group name); with them the parked ops (below) issued before the
//                last call, or all of them with `all`, ended when issued
//   in_flight()  works whose completion callback has not run yet
//   waited(work, at_once)  the program's wait() on `work` returned (Python's Work.wait,
//                wrapped): an op of `work` that has no future (gloo's reduce_scatter_tensor,
//                send, recv) ends now, at its completion where the wait came `at_once` from
//                the op's own call (`ended` 0), else at its completion's latest (3); False
//                where none was parked under it
#define PY_SSIZE_T_CLEAN  // take_ops() builds "s#" values
#include <Python.h>

#if __has_include(<torch/csrc/distributed/c10d/Work.hpp>)
#include <atomic>
#include <cctype>
#include <mutex>
#include <unordered_map>
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

// Ops whose work has no future (gloo's send/recv, and its reduce_scatter_tensor: a work whose
// wait() waits for an inner all-reduce, then copies the result out), parked until the
// program's wait() on the work returns (waited()), by the work's address. No reference is held
// (a weak one would keep the work's tensors until it is dropped): the address of a work freed
// unwaited can be another's later, so an op is matched to the latest op parked under it (a
// live work's address is its own), and one parked before a newer one of its address, or
// before the last take_ops(), ended when issued (its fallback t1, `ended` 1).
struct Parked {
  std::mutex mu;
  std::unordered_map<const void*, Op> ops;
  int64_t last_take = 0;  // when take_ops() last ran (an op parked before it is stale)
};
Parked* const g_parked = new Parked();
std::atomic<int64_t> g_n_parked{0};
constexpr size_t kMaxParked = 100000;

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
    if (!fut) {  // ends at the program's wait(), if it comes from Python (waited())
      std::lock_guard<std::mutex> lock(g_parked->mu);
      auto it = g_parked->ops.find(work.get());
      if (it != g_parked->ops.end()) {  // an earlier work at this address: freed unwaited
        finish(std::move(it->second));
        it->second = std::move(op);
      } else if (g_parked->ops.size() < kMaxParked) {
        g_parked->ops.emplace(work.get(), std::move(op));
      } else {
        finish(std::move(op));
      }
      g_n_parked = static_cast<int64_t>(g_parked->ops.size());
      return;
    }
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

PyObject* waited(PyObject*, PyObject* args) {
  if (g_n_parked.load(std::memory_order_relaxed) == 0) Py_RETURN_FALSE;  // (no cast: cheap)
  const int64_t t = monotonic_ns();
  PyObject* obj = nullptr;
  int at_once = 0;
  if (!PyArg_ParseTuple(args, "Op", &obj, &at_once)) return nullptr;
  const void* key = nullptr;
  if (!from_python([&] {
        key = pybind11::handle(obj).cast<c10::intrusive_ptr<c10d::Work>>().get();
      })) {
    PyErr_Clear();  // not a Work of ours to read: nothing parked under it
    Py_RETURN_FALSE;
  }
  std::lock_guard<std::mutex> lock(g_parked->mu);
  auto it = g_parked->ops.find(key);
  if (it == g_parked->ops.end()) Py_RETURN_FALSE;
  Op op = std::move(it->second);
  g_parked->ops.erase(it);
  g_n_parked = static_cast<int64_t>(g_parked->ops.size());
  op.t1 = t;
  op.ended = at_once ? 0 : 3;
  finish(std::move(op));
  Py_RETURN_TRUE;
}

// take_ops(all=False): parked ops from before the last call (or all) end when issued
PyObject* take_ops(PyObject*, PyObject* args) {
  int all = 0;
  if (!PyArg_ParseTuple(args, "|p", &all)) return nullptr;
  {
    std::lock_guard<std::mutex> lock(g_parked->mu);
    const int64_t since = g_parked->last_take;
    for (auto it = g_parked->ops.begin(); it != g_parked->ops.end();) {
      if (all || it->second.t0 < since) {
        finish(std::move(it->second));
        it = g_parked->ops.erase(it);
      } else {
        ++it;
      }
    }
    g_parked->last_take = monotonic_ns();
    g_n_parked = static_cast<int64_t>(g_parked->ops.size());
  }
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
    {"take_ops", stepscope_c10d::take_ops, METH_VARARGS,
     "The ops the C++ hooks and kernels saw finish since the last call."},
    {"waited", stepscope_c10d::waited, METH_VARARGS,
     "The program's wait() on a work returned: its op without a future ends now."},
    {"in_flight", stepscope_c10d::in_flight, METH_NOARGS,
     "Works whose completion callback has not run yet."},
    {nullptr, nullptr, 0, nullptr}};

#else  // a torch built without torch.distributed: no such functions
PyMethodDef collective_ops_methods[] = {{nullptr, nullptr, 0, nullptr}};
#endif
