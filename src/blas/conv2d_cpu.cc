/*
 * `tvm_ext.blas.conv2d(X, W, Y, stride_h, stride_w, pad_top, pad_left, dil_h, dil_w, groups)`:
 * NCHW data, OIHW weight, Y[n, f, y, x] = sum_{c, ry, rx} X[n, g*C/groups + c,
 * y*sh + ry*dh - pad_top, x*sw + rx*dw - pad_left] * W[f, c, ry, rx], out-of-range reads zero
 * (so bottom/right padding follows from Y's shape). As im2col + GEMM per image and group, on
 * the BLAS blas_library.cc loads. The column matrix (C/groups*KH*KW x OH*OW, one image and
 * group at a time) comes from TVM's workspace allocator, like a generated kernel's scratch.
 */
#include <tvm/ffi/error.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/function.h>
#include <tvm/runtime/c_backend_api.h>

#include <cstdint>

#include "blas/blas_library.h"
#include "blas/gemm_layout.h"

namespace tvm_ext {
namespace blas {
namespace {

struct ConvShape {
  int64_t n, c, h, w, f, cg, kh, kw, oh, ow, groups;
  int64_t sh, sw, pt, pl, dh, dw;
};

template <typename T>
void Im2Col(const T* x, const ConvShape& s, T* col) {
  int64_t pixels = s.oh * s.ow;
  for (int64_t c = 0; c < s.cg; ++c) {
    for (int64_t ky = 0; ky < s.kh; ++ky) {
      for (int64_t kx = 0; kx < s.kw; ++kx) {
        T* row = col + ((c * s.kh + ky) * s.kw + kx) * pixels;
        const T* plane = x + c * s.h * s.w;
        for (int64_t oy = 0; oy < s.oh; ++oy) {
          int64_t iy = oy * s.sh + ky * s.dh - s.pt;
          T* out = row + oy * s.ow;
          if (iy < 0 || iy >= s.h) {
            for (int64_t ox = 0; ox < s.ow; ++ox) out[ox] = T(0);
            continue;
          }
          const T* in = plane + iy * s.w;
          for (int64_t ox = 0; ox < s.ow; ++ox) {
            int64_t ix = ox * s.sw + kx * s.dw - s.pl;
            out[ox] = (ix >= 0 && ix < s.w) ? in[ix] : T(0);
          }
        }
      }
    }
  }
}

template <typename T>
void Gemm(const BlasLibrary& lib, int64_t m, int64_t n, int64_t k, const T* a, const T* b,
          T* c) {
  if constexpr (sizeof(T) == 4) {
    lib.sgemm(kRowMajor, kNoTrans, kNoTrans, m, n, k, 1.0f, a, k, b, n, 0.0f, c, n);
  } else {
    lib.dgemm(kRowMajor, kNoTrans, kNoTrans, m, n, k, 1.0, a, k, b, n, 0.0, c, n);
  }
}

template <typename T>
void Conv(const DLTensor* xt, const DLTensor* wt, DLTensor* yt, const ConvShape& s) {
  const BlasLibrary& lib = Library();
  const T* x = reinterpret_cast<const T*>(static_cast<char*>(xt->data) + xt->byte_offset);
  const T* w = reinterpret_cast<const T*>(static_cast<char*>(wt->data) + wt->byte_offset);
  T* y = reinterpret_cast<T*>(static_cast<char*>(yt->data) + yt->byte_offset);
  int64_t fg = s.f / s.groups, pixels = s.oh * s.ow, depth = s.cg * s.kh * s.kw;
  bool direct = s.kh == 1 && s.kw == 1 && s.sh == 1 && s.sw == 1 && s.pt == 0 && s.pl == 0 &&
                s.oh == s.h && s.ow == s.w;
  T* col = nullptr;
  if (!direct && depth * pixels > 0) {
    col = static_cast<T*>(TVMBackendAllocWorkspace(kDLCPU, 0, depth * pixels * sizeof(T),
                                                   kDLFloat, sizeof(T) * 8));
    if (col == nullptr) TVM_FFI_THROW(RuntimeError) << "tvm_ext.blas.conv2d: out of memory";
  }
  for (int64_t n = 0; n < s.n; ++n) {
    for (int64_t g = 0; g < s.groups; ++g) {
      const T* xg = x + (n * s.c + g * s.cg) * s.h * s.w;
      const T* cols = xg;
      if (!direct) {
        Im2Col(xg, s, col);
        cols = col;
      }
      Gemm(lib, fg, pixels, depth, w + g * fg * depth, cols, y + (n * s.f + g * fg) * pixels);
    }
  }
  if (col != nullptr) TVMBackendFreeWorkspace(kDLCPU, 0, col);
}

void Check(bool ok, const char* what) {
  if (!ok) TVM_FFI_THROW(ValueError) << "tvm_ext.blas.conv2d: " << what;
}

}  // namespace

void CpuConv2d(tvm::ffi::PackedArgs args) {
  Check(args.size() == 10, "expects X, W, Y and 7 integers");
  const DLTensor* x = args[0].cast<DLTensor*>();
  const DLTensor* w = args[1].cast<DLTensor*>();
  DLTensor* y = args[2].cast<DLTensor*>();
  Check(x->ndim == 4 && w->ndim == 4 && y->ndim == 4, "X, W and Y must be 4-D (NCHW, OIHW)");
  for (const DLTensor* t : {x, w, static_cast<const DLTensor*>(y)}) {
    Check(t->device.device_type == kDLCPU, "tensors must be on the CPU");
    Check(IsCompact(t), "tensors must be compact");
    Check(t->dtype.code == x->dtype.code && t->dtype.bits == x->dtype.bits, "one dtype only");
  }
  ConvShape s{x->shape[0], x->shape[1], x->shape[2], x->shape[3], w->shape[0], w->shape[1],
              w->shape[2], w->shape[3], y->shape[2], y->shape[3], 0, 0, 0, 0, 0, 0, 0};
  s.sh = args[3].cast<int64_t>(), s.sw = args[4].cast<int64_t>();
  s.pt = args[5].cast<int64_t>(), s.pl = args[6].cast<int64_t>();
  s.dh = args[7].cast<int64_t>(), s.dw = args[8].cast<int64_t>();
  s.groups = args[9].cast<int64_t>();
  Check(s.sh > 0 && s.sw > 0 && s.dh > 0 && s.dw > 0 && s.groups > 0,
        "strides, dilations and groups must be positive");
  Check(s.c == s.cg * s.groups && s.f % s.groups == 0,
        "channels do not match the weight's shape and groups");
  Check(y->shape[0] == s.n && y->shape[1] == s.f, "Y's batch or channels do not match");
  Check(x->dtype.code == kDLFloat && (x->dtype.bits == 32 || x->dtype.bits == 64),
        "float32 or float64 only");
  if (x->dtype.bits == 32) {
    Conv<float>(x, w, y, s);
  } else {
    Conv<double>(x, w, y, s);
  }
}

}  // namespace blas
}  // namespace tvm_ext
