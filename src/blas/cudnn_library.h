/*
 * cuDNN, resolved at run time (dlopen) as cuBLAS is (cublas_library.h): the runtime library
 * builds without cuDNN's headers and loads on machines without it; a convolution dispatched
 * to it where libcudnn is missing raises a one-line error naming the library and the fix.
 * The declarations are written out here with their ABI values (cuDNN 9's cudnn_graph.h and
 * cudnn_cnn.h: the convolution API of cuDNN 7-9, stable C ABI).
 *
 * Search order: the path given to `tvm_ext.cudnn.set_library` (Python points it at the
 * nvidia-cudnn wheel), $TVM_EXT_CUDNN_LIB, then libcudnn.so.9 and libcudnn.so on the loader's
 * path. A given path may be the library or a directory holding it (a wheel's root,
 * nvidia/cudnn/lib, nvidia/cu13/lib). cuDNN 9's libcudnn loads its engines (libcudnn_cnn,
 * libcudnn_ops, ...) by name, so those beside it are loaded first.
 *
 * One handle per device, created lazily on that device and bound to TVM's current stream of
 * the device before each call. A call's workspace (at most kWorkspaceBytes: the algorithm is
 * the heuristics' fastest within it) comes from TVM's workspace pool, stream-ordered like a
 * generated kernel's scratch.
 */
#ifndef TVM_EXT_BLAS_CUDNN_LIBRARY_H_
#define TVM_EXT_BLAS_CUDNN_LIBRARY_H_

#include <dlpack/dlpack.h>

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>

namespace tvm_ext {
namespace blas {
namespace cudnn {

using Handle = void*;  // cudnnHandle_t
using Status = int;    // cudnnStatus_t, 0 = CUDNN_STATUS_SUCCESS
using Stream = void*;  // cudaStream_t == CUstream
using Desc = void*;    // cudnn{Tensor,Filter,Convolution}Descriptor_t
constexpr int kFloat = 0, kHalf = 2, kBFloat16 = 9;  // cudnnDataType_t
constexpr int kNCHW = 0;                              // cudnnTensorFormat_t
constexpr int kCrossCorrelation = 1;                  // cudnnConvolutionMode_t (PyTorch's)
constexpr int kTensorOpMath = 1, kFmaMath = 3;        // cudnnMathType_t (FMA: no TF32)
constexpr int kDeterministic = 1;                     // cudnnDeterminism_t
constexpr size_t kWorkspaceBytes = size_t(64) << 20;

// cudnnConvolutionFwdAlgoPerf_t (and BwdFilterAlgoPerf_t, the same), field for field.
struct AlgoPerf {
  int algo;
  Status status;
  float time;
  size_t memory;
  int determinism;
  int math_type;
  int reserved[3];
};
static_assert(sizeof(AlgoPerf) == 48, "cudnnConvolutionFwdAlgoPerf_t layout");

struct Api {
  std::string path;
  Status (*create)(Handle*) = nullptr;
  Status (*set_stream)(Handle, Stream) = nullptr;
  const char* (*error_string)(Status) = nullptr;
  Status (*create_tensor)(Desc*) = nullptr;
  Status (*set_tensor)(Desc, int dtype, int dims, const int* extents,
                       const int* strides) = nullptr;  // cudnnSetTensorNdDescriptor
  Status (*destroy_tensor)(Desc) = nullptr;
  Status (*create_filter)(Desc*) = nullptr;
  Status (*set_filter)(Desc, int dtype, int format, int k, int c, int h, int w) = nullptr;
  Status (*destroy_filter)(Desc) = nullptr;
  Status (*create_conv)(Desc*) = nullptr;
  Status (*set_conv)(Desc, int pad_h, int pad_w, int stride_h, int stride_w, int dil_h,
                     int dil_w, int mode, int compute_type) = nullptr;
  Status (*set_groups)(Desc, int) = nullptr;
  Status (*set_math)(Desc, int) = nullptr;
  Status (*destroy_conv)(Desc) = nullptr;
  // cudnnGetConvolutionForwardAlgorithm_v7: the heuristics' algorithms, fastest first
  Status (*algorithms)(Handle, Desc x, Desc w, Desc conv, Desc y, int requested,
                       int* returned, AlgoPerf* results) = nullptr;
  Status (*forward)(Handle, const void* alpha, Desc x, const void* x_data, Desc w,
                    const void* w_data, Desc conv, int algo, void* workspace, size_t bytes,
                    const void* beta, Desc y, void* y_data) = nullptr;
  Status (*transform)(Handle, const void* alpha, Desc x, const void* x_data, const void* beta,
                      Desc y, void* y_data) = nullptr;  // cudnnTransformTensor
  // cudnnGetConvolutionBackwardFilterAlgorithm_v7 (its perf results laid out as AlgoPerf)
  Status (*filter_algorithms)(Handle, Desc x, Desc dy, Desc conv, Desc dw, int requested,
                              int* returned, AlgoPerf* results) = nullptr;
  Status (*backward_filter)(Handle, const void* alpha, Desc x, const void* x_data, Desc dy,
                            const void* dy_data, Desc conv, int algo, void* workspace,
                            size_t bytes, const void* beta, Desc dw, void* dw_data) = nullptr;
};

// Guards the loaded state and the handles. Call the functions below with it held.
std::mutex& Mutex();
// The loaded library (first use loads it); a one-line RuntimeError when it cannot be loaded.
const Api& LoadLocked();
// The handle of `dev`, made current (device), bound to `stream`.
Handle HandleLocked(DLDevice dev, Stream stream);
// "CUDNN_STATUS_NOT_SUPPORTED" and the like; throws RuntimeError naming `what`.
void Check(Status status, const char* what);

void SetLibraryPath(const std::string& path);
// The loaded library's path, or "" when it cannot be loaded (never throws).
std::string AvailablePath();

}  // namespace cudnn
}  // namespace blas
}  // namespace tvm_ext

#endif  // TVM_EXT_BLAS_CUDNN_LIBRARY_H_
