/*!
 * \file ccl/ccl_cpu.h
 * \brief The in-process "cpu" Disco collective backend (ccl_cpu.cc), as seen by the rest of the
 * runtime library.
 */
#ifndef TVM_EXT_CCL_CCL_CPU_H_
#define TVM_EXT_CCL_CCL_CPU_H_

#include <functional>
#include <string>
#include <vector>

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

/*! \brief One worker's part in a world-wide exchange of the cpu backend (see CpuWorldExchange). */
struct WorldPost {
  const void* send = nullptr;
  void* recv = nullptr;
  std::string signature;  // must be the same on every worker (the op, its arguments, shapes)
  std::string error;      // what this worker found wrong with its own arguments
};

/*!
 * \brief A rendezvous of every worker of this worker's cpu communicator, for collectives that
 * are not TVM's (the mesh collectives of ccl_mesh.cc): posts `mine`, waits for all workers,
 * fails on all of them at once if the signatures differ or any worker posted an error, runs
 * `work` on every worker's post (indexed by worker id), and waits until every worker is done,
 * so no buffer is released while another worker still reads it.
 */
void CpuWorldExchange(const char* op, WorldPost mine,
                      const std::function<void(const std::vector<WorldPost>&)>& work);

}  // namespace ccl
}  // namespace tvm_ext

#endif  // TVM_EXT_CCL_CCL_CPU_H_
