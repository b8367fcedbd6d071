// The engines this build has, best first, created once on first use.
#include "core/registry.h"

#include <memory>
#include <mutex>
#include <stdexcept>

#include "engines/factories.h"

namespace flashattn {
namespace {

struct Registry {
    std::vector<std::unique_ptr<Engine>> engines;  // best first

    Registry() {
#ifdef FLASHATTN_HAVE_METAL
        if (auto metal = make_metal_engine()) engines.push_back(std::move(metal));
#endif
        engines.push_back(make_cpu_engine());
        engines.push_back(make_metal_sim_engine());
    }
};

Registry& registry() {
    static Registry instance;  // thread-safe initialisation
    return instance;
}

}  // namespace

std::vector<std::string> available_engines() {
    std::vector<std::string> names;
    for (const auto& e : registry().engines) names.push_back(e->name());
    return names;
}

Engine& default_engine() { return *registry().engines.front(); }

Engine& get_engine(const std::string& name) {
    for (const auto& e : registry().engines)
        if (e->name() == name) return *e;
    std::string known;
    for (const auto& n : available_engines()) known += (known.empty() ? "'" : ", '") + n + "'";
    throw std::invalid_argument("backend: unknown engine '" + name + "'; available: " + known);
}

}  // namespace flashattn
