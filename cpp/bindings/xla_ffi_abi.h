// The part of XLA's FFI C ABI (xla/ffi/api/c_api.h, API version 0.x) that
// flashattn's JAX handlers use, declared here by hand.
//
// Why not include jaxlib's header: the extension is built by pip in an
// isolated environment that has no jax (jax is an optional extra), and the
// C++ FFI helpers (xla/ffi/api/ffi.h) are templates tied to the jaxlib they
// ship with. The C ABI is the stable contract XLA promises across releases:
// plain structs that begin with their size, enums with fixed values. Only
// the fields read or written here are declared in full; every struct keeps
// the exact order and types of the ABI up to its last field used.
#pragma once
#include <cstddef>
#include <cstdint>

namespace flashattn::xla_ffi {

enum ExtensionType : int { kExtensionMetadata = 1 };

struct ExtensionBase {
    size_t struct_size;
    ExtensionType type;
    ExtensionBase* next;
};

struct ApiVersion {
    size_t struct_size;
    ExtensionBase* extension_start;
    int major_version;
    int minor_version;
};

enum ErrorCode : int { kInvalidArgument = 3, kResourceExhausted = 8, kInternal = 13 };

struct Error;  // opaque, owned by XLA once returned

struct ErrorCreateArgs {
    size_t struct_size;
    ExtensionBase* extension_start;
    const char* message;  // copied by XLA
    ErrorCode errc;
};

enum DataType : int { kPred = 1, kS32 = 4, kS64 = 5, kF16 = 10, kF32 = 11, kF64 = 12, kBF16 = 16 };

struct Buffer {
    size_t struct_size;
    ExtensionBase* extension_start;
    DataType dtype;
    void* data;
    int64_t rank;
    int64_t* dims;  // row-major (XLA's default layout for custom calls)
};

enum ArgType : int { kArgBuffer = 1 };
enum RetType : int { kRetBuffer = 1 };
enum AttrType : int { kAttrArray = 1, kAttrDictionary = 2, kAttrScalar = 3, kAttrString = 4 };

struct ByteSpan {
    const char* ptr;
    size_t len;
};

struct Scalar {
    DataType dtype;
    void* value;
};

struct Args {
    size_t struct_size;
    ExtensionBase* extension_start;
    int64_t size;
    ArgType* types;
    void** args;  // Buffer* where types[i] == kArgBuffer
};

struct Rets {
    size_t struct_size;
    ExtensionBase* extension_start;
    int64_t size;
    RetType* types;
    void** rets;  // Buffer* where types[i] == kRetBuffer
};

struct Attrs {
    size_t struct_size;
    ExtensionBase* extension_start;
    int64_t size;
    AttrType* types;
    ByteSpan** names;
    void** attrs;  // Scalar* where types[i] == kAttrScalar
};

struct Api;

struct CallFrame {
    size_t struct_size;
    ExtensionBase* extension_start;  // a MetadataExtension when XLA asks for metadata
    const Api* api;
    void* ctx;
    int stage;
    Args args;
    Rets rets;
    Attrs attrs;
};

using Handler = Error*(CallFrame*);
using ErrorCreate = Error*(ErrorCreateArgs*);

// The head of the function table: only XLA_FFI_Error_Create is called.
struct Api {
    size_t struct_size;
    ExtensionBase* extension_start;
    ApiVersion api_version;
    const void* internal_api;
    ErrorCreate* error_create;
};

// XLA's metadata query, made once when a handler is registered: the handler
// answers with the ABI version it was written against and no traits.
struct Metadata {
    size_t struct_size;
    ApiVersion api_version;
    uint32_t traits;
};

struct MetadataExtension {
    ExtensionBase extension_base;
    Metadata* metadata;
};

// The ABI version these declarations follow.
constexpr int kApiMajor = 0;
constexpr int kApiMinor = 1;

}  // namespace flashattn::xla_ffi
