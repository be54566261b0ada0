"""Where the trainer's ctypes libraries are found: $<env var>, else beside this package, else in
<repo>/build/lib (_lib.py's librollout_trainer_ops.so, cuda_ops.py's
librollout_trainer_cuda_ops.so).
"""

from __future__ import annotations

import os


def find_library(name: str, env_var: str, how_to_build: str) -> str:
    """The library's path. OSError naming every place looked at, and how to get it, otherwise."""
    env = os.environ.get(env_var)
    here = os.path.dirname(os.path.abspath(__file__))
    repo = os.path.dirname(os.path.dirname(os.path.dirname(here)))
    candidates = [env] if env else [os.path.join(here, name),
                                    os.path.join(repo, "build", "lib", name)]
    for path in candidates:
        if os.path.exists(path):
            return path
    raise OSError(f"{name} not found (looked at {', '.join(candidates)}); {how_to_build} or set "
                  f"{env_var} to its path")
