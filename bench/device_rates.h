#pragma once

// The device ceilings a benchmark's floor is computed from, measured beside its figures on the
// machine that runs it: the device-to-device copy rate, a peer copy rate and a bf16 GEMM rate.
// Each exits the process with the CUDA error when the device cannot run it.

namespace rollout::bench {

// Device-to-device copy of 4 GiB, bytes read + written per second (the mean of 10 after 2
// warm-ups): how the floors' memory rate is counted.
double MeasureCopyBandwidth();

// Peer copy of 1 GiB from GPU `src` into GPU `dst` (NVLink on the H200 hosts), bytes per second
// into dst. Leaves device 0 current.
double MeasurePeerBandwidth(int dst, int src);

// bf16 GEMM 8192^3 (fp32 accumulation) with cuBLASLt's heuristic and a 64 MiB workspace: what
// the tensor cores reach on random data, FLOP/s.
double MeasureGemmFlops();

}  // namespace rollout::bench
