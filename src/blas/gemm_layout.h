/*
 * The layout of one `tvm_ext.*.gemm` call: what DispatchLibraryKernels
 * (passes/dispatch_library.py) passes beside the tensors A, B, C is, per tensor, its number of
 * axes and each axis' role: 0 = M, 1 = N, 2 = K, 3 + i = batch dim i, -1 = an axis read at 0.
 * C[b, m, n] = sum_k A[b, m, k] * B[b, k, n] for every batch index b; a batch dim missing from
 * A or B broadcasts. This turns that into extents and element strides (from the tensors'
 * shapes, compact row-major) shared by the CPU and GPU implementations.
 */
#ifndef TVM_EXT_BLAS_GEMM_LAYOUT_H_
#define TVM_EXT_BLAS_GEMM_LAYOUT_H_

#include <dlpack/dlpack.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/function.h>

#include <cstdint>
#include <vector>

namespace tvm_ext {
namespace blas {

struct Operand {
  const DLTensor* t = nullptr;
  int64_t row = 0, col = 0;     // element strides of its matrix axes (A: M, K; B: K, N; C: M, N)
  std::vector<int64_t> batch;   // element stride per batch dim (0: broadcast)
  char* base() const { return static_cast<char*>(t->data) + t->byte_offset; }
};

struct GemmLayout {
  Operand a, b, c;
  int64_t m = 1, n = 1, k = 1;
  std::vector<int64_t> batch;  // extents, from C
  int64_t num_batches() const;
  // Element offsets of batch `index` (row-major over `batch`) into A, B, C.
  void Offsets(int64_t index, int64_t* oa, int64_t* ob, int64_t* oc) const;
};

// Reads args[0..2] (tensors) and the roles after them; `api` names the function in errors.
GemmLayout ReadGemmLayout(tvm::ffi::PackedArgs args, const char* api);

// Whether a tensor is compact row-major (strides absent or those of its shape).
bool IsCompact(const DLTensor* t);

// The strides of an (rows x cols) matrix as BLAS takes it, row-major: transposed or not and
// the leading dimension; false when neither axis is contiguous.
bool RowMajor(int64_t row_stride, int64_t col_stride, int64_t rows, int64_t cols, bool* trans,
              int64_t* ld);

}  // namespace blas
}  // namespace tvm_ext

#endif  // TVM_EXT_BLAS_GEMM_LAYOUT_H_
