#!/usr/bin/env bash
# Prints, one per line, the distro packages that own the shared libraries the given binaries
# load (ldd), so a runtime image installs exactly the runtime halves of what the build stage's
# -dev packages pulled in (libgrpc++1.51*, libprotobuf32*, libabsl*, libgoogle-glog*,
# libcivetweb1, ...) under whatever names this distro release gives them (Debian 12 and
# Ubuntu 24.04 differ: the "t64" suffixes).
#
# Left out: the C/C++ runtime every base image has (libc6, libstdc++6, libgcc-s1) and the CUDA
# libraries under /usr/local/cuda* (the nvidia/cuda runtime base image ships them, pinned).
# libcuda.so.1 / libnvidia-* come from the host driver at run time (NVIDIA container toolkit),
# so "not found" is accepted for them only; any other unresolved library is an error.
#
# Usage: runtime-packages.sh BINARY...      (run in the build stage/host that built them)
set -euo pipefail
if [ $# -eq 0 ]; then
  echo "usage: $0 BINARY..." >&2
  exit 2
fi
declare -A packages=()
status=0
for bin in "$@"; do
  while read -r line; do
    case "$line" in
      *"=> not found"*)
        lib=${line%% *}
        case "$lib" in
          libcuda.so*|libnvidia-*) continue ;;
        esac
        echo "runtime-packages: $bin needs $lib, which is not installed" >&2
        status=1
        continue
        ;;
      *"=> /"*) ;;
      *) continue ;;   # linux-vdso, the dynamic loader itself
    esac
    path=${line#*=> }
    path=${path%% (*}
    case "$path" in
      /usr/local/cuda*|*/libcuda.so*|*/libnvidia-*) continue ;;
    esac
    owner=""
    # dpkg records paths as the package shipped them; with merged /usr the loader may report
    # /lib/... for a file dpkg knows as /usr/lib/... (or the other way round), and a symlink
    # name for the versioned file. Try the spellings in turn.
    real=$(readlink -f "$path")
    for candidate in "$path" "$real" "/usr$path" "/usr$real" "${path#/usr}" "${real#/usr}"; do
      [ -n "$candidate" ] || continue
      if out=$(dpkg-query -S "$candidate" 2>/dev/null); then
        owner=${out%%: *}
        break
      fi
    done
    if [ -z "$owner" ]; then
      echo "runtime-packages: no package owns $path (needed by $bin)" >&2
      status=1
      continue
    fi
    owner=${owner%%:*}        # drop the ":amd64" architecture qualifier
    owner=${owner%%,*}        # a path shared by several packages: the first is enough
    case "$owner" in
      libc6|libstdc++6|libgcc-s1) continue ;;
    esac
    packages[$owner]=1
  done < <(ldd "$bin")
done
if [ $status -ne 0 ]; then exit $status; fi
printf '%s\n' "${!packages[@]}" | sort
