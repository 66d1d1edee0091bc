// Process groups' pre/post collective hooks in C++ (part of module _stepscope_kineto, built by
// `stepscope build-torch`; a torch with c10d/Hooks.hpp: 2.14 has it, 2.11 does not).
//
// Why: hooks registered from Python run Python for every op on the thread that issues it (for
// DDP, its reducer's: the GIL to take while the main thread runs), and a Python done callback
// on every work. Here the pre-hook notes the op, the post-hook puts a C++ callback on its work's
// future that notes the completion (collective_ops.cpp), and the profiler takes the finished
// ops at each flush (take_ops()): no Python and no GIL per op.
//
//   hook_group(pg, hook_id, owner)  register both hooks on a ProcessGroup; `owner`: the
//                                   profiler's id of that group, given back with its ops
#include <Python.h>

#if __has_include(<torch/csrc/distributed/c10d/Hooks.hpp>)
#include <torch/csrc/distributed/c10d/Hooks.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <utility>

#include "c10d_glue.h"

namespace {

using stepscope_c10d::Op;

struct Open {
  std::mutex mu;
  std::map<std::pair<int64_t, int64_t>, Op> ops;  // (owner, op id) -> the pre-hook's part
};
// Never freed: a hook may run on a backend's thread while the process exits.
Open* const g_open = new Open();
constexpr size_t kMaxOpen = 100000;  // pre-hooks without their post-hook (a failed issue)

void post(int64_t owner, const c10d::PostHookArgs& a) {
  Op op;
  {
    std::lock_guard<std::mutex> lock(g_open->mu);
    auto it = g_open->ops.find({owner, a.op_id});
    if (it == g_open->ops.end()) return;
    op = std::move(it->second);
    g_open->ops.erase(it);
  }
  if (!a.work) {  // a synchronous op: it ended when issued (on the host, or on a device stream)
    op.t1 = stepscope_c10d::monotonic_ns();
    op.ended = stepscope_c10d::ended_without_work(op, 1);
    stepscope_c10d::finish(std::move(op));
    return;
  }
  stepscope_c10d::finish_at_completion(std::move(op), a.work);
}

PyObject* hook_group(PyObject*, PyObject* args) {
  PyObject* obj;
  long long hook_id, owner;
  if (!PyArg_ParseTuple(args, "OLL", &obj, &hook_id, &owner)) return nullptr;
  const bool ok = stepscope_c10d::from_python([&] {
    auto pg = pybind11::handle(obj).cast<c10::intrusive_ptr<c10d::ProcessGroup>>();
    const int64_t g = owner, size = pg->getSize();
    const std::string name = pg->getGroupName();
    // nothing may throw into the collective: an op the hooks cannot note is left out
    pg->registerPreHook(hook_id, [g, size, name](const c10d::PreHookArgs& a) noexcept {
      try {
        Op op;
        op.t0 = stepscope_c10d::monotonic_ns();
        op.name = static_cast<int64_t>(a.name);
        op.owner = g;
        op.size = size;
        op.group = name;
        // a recv has no input: its buffer, an output, is what it moves (as our kernels read
        // its tensors)
        for (const auto& t : a.input_tensors.empty() ? a.output_tensors : a.input_tensors)
          stepscope_c10d::add_input(op, t);
        std::lock_guard<std::mutex> lock(g_open->mu);
        if (g_open->ops.size() >= kMaxOpen) g_open->ops.clear();
        g_open->ops[{g, a.op_id}] = std::move(op);
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

}  // namespace

PyMethodDef collective_hooks_methods[] = {
    {"hook_group", hook_group, METH_VARARGS,
     "Register C++ pre/post collective hooks on a ProcessGroup."},
    {nullptr, nullptr, 0, nullptr}};

#else  // a torch without process-group hooks (2.11 and older): no such function
PyMethodDef collective_hooks_methods[] = {{nullptr, nullptr, 0, nullptr}};
#endif
