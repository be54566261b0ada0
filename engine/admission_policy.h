#pragma once

#include <optional>
#include <string_view>

namespace rollout {

// When a waiting sequence may start (docs/architecture.md, "Admission").
enum class AdmissionPolicy {
  // Only when the pool can hold everything it may still need -- its prompt plus max_new_tokens
  // (capped at max_context) -- beside what every running sequence may still need. Blocks are
  // still taken as the sequence grows; only the count is reserved. A running sequence then never
  // waits for a block, so nothing is preempted and nothing recomputed; memory a sample does not
  // use because it stops early is idle until it ends.
  kReserve,
  // The default. As kReserve, but a sequence that may stop before max_new_tokens (it does not
  // ignore EOS, or has stop tokens: Scheduler::MayStopEarly) is charged an estimate of the
  // tokens it will still generate: min(max_new_tokens - generated, 4096) x a ratio that starts
  // at 0.7, falls by 0.001 per step to 0.1 and, after a preemption, is raised to what the
  // running sequences' progress suggests (their generated share of max_new_tokens, plus 20
  // steps each: SGLang's new_token_ratio). One that cannot stop early is charged all of it, as
  // under kReserve, so fixed-length work (ignore_eos) is admitted exactly as kReserve admits it.
  // Admits more at once when samples stop early (RL rollouts: 1.08x the floor where kReserve
  // takes 1.43x, docs/benchmarks.md); when the estimate was short, one sequence gives way as
  // under kOptimistic.
  kEstimate,
  // As soon as its prompt fits; when a running sequence then needs a block and none is left,
  // one gives way (preemption) and is recomputed later. Admits more at once when samples stop
  // early, and pays for it in recomputation under pressure. Tests use it to force preemption.
  kOptimistic,
};

// The flag's name of `policy`: ParseAdmissionPolicy's inverse.
inline const char* AdmissionPolicyName(AdmissionPolicy policy) {
  switch (policy) {
    case AdmissionPolicy::kReserve:
      return "reserve";
    case AdmissionPolicy::kEstimate:
      return "estimate";
    case AdmissionPolicy::kOptimistic:
      return "optimistic";
  }
  return "";
}

// "reserve", "estimate" or "optimistic" (AdmissionPolicyName's); nullopt for anything else.
inline std::optional<AdmissionPolicy> ParseAdmissionPolicy(std::string_view name) {
  for (AdmissionPolicy policy :
       {AdmissionPolicy::kReserve, AdmissionPolicy::kEstimate, AdmissionPolicy::kOptimistic}) {
    if (name == AdmissionPolicyName(policy)) return policy;
  }
  return std::nullopt;
}

}  // namespace rollout
