#!/usr/bin/env python3
"""A colocated "trainer" for the CUDA IPC weight update (tests/gpu/ipc_update.sh drives it).

Loads a safetensors checkpoint (one written by rollout-make-model) onto the GPU, exports the
tensors' CUDA IPC handles with the Python client's own code (client/python/rollout_client/
ipc.py, loaded by path: this host has torch but no grpcio, so the package itself does not
import), writes them as rollout-cli's --ipc_tensors JSON, and runs `rollout-cli
update-weights-from-ipc --json` as a subprocess while it keeps the tensors alive. Two layouts,
the same bytes: `tensor` (one torch allocation per tensor, as a model's parameters) and
`packed` (views into one flat buffer, as a trainer's bucket), then `paused`: the packed
buffer again inside `rollout-cli pause` ... `resume`, the loop a trainer runs between steps
(PAUSE_UPDATE_RESUME wall_s=...). Also measures the device-to-device
copy rate of this GPU in the same run (the floor an IPC update is compared with).

Prints one line per update:
  IPC_UPDATE layout=L version=V tensors=N bytes=B wall_s=W receive_s=R swap_s=S gbps_wall=G
             digest=sha256:...
and a COPY_FLOOR line; writes everything as JSON to --results.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import struct
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
_spec = importlib.util.spec_from_file_location(
    "rollout_ipc", os.path.join(REPO, "client", "python", "rollout_client", "ipc.py"))
ipc = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = ipc  # dataclasses look their module up there while it executes
_spec.loader.exec_module(ipc)

DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


def safetensors_files(ckpt: str):
    index = os.path.join(ckpt, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            return sorted(set(json.load(f)["weight_map"].values()))
    return ["model.safetensors"]


def load_checkpoint(ckpt: str, device: torch.device):
    """name -> CUDA tensor, each its own allocation, in name order."""
    tensors = {}
    for name in safetensors_files(ckpt):
        with open(os.path.join(ckpt, name), "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
            base = 8 + header_len
            for tname, meta in sorted(header.items()):
                if tname == "__metadata__":
                    continue
                begin, end = meta["data_offsets"]
                f.seek(base + begin)
                host = torch.frombuffer(bytearray(f.read(end - begin)), dtype=torch.uint8)
                t = torch.empty(meta["shape"], dtype=DTYPES[meta["dtype"]], device=device)
                t.view(torch.uint8).view(-1).copy_(host)
                tensors[tname] = t
    torch.cuda.synchronize(device)
    return dict(sorted(tensors.items()))


def pack(tensors, device):
    """The same tensors as views into one flat buffer (256-byte aligned), and the seconds the
    device-to-device copies into it took."""
    offsets, total = [], 0
    for t in tensors.values():
        offsets.append(total)
        total += (t.numel() * t.element_size() + 255) // 256 * 256
    flat = torch.empty(total, dtype=torch.uint8, device=device)
    views = {}
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for (name, t), off in zip(tensors.items(), offsets):
        n = t.numel() * t.element_size()
        view = flat[off:off + n].view(t.dtype).view(t.shape)
        view.copy_(t)
        views[name] = view
    stop.record()
    torch.cuda.synchronize(device)
    return views, start.elapsed_time(stop) / 1e3


def copy_floor(device, nbytes=4 << 30, reps=5):
    """Best device-to-device copy rate of one big buffer, bytes copied per second."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    a.fill_(1)
    best = float("inf")
    for _ in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        b.copy_(a)
        stop.record()
        torch.cuda.synchronize(device)
        best = min(best, start.elapsed_time(stop) / 1e3)
    del a, b
    torch.cuda.empty_cache()
    return nbytes / best


def update(args, layout, tensors, version):
    with ipc.export_tensors(tensors) as exported:
        path = os.path.join(args.work, f"ipc-{layout}.json")
        with open(path, "w") as f:
            f.write(exported.to_json())
        handles = len({t.ipc_handle for t in exported.tensors})
        cmd = [args.cli, f"--server={args.server}", "--json", "update-weights-from-ipc",
               f"--ipc_tensors={path}", f"--version={version}", f"--policy={args.policy}"]
        start = time.monotonic()
        run = subprocess.run(cmd, capture_output=True, text=True)
        wall = time.monotonic() - start
    if run.returncode != 0:
        print(f"IPC_UPDATE layout={layout} FAILED rc={run.returncode}: {run.stderr.strip()}")
        return {"layout": layout, "ok": False, "error": run.stderr.strip()}
    r = json.loads(run.stdout.strip().splitlines()[-1])
    nbytes = int(r["bytes_received"])
    out = {"layout": layout, "ok": True, "version": version, "tensors": int(r["tensors_updated"]),
           "handles": handles, "bytes": nbytes, "wall_s": wall,
           "receive_s": float(r["receive_seconds"]), "swap_s": float(r["swap_seconds"]),
           "digest": r["weight_digest"], "gbps_wall": nbytes / wall / 1e9}
    print(f"IPC_UPDATE layout={layout} version={version} tensors={out['tensors']} "
          f"handles={handles} bytes={nbytes} wall_s={wall:.3f} receive_s={out['receive_s']:.3f} "
          f"swap_s={out['swap_s']:.3f} gbps_wall={out['gbps_wall']:.1f} digest={out['digest']}",
          flush=True)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", required=True, help="safetensors checkpoint to send")
    p.add_argument("--server", required=True, help="host:port of the rollout-server")
    p.add_argument("--cli", required=True, help="rollout-cli (or a wrapper that sets its env)")
    p.add_argument("--version", required=True, help="version prefix; -tensor / -packed appended")
    p.add_argument("--policy", default="drain")
    p.add_argument("--layouts", default="tensor,packed,paused")
    p.add_argument("--work", default="/tmp")
    p.add_argument("--results", default="")
    args = p.parse_args()
    device = torch.device("cuda", 0)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(device)}, "
          f"uuid {torch.cuda.get_device_properties(device).uuid}", flush=True)

    start = time.monotonic()
    tensors = load_checkpoint(args.checkpoint, device)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    print(f"loaded {len(tensors)} tensors, {total / 1e9:.2f} GB in {time.monotonic() - start:.1f} s",
          flush=True)
    rate = copy_floor(device)
    results = {"bytes": total, "tensors": len(tensors), "copy_floor_Bps": rate, "updates": []}
    print(f"COPY_FLOOR device-to-device {rate / 1e12:.2f} TB/s: {total / 1e9:.2f} GB in "
          f"{total / rate * 1e3:.1f} ms", flush=True)
    layouts = args.layouts.split(",")
    if "tensor" in layouts:
        results["updates"].append(update(args, "tensor", tensors, f"{args.version}-tensor"))
    if "packed" in layouts:
        packed, seconds = pack(tensors, device)
        results["pack_copy_s"] = seconds
        print(f"packed {len(packed)} tensors into one buffer by device copies in {seconds * 1e3:.1f} "
              f"ms ({total / seconds / 1e9:.0f} GB/s)", flush=True)
        del tensors
        torch.cuda.empty_cache()
        tensors = packed
        results["updates"].append(update(args, "packed", packed, f"{args.version}-packed"))
    if "paused" in layouts:
        # A trainer's loop between two steps: pause generation, update, resume (each a
        # rollout-cli call, as a script would make them), timed as a whole.
        target = tensors
        start = time.monotonic()
        paused = subprocess.run([args.cli, f"--server={args.server}", "pause"],
                                capture_output=True, text=True)
        u = update(args, "paused", target, f"{args.version}-paused")
        resumed = subprocess.run([args.cli, f"--server={args.server}", "resume"],
                                 capture_output=True, text=True)
        u["pause_update_resume_s"] = time.monotonic() - start
        u["ok"] = u.get("ok") and paused.returncode == 0 and resumed.returncode == 0
        print(f"PAUSE_UPDATE_RESUME wall_s={u['pause_update_resume_s']:.3f} (pause rc "
              f"{paused.returncode}, resume rc {resumed.returncode})", flush=True)
        results["updates"].append(u)
    digests = {u.get("digest") for u in results["updates"] if u.get("ok")}
    results["same_digest"] = len(digests) == 1
    if args.results:
        with open(args.results, "w") as f:
            json.dump(results, f, indent=1)
    ok = all(u.get("ok") for u in results["updates"]) and results["same_digest"]
    print("TRAINER", "OK" if ok else "FAILED", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
