// Declarations that TVM's shipped runtime headers (tensor.h, vm/executable.h) refer to but the
// wheel does not ship. tvm_ext never serializes through these streams, so declarations suffice:
// the inline functions that use them are never instantiated here.
#ifndef TVM_EXT_SHIM_TVM_SUPPORT_IO_H_
#define TVM_EXT_SHIM_TVM_SUPPORT_IO_H_

#include <cstddef>

namespace tvm {
namespace support {

class Stream {
 public:
  virtual ~Stream() = default;
  virtual size_t Read(void* ptr, size_t size) = 0;
  virtual size_t Write(const void* ptr, size_t size) = 0;
  template <typename T>
  void Write(const T& data);
  template <typename T>
  bool Read(T* out);
  template <typename T>
  void WriteArray(const T* data, size_t num_elems);
  template <typename T>
  bool ReadArray(T* data, size_t num_elems);
};

}  // namespace support
}  // namespace tvm

#endif  // TVM_EXT_SHIM_TVM_SUPPORT_IO_H_
