// The gate proxy's barriers and SIMD-group functions (part of its
// <metal_stdlib>): each a target shuffle or vote across a SIMD group of 32
// lanes (a warp on nvptx, a wave32 on gfx1100), so values exchanged between
// lanes cost what a GPU's registers and crossbar cost.
#pragma once

namespace fa_gate {

constexpr unsigned kSimdWidth = 32;

FA_GATE_DEVICE unsigned lane_id() {
#ifdef __AMDGPU__
    return __builtin_amdgcn_mbcnt_lo(~0u, 0u);
#else
    return __nvvm_read_ptx_sreg_laneid();
#endif
}

// Value of `bits` in lane `src` (src < 32).
FA_GATE_DEVICE unsigned shuffle_word(unsigned bits, unsigned src) {
#ifdef __AMDGPU__
    return unsigned(__builtin_amdgcn_ds_bpermute(int(src * 4u), int(bits)));
#else
    return unsigned(__nvvm_shfl_sync_idx_i32(0xffffffffu, int(bits), int(src), 31));
#endif
}

// Any trivially copyable value, moved as 32-bit words.
template <class T>
FA_GATE_DEVICE T shuffle(T x, unsigned src) {
    constexpr int words = (sizeof(T) + 3) / 4;
    unsigned w[words] = {};
    __builtin_memcpy(w, &x, sizeof(T));
    for (int i = 0; i < words; ++i) w[i] = shuffle_word(w[i], src);
    __builtin_memcpy(&x, w, sizeof(T));
    return x;
}

}  // namespace fa_gate

namespace metal {

FA_GATE_DEVICE void threadgroup_barrier(mem_flags) {
#ifdef __AMDGPU__
    __builtin_amdgcn_fence(__ATOMIC_RELEASE, "workgroup");
    __builtin_amdgcn_s_barrier();
    __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "workgroup");
#else
    __nvvm_bar_sync(0);  // __syncthreads()
#endif
}

FA_GATE_DEVICE void simdgroup_barrier(mem_flags) {
#ifdef __AMDGPU__
    __builtin_amdgcn_wave_barrier();
#else
    __nvvm_bar_warp_sync(0xffffffffu);
#endif
}

template <class T>
FA_GATE_DEVICE T simd_shuffle(T x, ushort lane) {
    return ::fa_gate::shuffle(x, unsigned(lane) % ::fa_gate::kSimdWidth);
}
template <class T>
FA_GATE_DEVICE T simd_broadcast(T x, ushort lane) {
    return simd_shuffle(x, lane);
}
template <class T>
FA_GATE_DEVICE T simd_shuffle_xor(T x, ushort mask) {
    return ::fa_gate::shuffle(x, (::fa_gate::lane_id() ^ mask) % ::fa_gate::kSimdWidth);
}
// Lanes with no source lane keep their own value, as MSL specifies.
template <class T>
FA_GATE_DEVICE T simd_shuffle_down(T x, ushort delta) {
    const unsigned me = ::fa_gate::lane_id(), src = me + delta;
    const T y = ::fa_gate::shuffle(x, src % ::fa_gate::kSimdWidth);
    return src < ::fa_gate::kSimdWidth ? y : x;
}
template <class T>
FA_GATE_DEVICE T simd_shuffle_up(T x, ushort delta) {
    const unsigned me = ::fa_gate::lane_id();
    const T y = ::fa_gate::shuffle(x, (me - delta) % ::fa_gate::kSimdWidth);
    return me >= delta ? y : x;
}

// Reductions: a butterfly of five shuffles, every lane gets the result.
template <class T>
FA_GATE_DEVICE T simd_sum(T x) {
    for (ushort m = 16; m > 0; m >>= 1) x = x + simd_shuffle_xor(x, m);
    return x;
}
template <class T>
FA_GATE_DEVICE T simd_max(T x) {
    for (ushort m = 16; m > 0; m >>= 1) x = max(x, simd_shuffle_xor(x, m));
    return x;
}
template <class T>
FA_GATE_DEVICE T simd_min(T x) {
    for (ushort m = 16; m > 0; m >>= 1) x = min(x, simd_shuffle_xor(x, m));
    return x;
}

FA_GATE_DEVICE bool simd_any(bool c) {
#ifdef __AMDGPU__
    return __builtin_amdgcn_ballot_w32(c) != 0u;
#else
    return __nvvm_vote_any_sync(0xffffffffu, c);
#endif
}
FA_GATE_DEVICE bool simd_all(bool c) {
#ifdef __AMDGPU__
    return __builtin_amdgcn_ballot_w32(!c) == 0u;
#else
    return __nvvm_vote_all_sync(0xffffffffu, c);
#endif
}

}  // namespace metal
