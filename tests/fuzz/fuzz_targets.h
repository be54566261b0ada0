// Fuzz entry points, shared by the libFuzzer binaries (one per target, *_fuzzer.cc) and by
// fuzz_replay_test, which runs every seed and regression input through them in the ordinary
// build. Each returns 0; a property violation aborts (so the fuzzer records a crash).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace rollout::fuzz {

// The input is a model.safetensors file in a directory with a valid config.json; it is opened
// with Checkpoint::Open and every tensor it yields is read (ReadF32) and bounds-checked.
int FuzzCheckpoint(const uint8_t* data, size_t size);

// The input is model.safetensors.index.json next to two valid shards (a.safetensors,
// b.safetensors); Checkpoint::Open must refuse escapes and missing tensors without crashing.
int FuzzCheckpointIndex(const uint8_t* data, size_t size);

// The input is config.json text for ParseModelConfig. An accepted config must survive
// ModelConfigToJson -> ParseModelConfig unchanged.
int FuzzModelConfig(const uint8_t* data, size_t size);

// The input is a serialized GenerateRequest, run through ToSampleSpecs against a real engine
// (the tiny preset, CPU). Accepted requests must expand to valid samples.
int FuzzGenerateRequest(const uint8_t* data, size_t size);

// The input is a serialized ScoreRequest, run through ToScoreSpecs against the same engine.
int FuzzScoreRequest(const uint8_t* data, size_t size);

// The input is a weight-update stream: [u16 little-endian length][WeightsHeader bytes], then
// any number of [u16 length][TensorData bytes]. Fed to WeightsStaging over the tiny engine's
// weight specs (SetHeader, AddData..., Finish). An accepted update must be exactly the
// declared tensors, every byte present.
int FuzzWeightsStream(const uint8_t* data, size_t size);

struct Target {
  const char* name;  // the corpus / regression folder name
  int (*run)(const uint8_t* data, size_t size);
};
const std::vector<Target>& Targets();

// Builds a weight-update stream input (the format FuzzWeightsStream reads).
std::string EncodeWeightsStream(const std::string& header,
                                const std::vector<std::string>& data_chunks);

}  // namespace rollout::fuzz
