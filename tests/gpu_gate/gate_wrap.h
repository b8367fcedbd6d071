// One __global__ wrapper per kernel instantiation, so the GPU back end emits
// and allocates it: FA_GATE_KERNEL(symbol, threads, function) defines
// `symbol` as a kernel with a launch bound of `threads` that calls
// `function` (a .metal kernel, compiled as a device function) with real
// thread and group ids, its body inlined.
//
// The kernel's parameters are bound as cpp/sim/bind.h binds them: first the
// buffers (pointers, or `constant T&` bound by value), then a prefix of the
// position builtins [[threadgroup_position_in_grid]] (uint3),
// [[thread_index_in_threadgroup]], [[thread_index_in_simdgroup]],
// [[simdgroup_index_in_threadgroup]] (uint each). The buffers arrive as one
// by-value struct of kernel arguments (uniform, like Metal's bound buffers);
// a `constant T&` parameter's T is in it by value, as setBytes puts it.
#pragma once

namespace fa_gate {

template <unsigned long... I>
struct Indices {};
template <unsigned long N, unsigned long... I>
struct MakeIndices : MakeIndices<N - 1, N - 1, I...> {};
template <unsigned long... I>
struct MakeIndices<0, I...> {
    using type = Indices<I...>;
};

// What a kernel parameter of type A is: a buffer (pointer or constant
// reference), stored in the argument struct as `stored`, or a builtin.
template <class A>
struct Param {
    static constexpr bool is_buffer = false;
    struct stored {};
};
template <class T>
struct Param<T*> {
    static constexpr bool is_buffer = true;
    using stored = T*;
};
template <class T>
struct Param<const T&> {
    static constexpr bool is_buffer = true;
    using stored = T;
};

// The arguments, one member per parameter (empty for builtins).
template <class... A>
struct Args;
template <>
struct Args<> {};
template <class A, class... Rest>
struct Args<A, Rest...> {
    typename Param<A>::stored head;
    Args<Rest...> tail;
};
template <unsigned long I>
struct Get {
    template <class A, class... Rest>
    FA_GATE_DEVICE static const auto& from(const Args<A, Rest...>& a) {
        return Get<I - 1>::from(a.tail);
    }
};
template <>
struct Get<0> {
    template <class A, class... Rest>
    FA_GATE_DEVICE static const auto& from(const Args<A, Rest...>& a) {
        return a.head;
    }
};

// The position builtins, read from the target's id registers.
struct Builtins {
    metal::uint3 group;
    uint thread_index, lane, simdgroup;  // not "thread": an MSL word
};
FA_GATE_DEVICE Builtins builtins() {
    Builtins b;
#ifdef __AMDGPU__
    b.group = metal::uint3(__builtin_amdgcn_workgroup_id_x(), __builtin_amdgcn_workgroup_id_y(),
                           __builtin_amdgcn_workgroup_id_z());
    b.thread_index = __builtin_amdgcn_workitem_id_x();
#else
    b.group = metal::uint3(__nvvm_read_ptx_sreg_ctaid_x(), __nvvm_read_ptx_sreg_ctaid_y(),
                           __nvvm_read_ptx_sreg_ctaid_z());
    b.thread_index = __nvvm_read_ptx_sreg_tid_x();
#endif
    b.lane = b.thread_index % kSimdWidth;
    b.simdgroup = b.thread_index / kSimdWidth;
    return b;
}

template <auto F>
struct Invoke;

template <class... A, void (*F)(A...)>
struct Invoke<F> {
    using Arguments = Args<A...>;
    static constexpr unsigned long buffers = (0ul + ... + (Param<A>::is_buffer ? 1ul : 0ul));

    template <class P, unsigned long I>
    FA_GATE_DEVICE static P bind(const Arguments& a, const Builtins& b) {
        if constexpr (Param<P>::is_buffer) {
            static_assert(I < buffers, "a buffer parameter after a position builtin");
            return Get<I>::from(a);
        } else {
            constexpr unsigned long k = I - buffers;
            if constexpr (k == 0) {
                static_assert(sizeof(P) == sizeof(metal::uint3), "parameter after the buffers is not uint3 [[threadgroup_position_in_grid]]");
                return b.group;
            } else {
                static_assert(k <= 3 && sizeof(P) == sizeof(uint), "more position builtins than the gate knows");
                return k == 1 ? b.thread_index : k == 2 ? b.lane : b.simdgroup;
            }
        }
    }

    template <unsigned long... I>
    FA_GATE_DEVICE static void call(const Arguments& a, Indices<I...>) {
        const Builtins b = builtins();
        [[clang::always_inline]] F(bind<A, I>(a, b)...);
    }

    FA_GATE_DEVICE static void run(const Arguments& a) { call(a, typename MakeIndices<sizeof...(A)>::type{}); }
};

}  // namespace fa_gate

#ifdef __AMDGPU__
// The launch bound, and Apple's register file: at most 128 32-bit registers
// per thread. Told so, the compiler schedules for it (an unbounded gfx1100
// has 256 and spends them on loads issued early); what still does not fit
// is spilled, and the gate rejects the scratch.
#define FA_GATE_BOUNDS(threads) \
    __attribute__((amdgpu_flat_work_group_size(threads, threads), amdgpu_num_vgpr(128)))
#else
#define FA_GATE_BOUNDS(threads) __attribute__((__launch_bounds__(threads)))
#endif

#define FA_GATE_KERNEL(symbol, threads, ...)                                                       \
    extern "C" __global__ FA_GATE_BOUNDS(threads) void symbol(                                     \
        ::fa_gate::Invoke<&__VA_ARGS__>::Arguments args) {                                         \
        ::fa_gate::Invoke<&__VA_ARGS__>::run(args);                                                \
    }
