/*!
 * \file ccl/ccl_mesh.h
 * \brief The mesh collectives of partitioned modules (tvm_ext.passes.PartitionOperators): what
 * every backend shares, i.e. the groups of one mesh level and the block layout of a cut axis.
 *
 * The k workers form a mesh of levels (p_1, ..., p_L), level 1 outermost; worker
 * w = sum_l c_l * stride_l with stride_l = p_{l+1} * ... * p_L. A collective at level l runs in
 * every group of the p_l workers that differ only in c_l: {base + j * stride_l, j < p_l}, the
 * worker's rank in it being c_l. Every worker calls it (all groups at once).
 *
 * A tensor cut along `axis` at level l holds, of the axis of the whole (gathered) tensor, viewed
 * as [A, p_l, B] (A: the levels above l that do not cut this axis, see
 * tvm_ext/partition/layout.py), the slice [A, c_l, B]. So, with `pre` / `post` the products of the
 * dims before / after the axis, piece c of a whole tensor [pre, A, p, B, post] is
 * [pre, A, c, B, post]: `rows = pre * A` runs of `B * post` elements, `p` runs apart.
 */
#ifndef TVM_EXT_CCL_CCL_MESH_H_
#define TVM_EXT_CCL_CCL_MESH_H_

#include <tvm/ffi/container/shape.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/error.h>

#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

#include "ccl/ccl_util.h"

namespace tvm_ext {
namespace ccl {

/*! \brief This worker's group at one mesh level. */
struct MeshGroup {
  int stride = 1;
  int size = 1;
  int rank = 0;  // c_l, the worker's coordinate at the level
  int base = 0;  // worker id of rank 0
  int Worker(int j) const { return base + j * stride; }
};

inline MeshGroup LocateMeshGroup(const DiscoWorker* worker, int64_t stride, int64_t size,
                                 const char* fn) {
  int n = worker->num_workers;
  if (stride < 1 || size < 1 || n % (stride * size) != 0) {
    TVM_FFI_THROW(ValueError) << fn << ": a mesh level of " << size << " workers " << stride
                              << " apart does not fit a session of " << n
                              << " workers (the module was partitioned for another number of "
                                 "devices: run it on as many workers as it was built for)";
  }
  MeshGroup g;
  g.stride = static_cast<int>(stride);
  g.size = static_cast<int>(size);
  g.rank = (worker->worker_id / g.stride) % g.size;
  g.base = worker->worker_id - g.rank * g.stride;
  return g;
}

/*! \brief A cut axis of a whole tensor as [pre, A, p, B, post] elements (see the file comment). */
struct AxisBlocks {
  int64_t rows = 1;   // pre * A
  int64_t run = 1;    // B * post, elements per run of one piece
  int64_t parts = 1;  // p
  int64_t RunBytes(int64_t elem) const { return run * elem; }
  /*! \brief Element offset of row i of piece c in the whole tensor. */
  int64_t WholeOffset(int64_t i, int64_t c) const { return (i * parts + c) * run; }
  /*! \brief Element offset of row i in a piece. */
  int64_t PieceOffset(int64_t i) const { return i * run; }
};

/*!
 * \brief The blocks of `axis` of a whole tensor of shape `whole` cut `parts` ways with `outer`
 * (A) leading blocks; throws when they do not divide.
 */
inline AxisBlocks MakeAxisBlocks(const tvm::ffi::Shape& whole, int64_t axis, int64_t outer,
                                 int64_t parts, const char* fn) {
  int64_t ndim = static_cast<int64_t>(whole.size());
  if (axis < 0 || axis >= ndim) {
    TVM_FFI_THROW(ValueError) << fn << ": axis " << axis << " of a " << ndim << "-d tensor";
  }
  int64_t n = whole[axis];
  if (outer < 1 || parts < 1 || n % (outer * parts) != 0) {
    TVM_FFI_THROW(ValueError) << fn << ": axis " << axis << " of extent " << n
                              << " cannot be cut into " << outer << " x " << parts << " blocks";
  }
  AxisBlocks b;
  int64_t pre = 1, post = 1;
  for (int64_t d = 0; d < axis; ++d) pre *= whole[d];
  for (int64_t d = axis + 1; d < ndim; ++d) post *= whole[d];
  b.rows = pre * outer;
  b.parts = parts;
  b.run = n / (outer * parts) * post;
  return b;
}

/*! \brief `shape` with `axis` multiplied by `factor` (the whole of a piece). */
inline tvm::ffi::Shape GrowAxis(const tvm::ffi::Shape& shape, int64_t axis, int64_t factor) {
  std::vector<int64_t> dims(shape.begin(), shape.end());
  if (axis >= 0 && axis < static_cast<int64_t>(dims.size())) dims[axis] *= factor;
  return tvm::ffi::Shape(dims);
}

inline bool SameShape(const tvm::ffi::Shape& a, const tvm::ffi::Shape& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i] != b[i]) return false;
  }
  return true;
}

inline std::string ShapeText(const tvm::ffi::Shape& s) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < s.size(); ++i) os << (i ? ", " : "") << s[i];
  os << "]";
  return os.str();
}

/*! \brief The integer arguments of a mesh collective, checked for count. */
inline std::vector<int64_t> MeshArgs(const tvm::ffi::Shape& args, size_t count, const char* fn,
                                     const char* names) {
  if (args.size() != count) {
    TVM_FFI_THROW(ValueError) << fn << " takes " << count << " integer arguments (" << names
                              << "), got " << args.size();
  }
  return std::vector<int64_t>(args.begin(), args.end());
}

}  // namespace ccl
}  // namespace tvm_ext

#endif  // TVM_EXT_CCL_CCL_MESH_H_
