/*!
 * \file ccl_cpu.h
 * \brief The in-process "cpu" Disco collective backend (ccl_cpu.cc), as seen by the rest of the
 * runtime library.
 */
#ifndef TVM_EXT_CCL_CPU_H_
#define TVM_EXT_CCL_CPU_H_

#include <string>

namespace tvm_ext {
namespace ccl {

/*!
 * \brief Abort the cpu communicator this worker thread belongs to (no-op if none): every worker
 * waiting in, or later entering, one of its collectives fails at once with `reason` instead of
 * waiting for a worker that will never arrive. The session needs a new init_ccl afterwards.
 */
void AbortCpuCommunicatorOfThisWorker(const std::string& reason);

/*! \brief Whether an error message is the echo of another worker's failure (an abort). */
bool IsAbortEcho(const std::string& message);

}  // namespace ccl
}  // namespace tvm_ext

#endif  // TVM_EXT_CCL_CPU_H_
