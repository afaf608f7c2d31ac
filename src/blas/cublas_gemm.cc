/*
 * `tvm_ext.cublas.gemm(A, B, C, roles...)`: the GEMMs of CUDA kernels (arguments as in
 * gemm_layout.h), by cuBLAS loaded at run time: neither this library nor an exported module
 * links it, and a machine without it gets a one-line error naming the library when a
 * dispatched kernel runs. No CUDA header is needed to build: the few cuBLAS declarations used
 * are below with their ABI values (cublas_api.h, library_types.h).
 *
 * Row-major C = A B is the column-major product C^T = B^T A^T, so B goes first. One handle
 * per device, on TVM's current stream for that device, with a fixed workspace allocated through
 * TVM's device API (so the memory counters see it; `tvm_ext.cublas.workspace_bytes` is what
 * the swap planner reserves for it).
 */
#include <dlfcn.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/reflection/registry.h>
#include <tvm/runtime/device_api.h>

#include <cstdlib>
#include <map>
#include <mutex>
#include <sstream>
#include <string>

#include "blas/gemm_layout.h"

namespace tvm_ext {
namespace blas {
namespace {

using Handle = void*;
constexpr int kOpN = 0, kOpT = 1;                       // cublasOperation_t
constexpr int kR32F = 0, kR16F = 2, kR16BF = 14;        // cudaDataType
constexpr int kCompute32F = 68;                          // cublasComputeType_t
constexpr int kGemmDefault = -1;                         // cublasGemmAlgo_t
constexpr size_t kWorkspaceBytes = size_t(32) << 20;     // cuBLAS' advice for Hopper

using CreateFn = int (*)(Handle*);
using SetStreamFn = int (*)(Handle, void*);
using SetWorkspaceFn = int (*)(Handle, void*, size_t);
using GemmFn = int (*)(Handle, int, int, int, int, int, const void*, const void*, int, int,
                       long long, const void*, int, int, long long, const void*, void*, int,
                       int, long long, int, int, int);

struct Cublas {
  CreateFn create = nullptr;
  SetStreamFn set_stream = nullptr;
  SetWorkspaceFn set_workspace = nullptr;
  GemmFn gemm = nullptr;
  std::map<int, Handle> handles;  // per device id
};

std::mutex mu;
std::string requested_path;  // NOLINT: guarded by mu
Cublas* loaded = nullptr;

Cublas* LoadLocked() {
  if (loaded != nullptr) return loaded;
  std::string candidates[5];
  int count = 0;
  if (!requested_path.empty()) candidates[count++] = requested_path;
  const char* env = std::getenv("TVM_EXT_CUBLAS_LIB");
  if (env != nullptr && *env != '\0') candidates[count++] = env;
  for (const char* name : {"libcublas.so.13", "libcublas.so.12", "libcublas.so"}) {
    candidates[count++] = name;
  }
  std::ostringstream tried;
  for (int i = 0; i < count; ++i) {
    void* lib = dlopen(candidates[i].c_str(), RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
      tried << (i ? "; " : "") << candidates[i] << " (" << dlerror() << ")";
      continue;
    }
    auto* c = new Cublas();
    c->create = reinterpret_cast<CreateFn>(dlsym(lib, "cublasCreate_v2"));
    c->set_stream = reinterpret_cast<SetStreamFn>(dlsym(lib, "cublasSetStream_v2"));
    c->set_workspace = reinterpret_cast<SetWorkspaceFn>(dlsym(lib, "cublasSetWorkspace_v2"));
    c->gemm = reinterpret_cast<GemmFn>(dlsym(lib, "cublasGemmStridedBatchedEx"));
    if (c->create && c->set_stream && c->set_workspace && c->gemm) return loaded = c;
    tried << (i ? "; " : "") << candidates[i] << " (missing cuBLAS v2 symbols)";
    delete c;
  }
  TVM_FFI_THROW(RuntimeError) << "tvm_ext.cublas: libcublas could not be loaded (install the "
                                 "CUDA toolkit's cuBLAS or pip install nvidia-cublas, or set "
                                 "TVM_EXT_CUBLAS_LIB); tried: " << tried.str();
}

void Check(int status, const char* what) {
  if (status != 0) {
    TVM_FFI_THROW(RuntimeError) << "tvm_ext.cublas: " << what << " failed (cuBLAS status "
                                << status << ")";
  }
}

Handle HandleFor(DLDevice dev) {
  std::lock_guard<std::mutex> lock(mu);
  Cublas* c = LoadLocked();
  auto it = c->handles.find(dev.device_id);
  if (it != c->handles.end()) return it->second;
  Handle h = nullptr;
  Check(c->create(&h), "cublasCreate");
  auto* api = tvm::runtime::DeviceAPI::Get(dev);
  void* workspace = api->AllocDataSpace(dev, kWorkspaceBytes, 256, DLDataType{kDLUInt, 8, 1});
  Check(c->set_workspace(h, workspace, kWorkspaceBytes), "cublasSetWorkspace");
  c->handles[dev.device_id] = h;
  return h;
}

int CudaType(DLDataType t, const char* name) {
  if (t.lanes == 1 && t.code == kDLFloat && t.bits == 32) return kR32F;
  if (t.lanes == 1 && t.code == kDLFloat && t.bits == 16) return kR16F;
  if (t.lanes == 1 && t.code == kDLBfloat && t.bits == 16) return kR16BF;
  TVM_FFI_THROW(TypeError) << "tvm_ext.cublas.gemm: " << name
                           << " must be float32, float16 or bfloat16";
}

// One strided-batched call over the innermost batch dim (or none) at element offsets.
struct Call {
  bool ta, tb, c_transposed;
  int64_t lda, ldb, ldc;
};

}  // namespace

void CublasGemm(tvm::ffi::PackedArgs args) {
  const char* api = "tvm_ext.cublas.gemm";
  GemmLayout g = ReadGemmLayout(args, api);
  DLDevice dev = g.c.t->device;
  for (const DLTensor* t : {g.a.t, g.b.t, g.c.t}) {
    if (t->device.device_type != kDLCUDA || t->device.device_id != dev.device_id) {
      TVM_FFI_THROW(ValueError) << api << ": A, B and C must be on one CUDA device";
    }
  }
  int ta_type = CudaType(g.a.t->dtype, "A"), tb_type = CudaType(g.b.t->dtype, "B");
  int tc_type = CudaType(g.c.t->dtype, "C");
  if (ta_type != tb_type || (tc_type != kR32F && tc_type != ta_type)) {
    TVM_FFI_THROW(TypeError) << api << ": A and B must share a dtype; C is float32 or theirs";
  }
  if (g.m == 0 || g.n == 0 || g.num_batches() == 0) return;
  Call call{};
  bool ok_a = RowMajor(g.a.row, g.a.col, g.m, g.k, &call.ta, &call.lda);
  bool ok_b = RowMajor(g.b.row, g.b.col, g.k, g.n, &call.tb, &call.ldb);
  bool ok_c = RowMajor(g.c.row, g.c.col, g.m, g.n, &call.c_transposed, &call.ldc);
  if (!ok_a || !ok_b || !ok_c) {
    TVM_FFI_THROW(ValueError) << api << ": an operand has no contiguous matrix axis";
  }
  Handle h = HandleFor(dev);
  Check(loaded->set_stream(h, TVMFFIEnvGetStream(kDLCUDA, dev.device_id)), "cublasSetStream");
  // The innermost batch dim is cuBLAS' batch; the others are looped over here.
  size_t nb = g.batch.size();
  int64_t inner = nb ? g.batch[nb - 1] : 1, outer = g.num_batches() / std::max<int64_t>(inner, 1);
  auto stride = [&](const Operand& op) -> long long {
    return nb && op.batch.size() == nb ? op.batch[nb - 1] : 0;
  };
  size_t esize_a = g.a.t->dtype.bits / 8, esize_b = g.b.t->dtype.bits / 8;
  size_t esize_c = g.c.t->dtype.bits / 8;
  float alpha = 1.0f, beta = 0.0f;
  for (int64_t o = 0; o < outer; ++o) {
    int64_t oa, ob, oc;
    g.Offsets(o * inner, &oa, &ob, &oc);
    const char* a = g.a.base() + oa * esize_a;
    const char* b = g.b.base() + ob * esize_b;
    char* c = g.c.base() + oc * esize_c;
    int status;
    if (!call.c_transposed) {  // column-major C^T (n x m) = B^T A^T
      status = loaded->gemm(h, call.tb ? kOpT : kOpN, call.ta ? kOpT : kOpN, g.n, g.m, g.k,
                            &alpha, b, tb_type, call.ldb, stride(g.b), a, ta_type, call.lda,
                            stride(g.a), &beta, c, tc_type, call.ldc, stride(g.c), inner,
                            kCompute32F, kGemmDefault);
    } else {  // C stored column-major: C (m x n) = A B
      status = loaded->gemm(h, call.ta ? kOpN : kOpT, call.tb ? kOpN : kOpT, g.m, g.n, g.k,
                            &alpha, a, ta_type, call.lda, stride(g.a), b, tb_type, call.ldb,
                            stride(g.b), &beta, c, tc_type, call.ldc, stride(g.c), inner,
                            kCompute32F, kGemmDefault);
    }
    Check(status, "cublasGemmStridedBatchedEx");
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
           [](tvm::ffi::String path) {
             std::lock_guard<std::mutex> lock(blas::mu);
             blas::requested_path = std::string(path);
           })
      .def("tvm_ext.cublas.workspace_bytes",
           []() { return static_cast<int64_t>(blas::kWorkspaceBytes); });
}
