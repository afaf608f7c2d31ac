#include "blas/blas_library.h"

#include <dlfcn.h>
#include <tvm/ffi/error.h>

#include <cstdlib>
#include <mutex>
#include <sstream>
#include <vector>

namespace tvm_ext {
namespace blas {
namespace {

std::mutex mu;
std::string requested_path;  // NOLINT: guarded by mu
BlasLibrary* loaded = nullptr;
std::string load_error;  // NOLINT: why the last attempt failed

void* Symbol(void* lib, const char* name) {
  // scipy-openblas32 prefixes every symbol; a plain OpenBLAS or CBLAS does not.
  std::string prefixed = std::string("scipy_") + name;
  void* sym = dlsym(lib, prefixed.c_str());
  return sym != nullptr ? sym : dlsym(lib, name);
}

BlasLibrary* TryLoad(const std::string& path, std::ostringstream* tried) {
  void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    *tried << (tried->tellp() > 0 ? "; " : "") << path << " (" << dlerror() << ")";
    return nullptr;
  }
  auto* out = new BlasLibrary();
  out->path = path;
  out->sgemm = reinterpret_cast<SgemmFn>(Symbol(lib, "cblas_sgemm"));
  out->dgemm = reinterpret_cast<DgemmFn>(Symbol(lib, "cblas_dgemm"));
  out->set_threads = reinterpret_cast<SetThreadsFn>(Symbol(lib, "openblas_set_num_threads"));
  out->get_threads = reinterpret_cast<GetThreadsFn>(Symbol(lib, "openblas_get_num_threads"));
  if (out->sgemm == nullptr || out->dgemm == nullptr) {
    *tried << (tried->tellp() > 0 ? "; " : "") << path << " (no cblas_sgemm)";
    delete out;
    return nullptr;
  }
  // The BLAS runs on as many threads as TVM's own thread pool.
  const char* threads = std::getenv("TVM_NUM_THREADS");
  if (threads != nullptr && out->set_threads != nullptr && std::atoi(threads) > 0) {
    out->set_threads(std::atoi(threads));
  }
  return out;
}

BlasLibrary* LoadLocked() {
  if (loaded != nullptr) return loaded;
  std::vector<std::string> candidates;
  // TVM_EXT_BLAS_LIB names the BLAS to use: nothing else is tried.
  const char* env = std::getenv("TVM_EXT_BLAS_LIB");
  if (env != nullptr && *env != '\0') candidates.push_back(env);
  if (!requested_path.empty() && candidates.empty()) candidates.push_back(requested_path);
  // Installed by pip, this library is site-packages/tvm_ext/lib/libtvm_ext_runtime.so and the
  // scipy-openblas32 wheel's BLAS is beside the package.
  Dl_info self;
  if (candidates.empty() && dladdr(reinterpret_cast<void*>(&SetLibraryPath), &self) != 0 &&
      self.dli_fname != nullptr) {
    std::string dir(self.dli_fname);
    dir = dir.substr(0, dir.find_last_of('/'));
    candidates.push_back(dir + "/../../scipy_openblas32/lib/libscipy_openblas.so");
  }
  for (const char* name : {"libscipy_openblas.so", "libopenblas.so.0", "libopenblas.so",
                           "libcblas.so.3", "libblas.so.3"}) {
    if (env == nullptr || *env == '\0') candidates.push_back(name);
  }
  std::ostringstream tried;
  for (const auto& path : candidates) {
    loaded = TryLoad(path, &tried);
    if (loaded != nullptr) return loaded;
  }
  load_error = tried.str();
  return nullptr;
}

}  // namespace

void SetLibraryPath(const std::string& path) {
  std::lock_guard<std::mutex> lock(mu);
  requested_path = path;
}

const BlasLibrary& Library() {
  std::lock_guard<std::mutex> lock(mu);
  BlasLibrary* lib = LoadLocked();
  if (lib == nullptr) {
    TVM_FFI_THROW(RuntimeError)
        << "tvm_ext.blas: no BLAS library could be loaded (pip install scipy-openblas32, or "
           "set TVM_EXT_BLAS_LIB to a CBLAS library); tried: "
        << load_error;
  }
  return *lib;
}

std::string AvailablePath() {
  std::lock_guard<std::mutex> lock(mu);
  BlasLibrary* lib = LoadLocked();
  return lib == nullptr ? std::string() : lib->path;
}

}  // namespace blas
}  // namespace tvm_ext
