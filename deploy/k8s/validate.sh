#!/usr/bin/env bash
# Checks the manifests in this directory without a cluster:
#   - every *.yaml parses (PyYAML) and every object has apiVersion, kind and metadata.name;
#   - kustomization.yaml's resources and generator files exist;
#   - server.flags holds only --flag[=value] lines, and, when a rollout-server binary is found
#     ($ROLLOUT_SERVER, else build/bin/rollout-server), only flags that binary knows;
#   - the shutdown timing adds up: terminationGracePeriodSeconds > preStop sleep +
#     --shutdown_grace_s + the server's own abort-flush and shutdown deadlines (6 s);
#   - probe, port and Prometheus annotation numbers agree with the flags;
#   - with kubectl: `kubectl kustomize` renders; with kubeconform: the rendering passes its
#     schemas (CRDs such as PodMonitor are skipped).
# Needs python3 with PyYAML (Debian: apt-get install -y python3-yaml).
# Usage: deploy/k8s/validate.sh            exit status 0 = all checks passed
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)

python=""
for p in "${PYTHON:-}" python3 /usr/bin/python3; do
  if [ -n "$p" ] && command -v "$p" >/dev/null 2>&1 && "$p" -c 'import yaml' 2>/dev/null; then
    python=$p
    break
  fi
done
if [ -z "$python" ]; then
  echo "validate: no python3 with PyYAML (apt-get install -y python3-yaml)" >&2
  exit 2
fi

server_bin=${ROLLOUT_SERVER:-$root/build/bin/rollout-server}
known_flags=""
if [ -x "$server_bin" ]; then
  # absl prints "--name (help); default: ...": keep the names.
  known_flags=$("$server_bin" --helpfull 2>&1 | sed -n 's/^ *--\([a-zA-Z0-9_]*\) .*/\1/p' | sort -u \
    | tr '\n' ' ') || true
fi

"$python" - "$here" "$known_flags" <<'PY'
import glob, os, re, sys
import yaml

here, known = sys.argv[1], set(sys.argv[2].split())
errors = []
def err(msg):
    errors.append(msg)

docs = {}
for path in sorted(glob.glob(os.path.join(here, "*.yaml"))):
    name = os.path.basename(path)
    try:
        with open(path) as f:
            objs = [d for d in yaml.safe_load_all(f) if d is not None]
    except yaml.YAMLError as e:
        err(f"{name}: YAML error: {e}")
        continue
    if not objs:
        err(f"{name}: no document")
    for d in objs:
        if not isinstance(d, dict):
            err(f"{name}: a document is not a mapping")
            continue
        for key in ("apiVersion", "kind"):
            if key not in d:
                err(f"{name}: missing {key}")
        if d.get("kind") != "Kustomization" and not (d.get("metadata") or {}).get("name"):
            err(f"{name}: {d.get('kind')} without metadata.name")
        docs.setdefault(d.get("kind"), []).append((name, d))
    print(f"parsed {name}: " + ", ".join(str(d.get("kind")) for d in objs if isinstance(d, dict)))

# kustomization: referenced files exist
kust = docs.get("Kustomization", [(None, {})])[0][1]
for res in kust.get("resources", []):
    if not os.path.exists(os.path.join(here, res)):
        err(f"kustomization.yaml: resource {res} does not exist")
gen_files = []
for gen in kust.get("configMapGenerator", []):
    for f in gen.get("files", []):
        f = f.split("=", 1)[-1]
        gen_files.append(f)
        if not os.path.exists(os.path.join(here, f)):
            err(f"kustomization.yaml: configMapGenerator file {f} does not exist")

# server.flags
flags = {}
flags_path = os.path.join(here, "server.flags")
with open(flags_path) as f:
    for n, line in enumerate(f, 1):
        s = line.strip()
        if not s or s.startswith("#"):
            continue
        m = re.fullmatch(r"--([A-Za-z0-9_]+)(?:=(.*))?", s)
        if not m:
            err(f"server.flags:{n}: not a --flag[=value] line: {s!r}")
            continue
        flags[m.group(1)] = m.group(2)
        if known and m.group(1) not in known:
            err(f"server.flags:{n}: rollout-server has no flag --{m.group(1)}")
print(f"server.flags: {len(flags)} flags" +
      (", checked against the built rollout-server" if known else
       " (no rollout-server binary found: flag names not checked)"))

def intflag(name, default):
    v = flags.get(name)
    return int(v) if v not in (None, "") else default

# the Deployment against the flags
grpc_port = intflag("port", 50051)
metrics_port = intflag("metrics_port", 9400)
grace = intflag("shutdown_grace_s", 30)
for name, dep in docs.get("Deployment", []):
    spec = dep["spec"]["template"]["spec"]
    c = spec["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
    if ports.get("grpc") != grpc_port:
        err(f"{name}: container port grpc {ports.get('grpc')} != --port {grpc_port}")
    if metrics_port and ports.get("metrics") != metrics_port:
        err(f"{name}: container port metrics {ports.get('metrics')} != --metrics_port {metrics_port}")
    ann = dep["spec"]["template"]["metadata"].get("annotations", {})
    if metrics_port and ann.get("prometheus.io/port") != str(metrics_port):
        err(f"{name}: prometheus.io/port {ann.get('prometheus.io/port')} != {metrics_port}")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        p = c.get(probe)
        if not p or "grpc" not in p:
            err(f"{name}: {probe} is not a grpc probe")
        elif p["grpc"].get("port") != grpc_port:
            err(f"{name}: {probe} port {p['grpc'].get('port')} != --port {grpc_port}")
    res = c.get("resources", {})
    for part in ("requests", "limits"):
        if str(res.get(part, {}).get("nvidia.com/gpu")) != "1":
            err(f"{name}: resources.{part}['nvidia.com/gpu'] is not 1")
    pre = 0
    cmd = (((c.get("lifecycle") or {}).get("preStop") or {}).get("exec") or {}).get("command", [])
    if cmd and cmd[0].endswith("sleep"):
        pre = int(cmd[1])
    tgps = spec.get("terminationGracePeriodSeconds", 30)
    need = pre + grace + 6
    if tgps <= need:
        err(f"{name}: terminationGracePeriodSeconds {tgps} <= preStop {pre} + "
            f"--shutdown_grace_s {grace} + 6")
    else:
        print(f"{name}: terminationGracePeriodSeconds {tgps} > preStop {pre} + grace {grace} + 6")
    mounts = {m["name"]: m["mountPath"] for m in c.get("volumeMounts", [])}
    tok = flags.get("auth_token_file")
    if tok and not any(tok.startswith(p.rstrip("/") + "/") or tok == p for p in mounts.values()):
        err(f"{name}: --auth_token_file {tok} is not under any volumeMount")

for name, svc in docs.get("Service", []):
    if svc["spec"].get("clusterIP") != "None":
        err(f"{name}: Service {svc['metadata']['name']} is not headless (clusterIP: None)")

if errors:
    print("\n".join("ERROR: " + e for e in errors), file=sys.stderr)
    sys.exit(1)
PY

if command -v kubectl >/dev/null 2>&1; then
  rendered=$(mktemp)
  trap 'rm -f "$rendered"' EXIT
  kubectl kustomize "$here" >"$rendered"
  echo "kubectl kustomize: rendered $(grep -c '^kind:' "$rendered") objects"
  if command -v kubeconform >/dev/null 2>&1; then
    kubeconform -strict -summary -ignore-missing-schemas "$rendered"
  else
    echo "kubeconform not installed: schemas not checked"
  fi
else
  echo "kubectl not installed: kustomization not rendered"
fi
echo "validate: OK"
