// Binding a kernel compiled from a .metal source to a launch: finds each of
// its parameters in the launch's buffers or the position builtins. Include
// after <metal_stdlib> (the shim), the .metal sources and the #undef of the
// shim's address-space words.
#pragma once
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "sim/launcher.h"

namespace flashattn::sim {

// Binds a kernel's parameters A... in order: the first buffers.size() are
// buffers (pointers, or `constant T&` for value bindings), the rest are
// position builtins in the order Builtins lists them.
template <class... A>
struct Binder {
    using Fn = void (*)(A...);

    template <class T>
    static std::string check_one(size_t index, const std::vector<Binding>& b) {
        const size_t n = b.size();
        if (index < n) {
            if constexpr (std::is_pointer_v<T>) {
                if (b[index].is_value) return "buffer(" + std::to_string(index) + ") is a device pointer but is bound by value";
            } else if constexpr (std::is_reference_v<T>) {
                if (!b[index].is_value) return "buffer(" + std::to_string(index) + ") is a constant reference but is bound to a device buffer";
            } else {
                return "parameter " + std::to_string(index) + " is not a buffer but the launch binds one there";
            }
            if (!b[index].ptr) return "buffer(" + std::to_string(index) + ") is bound to nothing";
            return {};
        }
        const size_t k = index - n;
        if constexpr (std::is_same_v<T, metal::uint3>) {
            if (k == 0) return {};
        } else if constexpr (std::is_same_v<T, uint>) {
            if (k >= 1 && k <= 3) return {};
        }
        return "parameter " + std::to_string(index) + " is neither a bound buffer nor the builtin expected at that position";
    }

    template <size_t... I>
    static std::string check(const std::vector<Binding>& b, std::index_sequence<I...>) {
        std::string why;
        ((why.empty() ? (void)(why = check_one<A>(I, b)) : (void)0), ...);
        if (why.empty() && b.size() > sizeof...(A))
            why = "the launch binds " + std::to_string(b.size()) + " buffers but the kernel has " +
                  std::to_string(sizeof...(A)) + " parameters";
        return why;
    }

    template <class T>
    static T get(size_t index, const std::vector<Binding>& b, const Builtins& bi) {
        if constexpr (std::is_pointer_v<T>) {
            return static_cast<T>(b[index].ptr);
        } else if constexpr (std::is_reference_v<T>) {
            return *static_cast<std::remove_reference_t<T>*>(b[index].ptr);
        } else if constexpr (std::is_same_v<T, metal::uint3>) {
            return metal::uint3{bi.group[0], bi.group[1], bi.group[2]};
        } else {
            const size_t k = index - b.size();
            return k == 1 ? bi.thread : k == 2 ? bi.lane : bi.simdgroup;
        }
    }

    template <size_t... I>
    static void run(Fn f, const std::vector<Binding>& b, const Builtins& bi, std::index_sequence<I...>) {
        f(get<A>(I, b, bi)...);
    }

    static Kernel make(const char* name, Fn f) {
        Kernel k;
        k.name = name;
        k.check = [](const std::vector<Binding>& b) { return check(b, std::index_sequence_for<A...>{}); };
        k.run = [f](const std::vector<Binding>& b, const Builtins& bi) {
            run(f, b, bi, std::index_sequence_for<A...>{});
        };
        return k;
    }
};

// A Kernel calling `f`, known to launches as `name`.
template <class... A>
Kernel make_kernel(const char* name, void (*f)(A...)) {
    return Binder<A...>::make(name, f);
}

}  // namespace flashattn::sim
