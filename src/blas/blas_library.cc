#include "blas/blas_library.h"

#include <dlfcn.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/function.h>

#include <cstdlib>
#include <mutex>
#include <sstream>
#include <vector>

namespace tvm_ext {
namespace blas {
namespace {

std::mutex mu;                 // guards the three below
std::string requested_path;    // NOLINT: from tvm_ext.blas.set_library
BlasLibrary* loaded = nullptr; // never freed: callers keep references to it
std::string load_error;        // NOLINT: what the last failed search tried

// scipy-openblas32 prefixes every symbol (so that it cannot clash with numpy's OpenBLAS); a
// plain OpenBLAS or CBLAS does not.
template <typename F>
void Bind(void* lib, const char* name, F* fn) {
  void* sym = dlsym(lib, (std::string("scipy_") + name).c_str());
  *fn = reinterpret_cast<F>(sym != nullptr ? sym : dlsym(lib, name));
}

// TVM's thread pool size (TVM_NUM_THREADS, else TVM's own default): the BLAS gets as many.
// OpenBLAS' default, every core, beside TVM's pool oversubscribes whenever TVM uses fewer:
// its threads spin while they wait, and on a loaded machine a GEMM then ran 10-50x slower.
int TvmThreads() {
  auto num_threads = tvm::ffi::Function::GetGlobal("runtime.NumThreads");
  if (num_threads.has_value()) return (*num_threads)().cast<int>();
  const char* env = std::getenv("TVM_NUM_THREADS");
  return env != nullptr ? std::atoi(env) : 0;
}

BlasLibrary* TryLoad(const std::string& path, std::ostringstream* tried) {
  auto note = [&](const std::string& why) {
    *tried << (tried->tellp() > 0 ? "; " : "") << path << " (" << why << ")";
  };
  void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    const char* err = dlerror();
    note(err != nullptr ? err : "not loadable");
    return nullptr;
  }
  auto* out = new BlasLibrary();
  out->path = path;
  Bind(lib, "cblas_sgemm", &out->sgemm);
  Bind(lib, "cblas_dgemm", &out->dgemm);
  if (out->sgemm == nullptr || out->dgemm == nullptr) {
    note("no cblas_sgemm/cblas_dgemm: not a CBLAS");
    delete out;
    dlclose(lib);
    return nullptr;
  }
  Bind(lib, "cblas_sgemm_batch_strided", &out->sgemm_batch_strided);
  Bind(lib, "cblas_dgemm_batch_strided", &out->dgemm_batch_strided);
  Bind(lib, "openblas_set_num_threads", &out->set_threads);
  Bind(lib, "openblas_set_num_threads_local", &out->set_threads_local);
  Bind(lib, "openblas_get_num_threads", &out->get_threads);
  Bind(lib, "openblas_get_config", &out->get_config);
  if (TvmThreads() > 0 && out->set_threads != nullptr) out->set_threads(TvmThreads());
  return out;
}

BlasLibrary* LoadLocked() {
  if (loaded != nullptr) return loaded;
  std::vector<std::string> candidates;
  if (!requested_path.empty()) candidates.push_back(requested_path);
  const char* env = std::getenv("TVM_EXT_BLAS_LIB");
  if (env != nullptr && *env != '\0') candidates.emplace_back(env);
  for (const char* name : {"libscipy_openblas.so", "libopenblas.so.0", "libopenblas.so",
                           "libcblas.so.3", "libblas.so.3"}) {
    candidates.emplace_back(name);
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

int BlasLibrary::Threads() const {
  if (get_threads != nullptr) return get_threads();
  return TvmThreads() > 0 ? TvmThreads() : 0;
}

Strategy ForcedStrategy() {
  const char* env = std::getenv("TVM_EXT_BLAS_BATCH");
  std::string s = env != nullptr ? env : "";
  return s == "loop" ? Strategy::kLoop : s == "strided" ? Strategy::kStrided
                                   : s == "pool" ? Strategy::kPool : Strategy::kAuto;
}

void SetLibraryPath(const std::string& path) {
  std::lock_guard<std::mutex> lock(mu);
  requested_path = path;
  // Switch at the next use (a call in flight keeps the old one, which stays mapped).
  if (loaded != nullptr && loaded->path != path) loaded = nullptr;
}

const BlasLibrary& Library() {
  std::lock_guard<std::mutex> lock(mu);
  BlasLibrary* lib = LoadLocked();
  if (lib == nullptr) {
    TVM_FFI_THROW(RuntimeError)
        << "tvm_ext.blas: no CPU BLAS library could be loaded; fix: `pip install "
           "scipy-openblas32` or set TVM_EXT_BLAS_LIB to a CBLAS library (e.g. "
           "/usr/lib/x86_64-linux-gnu/libopenblas.so.0); tried: "
        << load_error;
  }
  return *lib;
}

std::string AvailablePath() {
  std::lock_guard<std::mutex> lock(mu);
  BlasLibrary* lib = LoadLocked();
  return lib == nullptr ? std::string() : lib->path;
}

tvm::ffi::Map<tvm::ffi::String, tvm::ffi::Any> Info() {
  std::lock_guard<std::mutex> lock(mu);
  BlasLibrary* lib = LoadLocked();
  tvm::ffi::Map<tvm::ffi::String, tvm::ffi::Any> info;
  info.Set("path", tvm::ffi::String(lib ? lib->path : ""));
  const char* config = lib && lib->get_config ? lib->get_config() : nullptr;
  info.Set("config", tvm::ffi::String(config ? config : ""));
  info.Set("threads", static_cast<int64_t>(lib ? lib->Threads() : 0));
  info.Set("batch_strided", static_cast<bool>(lib && lib->sgemm_batch_strided));
  info.Set("error", tvm::ffi::String(lib ? "" : load_error));
  return info;
}

}  // namespace blas
}  // namespace tvm_ext
