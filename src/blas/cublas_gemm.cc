/*
 * `tvm_ext.cublas.gemm(A, B, C, nA, rolesA.., nB, rolesB.., nC, rolesC..)`: the GEMMs of CUDA
 * kernels (arguments and semantics as the CPU one, gemm_layout.h), by cuBLAS loaded at run time
 * (cublas_library.h), enqueued on TVM's current stream of C's device.
 *
 * Types (cublasGemmStridedBatchedEx, compute in float32 so that results match the generated
 * kernels): A and B float32, float16 or bfloat16 with C float32 or of their dtype; float64
 * throughout computes in float64.
 *
 * cuBLAS is column-major: a row-major C = A B is the column-major product C^T = B^T A^T, so B is
 * passed first; a transposed operand (contiguous along its other matrix axis) is just the other
 * op flag. The innermost merged batch dim (gemm_layout.h) is cuBLAS' strided batch; the outer
 * ones, if any, loop here. An operand contiguous along neither matrix axis (a batch dim
 * innermost) is gathered into a compact scratch by 2-D copies first, and such a C computed into
 * scratch and scattered back: correct, slower, and never produced by the common layouts.
 */
#include <tvm/ffi/error.h>
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/function.h>
#include <tvm/ffi/reflection/registry.h>
#include <tvm/runtime/device_api.h>

#include <algorithm>
#include <climits>
#include <cstdint>

#include "blas/cublas_library.h"
#include "blas/gemm_layout.h"
#include "cuda/cuda_driver.h"

namespace tvm_ext {
namespace blas {
namespace {

namespace cb = cublas;

constexpr int64_t kMaxBatchCount = 65535;  // per call, as older cuBLAS required

struct Types {
  int a, b, c, compute;
  size_t ea, eb, ec;  // element bytes
};

int CudaType(DLDataType t) {
  if (t.lanes != 1) return -1;
  if (t.code == kDLFloat && t.bits == 32) return cb::kR32F;
  if (t.code == kDLFloat && t.bits == 64) return cb::kR64F;
  if (t.code == kDLFloat && t.bits == 16) return cb::kR16F;
  if (t.code == kDLBfloat && t.bits == 16) return cb::kR16BF;
  return -1;
}

Types GemmTypes(const GemmLayout& g, const char* api) {
  Types ty{CudaType(g.a.t->dtype), CudaType(g.b.t->dtype), CudaType(g.c.t->dtype), 0,
           g.a.t->dtype.bits / 8u, g.b.t->dtype.bits / 8u, g.c.t->dtype.bits / 8u};
  bool f64 = ty.a == cb::kR64F && ty.b == cb::kR64F && ty.c == cb::kR64F;
  bool mixed = ty.a != -1 && ty.a != cb::kR64F && ty.a == ty.b &&
               (ty.c == cb::kR32F || ty.c == ty.a);
  if (!f64 && !mixed) {
    TVM_FFI_THROW(TypeError) << api << ": unsupported dtypes " << DTypeName(g.a.t->dtype) << ", "
                             << DTypeName(g.b.t->dtype) << ", " << DTypeName(g.c.t->dtype)
                             << ": A and B must be float32, float16 or bfloat16 with C float32 "
                             << "or of their dtype, or all three float64";
  }
  ty.compute = f64 ? cb::kCompute64F : cb::kCompute32F;
  return ty;
}

// How the operands are handed to cuBLAS, the same for every batch.
struct Plan {
  bool ta = false, tb = false, tc = false;  // stored transposed (tc: C as column-major m x n)
  int64_t lda = 0, ldb = 0, ldc = 0;
  bool pack_a = false, pack_b = false, pack_c = false;
};

// `count` elements at element stride src_stride -> at dst_stride (device to device, async).
void Copy(cb::Stream s, const char* src, int64_t src_stride, char* dst, int64_t dst_stride,
          int64_t count, size_t esize) {
  const CudaDriver* cu = CudaDriver::Get();
  if (cu == nullptr || cu->Memcpy2DAsync == nullptr) {
    TVM_FFI_THROW(RuntimeError) << "tvm_ext.cublas.gemm: the CUDA driver is not loaded";
  }
  CudaDriver::Memcpy2D c{};  // for the gathers of operands with no contiguous matrix axis
  c.srcMemoryType = c.dstMemoryType = CudaDriver::kMemoryTypeDevice;
  c.srcDevice = reinterpret_cast<uint64_t>(src), c.srcPitch = src_stride * esize;
  c.dstDevice = reinterpret_cast<uint64_t>(dst), c.dstPitch = dst_stride * esize;
  c.WidthInBytes = esize, c.Height = count;
  cb::CheckDriver(cu->Memcpy2DAsync(&c, s), "cuMemcpy2DAsync");
}

// A (rows x cols) matrix at (row, col) element strides <-> compact row-major `packed`.
void Repack(cb::Stream s, char* strided, int64_t row, int64_t col, int64_t rows, int64_t cols,
            size_t esize, char* packed, bool gather) {
  auto one = [&](char* x, char* p, int64_t count) {
    if (gather) {
      Copy(s, x, col, p, 1, count, esize);
    } else {
      Copy(s, p, 1, x, col, count, esize);
    }
  };
  if (row == col * cols) {  // the rows follow each other: one sequence
    one(strided, packed, rows * cols);
    return;
  }
  for (int64_t r = 0; r < rows; ++r) one(strided + r * row * esize, packed + r * cols * esize,
                                         cols);
}

struct Call {
  const cb::Api* lib;
  cb::Handle h;
  const Types* ty;
  const GemmLayout* g;
  const Plan* p;

  // `count` products at batch strides (elements) sa, sb, sc from these pointers.
  void Run(const char* a, int64_t sa, const char* b, int64_t sb, char* c, int64_t sc,
           int64_t count) const {
    float alpha32 = 1.0f, beta32 = 0.0f;
    double alpha64 = 1.0, beta64 = 0.0;
    bool f64 = ty->compute == cb::kCompute64F;
    const void* alpha = f64 ? static_cast<const void*>(&alpha64) : &alpha32;
    const void* beta = f64 ? static_cast<const void*>(&beta64) : &beta32;
    for (int64_t done = 0; done < count; done += kMaxBatchCount) {
      int batch = static_cast<int>(std::min(kMaxBatchCount, count - done));
      const char* a0 = a + done * sa * ty->ea;
      const char* b0 = b + done * sb * ty->eb;
      char* c0 = c + done * sc * ty->ec;
      cb::Status status;
      if (!p->tc) {  // column-major C^T (n x m) = B^T A^T
        status = lib->gemm(h, p->tb ? cb::kOpT : cb::kOpN, p->ta ? cb::kOpT : cb::kOpN, g->n,
                           g->m, g->k, alpha, b0, ty->b, p->ldb, sb, a0, ty->a, p->lda, sa, beta,
                           c0, ty->c, p->ldc, sc, batch, ty->compute, cb::kGemmDefault);
      } else {  // C stored column-major: C (m x n) = A B
        status = lib->gemm(h, p->ta ? cb::kOpN : cb::kOpT, p->tb ? cb::kOpN : cb::kOpT, g->m,
                           g->n, g->k, alpha, a0, ty->a, p->lda, sa, b0, ty->b, p->ldb, sb, beta,
                           c0, ty->c, p->ldc, sc, batch, ty->compute, cb::kGemmDefault);
      }
      cb::Check(status, "cublasGemmStridedBatchedEx");
    }
  }
};

// The common case: every operand in place; the innermost batch dim in one call.
void InPlace(const Call& call, const GemmLayout& g, const Types& ty) {
  size_t nb = g.batch.size();
  BatchDim inner = nb ? g.batch.back() : BatchDim{};
  int64_t outer = g.num_batches() / inner.extent;
  for (int64_t o = 0; o < outer; ++o) {
    int64_t oa, ob, oc;
    g.Offsets(o, nb ? nb - 1 : 0, &oa, &ob, &oc);
    call.Run(g.a.base() + oa * ty.ea, inner.a, g.b.base() + ob * ty.eb, inner.b,
             g.c.base() + oc * ty.ec, inner.c, inner.extent);
  }
}

// The rare case: some operand is contiguous along neither matrix axis; batch by batch through
// compact scratch from TVM's workspace pool (stream-ordered like a generated kernel's scratch:
// every use is enqueued on this stream before it is freed).
void Packed(const Call& call, const GemmLayout& g, const Types& ty, DLDevice dev,
            cb::Stream s) {
  const Plan& p = *call.p;
  auto* device_api = tvm::runtime::DeviceAPI::Get(dev);
  size_t bytes_a = p.pack_a ? g.m * g.k * ty.ea : 0, bytes_b = p.pack_b ? g.k * g.n * ty.eb : 0;
  size_t bytes_c = p.pack_c ? g.m * g.n * ty.ec : 0;
  char* scratch = static_cast<char*>(
      device_api->AllocWorkspace(dev, bytes_a + bytes_b + bytes_c + 512));
  char* pa = scratch;
  char* pb = pa + (bytes_a + 255) / 256 * 256;
  char* pc = pb + (bytes_b + 255) / 256 * 256;
  for (int64_t i = 0; i < g.num_batches(); ++i) {
    int64_t oa, ob, oc;
    g.Offsets(i, g.batch.size(), &oa, &ob, &oc);
    char* a = g.a.base() + oa * ty.ea;
    char* b = g.b.base() + ob * ty.eb;
    char* c = g.c.base() + oc * ty.ec;
    if (p.pack_a) Repack(s, a, g.a.row, g.a.col, g.m, g.k, ty.ea, pa, true), a = pa;
    if (p.pack_b) Repack(s, b, g.b.row, g.b.col, g.k, g.n, ty.eb, pb, true), b = pb;
    call.Run(a, 0, b, 0, p.pack_c ? pc : c, 0, 1);
    if (p.pack_c) Repack(s, c, g.c.row, g.c.col, g.m, g.n, ty.ec, pc, false);
  }
  device_api->FreeWorkspace(dev, scratch);
}

}  // namespace

void CublasGemm(tvm::ffi::PackedArgs args) {
  const char* api = "tvm_ext.cublas.gemm";
  GemmLayout g = ReadGemmLayout(args, api);
  DLDevice dev = g.c.t->device;
  for (const DLTensor* t : {g.a.t, g.b.t, g.c.t}) {
    if (t->device.device_type != kDLCUDA || t->device.device_id != dev.device_id) {
      TVM_FFI_THROW(ValueError) << api << ": A, B and C must be on one CUDA device (device "
                                << "types " << g.a.t->device.device_type << ", "
                                << g.b.t->device.device_type << ", " << dev.device_type
                                << " given; 2 is CUDA)";
    }
  }
  Types ty = GemmTypes(g, api);
  if (g.m == 0 || g.n == 0 || g.num_batches() == 0) return;
  Plan p;
  // Packed operands are compact row-major (not transposed) in the scratch.
  if (!RowMajor(g.a.row, g.a.col, g.m, g.k, &p.ta, &p.lda)) p.pack_a = true, p.ta = false,
                                                              p.lda = g.k;
  if (!RowMajor(g.b.row, g.b.col, g.k, g.n, &p.tb, &p.ldb)) p.pack_b = true, p.tb = false,
                                                              p.ldb = g.n;
  if (!RowMajor(g.c.row, g.c.col, g.m, g.n, &p.tc, &p.ldc)) p.pack_c = true, p.tc = false,
                                                              p.ldc = g.n;
  if (std::max({g.m, g.n, g.k, p.lda, p.ldb, p.ldc}) > INT_MAX) {
    TVM_FFI_THROW(ValueError) << api << ": a " << g.m << "x" << g.k << " by " << g.k << "x"
                              << g.n << " product is beyond cuBLAS' 32-bit dimensions";
  }

  std::lock_guard<std::mutex> lock(cb::Mutex());
  const cb::Api& lib = cb::LoadLocked();
  cb::Stream stream = TVMFFIEnvGetStream(kDLCUDA, dev.device_id);
  cb::Handle h = cb::HandleLocked(dev, stream);
  if (g.k == 0) {  // an empty sum: C = 0 (C is compact and every element of it is an output)
    const CudaDriver* cu = CudaDriver::Get();
    if (cu == nullptr || cu->MemsetD8Async == nullptr) {
      TVM_FFI_THROW(RuntimeError) << api << ": the CUDA driver is not loaded";
    }
    size_t bytes = ty.ec;
    for (int i = 0; i < g.c.t->ndim; ++i) bytes *= g.c.t->shape[i];
    cb::CheckDriver(cu->MemsetD8Async(reinterpret_cast<uint64_t>(g.c.base()), 0, bytes,
                                      stream), "cuMemsetD8Async");
    return;
  }
  Call call{&lib, h, &ty, &g, &p};
  if (p.pack_a || p.pack_b || p.pack_c) {
    Packed(call, g, ty, dev, stream);
  } else {
    InPlace(call, g, ty);
  }
}

}  // namespace blas
}  // namespace tvm_ext

TVM_FFI_STATIC_INIT_BLOCK() {
  namespace refl = tvm::ffi::reflection;
  namespace blas = tvm_ext::blas;
  refl::GlobalDef()
      .def_packed("tvm_ext.cublas.gemm",
                  [](tvm::ffi::PackedArgs args, tvm::ffi::Any*) { blas::CublasGemm(args); })
      .def("tvm_ext.cublas.set_library",
           [](tvm::ffi::String path) { blas::cublas::SetLibraryPath(std::string(path)); })
      .def("tvm_ext.cublas.available",
           []() { return tvm::ffi::String(blas::cublas::AvailablePath()); })
      .def("tvm_ext.cublas.workspace_bytes",
           []() { return static_cast<int64_t>(blas::cublas::kWorkspaceBytes); });
}
