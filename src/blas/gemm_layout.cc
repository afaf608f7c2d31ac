#include "blas/gemm_layout.h"

#include <tvm/ffi/container/tensor.h>  // DLTensor* arguments
#include <tvm/ffi/error.h>

#include <algorithm>
#include <optional>
#include <string>

namespace tvm_ext {
namespace blas {
namespace {

std::string RoleName(int role) {
  switch (role) {
    case kRoleM: return "M";
    case kRoleN: return "N";
    case kRoleK: return "K";
    case kRoleUnit: return "unit (-1)";
    default: return role >= kRoleBatch ? "batch dim " + std::to_string(role - kRoleBatch)
                                       : "invalid role " + std::to_string(role);
  }
}

// One tensor's roles, read and checked against its own shape.
struct Axes {
  const DLTensor* t = nullptr;
  const char* name = "";
  std::vector<int64_t> strides;
  int row = -1, col = -1;            // axis of the first / second matrix role
  std::vector<int> batch;            // axis per batch dim, -1 where absent
  int64_t extent(int axis) const { return axis < 0 ? 1 : t->shape[axis]; }
};

Axes ReadAxes(const DLTensor* t, const std::vector<int>& roles, int row_role, int col_role,
              const char* name, bool is_output, const char* api) {
  Axes ax;
  ax.t = t, ax.name = name;
  if (static_cast<int>(roles.size()) != t->ndim) {
    TVM_FFI_THROW(ValueError) << api << ": " << roles.size() << " roles given for " << name
                              << ", which has " << t->ndim << " axes";
  }
  if (!IsCompact(t)) {
    TVM_FFI_THROW(ValueError) << api << ": " << name << " is not compact row-major (strided "
                              << "views are not supported; pass a contiguous tensor)";
  }
  ax.strides.assign(t->ndim, 1);
  for (int i = t->ndim - 2; i >= 0; --i) ax.strides[i] = ax.strides[i + 1] * t->shape[i + 1];
  for (int i = 0; i < t->ndim; ++i) {
    int r = roles[i];
    int* slot = r == row_role ? &ax.row : r == col_role ? &ax.col : nullptr;
    if (r >= kRoleBatch) {
      size_t b = static_cast<size_t>(r - kRoleBatch);
      if (ax.batch.size() <= b) ax.batch.resize(b + 1, -1);
      slot = &ax.batch[b];
    } else if (r == kRoleUnit) {
      // An input axis read at index 0 contributes no offset, whatever its extent; every element
      // of the output is written, so an output axis can only be a unit one.
      if (is_output && t->shape[i] != 1) {
        TVM_FFI_THROW(ValueError) << api << ": " << name << " axis " << i << " has role -1 but "
                                  << "extent " << t->shape[i] << " (an output axis needs a role)";
      }
      continue;
    }
    if (slot == nullptr) {
      TVM_FFI_THROW(ValueError) << api << ": role " << r << " (" << RoleName(r) << ") is not "
                                << "valid for " << name << " axis " << i << " (" << name
                                << " takes " << RoleName(row_role) << ", " << RoleName(col_role)
                                << ", batch dims >= 3 and -1)";
    }
    if (*slot != -1) {
      TVM_FFI_THROW(ValueError) << api << ": " << RoleName(r) << " appears twice in " << name
                                << " (axes " << *slot << " and " << i << ")";
    }
    *slot = i;
  }
  for (auto [role, axis] : {std::pair{row_role, ax.row}, std::pair{col_role, ax.col}}) {
    if (axis == -1) {
      TVM_FFI_THROW(ValueError) << api << ": " << name << " has no axis with role "
                                << RoleName(role) << " (each matrix role appears exactly once)";
    }
  }
  return ax;
}

void CheckExtent(const char* api, const char* dim, const Axes& x, int x_axis, const Axes& y,
                 int y_axis) {
  if (x.extent(x_axis) != y.extent(y_axis)) {
    TVM_FFI_THROW(ValueError) << api << ": " << dim << " is " << x.extent(x_axis) << " in "
                              << x.name << " (axis " << x_axis << ") but " << y.extent(y_axis)
                              << " in " << y.name << " (axis " << y_axis << ")";
  }
}

std::vector<int> NextRoles(tvm::ffi::PackedArgs args, int* pos, const char* name,
                           const char* api) {
  auto count = *pos < args.size() ? args[*pos].try_cast<int64_t>() : std::nullopt;
  if (!count.has_value() || *count < 0 || *pos + 1 + *count > args.size()) {
    TVM_FFI_THROW(ValueError) << api << ": expected the number of " << name << "'s roles at "
                              << "argument " << *pos << ", then that many roles";
  }
  std::vector<int> roles;
  for (int64_t i = 1; i <= *count; ++i) {
    auto r = args[*pos + i].try_cast<int64_t>();
    if (!r.has_value()) {
      TVM_FFI_THROW(TypeError) << api << ": argument " << *pos + i << " (a role of " << name
                               << ") is not an integer";
    }
    roles.push_back(static_cast<int>(*r));
  }
  *pos += 1 + static_cast<int>(*count);
  return roles;
}

const DLTensor* TensorArg(tvm::ffi::PackedArgs args, int i, const char* api) {
  auto t = args[i].try_cast<DLTensor*>();
  if (!t.has_value() || *t == nullptr) {
    TVM_FFI_THROW(TypeError) << api << ": argument " << i << " (" << "ABC"[i]
                             << ") is not a tensor";
  }
  return *t;
}

}  // namespace

std::string DTypeName(DLDataType t) {
  const char* code = t.code == kDLInt ? "int" : t.code == kDLUInt ? "uint"
                     : t.code == kDLFloat ? "float" : t.code == kDLBfloat ? "bfloat" : nullptr;
  std::string name = code ? code + std::to_string(t.bits)
                          : "type code " + std::to_string(t.code) + " " + std::to_string(t.bits);
  return t.lanes == 1 ? name : name + "x" + std::to_string(t.lanes);
}

bool IsCompact(const DLTensor* t) {
  if (t->strides == nullptr) return true;
  int64_t expected = 1;
  for (int i = t->ndim - 1; i >= 0; --i) {
    if (t->shape[i] > 1 && t->strides[i] != expected) return false;
    expected *= t->shape[i];
  }
  return true;
}

int64_t GemmLayout::num_batches() const {
  int64_t total = 1;
  for (const BatchDim& d : batch) total *= d.extent;
  return total;
}

void GemmLayout::Offsets(int64_t index, size_t ndims, int64_t* oa, int64_t* ob,
                         int64_t* oc) const {
  *oa = *ob = *oc = 0;
  for (size_t i = ndims; i-- > 0;) {
    int64_t idx = index % batch[i].extent;
    index /= batch[i].extent;
    *oa += idx * batch[i].a, *ob += idx * batch[i].b, *oc += idx * batch[i].c;
  }
}

GemmLayout ReadGemmLayout(tvm::ffi::PackedArgs args, const char* api) {
  if (args.size() < 6) {
    TVM_FFI_THROW(ValueError) << api << ": expects (A, B, C, nA, roles of A.., nB, roles of "
                              << "B.., nC, roles of C..), got " << args.size() << " arguments";
  }
  GemmLayout g;
  g.a.t = TensorArg(args, 0, api), g.b.t = TensorArg(args, 1, api);
  g.c.t = TensorArg(args, 2, api);
  int pos = 3;
  std::vector<int> ra = NextRoles(args, &pos, "A", api);
  std::vector<int> rb = NextRoles(args, &pos, "B", api);
  std::vector<int> rc = NextRoles(args, &pos, "C", api);
  if (pos != args.size()) {
    TVM_FFI_THROW(ValueError) << api << ": " << args.size() - pos << " extra arguments after "
                              << "the roles";
  }
  Axes a = ReadAxes(g.a.t, ra, kRoleM, kRoleK, "A", false, api);
  Axes b = ReadAxes(g.b.t, rb, kRoleK, kRoleN, "B", false, api);
  Axes c = ReadAxes(g.c.t, rc, kRoleM, kRoleN, "C", true, api);
  CheckExtent(api, "M", a, a.row, c, c.row);
  CheckExtent(api, "N", b, b.col, c, c.col);
  CheckExtent(api, "K", a, a.col, b, b.row);
  g.m = c.extent(c.row), g.n = c.extent(c.col), g.k = a.extent(a.col);
  g.a.row = a.strides[a.row], g.a.col = a.strides[a.col];
  g.b.row = b.strides[b.row], g.b.col = b.strides[b.col];
  g.c.row = c.strides[c.row], g.c.col = c.strides[c.col];

  // Batch dims: C defines them all; A and B hold each at most once, of C's extent or 1.
  size_t nb = c.batch.size();
  for (size_t i = 0; i < nb; ++i) {
    if (c.batch[i] == -1) {
      TVM_FFI_THROW(ValueError) << api << ": batch dim " << i << " is not in C (C's batch dims "
                                << "must be numbered 0, 1, .. without gaps)";
    }
  }
  std::vector<BatchDim> dims(nb);
  for (size_t i = 0; i < nb; ++i) dims[i].extent = c.extent(c.batch[i]);
  for (Axes* x : {&a, &b}) {
    if (x->batch.size() > nb) {
      TVM_FFI_THROW(ValueError) << api << ": " << x->name << " has batch dim "
                                << x->batch.size() - 1 << ", which C does not have";
    }
    for (size_t i = 0; i < x->batch.size(); ++i) {
      int axis = x->batch[i];
      if (axis == -1) continue;
      int64_t extent = x->extent(axis);
      if (extent != dims[i].extent && extent != 1) {
        TVM_FFI_THROW(ValueError) << api << ": batch dim " << i << " is " << dims[i].extent
                                  << " in C but " << extent << " in " << x->name << " (axis "
                                  << axis << "; only 1 broadcasts)";
      }
      (x == &a ? dims[i].a : dims[i].b) = extent == 1 ? 0 : x->strides[axis];
    }
  }
  for (size_t i = 0; i < nb; ++i) dims[i].c = c.strides[c.batch[i]];

  // Merge from the innermost dim out: an outer dim whose strides are the inner one's times its
  // extent, in all three operands, continues it (a 0 stride continues a 0 stride).
  for (size_t i = nb; i-- > 0;) {
    const BatchDim& d = dims[i];
    if (d.extent == 1) continue;
    if (!g.batch.empty()) {
      BatchDim& in = g.batch.front();
      if (d.a == in.a * in.extent && d.b == in.b * in.extent && d.c == in.c * in.extent) {
        in.extent *= d.extent;
        continue;
      }
    }
    g.batch.insert(g.batch.begin(), d);
  }
  return g;
}

bool RowMajor(int64_t row_stride, int64_t col_stride, int64_t rows, int64_t cols, bool* trans,
              int64_t* ld) {
  // BLAS wants ld >= max(1, the stored row length) even where the value is never used.
  if (cols == 1 || col_stride == 1) {
    *trans = false;
    *ld = rows == 1 ? std::max<int64_t>(cols, 1) : row_stride;
    return *ld >= std::max<int64_t>(cols, 1);
  }
  if (rows == 1 || row_stride == 1) {
    *trans = true;
    *ld = col_stride;
    return *ld >= std::max<int64_t>(rows, 1);
  }
  return false;
}

}  // namespace blas
}  // namespace tvm_ext
