/*!
 * \file ccl/ccl_util.h
 * \brief What every tvm_ext Disco collective backend (cpu, nccl) shares: finding the calling
 * worker, the participants of a collective (the whole world or the worker's group), and checks
 * on the tensors handed in, with errors that say what to do.
 *
 * Group semantics follow TVM's disco builtins: a session of W workers in G groups has groups of
 * W/G consecutive workers; `in_group` collectives run inside each group with the group's first
 * worker as root, otherwise over all workers with worker 0 as root.
 */
#ifndef TVM_EXT_CCL_CCL_UTIL_H_
#define TVM_EXT_CCL_CCL_UTIL_H_

#include <dlpack/dlpack.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/error.h>
#include <tvm/runtime/disco/disco_worker.h>

#include <cstdint>
#include <sstream>
#include <string>

namespace tvm_ext {
namespace ccl {

using tvm::runtime::DiscoWorker;

/*! \brief The Disco worker running on this thread; a clear error outside a session. */
inline DiscoWorker* CurrentWorker(const char* fn) {
  DiscoWorker* worker = nullptr;
  try {
    worker = DiscoWorker::ThreadLocal();
  } catch (const tvm::ffi::Error&) {
    worker = nullptr;
  }
  if (worker == nullptr) {
    TVM_FFI_THROW(ValueError) << fn
                              << " was called outside a Disco worker: collectives run only "
                                 "inside a Disco session (tvm_ext.runtime.distributed.Session), "
                                 "on every worker at once";
  }
  return worker;
}

/*! \brief Who takes part in one collective, seen from one worker. */
struct Participants {
  int rank;   // this worker's rank among the participants (0 is the root)
  int size;   // number of participants
  int group;  // index of the group, or -1 for all workers
};

inline Participants Locate(const DiscoWorker* worker, bool in_group) {
  if (!in_group || worker->num_groups <= 1) return {worker->worker_id, worker->num_workers, -1};
  int group_size = worker->num_workers / worker->num_groups;
  return {worker->worker_id % group_size, group_size, worker->worker_id / group_size};
}

inline std::string DTypeName(DLDataType t) {
  std::ostringstream os;
  switch (t.code) {
    case kDLInt:
      os << "int" << int(t.bits);
      break;
    case kDLUInt:
      os << "uint" << int(t.bits);
      break;
    case kDLFloat:
      os << "float" << int(t.bits);
      break;
    case kDLBfloat:
      os << "bfloat" << int(t.bits);
      break;
    case kDLBool:
      os << "bool";
      break;
    default:
      os << "dtype(code=" << int(t.code) << ", bits=" << int(t.bits) << ")";
  }
  if (t.lanes != 1) os << "x" << int(t.lanes);
  return os.str();
}

inline bool SameDType(DLDataType a, DLDataType b) {
  return a.code == b.code && a.bits == b.bits && a.lanes == b.lanes;
}

/*! \brief "float32[4, 8]" */
inline std::string Describe(const tvm::ffi::Tensor& t) {
  std::ostringstream os;
  os << DTypeName(t.dtype()) << "[";
  for (int i = 0; i < t.ndim(); ++i) os << (i ? ", " : "") << t.shape()[i];
  os << "]";
  return os.str();
}

inline int64_t NumElements(const tvm::ffi::Tensor& t) {
  int64_t n = 1;
  for (int i = 0; i < t.ndim(); ++i) n *= t.shape()[i];
  return n;
}

inline int64_t NumBytes(const tvm::ffi::Tensor& t) {
  return static_cast<int64_t>(tvm::ffi::GetDataSize(NumElements(t), t.dtype()));
}

inline char* DataPtr(const tvm::ffi::Tensor& t) {
  return static_cast<char*>(t.data_ptr()) + t.byte_offset();
}

/*! \brief Collectives read and write flat buffers: reject strided views. */
inline void CheckContiguous(const tvm::ffi::Tensor& t, const char* fn, const char* what) {
  if (!t.IsContiguous()) {
    TVM_FFI_THROW(ValueError) << fn << ": buffer `" << what << "` (" << Describe(t)
                              << ") is not contiguous; collectives need compact tensors";
  }
}

}  // namespace ccl
}  // namespace tvm_ext

#endif  // TVM_EXT_CCL_CCL_UTIL_H_
