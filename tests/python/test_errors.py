"""Bad input raises the documented exception, never crashes: TypeError for a
wrong type or dtype (saying how to convert), ValueError for shapes, window,
scale and backend, each message starting with the function's name and naming
the argument and what was seen; and the empty shapes (B, Tq or Tk = 0)."""

from __future__ import annotations

import re

import numpy as np
import pytest

import flashattn as fa


def _arrays(B=2, Tq=5, Tk=7, H=4, Hkv=2, D=8, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, Tq, H, D), dtype=np.float32)
    k = rng.standard_normal((B, Tk, Hkv, D), dtype=np.float32)
    v = rng.standard_normal((B, Tk, Hkv, D), dtype=np.float32)
    return q, k, v


def _backward_args(**kw):
    q, k, v = _arrays(**kw)
    o, lse = fa.attention(q, k, v, return_lse=True)
    return dict(do=np.ones_like(q), q=q, k=k, v=v, o=o, lse=lse)


def call(fn_name, args, **opts):
    """Calls attention (q, k, v) or attention_backward (do, q, k, v, o, lse)."""
    if fn_name == "attention":
        return fa.attention(args["q"], args["k"], args["v"], **opts)
    return fa.attention_backward(args["do"], args["q"], args["k"], args["v"], args["o"],
                                 args["lse"], **opts)


def args_for(fn_name):
    if fn_name == "attention":
        q, k, v = _arrays()
        return dict(q=q, k=k, v=v)
    return _backward_args()


FUNCTIONS = ["attention", "attention_backward"]



# ------------------------------------------------------------------ types

@pytest.mark.parametrize("fn", FUNCTIONS)
@pytest.mark.parametrize("name", ["q", "k", "v"])
# (float16 and bfloat16 are dtypes of the contract; one of them among float32
# arrays is a mixing error: test_dtypes.py.)
@pytest.mark.parametrize("bad", ["list", "float64", "uint16", "int32", "bool", "complex64",
                                 "object"])
def test_wrong_type_or_dtype_is_a_type_error(fn, name, bad):
    args = args_for(fn)
    x = args[name]
    args[name] = x.tolist() if bad == "list" else x.astype(bad)
    with pytest.raises(TypeError) as err:
        call(fn, args)
    msg = str(err.value)
    assert msg.startswith(f"{fn}: {name} "), msg
    assert "float32" in msg
    how = "np.asarray" if bad == "list" else ".astype(np.float32)"
    assert how in msg, msg


@pytest.mark.parametrize("name", ["do", "o", "lse"])
def test_backward_extra_arrays_dtype_is_a_type_error(name):
    args = _backward_args()
    args[name] = args[name].astype(np.float64)
    with pytest.raises(TypeError, match=rf"^attention_backward: {name} .*astype\(np.float32\)"):
        call("attention_backward", args)


@pytest.mark.parametrize("fn", FUNCTIONS)
def test_non_native_byte_order_is_a_type_error(fn):
    args = args_for(fn)
    args["k"] = args["k"].astype(args["k"].dtype.newbyteorder())
    assert args["k"].dtype == np.float32 or args["k"].dtype.byteorder != "="
    with pytest.raises(TypeError, match=rf"^{fn}: k .*byte order.*astype\(np.float32\)"):
        call(fn, args)


def test_non_array_objects_are_type_errors():
    q, k, v = _arrays()
    for bad in (None, 3.0, "q", object()):
        with pytest.raises(TypeError, match=r"^attention: q "):
            fa.attention(bad, k, v)


# ------------------------------------------------------------------ shapes

SHAPE_ERRORS = [
    # (what, q shape, k shape, v shape, pattern naming the argument and shapes)
    ("q 3-d", (5, 4, 8), (2, 7, 2, 8), (2, 7, 2, 8), r"q must have 4 dimensions .*\(5, 4, 8\)"),
    ("k 5-d", (2, 5, 4, 8), (1, 2, 7, 2, 8), (2, 7, 2, 8), r"k must have 4 dimensions .*\(1, 2, 7, 2, 8\)"),
    ("v 2-d", (2, 5, 4, 8), (2, 7, 2, 8), (7, 8), r"v must have 4 dimensions .*\(7, 8\)"),
    ("batch", (2, 5, 4, 8), (3, 7, 2, 8), (3, 7, 2, 8), r"batch .*\(2, 5, 4, 8\).*\(3, 7, 2, 8\)"),
    ("head size", (2, 5, 4, 8), (2, 7, 2, 16), (2, 7, 2, 16), r"head size D.*\(2, 5, 4, 8\).*\(2, 7, 2, 16\)"),
    ("k vs v Hkv", (2, 5, 4, 8), (2, 7, 2, 8), (2, 7, 4, 8), r"k and v .*\(2, 7, 2, 8\).*\(2, 7, 4, 8\)"),
    ("k vs v Tk", (2, 5, 4, 8), (2, 7, 2, 8), (2, 6, 2, 8), r"k and v .*\(2, 7, 2, 8\).*\(2, 6, 2, 8\)"),
    ("k vs v D", (2, 5, 4, 8), (2, 7, 2, 8), (2, 7, 2, 9), r"k and v .*\(2, 7, 2, 9\)"),
    ("H % Hkv", (2, 5, 4, 8), (2, 7, 3, 8), (2, 7, 3, 8), r"H=4 .*multiple.*Hkv=3"),
    ("D = 0", (2, 5, 4, 0), (2, 7, 2, 0), (2, 7, 2, 0), r"head size D must be in 1\.\.256, got 0"),
    ("D = 257", (1, 2, 1, 257), (1, 2, 1, 257), (1, 2, 1, 257), r"head size D must be in 1\.\.256, got 257"),
    ("H = 0", (2, 5, 0, 8), (2, 7, 2, 8), (2, 7, 2, 8), r"heads"),
]


@pytest.mark.parametrize("fn", FUNCTIONS)
@pytest.mark.parametrize("what,qs,ks,vs,pattern", [
    pytest.param(*e, id=e[0]) for e in SHAPE_ERRORS])
def test_inconsistent_shapes_are_value_errors(fn, what, qs, ks, vs, pattern):
    q, k, v = (np.zeros(s, np.float32) for s in (qs, ks, vs))
    args = dict(q=q, k=k, v=v)
    if fn == "attention_backward":
        args.update(do=np.zeros_like(q), o=np.zeros_like(q),
                    lse=np.zeros((qs[0], qs[2], qs[1]) if len(qs) == 4 else (1, 1, 1), np.float32))
    with pytest.raises(ValueError, match=rf"^{fn}: .*{pattern}"):
        call(fn, args)


@pytest.mark.parametrize("D", [1, 256])
def test_head_size_limits_are_accepted(D):
    q, k, v = _arrays(B=1, Tq=3, Tk=4, H=1, Hkv=1, D=D)
    o = fa.attention(q, k, v)
    assert o.shape == q.shape and np.isfinite(o).all()


@pytest.mark.parametrize("name,shape,pattern", [
    ("do", (2, 5, 4, 7), r"do must have the shape of q \(2, 5, 4, 8\), got \(2, 5, 4, 7\)"),
    ("o", (2, 6, 4, 8), r"o must have the shape of q \(2, 5, 4, 8\), got \(2, 6, 4, 8\)"),
    ("o", (2, 5, 4), r"o must have 4 dimensions"),
    ("lse", (2, 5, 4), r"lse must have shape \(B, H, Tq\) = \(2, 4, 5\), got \(2, 5, 4\)"),
    ("lse", (2, 4, 5, 1), r"lse must have shape \(B, H, Tq\) = \(2, 4, 5\), got \(2, 4, 5, 1\)"),
    ("lse", (8, 5), r"lse must have shape \(B, H, Tq\)"),
])
def test_backward_extra_arrays_shape_is_a_value_error(name, shape, pattern):
    args = _backward_args(B=2, Tq=5, Tk=7, H=4, Hkv=2, D=8)
    args[name] = np.zeros(shape, np.float32)
    with pytest.raises(ValueError, match=rf"^attention_backward: {pattern}"):
        call("attention_backward", args)


# ------------------------------------------------------------ options

@pytest.mark.parametrize("fn", FUNCTIONS)
@pytest.mark.parametrize("window", [(-2, 0), (0, -5), (1,), (1, 2, 3), (1.5, 0), (0, 2.0),
                                    ("a", "b"), None, 3, (True, 0), "ab",
                                    (-2**63 - 1, 0), (0, -2**100), {1, 2}, {0: 1, 1: 2},
                                    np.array([1, 2]), (np.bool_(True), 0)],
                         ids=repr)
def test_bad_window_is_a_value_error(fn, window):
    with pytest.raises(ValueError, match=rf"^{fn}: window "):
        call(fn, args_for(fn), window=window)


@pytest.mark.parametrize("window", [(np.int64(3), np.int32(0)), [2, 1], (0, 0), (-1, -1)], ids=repr)
def test_window_accepts_any_pair_of_integers(window):
    q, k, v = _arrays()
    o = fa.attention(q, k, v, window=window)
    np.testing.assert_array_equal(o, fa.attention(q, k, v, window=tuple(int(w) for w in window)))


@pytest.mark.parametrize("fn", FUNCTIONS)
@pytest.mark.parametrize("scale", [float("nan"), float("inf"), -float("inf"), np.float32("nan")],
                         ids=repr)
def test_non_finite_scale_is_a_value_error(fn, scale):
    with pytest.raises(ValueError, match=rf"^{fn}: scale .*finite"):
        call(fn, args_for(fn), scale=scale)


@pytest.mark.parametrize("fn", FUNCTIONS)
@pytest.mark.parametrize("scale", [1e39, -1e39, 10**400, -10**400, 2**128], ids=repr)
def test_scale_beyond_float32_range_is_a_value_error(fn, scale):
    with pytest.raises(ValueError, match=rf"^{fn}: scale must be finite in float32"):
        call(fn, args_for(fn), scale=scale)


@pytest.mark.parametrize("fn", FUNCTIONS)
@pytest.mark.parametrize("scale", ["0.5", [1.0], 1j])
def test_non_number_scale_is_a_type_error(fn, scale):
    with pytest.raises(TypeError, match=rf"^{fn}: scale "):
        call(fn, args_for(fn), scale=scale)


@pytest.mark.parametrize("fn", FUNCTIONS)
def test_unknown_backend_is_a_value_error_listing_the_available_ones(fn):
    with pytest.raises(ValueError) as err:
        call(fn, args_for(fn), backend="cuda")
    msg = str(err.value)
    assert "'cuda'" in msg
    for name in fa.backends():
        assert f"'{name}'" in msg, msg


@pytest.mark.parametrize("fn", FUNCTIONS)
def test_unknown_backend_message_starts_with_the_function(fn):
    with pytest.raises(ValueError, match=rf"^{fn}: "):
        call(fn, args_for(fn), backend="cuda")


@pytest.mark.parametrize("fn", FUNCTIONS)
def test_a_known_engine_missing_here_says_why(fn):
    from flashattn._engines import missing

    absent = {name: why for name, (why, _) in missing().items() if name not in fa.backends()}
    if not absent:
        pytest.skip("every engine this build knows is available here")
    name, why = next(iter(absent.items()))
    with pytest.raises(ValueError, match=rf"^{fn}: backend '{name}' is not available here") as err:
        call(fn, args_for(fn), backend=name)
    assert why in str(err.value)


@pytest.mark.parametrize("fn", FUNCTIONS)
def test_non_string_backend_is_a_type_error(fn):
    with pytest.raises(TypeError, match=rf"^{fn}: backend "):
        call(fn, args_for(fn), backend=1)


def test_set_num_threads_rejects_bad_values(restore_threads):
    for bad in (0, -3, 1025, 2**31, 2**64):
        with pytest.raises(ValueError, match=rf"^set_num_threads: n must be in 1\.\.1024, got {bad}$"):
            fa.set_num_threads(bad)
    for bad in (2.0, "2", None, True):
        with pytest.raises(TypeError):
            fa.set_num_threads(bad)
    assert fa.get_num_threads() == restore_threads
    fa.set_num_threads(3)
    assert fa.get_num_threads() == 3


def test_version_and_backends():
    assert re.fullmatch(r"\d+\.\d+\.\d+.*", fa.__version__)
    names = fa.backends()
    assert isinstance(names, list) and all(isinstance(n, str) for n in names)
    assert "cpu" in names and "metal-sim" in names
    assert len(set(names)) == len(names)
    import platform
    import sys
    if sys.platform == "darwin" and platform.machine() == "arm64":
        assert names[0] == "metal"  # the default on Apple silicon
    else:
        assert names[0] == "cpu"


# ------------------------------------------------------------ empty shapes

@pytest.mark.parametrize("B,Tq,Tk", [(0, 5, 7), (2, 0, 7), (2, 5, 0), (0, 0, 0), (2, 0, 0)])
@pytest.mark.parametrize("causal", [False, True])
def test_empty_shapes(backend, B, Tq, Tk, causal):
    H, Hkv, D = 4, 2, 8
    q, k, v = _arrays(B=B, Tq=Tq, Tk=Tk, H=H, Hkv=Hkv, D=D)
    o, lse = fa.attention(q, k, v, causal=causal, return_lse=True, backend=backend)
    assert o.shape == (B, Tq, H, D) and o.dtype == np.float32
    assert lse.shape == (B, H, Tq) and lse.dtype == np.float32
    # Tk = 0: every row sees no key -> o = 0, lse = -inf.
    assert np.all(o == 0)
    assert np.all(np.isneginf(lse))
    do = np.ones_like(q)
    dq, dk, dv = fa.attention_backward(do, q, k, v, o, lse, causal=causal, backend=backend)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    assert all(g.dtype == np.float32 and np.all(g == 0) for g in (dq, dk, dv))


@pytest.mark.parametrize("fn", FUNCTIONS)
def test_window_beyond_int64_is_unbounded(fn):
    """Any int >= -1 is a valid window side; one past every key is unbounded."""
    args = args_for(fn)
    got, want = call(fn, args, window=(2**70, 0)), call(fn, args, window=(-1, 0))
    if fn == "attention":
        got, want = [got], [want]
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


# ------------------------------------------------ options taken as they are

@pytest.mark.parametrize("fn", FUNCTIONS)
@pytest.mark.parametrize("value", ["False", "no", 0, 1, None, 1.0, np.int64(0)], ids=repr)
def test_causal_must_be_a_bool(fn, value):
    """bool("False") is True: a string must not switch the mask on."""
    with pytest.raises(TypeError, match=rf"^{fn}: causal must be a bool, got "):
        call(fn, args_for(fn), causal=value)


@pytest.mark.parametrize("value", ["no", 0, None], ids=repr)
def test_return_lse_must_be_a_bool(value):
    q, k, v = _arrays()
    with pytest.raises(TypeError, match=r"^attention: return_lse must be a bool, got "):
        fa.attention(q, k, v, return_lse=value)


def test_numpy_bools_are_bools():
    q, k, v = _arrays()
    o, lse = fa.attention(q, k, v, causal=np.bool_(True), return_lse=np.bool_(True))
    np.testing.assert_array_equal(o, fa.attention(q, k, v, causal=True))


@pytest.mark.parametrize("fn", FUNCTIONS)
def test_masked_array_is_a_type_error(fn):
    """Its mask would be ignored: the engines see only the data."""
    args = args_for(fn)
    args["k"] = np.ma.masked_array(args["k"], mask=args["k"] > 1)
    with pytest.raises(TypeError, match=rf"^{fn}: k is a masked array; its mask would be ignored"):
        call(fn, args)


def test_numpy_scalar_as_q_is_a_type_error_that_says_so():
    _, k, v = _arrays()
    with pytest.raises(TypeError, match=r"^attention: q must be a 4-d numpy.ndarray of float32, "
                                        r"got a NumPy scalar \(float32\)"):
        fa.attention(np.float32(1.0), k, v)


def test_empty_lse_with_any_strides_is_accepted(backend):
    """Tq = 0: lse (B, H, 0) holds nothing, so its strides cannot matter."""
    q, k, v = _arrays(Tq=0)
    o, lse = fa.attention(q, k, v, return_lse=True, backend=backend)
    # Sliced from a non-empty array, an empty one keeps that array's strides.
    odd = np.empty((4, 4, 3), np.float32)[::2, :, :0]
    assert odd.shape == lse.shape and odd.strides == (96, 12, 4)
    dq, dk, dv = fa.attention_backward(np.ones_like(q), q, k, v, o, odd, backend=backend)
    assert dq.shape == q.shape and np.all(dk == 0) and np.all(dv == 0)


def test_output_allocation_failure_says_what_and_how_large():
    """o of (2**20, 2**30 - 1, 1024, 1) float32 is about 2**62 bytes: no system has
    that. The inputs broadcast one element, so they cost nothing."""
    q = np.broadcast_to(np.float32(0), (2**20, 2**30 - 1, 1024, 1))
    k = np.zeros((2**20, 1, 1, 1), np.float32)
    nbytes = 4 * 2**20 * (2**30 - 1) * 1024
    want = (f"attention: cannot allocate the output o of shape (1048576, 1073741823, 1024, 1) "
            f"float32 ({nbytes} bytes) for the cpu engine")
    with pytest.raises(MemoryError, match=f"^{re.escape(want)}$"):
        fa.attention(q, k, k, backend="cpu")


# --------------------------------------- the reference takes arguments alike

def _error_of(f):
    try:
        f()
    except Exception as e:  # noqa: BLE001 -- the exception itself is compared
        return type(e), str(e)
    return None


@pytest.mark.parametrize("opts", [
    dict(window=(-5, -5)), dict(window=(0, -2)), dict(window={1, 2}), dict(causal="yes"),
    dict(scale=float("nan")), dict(scale=10**400), dict(scale="1"),
], ids=repr)
def test_reference_rejects_options_as_the_engines_do(opts):
    q, k, v = _arrays()
    want = _error_of(lambda: fa.attention(q, k, v, **opts))
    assert want is not None
    assert _error_of(lambda: fa.reference.attention(q, k, v, **opts)) == want
    back = _error_of(lambda: fa.attention_backward(q, q, k, v, q, np.zeros((2, 4, 5), np.float32),
                                                   **opts))
    assert _error_of(lambda: fa.reference.attention_backward(q, q, k, v, **opts)) == back


@pytest.mark.parametrize("what,qs,ks,vs,pattern", [
    pytest.param(*e, id=e[0]) for e in SHAPE_ERRORS])
def test_reference_rejects_shapes_as_the_engines_do(what, qs, ks, vs, pattern):
    q, k, v = (np.zeros(s, np.float32) for s in (qs, ks, vs))
    want = _error_of(lambda: fa.attention(q, k, v))
    assert want is not None and want[0] is ValueError
    assert _error_of(lambda: fa.reference.attention(q, k, v)) == want


def test_reference_treats_huge_windows_as_unbounded():
    q, k, v = _arrays()
    for window in [(2**70, 0), (0, 2**70), (10**30, 10**30)]:
        bounded = tuple(-1 if side > 2**62 else side for side in window)
        np.testing.assert_array_equal(fa.reference.attention(q, k, v, window=window),
                                      fa.reference.attention(q, k, v, window=bounded))
        np.testing.assert_array_equal(
            fa.reference.visible_keys(5, 7, window=window),
            fa.reference.visible_keys(5, 7, window=bounded))
