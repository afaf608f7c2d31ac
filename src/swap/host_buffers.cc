/*!
 * \file swap/host_buffers.cc
 * \brief Host memory for swapped-out tensors: pinned when the device is CUDA, counted always.
 *
 * A device-to-host copy is asynchronous only into page-locked memory, and the VM's own CPU
 * allocator is not pinned. These builtins allocate host buffers through the tracked allocators
 * of memory/memory_stats.cc: on `cuda_host:0` (cudaMallocHost, counted under that device) when the
 * swapping device is CUDA, otherwise on the host device itself (cpu:1 in the CPU stand-in), so
 * host bytes are measured like device bytes. The VM variants take positions in the VM's device
 * list, like `R.memory.alloc_storage`, and use the VM's allocator kind (naive or pooled):
 *
 *   R.call_builtin_with_ctx("tvm_ext.swap.host_storage",
 *       (R.shape([nbytes]), R.prim_value(host), R.prim_value(dev)), ty_args=R.Object)
 *   R.call_builtin_with_ctx("tvm_ext.swap.host_empty",
 *       (R.shape(shape), R.dtype(dtype), R.prim_value(host), R.prim_value(dev)),
 *       ty_args=R.Tensor(shape, dtype))
 */
#include <tvm/ffi/function.h>
#include <tvm/ffi/reflection/registry.h>
#include <tvm/runtime/device_api.h>
#include <tvm/runtime/memory/memory_manager.h>
#include <tvm/runtime/vm/vm.h>

#include <cstdint>

namespace tvm_ext {
namespace swap {

using tvm::runtime::memory::Allocator;
using tvm::runtime::memory::AllocatorType;
using tvm::runtime::memory::MemoryManager;
using tvm::runtime::memory::Storage;
using tvm::runtime::vm::VirtualMachine;

namespace {

constexpr size_t kHostAlignment = 256;  // enough for any device's DMA engine

bool IsHostType(int type) { return type == kDLCPU || type == kDLCUDAHost || type == kDLROCMHost; }

/*! \brief The allocator, and its device, for host buffers of tensors swapped out of `device`. */
Allocator* HostAllocator(DLDevice host, DLDevice device, AllocatorType type, DLDevice* alloc_dev) {
  *alloc_dev = device.device_type == kDLCUDA ? DLDevice{kDLCUDAHost, 0} : host;
  if (!IsHostType(alloc_dev->device_type)) {
    TVM_FFI_THROW(ValueError) << "tvm_ext.swap: host buffers must be on a CPU device, got "
                              << tvm::runtime::DLDeviceType2Str(host.device_type) << ":"
                              << host.device_id;
  }
  return MemoryManager::GetOrCreateAllocator(*alloc_dev, type);
}

tvm::ffi::Tensor HostEmpty(tvm::ffi::Shape shape, DLDataType dtype, DLDevice host, DLDevice device,
                           AllocatorType type) {
  DLDevice alloc_dev;
  return HostAllocator(host, device, type, &alloc_dev)->Empty(shape, dtype, alloc_dev);
}

Storage HostStorage(const tvm::ffi::Shape& size, DLDevice host, DLDevice device,
                    AllocatorType type) {
  if (size.size() != 1 || size[0] < 0) {
    TVM_FFI_THROW(ValueError) << "tvm_ext.swap.host_storage takes a shape [nbytes], got "
                              << size.size() << " dims";
  }
  DLDevice alloc_dev;
  Allocator* alloc = HostAllocator(host, device, type, &alloc_dev);
  DLDataType u8{kDLUInt, 8, 1};
  return Storage(alloc->Alloc(alloc_dev, static_cast<size_t>(size[0]), kHostAlignment, u8), alloc);
}

/*! \brief Device `index` of the VM's device list, with its allocator kind. */
DLDevice VMDevice(void* ctx, int64_t index, AllocatorType* type = nullptr) {
  auto* vm = static_cast<VirtualMachine*>(ctx);
  if (index < 0 || index >= static_cast<int64_t>(vm->devices.size())) {
    TVM_FFI_THROW(IndexError) << "tvm_ext.swap: device index " << index
                              << " is outside the VM's device list of " << vm->devices.size()
                              << " devices";
  }
  if (type != nullptr) *type = vm->allocators[index]->type();
  return vm->devices[index];
}

}  // namespace

TVM_FFI_STATIC_INIT_BLOCK() {
  namespace refl = tvm::ffi::reflection;
  using tvm::ffi::Shape;
  refl::GlobalDef()
      .def("tvm_ext.swap.host_empty",
           [](void* vm, Shape shape, DLDataType dtype, int64_t host_index, int64_t dev_index) {
             AllocatorType type;
             DLDevice host = VMDevice(vm, host_index, &type);
             return HostEmpty(shape, dtype, host, VMDevice(vm, dev_index), type);
           })
      .def("tvm_ext.swap.host_storage",
           [](void* vm, Shape size, int64_t host_index, int64_t dev_index) {
             AllocatorType type;
             DLDevice host = VMDevice(vm, host_index, &type);
             return HostStorage(size, host, VMDevice(vm, dev_index), type);
           })
      // From Python (tests, benchmarks): explicit devices, naive allocator.
      .def("tvm_ext.swap.host_empty_on",
           [](Shape shape, DLDataType dtype, DLDevice host, DLDevice device) {
             return HostEmpty(shape, dtype, host, device, tvm::runtime::memory::kNaive);
           });
}

}  // namespace swap
}  // namespace tvm_ext
