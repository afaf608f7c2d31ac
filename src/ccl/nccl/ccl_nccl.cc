/*!
 * \file ccl/nccl/ccl_nccl.cc
 * \brief The "nccl" Disco collective backend: one GPU per worker, collectives through NCCL.
 *
 * Built into its own library, libtvm_ext_nccl.so (CMake option TVM_EXT_NCCL), so that the runtime
 * library never needs libcuda or libnccl; the runtime library's "runtime.disco.nccl.init_ccl"
 * (ccl/disco_session.cc) loads it on first use. It registers the per-worker functions TVM's disco
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
 *
 * The mesh collectives of partitioned modules (`tvm_ext.ccl.nccl.mesh_*`, see ccl/ccl_mesh.h) run
 * on one communicator per mesh level (ncclCommSplit of the global one) and rearrange pieces of a
 * cut axis with strided device copies through a scratch buffer.
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
#include <map>
#include <string>
#include <utility>

#include "ccl/ccl_mesh.h"
#include "ccl/ccl_util.h"

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
  // Mesh collectives: one communicator per mesh level (stride, size), made on first use, and a
  // device scratch buffer for rearranging pieces (grown as needed, reused in stream order).
  std::map<std::pair<int, int>, ncclComm_t> level_comms;
  void* scratch = nullptr;
  size_t scratch_bytes = 0;

  ~Context() { Clear(); }

  void Clear() {
    for (auto& kv : level_comms) ncclCommDestroy(kv.second);
    level_comms.clear();
    if (scratch != nullptr) cudaFree(scratch);
    scratch = nullptr;
    scratch_bytes = 0;
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
                                 "(tvm_ext.runtime.distributed.Session(k, \"nccl\") does)";
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
                                   "(tvm_ext.runtime.cuda.ensure_cuda_runtime())";
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

// ---------------------------------------------------------------------------------------------
// Mesh collectives (ccl_mesh.h): one mesh level at a time, any axis
// ---------------------------------------------------------------------------------------------

/*! \brief The communicator of this worker's group at a mesh level (every worker calls this at
 * the same collective the first time, as ncclCommSplit requires). */
ncclComm_t LevelComm(Context& ctx, const MeshGroup& g) {
  if (g.size == ctx.worker->num_workers) return ctx.global_comm;
  auto key = std::make_pair(g.stride, g.size);
  auto it = ctx.level_comms.find(key);
  if (it != ctx.level_comms.end()) return it->second;
  ncclComm_t comm = nullptr;
  TVM_EXT_NCCL_CALL(ncclCommSplit(ctx.global_comm, g.base, g.rank, &comm, nullptr));
  ctx.level_comms[key] = comm;
  return comm;
}

char* Scratch(Context& ctx, size_t nbytes) {
  if (nbytes > ctx.scratch_bytes) {
    TVM_EXT_CUDA_CALL(cudaStreamSynchronize(ctx.Stream()));
    if (ctx.scratch != nullptr) TVM_EXT_CUDA_CALL(cudaFree(ctx.scratch));
    ctx.scratch = nullptr;
    TVM_EXT_CUDA_CALL(cudaMalloc(&ctx.scratch, nbytes));
    ctx.scratch_bytes = nbytes;
  }
  return static_cast<char*>(ctx.scratch);
}

int64_t ElemBytes(const Tensor& t) {
  return (static_cast<int64_t>(t.dtype().bits) * t.dtype().lanes + 7) / 8;
}

/*! \brief Copy `parts` runs of `rows` x `run` bytes between a [rows][parts][run] layout
 * (`strided`) and `parts` contiguous [rows][run] pieces (`packed`), on the stream. */
void Rearrange(char* packed, char* strided, int64_t rows, int64_t parts, int64_t run_bytes,
               bool to_packed, cudaStream_t stream) {
  for (int64_t j = 0; j < parts; ++j) {
    char* piece = packed + j * rows * run_bytes;
    char* slot = strided + j * run_bytes;
    if (to_packed) {
      TVM_EXT_CUDA_CALL(cudaMemcpy2DAsync(piece, run_bytes, slot, parts * run_bytes, run_bytes,
                                          rows, cudaMemcpyDeviceToDevice, stream));
    } else {
      TVM_EXT_CUDA_CALL(cudaMemcpy2DAsync(slot, parts * run_bytes, piece, run_bytes, run_bytes,
                                          rows, cudaMemcpyDeviceToDevice, stream));
    }
  }
}

void MeshCheck(const Context& ctx, const Tensor& send, const Tensor& recv, const Shape& want,
               const char* fn) {
  CheckBuffer(ctx, send, fn, "send");
  CheckBuffer(ctx, recv, fn, "recv");
  if (!SameDType(send.dtype(), recv.dtype()) || !SameShape(recv.shape(), want)) {
    TVM_FFI_THROW(ValueError) << fn << ": recv " << Describe(recv) << " must be "
                              << DTypeName(send.dtype()) << ShapeText(want) << " for send "
                              << Describe(send);
  }
}

void MeshAllReduce(Tensor send, Shape args, Tensor recv) {
  const char* fn = "tvm_ext.ccl.nccl.mesh_allreduce";
  auto a = MeshArgs(args, 3, fn, "stride, size, kind");
  Context& ctx = Ctx(fn);
  MeshGroup g = LocateMeshGroup(ctx.worker, a[0], a[1], fn);
  MeshCheck(ctx, send, recv, send.shape(), fn);
  ncclDataType_t type;
  if (!NcclType(send.dtype(), &type)) {
    TVM_FFI_THROW(ValueError) << fn << ": NCCL cannot reduce " << DTypeName(send.dtype());
  }
  TVM_EXT_NCCL_CALL(ncclAllReduce(DataPtr(send), DataPtr(recv), NumElements(send), type,
                                  NcclOp(static_cast<int>(a[2]), send.dtype(), fn),
                                  LevelComm(ctx, g), ctx.Stream()));
}

void MeshAllGather(Tensor send, Shape args, Tensor recv) {
  const char* fn = "tvm_ext.ccl.nccl.mesh_allgather";
  auto a = MeshArgs(args, 4, fn, "stride, size, axis, A");
  Context& ctx = Ctx(fn);
  MeshGroup g = LocateMeshGroup(ctx.worker, a[0], a[1], fn);
  Shape whole = GrowAxis(send.shape(), a[2], g.size);
  MeshCheck(ctx, send, recv, whole, fn);
  AxisBlocks b = MakeAxisBlocks(whole, a[2], a[3], g.size, fn);
  int64_t es = ElemBytes(send);
  ncclComm_t comm = LevelComm(ctx, g);
  cudaStream_t stream = ctx.Stream();
  if (b.rows == 1) {
    TVM_EXT_NCCL_CALL(ncclAllGather(DataPtr(send), DataPtr(recv), NumBytes(send), ncclUint8,
                                    comm, stream));
    return;
  }
  char* staged = Scratch(ctx, NumBytes(recv));
  TVM_EXT_NCCL_CALL(ncclAllGather(DataPtr(send), staged, NumBytes(send), ncclUint8, comm,
                                  stream));
  Rearrange(staged, DataPtr(recv), b.rows, g.size, b.RunBytes(es), false, stream);
}

void MeshReduceScatter(Tensor send, Shape args, Tensor recv) {
  const char* fn = "tvm_ext.ccl.nccl.mesh_reduce_scatter";
  auto a = MeshArgs(args, 5, fn, "stride, size, kind, axis, A");
  Context& ctx = Ctx(fn);
  MeshGroup g = LocateMeshGroup(ctx.worker, a[0], a[1], fn);
  AxisBlocks b = MakeAxisBlocks(send.shape(), a[3], a[4], g.size, fn);
  std::vector<int64_t> piece(send.shape().begin(), send.shape().end());
  piece[a[3]] /= g.size;
  MeshCheck(ctx, send, recv, Shape(piece), fn);
  ncclDataType_t type;
  if (!NcclType(send.dtype(), &type)) {
    TVM_FFI_THROW(ValueError) << fn << ": NCCL cannot reduce " << DTypeName(send.dtype());
  }
  int64_t es = ElemBytes(send);
  ncclComm_t comm = LevelComm(ctx, g);
  cudaStream_t stream = ctx.Stream();
  const char* src = DataPtr(send);
  if (b.rows > 1) {
    char* staged = Scratch(ctx, NumBytes(send));
    Rearrange(staged, DataPtr(send), b.rows, g.size, b.RunBytes(es), true, stream);
    src = staged;
  }
  TVM_EXT_NCCL_CALL(ncclReduceScatter(src, DataPtr(recv), NumElements(recv), type,
                                      NcclOp(static_cast<int>(a[2]), send.dtype(), fn), comm,
                                      stream));
}

void MeshAllToAll(Tensor send, Shape args, Tensor recv) {
  const char* fn = "tvm_ext.ccl.nccl.mesh_all_to_all";
  auto a = MeshArgs(args, 6, fn, "stride, size, axis_in, A_in, axis_out, A_out");
  Context& ctx = Ctx(fn);
  MeshGroup g = LocateMeshGroup(ctx.worker, a[0], a[1], fn);
  Shape s = send.shape();
  std::vector<int64_t> out(s.begin(), s.end());
  if (a[2] == a[4] || a[2] < 0 || a[4] < 0 || a[2] >= static_cast<int64_t>(out.size()) ||
      a[4] >= static_cast<int64_t>(out.size())) {
    TVM_FFI_THROW(ValueError) << fn << ": axes " << a[2] << " -> " << a[4] << " of "
                              << Describe(send);
  }
  out[a[2]] *= g.size;
  out[a[4]] /= g.size;
  MeshCheck(ctx, send, recv, Shape(out), fn);
  AxisBlocks cut = MakeAxisBlocks(s, a[4], a[5], g.size, fn);   // send, sliced along axis_out
  AxisBlocks put = MakeAxisBlocks(Shape(out), a[2], a[3], g.size, fn);  // recv, along axis_in
  int64_t es = ElemBytes(send);
  int64_t piece_bytes = NumBytes(send) / g.size;
  char* outgoing = Scratch(ctx, 2 * NumBytes(send));
  char* incoming = outgoing + NumBytes(send);
  cudaStream_t stream = ctx.Stream();
  Rearrange(outgoing, DataPtr(send), cut.rows, g.size, cut.RunBytes(es), true, stream);
  ncclComm_t comm = LevelComm(ctx, g);
  TVM_EXT_NCCL_CALL(ncclGroupStart());
  for (int j = 0; j < g.size; ++j) {
    TVM_EXT_NCCL_CALL(ncclSend(outgoing + j * piece_bytes, piece_bytes, ncclUint8, j, comm,
                               stream));
    TVM_EXT_NCCL_CALL(ncclRecv(incoming + j * piece_bytes, piece_bytes, ncclUint8, j, comm,
                               stream));
  }
  TVM_EXT_NCCL_CALL(ncclGroupEnd());
  Rearrange(incoming, DataPtr(recv), put.rows, g.size, put.RunBytes(es), false, stream);
}

void MeshSlice(Tensor send, Shape args, Tensor recv) {
  const char* fn = "tvm_ext.ccl.nccl.mesh_slice";
  auto a = MeshArgs(args, 4, fn, "stride, size, axis, A");
  Context& ctx = Ctx(fn);
  MeshGroup g = LocateMeshGroup(ctx.worker, a[0], a[1], fn);
  AxisBlocks b = MakeAxisBlocks(send.shape(), a[2], a[3], g.size, fn);
  std::vector<int64_t> piece(send.shape().begin(), send.shape().end());
  piece[a[2]] /= g.size;
  MeshCheck(ctx, send, recv, Shape(piece), fn);
  int64_t run = b.RunBytes(ElemBytes(send));
  TVM_EXT_CUDA_CALL(cudaMemcpy2DAsync(DataPtr(recv), run, DataPtr(send) + g.rank * run,
                                      g.size * run, run, b.rows, cudaMemcpyDeviceToDevice,
                                      ctx.Stream()));
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
      .def("runtime.disco.nccl.sync_worker", SyncWorker)
      .def("tvm_ext.ccl.nccl.mesh_allreduce", MeshAllReduce)
      .def("tvm_ext.ccl.nccl.mesh_allgather", MeshAllGather)
      .def("tvm_ext.ccl.nccl.mesh_reduce_scatter", MeshReduceScatter)
      .def("tvm_ext.ccl.nccl.mesh_all_to_all", MeshAllToAll)
      .def("tvm_ext.ccl.nccl.mesh_slice", MeshSlice);
}

}  // namespace ccl
}  // namespace tvm_ext
