/*!
 * \file ccl_nccl.cc
 * \brief The "nccl" Disco collective backend: one GPU per worker, collectives through NCCL.
 *
 * Built into its own library, libtvm_ext_nccl.so (CMake option TVM_EXT_NCCL), so that the runtime
 * library never needs libcuda or libnccl; the runtime library's "runtime.disco.nccl.init_ccl"
 * (disco_session.cc) loads it on first use. It registers the per-worker functions TVM's disco
 * builtins dispatch to (`runtime.disco.nccl.<op>`) and the controller side of init_ccl as
 * "tvm_ext.nccl.init_ccl".
 *
 * Streams: TVM launches kernels on the worker's current stream (TVMFFIEnvGetStream), by default
 * the legacy default stream. Collectives run on that stream when one is set, else on a stream
 * created with cudaStreamCreate, which is ordered with the legacy default stream: a collective
 * starts after the kernels launched before it and the kernels launched after it wait for it.
 *
 * Reductions use NCCL's types (float16/32/64, bfloat16, int8/32/64, uint8/32/64; bool as uint8
 * with max for sum/max and min for prod/min). Data movement is byte-wise, so it takes any dtype.
 * Arguments are checked on each worker (device, contiguity, sizes); NCCL cannot check that the
 * workers agree with each other, so a mismatch between workers fails inside NCCL or hangs.
 */
#include <cuda_runtime.h>
#include <nccl.h>
#include <tvm/ffi/container/shape.h>
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/function.h>
#include <tvm/ffi/optional.h>
#include <tvm/ffi/reflection/registry.h>
#include <tvm/ffi/string.h>
#include <tvm/runtime/disco/session.h>

#include <algorithm>
#include <cstring>
#include <string>

#include "../ccl_util.h"

namespace tvm_ext {
namespace ccl {
namespace {

using tvm::ffi::Bytes;
using tvm::ffi::Function;
using tvm::ffi::Optional;
using tvm::ffi::Shape;
using tvm::ffi::Tensor;
using tvm::runtime::DRef;
using tvm::runtime::Session;

constexpr const char* kCclName = "nccl";

#define TVM_EXT_NCCL_CALL(cmd)                                                          \
  do {                                                                                  \
    ncclResult_t r_ = (cmd);                                                            \
    if (r_ != ncclSuccess) {                                                            \
      TVM_FFI_THROW(RuntimeError) << "NCCL error in " #cmd ": " << ncclGetErrorString(r_); \
    }                                                                                   \
  } while (0)

#define TVM_EXT_CUDA_CALL(cmd)                                                           \
  do {                                                                                   \
    cudaError_t e_ = (cmd);                                                              \
    if (e_ != cudaSuccess) {                                                             \
      TVM_FFI_THROW(RuntimeError) << "CUDA error in " #cmd ": " << cudaGetErrorString(e_); \
    }                                                                                    \
  } while (0)

struct Context {
  DiscoWorker* worker = nullptr;
  int device_id = -1;
  cudaStream_t own_stream = nullptr;
  ncclComm_t global_comm = nullptr;
  ncclComm_t group_comm = nullptr;  // == global_comm when there is one group

  ~Context() { Clear(); }

  void Clear() {
    if (group_comm != nullptr && group_comm != global_comm) ncclCommDestroy(group_comm);
    if (global_comm != nullptr) ncclCommDestroy(global_comm);
    if (own_stream != nullptr) cudaStreamDestroy(own_stream);
    group_comm = global_comm = nullptr;
    own_stream = nullptr;
    worker = nullptr;
  }

  cudaStream_t Stream() const {
    void* current = TVMFFIEnvGetStream(kDLCUDA, device_id);
    return current != nullptr ? static_cast<cudaStream_t>(current) : own_stream;
  }

  ncclComm_t Comm(bool in_group) const { return in_group ? group_comm : global_comm; }
};

Context& ThisWorker() {
  thread_local Context ctx;
  return ctx;
}

Context& Ctx(const char* fn) {
  DiscoWorker* worker = CurrentWorker(fn);
  Context& ctx = ThisWorker();
  if (ctx.global_comm == nullptr || ctx.worker != worker) {
    TVM_FFI_THROW(ValueError) << fn << ": the \"nccl\" collective backend is not initialised on "
                              << "worker " << worker->worker_id
                              << "; call SessionInitCCL(session, \"nccl\", device_ids) first "
                                 "(tvm_ext.distributed.Session(k, \"nccl\") does)";
  }
  TVM_EXT_CUDA_CALL(cudaSetDevice(ctx.device_id));
  return ctx;
}

void CheckBuffer(const Context& ctx, const Tensor& t, const char* fn, const char* what) {
  DLDevice dev = t.device();
  if (dev.device_type != kDLCUDA || dev.device_id != ctx.device_id) {
    TVM_FFI_THROW(ValueError) << fn << ": buffer `" << what << "` (" << Describe(t)
                              << ") is on device (" << static_cast<int>(dev.device_type) << ", "
                              << dev.device_id << "), but worker " << ctx.worker->worker_id
                              << " runs on cuda:" << ctx.device_id;
  }
  CheckContiguous(t, fn, what);
}

/*! \brief NCCL's type for a dtype; bool travels as uint8. */
bool NcclType(DLDataType t, ncclDataType_t* out) {
  if (t.lanes != 1) return false;
  switch (t.code) {
    case kDLFloat:
      if (t.bits == 16) *out = ncclFloat16;
      else if (t.bits == 32) *out = ncclFloat32;
      else if (t.bits == 64) *out = ncclFloat64;
      else return false;
      return true;
    case kDLBfloat:
      if (t.bits != 16) return false;
      *out = ncclBfloat16;
      return true;
    case kDLInt:
      if (t.bits == 8) *out = ncclInt8;
      else if (t.bits == 32) *out = ncclInt32;
      else if (t.bits == 64) *out = ncclInt64;
      else return false;
      return true;
    case kDLUInt:
    case kDLBool:
      if (t.bits == 8) *out = ncclUint8;
      else if (t.code == kDLUInt && t.bits == 32) *out = ncclUint32;
      else if (t.code == kDLUInt && t.bits == 64) *out = ncclUint64;
      else return false;
      return true;
    default:
      return false;
  }
}

ncclRedOp_t NcclOp(int kind, DLDataType t, const char* fn) {
  bool is_bool = t.code == kDLBool;
  switch (kind) {
    case 0:
      return is_bool ? ncclMax : ncclSum;
    case 1:
      return is_bool ? ncclMin : ncclProd;
    case 2:
      return ncclMin;
    case 3:
      return ncclMax;
    case 4:
      if (is_bool) TVM_FFI_THROW(ValueError) << fn << ": avg of bool is not defined";
      return ncclAvg;
  }
  TVM_FFI_THROW(ValueError) << fn << ": unknown reduce kind " << kind
                            << " (sum=0 prod=1 min=2 max=3 avg=4)";
  return ncclSum;  // unreachable
}

// ---------------------------------------------------------------------------------------------
// Collectives
// ---------------------------------------------------------------------------------------------

void AllReduce(Tensor send, int kind, bool in_group, Tensor recv) {
  const char* fn = "runtime.disco.nccl.allreduce";
  Context& ctx = Ctx(fn);
  CheckBuffer(ctx, send, fn, "send");
  CheckBuffer(ctx, recv, fn, "recv");
  if (!SameDType(send.dtype(), recv.dtype()) || NumElements(send) != NumElements(recv)) {
    TVM_FFI_THROW(ValueError) << fn << ": send " << Describe(send) << " and recv "
                              << Describe(recv) << " must match";
  }
  ncclDataType_t type;
  if (!NcclType(send.dtype(), &type)) {
    TVM_FFI_THROW(ValueError) << fn << ": NCCL cannot reduce " << DTypeName(send.dtype());
  }
  TVM_EXT_NCCL_CALL(ncclAllReduce(DataPtr(send), DataPtr(recv), NumElements(send), type,
                                  NcclOp(kind, send.dtype(), fn), ctx.Comm(in_group),
                                  ctx.Stream()));
}

void AllGather(Tensor send, bool in_group, Tensor recv) {
  const char* fn = "runtime.disco.nccl.allgather";
  Context& ctx = Ctx(fn);
  CheckBuffer(ctx, send, fn, "send");
  CheckBuffer(ctx, recv, fn, "recv");
  Participants p = Locate(ctx.worker, in_group);
  if (NumBytes(recv) != NumBytes(send) * p.size) {
    TVM_FFI_THROW(ValueError) << fn << ": recv " << Describe(recv) << " must hold " << p.size
                              << " times send " << Describe(send);
  }
  TVM_EXT_NCCL_CALL(ncclAllGather(DataPtr(send), DataPtr(recv), NumBytes(send), ncclUint8,
                                  ctx.Comm(in_group), ctx.Stream()));
}

void BroadcastFromWorker0(Optional<Tensor> send, bool in_group, Tensor recv) {
  const char* fn = "runtime.disco.nccl.broadcast_from_worker0";
  Context& ctx = Ctx(fn);
  CheckBuffer(ctx, recv, fn, "recv");
  Participants p = Locate(ctx.worker, in_group);
  const void* src = nullptr;
  if (p.rank == 0) {
    if (!send.has_value()) TVM_FFI_THROW(ValueError) << fn << ": the root must provide `send`";
    CheckBuffer(ctx, send.value(), fn, "send");
    if (NumBytes(send.value()) != NumBytes(recv)) {
      TVM_FFI_THROW(ValueError) << fn << ": send " << Describe(send.value()) << " and recv "
                                << Describe(recv) << " differ in size";
    }
    src = DataPtr(send.value());
  }
  TVM_EXT_NCCL_CALL(ncclBroadcast(src, DataPtr(recv), NumBytes(recv), ncclUint8, 0,
                                  ctx.Comm(in_group), ctx.Stream()));
}

void ScatterFromWorker0(Optional<Tensor> send, bool in_group, Tensor recv) {
  const char* fn = "runtime.disco.nccl.scatter_from_worker0";
  Context& ctx = Ctx(fn);
  CheckBuffer(ctx, recv, fn, "recv");
  Participants p = Locate(ctx.worker, in_group);
  ncclComm_t comm = ctx.Comm(in_group);
  cudaStream_t stream = ctx.Stream();
  int64_t nbytes = NumBytes(recv);
  if (p.rank == 0) {
    if (!send.has_value()) TVM_FFI_THROW(ValueError) << fn << ": the root must provide `send`";
    CheckBuffer(ctx, send.value(), fn, "send");
    if (NumBytes(send.value()) != nbytes * p.size) {
      TVM_FFI_THROW(ValueError) << fn << ": send " << Describe(send.value()) << " must hold "
                                << p.size << " times recv " << Describe(recv);
    }
  }
  TVM_EXT_NCCL_CALL(ncclGroupStart());
  if (p.rank == 0) {
    const char* data = DataPtr(send.value());
    for (int r = 0; r < p.size; ++r) {
      TVM_EXT_NCCL_CALL(ncclSend(data + nbytes * r, nbytes, ncclUint8, r, comm, stream));
    }
  }
  TVM_EXT_NCCL_CALL(ncclRecv(DataPtr(recv), nbytes, ncclUint8, 0, comm, stream));
  TVM_EXT_NCCL_CALL(ncclGroupEnd());
}

void GatherToWorker0(Tensor send, bool in_group, Optional<Tensor> recv) {
  const char* fn = "runtime.disco.nccl.gather_to_worker0";
  Context& ctx = Ctx(fn);
  CheckBuffer(ctx, send, fn, "send");
  Participants p = Locate(ctx.worker, in_group);
  ncclComm_t comm = ctx.Comm(in_group);
  cudaStream_t stream = ctx.Stream();
  int64_t nbytes = NumBytes(send);
  if (p.rank == 0) {
    if (!recv.has_value()) TVM_FFI_THROW(ValueError) << fn << ": the root must provide `recv`";
    CheckBuffer(ctx, recv.value(), fn, "recv");
    if (NumBytes(recv.value()) != nbytes * p.size) {
      TVM_FFI_THROW(ValueError) << fn << ": recv " << Describe(recv.value()) << " must hold "
                                << p.size << " times send " << Describe(send);
    }
  }
  TVM_EXT_NCCL_CALL(ncclGroupStart());
  if (p.rank == 0) {
    char* data = DataPtr(recv.value());
    for (int r = 0; r < p.size; ++r) {
      TVM_EXT_NCCL_CALL(ncclRecv(data + nbytes * r, nbytes, ncclUint8, r, comm, stream));
    }
  }
  TVM_EXT_NCCL_CALL(ncclSend(DataPtr(send), nbytes, ncclUint8, 0, comm, stream));
  TVM_EXT_NCCL_CALL(ncclGroupEnd());
}

void SendTo(Tensor buffer, int receiver, const char* fn) {
  Context& ctx = Ctx(fn);
  CheckBuffer(ctx, buffer, fn, "buffer");
  int n = ctx.worker->num_workers;
  if (receiver < 0 || receiver >= n || receiver == ctx.worker->worker_id) {
    TVM_FFI_THROW(ValueError) << fn << ": worker " << ctx.worker->worker_id
                              << " cannot send to worker " << receiver << " (workers 0.." << n - 1
                              << ", not itself)";
  }
  TVM_EXT_NCCL_CALL(ncclSend(DataPtr(buffer), NumBytes(buffer), ncclUint8, receiver,
                             ctx.global_comm, ctx.Stream()));
}

void RecvFrom(Tensor buffer, int sender, const char* fn) {
  Context& ctx = Ctx(fn);
  CheckBuffer(ctx, buffer, fn, "buffer");
  int n = ctx.worker->num_workers;
  if (sender < 0 || sender >= n || sender == ctx.worker->worker_id) {
    TVM_FFI_THROW(ValueError) << fn << ": worker " << ctx.worker->worker_id
                              << " cannot receive from worker " << sender << " (workers 0.."
                              << n - 1 << ", not itself)";
  }
  TVM_EXT_NCCL_CALL(ncclRecv(DataPtr(buffer), NumBytes(buffer), ncclUint8, sender,
                             ctx.global_comm, ctx.Stream()));
}

int GroupSize(const Context& ctx) {
  return ctx.worker->num_workers / std::max(1, ctx.worker->num_groups);
}

// ---------------------------------------------------------------------------------------------
// Set-up
// ---------------------------------------------------------------------------------------------

void InitCCL(Session sess, Shape device_ids) {
  if (!Function::GetGlobal("device_api.cuda").has_value()) {
    TVM_FFI_THROW(RuntimeError) << "init_ccl(\"nccl\"): TVM's CUDA runtime is not loaded (no "
                                   "device_api.cuda); load it first "
                                   "(tvm_ext.cuda_support.ensure_cuda_runtime())";
  }
  int64_t n = sess->GetNumWorkers();
  if (static_cast<int64_t>(device_ids.size()) != n) {
    TVM_FFI_THROW(ValueError) << "init_ccl(\"nccl\"): " << device_ids.size() << " device ids for "
                              << n << " workers; give one GPU per worker";
  }
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess || count == 0) {
    TVM_FFI_THROW(RuntimeError) << "init_ccl(\"nccl\"): no usable GPU ("
                                << (err != cudaSuccess ? cudaGetErrorString(err) : "0 devices")
                                << "); the nccl backend needs one GPU per worker, use the "
                                   "\"cpu\" backend on machines without GPUs";
  }
  for (int64_t id : device_ids) {
    if (id < 0 || id >= count) {
      TVM_FFI_THROW(ValueError) << "init_ccl(\"nccl\"): device id " << id << " but this machine has "
                                << count << " GPU(s)";
    }
  }
  ncclUniqueId id;
  TVM_EXT_NCCL_CALL(ncclGetUniqueId(&id));
  DRef func = sess->GetGlobalFunc("runtime.disco.nccl.init_ccl_per_worker");
  sess->CallPacked(func, device_ids, Bytes(id.internal, NCCL_UNIQUE_ID_BYTES));
}

void InitCCLPerWorker(Shape device_ids, Bytes unique_id) {
  DiscoWorker* worker = CurrentWorker("runtime.disco.nccl.init_ccl_per_worker");
  if (unique_id.size() != NCCL_UNIQUE_ID_BYTES) {
    TVM_FFI_THROW(ValueError) << "init_ccl(\"nccl\"): the unique id has " << unique_id.size()
                              << " bytes, NCCL wants " << NCCL_UNIQUE_ID_BYTES;
  }
  Context& ctx = ThisWorker();
  ctx.Clear();  // a re-initialisation replaces the old communicators
  int device_id = static_cast<int>(device_ids[worker->local_worker_id]);
  TVM_EXT_CUDA_CALL(cudaSetDevice(device_id));
  TVM_EXT_CUDA_CALL(cudaStreamCreate(&ctx.own_stream));
  ctx.worker = worker;
  ctx.device_id = device_id;
  worker->default_device = DLDevice{kDLCUDA, device_id};
  worker->ccl = kCclName;
  ncclUniqueId id;
  std::memcpy(id.internal, unique_id.data(), NCCL_UNIQUE_ID_BYTES);
  TVM_EXT_NCCL_CALL(ncclCommInitRank(&ctx.global_comm, worker->num_workers, id, worker->worker_id));
  if (worker->num_groups <= 1) {
    ctx.group_comm = ctx.global_comm;
  } else {
    int group_size = worker->num_workers / worker->num_groups;
    TVM_EXT_NCCL_CALL(ncclCommSplit(ctx.global_comm, worker->worker_id / group_size,
                                    worker->worker_id % group_size, &ctx.group_comm, nullptr));
  }
}

void SyncWorker() {
  Context& ctx = Ctx("runtime.disco.nccl.sync_worker");
  TVM_EXT_CUDA_CALL(cudaStreamSynchronize(ctx.Stream()));
}

}  // namespace

TVM_FFI_STATIC_INIT_BLOCK() {
  namespace refl = tvm::ffi::reflection;
  refl::GlobalDef()
      .def("tvm_ext.nccl.init_ccl", InitCCL)
      .def("tvm_ext.nccl.version",
           []() {
             int version = 0;
             ncclGetVersion(&version);
             return static_cast<int64_t>(version);
           })
      .def("runtime.disco.nccl.init_ccl_per_worker", InitCCLPerWorker)
      .def("runtime.disco.nccl.allreduce", AllReduce)
      .def("runtime.disco.nccl.allgather", AllGather)
      .def("runtime.disco.nccl.broadcast_from_worker0", BroadcastFromWorker0)
      .def("runtime.disco.nccl.scatter_from_worker0", ScatterFromWorker0)
      .def("runtime.disco.nccl.gather_to_worker0", GatherToWorker0)
      .def("runtime.disco.nccl.recv_from_worker0",
           [](Tensor buffer) { RecvFrom(buffer, 0, "runtime.disco.nccl.recv_from_worker0"); })
      .def("runtime.disco.nccl.send_to_next_group",
           [](Tensor buffer) {
             const char* fn = "runtime.disco.nccl.send_to_next_group";
             Context& ctx = Ctx(fn);
             SendTo(buffer, ctx.worker->worker_id + GroupSize(ctx), fn);
           })
      .def("runtime.disco.nccl.recv_from_prev_group",
           [](Tensor buffer) {
             const char* fn = "runtime.disco.nccl.recv_from_prev_group";
             Context& ctx = Ctx(fn);
             RecvFrom(buffer, ctx.worker->worker_id - GroupSize(ctx), fn);
           })
      .def("runtime.disco.nccl.send_to_worker",
           [](Tensor buffer, int receiver) {
             SendTo(buffer, receiver, "runtime.disco.nccl.send_to_worker");
           })
      .def("runtime.disco.nccl.recv_from_worker",
           [](Tensor buffer, int sender) {
             RecvFrom(buffer, sender, "runtime.disco.nccl.recv_from_worker");
           })
      .def("runtime.disco.nccl.sync_worker", SyncWorker);
}

}  // namespace ccl
}  // namespace tvm_ext
