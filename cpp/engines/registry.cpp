// The engines this build has, best first, created once on first use. Each is
// started on its own (engine_set.h): an engine that fails is left out with
// its reason, which fa.backends() callers see through missing_engines(); so
// is one that fails its self-test later (Engine::unusable_reason).
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
    for (const auto& e : registry().engines)
        if (e->unusable_reason().empty()) names.push_back(e->name());
    return names;
}

// Engines that could not start, then those left out since (a failed self-test).
std::vector<MissingEngine> missing_engines() {
    std::vector<MissingEngine> missing = registry().missing;
    for (const auto& e : registry().engines)
        if (std::string why = e->unusable_reason(); !why.empty())
            missing.push_back({e->name(), why, true});
    return missing;
}

Engine& default_engine() {
    EngineSet& set = registry();
    for (const auto& e : set.engines)
        if (e->unusable_reason().empty()) return *e;
    const std::vector<MissingEngine> missing = missing_engines();
    throw std::runtime_error("flashattn: no engine could start" +
                             (missing.empty() ? std::string()
                                              : ": " + missing.front().name + ": " +
                                                    missing.front().reason));
}

Engine& get_engine(const std::string& name) {
    for (const auto& e : registry().engines)
        if (e->name() == name && e->unusable_reason().empty()) return *e;
    for (const MissingEngine& m : missing_engines())
        if (m.name == name)
            throw std::invalid_argument("backend: engine '" + name + "' is not available: " +
                                        m.reason);
    std::string known;
    for (const auto& n : available_engines()) known += (known.empty() ? "'" : ", '") + n + "'";
    throw std::invalid_argument("backend: unknown engine '" + name + "'; available: " + known);
}

}  // namespace flashattn
