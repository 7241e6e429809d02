"""The carry list (`gpu_carry.txt`): the wheels a GPU machine without network needs for
gpu_check.py, with their sizes and digests; `fetch` downloads them and checks each file.

    python3 benchmarks/gpu_carry.py fetch [--dest .gpu-wheels]   # on a machine with an index
    python3 benchmarks/gpu_carry.py total
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CARRY_LIST = ROOT / "benchmarks" / "gpu_carry.txt"
DEFAULT_DEST = ROOT / ".gpu-wheels"
# What a GPU session may carry along in all.
LIMIT_BYTES = 64 << 20
# The GPU image's interpreter and platform (pip download's target flags).
TARGET = ["--python-version", "3.12", "--implementation", "cp",
          "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64",
          "--platform", "manylinux2014_x86_64"]


@dataclass(frozen=True)
class CarriedWheel:
    requirement: str  # name==version
    filename: str
    num_bytes: int
    sha256: str


def read_carry_list(path: Path = CARRY_LIST) -> list[CarriedWheel]:
    wheels = []
    for line in path.read_text(encoding="utf-8").splitlines():
        fields = line.split("#", 1)[0].split()
        if fields:
            requirement, filename, num_bytes, sha256 = fields
            wheels.append(CarriedWheel(requirement, filename, int(num_bytes), sha256))
    return wheels


def total_bytes(wheels: list[CarriedWheel]) -> int:
    return sum(w.num_bytes for w in wheels)


def file_problem(wheel: CarriedWheel, path: Path) -> str | None:
    """Why ``path`` is not the listed wheel, or None."""
    if not path.exists():
        return f"{path.name} is missing"
    data = path.read_bytes()
    if len(data) != wheel.num_bytes or hashlib.sha256(data).hexdigest() != wheel.sha256:
        return f"{path.name}: {len(data)} bytes, not the listed {wheel.num_bytes} and digest"
    return None


def fetch(dest: Path) -> int:
    """Download every listed wheel for the GPU image's platform into ``dest``; check each."""
    wheels = read_carry_list()
    dest.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                    "--only-binary=:all:", *TARGET, "-d", str(dest),
                    *(w.requirement for w in wheels)], check=True)
    problems = [p for w in wheels if (p := file_problem(w, dest / w.filename))]
    for problem in problems:
        print(f"gpu_carry: {problem}")
    print(f"gpu_carry: {len(wheels)} wheels, {total_bytes(wheels) / 2**20:.1f} MiB "
          f"(limit {LIMIT_BYTES / 2**20:.0f} MiB) in {dest}")
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("action", choices=["fetch", "total"])
    parser.add_argument("--dest", type=Path, default=DEFAULT_DEST)
    args = parser.parse_args(argv)
    if args.action == "fetch":
        return fetch(args.dest)
    wheels = read_carry_list()
    print(f"{total_bytes(wheels)} bytes ({total_bytes(wheels) / 2**20:.1f} MiB) in "
          f"{len(wheels)} wheels; limit {LIMIT_BYTES / 2**20:.0f} MiB")
    return 0 if total_bytes(wheels) <= LIMIT_BYTES else 1


if __name__ == "__main__":
    sys.exit(main())
