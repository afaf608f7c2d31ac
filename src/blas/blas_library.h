/*
 * The CPU BLAS, loaded at run time (dlopen), so that the runtime library links no BLAS and an
 * exported module deploys on any machine that has one: the scipy-openblas32 wheel's
 * libscipy_openblas.so (symbols prefixed `scipy_`), a system OpenBLAS, or any CBLAS.
 */
#ifndef TVM_EXT_BLAS_BLAS_LIBRARY_H_
#define TVM_EXT_BLAS_BLAS_LIBRARY_H_

#include <string>

namespace tvm_ext {
namespace blas {

// CBLAS ABI values (cblas.h).
enum CblasOrder { kRowMajor = 101 };
enum CblasTranspose { kNoTrans = 111, kTrans = 112 };

using SgemmFn = void (*)(int order, int trans_a, int trans_b, int m, int n, int k, float alpha,
                         const float* a, int lda, const float* b, int ldb, float beta, float* c,
                         int ldc);
using DgemmFn = void (*)(int order, int trans_a, int trans_b, int m, int n, int k, double alpha,
                         const double* a, int lda, const double* b, int ldb, double beta,
                         double* c, int ldc);
using SetThreadsFn = void (*)(int);
using GetThreadsFn = int (*)();

struct BlasLibrary {
  std::string path;
  SgemmFn sgemm = nullptr;
  DgemmFn dgemm = nullptr;
  SetThreadsFn set_threads = nullptr;
  GetThreadsFn get_threads = nullptr;
};

// The loaded library; throws a one-line error naming what was tried when none loads.
const BlasLibrary& Library();
// Where to look first (set by Python from the scipy-openblas32 wheel); before the first use.
void SetLibraryPath(const std::string& path);
// The loaded library's path, or "" when none can be loaded (never throws).
std::string AvailablePath();

}  // namespace blas
}  // namespace tvm_ext

#endif  // TVM_EXT_BLAS_BLAS_LIBRARY_H_
