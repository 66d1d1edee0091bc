// stepscope's native reader of torch's profiler events (module _stepscope_kineto).
//
// Compiled against the installed torch by `stepscope build-torch` (stepscope/pytorch/native.py),
// never at import: the Python reader (stepscope/pytorch/events.py) gives the same columns.
// Why: read through torch's Python API, each event costs a pybind object and seven accessor
// calls (~4 us); here the whole window is read in C++ into a few columns, and the result's
// free (longer than torch.profiler's whole JSON export) runs on a native thread, GIL released.
//
//   take()     stop torch's profiler (torch.autograd._disable_profiler) and hold its result
//   columns()  the held result's events as columns (what each holds: above columns())
//   release()  free the held result on a native thread (joined by the next take() or join())
//   join()     wait for that free (at exit: a free must not outlive the interpreter)
//
// The module also holds work_done.cpp's watch() and drain() (collectives' completion times
// stamped in C++) and collective_hooks.cpp's hook_group() and take_ops() (process groups'
// hooks in C++), for stepscope/pytorch/collectives.py.
#include <Python.h>

#include <torch/csrc/autograd/profiler_kineto.h>

#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

namespace prof = torch::autograd::profiler;

static std::unique_ptr<prof::ProfilerResult> g_result;
// The free of the last result; a pointer, never destroyed at exit (a joinable std::thread
// destroyed there would terminate the process). A child forked meanwhile (DataLoader workers)
// has no such thread: glibc marks the parent's other threads dead there, so join() returns.
static std::thread* g_freeing = nullptr;

static void join_freeing() {
  if (g_freeing == nullptr) return;
  Py_BEGIN_ALLOW_THREADS
  g_freeing->join();
  Py_END_ALLOW_THREADS
  delete g_freeing;
  g_freeing = nullptr;
}

static PyObject* take(PyObject*, PyObject*) {
  join_freeing();
  try {
    g_result = prof::disableProfiler();
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
  return PyLong_FromSize_t(g_result ? g_result->events().size() : 0);
}

template <typename T>
static PyObject* as_bytes(const std::vector<T>& v) {
  return PyBytes_FromStringAndSize(reinterpret_cast<const char*>(v.data()),
                                   static_cast<Py_ssize_t>(v.size() * sizeof(T)));
}

static PyObject* str_list(const std::vector<std::string>& v) {
  PyObject* out = PyList_New(static_cast<Py_ssize_t>(v.size()));
  if (out == nullptr) return nullptr;
  for (size_t i = 0; i < v.size(); i++) {
    PyObject* s = PyUnicode_DecodeUTF8(v[i].data(), static_cast<Py_ssize_t>(v[i].size()),
                                       "replace");
    if (s == nullptr) {
      Py_DECREF(out);
      return nullptr;
    }
    PyList_SET_ITEM(out, static_cast<Py_ssize_t>(i), s);
  }
  return out;
}

// Python's str() of a list of int lists: "[[64, 256], [256], []]"
static void format_shapes(std::string& out, c10::ArrayRef<std::vector<int64_t>> shapes) {
  out.push_back('[');
  for (size_t i = 0; i < shapes.size(); i++) {
    if (i) out.append(", ");
    out.push_back('[');
    for (size_t j = 0; j < shapes[i].size(); j++) {
      if (j) out.append(", ");
      out.append(std::to_string(shapes[i][j]));
    }
    out.push_back(']');
  }
  out.push_back(']');
}

// (names, shapes, dtypes, name index i32, input index i32 (-1: no typed inputs), start ns,
//  duration ns, device resource id (system thread id), start thread id, sequence nr,
//  forward thread id: i64 each), the arrays as bytes; names and inputs each listed once
static PyObject* columns(PyObject*, PyObject*) {
  if (!g_result) {
    PyErr_SetString(PyExc_RuntimeError, "no profiler result held (take() first)");
    return nullptr;
  }
  const auto& events = g_result->events();
  const size_t n = events.size();
  std::vector<int32_t> name_idx(n), input_idx(n);
  std::vector<int64_t> start(n), dur(n), tid(n), stid(n), seq(n), fwd(n);
  std::vector<std::string> names, shapes, dtypes;
  std::unordered_map<std::string, int32_t> name_of, input_of;
  std::string key;
  size_t i = 0;  // events kept so far
  try {
    for (const auto& e : events) {
      // CPU events only: device records reach Kineto only when its CUPTI callbacks were the
      // registered ones (stepscope's tracer registers its own after Kineto starts)
      if (e.deviceType() != c10::DeviceType::CPU) continue;
      auto it = name_of.find(e.name());
      if (it == name_of.end()) {
        it = name_of.emplace(e.name(), static_cast<int32_t>(names.size())).first;
        names.push_back(it->first);
      }
      name_idx[i] = it->second;
      start[i] = static_cast<int64_t>(e.startNs());
      dur[i] = static_cast<int64_t>(e.durationNs());
      tid[i] = e.deviceResourceId();
      seq[i] = e.sequenceNr();
      // thread ids matter only where there is a sequence number (flows); 0 elsewhere, as the
      // Python reader leaves them
      stid[i] = seq[i] >= 0 ? static_cast<int64_t>(e.startThreadId()) : 0;
      fwd[i] = seq[i] >= 0 ? static_cast<int64_t>(e.fwdThreadId()) : 0;
      input_idx[i] = -1;
      auto dt = e.dtypes();
      bool typed = false;
      for (const auto& d : dt) typed = typed || !d.empty();
      if (!typed) {
        i++;
        continue;
      }
      // the inputs' identity in raw bytes (dims, then dtypes); formatted once per distinct key
      auto sh = e.shapes();
      key.clear();
      for (const auto& dims : sh) {
        const int64_t k = static_cast<int64_t>(dims.size());
        key.append(reinterpret_cast<const char*>(&k), sizeof k);
        key.append(reinterpret_cast<const char*>(dims.data()), dims.size() * sizeof(int64_t));
      }
      for (const auto& d : dt) {
        key.push_back('\0');
        key.append(d);
      }
      auto in = input_of.find(key);
      if (in == input_of.end()) {
        in = input_of.emplace(key, static_cast<int32_t>(shapes.size())).first;
        std::string text;
        format_shapes(text, sh);
        shapes.push_back(std::move(text));
        text.clear();
        for (size_t j = 0; j < dt.size(); j++) {
          if (j) text.append(", ");
          text.append(dt[j]);
        }
        dtypes.push_back(std::move(text));
      }
      input_idx[i++] = in->second;
    }
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
  for (auto* v : {&name_idx, &input_idx}) v->resize(i);
  for (auto* v : {&start, &dur, &tid, &stid, &seq, &fwd}) v->resize(i);
  PyObject* parts[11] = {str_list(names), str_list(shapes), str_list(dtypes),
                         as_bytes(name_idx), as_bytes(input_idx), as_bytes(start),
                         as_bytes(dur), as_bytes(tid), as_bytes(stid), as_bytes(seq),
                         as_bytes(fwd)};
  PyObject* out = PyTuple_New(11);
  for (int i = 0; i < 11; i++) {
    if (parts[i] == nullptr || out == nullptr) {
      for (auto* p : parts) Py_XDECREF(p);
      Py_XDECREF(out);
      return nullptr;
    }
  }
  for (int i = 0; i < 11; i++) PyTuple_SET_ITEM(out, i, parts[i]);
  return out;
}

static PyObject* release(PyObject*, PyObject*) {
  join_freeing();
  if (g_result) {
    // the destructors touch no Python object (no Python tracer: with_stack is off)
    g_freeing = new std::thread([r = std::move(g_result)]() mutable { r.reset(); });
  }
  Py_RETURN_NONE;
}

static PyObject* join(PyObject*, PyObject*) {
  join_freeing();
  Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"take", take, METH_NOARGS, "Stop torch's profiler and hold its result; its event count."},
    {"columns", columns, METH_NOARGS, "The held result's events as columns."},
    {"release", release, METH_NOARGS, "Free the held result on a native thread."},
    {"join", join, METH_NOARGS, "Wait for the free started by release()."},
    {nullptr, nullptr, 0, nullptr}};

static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_stepscope_kineto",
                             "stepscope's native reader of torch's profiler events, and "
                             "collectives' completion stamps", -1,
                             methods};

extern PyMethodDef work_done_methods[];         // work_done.cpp
extern PyMethodDef collective_ops_methods[];    // collective_ops.cpp
extern PyMethodDef collective_hooks_methods[];  // collective_hooks.cpp
extern PyMethodDef c10d_kernels_methods[];      // c10d_kernels.cpp

PyMODINIT_FUNC PyInit__stepscope_kineto() {
  PyObject* m = PyModule_Create(&module);
  if (m != nullptr && (PyModule_AddFunctions(m, work_done_methods) < 0 ||
                       PyModule_AddFunctions(m, collective_ops_methods) < 0 ||
                       PyModule_AddFunctions(m, collective_hooks_methods) < 0 ||
                       PyModule_AddFunctions(m, c10d_kernels_methods) < 0)) {
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
