// Our kernels on torch's c10d ops, in C++ (part of module _stepscope_kineto, built by
// `stepscope build-torch`), for a torch without process-group hooks (2.11).
//
// Why: every ProcessGroup method goes through the dispatcher (torch >= 2.0), so a kernel on a
// key that every call passes (collectives.py says which and why) sees each op, including those
// DDP's reducer issues from C++. A Python kernel cost 20-50 µs of CPU per op (boxing the
// arguments to Python, the GIL, reading the tensors and the group); this one notes the op, hands
// it on to the keys below as the dispatcher would have done without it, and puts a C++ callback
// on its work's future (collective_ops.cpp): no Python and no GIL per op.
//
//   hook_ops(ops, owner, key)  register a kernel on dispatch key `key` of each op of `ops`, a
//                              list of (name in the c10d namespace, code, index of the input
//                              argument or -1, index of the process group argument); their ops
//                              are given back by take_ops() with `code` and `owner`.
//                              RuntimeError: none is left registered.
//   unhook_ops()               remove them (the ops are then dispatched as before)
#include <Python.h>

#if __has_include(<torch/csrc/distributed/c10d/ProcessGroup.hpp>)
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/library.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "c10d_glue.h"

namespace {

using stepscope_c10d::Op;

// What the kernels of one hook_ops() call know: per op, its code and the indices of its input
// and process group arguments, the owner, and the keys below theirs. Published before the
// kernels are registered and never freed (one per profiler start): a kernel still running on
// another thread when its ops are unhooked, or hooked anew, reads a table that stays valid. The
// kernel is a plain function, not a functor that the dispatcher frees when it is unregistered,
// for the same reason.
struct Spec {
  int64_t code, input, group;
};
struct Table {
  std::unordered_map<std::string, Spec> ops;  // by the op's full name, "c10d::allreduce_"
  int64_t owner = 0;
  c10::DispatchKeySet below;  // the keys after ours
};
std::atomic<const Table*> g_table{nullptr};
std::atomic<bool> g_on{false};  // off: the kernels pass every op on unnoted
std::unique_ptr<torch::Library> g_library;  // our registrations (touched with the GIL held)

// the bytes and dtype of an argument: a tensor, a list of them, or a list of such lists
void add_inputs(Op& op, const c10::IValue& v) {
  if (v.isTensor()) {
    stepscope_c10d::add_input(op, v.toTensor());
  } else if (v.isTensorList()) {
    for (const at::Tensor& t : v.toTensorList().vec()) stepscope_c10d::add_input(op, t);
  } else if (v.isList()) {
    for (const c10::IValue& item : v.toListRef()) add_inputs(op, item);
  }
}

void kernel(const c10::OperatorHandle& handle, c10::DispatchKeySet keys,
            torch::jit::Stack* stack) {
  const Table* table = g_table.load(std::memory_order_acquire);
  Op op;
  op.t0 = stepscope_c10d::monotonic_ns();
  bool noted = false;  // nothing may throw into the collective: an op not read is left out
  if (g_on.load(std::memory_order_relaxed)) {
    try {
      auto it = table->ops.find(handle.operator_name().name);
      if (it != table->ops.end()) {
        const Spec& spec = it->second;
        const size_t first = stack->size() - handle.schema().arguments().size();
        if (spec.input >= 0) add_inputs(op, (*stack)[first + spec.input]);
        auto pg = (*stack)[first + spec.group].toCustomClass<c10d::ProcessGroup>();
        op.size = pg->getSize();
        op.group = pg->getGroupName();
        op.name = spec.code;
        op.owner = table->owner;
        noted = true;
      }
    } catch (...) {
    }
  }
  handle.redispatchBoxed(keys & table->below, stack);  // (its exceptions are the program's)
  if (!noted) return;
  try {
    c10::intrusive_ptr<c10d::Work> work;
    if (!handle.schema().returns().empty() && stack->back().isCustomClass())
      work = stack->back().toCustomClass<c10d::Work>();
    if (work) {
      stepscope_c10d::finish_at_completion(std::move(op), work);
    } else {  // monitored_barrier_: done when it returns; NCCL's synchronous ops: enqueued
      op.t1 = stepscope_c10d::monotonic_ns();
      op.ended = stepscope_c10d::ended_without_work(op, 0);
      stepscope_c10d::finish(std::move(op));
    }
  } catch (...) {
  }
}

PyObject* unhook_ops(PyObject*, PyObject*) {
  g_on = false;
  g_library.reset();
  Py_RETURN_NONE;
}

PyObject* hook_ops(PyObject*, PyObject* args) {
  PyObject* ops;
  long long owner;
  const char* key;
  if (!PyArg_ParseTuple(args, "O!Ls", &PyList_Type, &ops, &owner, &key)) return nullptr;
  auto table = std::make_unique<Table>();
  table->owner = owner;
  std::vector<std::string> names;
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(ops); i++) {
    const char* name;
    long long code, input, group;
    if (!PyArg_ParseTuple(PyList_GET_ITEM(ops, i), "sLLL", &name, &code, &input, &group))
      return nullptr;
    names.emplace_back(name);
    table->ops["c10d::" + names.back()] = Spec{code, input, group};
  }
  g_on = false;
  g_library.reset();  // (one set of kernels at a time)
  const bool ok = stepscope_c10d::from_python([&] {
    const c10::DispatchKey k = c10::parseDispatchKey(key);
    table->below = c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, k);
    g_table = table.release();  // never freed (see Table)
    auto lib = std::make_unique<torch::Library>(torch::Library::IMPL, "c10d", k, __FILE__,
                                                __LINE__);
    for (const std::string& name : names)
      lib->impl(name.c_str(), torch::CppFunction::makeFromBoxedFunction<&kernel>());
    g_library = std::move(lib);  // (a throw above destroys `lib`: none left registered)
  });
  if (!ok) return nullptr;
  g_on = true;
  Py_RETURN_NONE;
}

}  // namespace

PyMethodDef c10d_kernels_methods[] = {
    {"hook_ops", hook_ops, METH_VARARGS, "Register C++ kernels on the c10d ops."},
    {"unhook_ops", unhook_ops, METH_NOARGS, "Remove the kernels hook_ops() registered."},
    {nullptr, nullptr, 0, nullptr}};

#else  // a torch built without torch.distributed: no such functions
PyMethodDef c10d_kernels_methods[] = {{nullptr, nullptr, 0, nullptr}};
#endif
