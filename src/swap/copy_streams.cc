/*!
 * \file swap/copy_streams.cc
 * \brief Asynchronous tensor copies on dedicated copy streams: the runtime of swap offloading.
 *
 * A swapped tensor leaves the device (swap-out: device -> host) and comes back before its next use
 * (swap-in: host -> device). Both are copies that must overlap compute, so they run on copy
 * streams, one per (device, stream id):
 *   - CPU (a stand-in for an accelerator: the VM's device list is [cpu(0), cpu(1)]): a worker
 *     thread per stream runs the copies in FIFO order, holding references to both tensors until
 *     the copy is done, so copies really run while the caller computes.
 *   - CUDA: a non-blocking cudaStream per stream (created through the driver, so that it does
 *     not serialise with kernels on the legacy default stream). A copy first waits for the compute
 *     stream (its source was produced there, its destination was last read there), runs as
 *     cudaMemcpyAsync through TVM's DeviceAPI and records an event; `wait` makes the compute
 *     stream wait for that event without blocking the host. Host buffers are pinned (cuda_host),
 *     otherwise the copy would not be asynchronous.
 *   - Any other device: DeviceAPI streams only (CreateStream / SyncStreamFromTo / StreamSync);
 *     a `wait` then waits for the whole stream.
 * The copy itself always goes through `DeviceAPI::CopyDataFromTo`. Copies on different streams
 * that touch the same memory are ordered automatically (the later one waits for the earlier one).
 *
 * Nothing is lost: a copy whose tensors differ in shape or dtype is refused when it is enqueued,
 * and a copy that fails while running is reported at the latest by the next `wait`/`wait_all` of
 * its stream; both errors name the tensor. A failure poisons the stream: every later copy, `wait`
 * and `wait_all` on it raises the same error (so no result is computed from stale data) until
 * `tvm_ext.swap.reset` clears it.
 *
 * Calling convention (what the SwapOffload pass emits). The function is non-dataflow and
 * impure (after CallTIRRewrite, before StaticPlanBlockMemory). Copies and waits are impure
 * `R.call_packed(..., ty_args=R.Tuple([]))` (never `call_pure_packed`: DCE drops it). `host` and
 * `dev` are positions in the VM's device list ([cpu(0), cpu(1)] or [cuda(0), cpu(0)]), S a stream
 * id (an int >= 0; copies on one stream run in order, e.g. S=0 for swap-outs and S=1 for
 * swap-ins), "a" the tensor's name for error messages. Host buffers: see host_buffers.cc.
 *
 *   hpool = R.call_builtin_with_ctx("tvm_ext.swap.host_storage",
 *               (R.shape([nbytes]), R.prim_value(host), R.prim_value(dev)), ty_args=R.Object)
 *   a_host = R.memory.alloc_tensor(hpool, R.prim_value(off), R.shape([4, 4]), R.dtype("float32"))
 *   # swap-out, right after the producer of `a`
 *   _ = R.call_packed("tvm_ext.swap.copy_async", a, a_host, R.prim_value(S), R.str("a"),
 *                     ty_args=R.Tuple([]))
 *   # before the first kernel that overwrites a's device memory; passing `a` also keeps it
 *   # alive until here (StaticPlanBlockMemory assumes an extern call keeps no reference)
 *   _ = R.call_packed("tvm_ext.swap.wait", a, R.prim_value(S), ty_args=R.Tuple([]))
 *   # swap-in into a2 (a device tensor: ensure_zero_offset of a pool slice), ahead of its use
 *   _ = R.call_packed("tvm_ext.swap.copy_async", a_host, a2, R.prim_value(S), R.str("a"),
 *                     ty_args=R.Tuple([]))
 *   # right before the first kernel that reads a2
 *   _ = R.call_packed("tvm_ext.swap.wait", a2, R.prim_value(S), ty_args=R.Tuple([]))
 *   # before the function returns: every stream (-1) or one stream
 *   _ = R.call_packed("tvm_ext.swap.wait_all", R.prim_value(-1), ty_args=R.Tuple([]))
 *   # a split op's chunk j of `a` along axis k into (to_chunk = 1) or out of (0) a chunk buffer
 *   # whose shape is a's with axis k cut: strided rows where an axis before k is not 1
 *   _ = R.call_packed("tvm_ext.swap.copy_chunk_async", a_host, a_chunk, R.prim_value(S),
 *                     R.prim_value(k), R.prim_value(j), R.prim_value(1), R.str("a"),
 *                     ty_args=R.Tuple([]))
 *   # a chunk's input range read through windows: rows r .. r + chunk rows of a along axis k
 *   # (r may be negative, the range may pass the end: only a's rows are copied)
 *   _ = R.call_packed("tvm_ext.swap.copy_window_async", a_host, a_win, R.prim_value(S),
 *                     R.prim_value(k), R.prim_value(r), R.str("a"), ty_args=R.Tuple([]))
 *
 * `wait(t, S)` waits for every copy on S enqueued so far whose source or destination overlaps
 * t's bytes (any view of the memory works); it returns at once if there is none; S = -1 waits
 * on every stream.
 *
 * On the CPU stand-in an emulated host link (link_emulation.h) can pace each copy between the
 * two devices to latency + bytes / bandwidth of wall time on its stream (off by default).
 *
 * Statistics (per stream: copies, bytes, busy time, the part of it during which no caller was
 * blocked in a wait = overlap with compute, time callers spent blocked, copies paced by the
 * emulated link and how late they ended) and an optional trace of timestamps (trace.h) serve
 * tests and benchmarks; CUDA streams report copies and bytes but no times.
 */
#include "swap/copy_streams.h"

#include <tvm/ffi/container/array.h>
#include <tvm/ffi/function.h>
#include <tvm/ffi/reflection/registry.h>
#include <tvm/runtime/device_api.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#ifdef __linux__
#include <sys/prctl.h>
#endif

#include "cuda/cuda_driver.h"
#include "swap/link_emulation.h"
#include "swap/trace.h"
#include "swap/worker_cpus.h"

namespace tvm_ext {
namespace swap {

using tvm::ffi::Tensor;
using tvm::runtime::DeviceAPI;

namespace {

// ---------------------------------------------------------------------------------------------
// Caller blocking
// ---------------------------------------------------------------------------------------------

/*!
 * \brief Cumulative time during which at least one caller was blocked in a wait. A copy that ran
 * over [t0, t1] overlapped compute for (t1 - t0) - (Blocked(t1) - Blocked(t0)).
 */
class BlockedClock {
 public:
  static BlockedClock* Global() {
    static auto* inst = new BlockedClock();
    return inst;
  }
  /*! \brief A caller starts blocking; returns the time (the clock's own, for exact traces). */
  int64_t Enter() {
    std::lock_guard<std::mutex> lock(mu_);
    int64_t now = NowNs();
    if (count_++ == 0) since_ = now;
    return now;
  }
  int64_t Leave() {
    std::lock_guard<std::mutex> lock(mu_);
    int64_t now = NowNs();
    if (--count_ == 0) total_ += now - since_;
    return now;
  }
  /*! \brief Blocked time up to now, and now. */
  std::pair<int64_t, int64_t> Read() {
    std::lock_guard<std::mutex> lock(mu_);
    int64_t now = NowNs();
    return {total_ + (count_ > 0 ? now - since_ : 0), now};
  }

 private:
  std::mutex mu_;
  int count_ = 0;
  int64_t since_ = 0;
  int64_t total_ = 0;
};

// ---------------------------------------------------------------------------------------------
// Jobs and streams
// ---------------------------------------------------------------------------------------------

bool IsHostType(int type) { return type == kDLCPU || type == kDLCUDAHost || type == kDLROCMHost; }

std::string DeviceStr(DLDevice dev) {
  std::ostringstream os;
  os << tvm::runtime::DLDeviceType2Str(static_cast<int>(dev.device_type)) << ":" << dev.device_id;
  return os.str();
}

std::string ShapeStr(const DLTensor* t) {
  std::ostringstream os;
  os << "(";
  for (int i = 0; i < t->ndim; ++i) os << (i ? ", " : "") << t->shape[i];
  os << (t->ndim == 1 ? ",)" : ")");
  return os.str();
}

/*! \brief The bytes a tensor occupies (tensors are contiguous: checked at enqueue). */
struct Region {
  int device_type = 0;
  int device_id = 0;
  uintptr_t begin = 0;
  uintptr_t end = 0;

  static Region Of(const DLTensor* t) {
    Region r;
    r.device_type = static_cast<int>(t->device.device_type);
    r.device_id = t->device.device_id;
    r.begin = reinterpret_cast<uintptr_t>(t->data) + t->byte_offset;
    r.end = r.begin + tvm::ffi::GetDataSize(*t);
    return r;
  }
  /*! rief The span of `rows` rows of `row_bytes` every `pitch` bytes from `start` in `t`. */
  static Region Rows(const DLTensor* t, int64_t start, int64_t rows, int64_t row_bytes,
                     int64_t pitch) {
    Region r = Of(t);
    r.begin += start;
    r.end = r.begin + (rows - 1) * pitch + row_bytes;
    return r;
  }
  bool Overlaps(const Region& o) const {
    return device_type == o.device_type && device_id == o.device_id && begin < o.end &&
           o.begin < end && begin < end && o.begin < o.end;
  }
};

class CopyStream;

/*! \brief A copy on another stream that a job must run after (they touch the same memory). */
struct Dep {
  std::shared_ptr<CopyStream> stream;
  uint64_t seq;
  bool reads_its_output;  // then the job fails if that copy failed: its input would be stale
};

struct Job {
  uint64_t seq = 0;
  Tensor src;  // held until the copy is done: the caller may drop its references meanwhile
  Tensor dst;
  std::string name;
  DLDevice src_device;
  DLDevice dst_device;
  Region src_region;
  Region dst_region;
  int64_t nbytes = 0;
  // A chunk copy (copy_chunk_async): `rows` rows of `row_bytes`, `src_pitch` / `dst_pitch`
  // apart from `src_start` / `dst_start`; otherwise the whole tensor, one contiguous copy.
  bool chunked = false;
  int64_t rows = 0;
  int64_t row_bytes = 0;
  int64_t src_start = 0;
  int64_t dst_start = 0;
  int64_t src_pitch = 0;
  int64_t dst_pitch = 0;
  int64_t enqueue_ns = 0;
  int64_t paced_ns = 0;  // CPU: the emulated link's time for this copy (0: as fast as memcpy)
  bool inject_failure = false;
  std::vector<Dep> deps;  // CPU: copies on other streams this one must wait for
  CudaDriver::CUevent event = nullptr;  // CUDA: recorded after the copy

  bool Touches(const Region& r) const { return src_region.Overlaps(r) || dst_region.Overlaps(r); }
  /*! \brief Whether `other` (enqueued later, on another stream) must wait for this job. */
  bool ConflictsWith(const Job& other) const {
    return other.dst_region.Overlaps(src_region) || other.dst_region.Overlaps(dst_region) ||
           other.src_region.Overlaps(dst_region);
  }
};

struct StreamStats {
  int64_t copies = 0;
  int64_t bytes = 0;
  int64_t busy_ns = 0;
  int64_t overlap_ns = 0;
  int64_t wait_ns = 0;
  int64_t waits = 0;
  int64_t paced = 0;         // copies paced by the emulated link
  int64_t late = 0;          // of those, copies whose memcpy alone outlasted the link's time
  int64_t overshoot_ns = 0;  // paced copies' end beyond their deadline (wake-up delay, late ones)
};

enum class StreamKind { kCpuWorker, kCudaEvents, kDeviceApi };

/*! \brief Run a job's copy on `stream` (nullptr: synchronous, the CPU workers). */
void RunCopy(const Job& job, void* stream) {
  DLTensor* src = const_cast<DLTensor*>(job.src.GetDLTensorPtr());
  DLTensor* dst = const_cast<DLTensor*>(job.dst.GetDLTensorPtr());
  DeviceAPI* api = DeviceAPI::Get(IsHostType(src->device.device_type) ? dst->device : src->device);
  if (!job.chunked) {
    api->CopyDataFromTo(src, dst, stream);
    return;
  }
  // A CUDA stream: one strided (2D) copy; a row-by-row copy would issue one cudaMemcpyAsync
  // per row, thousands per split op.
  const CudaDriver* cu = stream != nullptr && (src->device.device_type == kDLCUDA ||
                                               dst->device.device_type == kDLCUDA)
                             ? CudaDriver::Get()
                             : nullptr;
  if (cu != nullptr && cu->Memcpy2DAsync != nullptr) {
    CudaDriver::Memcpy2D copy{};
    copy.srcMemoryType = copy.dstMemoryType = CudaDriver::kMemoryTypeUnified;
    copy.srcDevice = reinterpret_cast<uintptr_t>(static_cast<char*>(src->data) +
                                                 src->byte_offset + job.src_start);
    copy.dstDevice = reinterpret_cast<uintptr_t>(static_cast<char*>(dst->data) +
                                                 dst->byte_offset + job.dst_start);
    // One row: any pitch at least its width will do (a chunk of one row has pitch 0).
    copy.srcPitch = static_cast<size_t>(std::max(job.src_pitch, job.row_bytes));
    copy.dstPitch = static_cast<size_t>(std::max(job.dst_pitch, job.row_bytes));
    copy.WidthInBytes = static_cast<size_t>(job.row_bytes);
    copy.Height = static_cast<size_t>(job.rows);
    DeviceAPI::Get(src->device.device_type == kDLCUDA ? src->device : dst->device)
        ->SetDevice(src->device.device_type == kDLCUDA ? src->device : dst->device);
    // Refused (e.g. memory the driver does not know, such as pageable host memory): the
    // row-by-row path below copies it, or reports why not.
    if (cu->Memcpy2DAsync(&copy, stream) == CudaDriver::kSuccess) return;
  }
  // Row by row, each row a contiguous byte range of both tensors.
  int64_t shape[1] = {job.row_bytes};
  DLTensor from = *src, to = *dst;
  from.ndim = to.ndim = 1;
  from.shape = to.shape = shape;
  from.strides = to.strides = nullptr;
  from.dtype = to.dtype = DLDataType{kDLUInt, 8, 1};
  for (int64_t r = 0; r < job.rows; ++r) {
    from.byte_offset = src->byte_offset + job.src_start + r * job.src_pitch;
    to.byte_offset = dst->byte_offset + job.dst_start + r * job.dst_pitch;
    api->CopyDataFromTo(&from, &to, stream);
  }
}

/*! \brief One copy stream: FIFO, its own error state and statistics. */
class CopyStream : public std::enable_shared_from_this<CopyStream> {
 public:
  CopyStream(DLDevice dev, int64_t stream_id) : dev_(dev), stream_id_(stream_id) {
    if (dev.device_type == kDLCPU) {
      kind_ = StreamKind::kCpuWorker;
    } else if (dev.device_type == kDLCUDA && CudaDriver::Get() != nullptr) {
      kind_ = StreamKind::kCudaEvents;
    } else {
      kind_ = StreamKind::kDeviceApi;
    }
  }

  /*! \brief Start the worker or create the device stream (after construction, once shared). */
  void Start() {
    if (kind_ == StreamKind::kCpuWorker) {
      std::string name = "tvm_ext-copy" + std::to_string(stream_id_);
      StartWorker(name.substr(0, 15).c_str(), [self = shared_from_this()] { self->WorkerLoop(); });
    } else if (kind_ == StreamKind::kCudaEvents) {
      const CudaDriver* cu = CudaDriver::Get();
      DeviceAPI::Get(dev_)->SetDevice(dev_);  // makes the primary context current
      CudaDriver::CUresult r = cu->StreamCreate(&handle_, CudaDriver::kStreamNonBlocking);
      if (r != CudaDriver::kSuccess) {
        TVM_FFI_THROW(RuntimeError) << "tvm_ext.swap: cannot create copy stream " << stream_id_
                                    << " on " << DeviceStr(dev_) << ": " << cu->Describe(r);
      }
    } else {
      handle_ = DeviceAPI::Get(dev_)->CreateStream(dev_);
    }
  }

  DLDevice device() const { return dev_; }
  int64_t stream_id() const { return stream_id_; }
  StreamKind kind() const { return kind_; }

  /*! \brief Raise if the stream is poisoned. Caller holds mu_. */
  void CheckHealthyLocked() const {
    if (!error_.empty()) {
      TVM_FFI_THROW(RuntimeError)
          << error_ << " [copy stream " << stream_id_ << " on " << DeviceStr(dev_)
          << " is poisoned: results computed after this copy would be stale; call "
          << "tvm_ext.runtime.swap_streams.reset() to clear it]";
    }
  }

  void Poison(const std::string& message) {
    std::lock_guard<std::mutex> lock(mu_);
    PoisonLocked(message);
  }

  /*! \brief Adds the jobs on this stream that `job` (for another stream) must wait for. */
  void AddConflicts(const Job& job, std::vector<Dep>* deps) {
    std::lock_guard<std::mutex> lock(mu_);
    for (const Job& p : pending_) {
      if (p.ConflictsWith(job)) {
        deps->push_back({shared_from_this(), p.seq, job.src_region.Overlaps(p.dst_region)});
      }
    }
  }

  /*! \brief Enqueue a validated job; `deps` are conflicting jobs on other streams. */
  void Enqueue(Job job, const std::vector<Dep>& deps) {
    std::unique_lock<std::mutex> lock(mu_);
    CheckHealthyLocked();
    job.seq = next_seq_++;
    job.enqueue_ns = NowNs();
    if (kind_ == StreamKind::kCpuWorker) {
      job.deps = deps;
      pending_.push_back(std::move(job));
      // Notified unlocked: a worker woken under the lock would block on it at once, and the
      // caller would pay a second wake-up when it lets go.
      lock.unlock();
      cv_.notify_all();
      return;
    }
    // Device streams: everything is issued here, on the caller's thread.
    ReapLocked();
    DeviceAPI* api = DeviceAPI::Get(dev_);
    api->SetDevice(dev_);
    try {
      // The source was produced, and the destination last read, on the compute stream.
      api->SyncStreamFromTo(dev_, api->GetCurrentStream(dev_), handle_);
      for (const Dep& dep : deps) dep.stream->OrderAfter(dep.seq, handle_);
      if (job.inject_failure) {
        TVM_FFI_THROW(RuntimeError) << "injected failure (tvm_ext.swap.inject_failure)";
      }
      if (job.nbytes > 0) RunCopy(job, handle_);
      if (kind_ == StreamKind::kCudaEvents) {
        const CudaDriver* cu = CudaDriver::Get();
        CudaDriver::CUresult r = cu->EventCreate(&job.event, CudaDriver::kEventDisableTiming);
        if (r == CudaDriver::kSuccess) r = cu->EventRecord(job.event, handle_);
        if (r != CudaDriver::kSuccess) TVM_FFI_THROW(RuntimeError) << cu->Describe(r);
      }
    } catch (const tvm::ffi::Error& err) {
      std::string msg = FailureMessage(job, err.message());
      PoisonLocked(msg);
      TVM_FFI_THROW(RuntimeError) << msg;
    }
    stats_.copies += 1;
    stats_.bytes += job.nbytes;
    Trace::Global()->Add({kTraceCopy, stream_id_, job.nbytes, job.enqueue_ns, job.enqueue_ns,
                          job.enqueue_ns, job.name});
    pending_.push_back(std::move(job));
  }

  /*! \brief Order `waiter` (a device stream) after job `seq` of this stream. */
  void OrderAfter(uint64_t seq, void* waiter) {
    std::lock_guard<std::mutex> lock(mu_);
    if (seq <= completed_seq_) return;
    if (kind_ == StreamKind::kCudaEvents) {
      for (const Job& p : pending_) {
        if (p.seq == seq && p.event != nullptr) {
          const CudaDriver* cu = CudaDriver::Get();
          CudaDriver::CUresult r = cu->StreamWaitEvent(waiter, p.event, 0);
          if (r != CudaDriver::kSuccess) TVM_FFI_THROW(RuntimeError) << cu->Describe(r);
          return;
        }
      }
    }
    DeviceAPI::Get(dev_)->SyncStreamFromTo(dev_, handle_, waiter);
  }

  /*! \brief See Wait() in copy_streams.h. */
  void WaitFor(const Region& region) {
    std::unique_lock<std::mutex> lock(mu_);
    CheckHealthyLocked();
    if (kind_ != StreamKind::kCpuWorker) ReapLocked();
    CheckHealthyLocked();
    const Job* last = nullptr;
    for (const Job& p : pending_) {
      if (p.Touches(region)) last = &p;
    }
    if (last == nullptr) return;
    if (kind_ == StreamKind::kCpuWorker) {
      uint64_t seq = last->seq;
      BlockUntil(&lock, [&] { return completed_seq_ >= seq || !error_.empty(); });
      CheckHealthyLocked();
      return;
    }
    // Device streams: the compute stream waits; the host goes on issuing kernels.
    DeviceAPI* api = DeviceAPI::Get(dev_);
    api->SetDevice(dev_);
    void* compute = api->GetCurrentStream(dev_);
    stats_.waits += 1;
    if (kind_ == StreamKind::kCudaEvents) {
      const CudaDriver* cu = CudaDriver::Get();
      CudaDriver::CUresult r = cu->StreamWaitEvent(compute, last->event, 0);
      if (r != CudaDriver::kSuccess) {
        PoisonLocked(FailureMessage(*last, cu->Describe(r)));
        CheckHealthyLocked();
      }
    } else {
      api->SyncStreamFromTo(dev_, handle_, compute);
    }
  }

  /*! \brief Block until the stream is empty; with `raise`, raise if it failed. */
  void Drain(bool raise) {
    std::unique_lock<std::mutex> lock(mu_);
    if (raise) CheckHealthyLocked();
    if (kind_ == StreamKind::kCpuWorker) {
      BlockUntil(&lock, [&] { return pending_.empty(); });
    } else if (!pending_.empty()) {
      int64_t t0 = NowNs();
      try {
        DeviceAPI::Get(dev_)->StreamSync(dev_, handle_);
      } catch (const tvm::ffi::Error& err) {
        PoisonLocked(FailureMessage(pending_.front(), err.message()));
      }
      ReapLocked();
      if (kind_ == StreamKind::kDeviceApi) {  // no events: the whole stream is done
        completed_seq_ = next_seq_ - 1;
        pending_.clear();
      }
      stats_.wait_ns += NowNs() - t0;
      stats_.waits += 1;
    }
    if (raise) CheckHealthyLocked();
  }

  bool Idle() {
    std::lock_guard<std::mutex> lock(mu_);
    if (kind_ == StreamKind::kCudaEvents) ReapLocked();
    return pending_.empty();
  }

  StreamStats Stats() {
    std::lock_guard<std::mutex> lock(mu_);
    return stats_;
  }
  void ResetStats() {
    std::lock_guard<std::mutex> lock(mu_);
    stats_ = StreamStats();
  }
  void ClearError() {
    std::lock_guard<std::mutex> lock(mu_);
    error_.clear();
  }

 private:
  std::string FailureMessage(const Job& job, const std::string& reason) const {
    std::ostringstream os;
    os << "tvm_ext.swap: copy of tensor '" << job.name << "' (" << DeviceStr(job.src_device)
       << " -> " << DeviceStr(job.dst_device) << ", " << job.nbytes << " bytes) on copy stream "
       << stream_id_ << " failed: " << reason;
    return os.str();
  }

  void PoisonLocked(const std::string& message) {
    if (error_.empty()) error_ = message;  // the first failure is the cause
    cv_.notify_all();
  }

  /*! \brief Wait on cv_ with the caller counted as blocked (not computing). */
  template <typename Pred>
  void BlockUntil(std::unique_lock<std::mutex>* lock, Pred pred) {
    if (pred()) return;
    int64_t t0 = BlockedClock::Global()->Enter();
    cv_.wait(*lock, pred);
    int64_t t1 = BlockedClock::Global()->Leave();
    stats_.wait_ns += t1 - t0;
    stats_.waits += 1;
    Trace::Global()->Add({kTraceWait, stream_id_, 0, t0, t0, t1, ""});
  }

  /*! \brief Device streams: retire finished jobs from the front (drops their references). */
  void ReapLocked() {
    if (kind_ != StreamKind::kCudaEvents || pending_.empty()) return;
    const CudaDriver* cu = CudaDriver::Get();
    DeviceAPI::Get(dev_)->SetDevice(dev_);  // the caller's thread may not have touched CUDA yet
    while (!pending_.empty()) {
      Job& front = pending_.front();
      CudaDriver::CUresult r = cu->EventQuery(front.event);
      if (r == CudaDriver::kNotReady) break;
      if (r != CudaDriver::kSuccess) PoisonLocked(FailureMessage(front, cu->Describe(r)));
      cu->EventDestroy(front.event);
      completed_seq_ = front.seq;
      pending_.pop_front();
    }
  }

  /*!
   * \brief The emulated link: sleep (not spin: the compute keeps the cores) until `deadline`.
   * Returns whether the copy was already past it (its memcpy alone took longer).
   */
  static bool PaceUntil(int64_t deadline) {
    int64_t left = deadline - NowNs();
    if (left <= 0) return true;
    std::this_thread::sleep_for(std::chrono::nanoseconds(left));
    return false;
  }

  void WorkerLoop() {
#ifdef __linux__
    // Wake-ups within ~1 us of a pacing deadline instead of the default 50 us timer slack.
    prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);
#endif
    for (;;) {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return !pending_.empty(); });
      // deque::push_back keeps references valid; only this thread pops.
      Job& job = pending_.front();
      bool skip = !error_.empty();
      lock.unlock();

      std::string failure;
      int64_t start = 0, end = 0, blocked0 = 0, blocked1 = 0;
      bool late = false;
      if (!skip) {
        for (const Dep& dep : job.deps) {
          std::string dep_error = dep.stream->WaitSeq(dep.seq);
          if (!dep_error.empty() && dep.reads_its_output) {
            failure = "it reads or overwrites memory of a failed copy: " + dep_error;
            break;
          }
        }
      }
      if (!skip && failure.empty()) {
        std::tie(blocked0, start) = BlockedClock::Global()->Read();
        try {
          if (job.inject_failure) {
            TVM_FFI_THROW(RuntimeError) << "injected failure (tvm_ext.swap.inject_failure)";
          }
          if (job.nbytes > 0) RunCopy(job, nullptr);
        } catch (const tvm::ffi::Error& err) {
          failure = err.message();
        } catch (const std::exception& err) {
          failure = err.what();
        }
        if (failure.empty() && job.paced_ns > 0) late = PaceUntil(start + job.paced_ns);
        std::tie(blocked1, end) = BlockedClock::Global()->Read();
      }

      if (!failure.empty()) failure = FailureMessage(job, failure);
      // Drop the references before the copy counts as done: a caller that waited for it may
      // then rely on the memory being released (the VM frees what it no longer uses).
      job.src = Tensor();
      job.dst = Tensor();

      lock.lock();
      if (!failure.empty()) {
        PoisonLocked(failure);
      } else if (!skip) {
        ok_through_seq_ = job.seq;
        stats_.copies += 1;
        stats_.bytes += job.nbytes;
        stats_.busy_ns += end - start;
        stats_.overlap_ns += std::max<int64_t>(0, (end - start) - (blocked1 - blocked0));
        if (job.paced_ns > 0) {
          stats_.paced += 1;
          stats_.late += late ? 1 : 0;
          stats_.overshoot_ns += std::max<int64_t>(0, end - (start + job.paced_ns));
        }
        Trace::Global()->Add({kTraceCopy, stream_id_, job.nbytes, job.enqueue_ns, start, end, job.name});
      }
      completed_seq_ = job.seq;
      pending_.pop_front();
      lock.unlock();
      cv_.notify_all();
    }
  }

  /*! \brief Block (a worker) until job `seq` is done; "" if it copied, else the error. */
  std::string WaitSeq(uint64_t seq) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return completed_seq_ >= seq; });  // a poisoned stream skips quickly
    if (seq <= ok_through_seq_) return "";
    return error_.empty() ? "it was not run" : error_;
  }

  DLDevice dev_;
  int64_t stream_id_;
  StreamKind kind_;
  void* handle_ = nullptr;  // device stream (CUDA, DeviceAPI kinds)
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Job> pending_;  // enqueued and not yet retired, in FIFO order
  uint64_t next_seq_ = 1;
  uint64_t completed_seq_ = 0;
  uint64_t ok_through_seq_ = 0;  // CPU: jobs 1..this copied (a failure stops the rest)
  std::string error_;
  StreamStats stats_;
};

/*! \brief All copy streams, keyed by (device type, device id, stream id). Never destroyed. */
class StreamTable {
 public:
  static StreamTable* Global() {
    static auto* inst = new StreamTable();
    return inst;
  }

  std::shared_ptr<CopyStream> GetOrCreate(DLDevice dev, int64_t stream_id) {
    std::lock_guard<std::mutex> lock(mu_);
    auto key = std::make_tuple(static_cast<int>(dev.device_type), dev.device_id, stream_id);
    auto it = streams_.find(key);
    if (it != streams_.end()) return it->second;
    auto stream = std::make_shared<CopyStream>(dev, stream_id);
    stream->Start();
    streams_[key] = stream;
    return stream;
  }

  /*! \brief Streams with this id (kAllStreams: all), in a fixed order. */
  std::vector<std::shared_ptr<CopyStream>> Select(int64_t stream_id) {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<std::shared_ptr<CopyStream>> out;
    for (const auto& kv : streams_) {
      if (stream_id == kAllStreams || std::get<2>(kv.first) == stream_id) out.push_back(kv.second);
    }
    return out;
  }

  /*! \brief Consume one injected failure for `stream_id`, if any is armed. */
  bool TakeInjectedFailure(int64_t stream_id) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = injected_.find(stream_id);
    if (it == injected_.end() || it->second <= 0) return false;
    --it->second;
    return true;
  }
  void InjectFailures(int64_t stream_id, int64_t count) {
    std::lock_guard<std::mutex> lock(mu_);
    injected_[stream_id] = count;
  }
  void ClearInjected() {
    std::lock_guard<std::mutex> lock(mu_);
    injected_.clear();
  }

 private:
  std::mutex mu_;
  std::map<std::tuple<int, int, int64_t>, std::shared_ptr<CopyStream>> streams_;
  std::map<int64_t, int64_t> injected_;
};

/*! \brief The device whose stream carries a copy: the accelerator side, or cpu:0 for CPU-only. */
DLDevice StreamDevice(const DLTensor* src, const DLTensor* dst) {
  if (!IsHostType(src->device.device_type)) return src->device;
  if (!IsHostType(dst->device.device_type)) return dst->device;
  return DLDevice{kDLCPU, 0};
}

/*! \brief Why `dst <- src` cannot be copied, or "" if it can (`same_shape`: as a whole). */
std::string ValidationError(const DLTensor* src, const DLTensor* dst, bool same_shape = true) {
  std::ostringstream os;
  if (same_shape && (src->ndim != dst->ndim ||
                     !std::equal(src->shape, src->shape + src->ndim, dst->shape))) {
    os << "shape mismatch: source " << ShapeStr(src) << ", destination " << ShapeStr(dst);
  } else if (src->dtype.code != dst->dtype.code || src->dtype.bits != dst->dtype.bits ||
             src->dtype.lanes != dst->dtype.lanes) {
    os << "dtype mismatch: source " << tvm::ffi::DLDataTypeToString(src->dtype)
       << ", destination " << tvm::ffi::DLDataTypeToString(dst->dtype);
  } else if (!tvm::ffi::IsContiguous(*src) || !tvm::ffi::IsContiguous(*dst)) {
    os << "only contiguous tensors can be copied";
  } else {
    int s = src->device.device_type, d = dst->device.device_type;
    bool both_host = IsHostType(s) && IsHostType(d);
    bool one_device = IsHostType(s) != IsHostType(d);
    bool same_device_type = s == d;
    if (!(both_host || one_device || same_device_type)) {
      os << "unsupported device pair " << DeviceStr(src->device) << " -> "
         << DeviceStr(dst->device);
    }
  }
  return os.str();
}

}  // namespace

namespace {

/*!
 * \brief Check and enqueue `job` (its tensors, name, geometry and byte count set) on copy stream
 * `stream_id`; `what` names the call in errors, `shape_error` is a refusal found by the caller.
 */
void Submit(Job job, int64_t stream_id, const char* what, const std::string& shape_error) {
  if (!(job.src.defined() && job.dst.defined())) TVM_FFI_THROW(ValueError)
      << what << " of '" << job.name << "': source and destination must be tensors";
  if (!(stream_id >= 0)) TVM_FFI_THROW(ValueError)
      << what << " of '" << job.name << "': stream id must be >= 0, got " << stream_id;
  const DLTensor* s = job.src.GetDLTensorPtr();
  const DLTensor* d = job.dst.GetDLTensorPtr();
  std::shared_ptr<CopyStream> stream =
      StreamTable::Global()->GetOrCreate(StreamDevice(s, d), stream_id);
  std::string invalid = shape_error.empty() ? ValidationError(s, d, !job.chunked) : shape_error;
  if (!invalid.empty()) {
    std::ostringstream os;
    os << "tvm_ext.swap: copy of tensor '" << job.name << "' (" << DeviceStr(s->device) << " -> "
       << DeviceStr(d->device) << ") on copy stream " << stream_id << " refused: " << invalid;
    stream->Poison(os.str());
    TVM_FFI_THROW(ValueError) << os.str();
  }
  job.src_device = s->device;
  job.dst_device = d->device;
  if (!job.chunked || job.nbytes == 0) {
    job.src_region = Region::Of(s);
    job.dst_region = Region::Of(d);
  } else {
    job.src_region = Region::Rows(s, job.src_start, job.rows, job.row_bytes, job.src_pitch);
    job.dst_region = Region::Rows(d, job.dst_start, job.rows, job.row_bytes, job.dst_pitch);
  }
  // The emulated link paces copies between two devices on the CPU stand-in's worker streams.
  EmulatedLink link = CurrentLink();
  bool crosses = s->device.device_type != d->device.device_type ||
                 s->device.device_id != d->device.device_id;
  if (link.on() && crosses && stream->kind() == StreamKind::kCpuWorker) {
    job.paced_ns = link.DurationNs(job.nbytes);
  }
  job.inject_failure = StreamTable::Global()->TakeInjectedFailure(stream_id);
  // Copies on other streams that touch the same memory run first.
  std::vector<Dep> deps;
  for (const auto& other : StreamTable::Global()->Select(kAllStreams)) {
    // Streams of one device only: a CPU worker must not wait on a CUDA stream's bookkeeping.
    DLDevice a = other->device(), b = stream->device();
    if (other != stream && a.device_type == b.device_type && a.device_id == b.device_id) {
      other->AddConflicts(job, &deps);
    }
  }
  stream->Enqueue(std::move(job), deps);
}

/*! \brief Why `chunk` is not chunk `index` along `axis` of `whole`, or "". */
std::string ChunkError(const DLTensor* whole, const DLTensor* chunk, int64_t axis, int64_t index) {
  std::ostringstream os;
  bool shapes = whole->ndim == chunk->ndim && axis >= 0 && axis < whole->ndim;
  for (int i = 0; shapes && i < whole->ndim; ++i) {
    shapes = i == axis ? chunk->shape[i] > 0 && whole->shape[i] % chunk->shape[i] == 0
                       : chunk->shape[i] == whole->shape[i];
  }
  if (!shapes) {
    os << "chunk " << ShapeStr(chunk) << " is not a chunk of " << ShapeStr(whole) << " along axis "
       << axis;
  } else if (index < 0 || index >= whole->shape[axis] / chunk->shape[axis]) {
    os << "chunk index " << index << " out of range for " << whole->shape[axis] / chunk->shape[axis]
       << " chunks";
  }
  return os.str();
}

}  // namespace

void CopyAsync(Tensor src, Tensor dst, int64_t stream_id, const std::string& name) {
  Job job;
  job.src = src;
  job.dst = dst;
  job.name = name;
  if (src.defined()) job.nbytes = static_cast<int64_t>(tvm::ffi::GetDataSize(*src.GetDLTensorPtr()));
  Submit(std::move(job), stream_id, "tvm_ext.swap.copy_async", "");
}

void CopyChunkAsync(Tensor whole, Tensor chunk, int64_t stream_id, int64_t axis, int64_t index,
                    bool to_chunk, const std::string& name) {
  Job job;
  job.src = to_chunk ? whole : chunk;
  job.dst = to_chunk ? chunk : whole;
  job.name = name;
  std::string error;
  if (whole.defined() && chunk.defined()) {
    const DLTensor* w = whole.GetDLTensorPtr();
    const DLTensor* c = chunk.GetDLTensorPtr();
    error = ChunkError(w, c, axis, index);
    if (error.empty()) {
      // Rows: the axes before `axis`; each row is the chunk's slab of the axes from `axis` on.
      int64_t inner = (c->dtype.bits * c->dtype.lanes + 7) / 8;
      for (int i = axis + 1; i < c->ndim; ++i) inner *= c->shape[i];
      job.chunked = true;
      job.rows = 1;
      for (int i = 0; i < axis; ++i) job.rows *= c->shape[i];
      job.row_bytes = c->shape[axis] * inner;
      int64_t whole_pitch = w->shape[axis] * inner;
      int64_t whole_start = index * job.row_bytes;
      job.src_start = to_chunk ? whole_start : 0;
      job.dst_start = to_chunk ? 0 : whole_start;
      job.src_pitch = to_chunk ? whole_pitch : job.row_bytes;
      job.dst_pitch = to_chunk ? job.row_bytes : whole_pitch;
      job.nbytes = job.rows * job.row_bytes;
    }
  }
  Submit(std::move(job), stream_id, "tvm_ext.swap.copy_chunk_async", error);
}

void CopyWindowAsync(Tensor whole, Tensor chunk, int64_t stream_id, int64_t axis,
                     int64_t start, const std::string& name) {
  Job job;
  job.src = whole;
  job.dst = chunk;
  job.name = name;
  std::string error;
  if (whole.defined() && chunk.defined()) {
    const DLTensor* w = whole.GetDLTensorPtr();
    const DLTensor* c = chunk.GetDLTensorPtr();
    bool shapes = w->ndim == c->ndim && axis >= 0 && axis < w->ndim;
    for (int i = 0; shapes && i < w->ndim; ++i) {
      shapes = i == axis ? c->shape[i] > 0 : c->shape[i] == w->shape[i];
    }
    int64_t lo = std::max<int64_t>(start, 0);
    int64_t hi = shapes ? std::min(start + c->shape[axis], w->shape[axis]) : 0;
    if (!shapes) {
      error = "window " + ShapeStr(c) + " does not match " + ShapeStr(w) + " but along axis " +
              std::to_string(axis);
    } else if (hi <= lo) {
      error = "window rows " + std::to_string(start) + ".." +
              std::to_string(start + c->shape[axis]) + " hold no row of the " +
              std::to_string(w->shape[axis]) + " along axis " + std::to_string(axis);
    } else {
      int64_t inner = (c->dtype.bits * c->dtype.lanes + 7) / 8;
      for (int i = axis + 1; i < c->ndim; ++i) inner *= c->shape[i];
      job.chunked = true;
      job.rows = 1;
      for (int i = 0; i < axis; ++i) job.rows *= c->shape[i];
      job.row_bytes = (hi - lo) * inner;
      job.src_start = lo * inner;
      job.dst_start = (lo - start) * inner;
      job.src_pitch = w->shape[axis] * inner;
      job.dst_pitch = c->shape[axis] * inner;
      job.nbytes = job.rows * job.row_bytes;
    }
  }
  Submit(std::move(job), stream_id, "tvm_ext.swap.copy_window_async", error);
}

void Wait(Tensor tensor, int64_t stream_id) {
  if (!tensor.defined()) TVM_FFI_THROW(ValueError) << "tvm_ext.swap.wait needs a tensor";
  Region region = Region::Of(tensor.GetDLTensorPtr());
  for (const auto& stream : StreamTable::Global()->Select(stream_id)) stream->WaitFor(region);
}

void WaitAll(int64_t stream_id) {
  for (const auto& stream : StreamTable::Global()->Select(stream_id)) stream->Drain(true);
}

namespace {

tvm::ffi::Array<int64_t> StatsRow(const std::shared_ptr<CopyStream>& s) {
  StreamStats st = s->Stats();
  return {static_cast<int64_t>(s->device().device_type),
          s->device().device_id,
          s->stream_id(),
          st.copies,
          st.bytes,
          st.busy_ns,
          st.overlap_ns,
          st.wait_ns,
          st.waits,
          s->kind() == StreamKind::kCpuWorker ? 1 : 0,
          st.paced,
          st.late,
          st.overshoot_ns};
}

}  // namespace

TVM_FFI_STATIC_INIT_BLOCK() {
  namespace refl = tvm::ffi::reflection;
  using tvm::ffi::Array;
  using tvm::ffi::Shape;
  using tvm::ffi::String;
  refl::GlobalDef()
      // --- what the SwapOffload pass emits (see the file header) ---
      .def("tvm_ext.swap.copy_async",
           [](Tensor src, Tensor dst, int64_t stream_id, String name) {
             CopyAsync(src, dst, stream_id, std::string(name));
           })
      .def("tvm_ext.swap.copy_chunk_async",
           [](Tensor whole, Tensor chunk, int64_t stream_id, int64_t axis, int64_t index,
              int64_t to_chunk, String name) {
             CopyChunkAsync(whole, chunk, stream_id, axis, index, to_chunk != 0,
                            std::string(name));
           })
      .def("tvm_ext.swap.copy_window_async",
           [](Tensor whole, Tensor chunk, int64_t stream_id, int64_t axis, int64_t start,
              String name) {
             CopyWindowAsync(whole, chunk, stream_id, axis, start, std::string(name));
           })
      .def("tvm_ext.swap.wait", [](Tensor t, int64_t stream_id) { Wait(t, stream_id); })
      .def("tvm_ext.swap.wait_all", [](int64_t stream_id) { WaitAll(stream_id); })
      // --- for Python, tests and benchmarks ---
      .def("tvm_ext.swap.is_idle",
           [](int64_t stream_id) {
             for (const auto& s : StreamTable::Global()->Select(stream_id)) {
               if (!s->Idle()) return false;
             }
             return true;
           })
      .def("tvm_ext.swap.stats",
           []() {
             Array<Array<int64_t>> rows;
             for (const auto& s : StreamTable::Global()->Select(kAllStreams)) {
               rows.push_back(StatsRow(s));
             }
             return rows;
           })
      .def("tvm_ext.swap.reset_stats",
           []() {
             for (const auto& s : StreamTable::Global()->Select(kAllStreams)) s->ResetStats();
             Trace::Global()->Clear();
           })
      .def("tvm_ext.swap.reset",
           []() {
             StreamTable::Global()->ClearInjected();
             for (const auto& s : StreamTable::Global()->Select(kAllStreams)) {
               s->Drain(false);
               s->ClearError();
               s->ResetStats();
             }
             Trace::Global()->Clear();
           })
      .def("tvm_ext.swap.inject_failure", [](int64_t stream_id, int64_t count) {
        StreamTable::Global()->InjectFailures(stream_id, count);
      });
}

}  // namespace swap
}  // namespace tvm_ext
