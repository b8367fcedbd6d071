// Tests of the boundary: make_forward_params / make_backward_params messages
// and normalisation (window and causal rules, strides, scale), and the masking
// helpers of shaders/flash_params.h against a brute-force visibility rule.
#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <vector>

#include "check.h"
#include "core/params.h"
#include "flash_params.h"

using flashattn::AttentionOptions;
using flashattn::TensorView;
using flashattn::make_backward_params;
using flashattn::make_forward_params;

namespace {

std::vector<int64_t> contiguous(const std::vector<int64_t>& shape) {
    std::vector<int64_t> s(shape.size(), 1);
    for (int a = int(shape.size()) - 2; a >= 0; --a) s[a] = s[a + 1] * shape[a + 1];
    return s;
}

TensorView view(std::vector<int64_t> shape) {
    TensorView t;
    t.strides = contiguous(shape);
    t.shape = std::move(shape);
    return t;
}

TensorView view(std::vector<int64_t> shape, std::vector<int64_t> strides) {
    TensorView t;
    t.shape = std::move(shape);
    t.strides = std::move(strides);
    return t;
}

AttentionOptions opts(bool causal, int64_t left, int64_t right) {
    AttentionOptions o;
    o.causal = causal;
    o.window_left = left;
    o.window_right = right;
    return o;
}

// The contract in plain words: query i sits at key position p = i + Tk - Tq,
// sees key j when p - left <= j <= p + right (-1: that side unbounded) and,
// when causal, j <= p.
bool visible(int64_t i, int64_t j, int64_t Tq, int64_t Tk, bool causal, int64_t left,
             int64_t right) {
    const int64_t p = i + Tk - Tq;
    if (j < 0 || j >= Tk) return false;
    if (left >= 0 && j < p - left) return false;
    if (right >= 0 && j > p + right) return false;
    if (causal && j > p) return false;
    return true;
}

void test_messages() {
    const AttentionOptions none;
    const TensorView q = view({2, 5, 4, 8}), k = view({2, 7, 2, 8}), v = view({2, 7, 2, 8});

    // Wrong number of dimensions: names the argument, its axes and the shape seen.
    CHECK_THROWS(std::invalid_argument, "attention: q must have 4 dimensions (B, Tq, H, D), got shape (5, 4, 8)",
                 make_forward_params(view({5, 4, 8}), k, v, none));
    CHECK_THROWS(std::invalid_argument, "attention: k must have 4 dimensions (B, Tk, Hkv, D), got shape (1, 2, 7, 2, 8)",
                 make_forward_params(q, view({1, 2, 7, 2, 8}), v, none));
    CHECK_THROWS(std::invalid_argument, "attention: v must have 4 dimensions",
                 make_forward_params(q, k, view({7, 2, 8}), none));
    CHECK_THROWS(std::invalid_argument, "got shape (8,)",
                 make_forward_params(view({8}), k, v, none));

    // The last axis must be contiguous (the bindings copy anything else first).
    CHECK_THROWS(std::invalid_argument, "attention: q must have a contiguous last axis (stride 1), got stride 2",
                 make_forward_params(view({2, 5, 4, 8}, {640, 64, 16, 2}), k, v, none));
    CHECK_THROWS(std::invalid_argument, "v must have a contiguous last axis",
                 make_forward_params(q, k, view({2, 7, 2, 8}, {112, 16, 8, -1}), none));
    // ...except when it has length 1, where the stride never matters.
    CHECK(make_forward_params(view({2, 5, 4, 1}, {20, 4, 1, 7}), view({2, 7, 2, 1}),
                              view({2, 7, 2, 1}), none).D == 1);

    // Inconsistent shapes name both arrays and their shapes.
    CHECK_THROWS(std::invalid_argument, "attention: k and v must have the same shape, got k (2, 7, 2, 8) and v (2, 6, 2, 8)",
                 make_forward_params(q, k, view({2, 6, 2, 8}), none));
    CHECK_THROWS(std::invalid_argument, "attention: q and k must have the same batch size; got q (2, 5, 4, 8) and k (3, 7, 2, 8)",
                 make_forward_params(q, view({3, 7, 2, 8}), view({3, 7, 2, 8}), none));
    CHECK_THROWS(std::invalid_argument, "attention: q and k must have the same head size D; got q (2, 5, 4, 8) and k (2, 7, 2, 9)",
                 make_forward_params(q, view({2, 7, 2, 9}), view({2, 7, 2, 9}), none));
    CHECK_THROWS(std::invalid_argument, "attention: the number of query heads H=4 must be a multiple of the number of kv heads Hkv=3",
                 make_forward_params(q, view({2, 7, 3, 8}), view({2, 7, 3, 8}), none));
    CHECK_THROWS(std::invalid_argument, "the number of heads must be at least 1",
                 make_forward_params(q, view({2, 7, 0, 8}), view({2, 7, 0, 8}), none));
    CHECK_THROWS(std::invalid_argument, "the number of heads must be at least 1",
                 make_forward_params(view({2, 5, 0, 8}), k, v, none));

    // Head size: 1..256 accepted, 0 and 257 refused with the value seen.
    CHECK_THROWS(std::invalid_argument, "attention: head size D must be in 1..256, got 0",
                 make_forward_params(view({1, 2, 1, 0}), view({1, 2, 1, 0}), view({1, 2, 1, 0}), none));
    CHECK_THROWS(std::invalid_argument, "head size D must be in 1..256, got 257 (q shape (1, 2, 1, 257))",
                 make_forward_params(view({1, 2, 1, 257}), view({1, 2, 1, 257}), view({1, 2, 1, 257}), none));
    CHECK(make_forward_params(view({1, 2, 1, 256}), view({1, 2, 1, 256}), view({1, 2, 1, 256}), none).D == 256);
    CHECK(make_forward_params(view({1, 2, 1, 1}), view({1, 2, 1, 1}), view({1, 2, 1, 1}), none).D == 1);

    // Window and scale.
    CHECK_THROWS(std::invalid_argument, "attention: window must be a pair of ints >= -1 (-1: unbounded), got (-2, 0)",
                 make_forward_params(q, k, v, opts(false, -2, 0)));
    CHECK_THROWS(std::invalid_argument, "got (3, -5)", make_forward_params(q, k, v, opts(true, 3, -5)));
    for (double bad : {std::nan(""), std::numeric_limits<double>::infinity(),
                       -std::numeric_limits<double>::infinity()}) {
        AttentionOptions o;
        o.scale = bad;
        CHECK_THROWS(std::invalid_argument, "attention: scale must be finite", make_forward_params(q, k, v, o));
    }

    // Sizes whose window arithmetic would overflow int32 in the kernels.
    const int64_t huge = int64_t(1) << 31;
    CHECK_THROWS(std::invalid_argument, "attention: B, Tq, Tk and H must each be at most 1073741823",
                 make_forward_params(view({1, huge, 1, 4}, {huge * 4, 4, 4, 1}), view({1, 3, 1, 4}),
                                     view({1, 3, 1, 4}), none));
    // The limit the message states is the limit: 2**30 - 1 passes, 2**30 does not.
    const int64_t limit = (int64_t(1) << 30) - 1;
    CHECK(make_forward_params(view({1, limit, 1, 4}, {0, 0, 0, 1}), view({1, 3, 1, 4}),
                              view({1, 3, 1, 4}), none).Tq == limit);
    CHECK_THROWS(std::invalid_argument, "at most 1073741823",
                 make_forward_params(view({1, limit + 1, 1, 4}, {0, 0, 0, 1}), view({1, 3, 1, 4}),
                                     view({1, 3, 1, 4}), none));
    CHECK_THROWS(std::invalid_argument, "at most 1073741823",
                 make_forward_params(view({1, 3, 1, 4}), view({1, huge, 1, 4}, {0, 0, 0, 1}),
                                     view({1, huge, 1, 4}, {0, 0, 0, 1}), none));

    // Empty calls are valid: B = 0, Tq = 0, Tk = 0.
    CHECK(make_forward_params(view({0, 5, 4, 8}), view({0, 7, 2, 8}), view({0, 7, 2, 8}), none).B == 0);
    CHECK(make_forward_params(view({2, 0, 4, 8}), k, v, none).Tq == 0);
    CHECK(make_forward_params(q, view({2, 0, 2, 8}), view({2, 0, 2, 8}), none).Tk == 0);
    // NumPy 2 gives empty arrays all-zero strides: still accepted.
    CHECK(make_forward_params(view({2, 0, 4, 8}, {0, 0, 0, 0}), k, v, none).Tq == 0);
    CHECK(make_forward_params(q, view({2, 0, 2, 8}, {0, 0, 0, 0}), view({2, 0, 2, 8}, {0, 0, 0, 0}),
                              none).Tk == 0);

    // Backward: the same checks under its own name, plus do, o and lse.
    const TensorView lse = view({2, 4, 5});
    CHECK_THROWS(std::invalid_argument, "attention_backward: q must have 4 dimensions",
                 make_backward_params(q, view({5, 4, 8}), k, v, q, lse, none));
    CHECK_THROWS(std::invalid_argument, "attention_backward: head size D must be in 1..256",
                 make_backward_params(view({1, 2, 1, 300}), view({1, 2, 1, 300}), view({1, 2, 1, 300}),
                                      view({1, 2, 1, 300}), view({1, 2, 1, 300}), view({1, 1, 2}), none));
    CHECK_THROWS(std::invalid_argument, "attention_backward: do must have the shape of q (2, 5, 4, 8), got (2, 5, 4, 7)",
                 make_backward_params(view({2, 5, 4, 7}), q, k, v, q, lse, none));
    CHECK_THROWS(std::invalid_argument, "attention_backward: do must have 4 dimensions (B, Tq, H, D), got shape (5, 4, 8)",
                 make_backward_params(view({5, 4, 8}), q, k, v, q, lse, none));
    CHECK_THROWS(std::invalid_argument, "attention_backward: o must have the shape of q (2, 5, 4, 8), got (2, 6, 4, 8)",
                 make_backward_params(q, q, k, v, view({2, 6, 4, 8}), lse, none));
    CHECK_THROWS(std::invalid_argument, "attention_backward: o must have a contiguous last axis",
                 make_backward_params(q, q, k, v, view({2, 5, 4, 8}, {320, 64, 16, 2}), lse, none));
    CHECK_THROWS(std::invalid_argument, "attention_backward: lse must have shape (B, H, Tq) = (2, 4, 5), got (2, 5, 4)",
                 make_backward_params(q, q, k, v, q, view({2, 5, 4}), none));
    CHECK_THROWS(std::invalid_argument, "attention_backward: lse must have shape (B, H, Tq) = (2, 4, 5), got (2, 4, 5, 1)",
                 make_backward_params(q, q, k, v, q, view({2, 4, 5, 1}), none));
    CHECK_THROWS(std::invalid_argument, "attention_backward: lse must be C-contiguous",
                 make_backward_params(q, q, k, v, q, view({2, 4, 5}, {5, 10, 1}), none));
    CHECK_THROWS(std::invalid_argument, "attention_backward: window must be a pair of ints",
                 make_backward_params(q, q, k, v, q, lse, opts(false, 0, -3)));
    // An empty lse (Tq = 0) is never read: any strides.
    CHECK(make_backward_params(view({2, 0, 4, 8}), view({2, 0, 4, 8}), k, v, view({2, 0, 4, 8}),
                               view({2, 4, 0}, {1, 2, 8}), none).Tq == 0);
    // Size-1 axes of lse may carry any stride (NumPy gives them arbitrary ones).
    CHECK(make_backward_params(view({1, 5, 1, 8}), view({1, 5, 1, 8}), view({1, 7, 1, 8}),
                               view({1, 7, 1, 8}), view({1, 5, 1, 8}), view({1, 1, 5}, {99, 77, 1}),
                               none).Tq == 5);
}

void test_normalisation() {
    const TensorView q = view({2, 5, 4, 8}), k = view({2, 7, 2, 8}), v = view({2, 7, 2, 8});

    // Shapes, the group size and the default scale 1/sqrt(D).
    FlashParams p = make_forward_params(q, k, v, AttentionOptions{});
    CHECK(p.B == 2 && p.Tq == 5 && p.Tk == 7 && p.H == 4 && p.Hkv == 2 && p.D == 8);
    CHECK(p.group == 2);
    CHECK(p.scale == float(1.0 / std::sqrt(8.0)));
    // Unbounded sides reach past every key: left = Tk, right = Tq.
    CHECK(p.window_left == 7 && p.window_right == 5);

    // An explicit scale is kept, including 0 and negative values.
    for (double s : {0.0, -0.5, 3.25}) {
        AttentionOptions o;
        o.scale = s;
        CHECK(make_forward_params(q, k, v, o).scale == float(s));
    }

    // Causal caps right at 0 whatever was asked; left stays.
    p = make_forward_params(q, k, v, opts(true, -1, -1));
    CHECK(p.window_left == 7 && p.window_right == 0);
    p = make_forward_params(q, k, v, opts(true, 3, 9));
    CHECK(p.window_left == 3 && p.window_right == 0);
    // The seed's window w is (w - 1, 0) with causal.
    p = make_forward_params(q, k, v, opts(true, 2, 0));
    CHECK(p.window_left == 2 && p.window_right == 0);
    // Bounded sides larger than the sequence are clamped to the unbounded values.
    p = make_forward_params(q, k, v, opts(false, 1000, 1000));
    CHECK(p.window_left == 7 && p.window_right == 5);
    p = make_forward_params(q, k, v, opts(false, 0, 2));
    CHECK(p.window_left == 0 && p.window_right == 2);
    // Window values far beyond int32 do not wrap.
    p = make_forward_params(q, k, v, opts(false, int64_t(1) << 40, int64_t(1) << 40));
    CHECK(p.window_left == 7 && p.window_right == 5);

    // Input strides are carried as given (packed qkv: q = qkv[:, :, 0]);
    // outputs are contiguous.
    const int64_t B = 2, T = 6, H = 4, D = 8;
    const std::vector<int64_t> packed = {T * 3 * H * D, 3 * H * D, D, 1};
    const TensorView pq = view({B, T, H, D}, packed), pk = view({B, T, H, D}, packed);
    p = make_forward_params(pq, pk, pk, AttentionOptions{});
    CHECK(p.q.b == T * 3 * H * D && p.q.t == 3 * H * D && p.q.h == D);
    CHECK(p.k.b == p.q.b && p.k.t == p.q.t && p.k.h == p.q.h);
    CHECK(p.v.b == p.q.b && p.v.t == p.q.t && p.v.h == p.q.h);
    CHECK(p.o.b == T * H * D && p.o.t == H * D && p.o.h == D);
    CHECK(p.dq.b == p.o.b && p.dq.t == p.o.t && p.dq.h == p.o.h);
    CHECK(p.dk.b == T * H * D && p.dk.t == H * D && p.dk.h == D);
    CHECK(p.dv.b == p.dk.b && p.dv.t == p.dk.t && p.dv.h == p.dk.h);
    // Zero strides (a broadcast) and negative strides (a reversed view) pass through.
    p = make_forward_params(view({B, T, H, D}, {0, 0, 0, 1}), view({B, T, 1, D}, {-T * D, D, D, 1}),
                            view({B, T, 1, D}), AttentionOptions{});
    CHECK(p.q.b == 0 && p.q.t == 0 && p.q.h == 0);
    CHECK(p.k.b == -T * D && p.k.t == D);
    CHECK(p.group == H);

    // Backward carries do and o strides as given; dq/dk/dv are contiguous.
    const std::vector<int64_t> tr = {T * H * D, D, T * D, 1};  // (B, H, T, D) memory seen as (B, T, H, D)
    p = make_backward_params(view({B, T, H, D}, tr), view({B, T, H, D}), view({B, T, 2, D}),
                             view({B, T, 2, D}), view({B, T, H, D}, packed), view({B, H, T}),
                             opts(true, 1, -1));
    CHECK(p.dout.b == T * H * D && p.dout.t == D && p.dout.h == T * D);
    CHECK(p.o.b == T * 3 * H * D && p.o.t == 3 * H * D && p.o.h == D);
    CHECK(p.dq.b == T * H * D && p.dq.t == H * D && p.dq.h == D);
    CHECK(p.dk.b == T * 2 * D && p.dk.t == 2 * D && p.dk.h == D);
    CHECK(p.window_left == 1 && p.window_right == 0);
}

// For every small shape and option, the key range of each query row and the
// query range of each key equal the brute-force visible sets.
void test_mask_helpers() {
    int64_t cases = 0;
    for (int64_t Tq = 1; Tq <= 9; ++Tq)
        for (int64_t Tk = 1; Tk <= 9; ++Tk)
            for (int causal = 0; causal < 2; ++causal)
                for (int64_t left = -1; left <= 10; ++left)
                    for (int64_t right = -1; right <= 10; ++right) {
                        const FlashParams p = make_forward_params(
                            view({1, Tq, 1, 4}), view({1, Tk, 1, 4}), view({1, Tk, 1, 4}),
                            opts(causal != 0, left, right));
                        for (int64_t i = 0; i < Tq; ++i) {
                            const int64_t b = fa_key_begin(i, p.Tq, p.Tk, p.window_left);
                            const int64_t e = fa_key_end(i, p.Tq, p.Tk, p.window_right);
                            CHECK(b >= 0 && e <= Tk);
                            for (int64_t j = 0; j < Tk; ++j) {
                                const bool in_range = b <= j && j < e;
                                if (in_range != visible(i, j, Tq, Tk, causal, left, right)) {
                                    std::printf("key range of row %lld: Tq=%lld Tk=%lld causal=%d window=(%lld, %lld) j=%lld\n",
                                                (long long)i, (long long)Tq, (long long)Tk, causal,
                                                (long long)left, (long long)right, (long long)j);
                                    CHECK(false);
                                }
                            }
                        }
                        for (int64_t j = 0; j < Tk; ++j) {
                            const int64_t b = fa_query_begin(j, p.Tq, p.Tk, p.window_right);
                            const int64_t e = fa_query_end(j, p.Tq, p.Tk, p.window_left);
                            CHECK(b >= 0 && e <= Tq);
                            for (int64_t i = 0; i < Tq; ++i) {
                                const bool in_range = b <= i && i < e;
                                if (in_range != visible(i, j, Tq, Tk, causal, left, right)) {
                                    std::printf("query range of key %lld: Tq=%lld Tk=%lld causal=%d window=(%lld, %lld) i=%lld\n",
                                                (long long)j, (long long)Tq, (long long)Tk, causal,
                                                (long long)left, (long long)right, (long long)i);
                                    CHECK(false);
                                }
                            }
                        }
                        ++cases;
                    }
    CHECK(cases == 9 * 9 * 2 * 12 * 12);

    // At the largest accepted sizes the helpers still agree with the rule
    // (int64 arithmetic: p + right reaches Tk + Tq without wrapping).
    const int64_t big = std::numeric_limits<int32_t>::max() / 2;
    for (int64_t Tq : {int64_t(1), int64_t(1000), big})
        for (int64_t Tk : {int64_t(1), int64_t(777), big})
            for (int causal = 0; causal < 2; ++causal)
                for (int64_t left : {int64_t(-1), int64_t(0), int64_t(5), big})
                    for (int64_t right : {int64_t(-1), int64_t(0), int64_t(3), big}) {
                        const FlashParams p = make_forward_params(
                            view({1, Tq, 1, 4}, {0, 0, 0, 1}), view({1, Tk, 1, 4}, {0, 0, 0, 1}),
                            view({1, Tk, 1, 4}, {0, 0, 0, 1}), opts(causal != 0, left, right));
                        for (int64_t i : {int64_t(0), Tq / 2, Tq - 1}) {
                            const int64_t b = fa_key_begin(i, p.Tq, p.Tk, p.window_left);
                            const int64_t e = fa_key_end(i, p.Tq, p.Tk, p.window_right);
                            // Check the range's edges and their neighbours.
                            for (int64_t j : {b - 1, b, e - 1, e, int64_t(0), Tk - 1}) {
                                if (j < 0 || j >= Tk) continue;
                                CHECK((b <= j && j < e) == visible(i, j, Tq, Tk, causal, left, right));
                            }
                            if (b < e) {
                                CHECK(fa_query_begin(b, p.Tq, p.Tk, p.window_right) <= i);
                                CHECK(fa_query_end(b, p.Tq, p.Tk, p.window_left) > i);
                                CHECK(fa_query_begin(e - 1, p.Tq, p.Tk, p.window_right) <= i);
                                CHECK(fa_query_end(e - 1, p.Tq, p.Tk, p.window_left) > i);
                            }
                        }
                    }
}

}  // namespace

int main() {
    test_messages();
    test_normalisation();
    test_mask_helpers();
    return flashattn_test::finish("test_params");
}
