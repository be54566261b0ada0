"""The generated protobuf/gRPC modules of rollout.v1, shipped inside the package.

They are generated when the package is built (setup.py's build step runs protoc on
proto/rollout/v1/rollout.proto into rollout_client/_gen/), never at import: importing needs no
protoc, writes nothing and works from a read-only install anywhere. The one absolute import
protoc writes into the gRPC module (``from rollout.v1 import rollout_pb2``) is made relative
at build time, so nothing named ``rollout`` is put on sys.path.
"""

from __future__ import annotations

_INSTALL_HINT = ("install the package with pip, which generates them, e.g. into a venv: "
                 "/usr/bin/python3 -m venv --system-site-packages VENV && VENV/bin/pip install "
                 "--no-build-isolation ./client/python (from the repository root; the build needs "
                 "protoc and grpc_python_plugin, Debian: protobuf-compiler "
                 "protobuf-compiler-grpc, or grpcio-tools)")


def load():
    """Returns (rollout_pb2, rollout_pb2_grpc); ImportError saying what to do if they are
    missing or do not load."""
    try:
        import grpc  # noqa: F401
        import google.protobuf  # noqa: F401
    except ImportError as e:
        raise ImportError(f"rollout_client needs grpcio and protobuf ({e}); Debian: apt-get "
                          "install python3-grpcio python3-protobuf, or pip install grpcio "
                          "protobuf") from None
    try:
        from ._gen import rollout_pb2, rollout_pb2_grpc
    except ModuleNotFoundError:
        raise ImportError("rollout_client: its generated gRPC modules (rollout_client._gen) "
                          f"are missing; {_INSTALL_HINT}") from None
    except Exception as e:  # e.g. generated code newer than the protobuf runtime
        raise ImportError(f"rollout_client: its generated gRPC modules do not load with this "
                          f"protobuf/grpcio ({type(e).__name__}: {e}); rebuild the package "
                          f"against them: {_INSTALL_HINT}") from None
    return rollout_pb2, rollout_pb2_grpc
