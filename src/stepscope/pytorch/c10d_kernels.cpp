// Our kernels on the Autograd key of torch's c10d ops, in C++ (part of module _stepscope_kineto,
// built by `stepscope build-torch`), for a torch without process-group hooks (2.11).
//
// Why: every ProcessGroup method goes through the dispatcher (torch >= 2.0), and the c10d ops
// have no autograd kernel of their own, so a kernel there sees each op, including those DDP's
// reducer issues from C++. A Python kernel cost 20-50 µs of CPU per op (boxing the arguments to
// Python, the GIL, reading the tensors and the group); this one notes the op, hands it on below
// autograd as the dispatcher would have done without it, and puts a C++ callback on its work's
// future (collective_ops.cpp): no Python and no GIL per op.
//
//   hook_ops(ops, owner)  register a kernel on each op of `ops`, a list of (name in the c10d
//                         namespace, code, index of the input argument or -1, index of the
//                         process group argument); their ops are given back by take_ops()
//                         with `code` and `owner`. RuntimeError: none is left registered.
//   unhook_ops()          remove them (the ops are then dispatched as before)
//   ops_seen()            how many ops the kernels have noted on this thread (a caller of a
//                         collective learns whether they saw it)
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
// and process group arguments, and the owner. Published whole and never freed (one per
// profiler start): a kernel still running on another thread when its ops are unhooked, or
// hooked anew, reads a table that stays valid. The kernel is a plain function, not a functor
// that the dispatcher frees when it is unregistered, for the same reason.
struct Spec {
  int64_t code, input, group;
};
struct Table {
  std::unordered_map<std::string, Spec> ops;  // by the op's full name, "c10d::allreduce_"
  int64_t owner = 0;
};
std::atomic<const Table*> g_table{nullptr};  // null: the kernels pass every op on unnoted
thread_local int64_t t_seen = 0;
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
  const c10::DispatchKeySet below = keys & c10::after_autograd_keyset;
  const Table* table = g_table.load(std::memory_order_acquire);
  Op op;
  op.t0 = stepscope_c10d::monotonic_ns();
  bool noted = false;  // nothing may throw into the collective: an op not read is left out
  if (table != nullptr) {
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
  handle.redispatchBoxed(below, stack);  // (its exceptions are the program's)
  if (!noted) return;
  try {
    c10::intrusive_ptr<c10d::Work> work;
    if (!handle.schema().returns().empty() && stack->back().isCustomClass())
      work = stack->back().toCustomClass<c10d::Work>();
    t_seen++;
    if (work) {
      stepscope_c10d::finish_at_completion(std::move(op), work);
    } else {  // monitored_barrier_: done when it returns
      op.t1 = stepscope_c10d::monotonic_ns();
      stepscope_c10d::finish(std::move(op));
    }
  } catch (...) {
  }
}

PyObject* unhook_ops(PyObject*, PyObject*) {
  g_table = nullptr;
  g_library.reset();
  Py_RETURN_NONE;
}

PyObject* hook_ops(PyObject*, PyObject* args) {
  PyObject* ops;
  long long owner;
  if (!PyArg_ParseTuple(args, "O!L", &PyList_Type, &ops, &owner)) return nullptr;
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
  g_table = nullptr;
  g_library.reset();  // (one set of kernels at a time)
  const bool ok = stepscope_c10d::from_python([&] {
    auto lib = std::make_unique<torch::Library>(torch::Library::IMPL, "c10d",
                                                c10::DispatchKey::Autograd, __FILE__, __LINE__);
    for (const std::string& name : names)
      lib->impl(name.c_str(), torch::CppFunction::makeFromBoxedFunction<&kernel>());
    g_library = std::move(lib);  // (a throw above destroys `lib`: none left registered)
  });
  if (!ok) return nullptr;
  g_table = table.release();  // never freed (see Table)
  Py_RETURN_NONE;
}

PyObject* ops_seen(PyObject*, PyObject*) { return PyLong_FromLongLong(t_seen); }

}  // namespace

PyMethodDef c10d_kernels_methods[] = {
    {"hook_ops", hook_ops, METH_VARARGS, "Register C++ kernels on the c10d ops' Autograd key."},
    {"unhook_ops", unhook_ops, METH_NOARGS, "Remove the kernels hook_ops() registered."},
    {"ops_seen", ops_seen, METH_NOARGS, "How many ops the kernels noted on this thread."},
    {nullptr, nullptr, 0, nullptr}};

#else  // a torch built without torch.distributed: no such functions
PyMethodDef c10d_kernels_methods[] = {{nullptr, nullptr, 0, nullptr}};
#endif
