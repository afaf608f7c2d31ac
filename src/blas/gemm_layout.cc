#include "blas/gemm_layout.h"

#include <tvm/ffi/error.h>

#include <algorithm>
#include <string>

namespace tvm_ext {
namespace blas {
namespace {

constexpr int kM = 0, kN = 1, kK = 2, kBatch = 3, kUnit = -1;

std::vector<int64_t> CompactStrides(const DLTensor* t, const char* api) {
  std::vector<int64_t> strides(t->ndim, 1);
  for (int i = t->ndim - 2; i >= 0; --i) strides[i] = strides[i + 1] * t->shape[i + 1];
  if (!IsCompact(t)) TVM_FFI_THROW(ValueError) << api << ": tensors must be compact row-major";
  return strides;
}

// Fills `op`'s strides and the extents it defines; checks the ones it shares.
void Bind(Operand* op, const std::vector<int>& roles, int row_role, int col_role,
          GemmLayout* g, bool defines_batch, const char* name, const char* api) {
  const DLTensor* t = op->t;
  if (static_cast<int>(roles.size()) != t->ndim) {
    TVM_FFI_THROW(ValueError) << api << ": " << roles.size() << " roles for " << name
                              << " with " << t->ndim << " axes";
  }
  std::vector<int64_t> strides = CompactStrides(t, api);
  int seen_row = 0, seen_col = 0;
  for (int i = 0; i < t->ndim; ++i) {
    int r = roles[i];
    int64_t extent = t->shape[i];
    int64_t* dim = r == kM ? &g->m : r == kN ? &g->n : r == kK ? &g->k : nullptr;
    if (r == row_role || r == col_role) {
      (r == row_role ? op->row : op->col) = strides[i];
      ++(r == row_role ? seen_row : seen_col);
      if (*dim == -1) *dim = extent;
      if (*dim != extent) {
        TVM_FFI_THROW(ValueError) << api << ": " << name << " axis " << i << " has extent "
                                  << extent << ", expected " << *dim;
      }
    } else if (r >= kBatch) {
      size_t b = static_cast<size_t>(r - kBatch);
      if (defines_batch) {
        if (g->batch.size() <= b) g->batch.resize(b + 1, -1);
        if (g->batch[b] != -1) {
          TVM_FFI_THROW(ValueError) << api << ": batch dim " << b << " twice in " << name;
        }
        g->batch[b] = extent;
      } else if (b >= g->batch.size() || (extent != g->batch[b] && extent != 1)) {
        TVM_FFI_THROW(ValueError) << api << ": " << name << " axis " << i << " (batch dim "
                                  << b << ") does not match C";
      }
      if (op->batch.size() <= b) op->batch.resize(b + 1, 0);
      op->batch[b] = extent == 1 ? 0 : strides[i];
    } else if (r != kUnit || extent != 1) {
      TVM_FFI_THROW(ValueError) << api << ": role " << r << " is not valid for " << name
                                << " axis " << i << " (extent " << extent << ")";
    }
  }
  if (seen_row != 1 || seen_col != 1) {
    TVM_FFI_THROW(ValueError) << api << ": " << name << " needs exactly one axis of each "
                              << "matrix role";
  }
}

std::vector<int> NextRoles(tvm::ffi::PackedArgs args, int* pos, const char* api) {
  if (*pos >= args.size()) TVM_FFI_THROW(ValueError) << api << ": missing roles";
  int64_t n = args[*pos].cast<int64_t>();
  ++*pos;
  if (n < 0 || *pos + n > args.size()) TVM_FFI_THROW(ValueError) << api << ": bad role count";
  std::vector<int> roles;
  for (int64_t i = 0; i < n; ++i) {
    roles.push_back(static_cast<int>(args[*pos + i].cast<int64_t>()));
  }
  *pos += static_cast<int>(n);
  return roles;
}

}  // namespace

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
  for (int64_t e : batch) total *= e;
  return total;
}

void GemmLayout::Offsets(int64_t index, int64_t* oa, int64_t* ob, int64_t* oc) const {
  *oa = *ob = *oc = 0;
  for (int i = static_cast<int>(batch.size()) - 1; i >= 0; --i) {
    int64_t idx = index % batch[i];
    index /= batch[i];
    if (static_cast<size_t>(i) < a.batch.size()) *oa += idx * a.batch[i];
    if (static_cast<size_t>(i) < b.batch.size()) *ob += idx * b.batch[i];
    *oc += idx * c.batch[i];
  }
}

GemmLayout ReadGemmLayout(tvm::ffi::PackedArgs args, const char* api) {
  if (args.size() < 6) TVM_FFI_THROW(ValueError) << api << ": expects A, B, C and their roles";
  GemmLayout g;
  g.a.t = args[0].cast<DLTensor*>();
  g.b.t = args[1].cast<DLTensor*>();
  g.c.t = args[2].cast<DLTensor*>();
  int pos = 3;
  std::vector<int> ra = NextRoles(args, &pos, api);
  std::vector<int> rb = NextRoles(args, &pos, api);
  std::vector<int> rc = NextRoles(args, &pos, api);
  if (pos != args.size()) TVM_FFI_THROW(ValueError) << api << ": extra arguments after roles";
  g.m = g.n = g.k = -1;
  Bind(&g.c, rc, kM, kN, &g, true, "C", api);
  for (size_t i = 0; i < g.batch.size(); ++i) {
    if (g.batch[i] == -1) TVM_FFI_THROW(ValueError) << api << ": batch dim " << i << " not in C";
  }
  g.c.batch.resize(g.batch.size(), 0);
  Bind(&g.a, ra, kM, kK, &g, false, "A", api);
  Bind(&g.b, rb, kK, kN, &g, false, "B", api);
  return g;
}

bool RowMajor(int64_t row_stride, int64_t col_stride, int64_t rows, int64_t cols, bool* trans,
              int64_t* ld) {
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
