/*!
 * \file graph/kernel_graphs.cc
 * \brief A module's static kernel regions replayed as CUDA graphs, captured again when an
 * argument has moved.
 *
 * TVM's RewriteCUDAGraph lifts each run of kernel launches that reads only memory at fixed
 * addresses (the storage it allocates once, and the weights: the parameters after `num_input`)
 * into a function, and calls it through a builtin that captures it into a CUDA graph on the
 * first call and replays the graph on every later one. TVM's builtin trusts the caller to pass
 * the same weight tensors on every call; new weight tensors would be read from the old
 * addresses. tvm_ext's pass (passes/capture_kernel_graphs.py) calls these builtins instead:
 *
 *   R.call_builtin_with_ctx("tvm_ext.cuda_graph.get_cached_alloc", (alloc_func, index))
 *   R.call_builtin_with_ctx("tvm_ext.cuda_graph.run_or_capture",
 *                           (region_func, (args...), index[, shape]))
 *
 * The first runs the function allocating the static storage once per VM (as TVM's does).
 *
 * Each graph is keyed by (index, shape) and remembers the addresses of its arguments (a
 * tensor's data, any other object's identity): when one has moved, the graph is captured again
 * rather than replayed, so a call is right whatever it is passed.
 *
 * - Capture, as TVM's: the region runs once on the current stream (loading its kernels and
 *   sizing the workspace pool), then again on a fresh stream under global-mode capture, and the
 *   graph is instantiated. The first run's results are the call's.
 * - A region that cannot be captured (an operation refused under capture) stays uncaptured:
 *   the first run's results stand, later calls run it directly, one line goes to stderr. So
 *   does a region whose arguments moved on more than kMaxMoves calls (a caller placing new
 *   weights every call would pay a capture each time).
 * - On a CPU device (the stand-in the tests run on) capture records the arguments and replay
 *   runs the region again on the recorded ones, as a graph replays its kernels on the recorded
 *   addresses: a rewrite that relied on anything else would give other results.
 *
 * `tvm_ext.cuda_graph.stats()` counts captures, replays, recaptures and regions turned direct
 * in this process; `tvm_ext.cuda_graph.reset_stats()` zeroes them.
 */
#include <tvm/ffi/container/array.h>
#include <tvm/ffi/container/shape.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/function.h>
#include <tvm/ffi/reflection/registry.h>
#include <tvm/runtime/vm/vm.h>

#include <atomic>
#include <cstdint>
#include <iostream>
#include <map>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "cuda/cuda_driver.h"

namespace tvm_ext {
namespace graph {

namespace ffi = tvm::ffi;
using tvm::runtime::vm::VirtualMachine;
using tvm::runtime::vm::VMExtension;
using tvm::runtime::vm::VMExtensionNode;

struct Counters {
  std::atomic<int64_t> captures{0}, replays{0}, recaptures{0}, direct{0};
};
Counters& Stats() {
  static auto* counters = new Counters();  // never destroyed (exit order)
  return *counters;
}

// How often a region's arguments may move (each time it is captured again) before it runs
// without a graph: a caller placing new weights on every call would pay a capture each call,
// more than the launches it saves.
constexpr int kMaxMoves = 2;

/*! \brief One region: where its arguments were, what it returned, its graph. */
struct Entry {
  bool captured = false;
  std::vector<uintptr_t> addresses;  // AddressesOf its arguments when captured
  ffi::Any states;
  void* exec = nullptr;  // CUgraphExec; nullptr on a CPU device
  int moves = 0;         // captures again because an argument moved
  bool direct = false;   // capture failed, or the arguments kept moving: run it directly
};

class KernelGraphsNode : public VMExtensionNode {
 public:
  ~KernelGraphsNode() {
    const CudaDriver* driver = CudaDriver::Get();
    for (auto& kv : entries) {
      if (kv.second.exec != nullptr && driver != nullptr) driver->GraphExecDestroy(kv.second.exec);
    }
  }
  std::map<std::pair<int64_t, std::vector<int64_t>>, Entry> entries;
  std::map<int64_t, ffi::Any> allocations;  // get_cached_alloc's, by index

  static constexpr const bool _type_mutable = true;
  TVM_FFI_DECLARE_OBJECT_INFO_FINAL("tvm_ext.KernelGraphs", KernelGraphsNode, VMExtensionNode);
};

class KernelGraphs : public VMExtension {
 public:
  TVM_FFI_DEFINE_OBJECT_REF_METHODS_NULLABLE(KernelGraphs, VMExtension, KernelGraphsNode);
  static KernelGraphs Create() { return KernelGraphs(ffi::make_object<KernelGraphsNode>()); }
};

namespace {

// What a graph bakes in of one argument, appended to `out` with a tag per kind: a tensor's
// data address; a tuple's elements (the VM builds a tuple afresh on every call); a shape's or a
// number's value; any other object's identity (a storage from the cached allocations).
void Describe(const ffi::Any& a, std::vector<uintptr_t>* out) {
  if (auto t = a.try_cast<DLTensor*>()) {
    out->insert(out->end(), {1, reinterpret_cast<uintptr_t>(
                                    static_cast<const char*>((*t)->data) + (*t)->byte_offset)});
  } else if (a.as<ffi::ArrayObj>() != nullptr) {
    auto items = a.cast<ffi::Array<ffi::Any>>();
    out->insert(out->end(), {2, items.size()});
    for (const ffi::Any& item : items) Describe(item, out);
  } else if (const auto* shape = a.as<ffi::ShapeObj>()) {
    out->insert(out->end(), {3, shape->size});
    for (size_t i = 0; i < shape->size; ++i) out->push_back(static_cast<uintptr_t>(shape->data[i]));
  } else if (const auto* obj = a.as<ffi::Object>()) {
    out->insert(out->end(), {4, reinterpret_cast<uintptr_t>(obj)});
  } else if (auto i = a.try_cast<int64_t>()) {
    out->insert(out->end(), {5, static_cast<uintptr_t>(*i)});
  } else {
    out->push_back(6);  // none, a float, a string view: nothing a kernel reads by address
  }
}

std::vector<uintptr_t> AddressesOf(const ffi::Array<ffi::Any>& args) {
  std::vector<uintptr_t> out;
  for (const ffi::Any& a : args) Describe(a, &out);
  return out;
}

void Invoke(VirtualMachine* vm, const ffi::ObjectRef& func, const ffi::Array<ffi::Any>& args,
            ffi::Any* rv) {
  std::vector<ffi::AnyView> packed(args.begin(), args.end());
  vm->InvokeClosurePacked(func, ffi::PackedArgs(packed.data(), static_cast<int>(packed.size())),
                          rv);
}

void Check(const CudaDriver& d, CudaDriver::CUresult r, const char* what) {
  if (r != CudaDriver::kSuccess) {
    TVM_FFI_THROW(RuntimeError) << "tvm_ext.cuda_graph: " << what << " failed: " << d.Describe(r);
  }
}

/*!
 * \brief Runs `func` on a fresh stream under capture (TVM's current stream of the device
 * while it runs) and returns the instantiated graph; on failure, the capture is ended, the
 * stream restored, and the reason returned in `why` (exec nullptr).
 */
void* Capture(const CudaDriver& d, VirtualMachine* vm, const ffi::ObjectRef& func,
              const ffi::Array<ffi::Any>& args, ffi::Any* rv, std::string* why) {
  // Nothing here throws: the region has run once already (an optimizer step's update
  // included), so a failure leaves it without a graph rather than failing the call.
  int device = 0;
  CudaDriver::CUstream stream = nullptr;
  CudaDriver::CUresult r = d.CtxGetDevice(&device);
  if (r == CudaDriver::kSuccess) r = d.StreamCreate(&stream, 0);
  if (r != CudaDriver::kSuccess) {
    *why = "no capture stream: " + d.Describe(r);
    return nullptr;
  }
  TVMFFIStreamHandle previous = nullptr;
  if (TVMFFIEnvSetStream(kDLCUDA, device, stream, &previous) != 0) {
    d.StreamDestroy(stream);
    *why = "cannot make the capture stream TVM's current one";
    return nullptr;
  }
  CudaDriver::CUgraph graph = nullptr;
  CudaDriver::CUresult began = d.StreamBeginCapture(stream, CudaDriver::kCaptureModeGlobal);
  if (began == CudaDriver::kSuccess) {
    try {
      Invoke(vm, func, args, rv);
    } catch (const ffi::Error& err) {
      *why = err.message();
    } catch (const std::exception& err) {
      *why = err.what();
    }
    CudaDriver::CUresult ended = d.StreamEndCapture(stream, &graph);
    if (why->empty() && ended != CudaDriver::kSuccess) *why = "end: " + d.Describe(ended);
  } else {
    *why = "begin: " + d.Describe(began);
  }
  TVMFFIEnvSetStream(kDLCUDA, device, previous, nullptr);
  d.StreamDestroy(stream);
  void* exec = nullptr;
  if (why->empty()) {
    r = d.GraphInstantiate(&exec, graph, 0);
    if (r != CudaDriver::kSuccess) *why = "instantiate: " + d.Describe(r), exec = nullptr;
  }
  if (graph != nullptr) d.GraphDestroy(graph);
  return exec;
}

ffi::Any RunOrCapture(VirtualMachine* vm, const ffi::ObjectRef& func,
                      const ffi::Array<ffi::Any>& args, int64_t index,
                      const std::vector<int64_t>& shape) {
  KernelGraphsNode* graphs = vm->GetOrCreateExtension<KernelGraphs>().get();
  bool cuda = !vm->devices.empty() && vm->devices[0].device_type == kDLCUDA;
  const CudaDriver* driver = cuda ? CudaDriver::Get() : nullptr;
  if (cuda && (driver == nullptr || !driver->HasGraphs())) {
    TVM_FFI_THROW(RuntimeError) << "tvm_ext.cuda_graph: the CUDA driver (libcuda.so.1) lacks "
                                   "the graph entry points (CUDA >= 11.4 needed)";
  }
  std::vector<uintptr_t> addresses = AddressesOf(args);
  Counters& stats = Stats();
  Entry& e = graphs->entries[std::make_pair(index, shape)];
  if (e.direct) {
    ffi::Any rv;
    Invoke(vm, func, args, &rv);
    return rv;
  }
  if (e.captured && e.addresses == addresses) {
    ++stats.replays;
    if (cuda) {
      int device = 0;
      Check(*driver, driver->CtxGetDevice(&device), "cuCtxGetDevice");
      Check(*driver, driver->GraphLaunch(e.exec, TVMFFIEnvGetStream(kDLCUDA, device)),
            "cuGraphLaunch");
    } else {
      ffi::Any ignored;  // the graph's outputs are the captured states
      Invoke(vm, func, args, &ignored);
    }
    return e.states;
  }
  if (e.captured) {  // an argument moved: this graph would read the old address
    ++stats.recaptures;
    if (e.exec != nullptr) driver->GraphExecDestroy(e.exec);
    e.exec = nullptr, e.captured = false, e.states = ffi::Any();
    if (++e.moves > kMaxMoves) {
      e.direct = true;
      ++stats.direct;
      std::cerr << "tvm_ext: kernel region " << index << " runs without a CUDA graph from "
                << "now on: its arguments moved on " << e.moves << " calls (pass the same "
                << "weight tensors to every call to keep its graph)" << std::endl;
    }
  }
  ffi::Any rv;
  Invoke(vm, func, args, &rv);  // the call's results; loads the kernels before capture
  if (e.direct) return rv;
  if (cuda) {
    std::string why;
    ffi::Any captured_rv;
    e.exec = Capture(*driver, vm, func, args, &captured_rv, &why);
    if (e.exec == nullptr) {
      e.direct = true;
      ++stats.direct;
      std::cerr << "tvm_ext: kernel region " << index << " runs without a CUDA graph (capture "
                << "failed: " << why << ")" << std::endl;
      return rv;
    }
    rv = captured_rv;  // views of the same memory as the first run's
  }
  ++stats.captures;
  e.captured = true;
  e.addresses = std::move(addresses);
  e.states = rv;
  return rv;
}

ffi::Any CachedAlloc(VirtualMachine* vm, const ffi::ObjectRef& func, int64_t index) {
  KernelGraphsNode* graphs = vm->GetOrCreateExtension<KernelGraphs>().get();
  auto it = graphs->allocations.find(index);
  if (it != graphs->allocations.end()) return it->second;
  ffi::Any rv;
  Invoke(vm, func, {}, &rv);
  graphs->allocations.emplace(index, rv);
  return rv;
}

}  // namespace

TVM_FFI_STATIC_INIT_BLOCK() {
  namespace refl = tvm::ffi::reflection;
  refl::GlobalDef()
      .def_packed("tvm_ext.cuda_graph.run_or_capture",
                  [](ffi::PackedArgs args, ffi::Any* rv) {
                    if (args.size() != 4 && args.size() != 5) {
                      TVM_FFI_THROW(TypeError) << "tvm_ext.cuda_graph.run_or_capture takes "
                                                  "(vm, func, args, index[, shape])";
                    }
                    std::vector<int64_t> shape;
                    if (args.size() == 5) {
                      ffi::Shape s = args[4].cast<ffi::Shape>();
                      shape.assign(s.begin(), s.end());
                    }
                    *rv = RunOrCapture(VirtualMachine::GetContextPtr(args[0]),
                                       args[1].cast<ffi::ObjectRef>(),
                                       args[2].cast<ffi::Array<ffi::Any>>(),
                                       args[3].cast<int64_t>(), shape);
                  })
      .def_packed("tvm_ext.cuda_graph.get_cached_alloc",
                  [](ffi::PackedArgs args, ffi::Any* rv) {
                    if (args.size() != 3) {
                      TVM_FFI_THROW(TypeError) << "tvm_ext.cuda_graph.get_cached_alloc takes "
                                                  "(vm, func, index)";
                    }
                    *rv = CachedAlloc(VirtualMachine::GetContextPtr(args[0]),
                                      args[1].cast<ffi::ObjectRef>(), args[2].cast<int64_t>());
                  })
      .def("tvm_ext.cuda_graph.stats",
           []() {
             Counters& s = Stats();
             return ffi::Shape({s.captures.load(), s.replays.load(), s.recaptures.load(),
                                s.direct.load()});
           })
      .def("tvm_ext.cuda_graph.reset_stats", []() {
        Counters& s = Stats();
        s.captures = 0, s.replays = 0, s.recaptures = 0, s.direct = 0;
      });
}

}  // namespace graph
}  // namespace tvm_ext
