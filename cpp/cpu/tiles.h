// Tile-level bookkeeping shared by the forward and backward passes: block
// sizes, the band of keys a block of queries sees (and the reverse), and
// aligned scratch memory.
#pragma once
#ifndef FLASHATTN_CPU_ISA
#error "include cpu/isa_begin.h first"
#endif

namespace flashattn::cpu::FLASHATTN_CPU_ISA {

// Keys per tile; query rows per tile is at most kBlockQ (fewer for short Tq)
// and a multiple of the vector width, as queries run along vector lanes.
constexpr int kBlockK = 64;
constexpr int kBlockQ = 64;
constexpr int kMaxD = 256;  // head sizes are 1..kMaxD (core/params.h: kMaxHeadDim)

constexpr float kLog2e = 1.4426950408889634f;

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Tile rows may pack the query heads of one kv head's group (GQA) with
// their positions, position-major: row R is position t = R / g of head
// hk * g + R % g. What a row sees depends on t alone, so the rows that see a
// key stay one contiguous range, and one pass over K and V serves the whole
// group. g = 1 is one head's rows, R = t.

// Keys [begin, end) that some row of [i0, i1) sees; rows' bands are monotone
// in i, so the first row bounds the start and the last row the end.
struct Range {
    int64_t begin, end;
};
inline Range keys_of_rows(const FlashParams& p, int64_t i0, int64_t i1, int g = 1) {
    return {fa_key_begin(i0 / g, p.Tq, p.Tk, p.window_left),
            fa_key_end((i1 - 1) / g, p.Tq, p.Tk, p.window_right)};
}
inline Range rows_of_keys(const FlashParams& p, int64_t j0, int64_t j1) {
    return {fa_query_begin(j0, p.Tq, p.Tk, p.window_right),
            fa_query_end(j1 - 1, p.Tq, p.Tk, p.window_left)};
}
// True when every row of [i0, i1) sees every key of [j0, j1): no mask needed.
inline bool block_inside_band(const FlashParams& p, int64_t i0, int64_t i1, int64_t j0,
                              int64_t j1, int g = 1) {
    return j0 >= fa_key_begin((i1 - 1) / g, p.Tq, p.Tk, p.window_left) &&
           j1 <= fa_key_end(i0 / g, p.Tq, p.Tk, p.window_right);
}
// [b, e) clipped to a tile's [0, n), as ints; empty stays empty (lo == hi).
inline void clip_to_tile(int64_t b, int64_t e, int n, int& lo, int& hi) {
    lo = int(std::clamp<int64_t>(b, 0, n));
    hi = std::max(lo, int(std::clamp<int64_t>(e, 0, n)));
}
// The query rows that see key j, as tile columns [lo, hi) of the query tile
// starting at row i0 with nq valid rows.
inline void key_columns(const FlashParams& p, int64_t j, int64_t i0, int nq, int& lo, int& hi,
                        int g = 1) {
    clip_to_tile(fa_query_begin(j, p.Tq, p.Tk, p.window_right) * g - i0,
                 fa_query_end(j, p.Tq, p.Tk, p.window_left) * g - i0, nq, lo, hi);
}
// The keys that query row i sees, as tile rows [lo, hi) of the key block
// starting at key j0 with nk keys.
inline void row_keys(const FlashParams& p, int64_t i, int64_t j0, int nk, int& lo, int& hi,
                     int g = 1) {
    clip_to_tile(fa_key_begin(i / g, p.Tq, p.Tk, p.window_left) - j0,
                 fa_key_end(i / g, p.Tq, p.Tk, p.window_right) - j0, nk, lo, hi);
}
// True when query row i sees at least one key.
inline bool row_sees_keys(const FlashParams& p, int64_t i, int g = 1) {
    return fa_key_begin(i / g, p.Tq, p.Tk, p.window_left) <
           fa_key_end(i / g, p.Tq, p.Tk, p.window_right);
}

// True when the mask tile (rows x cols of it, row stride ld; -inf where the
// mask hides the score) hides at least one entry.
inline bool any_hidden(const float* bias, int rows, int cols, int64_t ld) {
    for (int r = 0; r < rows; ++r)
        for (int c = 0; c < cols; ++c)
            if (bias[r * ld + c] == -std::numeric_limits<float>::infinity()) return true;
    return false;
}

// True when no element of the rows x cols block (row stride ld) is inf or
// NaN: masked tiles then need no care for 0 * inf.
inline bool all_finite(const float* x, int rows, int cols, int64_t ld) {
    uint32_t bad = 0;
    for (int r = 0; r < rows; ++r) {
        const float* row = x + r * ld;
        for (int c = 0; c < cols; ++c) {
            uint32_t bits;
            std::memcpy(&bits, row + c, sizeof bits);
            bad |= uint32_t((bits & 0x7f800000u) == 0x7f800000u);  // exponent all ones
        }
    }
    return bad == 0;
}

// Query rows per tile for `rows` rows (per head, or per packed group):
// kBlockQ, or rows rounded up to the vector width when fewer (a decoding
// step should not pay for 64 rows).
inline int query_block(int64_t rows, int width) {
    return int(std::min<int64_t>(kBlockQ, round_up(rows, width)));
}

// Asks for rows [0, n) of a block (cols elements of T each, row stride ld) to come
// into cache ahead of use: K and V rows sit a head's stride apart, so the
// hardware prefetchers see short streams and a long-T or decoding pass would
// otherwise wait on memory at every block.
template <class T>
inline void prefetch_rows(const T* x, int n, int cols, int64_t ld) {
    constexpr int line = 64 / int(sizeof(T));  // elements per cache line
    for (int r = 0; r < n; ++r)
        for (int c = 0; c < cols; c += line) __builtin_prefetch(x + r * ld + c, 0, 3);
}

// 64-byte aligned float memory, uninitialised (huge pages when large).
class AlignedBuffer {
public:
    AlignedBuffer() = default;
    explicit AlignedBuffer(size_t n_floats) { resize(n_floats); }
    void resize(size_t n_floats) {
        if (n_floats <= size_) return;
        data_.reset(static_cast<float*>(allocate_host(n_floats * sizeof(float))));
        size_ = n_floats;
    }
    float* data() const { return data_.get(); }

private:
    struct Free {
        void operator()(float* p) const { std::free(p); }
    };
    std::unique_ptr<float, Free> data_;
    size_t size_ = 0;
};

// Per-thread scratch, grown on demand and kept for the thread's life so a
// call allocates nothing per tile. Slots are independent buffers.
inline float* scratch(size_t n_floats, int slot) {
    thread_local AlignedBuffer buffers[16];
    buffers[slot].resize(n_floats);
    return buffers[slot].data();
}

}  // namespace flashattn::cpu::FLASHATTN_CPU_ISA
