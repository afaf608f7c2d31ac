/*
 * `tvm_ext.blas.gemm(A, B, C, roles..)`: the GEMMs of CPU kernels (arguments in gemm_layout.h),
 * float32 (sgemm) and float64 (dgemm), on the CBLAS that blas_library.cc loads.
 *
 * Each operand is passed in place: one contiguous along one of its matrix axes is a transpose
 * flag and a leading dimension; one contiguous along neither (a batch dim innermost) is first
 * packed into a buffer, batch by batch (correct, slower, rare). A batch runs
 *   - in a plain loop when the whole batch is tiny (below 2^18 multiply-adds: 8 heads of
 *     16x16x64): waking other threads costs what they would save;
 *   - as one cblas_?gemm_batch_strided call (OpenBLAS >= 0.3.30, so scipy-openblas32) when its
 *     products are small (OpenBLAS runs a product below 2^18 multiply-adds on one thread
 *     anyway: attention's 64x64x64 heads) or the batch spreads evenly over the BLAS threads:
 *     OpenBLAS hands whole products to its already running threads, one each;
 *   - else as one multi-threaded product after another (few large products);
 *   - without the batch call (another CBLAS), small products go over TVM's thread pool,
 *     single-threaded each (openblas_set_num_threads_local), when there is enough work to
 *     pay for waking the pool.
 * Measured on the 2-core development machine (TVM_EXT_BLAS_BATCH=loop|strided|pool forces one
 * way, for such measurements): the batch call was as fast as a
 * loop of calls or faster on every batched shape tried (8x64x64x64: 21 us against 38 us), and
 * TVM's pool cost about 7 us more than a loop on small batches there.
 */
#include <tvm/ffi/error.h>
#include <tvm/ffi/function.h>
#include <tvm/runtime/c_backend_api.h>

#include <algorithm>
#include <climits>
#include <vector>

#include "blas/blas_library.h"
#include "blas/gemm_layout.h"

namespace tvm_ext {
namespace blas {
namespace {

// How one batch's product is handed to the BLAS, the same for every batch.
struct Plan {
  bool ta = false, tb = false;  // operand stored transposed
  int64_t lda = 0, ldb = 0;
  bool pack_a = false, pack_b = false;  // contiguous along neither matrix axis
  bool swap = false;                    // C stored transposed: compute C^T = B^T A^T
  int64_t ldc = 0;
  bool pack_c = false;                  // C contiguous along neither: compute into a buffer
};

Plan MakePlan(const GemmLayout& g) {
  Plan p;
  if (!RowMajor(g.a.row, g.a.col, g.m, g.k, &p.ta, &p.lda)) p.pack_a = true, p.ta = false,
                                                              p.lda = g.k;
  if (!RowMajor(g.b.row, g.b.col, g.k, g.n, &p.tb, &p.ldb)) p.pack_b = true, p.tb = false,
                                                              p.ldb = g.n;
  if (!RowMajor(g.c.row, g.c.col, g.m, g.n, &p.swap, &p.ldc)) p.pack_c = true, p.swap = false,
                                                              p.ldc = g.n;
  return p;
}

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

// One batch: C (m x n) = A (m x k) B (k x n) at these element pointers.
template <typename T>
void GemmOne(const BlasLibrary& lib, const GemmLayout& g, const Plan& p, const T* a, const T* b,
             T* c) {
  if (g.k == 0) {  // an empty sum; the BLAS would refuse the empty operands' leading dims
    for (int64_t i = 0; i < g.m; ++i) {
      for (int64_t j = 0; j < g.n; ++j) c[i * g.c.row + j * g.c.col] = T(0);
    }
    return;
  }
  std::vector<T> pa, pb, pc;  // only for the rare packed operands
  if (p.pack_a) pa.resize(g.m * g.k), Pack(a, g.a.row, g.a.col, g.m, g.k, pa.data()),
                a = pa.data();
  if (p.pack_b) pb.resize(g.k * g.n), Pack(b, g.b.row, g.b.col, g.k, g.n, pb.data()),
                b = pb.data();
  T* out = p.pack_c ? (pc.resize(g.m * g.n), pc.data()) : c;
  if (p.swap) {
    Call(lib, !p.tb, !p.ta, g.n, g.m, g.k, b, p.ldb, a, p.lda, out, p.ldc);
  } else {
    Call(lib, p.ta, p.tb, g.m, g.n, g.k, a, p.lda, b, p.ldb, out, p.ldc);
  }
  if (p.pack_c) {
    for (int64_t i = 0; i < g.m; ++i) {
      for (int64_t j = 0; j < g.n; ++j) c[i * g.c.row + j * g.c.col] = pc[i * g.n + j];
    }
  }
}

template <typename T>
struct Batches {
  const BlasLibrary* lib;
  const GemmLayout* g;
  const Plan* p;
  int64_t count;
  bool single_threaded;  // restrict the BLAS to the calling thread (pool workers)

  void Run(int64_t first, int64_t last) const {
    const T* a = reinterpret_cast<const T*>(g->a.base());
    const T* b = reinterpret_cast<const T*>(g->b.base());
    T* c = reinterpret_cast<T*>(g->c.base());
    int before = single_threaded && lib->set_threads_local ? lib->set_threads_local(1) : 0;
    for (int64_t i = first; i < last; ++i) {
      int64_t oa, ob, oc;
      g->Offsets(i, g->batch.size(), &oa, &ob, &oc);
      GemmOne<T>(*lib, *g, *p, a + oa, b + ob, c + oc);
    }
    if (single_threaded && lib->set_threads_local) lib->set_threads_local(before);
  }
};

template <typename T>
int RunTask(int task_id, TVMParallelGroupEnv* env, void* cdata) {
  const auto* all = static_cast<const Batches<T>*>(cdata);
  int64_t tasks = env->num_task;
  all->Run(all->count * task_id / tasks, all->count * (task_id + 1) / tasks);
  return 0;
}

// OpenBLAS computes a GEMM of at most this many multiply-adds on one thread (interface/gemm.c:
// SMP_THRESHOLD_MIN * GEMM_MULTITHREAD_THRESHOLD); a batch of them is parallel over the batch
// or not at all.
constexpr int64_t kSingleThreadedGemm = int64_t(65536) * 4;
// Total multiply-adds of a batch below which handing it to other threads (OpenBLAS' or TVM's)
// costs about what it saves (measured: 8x16x16x64, 2^17, ran as fast or faster in a loop).
constexpr int64_t kParallelWork = int64_t(1) << 18;
// For TVM's pool, whose wake-up costs more (measured about 7 us on the development machine).
constexpr int64_t kPoolWork = int64_t(1) << 20;

// The whole batch in one cblas_?gemm_batch_strided call, if the library has it and the batch
// is one strided dim whose offsets fit OpenBLAS' 32-bit index arithmetic.
template <typename T>
bool TryStrided(const BlasLibrary& lib, const GemmLayout& g, const Plan& p) {
  if (g.batch.size() != 1 || p.pack_a || p.pack_b || p.pack_c || g.k == 0) return false;
  const BatchDim& d = g.batch[0];
  if (std::max({d.a, d.b, d.c}) * d.extent > INT_MAX) return false;
  const T* a = reinterpret_cast<const T*>(g.a.base());
  const T* b = reinterpret_cast<const T*>(g.b.base());
  T* c = reinterpret_cast<T*>(g.c.base());
  auto run = [&](auto fn, T one, T zero) {
    if (fn == nullptr) return false;
    if (p.swap) {  // C stored transposed: C^T = B^T A^T
      fn(kRowMajor, p.tb ? kNoTrans : kTrans, p.ta ? kNoTrans : kTrans, g.n, g.m, g.k, one, b,
         p.ldb, d.b, a, p.lda, d.a, zero, c, p.ldc, d.c, d.extent);
    } else {
      fn(kRowMajor, p.ta ? kTrans : kNoTrans, p.tb ? kTrans : kNoTrans, g.m, g.n, g.k, one, a,
         p.lda, d.a, b, p.ldb, d.b, zero, c, p.ldc, d.c, d.extent);
    }
    return true;
  };
  if constexpr (sizeof(T) == 4) {
    return run(lib.sgemm_batch_strided, 1.0f, 0.0f);
  } else {
    return run(lib.dgemm_batch_strided, 1.0, 0.0);
  }
}

template <typename T>
void Gemm(const GemmLayout& g) {
  if (g.m == 0 || g.n == 0 || g.num_batches() == 0) return;
  const BlasLibrary& lib = Library();
  Plan p = MakePlan(g);
  // The CBLAS takes 32-bit ints (scipy-openblas32, the LP64 libopenblas.so.0).
  if (std::max({g.m, g.n, g.k, p.lda, p.ldb, p.ldc}) > INT_MAX) {
    TVM_FFI_THROW(ValueError) << "tvm_ext.blas.gemm: a " << g.m << "x" << g.k << " by " << g.k
                              << "x" << g.n << " product is beyond the 32-bit BLAS interface";
  }
  Batches<T> all{&lib, &g, &p, g.num_batches(), false};
  if (all.count == 1) return all.Run(0, 1);
  // Batched. OpenBLAS' batch call hands whole products to its (already running) threads, each
  // single-threaded: the right thing for small products, and for large ones when the batch
  // spreads evenly over the threads; otherwise one multi-threaded product after another.
  int64_t mnk = g.m * g.n * g.k, threads = std::max(lib.Threads(), 1);
  bool small = mnk <= kSingleThreadedGemm;
  bool even = all.count >= threads && (all.count % threads == 0 || all.count >= 4 * threads);
  Strategy how = ForcedStrategy();
  if (how == Strategy::kAuto) {
    bool has_batch_call = sizeof(T) == 4 ? lib.sgemm_batch_strided != nullptr
                                         : lib.dgemm_batch_strided != nullptr;
    int64_t work = all.count * mnk;
    if (small && work < kParallelWork) {
      how = Strategy::kLoop;  // tiny: one thread does it before others would wake up
    } else if (!has_batch_call) {
      how = small && work >= kPoolWork ? Strategy::kPool : Strategy::kLoop;
    } else {
      how = small || even ? Strategy::kStrided : Strategy::kLoop;
    }
  }
  if (how == Strategy::kStrided && TryStrided<T>(lib, g, p)) return;
  if (how == Strategy::kPool) {
    // Without the batch call: the batch over TVM's thread pool, single-threaded products.
    all.single_threaded = true;
    if (TVMBackendParallelLaunch(RunTask<T>, &all, 0) != 0) {
      TVM_FFI_THROW(RuntimeError) << "tvm_ext.blas.gemm: TVM's thread pool failed";
    }
    return;
  }
  all.Run(0, all.count);
}

void CheckOperands(const GemmLayout& g, const char* api) {
  DLDataType dt = g.c.t->dtype;
  for (const DLTensor* t : {g.a.t, g.b.t, g.c.t}) {
    if (t->device.device_type != kDLCPU) {
      TVM_FFI_THROW(ValueError) << api << ": A, B and C must be CPU tensors (device type "
                                << t->device.device_type << " given)";
    }
    if (t->dtype.code != dt.code || t->dtype.bits != dt.bits || t->dtype.lanes != dt.lanes) {
      TVM_FFI_THROW(TypeError) << api << ": A, B and C must have one dtype (" << DTypeName(
          g.a.t->dtype) << ", " << DTypeName(g.b.t->dtype) << ", " << DTypeName(dt) << " given)";
    }
  }
  if (dt.code != kDLFloat || (dt.bits != 32 && dt.bits != 64) || dt.lanes != 1) {
    TVM_FFI_THROW(TypeError) << api << ": float32 or float64 only (" << DTypeName(dt)
                             << " given)";
  }
}

}  // namespace

void CpuGemm(tvm::ffi::PackedArgs args) {
  const char* api = "tvm_ext.blas.gemm";
  GemmLayout g = ReadGemmLayout(args, api);
  CheckOperands(g, api);
  if (g.c.t->dtype.bits == 32) {
    Gemm<float>(g);
  } else {
    Gemm<double>(g);
  }
}

}  // namespace blas
}  // namespace tvm_ext
