#include "blas/cublas_library.h"

#include <dlfcn.h>
#include <tvm/ffi/error.h>
#include <tvm/runtime/device_api.h>

#include <map>
#include <sstream>
#include <vector>

#include "blas/vendor_library.h"
#include "cuda/capture_mode.h"
#include "cuda/cuda_driver.h"

namespace tvm_ext {
namespace blas {
namespace cublas {
namespace {

std::string requested_path;  // NOLINT: from tvm_ext.cublas.set_library; under Mutex()
Api* loaded = nullptr;       // never freed: it stays valid for calls in flight
std::string load_error;      // NOLINT: what the last failed search tried

struct DeviceState {
  Handle handle = nullptr;
  Stream stream = nullptr;
  bool bound = false;                 // stream/workspace set at least once
  std::map<Stream, void*> workspace;  // one per stream the handle has run on
};
std::map<int, DeviceState>& Devices() {
  static auto* devices = new std::map<int, DeviceState>();  // never destroyed (exit order)
  return *devices;
}

const std::vector<const char*> kNames = {"libcublas.so.13", "libcublas.so.12", "libcublas.so"};
// The layouts of the CUDA toolkit and of the nvidia-cublas wheels (cu13: nvidia/cu13/lib, cu12:
// nvidia/cublas/lib), in a directory given.
const std::vector<const char*> kSubdirs = {"", "/lib", "/lib64", "/cu13/lib", "/cublas/lib",
                                           "/nvidia/cu13/lib", "/nvidia/cublas/lib"};

Api* TryLoad(const std::string& path, std::ostringstream* tried) {
  auto note = [&](const std::string& why) {
    *tried << (tried->tellp() > 0 ? "; " : "") << path << " (" << why << ")";
  };
  // A wheel's libcublas finds its libcublasLt only if it is already loaded (no RUNPATH).
  size_t slash = path.find_last_of('/');
  if (slash != std::string::npos) {
    std::string dir = path.substr(0, slash + 1);
    for (const char* lt : {"libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so"}) {
      if (dlopen((dir + lt).c_str(), RTLD_NOW | RTLD_LOCAL) != nullptr) break;
    }
  }
  void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    const char* err = dlerror();
    note(err != nullptr ? err : "not loadable");
    return nullptr;
  }
  auto* api = new Api();
  api->path = path;
  bool ok = vendor::Bind(lib, "cublasCreate_v2", &api->create) &&
            vendor::Bind(lib, "cublasSetStream_v2", &api->set_stream) &&
            vendor::Bind(lib, "cublasSetWorkspace_v2", &api->set_workspace) &&
            vendor::Bind(lib, "cublasGemmStridedBatchedEx", &api->gemm);
  vendor::Bind(lib, "cublasGetStatusName", &api->status_name);
  if (!ok) {
    note("no cublasCreate_v2/cublasSetWorkspace_v2/cublasGemmStridedBatchedEx: cuBLAS < 11?");
    delete api;
    return nullptr;
  }
  return api;
}

// The workspace key of every stream under capture (no stream has this handle).
const Stream kCaptureKey = reinterpret_cast<Stream>(~uintptr_t(0));

}  // namespace

std::mutex& Mutex() {
  static auto* mu = new std::mutex();
  return *mu;
}

const Api& LoadLocked() {
  if (loaded != nullptr) return *loaded;
  std::vector<std::string> candidates =
      vendor::Candidates(requested_path, "TVM_EXT_CUBLAS_LIB", kSubdirs, kNames);
  std::ostringstream tried;
  for (const auto& path : candidates) {
    loaded = TryLoad(path, &tried);
    if (loaded != nullptr) return *loaded;
  }
  load_error = tried.str();
  TVM_FFI_THROW(RuntimeError) << "tvm_ext.cublas: libcublas could not be loaded; fix: `pip "
                                 "install nvidia-cublas` (CUDA 13) or nvidia-cublas-cu12, or set "
                                 "TVM_EXT_CUBLAS_LIB to libcublas.so.N or its directory; tried: "
                              << load_error;
}

void Check(Status status, const char* what) {
  if (status == 0) return;
  const char* name = loaded && loaded->status_name ? loaded->status_name(status) : nullptr;
  TVM_FFI_THROW(RuntimeError) << "tvm_ext.cublas: " << what << " failed: "
                              << (name ? name : "cuBLAS status") << " (" << status << ")";
}

void CheckDriver(int result, const char* what) {
  if (result != 0) {
    TVM_FFI_THROW(RuntimeError) << "tvm_ext.cublas: " << what << " failed: CUDA error "
                                << result;
  }
}

Handle HandleLocked(DLDevice dev, Stream stream) {
  const Api& api = LoadLocked();
  tvm::runtime::DeviceAPI* device_api = vendor::CurrentDevice(dev, "tvm_ext.cublas");
  DeviceState& st = Devices()[dev.device_id];
  if (st.handle == nullptr) Check(api.create(&st.handle), "cublasCreate");
  if (!st.bound || st.stream != stream) {
    Check(api.set_stream(st.handle, stream), "cublasSetStream");
    const CudaDriver* cu = CudaDriver::Get();
    bool capturing = Capturing(cu, stream);
    void*& ws = st.workspace[capturing ? kCaptureKey : stream];
    if (ws == nullptr) {
      RelaxedCapture relaxed(capturing ? cu : nullptr);
      ws = device_api->AllocDataSpace(dev, kWorkspaceBytes, 256, DLDataType{kDLUInt, 8, 1});
    }
    Check(api.set_workspace(st.handle, ws, kWorkspaceBytes), "cublasSetWorkspace");
    st.stream = stream, st.bound = true;
  }
  return st.handle;
}

void SetLibraryPath(const std::string& path) {
  std::lock_guard<std::mutex> lock(Mutex());
  requested_path = path;  // used at the first load; a loaded cuBLAS (with handles) stays
}

std::string AvailablePath() { return vendor::LoadedPath(Mutex(), LoadLocked); }

}  // namespace cublas
}  // namespace blas
}  // namespace tvm_ext
