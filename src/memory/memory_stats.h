/*!
 * \file memory/memory_stats.h
 * \brief Per-device byte counters kept by tvm_ext's tracked allocators (see memory_stats.cc).
 */
#ifndef TVM_EXT_MEMORY_MEMORY_STATS_H_
#define TVM_EXT_MEMORY_MEMORY_STATS_H_

#include <dlpack/dlpack.h>

#include <cstdint>

namespace tvm_ext {

struct MemoryCounters {
  int64_t in_use;
  int64_t peak_in_use;
  int64_t reserved;
  int64_t peak_reserved;
  int64_t num_allocs;
  int64_t num_frees;
};

/*! \brief The counters of one device (zeros for a device never allocated on). */
MemoryCounters GetMemoryCounters(DLDevice dev);

/*! \brief Whether the VM allocator of this kind on this device is one of ours. */
bool AllocatorIsTracked(DLDevice dev, int alloc_type);

}  // namespace tvm_ext

#endif  // TVM_EXT_MEMORY_MEMORY_STATS_H_
