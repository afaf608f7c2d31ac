/*!
 * \file swap/worker_cpus.h
 * \brief Which CPUs the CPU stand-in's copy workers run on.
 *
 * A GPU copies on its own engines while its cores compute. On the CPU stand-in a copy stream's
 * worker is a thread, and left to the scheduler it shares a core with the compute: a worker
 * woken while the caller runs a kernel (its copy's dependency done, or the caller resumed by the
 * copy it just finished) can wait in that core's run queue until the kernel ends, a millisecond
 * and more, while the copy's stream sits idle. Pinning the workers to a CPU of their own (and
 * the compute to the others) makes the stand-in behave like a device with copy engines.
 *
 * Set by `tvm_ext.swap.set_worker_cpus([cpu, ...])` (empty: unpinned) or, for an exported module
 * run without tvm_ext's Python, by TVM_EXT_COPY_WORKER_CPUS ("3", "2,3", "2-3"), read when the
 * first worker starts. Applies to the workers running and to those started later. Linux only.
 */
#ifndef TVM_EXT_SWAP_WORKER_CPUS_H_
#define TVM_EXT_SWAP_WORKER_CPUS_H_

#include <functional>
#include <vector>

namespace tvm_ext {
namespace swap {

/*! \brief The CPUs copy workers are pinned to (empty: unpinned); raises on a malformed
 * TVM_EXT_COPY_WORKER_CPUS. */
std::vector<int> WorkerCpus();

/*! \brief Pin the workers, running and future, to `cpus` (empty: unpin them); raises
 * ValueError on a CPU this process cannot run on. */
void SetWorkerCpus(const std::vector<int>& cpus);

/*! \brief Start a copy worker running `body`, named `name` and pinned as set. Raises (before
 * starting it) on a malformed TVM_EXT_COPY_WORKER_CPUS. */
void StartWorker(const char* name, std::function<void()> body);

}  // namespace swap
}  // namespace tvm_ext

#endif  // TVM_EXT_SWAP_WORKER_CPUS_H_
