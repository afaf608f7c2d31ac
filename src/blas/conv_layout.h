/*
 * The arguments of one `tvm_ext.blas.conv2d` / `tvm_ext.cudnn.conv2d` call, shared by the CPU
 * and GPU implementations:
 *
 *   conv2d(X, W, Y, stride_h, stride_w, pad_top, pad_left, dil_h, dil_w, groups
 *          [, X axes (n, c, h, w), W axes (f, c, kh, kw), Y axes (n, f, h, w)])
 *   Y[n, f, y, x] = sum_{c, ry, rx} X[n, g*C/groups + c, y*sh + ry*dh - pad_top,
 *                                     x*sw + rx*dw - pad_left] * W[f, c, ry, rx]
 *
 * with g = f / (F/groups) and out-of-range reads zero (so bottom/right padding follows from
 * Y's shape). Each tensor is compact; the optional 12 integers say which of its axes holds
 * each role (default NCHW / OIHW / NCHW), so a weight gradient, whose data and output are
 * "CNHW" ([C, N, H, W]: channels outermost), calls it as it is.
 */
#ifndef TVM_EXT_BLAS_CONV_LAYOUT_H_
#define TVM_EXT_BLAS_CONV_LAYOUT_H_

#include <dlpack/dlpack.h>
#include <tvm/ffi/function.h>

#include <cstdint>

namespace tvm_ext {
namespace blas {

struct ConvShape {
  int64_t n, c, h, w, f, cg, kh, kw, oh, ow, groups;
  int64_t sh, sw, pt, pl, dh, dw;
  // Element strides per role: X (n, c, h, w), W (f, c, kh, kw), Y (n, f, h, w).
  int64_t xs[4], ws[4], ys[4];
  int64_t fg() const { return f / groups; }
  int64_t pixels() const { return oh * ow; }
  int64_t depth() const { return cg * kh * kw; }
  // Y's pixels of one (image, filter) are one row-major run, and a group's filters rows of
  // a matrix BLAS accepts (row stride at least the row).
  bool pixels_contiguous() const {
    return ys[3] == 1 && (oh == 1 || ys[2] == ow) && (fg() == 1 || ys[1] >= pixels());
  }
  // ... and consecutive images' runs follow each other: columns (image, pixel) are one run.
  bool images_merge() const { return pixels_contiguous() && (n == 1 || ys[0] == pixels()); }
  // W_g is a row-major (F/g x depth) matrix in place (row stride ws[0]).
  bool weight_in_place() const {
    return (kw == 1 || ws[3] == 1) && (kh == 1 || ws[2] == kw) &&
           (cg == 1 || ws[1] == kh * kw) && (fg() == 1 || ws[0] >= depth());
  }
  // X's (C/g x H*W) planes are the column matrix of a 1x1, stride-1, unpadded convolution.
  bool direct() const {
    return kh == 1 && kw == 1 && sh == 1 && sw == 1 && pt == 0 && pl == 0 && oh == h &&
           ow == w && xs[3] == 1 && (h == 1 || xs[2] == w) && (cg == 1 || xs[1] == h * w);
  }
};

struct ConvArgs {
  const DLTensor* x;
  const DLTensor* w;
  DLTensor* y;
  ConvShape s;
};

// The tensors and geometry of a call (shapes, roles and parameters checked; dtypes and
// devices are the caller's to check). Errors are ValueErrors naming `api`.
ConvArgs ReadConvArgs(tvm::ffi::PackedArgs args, const char* api);

}  // namespace blas
}  // namespace tvm_ext

#endif  // TVM_EXT_BLAS_CONV_LAYOUT_H_
