/*!
 * \file swap/trace.h
 * \brief The swap runtime's clock and its optional trace of timestamped events: copies on the
 * copy streams, callers blocked in waits, and the calls the Relax VM makes (kernels included,
 * recorded by the VM instrument of vm_timeline.cc). One clock for all, so a measured timeline
 * lines copies up against the kernels they overlap.
 */
#ifndef TVM_EXT_SWAP_TRACE_H_
#define TVM_EXT_SWAP_TRACE_H_

#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

namespace tvm_ext {
namespace swap {

/*! \brief Monotonic nanoseconds since the library's first use. */
int64_t NowNs();

enum TraceKind : int64_t {
  kTraceCopy = 0,  // t0 enqueue, t1 start, t2 end
  kTraceWait = 1,  // a caller blocked: t0 = t1 begin, t2 end
  kTraceCall = 2,  // a VM call: t0 = t1 begin, t2 end; name = the callee's symbol
};

struct TraceRecord {
  int64_t kind;
  int64_t stream_id;  // -1 for VM calls
  int64_t bytes;
  int64_t t0, t1, t2;
  std::string name;
};

/*! \brief The global trace: off by default, bounded, appended to from any thread. */
class Trace {
 public:
  static Trace* Global();
  static constexpr size_t kMaxRecords = 1 << 20;
  std::atomic<bool> enabled{false};
  void Add(TraceRecord rec);
  std::vector<TraceRecord> Get();
  void Clear();

 private:
  std::mutex mu_;
  std::vector<TraceRecord> records_;
};

}  // namespace swap
}  // namespace tvm_ext

#endif  // TVM_EXT_SWAP_TRACE_H_
