/*!
 * \file cuda/cuda_driver.h
 * \brief The few CUDA driver entry points the copy streams (streams, events), the kernel
 * graphs (capture, launch) and the cuBLAS calls (memset, strided copies, capture status) need,
 * resolved at run time from libcuda.so.1, so that the runtime library builds and loads without
 * CUDA.
 *
 * cudaStream_t / cudaEvent_t are the driver's CUstream / CUevent, so handles mix freely with
 * those of TVM's CUDA runtime. The driver is used only for devices of type kDLCUDA, which cannot
 * exist unless the real driver is loaded.
 */
#ifndef TVM_EXT_CUDA_CUDA_DRIVER_H_
#define TVM_EXT_CUDA_CUDA_DRIVER_H_

#include <dlfcn.h>

#include <sstream>
#include <string>

namespace tvm_ext {

struct CudaDriver {
  using CUresult = int;
  using CUstream = void*;
  using CUevent = void*;
  static constexpr CUresult kSuccess = 0;
  static constexpr CUresult kNotReady = 600;
  static constexpr unsigned kStreamNonBlocking = 0x1;
  static constexpr unsigned kEventDisableTiming = 0x2;
  static constexpr int kMemoryTypeDevice = 2;   // CU_MEMORYTYPE_DEVICE
  static constexpr int kMemoryTypeUnified = 4;  // CU_MEMORYTYPE_UNIFIED: the driver finds out

  /*! \brief CUDA_MEMCPY2D (cuda.h), field for field. */
  struct Memcpy2D {
    size_t srcXInBytes, srcY;
    int srcMemoryType;
    const void* srcHost;
    unsigned long long srcDevice;  // NOLINT(runtime/int): CUdeviceptr
    void* srcArray;
    size_t srcPitch;
    size_t dstXInBytes, dstY;
    int dstMemoryType;
    void* dstHost;
    unsigned long long dstDevice;  // NOLINT(runtime/int)
    void* dstArray;
    size_t dstPitch;
    size_t WidthInBytes, Height;
  };
  static_assert(sizeof(Memcpy2D) == 128, "CUDA_MEMCPY2D layout");

  CUresult (*StreamCreate)(CUstream*, unsigned) = nullptr;
  CUresult (*EventCreate)(CUevent*, unsigned) = nullptr;
  CUresult (*EventRecord)(CUevent, CUstream) = nullptr;
  CUresult (*EventQuery)(CUevent) = nullptr;
  CUresult (*EventDestroy)(CUevent) = nullptr;
  CUresult (*StreamWaitEvent)(CUstream, CUevent, unsigned) = nullptr;
  CUresult (*GetErrorString)(CUresult, const char**) = nullptr;
  // Optional: strided chunk copies in one call (else row by row through TVM's DeviceAPI).
  CUresult (*Memcpy2DAsync)(const Memcpy2D*, CUstream) = nullptr;
  // Optional (blas/cublas_gemm.cc): an empty product's zeroed output.
  CUresult (*MemsetD8Async)(unsigned long long, unsigned char, size_t,  // NOLINT(runtime/int)
                            CUstream) = nullptr;
  // Optional (blas/cublas_library.cc): whether a stream is under capture (status 1: active),
  // and this thread's capture mode exchanged (2: relaxed).
  static constexpr int kCaptureActive = 1, kCaptureModeRelaxed = 2;
  CUresult (*StreamIsCapturing)(CUstream, int* status) = nullptr;
  CUresult (*ThreadExchangeStreamCaptureMode)(int* mode) = nullptr;

  // Graphs (graph/kernel_graphs.cc); all bound or `HasGraphs()` is false.
  using CUgraph = void*;
  using CUgraphExec = void*;
  static constexpr int kCaptureModeGlobal = 0;
  CUresult (*StreamDestroy)(CUstream) = nullptr;
  CUresult (*StreamBeginCapture)(CUstream, int mode) = nullptr;
  CUresult (*StreamEndCapture)(CUstream, CUgraph*) = nullptr;
  CUresult (*GraphInstantiate)(CUgraphExec*, CUgraph, unsigned long long) = nullptr;  // NOLINT
  CUresult (*GraphLaunch)(CUgraphExec, CUstream) = nullptr;
  CUresult (*GraphExecDestroy)(CUgraphExec) = nullptr;
  CUresult (*GraphDestroy)(CUgraph) = nullptr;
  CUresult (*CtxGetDevice)(int*) = nullptr;
  bool HasGraphs() const {
    return StreamDestroy && StreamBeginCapture && StreamEndCapture && GraphInstantiate &&
           GraphLaunch && GraphExecDestroy && GraphDestroy && CtxGetDevice;
  }

  /*! \brief The driver if libcuda.so.1 is loadable and has every entry point, else nullptr. */
  static const CudaDriver* Get() {
    static const CudaDriver* inst = Load();
    return inst;
  }

  std::string Describe(CUresult r) const {
    const char* msg = nullptr;
    if (GetErrorString) GetErrorString(r, &msg);
    std::ostringstream os;
    os << "CUDA error " << r << (msg ? std::string(" (") + msg + ")" : "");
    return os.str();
  }

 private:
  static const CudaDriver* Load() {
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (lib == nullptr) lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) return nullptr;
    auto* d = new CudaDriver();
    bool ok = Bind(lib, "cuStreamCreate", &d->StreamCreate) &&
              Bind(lib, "cuEventCreate", &d->EventCreate) &&
              Bind(lib, "cuEventRecord", &d->EventRecord) &&
              Bind(lib, "cuEventQuery", &d->EventQuery) &&
              Bind(lib, "cuEventDestroy_v2", &d->EventDestroy) &&
              Bind(lib, "cuStreamWaitEvent", &d->StreamWaitEvent);
    Bind(lib, "cuGetErrorString", &d->GetErrorString);
    Bind(lib, "cuMemcpy2DAsync_v2", &d->Memcpy2DAsync);
    Bind(lib, "cuMemsetD8Async", &d->MemsetD8Async);
    Bind(lib, "cuStreamIsCapturing", &d->StreamIsCapturing);
    Bind(lib, "cuThreadExchangeStreamCaptureMode", &d->ThreadExchangeStreamCaptureMode);
    Bind(lib, "cuStreamDestroy_v2", &d->StreamDestroy);
    Bind(lib, "cuStreamBeginCapture_v2", &d->StreamBeginCapture);
    Bind(lib, "cuStreamEndCapture", &d->StreamEndCapture);
    Bind(lib, "cuGraphInstantiateWithFlags", &d->GraphInstantiate);
    Bind(lib, "cuGraphLaunch", &d->GraphLaunch);
    Bind(lib, "cuGraphExecDestroy", &d->GraphExecDestroy);
    Bind(lib, "cuGraphDestroy", &d->GraphDestroy);
    Bind(lib, "cuCtxGetDevice", &d->CtxGetDevice);
    if (!ok) {  // e.g. tvm_ext's no-device stub: no CUDA tensor can exist then anyway
      delete d;
      return nullptr;
    }
    return d;
  }
  template <typename F>
  static bool Bind(void* lib, const char* name, F* fn) {
    *fn = reinterpret_cast<F>(dlsym(lib, name));
    return *fn != nullptr;
  }
};

}  // namespace tvm_ext

#endif  // TVM_EXT_CUDA_CUDA_DRIVER_H_
