// The engines this build has, best first, created once on first use. Each is
// started on its own (engine_set.h): an engine that fails is left out with
// its reason, which fa.backends() callers see through missing_engines().
#include "core/registry.h"

#include <exception>
#include <memory>
#include <mutex>
#include <stdexcept>

#include "engines/engine_set.h"
#include "engines/factories.h"

// FLASHATTN_NO_METAL_REASON: why this build has no metal engine (not macOS,
// FLASHATTN_METAL=OFF, or no working Metal compiler at configure time).
#include "engines_build.h"

namespace flashattn {

EngineSet start_engines(const std::vector<EngineFactory>& factories) {
    EngineSet set;
    for (const EngineFactory& f : factories) {
        try {
            std::unique_ptr<Engine> engine = f.make();
            if (engine) set.engines.push_back(std::move(engine));
            else set.missing.push_back({f.name, f.when_null, false});
        } catch (const std::exception& e) {
            set.missing.push_back({f.name, e.what(), true});
        } catch (...) {
            set.missing.push_back({f.name, "failed to start (unknown exception)", true});
        }
    }
    return set;
}

namespace {

std::vector<EngineFactory> factories() {
    std::vector<EngineFactory> list;
#ifdef FLASHATTN_HAVE_METAL
    list.push_back({"metal", make_metal_engine,
                    "no Metal device on this machine (MTLCreateSystemDefaultDevice returned nil)"});
#endif
    list.push_back({"cpu", make_cpu_engine, "the cpu engine did not start"});
    list.push_back({"metal-sim", make_metal_sim_engine, "the metal-sim engine did not start"});
    return list;
}

EngineSet& registry() {
    static EngineSet instance = [] {  // thread-safe initialisation
        EngineSet set = start_engines(factories());
#ifndef FLASHATTN_HAVE_METAL
        set.missing.insert(set.missing.begin(), MissingEngine{"metal", FLASHATTN_NO_METAL_REASON, false});
#endif
        return set;
    }();
    return instance;
}

}  // namespace

std::vector<std::string> available_engines() {
    std::vector<std::string> names;
    for (const auto& e : registry().engines) names.push_back(e->name());
    return names;
}

std::vector<MissingEngine> missing_engines() { return registry().missing; }

Engine& default_engine() {
    EngineSet& set = registry();
    if (set.engines.empty())
        throw std::runtime_error("flashattn: no engine could start" +
                                 (set.missing.empty() ? std::string()
                                                      : ": " + set.missing.front().name + ": " +
                                                            set.missing.front().reason));
    return *set.engines.front();
}

Engine& get_engine(const std::string& name) {
    for (const auto& e : registry().engines)
        if (e->name() == name) return *e;
    for (const MissingEngine& m : registry().missing)
        if (m.name == name)
            throw std::invalid_argument("backend: engine '" + name + "' is not available: " +
                                        m.reason);
    std::string known;
    for (const auto& n : available_engines()) known += (known.empty() ? "'" : ", '") + n + "'";
    throw std::invalid_argument("backend: unknown engine '" + name + "'; available: " + known);
}

}  // namespace flashattn
