/*
 * cuBLAS, resolved at run time (dlopen; the few CUDA driver calls `tvm_ext.cublas.gemm`
 * needs come from cuda/cuda_driver.h), so that the runtime library builds without CUDA
 * headers and loads on machines without CUDA; a dispatched kernel run where libcublas is
 * missing raises a one-line error.
 * The declarations are written out here with their ABI values (checked against cuBLAS 13.1's
 * cublas_api.h and CUDA 13's library_types.h / cuda.h): they are stable C ABI since CUDA 11.
 *
 * Search order: the path given to `tvm_ext.cublas.set_library` (Python points it at the
 * nvidia-cublas wheel), $TVM_EXT_CUBLAS_LIB, then libcublas.so.13, libcublas.so.12,
 * libcublas.so on the loader's path. A given path may be the library or a directory holding it
 * (a wheel's root, nvidia/cu13/lib, nvidia/cublas/lib). The wheels' libcublas has no RUNPATH, so
 * its libcublasLt (same directory) is loaded first.
 *
 * One handle per device, created lazily on that device, bound to TVM's current stream of the
 * device (TVMFFIEnvGetStream) before each call, with a workspace of kWorkspaceBytes per stream
 * it has run on (cublasSetStream resets the workspace to cuBLAS' own pool, so it is set again
 * after every stream change; one buffer per stream, because work queued on the previous stream
 * may still be using the previous one). The buffers come from TVM's device API, like every
 * other tensor, and `tvm_ext.cublas.workspace_bytes` tells the memory planners their size.
 * A stream under CUDA graph capture (a fresh stream per capture) uses one more buffer per
 * device, the capture workspace, which every captured graph bakes in: the graphs replay one
 * after another on the VM's stream, never beside each other. It is allocated in relaxed capture
 * mode, since global mode refuses cudaMalloc during a capture.
 */
#ifndef TVM_EXT_BLAS_CUBLAS_LIBRARY_H_
#define TVM_EXT_BLAS_CUBLAS_LIBRARY_H_

#include <dlpack/dlpack.h>

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>

namespace tvm_ext {
namespace blas {
namespace cublas {

using Handle = void*;   // cublasHandle_t
using Status = int;     // cublasStatus_t, 0 = CUBLAS_STATUS_SUCCESS
using Stream = void*;   // cudaStream_t == CUstream
constexpr int kOpN = 0, kOpT = 1;                                   // cublasOperation_t
constexpr int kR32F = 0, kR64F = 1, kR16F = 2, kR16BF = 14;         // cudaDataType
constexpr int kCompute32F = 68, kCompute64F = 70;                    // cublasComputeType_t
constexpr int kGemmDefault = -1;                                     // cublasGemmAlgo_t
// cuBLAS' advice for Hopper (32 MiB; 4 MiB suffices before it). Per device and stream.
constexpr size_t kWorkspaceBytes = size_t(32) << 20;

struct Api {
  std::string path;
  Status (*create)(Handle*) = nullptr;
  Status (*set_stream)(Handle, Stream) = nullptr;
  Status (*set_workspace)(Handle, void*, size_t) = nullptr;
  Status (*gemm)(Handle, int trans_a, int trans_b, int m, int n, int k, const void* alpha,
                 const void* a, int a_type, int lda, long long stride_a,  // NOLINT(runtime/int)
                 const void* b, int b_type, int ldb, long long stride_b,  // NOLINT(runtime/int)
                 const void* beta, void* c, int c_type, int ldc,
                 long long stride_c, int batch_count, int compute_type,  // NOLINT(runtime/int)
                 int algo) = nullptr;
  const char* (*status_name)(Status) = nullptr;  // optional
};

// Guards the loaded state and the handles: a GEMM is enqueued under it (a handle is bound to
// one stream at a time).
std::mutex& Mutex();
// The loaded library (first use loads it); a one-line RuntimeError when it cannot be loaded.
// Call with Mutex() held.
const Api& LoadLocked();
// The handle of `dev`, made current (device), bound to `stream` with its workspace. Mutex() held.
Handle HandleLocked(DLDevice dev, Stream stream);
// "CUBLAS_STATUS_NOT_INITIALIZED (1)" and the like; throws RuntimeError naming `what`.
void Check(Status status, const char* what);
void CheckDriver(int result, const char* what);

void SetLibraryPath(const std::string& path);
// The loaded library's path, or "" when it cannot be loaded (never throws).
std::string AvailablePath();

}  // namespace cublas
}  // namespace blas
}  // namespace tvm_ext

#endif  // TVM_EXT_BLAS_CUBLAS_LIBRARY_H_
