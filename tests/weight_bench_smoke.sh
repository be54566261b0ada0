#!/usr/bin/env bash
# ctest: rollout-weight-bench on the CPU backend with the tiny model: every update's served digest
# must equal the digest of the bytes sent and the RESULT line must be printed; and with
# --tamper_for_testing (the bench expecting other bytes' digest) it must exit 1 printing no
# RESULT, so that the check is known to bite. Usage: weight_bench_smoke.sh BENCH_BINARY
set -uo pipefail
bench=$1
out=$("$bench" --backend=cpu --preset=tiny --updates=2 --floor_mb=16 2>&1)
rc=$?
echo "$out"
[[ $rc -eq 0 ]] || { echo "rollout-weight-bench exited $rc"; exit 1; }
grep -q "^RESULT weight update, cpu backend" <<<"$out" || { echo "no RESULT line"; exit 1; }
grep -q "served digest = digest of the bytes sent: sha256:" <<<"$out" || exit 1

out=$("$bench" --backend=cpu --preset=tiny --updates=2 --floor_mb=16 --tamper_for_testing 2>&1)
rc=$?
echo "$out" | tail -3
[[ $rc -eq 1 ]] || { echo "with a wrong expected digest: exit $rc, expected 1"; exit 1; }
if grep -q "^RESULT" <<<"$out"; then echo "a RESULT despite the digest mismatch"; exit 1; fi
out=$("$bench" --backend=tpu --preset=tiny --updates=2 --floor_mb=16 2>&1)
rc=$?
echo "$out" | tail -3
[[ $rc -eq 2 ]] || { echo "with --backend=tpu: exit $rc, expected 2"; exit 1; }
if grep -q "^floors:" <<<"$out"; then echo "--backend=tpu measured the floors first"; exit 1; fi
echo "weight_bench_smoke: ok"
