/*!
 * \file memory/memory_stats.cc
 * \brief Measured device memory: allocators that count every byte the Relax VM takes.
 *
 * TVM's MemoryManager asks the global function "DeviceAllocator.<kind>" for an allocator before
 * it falls back to its own; for CPU and CUDA devices <kind> is empty. Registering
 * "DeviceAllocator." therefore puts the allocators below under every VM created after this
 * library is loaded, with no change to TVM. They allocate exactly as TVM's own naive and pooled
 * allocators do (through the DeviceAPI) and keep, per device:
 *   in_use   bytes handed out and not yet freed (what the program holds),
 *   reserved bytes taken from the device (equal to in_use for the naive allocator; the pooled
 *            allocator also holds freed blocks for reuse),
 * and the peak of each since the last reset.
 */
#include "memory/memory_stats.h"

#include <tvm/ffi/function.h>
#include <tvm/ffi/reflection/registry.h>
#include <tvm/runtime/device_api.h>
#include <tvm/runtime/memory/memory_manager.h>

#include <algorithm>
#include <atomic>
#include <map>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

namespace tvm_ext {

using tvm::runtime::DeviceAPI;
using tvm::runtime::memory::Allocator;
using tvm::runtime::memory::AllocatorType;
using tvm::runtime::memory::Buffer;
using tvm::runtime::memory::MemoryManager;

namespace {

struct Counters {
  int64_t in_use = 0;
  int64_t peak_in_use = 0;
  int64_t reserved = 0;
  int64_t peak_reserved = 0;
  int64_t num_allocs = 0;
  int64_t num_frees = 0;
};

class StatsTable {
 public:
  static StatsTable* Global() {
    static auto* inst = new StatsTable();  // never destroyed: allocators outlive static dtors
    return inst;
  }

  void Change(const DLDevice& dev, int64_t in_use_delta, int64_t reserved_delta) {
    std::lock_guard<std::mutex> lock(mu_);
    Counters& c = table_[Key(dev)];
    c.in_use += in_use_delta;
    c.reserved += reserved_delta;
    if (in_use_delta > 0) ++c.num_allocs;
    if (in_use_delta < 0) ++c.num_frees;
    c.peak_in_use = std::max(c.peak_in_use, c.in_use);
    c.peak_reserved = std::max(c.peak_reserved, c.reserved);
  }

  Counters Get(const DLDevice& dev) {
    std::lock_guard<std::mutex> lock(mu_);
    return table_[Key(dev)];
  }

  void ResetPeak(const DLDevice& dev) {
    std::lock_guard<std::mutex> lock(mu_);
    Counters& c = table_[Key(dev)];
    c.peak_in_use = c.in_use;
    c.peak_reserved = c.reserved;
    c.num_allocs = 0;
    c.num_frees = 0;
  }

 private:
  static std::pair<int, int> Key(const DLDevice& dev) {
    return {static_cast<int>(dev.device_type), dev.device_id};
  }
  std::mutex mu_;
  std::map<std::pair<int, int>, Counters> table_;
};

/*! \brief Allocates each request from the device and frees it at once, counting both. */
class TrackedNaiveAllocator final : public Allocator {
 public:
  TrackedNaiveAllocator() : Allocator(tvm::runtime::memory::kNaive) {}
  using Allocator::Alloc;

  Buffer Alloc(DLDevice dev, size_t nbytes, size_t alignment, DLDataType type_hint) final {
    Buffer buf;
    buf.device = dev;
    buf.size = nbytes;
    buf.alloc_type = tvm::runtime::memory::kNaive;
    buf.data = DeviceAPI::Get(dev)->AllocDataSpace(dev, nbytes, alignment, type_hint);
    StatsTable::Global()->Change(dev, static_cast<int64_t>(nbytes), static_cast<int64_t>(nbytes));
    used_ += nbytes;
    return buf;
  }

  void Free(const Buffer& buffer) final {
    DeviceAPI::Get(buffer.device)->FreeDataSpace(buffer.device, buffer.data);
    StatsTable::Global()->Change(buffer.device, -static_cast<int64_t>(buffer.size),
                                 -static_cast<int64_t>(buffer.size));
    used_ -= buffer.size;
  }

  size_t UsedMemory() const final { return used_.load(); }

 private:
  std::atomic<size_t> used_{0};
};

/*!
 * \brief Keeps freed blocks in per-size free lists (sizes rounded to a page) and reuses them;
 * on an allocation failure it returns every cached block to the device and tries once more.
 */
class TrackedPooledAllocator final : public Allocator {
 public:
  static constexpr size_t kPageSize = 4096;
  TrackedPooledAllocator() : Allocator(tvm::runtime::memory::kPooled) {}
  ~TrackedPooledAllocator() { ReleaseAll(); }
  using Allocator::Alloc;

  Buffer Alloc(DLDevice dev, size_t nbytes, size_t alignment, DLDataType type_hint) final {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    size_t size = ((nbytes + kPageSize - 1) / kPageSize) * kPageSize;
    if (size == 0) size = kPageSize;
    Buffer buf;
    auto it = free_.find(size);
    if (it != free_.end() && !it->second.empty()) {
      buf = it->second.back();
      it->second.pop_back();
    } else {
      buf.device = dev;
      buf.size = size;
      buf.alloc_type = tvm::runtime::memory::kPooled;
      try {
        buf.data = DeviceAPI::Get(dev)->AllocDataSpace(dev, size, alignment, type_hint);
      } catch (const tvm::ffi::Error&) {
        ReleaseAll();
        buf.data = DeviceAPI::Get(dev)->AllocDataSpace(dev, size, alignment, type_hint);
      }
      reserved_ += size;
      StatsTable::Global()->Change(dev, 0, static_cast<int64_t>(size));
    }
    requested_[buf.data] = nbytes;
    StatsTable::Global()->Change(dev, static_cast<int64_t>(nbytes), 0);
    return buf;
  }

  void Free(const Buffer& buffer) final {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    auto it = requested_.find(buffer.data);
    int64_t nbytes = it == requested_.end() ? 0 : static_cast<int64_t>(it->second);
    if (it != requested_.end()) requested_.erase(it);
    StatsTable::Global()->Change(buffer.device, -nbytes, 0);
    free_[buffer.size].push_back(buffer);
  }

  void Clear() final { ReleaseAll(); }

  size_t UsedMemory() const final { return reserved_.load(); }

 private:
  void ReleaseAll() {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    for (auto& kv : free_) {
      for (const Buffer& b : kv.second) {
        DeviceAPI::Get(b.device)->FreeDataSpace(b.device, b.data);
        reserved_ -= b.size;
        StatsTable::Global()->Change(b.device, 0, -static_cast<int64_t>(b.size));
      }
    }
    free_.clear();
  }

  std::recursive_mutex mu_;
  std::atomic<size_t> reserved_{0};
  std::unordered_map<size_t, std::vector<Buffer>> free_;
  std::unordered_map<void*, size_t> requested_;
};

}  // namespace

MemoryCounters GetMemoryCounters(DLDevice dev) {
  Counters c = StatsTable::Global()->Get(dev);
  return {c.in_use, c.peak_in_use, c.reserved, c.peak_reserved, c.num_allocs, c.num_frees};
}

bool AllocatorIsTracked(DLDevice dev, int alloc_type) {
  // GetAllocator aborts when none exists yet: create-or-get, which is what the VM does anyway.
  Allocator* alloc =
      MemoryManager::GetOrCreateAllocator(dev, static_cast<AllocatorType>(alloc_type));
  return dynamic_cast<TrackedNaiveAllocator*>(alloc) != nullptr ||
         dynamic_cast<TrackedPooledAllocator*>(alloc) != nullptr;
}

TVM_FFI_STATIC_INIT_BLOCK() {
  namespace refl = tvm::ffi::reflection;
  refl::GlobalDef()
      // Consulted by MemoryManager for CPU, CUDA and pinned-host devices (their kind string is "").
      .def("DeviceAllocator.",
           [](DLDevice dev, int type) -> void* {
             if (type == tvm::runtime::memory::kNaive) return new TrackedNaiveAllocator();
             if (type == tvm::runtime::memory::kPooled) return new TrackedPooledAllocator();
             return nullptr;
           })
      .def("tvm_ext.memory.stats",
           [](DLDevice dev) {
             MemoryCounters c = GetMemoryCounters(dev);
             return tvm::ffi::Array<int64_t>{c.in_use,   c.peak_in_use, c.reserved,
                                             c.peak_reserved, c.num_allocs, c.num_frees};
           })
      .def("tvm_ext.memory.reset_peak",
           [](DLDevice dev) { StatsTable::Global()->ResetPeak(dev); })
      .def("tvm_ext.memory.is_tracked",
           [](DLDevice dev, int alloc_type) { return AllocatorIsTracked(dev, alloc_type); })
      .def("tvm_ext.memory.empty",
           [](tvm::ffi::Shape shape, DLDataType dtype, DLDevice dev) {
             Allocator* alloc =
                 MemoryManager::GetOrCreateAllocator(dev, tvm::runtime::memory::kNaive);
             return alloc->Empty(shape, dtype, dev);
           });
}

}  // namespace tvm_ext
