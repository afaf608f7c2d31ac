/*!
 * \file cuda/capture_mode.h
 * \brief Whether a stream is under CUDA graph capture, and relaxed capture mode for the
 * allocations a vendor library call makes during one (global mode refuses cudaMalloc while
 * any stream of the process is capturing).
 */
#ifndef TVM_EXT_CUDA_CAPTURE_MODE_H_
#define TVM_EXT_CUDA_CAPTURE_MODE_H_

#include "cuda/cuda_driver.h"

namespace tvm_ext {

inline bool Capturing(const CudaDriver* cu, void* stream) {
  int status = 0;
  return stream != nullptr && cu != nullptr && cu->StreamIsCapturing != nullptr &&
         cu->StreamIsCapturing(stream, &status) == CudaDriver::kSuccess &&
         status == CudaDriver::kCaptureActive;
}

/*! \brief This thread in relaxed capture mode while it lives (cu nullptr: nothing to do). */
class RelaxedCapture {
 public:
  explicit RelaxedCapture(const CudaDriver* cu)
      : cu_(cu != nullptr && cu->ThreadExchangeStreamCaptureMode != nullptr ? cu : nullptr) {
    if (cu_ != nullptr) cu_->ThreadExchangeStreamCaptureMode(&mode_);
  }
  ~RelaxedCapture() {
    if (cu_ != nullptr) cu_->ThreadExchangeStreamCaptureMode(&mode_);
  }
  RelaxedCapture(const RelaxedCapture&) = delete;
  RelaxedCapture& operator=(const RelaxedCapture&) = delete;

 private:
  const CudaDriver* cu_;
  int mode_ = CudaDriver::kCaptureModeRelaxed;  // the previous mode while relaxed
};

}  // namespace tvm_ext

#endif  // TVM_EXT_CUDA_CAPTURE_MODE_H_
