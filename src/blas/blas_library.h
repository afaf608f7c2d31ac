/*
 * The CPU BLAS, loaded at run time (dlopen, RTLD_LOCAL), so that the runtime library links no
 * BLAS, builds without one, and an exported module deploys on any machine that has one: the
 * scipy-openblas32 wheel's libscipy_openblas.so (every symbol prefixed `scipy_`), a system
 * OpenBLAS, or any CBLAS. RTLD_LOCAL keeps its symbols from clashing with another BLAS in the
 * process (numpy's, PyTorch's).
 *
 * Search order: the path given to `tvm_ext.blas.set_library` (Python points it at the
 * scipy-openblas32 wheel, tvm_ext/runtime/blas.py), $TVM_EXT_BLAS_LIB, then libscipy_openblas.so,
 * libopenblas.so.0, libopenblas.so, libcblas.so.3, libblas.so.3 on the loader's path.
 */
#ifndef TVM_EXT_BLAS_BLAS_LIBRARY_H_
#define TVM_EXT_BLAS_BLAS_LIBRARY_H_

#include <tvm/ffi/container/map.h>
#include <tvm/ffi/string.h>

#include <string>

namespace tvm_ext {
namespace blas {

// CBLAS ABI values (cblas.h).
enum CblasOrder { kRowMajor = 101 };
enum CblasTranspose { kNoTrans = 111, kTrans = 112 };

// 32-bit integers (LP64 interface: scipy-openblas32, libopenblas.so.0, libcblas.so.3).
using SgemmFn = void (*)(int order, int trans_a, int trans_b, int m, int n, int k, float alpha,
                         const float* a, int lda, const float* b, int ldb, float beta, float* c,
                         int ldc);
using DgemmFn = void (*)(int order, int trans_a, int trans_b, int m, int n, int k, double alpha,
                         const double* a, int lda, const double* b, int ldb, double beta,
                         double* c, int ldc);
// OpenBLAS >= 0.3.30: `count` products at element strides stride_a/b/c.
using SgemmBatchStridedFn = void (*)(int order, int trans_a, int trans_b, int m, int n, int k,
                                     float alpha, const float* a, int lda, int stride_a,
                                     const float* b, int ldb, int stride_b, float beta, float* c,
                                     int ldc, int stride_c, int count);
using DgemmBatchStridedFn = void (*)(int order, int trans_a, int trans_b, int m, int n, int k,
                                     double alpha, const double* a, int lda, int stride_a,
                                     const double* b, int ldb, int stride_b, double beta,
                                     double* c, int ldc, int stride_c, int count);
using SetThreadsFn = void (*)(int);
using SetThreadsLocalFn = int (*)(int);  // returns the calling thread's previous setting
using GetThreadsFn = int (*)();
using GetConfigFn = char* (*)();

struct BlasLibrary {
  std::string path;
  SgemmFn sgemm = nullptr;  // required, as is dgemm
  DgemmFn dgemm = nullptr;
  SgemmBatchStridedFn sgemm_batch_strided = nullptr;  // optional: the rest may be missing
  DgemmBatchStridedFn dgemm_batch_strided = nullptr;
  SetThreadsFn set_threads = nullptr;
  SetThreadsLocalFn set_threads_local = nullptr;
  GetThreadsFn get_threads = nullptr;
  GetConfigFn get_config = nullptr;
  // BLAS threads, as far as known (get_threads, else TVM's thread count, else 0 = unknown).
  int Threads() const;
};

// How a batch of products runs (gemm_cpu.cc, conv2d_cpu.cc): kAuto decides by size;
// TVM_EXT_BLAS_BATCH=loop|strided|pool forces one way (benchmarks, tests). Read at each batched
// call (a getenv, nothing next to a BLAS call), so that one process can compare them.
enum class Strategy { kAuto, kLoop, kStrided, kPool };
Strategy ForcedStrategy();

// The loaded library (loaded at the first call); throws a one-line RuntimeError naming what
// was tried and how to fix it when none loads. Thread-safe; the reference stays valid.
const BlasLibrary& Library();
// Where to look first; a later call with another path makes the next use load that one.
void SetLibraryPath(const std::string& path);
// The loaded library's path, or "" when none can be loaded (never throws).
std::string AvailablePath();
// {"path", "config", "threads", "batch_strided", "error"} for tests and benchmarks.
tvm::ffi::Map<tvm::ffi::String, tvm::ffi::Any> Info();

}  // namespace blas
}  // namespace tvm_ext

#endif  // TVM_EXT_BLAS_BLAS_LIBRARY_H_
