"""What ``mx.fast.metal_kernel`` makes of a name, a header and a body: the
kernel's name and the whole source it compiles, reproduced from MLX's own
code (mlx/backend/common/metal_kernel.cpp: ``metal_kernel`` and
``write_signature``, MLX 0.32; the signature is written alike in 0.25, the
name's dtype suffixes are new in 0.32).

Nothing on a Mac uses this: MLX assembles the source itself. It lets
metal-sim compile and run, on any machine, the text MLX would compile, so
that a syntax or binding error in what flashattn hands MLX shows up here
(cpp/sim/generate_instream.py, and the stand-in for ``metal_kernel`` in
flashattn._instream.sim). MLX compiles the result after its own utility
header (``metal::utils()``: <metal_stdlib>, its bfloat16_t and float16_t,
...); metal-sim puts :data:`UTILS_STAND_IN` there.

Standard library only, no imports from flashattn (run by path at build time).
"""

from __future__ import annotations

# Inputs with fewer elements are passed in the constant address space.
MAX_CONSTANT_ARRAY_SIZE = 8

# The attributes MLX adds to the signature when the body mentions their
# name (a substring test, in this order), with their types.
METAL_ATTRIBUTES = (
    ("dispatch_quadgroups_per_threadgroup", "uint"),
    ("dispatch_simdgroups_per_threadgroup", "uint"),
    ("dispatch_threads_per_threadgroup", "uint3"),
    ("grid_origin", "uint3"),
    ("grid_size", "uint3"),
    ("quadgroup_index_in_threadgroup", "uint"),
    ("quadgroups_per_threadgroup", "uint"),
    ("simdgroup_index_in_threadgroup", "uint"),
    ("simdgroups_per_threadgroup", "uint"),
    ("thread_execution_width", "uint"),
    ("thread_index_in_quadgroup", "uint"),
    ("thread_index_in_simdgroup", "uint"),
    ("thread_index_in_threadgroup", "uint"),
    ("thread_position_in_grid", "uint3"),
    ("thread_position_in_threadgroup", "uint3"),
    ("threadgroup_position_in_grid", "uint3"),
    ("threadgroups_per_grid", "uint3"),
    ("threads_per_grid", "uint3"),
    ("threads_per_simdgroup", "uint"),
    ("threads_per_threadgroup", "uint3"),
)

# MLX's get_type_string, by dtype name (mx.float16 -> "float16").
TYPE_STRINGS = {
    "float32": "float", "float16": "float16_t", "bfloat16": "bfloat16_t", "float64": "double",
    "complex64": "complex64_t", "bool": "bool", "int8": "int8_t", "int16": "int16_t",
    "int32": "int32_t", "int64": "int64_t", "uint8": "uint8_t", "uint16": "uint16_t",
    "uint32": "uint32_t", "uint64": "uint64_t",
}

# What metal-sim puts where MLX prepends its utility header: what of it the
# signatures rely on (the type names beyond MSL's own; MLX's bf16.h also
# says `using namespace metal`).
UTILS_STAND_IN = "using namespace metal;\ntypedef half float16_t;\ntypedef bfloat bfloat16_t;\n"


def attributes(source: str) -> list[tuple[str, str]]:
    """(name, type) of each attribute MLX adds for `source`, in its order."""
    return [(a, t) for a, t in METAL_ATTRIBUTES if a in source]


def kernel_name(name: str, inputs, output_dtypes) -> str:
    """MLX's name for the kernel: `inputs` are (dtype, ndim, size) triples."""
    out = "custom_kernel_" + name
    for dtype, ndim, size in inputs:
        out += "_" + TYPE_STRINGS[dtype]
        out += "s" if ndim == 0 else ("c" if size < MAX_CONSTANT_ARRAY_SIZE else "")
    for dtype in output_dtypes:
        out += "_" + TYPE_STRINGS[dtype]
    return out


def write_signature(func_name: str, header: str, source: str, input_names, inputs,
                    output_names, output_dtypes, attrs, shape_infos,
                    atomic_outputs: bool = False) -> str:
    """MLX's write_signature, without template arguments (flashattn passes
    none: the body pins the kernel template's parameters itself)."""
    text = header + "[[kernel]] void " + func_name + "(\n"
    index = 0
    for name, (dtype, ndim, size), (has_shape, has_strides, has_ndim) in zip(
            input_names, inputs, shape_infos):
        location = "constant" if size < MAX_CONSTANT_ARRAY_SIZE else "device"
        ref = "&" if ndim == 0 else "*"
        text += f"  const {location} {TYPE_STRINGS[dtype]}{ref} {name} [[buffer({index})]],\n"
        index += 1
        if ndim > 0:
            if has_shape:
                text += f"  const constant int* {name}_shape [[buffer({index})]],\n"
                index += 1
            if has_strides:
                text += f"  const constant int64_t* {name}_strides [[buffer({index})]],\n"
                index += 1
            if has_ndim:
                text += f"  const constant int& {name}_ndim [[buffer({index})]],\n"
                index += 1
    for name, dtype in zip(output_names, output_dtypes):
        type_string = TYPE_STRINGS[dtype]
        if atomic_outputs:
            type_string = f"atomic<{type_string}>"
        text += f"  device {type_string}* {name} [[buffer({index})]]"
        # (MLX's test, index against inputs + outputs, as written there.)
        if index < len(inputs) + len(output_names) - 1 or attrs:
            text += ",\n"
        else:
            text += ") {\n"
        index += 1
    for i, (attr, type_) in enumerate(attrs):
        text += f"  {type_} {attr} [[{attr}]]"
        text += ",\n" if i < len(attrs) - 1 else ") {\n"
    return text + source + "\n}\n"


def assemble(name: str, input_names, output_names, source: str, header: str, inputs,
             output_dtypes, atomic_outputs: bool = False) -> tuple[str, str, list]:
    """(kernel name, the source MLX compiles after its utility header, the
    attributes in signature order) for a metal_kernel(name, input_names,
    output_names, source, header) called with `inputs` ((dtype, ndim, size)
    of each) and `output_dtypes`."""
    shape_infos = [(n + "_shape" in source, n + "_strides" in source, n + "_ndim" in source)
                   for n in input_names]
    attrs = attributes(source)
    func = kernel_name(name, inputs, output_dtypes)
    text = write_signature(func, header, source, input_names, inputs, output_names,
                           output_dtypes, attrs, shape_infos, atomic_outputs)
    return func, text, attrs
