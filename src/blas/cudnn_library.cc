#include "blas/cudnn_library.h"

#include <dlfcn.h>
#include <tvm/ffi/error.h>

#include <map>
#include <sstream>
#include <vector>

#include "blas/vendor_library.h"

namespace tvm_ext {
namespace blas {
namespace cudnn {
namespace {

std::string requested_path;  // NOLINT: from tvm_ext.cudnn.set_library; under Mutex()
Api* loaded = nullptr;       // never freed: it stays valid for calls in flight
const std::vector<const char*> kNames = {"libcudnn.so.9", "libcudnn.so"};
// The layouts of the CUDA toolkit and of the nvidia-cudnn wheels (cu12: nvidia/cudnn/lib,
// cu13: nvidia/cu13/lib), in a directory given.
const std::vector<const char*> kSubdirs = {"", "/lib", "/lib64", "/cudnn/lib", "/cu13/lib",
                                           "/nvidia/cudnn/lib", "/nvidia/cu13/lib"};
// cuDNN 9's engine libraries, dependencies first: libcudnn opens them by name.
constexpr const char* kEngines[] = {
    "libcudnn_graph.so.9", "libcudnn_engines_precompiled.so.9",
    "libcudnn_engines_runtime_compiled.so.9", "libcudnn_heuristic.so.9", "libcudnn_ops.so.9",
    "libcudnn_cnn.so.9", "libcudnn_adv.so.9"};

struct DeviceState {
  Handle handle = nullptr;
  Stream stream = nullptr;
  bool bound = false;
};
std::map<int, DeviceState>& Devices() {
  static auto* devices = new std::map<int, DeviceState>();  // never destroyed (exit order)
  return *devices;
}

Api* TryLoad(const std::string& path, std::ostringstream* tried) {
  auto note = [&](const std::string& why) {
    *tried << (tried->tellp() > 0 ? "; " : "") << path << " (" << why << ")";
  };
  size_t slash = path.find_last_of('/');
  if (slash != std::string::npos) {
    std::string dir = path.substr(0, slash + 1);
    for (const char* engine : kEngines) {
      if (vendor::Exists(dir + engine)) dlopen((dir + engine).c_str(), RTLD_NOW | RTLD_GLOBAL);
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
  bool ok = vendor::Bind(lib, "cudnnCreate", &api->create) &&
            vendor::Bind(lib, "cudnnSetStream", &api->set_stream) &&
            vendor::Bind(lib, "cudnnGetErrorString", &api->error_string) &&
            vendor::Bind(lib, "cudnnCreateTensorDescriptor", &api->create_tensor) &&
            vendor::Bind(lib, "cudnnSetTensorNdDescriptor", &api->set_tensor) &&
            vendor::Bind(lib, "cudnnDestroyTensorDescriptor", &api->destroy_tensor) &&
            vendor::Bind(lib, "cudnnCreateFilterDescriptor", &api->create_filter) &&
            vendor::Bind(lib, "cudnnSetFilter4dDescriptor", &api->set_filter) &&
            vendor::Bind(lib, "cudnnDestroyFilterDescriptor", &api->destroy_filter) &&
            vendor::Bind(lib, "cudnnCreateConvolutionDescriptor", &api->create_conv) &&
            vendor::Bind(lib, "cudnnSetConvolution2dDescriptor", &api->set_conv) &&
            vendor::Bind(lib, "cudnnSetConvolutionGroupCount", &api->set_groups) &&
            vendor::Bind(lib, "cudnnSetConvolutionMathType", &api->set_math) &&
            vendor::Bind(lib, "cudnnDestroyConvolutionDescriptor", &api->destroy_conv) &&
            vendor::Bind(lib, "cudnnGetConvolutionForwardAlgorithm_v7", &api->algorithms) &&
            vendor::Bind(lib, "cudnnConvolutionForward", &api->forward) &&
            vendor::Bind(lib, "cudnnTransformTensor", &api->transform) &&
            vendor::Bind(lib, "cudnnGetConvolutionBackwardFilterAlgorithm_v7",
                         &api->filter_algorithms) &&
            vendor::Bind(lib, "cudnnConvolutionBackwardFilter", &api->backward_filter);
  if (!ok) {
    note("no cudnnGetConvolutionForwardAlgorithm_v7 or another convolution entry point: "
         "cuDNN older than 7, or without its convolution library");
    delete api;
    return nullptr;
  }
  return api;
}

}  // namespace

std::mutex& Mutex() {
  static auto* mu = new std::mutex();
  return *mu;
}

const Api& LoadLocked() {
  if (loaded != nullptr) return *loaded;
  std::ostringstream tried;
  for (const auto& path : vendor::Candidates(requested_path, "TVM_EXT_CUDNN_LIB", kSubdirs,
                                             kNames)) {
    loaded = TryLoad(path, &tried);
    if (loaded != nullptr) return *loaded;
  }
  TVM_FFI_THROW(RuntimeError) << "tvm_ext.cudnn: libcudnn could not be loaded; fix: `pip "
                                 "install nvidia-cudnn-cu12` (or -cu13), set TVM_EXT_CUDNN_LIB "
                                 "to libcudnn.so.9 or its directory, or build with "
                                 "--no-library; tried: "
                              << tried.str();
}

void Check(Status status, const char* what) {
  if (status == 0) return;
  const char* name = loaded && loaded->error_string ? loaded->error_string(status) : nullptr;
  TVM_FFI_THROW(RuntimeError) << "tvm_ext.cudnn: " << what << " failed: "
                              << (name ? name : "cuDNN status") << " (" << status << ")";
}

Handle HandleLocked(DLDevice dev, Stream stream) {
  const Api& api = LoadLocked();
  vendor::CurrentDevice(dev, "tvm_ext.cudnn");
  DeviceState& st = Devices()[dev.device_id];
  if (st.handle == nullptr) Check(api.create(&st.handle), "cudnnCreate");
  if (!st.bound || st.stream != stream) {
    Check(api.set_stream(st.handle, stream), "cudnnSetStream");
    st.stream = stream, st.bound = true;
  }
  return st.handle;
}

void SetLibraryPath(const std::string& path) {
  std::lock_guard<std::mutex> lock(Mutex());
  requested_path = path;  // used at the first load; a loaded cuDNN (with handles) stays
}

std::string AvailablePath() { return vendor::LoadedPath(Mutex(), LoadLocked); }

}  // namespace cudnn
}  // namespace blas
}  // namespace tvm_ext
