"""The carry list (benchmarks/gpu_carry.txt): within the 64 MiB a GPU session may carry, every
wheel built for the GPU image's CPython 3.12 on x86_64 Linux, the README's figure its total, and
the downloaded files (when fetched) the ones listed.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from packaging.tags import Tag
from packaging.utils import canonicalize_name, parse_wheel_filename

from benchmarks.gpu_carry import (
    DEFAULT_DEST,
    LIMIT_BYTES,
    file_problem,
    read_carry_list,
    total_bytes,
)

ROOT = Path(__file__).resolve().parents[2]
WHEELS = read_carry_list()
# Tags the image's interpreter (CPython 3.12, glibc 2.28 or newer, x86_64) accepts, enough to
# cover the listed wheels' kinds: pure Python, abi3 from 3.11 and cp312 builds.
IMAGE_TAGS = {Tag(interpreter, abi, platform)
              for interpreter, abi in (("py3", "none"), ("cp311", "abi3"), ("cp312", "cp312"),
                                       ("cp312", "abi3"))
              for platform in ("any", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
                               "manylinux_2_24_x86_64", "manylinux_2_27_x86_64",
                               "manylinux_2_28_x86_64")}


def test_the_carry_list_fits_in_64_mib_and_the_readme_gives_its_total() -> None:
    total = total_bytes(WHEELS)
    assert 0 < total <= LIMIT_BYTES, f"{total / 2**20:.1f} MiB"
    readme = (ROOT / "README.md").read_text()
    assert f"{total / 2**20:.1f} MiB" in readme and f"{total:,} bytes" in readme


def test_every_wheel_is_its_requirement_built_for_the_gpu_image() -> None:
    names = set()
    for wheel in WHEELS:
        name, version, _, tags = parse_wheel_filename(wheel.filename)
        wanted_name, wanted_version = wheel.requirement.split("==")
        assert (name, str(version)) == (canonicalize_name(wanted_name), wanted_version), wheel
        assert tags & IMAGE_TAGS, f"{wheel.filename} does not install on CPython 3.12 x86_64"
        assert len(wheel.sha256) == 64 and wheel.num_bytes > 0
        names.add(name)
    # What gpu_check imports that the image lacks: the config schema and the handoff.
    assert {"pydantic", "pydantic-core", "ucxx-cu13", "libucx-cu13"} <= names


@pytest.mark.skipif(not DEFAULT_DEST.exists(), reason="no .gpu-wheels/ here "
                    "(python3 benchmarks/gpu_carry.py fetch downloads it)")
def test_fetched_wheels_are_the_listed_files() -> None:
    assert [p for w in WHEELS if (p := file_problem(w, DEFAULT_DEST / w.filename))] == []


def test_a_changed_file_is_named(tmp_path: Path) -> None:
    wheel = WHEELS[0]
    assert "missing" in (file_problem(wheel, tmp_path / wheel.filename) or "")
    (tmp_path / wheel.filename).write_bytes(b"x" * wheel.num_bytes)
    assert "not the listed" in (file_problem(wheel, tmp_path / wheel.filename) or "")
