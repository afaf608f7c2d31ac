#include "blas/conv_layout.h"

#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/error.h>

#include "blas/gemm_layout.h"

namespace tvm_ext {
namespace blas {
namespace {

void Check(bool ok, const char* api, const char* what) {
  if (!ok) TVM_FFI_THROW(ValueError) << api << ": " << what;
}

// Element strides of a compact tensor's 4 roles, from the axis holding each (a permutation).
void RoleStrides(const DLTensor* t, const int64_t* axes, const char* api, const char* name,
                 int64_t* strides, int64_t* extents) {
  int64_t compact[4];
  compact[3] = 1;
  for (int i = 2; i >= 0; --i) compact[i] = compact[i + 1] * t->shape[i + 1];
  bool seen[4] = {false, false, false, false};
  for (int r = 0; r < 4; ++r) {
    if (axes[r] < 0 || axes[r] > 3 || seen[axes[r]]) {
      TVM_FFI_THROW(ValueError) << api << ": the axes of " << name
                                << " must be a permutation of 0..3";
    }
    seen[axes[r]] = true;
    strides[r] = compact[axes[r]];
    extents[r] = t->shape[axes[r]];
  }
}

}  // namespace

ConvArgs ReadConvArgs(tvm::ffi::PackedArgs args, const char* api) {
  Check(args.size() == 10 || args.size() == 22, api,
        "expects (X, W, Y, stride_h, stride_w, pad_top, pad_left, dil_h, dil_w, groups"
        "[, 4 axes of X (n, c, h, w), 4 of W (f, c, kh, kw), 4 of Y (n, f, h, w)])");
  ConvArgs a{args[0].cast<DLTensor*>(), args[1].cast<DLTensor*>(), args[2].cast<DLTensor*>(),
             ConvShape{}};
  Check(a.x->ndim == 4 && a.w->ndim == 4 && a.y->ndim == 4, api,
        "X, W and Y must be 4-D: X [N, C, H, W], W [F, C/groups, KH, KW], Y [N, F, OH, OW] "
        "(in the order their axes arguments give)");
  for (const DLTensor* t : {a.x, a.w, static_cast<const DLTensor*>(a.y)}) {
    Check(IsCompact(t), api, "X, W and Y must be compact (no strided views)");
  }
  int64_t axes[12] = {0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3};
  if (args.size() == 22) {
    for (int i = 0; i < 12; ++i) axes[i] = args[10 + i].cast<int64_t>();
  }
  ConvShape& s = a.s;
  int64_t xe[4], we[4], ye[4];
  RoleStrides(a.x, axes, api, "X", s.xs, xe);
  RoleStrides(a.w, axes + 4, api, "W", s.ws, we);
  RoleStrides(a.y, axes + 8, api, "Y", s.ys, ye);
  s.n = xe[0], s.c = xe[1], s.h = xe[2], s.w = xe[3];
  s.f = we[0], s.cg = we[1], s.kh = we[2], s.kw = we[3];
  s.oh = ye[2], s.ow = ye[3];
  s.sh = args[3].cast<int64_t>(), s.sw = args[4].cast<int64_t>();
  s.pt = args[5].cast<int64_t>(), s.pl = args[6].cast<int64_t>();
  s.dh = args[7].cast<int64_t>(), s.dw = args[8].cast<int64_t>();
  s.groups = args[9].cast<int64_t>();
  Check(s.sh > 0 && s.sw > 0 && s.dh > 0 && s.dw > 0 && s.groups > 0, api,
        "strides, dilations and groups must be positive");
  Check(s.pt >= 0 && s.pl >= 0, api, "padding must not be negative");
  Check(s.c == s.cg * s.groups, api,
        "X's channels must be W's input channels (W.shape[1]) times groups");
  Check(s.f % s.groups == 0, api, "W's output channels (W.shape[0]) must divide by groups");
  Check(ye[0] == s.n, api, "Y's batch must be X's");
  Check(ye[1] == s.f, api, "Y's channels must be W's output channels (W.shape[0])");
  return a;
}

}  // namespace blas
}  // namespace tvm_ext
