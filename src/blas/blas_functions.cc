/*
 * The CPU vendor-library functions compiled kernels call (passes/dispatch_library.py emits
 * `T.call_packed` of these on the kernel's buffers, destination-passing: the output is the last
 * tensor) and their Python-side controls (tvm_ext/runtime/blas.py):
 *
 *   tvm_ext.blas.gemm(A, B, C, nA, rolesA.., nB, rolesB.., nC, rolesC..)   gemm_cpu.cc
 *   tvm_ext.blas.conv2d(X, W, Y, sh, sw, pad_top, pad_left, dh, dw, groups[, 12 axes])
 *   tvm_ext.blas.set_library(path: str)     where to look first for the BLAS
 *   tvm_ext.blas.available() -> str         its path, "" when none loads (never throws)
 *   tvm_ext.blas.info() -> Map              path, config, threads, batch_strided, error
 */
#include <tvm/ffi/function.h>
#include <tvm/ffi/reflection/registry.h>

#include <string>

#include "blas/blas_library.h"

namespace tvm_ext {
namespace blas {
void CpuGemm(tvm::ffi::PackedArgs args);
void CpuConv2d(tvm::ffi::PackedArgs args);
}  // namespace blas
}  // namespace tvm_ext

TVM_FFI_STATIC_INIT_BLOCK() {
  namespace refl = tvm::ffi::reflection;
  namespace blas = tvm_ext::blas;
  refl::GlobalDef()
      .def_packed("tvm_ext.blas.gemm",
                  [](tvm::ffi::PackedArgs args, tvm::ffi::Any*) { blas::CpuGemm(args); })
      .def_packed("tvm_ext.blas.conv2d",
                  [](tvm::ffi::PackedArgs args, tvm::ffi::Any*) { blas::CpuConv2d(args); })
      .def("tvm_ext.blas.set_library",
           [](tvm::ffi::String path) { blas::SetLibraryPath(std::string(path)); })
      .def("tvm_ext.blas.available", []() { return tvm::ffi::String(blas::AvailablePath()); })
      .def("tvm_ext.blas.info", []() { return blas::Info(); });
}
