"""The in-stream paths' kernel sources (flashattn._instream.source) are
generated from the shipped shaders, never copied: every kernel the plan
names is found among the .metal files' own instantiations (the same set
metal-sim registers), its body goes to MLX verbatim, and every text the
installed package generates now is one metal-sim compiled at build time.
MLX's assembly of a metal_kernel is reproduced as MLX's source writes it."""

from __future__ import annotations

import re

import pytest

import flashattn._core as core
from flashattn._instream import call, mlx_assembly, sim, source

CONSTANTS = ((0, "boolean", 1), (1, "boolean", 0), (2, "int32", 21))


@pytest.fixture(scope="module")
def shaders():
    return call.shaders()


def test_instantiations_are_metal_sims_kernels(shaders):
    assert set(shaders.instances) == set(core._sim_kernel_names())


@pytest.mark.parametrize("direction", ["forward", "backward"])
@pytest.mark.parametrize("shape", [(2, 37, 50, 4, 2, 16), (1, 1, 700, 8, 2, 100),
                                   (1, 9, 9, 2, 2, 256)], ids=str)
def test_every_kernel_a_plan_names_is_instantiated(shaders, direction, shape):
    B, Tq, Tk, H, Hkv, D = shape
    q, kv = call.contiguous((B, Tq, H, D)), call.contiguous((B, Tk, Hkv, D))
    extra = {} if direction == "forward" else dict(do=q, o=q, lse=call.contiguous((B, H, Tq)))
    for dtype in ("float32", "float16", "bfloat16"):
        plan = call.plan(direction, dtype, q, kv, kv, softcap=3.0, **extra)
        for launch in plan.launches:
            inst = shaders.instance(launch.kernel)
            params = [p for p in inst.kernel.params if p.buffer is not None]
            assert len(params) == len(launch.buffers), launch.kernel


def test_mlx_body_is_the_templates_body_with_its_parameters_bound(shaders):
    spec = shaders.mlx_kernel("flash_bwd_dq_f16_hd96", CONSTANTS)
    inst = spec.instance
    assert inst.kernel.name == "flash_bwd_dq" and inst.args == ("96", "half")
    assert "    constexpr int HD = 96;\n    typedef half T;\n" in spec.source
    assert inst.kernel.body.strip("\n") in spec.source  # verbatim, at the kernel's own scope
    assert "kernel void" not in spec.header and "flash_bwd_dq<" not in spec.header
    # MLX binds every input as a device buffer: the structs are read through it.
    assert re.search(r"\bconstant\s+Flash\w+\s*&", spec.header + spec.source) is None
    assert "device const FlashParams& p = *reinterpret_cast<device const FlashParams*>(fa_in_p)" \
        in spec.source
    assert [n for n, _ in spec.outputs] == ["fa_out_dq"]
    assert [n for n, _ in spec.inputs][:4] == ["fa_in_q", "fa_in_k", "fa_in_v", "fa_in_dout"]
    assert spec.name == "flashattn_flash_bwd_dq_f16_hd96_fc1_0_21"


def test_tiled_kernels_declare_their_threadgroup_size(shaders):
    """Every tiled kernel template declares FA_MAX_THREADS(FA_THREADS)
    ([[max_total_threads_per_threadgroup]] on Metal), the N the host builds
    its pipeline for (core::declared_max_threads); the parser keeps the
    template (its parameters) and the torch source keeps the attribute."""
    tiled = {"flash_fwd", "flash_bwd_dq", "flash_bwd_dkdv"}
    seen = set()
    for inst in shaders.instances.values():
        k = inst.kernel
        head = k.definition[:k.definition.index(k.name + "(")]
        declares = "FA_MAX_THREADS(FA_THREADS)" in head
        assert declares == (k.name in tiled), (k.name, head)
        if k.name in tiled:
            assert [n for _, n in k.template_params] == ["HD", "T"], k.name
            seen.add(k.name)
    assert seen == tiled
    assert "FA_MAX_THREADS(FA_THREADS) kernel void flash_bwd_dq(" in \
        shaders.torch_source("flash_bwd_dq_f16_hd64", CONSTANTS)


def test_torch_source_is_the_template_unchanged_and_one_instantiation(shaders):
    text = shaders.torch_source("flash_fwd_bf16_hd128", CONSTANTS)
    inst = shaders.instance("flash_fwd_bf16_hd128")
    assert inst.kernel.definition in text
    assert text.count('FA_HOST_NAME("') == 1
    assert re.search(r'template FA_HOST_NAME\("flash_fwd_bf16_hd128"\) kernel void '
                     r'flash_fwd<128, bfloat>\(device const bfloat\*, ', text)
    assert text.count("kernel void flash_fwd(") == 1  # no other kernel came along


def test_constants_block_gives_each_index_its_value():
    block = source.constants_block(CONSTANTS + ((3, "float32", 0x3FC00000),))
    assert "#define FA_INSTREAM_VALUE_0 true\n" in block
    assert "#define FA_INSTREAM_VALUE_1 false\n" in block
    assert "#define FA_INSTREAM_VALUE_2 21\n" in block
    assert "#define FA_INSTREAM_VALUE_3 1.5f\n" in block
    assert "#ifndef FA_FUNCTION_CONSTANT" in block  # metal-sim's <metal_stdlib> defines it
    assert sim.constants_of(block) == list(CONSTANTS + ((3, "float32", 0x3FC00000),))


def test_key_ignores_the_constants_and_nothing_else(shaders):
    a = shaders.torch_source("flash_fwd_f32_hd64", CONSTANTS)
    b = shaders.torch_source("flash_fwd_f32_hd64", ())
    assert source.text_key(a) == source.text_key(b)
    assert source.text_key(a) != source.text_key(shaders.torch_source("flash_fwd_f32_hd32", ()))
    assert source.text_key(a) != source.text_key(a.replace("p.scale", "p.scale * 1"))


def _assembled(spec):
    inst = spec.instance
    inputs = [(inst.dtype(p), 1, 8) for _, p in spec.inputs]
    return mlx_assembly.assemble(spec.name, [n for n, _ in spec.inputs],
                                 [n for n, _ in spec.outputs], spec.source, spec.header, inputs,
                                 [inst.dtype(p) for _, p in spec.outputs])


def test_every_generated_text_is_one_metal_sim_compiled(shaders):
    compiled = set(core._sim_instream_keys())
    for host in shaders.instances:
        _, text, _ = _assembled(shaders.mlx_kernel(host, CONSTANTS))
        torch_text = shaders.torch_source(host, CONSTANTS)
        assert source.text_key(text) in compiled, f"MLX {host}"
        assert source.text_key(torch_text) in compiled, f"torch {host}"
        # MLX and torch hand Metal the text as ASCII (NSASCIIStringEncoding).
        assert text.isascii() and torch_text.isascii(), host
    assert len(compiled) == 2 * len(shaders.instances)


def test_mlx_signature_as_mlx_writes_it():
    # The example of MLX's metal_kernel docstring, on a float16 (4, 16) input.
    body = "uint elem = thread_position_in_grid.x;\nout[elem] = metal::exp(inp[elem]);"
    name, text, attrs = mlx_assembly.assemble("myexp", ["inp"], ["out"], body, "// header\n",
                                              [("float16", 2, 64)], ["float16"])
    assert name == "custom_kernel_myexp_float16_t_float16_t"
    assert attrs == [("thread_position_in_grid", "uint3")]
    assert text == ("// header\n[[kernel]] void custom_kernel_myexp_float16_t_float16_t(\n"
                    "  const device float16_t* inp [[buffer(0)]],\n"
                    "  device float16_t* out [[buffer(1)]],\n"
                    "  uint3 thread_position_in_grid [[thread_position_in_grid]]) {\n"
                    + body + "\n}\n")


def test_mlx_signature_small_inputs_scalars_and_shapes():
    body = "x_shape[0] + a + b[0] + thread_index_in_simdgroup + simdgroup_index_in_threadgroup"
    name, text, attrs = mlx_assembly.assemble(
        "k", ["x", "a", "b"], ["y"], body, "", [("float32", 2, 12), ("int32", 0, 1),
                                              ("uint8", 1, 3)], ["bfloat16"])
    assert name == "custom_kernel_k_float_int32_ts_uint8_tc_bfloat16_t"
    assert [a for a, _ in attrs] == ["simdgroup_index_in_threadgroup",
                                     "thread_index_in_simdgroup"]
    assert text.startswith("[[kernel]] void custom_kernel_k_float_int32_ts_uint8_tc_bfloat16_t(\n"
                           "  const device float* x [[buffer(0)]],\n"
                           "  const constant int* x_shape [[buffer(1)]],\n"
                           "  const constant int32_t& a [[buffer(2)]],\n"
                           "  const constant uint8_t* b [[buffer(3)]],\n"
                           "  device bfloat16_t* y [[buffer(4)]],\n"
                           "  uint simdgroup_index_in_threadgroup "
                           "[[simdgroup_index_in_threadgroup]],\n"
                           "  uint thread_index_in_simdgroup [[thread_index_in_simdgroup]]) {\n")


def test_flashattn_bodies_ask_mlx_only_for_the_builtins_they_bind(shaders):
    for host in shaders.instances:
        _, _, attrs = _assembled(shaders.mlx_kernel(host, ()))
        wanted = {p.builtin for p in shaders.instance(host).kernel.params if p.builtin}
        assert {a for a, _ in attrs} == wanted, host


def test_preprocessor_expands_instantiation_macros():
    files = {"k.metal": '#define TYPES(X, a) X(f32, float, a) X(f16, half, a)\n'
                        '#define INST(N, T, HD) template FA_HOST_NAME("k_" #N "_hd" #HD) '
                        'kernel void k<HD, T>(device T*, uint);\n'
                        '#define INST_T(HD) TYPES(INST, HD)\n'
                        'template <int HD, class T>\n'
                        'kernel void k(device T* x [[buffer(0)]], uint t [[thread_index_in_threadgroup]])'
                        ' { x[t] = T(HD); }\n'
                        'INST_T(8) INST_T(16)\n'
                        'template [[host_name("raw")]] kernel void k<4, float>(device float*, uint);\n'}
    s = source.ShaderSet(files)
    assert {h: i.args for h, i in s.instances.items()} == {
        "k_f32_hd8": ("8", "float"), "k_f16_hd8": ("8", "half"), "k_f32_hd16": ("16", "float"),
        "k_f16_hd16": ("16", "half"), "raw": ("4", "float")}
    header = s.mlx_kernel("raw").header
    assert "template" not in header.split(source.CONSTANTS_END)[1].replace("#define INST", "")


def test_a_kernel_the_shaders_lack_is_an_error(shaders):
    with pytest.raises(source.SourceError, match="no kernel named 'flash_nope_f32'"):
        shaders.instance("flash_nope_f32")
