"""The TensorRT extras install parts that can run together: the TensorRT wheel and the CUDA binding of
one extra are built for the same CUDA major (a CUDA 13 TensorRT beside a CUDA 12 binding needs a driver
that the binding's pin says is not there).

Why the bare `tensorrt` name is refused: it is a meta package whose target moves. On Linux,
`tensorrt` 10.12.0.36 and 10.13.0.35 require `tensorrt_cu12`, 10.13.2.6 and 10.13.3.9 require
`tensorrt_cu13` (their sdists' PKG-INFO, `pip download --no-deps`; NVIDIA/TensorRT#4614), so
`tensorrt>=8.6` resolves to a wheel that needs a CUDA 13 driver.

Every NVIDIA-side dependency stops at a release we model (an API table under tests/data, or the release a
telemetry source's stand-in was written against), and a CUDA binding pin admits only minor lines that have a
table of their own: `cuda-python>=13.0,<13.6` once resolved to cuda-python 13.4.4 (cuda-bindings 13.4.4)
while the only 13.x table was cuda-bindings 13.5.0.
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
PROJECT = canonicalize_name(tomllib.loads(PYPROJECT.read_text())["project"]["name"])  # jetson-edge-agent


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
CUDA_BINDINGS = frozenset({"cuda-python", "cuda-bindings"})  # cuda-python X.Y.Z requires cuda-bindings ~=X.Y.Z
NVIDIA_SIDE = re.compile(r"^(tensorrt(-cu\d+)?|cuda-python|cuda-bindings|pycuda|nvidia-.+|jetson-.+)$")
# Modelled releases that have no API table: the release each telemetry source's stand-in is written against.
MODELLED = {
    # tests/test_telemetry_sources.py `fake_pynvml`; every pynvml name agent/telemetry/nvml_source.py calls is
    # in the published nvidia-ml-py 13.615.71 wheel's pynvml.py.
    "nvidia-ml-py": Version("13.615.71"),
    # rbonghi/jetson_stats tags 4.2.12 to 7.2.0 (jtop/jtop.py, jtop/core/power.py ...: the jtop stand-in and
    # jtop_source.py) and the 7.2.2 sdist on PyPI (its jtop/core/power.py adds Thor's INA238 `VIN` total).
    "jetson-stats": Version("7.2.2"),
}


def newest_table(directory: str) -> Version:
    """The newest release we hold an API table for (file stems `11.1.0`, `cuda-bindings-13.5.0`)."""
    return max(Version(p.stem.rsplit("-", 1)[-1]) for p in (DATA / directory).glob("*.json"))


def table_lines(directory: str) -> set[tuple[int, int]]:
    """(major, minor) of every release we hold an API table for."""
    versions = (Version(p.stem.rsplit("-", 1)[-1]) for p in (DATA / directory).glob("*.json"))
    return {(v.major, v.minor) for v in versions}


def newest_modelled(name: str) -> Version | None:
    """The newest release of an NVIDIA-side package that we model; None when we model none."""
    if TRT_CU.match(name) or name == "tensorrt":
        return newest_table("tensorrt_api")
    if name in CUDA_BINDINGS:
        return newest_table("cuda_api")
    if name == "pycuda":
        return newest_table("pycuda_api")
    return MODELLED.get(name)


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


@pytest.mark.parametrize("extra", sorted(extras()))
def test_every_nvidia_side_dependency_is_capped_at_a_release_we_model(extra: str) -> None:
    for req in extras()[extra]:
        name = canonicalize_name(req.name)
        if not NVIDIA_SIDE.match(name) or name == PROJECT:  # jetson-edge-agent[fleet] is this project
            continue
        newest = newest_modelled(name)
        assert newest is not None, (f"[{extra}] {req}: no release of {name} is modelled here; add a stand-in or an "
                                    "API table (and MODELLED in tests/test_extras.py) before depending on it")
        beyond = [v for v in (f"{newest.major}.{newest.minor + 1}.0", f"{newest.major + 1}.0.0", "9999")
                  if req.specifier.contains(v)]
        assert not beyond, (f"[{extra}] {req} admits {beyond[0]}, past the newest {name} we model ({newest}): "
                            f"cap it, e.g. <{newest.major}.{newest.minor + 1}")


@pytest.mark.parametrize("extra", sorted(extras()))
def test_every_cuda_binding_line_a_pin_admits_has_an_api_table(extra: str) -> None:
    # pip keeps a binding that already satisfies the pin (a --system-site-packages venv on a device), so every
    # minor line the pin admits is one the agent may run on, not only the newest
    lines = table_lines("cuda_api")
    for req in extras()[extra]:
        if canonicalize_name(req.name) not in CUDA_BINDINGS:
            continue
        missing = [v for v in admitted(req, CUDA_MAJORS) if (v.major, v.minor) not in lines]
        shown = ", ".join(f"{v.major}.{v.minor}" for v in missing[:6]) + (" ..." if len(missing) > 6 else "")
        assert not missing, (f"[{extra}] {req} admits CUDA binding {shown} "
                             "with no API table in tests/data/cuda_api: narrow the pin to modelled lines, or add the "
                             "tables (scripts/extract_cuda_api.py)")


def test_the_rules_read_specifiers() -> None:
    assert {(13, 4), (13, 5)} <= table_lines("cuda_api")  # what jetpack7 admits
    assert newest_modelled("tensorrt-cu13") == newest_table("tensorrt_api")
    assert newest_modelled("onnxruntime-gpu") is None and not NVIDIA_SIDE.match("onnxruntime-gpu")
    assert (
        NVIDIA_SIDE.match("nvidia-ml-py") and NVIDIA_SIDE.match("jetson-stats") and NVIDIA_SIDE.match("tensorrt-cu12")
    )
    assert [str(v) for v in admitted(Requirement("cuda-python>=13.4,<13.6"), CUDA_MAJORS)] == ["13.4.0", "13.5.0"]
