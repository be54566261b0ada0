"""Weight sync from a torch trainer's GPU tensors through the Python client, timed.

Loads the checkpoint the servers were started on (so the digest after the update must equal
the one they report at start: the bytes arrived whole) into torch tensors on the GPU, then
pushes them with RolloutClient.update_weights to the first target (twice for each --streams
count: one update over that many connections), and with Fleet to all of
them when several are given. Prints each call's seconds and GB/s, the servers' receive/swap
split, and beside it the host's memcpy rate and the pinned device-to-host rate measured in the
same run. Exits 1 (no RESULT line) when a digest differs or a call fails.

    python3 bench/python_weights_bench.py --model DIR --targets 127.0.0.1:50061[,...] --streams 1,4

Needs torch (with CUDA), numpy, grpcio and the installed rollout_client package (or
PYTHONPATH pointing at a copy of it).
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np


def rates(torch):
    """(host memcpy GB/s, pinned device-to-host GB/s), 1 GiB each, best of 3."""
    n = 1 << 30
    a = np.ones(n, np.uint8)
    b = np.empty_like(a)
    best = 1e9
    for _ in range(3):
        t0 = time.perf_counter()
        np.copyto(b, a)
        best = min(best, time.perf_counter() - t0)
    memcpy = n / best / 1e9
    d = torch.ones(n, dtype=torch.uint8, device="cuda")
    h = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    best = 1e9
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        h.copy_(d, non_blocking=True)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return memcpy, n / best / 1e9


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True, help="the checkpoint the servers serve")
    p.add_argument("--targets", required=True, help="comma-separated host:port list")
    p.add_argument("--bucket_mb", type=int, default=256)
    p.add_argument("--chunk_mb", type=int, default=4)
    p.add_argument("--token", default=None)
    p.add_argument("--streams", default="1,4",
                   help="comma-separated stream counts for RolloutClient.update_weights(streams=)")
    args = p.parse_args()

    import torch
    from rollout_client import Fleet, RolloutClient, read_safetensors

    targets = args.targets.split(",")
    memcpy, d2h = rates(torch)
    print(f"host memcpy {memcpy:.1f} GB/s, pinned device-to-host {d2h:.1f} GB/s")

    t0 = time.perf_counter()
    state = {}
    for name, t in read_safetensors(args.model).items():
        assert t.dtype == "BF16", (name, t.dtype)
        host = torch.frombuffer(bytearray(t.data), dtype=torch.bfloat16).reshape(t.shape)
        state[name] = host.to("cuda")
    torch.cuda.synchronize()
    total = sum(v.numel() * 2 for v in state.values())
    print(f"loaded {len(state)} tensors, {total / 1e9:.2f} GB, onto the GPU in "
          f"{time.perf_counter() - t0:.1f} s")

    failed = False
    with RolloutClient(targets[0], token=args.token, timeout=600) as client:
        start_digest = client.wait_ready(60).weight_digest
        for streams in [int(n) for n in args.streams.split(",")]:
            for i in range(2):
                r = client.update_weights(state.items(), version=f"py-bench-{streams}x-{i}",
                                          bucket_bytes=args.bucket_mb << 20,
                                          chunk_bytes=args.chunk_mb << 20, streams=streams)
                ok = r.weight_digest == start_digest and r.bytes_received == total
                failed |= not ok
                print(f"RolloutClient run {i}, {streams} stream(s): {r.seconds:.2f} s = "
                      f"{r.bytes_per_second / 1e9:.2f} GB/s (server receive "
                      f"{r.receive_seconds:.2f} s, swap {r.swap_seconds:.2f} s); digest "
                      f"{'equal to the start' if ok else 'DIFFERS: ' + r.weight_digest}")
    if len(targets) > 1:
        with Fleet(targets, token=args.token, timeout=600) as fleet:
            digests = [i.weight_digest for i in fleet.wait_ready(60)]
            t0 = time.perf_counter()
            results = fleet.update_weights(state.items(), version="py-bench-fleet",
                                           bucket_bytes=args.bucket_mb << 20,
                                           chunk_bytes=args.chunk_mb << 20)
            wall = time.perf_counter() - t0
            for target, r, d in zip(targets, results, digests):
                ok = r.weight_digest == d and r.bytes_received == total
                failed |= not ok
                print(f"Fleet {target}: {r.seconds:.2f} s = {r.bytes_per_second / 1e9:.2f} GB/s "
                      f"(server receive {r.receive_seconds:.2f} s, swap {r.swap_seconds:.2f} s); "
                      f"digest {'equal' if ok else 'DIFFERS'}")
            print(f"Fleet of {len(targets)}: {wall:.2f} s for {len(targets)} x {total / 1e9:.2f} GB")
    if failed:
        print("FAILED: a digest or byte count differs; no result", file=sys.stderr)
        return 1
    print(f"RESULT python update_weights {total / 1e9:.2f} GB from GPU tensors, floors: memcpy "
          f"{memcpy:.1f} GB/s, pinned D2H {d2h:.1f} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
