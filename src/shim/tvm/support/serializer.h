// See io.h: a declaration-only stand-in for a header the TVM wheel does not ship.
#ifndef TVM_EXT_SHIM_TVM_SUPPORT_SERIALIZER_H_
#define TVM_EXT_SHIM_TVM_SUPPORT_SERIALIZER_H_
#include <tvm/support/io.h>

namespace tvm {
namespace support {
// vm/executable.h specializes this for VMFuncInfo.
template <typename T>
struct Serializer;
}  // namespace support
}  // namespace tvm
#endif  // TVM_EXT_SHIM_TVM_SUPPORT_SERIALIZER_H_
