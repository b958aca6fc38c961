"""The TensorRT extras install parts that can run together: the TensorRT wheel and the CUDA binding of
one extra are built for the same CUDA major (a CUDA 13 TensorRT beside a CUDA 12 binding needs a driver
that the binding's pin says is not there).

Why the bare `tensorrt` name is refused: it is a meta package whose target moves. On Linux,
`tensorrt` 10.12.0.36 and 10.13.0.35 require `tensorrt_cu12`, 10.13.2.6 and 10.13.3.9 require
`tensorrt_cu13` (their sdists' PKG-INFO, `pip download --no-deps`; NVIDIA/TensorRT#4614), so
`tensorrt>=8.6` resolves to a wheel that needs a CUDA 13 driver.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10
    import tomli as tomllib

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"
TRT_CU = re.compile(r"^tensorrt-cu(\d+)$")
CUDA_MAJORS = range(10, 20)


def extras() -> dict[str, list[Requirement]]:
    """Every optional-dependency group of pyproject.toml, parsed."""
    data = tomllib.loads(PYPROJECT.read_text())
    return {name: [Requirement(r) for r in reqs] for name, reqs in data["project"]["optional-dependencies"].items()}


def cuda_python_majors(req: Requirement) -> set[int]:
    """The CUDA majors a cuda-python specifier admits (a release of each major is probed at minors 0-9)."""
    return {m for m in CUDA_MAJORS if any(req.specifier.contains(f"{m}.{minor}.0") for minor in range(10))}


def cuda_majors(reqs: list[Requirement]) -> dict[str, set[int]]:
    """{"tensorrt": {12}, "cuda-python": {12}} for one extra; only the parts it has."""
    found: dict[str, set[int]] = {}
    for req in reqs:
        name = canonicalize_name(req.name)
        if match := TRT_CU.match(name):
            found.setdefault("tensorrt", set()).add(int(match.group(1)))
        elif name == "cuda-python":
            found["cuda-python"] = cuda_python_majors(req)
    return found


@pytest.mark.parametrize("extra", sorted(extras()))
def test_extra_never_names_the_moving_tensorrt_meta_package(extra: str) -> None:
    names = [canonicalize_name(r.name) for r in extras()[extra]]
    assert "tensorrt" not in names, (f"[{extra}] depends on `tensorrt`, which pip resolves to tensorrt_cu13 "
                                     "(CUDA 13 driver) since 10.13.2; name tensorrt-cu12 or tensorrt-cu13")


@pytest.mark.parametrize("extra", sorted(extras()))
def test_tensorrt_and_cuda_binding_agree_on_the_cuda_major(extra: str) -> None:
    majors = cuda_majors(extras()[extra])
    if "cuda-python" in majors:
        assert len(majors["cuda-python"]) == 1, f"[{extra}] cuda-python spans CUDA {sorted(majors['cuda-python'])}"
    if "tensorrt" in majors:
        assert "cuda-python" in majors, f"[{extra}] has TensorRT but no CUDA binding to move tensors with"
        assert majors["tensorrt"] == majors["cuda-python"], f"[{extra}] CUDA majors differ: {majors}"


def test_the_tensorrt_extra_is_a_cuda_12_pair() -> None:
    # docs/engines.md promises the x86-64 extra on a 12.x driver (tensorrt-cu12 starts at 10.0.1)
    assert cuda_majors(extras()["tensorrt"]) == {"tensorrt": {12}, "cuda-python": {12}}


DATA = Path(__file__).resolve().parent / "data"


def newest_table(directory: str) -> Version:
    """The newest release we hold an API table for (file stems `11.1.0`, `cuda-bindings-13.5.0`)."""
    return max(Version(p.stem.rsplit("-", 1)[-1]) for p in (DATA / directory).glob("*.json"))


def admitted(req: Requirement, majors: range) -> list[Version]:
    """Releases (every major.minor.0 of `majors`, minors 0-30) the requirement lets pip install."""
    return [Version(f"{m}.{n}.0") for m in majors for n in range(31) if req.specifier.contains(f"{m}.{n}.0")]


@pytest.mark.parametrize("extra", sorted(extras()))
def test_every_nvidia_pin_stops_at_the_newest_release_with_an_api_table(extra: str) -> None:
    tables = {"tensorrt": newest_table("tensorrt_api"), "cuda-python": newest_table("cuda_api")}
    for req in extras()[extra]:
        name = canonicalize_name(req.name)
        kind = "tensorrt" if TRT_CU.match(name) else name if name in tables else None
        if kind is None:
            continue
        newest = tables[kind]
        beyond = [v for v in admitted(req, range(8, 20)) if (v.major, v.minor) > (newest.major, newest.minor)]
        assert not beyond, (f"[{extra}] {req} admits {beyond[0]}, newer than the newest {kind} API table ({newest}): "
                            "cap the pin, or add that release's table (scripts/extract_*_api.py)")


def test_the_major_probe_reads_specifiers() -> None:
    assert cuda_python_majors(Requirement("cuda-python>=12.0,<13")) == {12}
    assert cuda_python_majors(Requirement("cuda-python>=12.6,<12.7")) == {12}
    assert cuda_python_majors(Requirement("cuda-python>=12.0")) == set(range(12, 20))
    assert cuda_majors([Requirement("tensorrt-cu13>=10.13"), Requirement("cuda_python<13")]) == \
        {"tensorrt": {13}, "cuda-python": set(range(10, 13))}
