#!/usr/bin/env bash
# Pushes one weight version to EVERY replica of a rollout service, then checks that each one
# reports it (GetServerInfo.weight_version). Replicas are the addresses DNS returns for the
# service name (a Kubernetes headless Service lists every ready pod), or an explicit list.
#
#   deploy/push-weights.sh --service rollout.rollout.svc.cluster.local:50051 \
#       --version step-100 --path /models/step-100 --auth_token_file /var/run/secrets/rollout/token
#   deploy/push-weights.sh --endpoints 10.0.0.5:50051,10.0.0.6:50051 \
#       --version step-100 --from ./ckpt/step-100 --policy abort --auth_token_file ./token
#
#   --path DIR        UpdateWeightsFromPath: each server loads DIR from ITS OWN disk (a shared
#                     volume mounted at the same path everywhere). Cheap for the pusher.
#   --from DIR        UpdateWeights: stream the local checkpoint DIR to each server (the pusher
#                     sends the whole checkpoint once per replica).
#   --policy P        drain (default) | abort | continue: what happens to rollouts in flight on
#                     each replica (docs/operations.md, "Pushing weights").
#   --auth_token_file F  bearer token for the control RPCs (its first line; rollout-cli reads
#                     the file itself, so the token is never on a command line). --token-file is
#                     the deprecated spelling.
#   --parallel N      replicas updated at once (default: all).
#   --verify-only     push nothing; only check every replica's weight_version.
#   --cli PATH        rollout-cli to use (default: rollout-cli on PATH, else build/bin/).
#   -- FLAGS...       passed to every rollout-cli call, e.g. -- --tls_root_cert=ca.pem
#
# A replica busy with another update (ABORTED) is retried a few times. Exit status: 0 when every
# replica serves --version, 1 otherwise (the failing replicas are listed). Pushes are not atomic
# across replicas: until this returns 0, completions may carry either version, so check
# Completion.weight_version on the client side too.
set -euo pipefail

service="" endpoints="" version="" path="" from="" policy="drain" token_file=""
parallel=0 verify_only=0 cli=""
extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --service) service=$2; shift 2 ;;
    --endpoints) endpoints=$2; shift 2 ;;
    --version) version=$2; shift 2 ;;
    --path) path=$2; shift 2 ;;
    --from) from=$2; shift 2 ;;
    --policy) policy=$2; shift 2 ;;
    --auth_token_file) token_file=$2; shift 2 ;;
    --token-file)
      echo "push-weights: --token-file is deprecated; use --auth_token_file" >&2
      token_file=$2; shift 2 ;;
    --parallel) parallel=$2; shift 2 ;;
    --verify-only) verify_only=1; shift ;;
    --cli) cli=$2; shift 2 ;;
    --) shift; extra=("$@"); break ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d'; exit 0 ;;
    *) echo "push-weights: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
die() { echo "push-weights: $*" >&2; exit 2; }
[ -n "$version" ] || die "--version is required"
[ -n "$service" ] || [ -n "$endpoints" ] || die "give --service HOST:PORT or --endpoints A,B"
if [ "$verify_only" -eq 0 ]; then
  [ -n "$path" ] || [ -n "$from" ] || die "give --path DIR (server side) or --from DIR (streamed)"
  [ -z "$path" ] || [ -z "$from" ] || die "--path and --from exclude each other"
fi
case "$policy" in drain|abort|continue) ;; *) die "--policy must be drain, abort or continue" ;; esac

if [ -z "$cli" ]; then
  cli=$(command -v rollout-cli || true)
  [ -n "$cli" ] || cli=$(cd "$(dirname "$0")/.." && pwd)/build/bin/rollout-cli
fi
[ -x "$cli" ] || die "no rollout-cli at $cli (use --cli)"

# The replicas.
targets=()
if [ -n "$endpoints" ]; then
  IFS=, read -r -a targets <<<"$endpoints"
else
  host=${service%:*}
  port=${service##*:}
  [ "$host" != "$service" ] || die "--service needs HOST:PORT"
  host=${host#dns:///}
  while read -r addr; do
    case "$addr" in
      *:*) targets+=("[$addr]:$port") ;;   # IPv6
      *) targets+=("$addr:$port") ;;
    esac
  done < <(getent ahosts "$host" | awk '{print $1}' | sort -u)
fi
[ ${#targets[@]} -gt 0 ] || die "no replica found for ${service:-$endpoints}"
echo "push-weights: ${#targets[@]} replica(s): ${targets[*]}"

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
auth=()
if [ -n "$token_file" ]; then
  [ -r "$token_file" ] || die "cannot read $token_file"
  auth=(--auth_token_file="$token_file")
fi

push_one() {  # target index
  local target=$1 i=$2 attempt out
  for attempt in 1 2 3 4 5; do
    if [ -n "$path" ]; then
      out=$("$cli" --server="$target" "${auth[@]}" "${extra[@]}" \
        update-weights-from-path --path="$path" --weight_version="$version" \
        --policy="$policy" 2>&1) && { echo "$out" >"$work/push.$i"; return 0; }
    else
      out=$("$cli" --server="$target" "${auth[@]}" "${extra[@]}" \
        update-weights --from="$from" --weight_version="$version" --policy="$policy" 2>&1) \
        && { echo "$out" >"$work/push.$i"; return 0; }
    fi
    case "$out" in
      *ABORTED*) sleep $((attempt * 2)) ;;      # another update in progress there: retry
      *) break ;;
    esac
  done
  echo "$out" >"$work/push.$i"
  return 1
}

if [ "$verify_only" -eq 0 ]; then
  pids=()
  for i in "${!targets[@]}"; do
    push_one "${targets[$i]}" "$i" &
    pids+=($!)
    if [ "$parallel" -gt 0 ] && [ $(( (i + 1) % parallel )) -eq 0 ]; then
      wait "${pids[@]}" || true
      pids=()
    fi
  done
  for p in "${pids[@]}"; do wait "$p" || true; done
  for i in "${!targets[@]}"; do
    echo "--- ${targets[$i]}"
    cat "$work/push.$i" 2>/dev/null || true
  done
fi

failed=()
for target in "${targets[@]}"; do
  info=$("$cli" --server="$target" "${auth[@]}" "${extra[@]}" --json info 2>&1) || true
  got=$(printf '%s' "$info" | sed -n 's/.*"weight_version":"\([^"]*\)".*/\1/p' | head -n 1)
  if [ "$got" = "$version" ]; then
    echo "ok      $target  weight_version=$got"
  else
    if [ -n "$got" ]; then
      echo "MISSING $target  weight_version=$got (expected $version)"
    else
      echo "MISSING $target  no answer: $info"
    fi
    failed+=("$target")
  fi
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "push-weights: ${#failed[@]} of ${#targets[@]} replica(s) do not serve $version:" \
    "${failed[*]}" >&2
  exit 1
fi
echo "push-weights: all ${#targets[@]} replica(s) serve $version"
