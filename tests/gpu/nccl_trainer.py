#!/usr/bin/env python3
"""A torch "trainer" on GPU 0 broadcasting a checkpoint to rollout servers on the other GPUs by
NCCL (tests/gpu/nccl_broadcast.sh drives it; rollout_client.WeightBroadcaster does the work).

Loads a safetensors checkpoint (rollout-make-model's) onto GPU 0, measures the peer copy rate
from GPU 0 to each server's GPU (the floor a broadcast is compared with), then:
  1. joins the servers into a weight-sync group; a broadcast that stops half way (the trainer
     sends half the buckets, then aborts its communicator): every server must answer
     DEADLINE_EXCEEDED, leave the group and keep its weights, version and digest;
  2. joins again and broadcasts the whole checkpoint --repeats times (one version each),
     printing per server:
       BROADCAST version=V server=T bytes=B wall_s=W receive_s=R swap_s=S gbps_receive=G
                 gbps_wall=H digest=sha256:...
     (gbps_receive: the bytes over the server's receive time, handshake to last bucket hashed,
     i.e. per receiving GPU), and a TRAINER line with the trainer's own wall time;
  3. writes everything as JSON to --results and prints "TRAINER OK" or "TRAINER FAILED".
Needs torch and the rollout_client package (with grpcio) on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import sys
import time

import torch

import rollout_client
from rollout_client import BroadcastError, RolloutClient, WeightBroadcaster
from rollout_client.broadcast import TorchNcclTransport

HERE = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.util.spec_from_file_location("ipc_trainer", os.path.join(HERE, "ipc_trainer.py"))
ipc_trainer = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ipc_trainer)


class StopHalfWay(TorchNcclTransport):
    """Sends the first half of the buckets, then aborts: a trainer that dies mid-broadcast."""

    def send(self, plan, tensors, timeout):
        half = dataclasses.replace(plan, buckets=plan.buckets[:max(1, len(plan.buckets) // 2)])
        super().send(half, tensors, timeout)
        torch.cuda.synchronize(self.device)
        self.close()


def peer_floor(src: torch.device, dst: torch.device, nbytes: int = 2 << 30, reps: int = 5) -> float:
    """Best copy rate from src to dst (bytes per second): NVLink's, for a broadcast's floor."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=src).fill_(1)
    b = torch.empty(nbytes, dtype=torch.uint8, device=dst)
    best = float("inf")
    for _ in range(reps):
        torch.cuda.synchronize(src)
        torch.cuda.synchronize(dst)
        start = time.perf_counter()
        b.copy_(a, non_blocking=True)
        torch.cuda.synchronize(dst)
        torch.cuda.synchronize(src)
        best = min(best, time.perf_counter() - start)
    del a, b
    torch.cuda.empty_cache()
    return nbytes / best


def infos(targets):
    out = []
    for t in targets:
        with RolloutClient(t, timeout=60) as c:
            out.append(c.server_info())
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--targets", required=True, help="host:port,host:port,... (server i = rank i+1)")
    p.add_argument("--server_gpus", default="", help="the servers' GPU indices, for the floor")
    p.add_argument("--version", default="bc")
    p.add_argument("--policy", default="drain")
    p.add_argument("--bucket_mb", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--timeout", type=float, default=120)
    p.add_argument("--half_way_timeout", type=float, default=10)
    p.add_argument("--results", default="")
    args = p.parse_args()
    targets = args.targets.split(",")
    device = torch.device("cuda", 0)
    print(f"torch {torch.__version__}, rollout_client from {os.path.dirname(rollout_client.__file__)}, "
          f"{torch.cuda.device_count()} GPUs, trainer on {torch.cuda.get_device_name(device)}",
          flush=True)
    start = time.monotonic()
    tensors = ipc_trainer.load_checkpoint(args.checkpoint, device)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    print(f"loaded {len(tensors)} tensors, {total / 1e9:.2f} GB in {time.monotonic() - start:.1f} s",
          flush=True)
    results = {"bytes": total, "tensors": len(tensors), "targets": targets, "floors": {},
               "broadcasts": [], "half_way": {}}
    for g in [int(x) for x in args.server_gpus.split(",") if x]:
        rate = peer_floor(device, torch.device("cuda", g))
        results["floors"][g] = rate
        print(f"P2P_FLOOR gpu0->gpu{g} {rate / 1e9:.0f} GB/s: {total / 1e9:.2f} GB in "
              f"{total / rate * 1e3:.0f} ms", flush=True)
    bucket = args.bucket_mb << 20
    ok = True

    # 1. A broadcast that stops half way changes nothing and leaves the group.
    before = infos(targets)
    t0 = time.monotonic()
    fleet = WeightBroadcaster(targets, device, timeout=args.timeout,
                              transport=StopHalfWay(device))
    print(f"JOIN {len(targets)} servers in {time.monotonic() - t0:.2f} s "
          f"(NCCL {fleet.groups[0].nccl_version})", flush=True)
    try:
        fleet.broadcast(tensors.items(), f"{args.version}-half", args.policy, bucket_bytes=bucket,
                        timeout=args.half_way_timeout)
        print("HALF_WAY FAILED: the broadcast that stopped half way succeeded", flush=True)
        ok = False
    except BroadcastError as e:
        codes = [getattr(err, "code", None) for err in e.errors]
        after = infos(targets)
        unchanged = all(a.weight_digest == b.weight_digest and a.weight_version == b.weight_version
                        for a, b in zip(after, before))
        left = all(a.weight_sync_group is None for a in after)
        # The servers wait for the next bucket until their timeout (or NCCL reports the
        # trainer's abort as a remote error).
        half_ok = all(c in ("DEADLINE_EXCEEDED", "UNAVAILABLE") for c in codes) and unchanged \
            and left
        results["half_way"] = {"codes": codes, "unchanged": unchanged, "left": left, "ok": half_ok}
        print(f"HALF_WAY codes={codes} weights_unchanged={unchanged} left_group={left} "
              f"{'OK' if half_ok else 'FAILED'}", flush=True)
        ok = ok and half_ok
    fleet.close()

    # 2. Joined again: whole broadcasts.
    t0 = time.monotonic()
    with WeightBroadcaster(targets, device, timeout=args.timeout) as fleet:
        results["join_s"] = time.monotonic() - t0
        for r in range(args.repeats):
            version = f"{args.version}-{r}"
            t0 = time.monotonic()
            try:
                got = fleet.broadcast(tensors.items(), version, args.policy, bucket_bytes=bucket)
            except BroadcastError as e:
                print(f"BROADCAST version={version} FAILED: {e}", flush=True)
                results["broadcasts"].append({"version": version, "ok": False, "error": str(e)})
                ok = False
                break
            wall = time.monotonic() - t0
            for target, u in zip(targets, got):
                row = {"version": version, "server": target, "ok": True,
                       "bytes": u.bytes_received, "wall_s": u.seconds,
                       "receive_s": u.receive_seconds, "swap_s": u.swap_seconds,
                       "gbps_receive": u.bytes_received / max(u.receive_seconds, 1e-9) / 1e9,
                       "gbps_wall": u.bytes_received / max(u.seconds, 1e-9) / 1e9,
                       "digest": u.weight_digest}
                results["broadcasts"].append(row)
                print(f"BROADCAST version={version} server={target} bytes={row['bytes']} "
                      f"wall_s={row['wall_s']:.3f} receive_s={row['receive_s']:.3f} "
                      f"swap_s={row['swap_s']:.3f} gbps_receive={row['gbps_receive']:.1f} "
                      f"gbps_wall={row['gbps_wall']:.1f} digest={row['digest']}", flush=True)
            print(f"TRAINER version={version} wall_s={wall:.3f} "
                  f"gbps={total / wall / 1e9:.1f} into {len(targets)} servers", flush=True)
    digests = {b.get("digest") for b in results["broadcasts"] if b.get("ok")}
    results["same_digest"] = len(digests) == 1
    ok = ok and results["same_digest"] and bool(results["broadcasts"])
    if args.results:
        with open(args.results, "w") as f:
            json.dump(results, f, indent=1)
    print("TRAINER", "OK" if ok else "FAILED", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
