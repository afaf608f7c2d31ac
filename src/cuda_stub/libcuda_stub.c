/*
 * A stand-in for the CUDA driver (libcuda.so.1) on machines without a GPU.
 *
 * TVM's CUDA runtime library links the driver. Where no driver is installed it fails to load,
 * and TVM then exports CUDA modules as source that no GPU machine can load back. With this stub
 * loaded first, the runtime library loads, nvcc-compiled device code is packed into the module,
 * and the exported module can be loaded and inspected here. Every call reports that there is no
 * device, so nothing can run on it by mistake.
 */
#include <stddef.h>

typedef int CUresult;
#define CUDA_ERROR_NO_DEVICE 100

static const char kNoDevice[] = "CUDA_ERROR_NO_DEVICE (tvm_ext stub driver: no GPU here)";

CUresult cuGetErrorName(CUresult error, const char** name) {
  (void)error;
  if (name) *name = "CUDA_ERROR_NO_DEVICE";
  return 0;
}
CUresult cuGetErrorString(CUresult error, const char** str) {
  (void)error;
  if (str) *str = kNoDevice;
  return 0;
}
CUresult cuInit(unsigned int flags) { (void)flags; return CUDA_ERROR_NO_DEVICE; }
CUresult cuDriverGetVersion(int* version) { if (version) *version = 0; return CUDA_ERROR_NO_DEVICE; }
CUresult cuDeviceGetCount(int* count) { if (count) *count = 0; return CUDA_ERROR_NO_DEVICE; }
CUresult cuDeviceGetName(char* name, int len, int dev) {
  (void)dev;
  if (name && len > 0) name[0] = '\0';
  return CUDA_ERROR_NO_DEVICE;
}
CUresult cuFuncSetAttribute(void* f, int attr, int value) {
  (void)f; (void)attr; (void)value;
  return CUDA_ERROR_NO_DEVICE;
}
CUresult cuLaunchKernelEx(const void* config, void* f, void** params, void** extra) {
  (void)config; (void)f; (void)params; (void)extra;
  return CUDA_ERROR_NO_DEVICE;
}
CUresult cuLaunchKernel(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                        unsigned bz, unsigned shmem, void* stream, void** params, void** extra) {
  (void)f; (void)gx; (void)gy; (void)gz; (void)bx; (void)by; (void)bz; (void)shmem;
  (void)stream; (void)params; (void)extra;
  return CUDA_ERROR_NO_DEVICE;
}
CUresult cuModuleGetFunction(void** f, void* mod, const char* name) {
  (void)f; (void)mod; (void)name;
  return CUDA_ERROR_NO_DEVICE;
}
CUresult cuModuleLoadData(void** mod, const void* image) {
  (void)mod; (void)image;
  return CUDA_ERROR_NO_DEVICE;
}
CUresult cuModuleUnload(void* mod) { (void)mod; return CUDA_ERROR_NO_DEVICE; }
CUresult cuTensorMapEncodeTiled(void* map, int dtype, unsigned rank, void* addr, const void* dims,
                                const void* strides, const void* box, const void* elem_strides,
                                int interleave, int swizzle, int l2, int oob) {
  (void)map; (void)dtype; (void)rank; (void)addr; (void)dims; (void)strides; (void)box;
  (void)elem_strides; (void)interleave; (void)swizzle; (void)l2; (void)oob;
  return CUDA_ERROR_NO_DEVICE;
}
CUresult cuGetProcAddress(const char* symbol, void** pfn, int version, unsigned long long flags,
                          void* status) {
  (void)symbol; (void)version; (void)flags; (void)status;
  if (pfn) *pfn = NULL;
  return CUDA_ERROR_NO_DEVICE;
}
CUresult cuGetProcAddress_v2(const char* symbol, void** pfn, int version,
                             unsigned long long flags, void* status) {
  return cuGetProcAddress(symbol, pfn, version, flags, status);
}
