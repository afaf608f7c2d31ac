/*!
 * \file ccl/disco_session.cc
 * \brief Worker-side helpers for running compiled modules on a Disco session
 * (tvm_ext/runtime/distributed.py drives them), and the lazy entry point of the NCCL backend.
 *
 * Every function here runs on a Disco worker and works on that worker's default device (set by
 * the collective backend's init_ccl: cpu(i) or cuda(i)), so one broadcast call does the right
 * thing on every worker:
 *   tvm_ext.disco.load_vm_module(path, allocator, host_offset)
 *                                                  a Relax VM on the worker's device, with the
 *                                                  allocator asked for (naive: exact peaks);
 *                                                  host_offset > 0 gives a CPU worker i the host
 *                                                  cpu(i + host_offset) (a swapped module's host
 *                                                  memory, counted apart from its device)
 *   tvm_ext.disco.empty(shape, dtype)              a tensor from the tracked allocator
 *   tvm_ext.disco.host_empty(shape, dtype, host_offset)  the same on the worker's host device
 *   tvm_ext.disco.memory_stats() / reset_peak()    tvm_ext.memory.* of the worker's device
 *   tvm_ext.disco.describe(value) / leaf(value, i) the tensors inside a (nested) VM result
 *   tvm_ext.disco.call_guarded(func, args...)      call, and keep an error instead of throwing
 *   tvm_ext.disco.take_error()                     the kept error, cleared
 * A worker thread that throws ends the process (TVM's workers do not catch), so calls that may
 * fail go through call_guarded; it also aborts the cpu communicator, so that workers waiting
 * for the failed one in a collective stop with its error instead of hanging.
 *
 * "runtime.disco.nccl.init_ccl" (registered only when TVM itself has no NCCL backend) loads
 * libtvm_ext_nccl.so from next to this library on first use, or says how to get it.
 */
#include <dlfcn.h>
#include <unistd.h>
#include <tvm/ffi/container/array.h>
#include <tvm/ffi/container/shape.h>
#include <tvm/ffi/extra/module.h>
#include <tvm/ffi/function.h>
#include <tvm/ffi/reflection/registry.h>
#include <tvm/runtime/disco/session.h>
#include <tvm/runtime/memory/memory_manager.h>

#include <cstdlib>
#include <mutex>
#include <sstream>
#include <string>
#include <unordered_map>

#include "ccl/ccl_cpu.h"
#include "ccl/ccl_util.h"
#include "memory/memory_stats.h"

namespace tvm_ext {
namespace {

using tvm::ffi::Any;
using tvm::ffi::Array;
using tvm::ffi::Function;
using tvm::ffi::Shape;
using tvm::ffi::String;
using tvm::ffi::Tensor;
using tvm::runtime::DiscoWorker;
using tvm::runtime::memory::Allocator;
using tvm::runtime::memory::MemoryManager;

DLDevice WorkerDevice(const char* fn) { return ccl::CurrentWorker(fn)->default_device; }

tvm::ffi::Module OpenLibrary(const std::string& path) {
  static std::mutex mu;
  static auto* cache = new std::unordered_map<std::string, tvm::ffi::Module>();
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache->find(path);
  if (it != cache->end()) return it->second;
  tvm::ffi::Module lib = tvm::ffi::Module::LoadFromFile(path);
  cache->emplace(path, lib);
  return lib;
}

/*! \brief The host device of a worker: cpu(i + host_offset) for CPU worker i when
 * host_offset > 0, else its own device (CPU) or cpu(0) (GPU), as TVM does. */
DLDevice WorkerHost(DLDevice dev, int64_t host_offset) {
  if (dev.device_type != kDLCPU) return DLDevice{kDLCPU, 0};
  if (host_offset > 0) return DLDevice{kDLCPU, static_cast<int32_t>(dev.device_id + host_offset)};
  return dev;
}

tvm::ffi::Module LoadVMModule(const String& path, int allocator, int64_t host_offset) {
  DiscoWorker* worker = ccl::CurrentWorker("tvm_ext.disco.load_vm_module");
  if (allocator != tvm::runtime::memory::kNaive && allocator != tvm::runtime::memory::kPooled) {
    TVM_FFI_THROW(ValueError) << "tvm_ext.disco.load_vm_module: allocator " << allocator
                              << " is neither naive (1) nor pooled (2)";
  }
  tvm::ffi::Module lib = OpenLibrary(path);
  auto load = lib->GetFunction("vm_load_executable");
  if (!load.has_value()) {
    TVM_FFI_THROW(ValueError) << path << " holds no Relax VM executable (no vm_load_executable): "
                              << "export one with tvm.compile(...).export_library(path)";
  }
  tvm::ffi::Module vm = (*load)().cast<tvm::ffi::Module>();
  DLDevice dev = worker->default_device;
  // Host-side tensors (shapes, ...) of a CPU worker stay on its own cpu(i), so that its counters
  // hold everything it allocates, unless a separate host is asked for; GPU workers use cpu(0).
  DLDevice host = WorkerHost(dev, host_offset);
  auto init = vm->GetFunction("vm_initialization");
  if (!init.has_value()) TVM_FFI_THROW(ValueError) << path << ": not built by the Relax VM";
  (*init)(static_cast<int>(dev.device_type), dev.device_id, allocator,
          static_cast<int>(host.device_type), host.device_id, allocator);
  return vm;
}

/*! \brief JSON of the tensors in a VM result, leaves in depth-first order. */
void DescribeValue(const Any& value, std::ostringstream& os) {
  if (auto tensor = value.as<Tensor>()) {
    const Tensor& t = tensor.value();
    os << "{\"shape\": [";
    for (int i = 0; i < t.ndim(); ++i) os << (i ? ", " : "") << t.shape()[i];
    os << "], \"dtype\": \"" << tvm::ffi::DLDataTypeToString(t.dtype()) << "\"}";
  } else if (auto array = value.as<Array<Any>>()) {
    os << "[";
    bool first = true;
    for (const Any& item : array.value()) {
      os << (first ? "" : ", ");
      first = false;
      DescribeValue(item, os);
    }
    os << "]";
  } else if (auto shape = value.as<Shape>()) {
    os << "{\"shape_value\": [";
    for (size_t i = 0; i < shape.value().size(); ++i) os << (i ? ", " : "") << shape.value()[i];
    os << "]}";
  } else if (auto i = value.as<int64_t>()) {
    os << "{\"int\": " << i.value() << "}";
  } else if (auto f = value.as<double>()) {
    os << "{\"float\": " << f.value() << "}";
  } else if (value == nullptr) {
    os << "null";
  } else {
    os << "{\"other\": \"" << value.GetTypeKey() << "\"}";
  }
}

bool FindLeaf(const Any& value, int64_t* index, Any* out) {
  if (auto array = value.as<Array<Any>>()) {
    for (const Any& item : array.value()) {
      if (FindLeaf(item, index, out)) return true;
    }
    return false;
  }
  if ((*index)-- == 0) {
    *out = value;
    return true;
  }
  return false;
}

struct KeptError {
  bool set = false;
  bool echo = false;  // the echo of another worker's failure
  std::string message;
};

KeptError& ThisWorkerError() {
  thread_local KeptError error;
  return error;
}

void KeepError(const std::string& kind, const std::string& message) {
  KeptError& kept = ThisWorkerError();
  bool echo = ccl::IsAbortEcho(message);
  if (!kept.set || (kept.echo && !echo)) {  // keep the root cause
    kept.set = true;
    kept.echo = echo;
    kept.message = kind + ": " + message;
  }
  if (!echo) {
    int id = -1;
    try {
      id = DiscoWorker::ThreadLocal()->worker_id;
    } catch (const tvm::ffi::Error&) {
    }
    ccl::AbortCpuCommunicatorOfThisWorker("worker " + std::to_string(id) + " failed: " + kind +
                                          ": " + message);
  }
}

// ---------------------------------------------------------------------------------------------
// The NCCL backend, loaded on first use
// ---------------------------------------------------------------------------------------------

constexpr const char* kNcclLibrary = "libtvm_ext_nccl.so";

std::string ThisLibraryDir() {
  Dl_info info;
  if (dladdr(reinterpret_cast<void*>(&ThisLibraryDir), &info) == 0 || info.dli_fname == nullptr) {
    return ".";
  }
  std::string path = info.dli_fname;
  size_t slash = path.rfind('/');
  return slash == std::string::npos ? "." : path.substr(0, slash);
}

String LoadNcclBackend() {
  static std::mutex mu;
  static std::string loaded;
  std::lock_guard<std::mutex> lock(mu);
  if (!loaded.empty()) return loaded;
  const char* env = std::getenv("TVM_EXT_NCCL_LIB");
  std::string path = env && *env ? env : ThisLibraryDir() + "/" + kNcclLibrary;
  if (access(path.c_str(), R_OK) != 0) {
    TVM_FFI_THROW(RuntimeError)
        << "the NCCL collective backend is not part of this tvm_ext build (no " << path
        << "). It is built when CMake finds the CUDA toolkit and nccl.h: `pip install "
           "nvidia-nccl-cu12` (or install NCCL), then rebuild tvm_ext with `pip install . "
           "-Ccmake.define.TVM_EXT_NCCL=ON` (ON stops the build with the reason if anything is "
           "missing). On a machine without GPUs use the \"cpu\" backend.";
  }
  dlerror();
  if (dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL) == nullptr) {
    const char* why = dlerror();
    TVM_FFI_THROW(RuntimeError) << "cannot load the NCCL collective backend " << path << ": "
                                << (why ? why : "unknown error")
                                << " (it needs libnccl.so.2, e.g. from nvidia-nccl-cu12)";
  }
  if (!Function::GetGlobal("tvm_ext.nccl.init_ccl").has_value()) {
    TVM_FFI_THROW(RuntimeError) << path << " loaded but registered no tvm_ext.nccl.init_ccl";
  }
  loaded = path;
  return loaded;
}

}  // namespace

TVM_FFI_STATIC_INIT_BLOCK() {
  namespace refl = tvm::ffi::reflection;
  refl::GlobalDef()
      .def("tvm_ext.disco.load_vm_module", LoadVMModule)
      .def("tvm_ext.disco.empty",
           [](Shape shape, DLDataType dtype) {
             DLDevice dev = WorkerDevice("tvm_ext.disco.empty");
             Allocator* alloc =
                 MemoryManager::GetOrCreateAllocator(dev, tvm::runtime::memory::kNaive);
             return alloc->Empty(shape, dtype, dev);
           })
      .def("tvm_ext.disco.host_empty",
           [](Shape shape, DLDataType dtype, int64_t host_offset) {
             DLDevice dev = WorkerHost(WorkerDevice("tvm_ext.disco.host_empty"), host_offset);
             Allocator* alloc =
                 MemoryManager::GetOrCreateAllocator(dev, tvm::runtime::memory::kNaive);
             return alloc->Empty(shape, dtype, dev);
           })
      .def("tvm_ext.disco.device", []() { return WorkerDevice("tvm_ext.disco.device"); })
      .def("tvm_ext.disco.memory_stats",
           []() {
             MemoryCounters c = GetMemoryCounters(WorkerDevice("tvm_ext.disco.memory_stats"));
             return Array<int64_t>{c.in_use,        c.peak_in_use, c.reserved,
                                   c.peak_reserved, c.num_allocs,  c.num_frees};
           })
      .def("tvm_ext.disco.reset_peak",
           []() {
             DLDevice dev = WorkerDevice("tvm_ext.disco.reset_peak");
             Function::GetGlobalRequired("tvm_ext.memory.reset_peak")(dev);
           })
      .def("tvm_ext.disco.get_function",
           [](tvm::ffi::Module mod, String name) {
             auto func = mod->GetFunction(name);
             if (!func.has_value()) {
               TVM_FFI_THROW(AttributeError) << "the module has no function `" << name << "`";
             }
             return func.value();
           })
      .def("tvm_ext.disco.describe",
           [](Any value) {
             std::ostringstream os;
             DescribeValue(value, os);
             return String(os.str());
           })
      .def("tvm_ext.disco.leaf",
           [](Any value, int64_t index) {
             Any out;
             int64_t i = index;
             if (!FindLeaf(value, &i, &out)) {
               TVM_FFI_THROW(IndexError) << "tvm_ext.disco.leaf: no leaf " << index;
             }
             return out;
           })
      .def_packed("tvm_ext.disco.call_guarded",
                  [](tvm::ffi::PackedArgs args, Any* rv) {
                    try {
                      if (args.size() == 0 || args[0] == nullptr) {
                        TVM_FFI_THROW(ValueError) << "call_guarded: no function to call";
                      }
                      Function func = args[0].cast<Function>();
                      func.CallPacked(args.Slice(1), rv);
                    } catch (const tvm::ffi::Error& e) {
                      KeepError(e.kind(), e.message());
                      *rv = nullptr;
                    } catch (const std::exception& e) {
                      KeepError("InternalError", e.what());
                      *rv = nullptr;
                    }
                  })
      // "" when the worker kept no error; else "root:<msg>" or "echo:<msg>".
      .def("tvm_ext.disco.take_error",
           []() {
             KeptError& kept = ThisWorkerError();
             std::string out;
             if (kept.set) out = (kept.echo ? "echo:" : "root:") + kept.message;
             kept = KeptError();
             return String(out);
           })
      .def("tvm_ext.disco.load_nccl_backend", LoadNcclBackend);
  // TVM builds with NCCL register their own; this lazy entry point only fills the gap.
  if (!Function::GetGlobal("runtime.disco.nccl.init_ccl").has_value()) {
    refl::GlobalDef().def("runtime.disco.nccl.init_ccl",
                          [](tvm::runtime::Session sess, Shape device_ids) {
                            LoadNcclBackend();
                            Function::GetGlobalRequired("tvm_ext.nccl.init_ccl")(sess,
                                                                                 device_ids);
                          });
  }
}

}  // namespace tvm_ext
