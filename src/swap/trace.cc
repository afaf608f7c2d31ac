/*!
 * \file swap/trace.cc
 * \brief The swap runtime's clock and trace (see trace.h), and their Python entry points.
 */
#include "swap/trace.h"

#include <tvm/ffi/container/array.h>
#include <tvm/ffi/function.h>
#include <tvm/ffi/reflection/registry.h>

#include <chrono>
#include <utility>

namespace tvm_ext {
namespace swap {

int64_t NowNs() {
  static const auto epoch = std::chrono::steady_clock::now();
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() -
                                                              epoch)
      .count();
}

Trace* Trace::Global() {
  static auto* inst = new Trace();
  return inst;
}

void Trace::Add(TraceRecord rec) {
  if (!enabled.load()) return;
  std::lock_guard<std::mutex> lock(mu_);
  if (records_.size() < kMaxRecords) records_.push_back(std::move(rec));
}

std::vector<TraceRecord> Trace::Get() {
  std::lock_guard<std::mutex> lock(mu_);
  return records_;
}

void Trace::Clear() {
  std::lock_guard<std::mutex> lock(mu_);
  records_.clear();
}

TVM_FFI_STATIC_INIT_BLOCK() {
  namespace refl = tvm::ffi::reflection;
  using tvm::ffi::Array;
  using tvm::ffi::String;
  refl::GlobalDef()
      .def("tvm_ext.swap.set_tracing", [](bool on) { Trace::Global()->enabled.store(on); })
      .def("tvm_ext.swap.trace",
           []() {
             Array<Array<tvm::ffi::Any>> rows;
             for (const TraceRecord& r : Trace::Global()->Get()) {
               rows.push_back(Array<tvm::ffi::Any>{r.kind, r.stream_id, r.bytes, r.t0, r.t1,
                                                   r.t2, String(r.name)});
             }
             return rows;
           })
      .def("tvm_ext.swap.now_ns", []() { return NowNs(); });
}

}  // namespace swap
}  // namespace tvm_ext
