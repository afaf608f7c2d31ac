/*
 * What the vendor libraries loaded at run time (cublas_library.h, cudnn_library.h) share: the
 * files a search tries, binding entry points, and the CUDA device a handle is made on.
 */
#ifndef TVM_EXT_BLAS_VENDOR_LIBRARY_H_
#define TVM_EXT_BLAS_VENDOR_LIBRARY_H_

#include <dlfcn.h>
#include <dlpack/dlpack.h>
#include <tvm/ffi/error.h>
#include <tvm/runtime/device_api.h>

#include <mutex>
#include <string>
#include <vector>

namespace tvm_ext {
namespace blas {
namespace vendor {

// The files to try, in order: `requested` (the path Python set), then the environment
// variable `env`, each a file or a directory searched in `subdirs` for `names` (a directory
// holding none of them stands for its first name, reported as not found); then `names` on
// the loader's path.
std::vector<std::string> Candidates(const std::string& requested, const char* env,
                                    const std::vector<const char*>& subdirs,
                                    const std::vector<const char*>& names);

// Whether a file (or, with `directory`, a directory) exists at `path`.
bool Exists(const std::string& path, bool directory = false);

template <typename F>
bool Bind(void* lib, const char* name, F* fn) {
  *fn = reinterpret_cast<F>(dlsym(lib, name));
  return *fn != nullptr;
}

// The path of the library `load_locked` (a library's LoadLocked) loads, taking `mu` around it,
// or "" where it cannot be loaded (never throws).
template <typename Load>
std::string LoadedPath(std::mutex& mu, Load load_locked) {
  std::lock_guard<std::mutex> lock(mu);
  try {
    return load_locked().path;
  } catch (const tvm::ffi::Error&) {
    return "";
  }
}

// The DeviceAPI of the CUDA device `dev`, made the current device (a handle belongs to the
// device current at its creation). RuntimeErrors start with `what` ("tvm_ext.cudnn").
tvm::runtime::DeviceAPI* CurrentDevice(DLDevice dev, const char* what);

}  // namespace vendor
}  // namespace blas
}  // namespace tvm_ext

#endif  // TVM_EXT_BLAS_VENDOR_LIBRARY_H_
