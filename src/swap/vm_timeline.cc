/*!
 * \file swap/vm_timeline.cc
 * \brief The measured compute timeline: a Relax VM instrument that records when each call the
 * VM makes (kernels, builtins, the swap runtime's copies and waits) begins and ends, on the
 * trace's clock (trace.h), so that copies line up against the kernels they overlap.
 *
 *   vm.set_instrument(tvm_ffi.get_global_func("tvm_ext.swap.vm_instrument"))
 *
 * The VM calls it before and after every Call instruction with (func, symbol, before_run,
 * ret, args...). It is C++ so that a call costs well under a microsecond (a Python instrument
 * costs tens of microseconds per call, as long as many small kernels); it records only while
 * tracing is on (`tvm_ext.swap.set_tracing`; the trace drops records when it is off) and always
 * lets the call run.
 */
#include <tvm/ffi/any.h>
#include <tvm/ffi/function.h>
#include <tvm/ffi/reflection/registry.h>

#include <string>
#include <utility>
#include <vector>

#include "swap/trace.h"

namespace tvm_ext {
namespace swap {

namespace {

constexpr int kNoOp = 0;  // VMInstrumentReturnKind::kNoOp: run the call as usual

/*! \brief Calls begun and not yet ended on this thread (a VM function may call another). */
thread_local std::vector<std::pair<std::string, int64_t>> open_calls;

void Instrument(tvm::ffi::PackedArgs args, tvm::ffi::Any* ret) {
  *ret = kNoOp;
  if (args.size() < 3) return;
  bool before = args[2].cast<bool>();
  if (before) {
    open_calls.emplace_back(args[1].cast<std::string>(), NowNs());
    return;
  }
  if (open_calls.empty()) return;  // installed during the call
  int64_t end = NowNs();
  std::pair<std::string, int64_t> call = std::move(open_calls.back());
  open_calls.pop_back();
  Trace::Global()->Add({kTraceCall, -1, 0, call.second, call.second, end, std::move(call.first)});
}

}  // namespace

TVM_FFI_STATIC_INIT_BLOCK() {
  namespace refl = tvm::ffi::reflection;
  refl::GlobalDef().def_packed("tvm_ext.swap.vm_instrument", Instrument);
}

}  // namespace swap
}  // namespace tvm_ext
