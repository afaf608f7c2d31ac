/*!
 * \file ccl/ccl_mesh.cc
 * \brief Mesh collectives: the conversions of a partitioned module at one level of a device mesh
 * (ccl_mesh.h), for any axis. Relax calls them as destination-passing packed functions:
 *
 *   tvm_ext.ccl.mesh_allreduce(send, [stride, size, kind], recv)
 *   tvm_ext.ccl.mesh_allgather(send, [stride, size, axis, A], recv)        recv: axis * size
 *   tvm_ext.ccl.mesh_reduce_scatter(send, [stride, size, kind, axis, A], recv)   axis / size
 *   tvm_ext.ccl.mesh_all_to_all(send, [stride, size, axis_in, A_in, axis_out, A_out], recv)
 *   tvm_ext.ccl.mesh_slice(send, [stride, size, axis, A], recv)          local, no messages
 *
 * `kind` numbers reductions as TVM does (sum 0, prod 1, min 2, max 3, avg 4). Each dispatches to
 * `tvm_ext.ccl.<backend>.mesh_<op>` of the worker's collective backend; this file implements the
 * "cpu" one (every worker of the process meets in CpuWorldExchange, then reads what it needs
 * from its group's buffers). The nccl backend implements them in ccl/nccl/ccl_nccl.cc.
 */
#include <tvm/ffi/container/shape.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/function.h>
#include <tvm/ffi/reflection/registry.h>

#include <cstring>
#include <string>
#include <vector>

#include "ccl/ccl_cpu.h"
#include "ccl/ccl_mesh.h"
#include "ccl/ccl_reduce.h"
#include "ccl/ccl_util.h"

namespace tvm_ext {
namespace ccl {
namespace {

using tvm::ffi::Function;
using tvm::ffi::Shape;
using tvm::ffi::Tensor;

const char* const kOps[] = {"mesh_allreduce", "mesh_allgather", "mesh_reduce_scatter",
                            "mesh_all_to_all", "mesh_slice"};

/*! \brief tvm_ext.ccl.<op>: the implementation of the worker's backend. */
void Dispatch(const char* op, Tensor send, Shape args, Tensor recv) {
  std::string fn = std::string("tvm_ext.ccl.") + op;
  DiscoWorker* worker = CurrentWorker(fn.c_str());
  std::string name = "tvm_ext.ccl." + std::string(worker->ccl) + "." + op;
  auto impl = Function::GetGlobal(name);
  if (!impl.has_value()) {
    TVM_FFI_THROW(ValueError) << fn << ": the collective backend \"" << worker->ccl
                              << "\" has no mesh collectives (" << name
                              << " is not registered); partitioned modules run on the tvm_ext "
                                 "backends \"cpu\" and \"nccl\" (tvm_ext.runtime.distributed.Session)";
  }
  (*impl)(send, args, recv);
}

int64_t ElemBytes(const Tensor& t) {
  return (static_cast<int64_t>(t.dtype().bits) * t.dtype().lanes + 7) / 8;
}

/*! \brief Local checks shared by every cpu mesh op; "" or what is wrong. */
std::string CheckPair(const Tensor& send, const Tensor& recv, const Shape& want_recv) {
  for (const Tensor* t : {&send, &recv}) {
    int type = t->device().device_type;
    if (type != kDLCPU && type != kDLCUDAHost) {
      return "the cpu backend moves host memory only, got a tensor on device type " +
             std::to_string(type);
    }
    if (!t->IsContiguous()) return "buffer " + Describe(*t) + " is not contiguous";
  }
  if (!SameDType(send.dtype(), recv.dtype())) {
    return "send " + Describe(send) + " and recv " + Describe(recv) + " differ in dtype";
  }
  if (!SameShape(recv.shape(), want_recv)) {
    return "recv " + Describe(recv) + " must have shape " + ShapeText(want_recv) + " for send " +
           Describe(send);
  }
  return "";
}

std::string Signature(const char* op, const std::vector<int64_t>& a, const Tensor& send,
                      const Tensor& recv) {
  std::string s = std::string(op) + "(" + Describe(send) + " -> " + Describe(recv) + "; args";
  for (int64_t v : a) s += " " + std::to_string(v);
  return s + ")";
}

/*! \brief Exchange with every worker (see CpuWorldExchange); `work` gets the group's sends. */
template <typename Work>
void GroupExchange(const char* op, const MeshGroup& g, const std::vector<int64_t>& a,
                   const Tensor& send, const Tensor& recv, std::string error, Work work) {
  WorldPost mine;
  mine.send = DataPtr(send);
  mine.recv = DataPtr(recv);
  mine.signature = Signature(op, a, send, recv);
  mine.error = std::move(error);
  CpuWorldExchange(op, std::move(mine), [&](const std::vector<WorldPost>& posts) {
    std::vector<const char*> sends(g.size);
    for (int j = 0; j < g.size; ++j) sends[j] = static_cast<const char*>(posts[g.Worker(j)].send);
    work(sends);
  });
}

void CpuAllReduce(Tensor send, Shape args, Tensor recv) {
  const char* fn = "tvm_ext.ccl.cpu.mesh_allreduce";
  auto a = MeshArgs(args, 3, fn, "stride, size, kind");
  MeshGroup g = LocateMeshGroup(CurrentWorker(fn), a[0], a[1], fn);
  std::string error = CheckPair(send, recv, send.shape());
  std::string why;
  ReduceFn reduce = FindReduce(send.dtype(), static_cast<int>(a[2]), &why);
  if (error.empty() && reduce == nullptr) error = why;
  GroupExchange("mesh_allreduce", g, a, send, recv, error, [&](const auto& sends) {
    std::vector<const void*> in(sends.begin(), sends.end());
    std::vector<void*> out(g.size, DataPtr(recv));
    reduce(in.data(), out.data(), g.size, 0, NumElements(send));
  });
}

void CpuAllGather(Tensor send, Shape args, Tensor recv) {
  const char* fn = "tvm_ext.ccl.cpu.mesh_allgather";
  auto a = MeshArgs(args, 4, fn, "stride, size, axis, A");
  MeshGroup g = LocateMeshGroup(CurrentWorker(fn), a[0], a[1], fn);
  Shape whole = GrowAxis(send.shape(), a[2], g.size);
  AxisBlocks b = MakeAxisBlocks(whole, a[2], a[3], g.size, fn);
  int64_t es = ElemBytes(send);
  GroupExchange("mesh_allgather", g, a, send, recv, CheckPair(send, recv, whole),
                [&](const auto& sends) {
                  char* dst = DataPtr(recv);
                  for (int j = 0; j < g.size; ++j) {
                    for (int64_t i = 0; i < b.rows; ++i) {
                      std::memcpy(dst + b.WholeOffset(i, j) * es, sends[j] + b.PieceOffset(i) * es,
                                  b.RunBytes(es));
                    }
                  }
                });
}

void CpuReduceScatter(Tensor send, Shape args, Tensor recv) {
  const char* fn = "tvm_ext.ccl.cpu.mesh_reduce_scatter";
  auto a = MeshArgs(args, 5, fn, "stride, size, kind, axis, A");
  MeshGroup g = LocateMeshGroup(CurrentWorker(fn), a[0], a[1], fn);
  AxisBlocks b = MakeAxisBlocks(send.shape(), a[3], a[4], g.size, fn);
  std::vector<int64_t> piece(send.shape().begin(), send.shape().end());
  piece[a[3]] /= g.size;
  std::string error = CheckPair(send, recv, Shape(piece));
  std::string why;
  ReduceFn reduce = FindReduce(send.dtype(), static_cast<int>(a[2]), &why);
  if (error.empty() && reduce == nullptr) error = why;
  int64_t es = ElemBytes(send);
  GroupExchange("mesh_reduce_scatter", g, a, send, recv, error, [&](const auto& sends) {
    std::vector<const void*> in(g.size);
    for (int64_t i = 0; i < b.rows; ++i) {
      for (int j = 0; j < g.size; ++j) in[j] = sends[j] + b.WholeOffset(i, g.rank) * es;
      std::vector<void*> out(g.size, DataPtr(recv) + b.PieceOffset(i) * es);
      reduce(in.data(), out.data(), g.size, 0, b.run);
    }
  });
}

struct CopyDim {
  int64_t extent, src_stride, dst_stride;  // elements
};

void StridedCopy(const char* src, char* dst, const std::vector<CopyDim>& dims, size_t d,
                 int64_t chunk_bytes, int64_t es) {
  if (d == dims.size()) {
    std::memcpy(dst, src, chunk_bytes);
    return;
  }
  const CopyDim& c = dims[d];
  for (int64_t i = 0; i < c.extent; ++i) {
    StridedCopy(src + i * c.src_stride * es, dst + i * c.dst_stride * es, dims, d + 1,
                chunk_bytes, es);
  }
}

std::vector<int64_t> RowMajorStrides(const Shape& s) {
  std::vector<int64_t> st(s.size(), 1);
  for (int64_t d = static_cast<int64_t>(s.size()) - 2; d >= 0; --d) st[d] = st[d + 1] * s[d + 1];
  return st;
}

void CpuAllToAll(Tensor send, Shape args, Tensor recv) {
  const char* fn = "tvm_ext.ccl.cpu.mesh_all_to_all";
  auto a = MeshArgs(args, 6, fn, "stride, size, axis_in, A_in, axis_out, A_out");
  MeshGroup g = LocateMeshGroup(CurrentWorker(fn), a[0], a[1], fn);
  int64_t ax_in = a[2], outer_in = a[3], ax_out = a[4], outer_out = a[5];
  Shape s = send.shape();
  int64_t ndim = static_cast<int64_t>(s.size());
  if (ax_in == ax_out || ax_in < 0 || ax_out < 0 || ax_in >= ndim || ax_out >= ndim) {
    TVM_FFI_THROW(ValueError) << fn << ": axes " << ax_in << " -> " << ax_out << " of "
                              << Describe(send) << " (two different axes)";
  }
  MakeAxisBlocks(s, ax_out, outer_out, g.size, fn);  // checks divisibility
  std::vector<int64_t> out_dims(s.begin(), s.end());
  out_dims[ax_in] *= g.size;
  out_dims[ax_out] /= g.size;
  Shape o(out_dims);
  MakeAxisBlocks(o, ax_in, outer_in, g.size, fn);
  int64_t es = ElemBytes(send);
  std::vector<int64_t> ss = RowMajorStrides(s), ds = RowMajorStrides(o);
  int64_t b_out = s[ax_out] / g.size / outer_out, b_in = s[ax_in] / outer_in;
  std::vector<CopyDim> dims;
  for (int64_t d = 0; d < ndim; ++d) {
    if (d == ax_out) {
      dims.push_back({outer_out, g.size * b_out * ss[d], b_out * ds[d]});
      dims.push_back({b_out, ss[d], ds[d]});
    } else if (d == ax_in) {
      dims.push_back({outer_in, b_in * ss[d], g.size * b_in * ds[d]});
      dims.push_back({b_in, ss[d], ds[d]});
    } else {
      dims.push_back({s[d], ss[d], ds[d]});
    }
  }
  int64_t chunk = 1;  // merge the trailing dims both sides hold contiguously
  while (!dims.empty() && dims.back().src_stride == chunk && dims.back().dst_stride == chunk) {
    chunk *= dims.back().extent;
    dims.pop_back();
  }
  int64_t src_offset = g.rank * b_out * ss[ax_out];
  GroupExchange("mesh_all_to_all", g, a, send, recv, CheckPair(send, recv, o),
                [&](const auto& sends) {
                  for (int j = 0; j < g.size; ++j) {
                    StridedCopy(sends[j] + src_offset * es,
                                DataPtr(recv) + j * b_in * ds[ax_in] * es, dims, 0, chunk * es,
                                es);
                  }
                });
}

void CpuSlice(Tensor send, Shape args, Tensor recv) {
  const char* fn = "tvm_ext.ccl.cpu.mesh_slice";
  auto a = MeshArgs(args, 4, fn, "stride, size, axis, A");
  MeshGroup g = LocateMeshGroup(CurrentWorker(fn), a[0], a[1], fn);
  AxisBlocks b = MakeAxisBlocks(send.shape(), a[2], a[3], g.size, fn);
  std::vector<int64_t> piece(send.shape().begin(), send.shape().end());
  piece[a[2]] /= g.size;
  std::string error = CheckPair(send, recv, Shape(piece));
  if (!error.empty()) TVM_FFI_THROW(ValueError) << fn << ": " << error;
  int64_t es = ElemBytes(send);
  const char* src = DataPtr(send);
  char* dst = DataPtr(recv);
  for (int64_t i = 0; i < b.rows; ++i) {
    std::memcpy(dst + b.PieceOffset(i) * es, src + b.WholeOffset(i, g.rank) * es, b.RunBytes(es));
  }
}

}  // namespace

TVM_FFI_STATIC_INIT_BLOCK() {
  namespace refl = tvm::ffi::reflection;
  refl::GlobalDef()
      .def("tvm_ext.ccl.mesh_allreduce",
           [](Tensor s, Shape a, Tensor r) { Dispatch(kOps[0], s, a, r); })
      .def("tvm_ext.ccl.mesh_allgather",
           [](Tensor s, Shape a, Tensor r) { Dispatch(kOps[1], s, a, r); })
      .def("tvm_ext.ccl.mesh_reduce_scatter",
           [](Tensor s, Shape a, Tensor r) { Dispatch(kOps[2], s, a, r); })
      .def("tvm_ext.ccl.mesh_all_to_all",
           [](Tensor s, Shape a, Tensor r) { Dispatch(kOps[3], s, a, r); })
      .def("tvm_ext.ccl.mesh_slice", [](Tensor s, Shape a, Tensor r) { Dispatch(kOps[4], s, a, r); })
      .def("tvm_ext.ccl.cpu.mesh_allreduce", CpuAllReduce)
      .def("tvm_ext.ccl.cpu.mesh_allgather", CpuAllGather)
      .def("tvm_ext.ccl.cpu.mesh_reduce_scatter", CpuReduceScatter)
      .def("tvm_ext.ccl.cpu.mesh_all_to_all", CpuAllToAll)
      .def("tvm_ext.ccl.cpu.mesh_slice", CpuSlice);
}

}  // namespace ccl
}  // namespace tvm_ext
