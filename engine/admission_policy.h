#pragma once

namespace rollout {

// When a waiting sequence may start (docs/architecture.md, "Admission").
enum class AdmissionPolicy {
  // Only when the pool can hold everything it may still need -- its prompt plus max_new_tokens
  // (capped at max_context) -- beside what every running sequence may still need. Blocks are
  // still taken as the sequence grows; only the count is reserved. A running sequence then never
  // waits for a block, so nothing is preempted and nothing recomputed; memory a sample does not
  // use because it stops early is idle until it ends.
  kReserve,
  // As soon as its prompt fits; when a running sequence then needs a block and none is left,
  // one gives way (preemption) and is recomputed later. Admits more at once when samples stop
  // early, and pays for it in recomputation under pressure. Tests use it to force preemption.
  kOptimistic,
};

}  // namespace rollout
