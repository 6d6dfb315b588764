"""Build hook: generate the fence.v1 gRPC stubs from the proto with grpcio-tools.

The proto is the single source of truth (``proto/fence/v1/fence.proto`` at the repository
root). Nothing generated is committed: every build (wheel, editable install, sdist -> wheel)
runs ``grpc_tools.protoc`` here. The proto is found, in order, at:

1. ``$FENCE_PROTO_ROOT/fence/v1/fence.proto`` (explicit override);
2. ``<this dir>/proto/fence/v1/fence.proto`` (an sdist carries its own copy, see ``sdist``);
3. ``<this dir>/../../proto/fence/v1/fence.proto`` (building from the repository).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py as _build_py
from setuptools.command.sdist import sdist as _sdist

HERE = Path(__file__).resolve().parent
PROTO_REL = Path("fence") / "v1" / "fence.proto"
GENERATED = ("fence_pb2.py", "fence_pb2.pyi", "fence_pb2_grpc.py")


def proto_root() -> Path:
    """Returns the directory that contains ``fence/v1/fence.proto``."""
    candidates = []
    env = os.environ.get("FENCE_PROTO_ROOT")
    if env:
        candidates.append(Path(env))
    candidates += [HERE / "proto", HERE.parent.parent / "proto"]
    for root in candidates:
        if (root / PROTO_REL).is_file():
            return root.resolve()
    raise SystemExit(
        "fence-client build: cannot find fence/v1/fence.proto; looked under "
        + ", ".join(str(c) for c in candidates)
        + " (set FENCE_PROTO_ROOT to the directory holding fence/v1/fence.proto)"
    )


def generate(out_dir: Path) -> None:
    """Runs protoc (from grpcio-tools) on the proto, writing ``out_dir/fence/v1/*``."""
    # Imported here so that merely reading this file (e.g. by tooling) does not need grpcio-tools.
    import grpc_tools
    from grpc_tools import protoc

    root = proto_root()
    well_known = Path(grpc_tools.__file__).resolve().parent / "_proto"
    out_dir.mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"-I{root}",
        f"-I{well_known}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        str(root / PROTO_REL),
    ]
    code = protoc.main(args)
    if code != 0:
        raise SystemExit(f"fence-client build: protoc failed with exit code {code}")
    for name in GENERATED:
        if not (out_dir / "fence" / "v1" / name).is_file():
            raise SystemExit(f"fence-client build: protoc did not produce fence/v1/{name}")


class build_py(_build_py):
    """Copies the hand-written sources, then generates the stubs next to them."""

    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            # An editable install imports straight from src/: generate there (gitignored).
            generate(HERE / "src")
        else:
            generate(Path(self.build_lib))

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        outputs = list(super().get_outputs(include_bytecode))
        if not getattr(self, "editable_mode", False):
            base = Path(self.build_lib) / "fence" / "v1"
            outputs += [str(base / name) for name in GENERATED]
        return outputs


class sdist(_sdist):
    """Makes the sdist self-contained: it carries a copy of the proto under ``proto/``."""

    def make_release_tree(self, base_dir: str, files: list[str]) -> None:
        super().make_release_tree(base_dir, files)
        source = proto_root() / PROTO_REL
        target = Path(base_dir) / "proto" / PROTO_REL
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, target)


setup(cmdclass={"build_py": build_py, "sdist": sdist})
