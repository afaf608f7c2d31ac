/*
 * The layout of one `tvm_ext.blas.gemm` / `tvm_ext.cublas.gemm` call, shared by the CPU and GPU
 * implementations. What DispatchLibraryKernels (passes/dispatch_library.py) passes after the
 * tensors A, B, C is, per tensor, its number of axes and each axis' role:
 *
 *   gemm(A, B, C, nA, roleA_0, .., nB, roleB_0, .., nC, roleC_0, ..)
 *   0 = M, 1 = N, 2 = K, 3 + i = batch dim i, -1 = an axis read at index 0 (no offset)
 *
 * and the function computes, overwriting C, C[b, m, n] = sum_k A[b, m, k] * B[b, k, n] for
 * every batch index b. Axis order is free (a transposed operand is just another order); a batch
 * dim missing from A or B (or of extent 1 there) broadcasts. Tensors are compact row-major, so
 * each role's element stride follows from the shape and the role's axis.
 */
#ifndef TVM_EXT_BLAS_GEMM_LAYOUT_H_
#define TVM_EXT_BLAS_GEMM_LAYOUT_H_

#include <dlpack/dlpack.h>
#include <tvm/ffi/function.h>

#include <cstdint>
#include <string>
#include <vector>

namespace tvm_ext {
namespace blas {

constexpr int kRoleM = 0, kRoleN = 1, kRoleK = 2, kRoleBatch = 3, kRoleUnit = -1;

struct Operand {
  const DLTensor* t = nullptr;
  int64_t row = 0, col = 0;  // element strides of its matrix axes (A: M, K; B: K, N; C: M, N)
  char* base() const { return static_cast<char*>(t->data) + t->byte_offset; }
};

// One batch loop after merging: its extent and the element stride of each operand along it
// (0: broadcast).
struct BatchDim {
  int64_t extent = 1, a = 0, b = 0, c = 0;
};

struct GemmLayout {
  Operand a, b, c;
  int64_t m = 0, n = 0, k = 0;
  // The batch dims, outermost first, with extent-1 dims dropped and adjacent dims merged
  // wherever every operand's strides allow it (e.g. [b0, b1] of a compact C and a broadcast A
  // is one dim), so that the common cases are a single strided batch.
  std::vector<BatchDim> batch;

  int64_t num_batches() const;
  // Element offsets into A, B, C of the batch whose index over dims [0, ndims) (row-major) is
  // `index`; the dims after `ndims` are at index 0.
  void Offsets(int64_t index, size_t ndims, int64_t* oa, int64_t* ob, int64_t* oc) const;
};

// Reads args[0..2] (tensors) and the roles after them; checks the roles, that extents agree and
// that the tensors are compact; `api` names the function in errors. Throws ValueError.
GemmLayout ReadGemmLayout(tvm::ffi::PackedArgs args, const char* api);

// "float32", "bfloat16", "int8x4": for error messages.
std::string DTypeName(DLDataType t);

// Whether a tensor is compact row-major (strides absent or those of its shape).
bool IsCompact(const DLTensor* t);

// How a (rows x cols) matrix with these element strides is handed to a row-major BLAS: `trans`
// (stored as its transpose) and the leading dimension. False when neither axis is contiguous
// (the caller packs it first).
bool RowMajor(int64_t row_stride, int64_t col_stride, int64_t rows, int64_t cols, bool* trans,
              int64_t* ld);

}  // namespace blas
}  // namespace tvm_ext

#endif  // TVM_EXT_BLAS_GEMM_LAYOUT_H_
