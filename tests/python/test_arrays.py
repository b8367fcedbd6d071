"""The NumPy API reads other libraries' arrays in place: anything exposing
__dlpack__ on the host (torch CPU tensors, JAX CPU arrays, MLX arrays), the
buffer protocol or __array_interface__; results are NumPy arrays. A torch
tensor that requires grad is pointed to flashattn.torch. And `import
flashattn` imports no framework."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import flashattn as fa
from flashattn._arrays import host_array


def _qkv():
    rng = np.random.default_rng(0)
    return [rng.standard_normal((2, 19, 4, 8), dtype=np.float32) for _ in range(3)]


class _InterfaceOnly:
    """Exposes nothing but __array_interface__ (as many C extensions do)."""

    def __init__(self, a):
        self._a = a
        self.__array_interface__ = a.__array_interface__


def _frameworks():
    out = []
    try:
        import torch
        out.append(pytest.param(torch.from_numpy, id="torch"))
    except ImportError:
        out.append(pytest.param(None, id="torch", marks=pytest.mark.skip(reason="torch not installed")))
    try:
        import jax.numpy as jnp
        out.append(pytest.param(jnp.asarray, id="jax"))
    except ImportError:
        out.append(pytest.param(None, id="jax", marks=pytest.mark.skip(reason="jax not installed")))
    try:
        import mlx.core as mx
        out.append(pytest.param(mx.array, id="mlx"))
    except ImportError:
        out.append(pytest.param(None, id="mlx", marks=pytest.mark.skip(reason="mlx not installed")))
    return out


WRAPPERS = _frameworks() + [
    pytest.param(memoryview, id="buffer-protocol"),
    pytest.param(_InterfaceOnly, id="array-interface"),
]


@pytest.mark.parametrize("wrap", WRAPPERS)
def test_other_arrays_give_the_numpy_results_bit_for_bit(wrap):
    q, k, v = _qkv()
    o, lse = fa.attention(q, k, v, causal=True, return_lse=True, backend="cpu")
    do = np.ones_like(o)
    grads = fa.attention_backward(do, q, k, v, o, lse, causal=True, backend="cpu")

    wrapped = [wrap(x) for x in (q, k, v)]
    o2, lse2 = fa.attention(*wrapped, causal=True, return_lse=True, backend="cpu")
    assert type(o2) is np.ndarray and type(lse2) is np.ndarray
    np.testing.assert_array_equal(o2, o)
    np.testing.assert_array_equal(lse2, lse)
    grads2 = fa.attention_backward(wrap(do), *wrapped, wrap(o), wrap(lse), causal=True,
                                   backend="cpu")
    for g2, g in zip(grads2, grads):
        assert type(g2) is np.ndarray
        np.testing.assert_array_equal(g2, g)


@pytest.mark.parametrize("wrap", WRAPPERS)
def test_other_arrays_are_viewed_not_copied(wrap):
    q = _qkv()[0]
    x = wrap(q)
    a = host_array("attention", "q", x)
    # The framework may own a copy it made when wrapping; the view must be of
    # the wrapped object's memory, wherever that is.
    inner = host_array("attention", "q", x)
    # Both views alive: two copies would sit at two addresses.
    assert a.ctypes.data == inner.ctypes.data
    if hasattr(x, "unsafe_buffer_pointer"):  # jax
        assert a.ctypes.data == x.unsafe_buffer_pointer()
    if hasattr(x, "data_ptr"):  # torch
        assert a.ctypes.data == x.data_ptr()
    if wrap in (memoryview, _InterfaceOnly) or getattr(wrap, "__name__", "") == "from_numpy":
        assert np.shares_memory(a, q)


def test_a_strided_torch_view_is_read_in_place(monkeypatch):
    torch = pytest.importorskip("torch", reason="needs torch")
    import flashattn._api as api

    monkeypatch.setattr(api, "_contiguous_copy", lambda x: pytest.fail("copied"))
    qkv = torch.randn(2, 19, 3, 4, 8)  # packed: q, k, v are strided views
    q, k, v = qkv.unbind(2)
    o = fa.attention(q, k, v, backend="cpu")
    want = fa.attention(*(np.ascontiguousarray(x.numpy()) for x in (q, k, v)), backend="cpu")
    np.testing.assert_array_equal(o, want)


def test_a_torch_tensor_that_requires_grad_points_to_flashattn_torch():
    torch = pytest.importorskip("torch", reason="needs torch")
    q, k, v = (torch.from_numpy(x) for x in _qkv())
    with pytest.raises(TypeError, match=r"^attention: k is a torch tensor that requires grad.*"
                                        r"flashattn\.torch\.attention"):
        fa.attention(q, k.requires_grad_(), v)


def test_a_non_float32_tensor_says_float32():
    torch = pytest.importorskip("torch", reason="needs torch")
    q, k, v = (torch.from_numpy(x) for x in _qkv())
    with pytest.raises(TypeError, match=r"^attention: v .*float32"):
        fa.attention(q, k, v.to(torch.float64))
    # float16 and bfloat16 tensors are read in place (dtypes of the contract;
    # bfloat16 as its int16 bits, which DLPack carries): among float32 ones,
    # each is a mixing error naming each dtype.
    for half, name in ((torch.float16, "float16"), (torch.bfloat16, "bfloat16")):
        with pytest.raises(TypeError, match=rf"^attention: q, k and v must share one dtype.*v is "
                                            rf"{name}"):
            fa.attention(q, k, v.to(half))
        o = fa.attention(q.to(half), k.to(half), v.to(half))
        assert o.dtype.name == name


def test_an_array_on_a_device_the_cpu_cannot_read_is_a_type_error():
    class OnCuda:
        def __dlpack__(self, **kwargs):
            raise AssertionError("must not be exported")

        def __dlpack_device__(self):
            return (2, 0)  # kDLCUDA

    q, k, v = _qkv()
    with pytest.raises(TypeError, match=r"^attention: q lives on a device .*type 2"):
        fa.attention(OnCuda(), k, v)


def test_import_flashattn_imports_no_framework():
    code = (
        "import sys, numpy as np, flashattn as fa\n"
        "x = np.ones((1, 4, 2, 8), np.float32)\n"
        "fa.attention(x, x, x)\n"
        "print(sorted(m for m in ('torch', 'jax', 'jaxlib', 'mlx') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
