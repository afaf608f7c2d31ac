#include "blas/vendor_library.h"

#include <sys/stat.h>
#include <tvm/ffi/error.h>

#include <cstdlib>

namespace tvm_ext {
namespace blas {
namespace vendor {
namespace {

void Expand(const std::string& path, const std::vector<const char*>& subdirs,
            const std::vector<const char*>& names, std::vector<std::string>* out) {
  if (!Exists(path, true)) {
    out->push_back(path);
    return;
  }
  size_t before = out->size();
  for (const char* sub : subdirs) {
    for (const char* name : names) {
      std::string file = path + sub + "/" + name;
      if (Exists(file, false)) out->push_back(file);
    }
  }
  if (out->size() == before) out->push_back(path + "/" + names.front());
}

}  // namespace

bool Exists(const std::string& path, bool directory) {
  struct stat st;
  return stat(path.c_str(), &st) == 0 && (!directory || S_ISDIR(st.st_mode));
}

std::vector<std::string> Candidates(const std::string& requested, const char* env,
                                    const std::vector<const char*>& subdirs,
                                    const std::vector<const char*>& names) {
  std::vector<std::string> out;
  if (!requested.empty()) Expand(requested, subdirs, names, &out);
  const char* value = std::getenv(env);
  if (value != nullptr && *value != '\0') Expand(value, subdirs, names, &out);
  for (const char* name : names) out.emplace_back(name);
  return out;
}

tvm::runtime::DeviceAPI* CurrentDevice(DLDevice dev, const char* what) {
  tvm::runtime::DeviceAPI* device_api = tvm::runtime::DeviceAPI::Get(dev, true);
  if (device_api == nullptr) {
    TVM_FFI_THROW(RuntimeError) << what << ": TVM's CUDA runtime is not loaded (no "
                                   "device_api.cuda): a CUDA tensor needs a GPU, its driver and "
                                   "libtvm_runtime_cuda.so";
  }
  try {
    device_api->SetDevice(dev);
  } catch (const tvm::ffi::Error& err) {
    TVM_FFI_THROW(RuntimeError) << what << ": cannot use CUDA device " << dev.device_id << ": "
                                << err.message();
  }
  return device_api;
}

}  // namespace vendor
}  // namespace blas
}  // namespace tvm_ext
