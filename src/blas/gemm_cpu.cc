/*
 * `tvm_ext.blas.gemm(A, B, C, roles...)`: the GEMMs of CPU kernels (see gemm_layout.h for the
 * arguments), by the CBLAS that blas_library.cc loads. Each batch is one cblas_?gemm call on
 * the operands in place (a transposed operand is a transpose flag); an operand with no
 * contiguous axis is first packed. Small batched GEMMs (attention) run their batches in
 * parallel on TVM's thread pool, each single-threaded, rather than one after another.
 */
#include <tvm/ffi/error.h>
#include <tvm/ffi/function.h>
#include <tvm/ffi/reflection/registry.h>
#include <tvm/runtime/c_backend_api.h>

#include <cstring>
#include <vector>

#include "blas/blas_library.h"
#include "blas/gemm_layout.h"

namespace tvm_ext {
namespace blas {
namespace {

// Below this many multiply-adds per GEMM, parallelise over the batch instead of inside.
constexpr int64_t kSmallGemm = 64 * 64 * 64 * 4;

template <typename T>
void Pack(const T* src, int64_t row_stride, int64_t col_stride, int64_t rows, int64_t cols,
          T* dst) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) dst[r * cols + c] = src[r * row_stride + c * col_stride];
  }
}

template <typename T>
void Call(const BlasLibrary& lib, bool ta, bool tb, int64_t m, int64_t n, int64_t k,
          const T* a, int64_t lda, const T* b, int64_t ldb, T* c, int64_t ldc) {
  int flag_a = ta ? kTrans : kNoTrans, flag_b = tb ? kTrans : kNoTrans;
  if constexpr (sizeof(T) == 4) {
    lib.sgemm(kRowMajor, flag_a, flag_b, m, n, k, 1.0f, a, lda, b, ldb, 0.0f, c, ldc);
  } else {
    lib.dgemm(kRowMajor, flag_a, flag_b, m, n, k, 1.0, a, lda, b, ldb, 0.0, c, ldc);
  }
}

// One batch: C (m x n) = A (m x k) * B (k x n), each given by its strides.
template <typename T>
void GemmOne(const BlasLibrary& lib, const GemmLayout& g, const T* a, const T* b, T* c) {
  int64_t m = g.m, n = g.n, k = g.k;
  if (k == 0) {
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = 0; j < n; ++j) c[i * g.c.row + j * g.c.col] = T(0);
    }
    return;
  }
  bool ta, tb, tc;
  int64_t lda, ldb, ldc;
  std::vector<T> pa, pb, pc;
  if (!RowMajor(g.a.row, g.a.col, m, k, &ta, &lda)) {
    pa.resize(m * k);
    Pack(a, g.a.row, g.a.col, m, k, pa.data());
    a = pa.data(), ta = false, lda = k;
  }
  if (!RowMajor(g.b.row, g.b.col, k, n, &tb, &ldb)) {
    pb.resize(k * n);
    Pack(b, g.b.row, g.b.col, k, n, pb.data());
    b = pb.data(), tb = false, ldb = n;
  }
  bool direct = RowMajor(g.c.row, g.c.col, m, n, &tc, &ldc);
  if (direct && !tc) {
    Call(lib, ta, tb, m, n, k, a, lda, b, ldb, c, ldc);
  } else if (direct) {
    // C is stored transposed: C^T (n x m) = B^T A^T.
    Call(lib, !tb, !ta, n, m, k, b, ldb, a, lda, c, ldc);
  } else {
    pc.resize(m * n);
    Call(lib, ta, tb, m, n, k, a, lda, b, ldb, pc.data(), n);
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = 0; j < n; ++j) c[i * g.c.row + j * g.c.col] = pc[i * n + j];
    }
  }
}

template <typename T>
struct BatchTask {
  const BlasLibrary* lib;
  const GemmLayout* g;
  int64_t first, last;
  void Run() const {
    const T* a = reinterpret_cast<const T*>(g->a.base());
    const T* b = reinterpret_cast<const T*>(g->b.base());
    T* c = reinterpret_cast<T*>(g->c.base());
    for (int64_t i = first; i < last; ++i) {
      int64_t oa, ob, oc;
      g->Offsets(i, &oa, &ob, &oc);
      GemmOne<T>(*lib, *g, a + oa, b + ob, c + oc);
    }
  }
};

template <typename T>
int ParallelBatch(int task_id, TVMParallelGroupEnv* env, void* cdata) {
  const auto* all = static_cast<const BatchTask<T>*>(cdata);
  int64_t total = all->last, tasks = env->num_task;
  BatchTask<T> part = *all;
  part.first = total * task_id / tasks;
  part.last = total * (task_id + 1) / tasks;
  part.Run();
  return 0;
}

template <typename T>
void Gemm(const GemmLayout& g) {
  const BlasLibrary& lib = Library();
  BatchTask<T> all{&lib, &g, 0, g.num_batches()};
  if (g.m == 0 || g.n == 0 || all.last == 0) return;
  if (all.last > 1 && g.m * g.n * g.k < kSmallGemm) {
    TVMBackendParallelLaunch(ParallelBatch<T>, &all, 0);
  } else {
    all.Run();
  }
}

void CheckDtypes(const GemmLayout& g, const char* api) {
  DLDataType dt = g.c.t->dtype;
  for (const DLTensor* t : {g.a.t, g.b.t}) {
    if (t->dtype.code != dt.code || t->dtype.bits != dt.bits) {
      TVM_FFI_THROW(TypeError) << api << ": A, B and C must have one dtype";
    }
  }
  for (const DLTensor* t : {g.a.t, g.b.t, g.c.t}) {
    if (t->device.device_type != kDLCPU) {
      TVM_FFI_THROW(ValueError) << api << ": tensors must be on the CPU";
    }
  }
  if (dt.code != kDLFloat || (dt.bits != 32 && dt.bits != 64) || dt.lanes != 1) {
    TVM_FFI_THROW(TypeError) << api << ": float32 or float64 only";
  }
}

}  // namespace

void CpuGemm(tvm::ffi::PackedArgs args) {
  const char* api = "tvm_ext.blas.gemm";
  GemmLayout g = ReadGemmLayout(args, api);
  CheckDtypes(g, api);
  if (g.c.t->dtype.bits == 32) {
    Gemm<float>(g);
  } else {
    Gemm<double>(g);
  }
}

}  // namespace blas
}  // namespace tvm_ext
