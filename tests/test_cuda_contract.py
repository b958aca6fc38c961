"""One contract for every CUDA memory implementation (cuda-python, pycuda), run wherever each one works.

Implementations that do not import or reach a GPU here are skipped with the reason. Everywhere, the
same contract also runs (a) on the recording stand-in FakeCudaMemory and (b) on the product's own
CudaPythonMemory over a stand-in runtime module per cuda-python release in tests/data/cuda_api/
(12.4 with only `cuda.cudart`, 12.9 with both import paths, 13.x with only `cuda.bindings.runtime`;
names and `(err, *values)` return shapes from the published wheels, host memory posing as the GPU).
"""

from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path

import numpy as np
import pytest

from engines import cuda as cuda_mem
from engines.cuda.cuda_python import CudaPythonMemory
from engines.cuda import CudaError
from tests.fake_cuda_releases import (
    PycudaTable,
    cuda_api_tables,
    fake_cuda_runtime,
    install_cuda_python,
    install_pycuda,
    load_cuda_api,
    pycuda_api_tables,
)
from tests.fake_nvidia import FakeCudaMemory

RELEASES = tuple(f"stand-in-{stem}" for stem in cuda_api_tables())  # CudaPythonMemory on a release's table
PYCUDA_RELEASES = tuple(f"stand-in-{stem}" for stem in pycuda_api_tables())  # PyCudaMemory on a release's table
IMPLEMENTATIONS = (*cuda_mem.IMPLEMENTATIONS, "fake", *RELEASES, *PYCUDA_RELEASES)


def _pycuda_memory(mp: pytest.MonkeyPatch, stem: str):
    """engines.cuda.pycuda_memory imported against release `stem`'s pycuda.driver stand-in."""
    install_pycuda(mp, stem)
    mp.delitem(sys.modules, "engines.cuda.pycuda_memory", raising=False)
    return importlib.import_module("engines.cuda.pycuda_memory").PyCudaMemory()


@pytest.fixture(scope="module", params=IMPLEMENTATIONS)
def cuda(request: pytest.FixtureRequest):
    with pytest.MonkeyPatch.context() as mp:
        if request.param == "fake":
            impl = FakeCudaMemory()
        elif request.param in RELEASES:
            install_cuda_python(mp, request.param.removeprefix("stand-in-"))
            impl = CudaPythonMemory()
        elif request.param in PYCUDA_RELEASES:
            impl = _pycuda_memory(mp, request.param.removeprefix("stand-in-"))
        else:
            try:
                impl = cuda_mem.open_cuda_memory(request.param)
            except CudaError as exc:
                pytest.skip(f"{request.param} unavailable here: {exc}")
        yield impl
        impl.close()
    if request.param in PYCUDA_RELEASES:
        sys.modules.pop("engines.cuda.pycuda_memory", None)  # bound to the stand-in: never reuse it


@pytest.fixture
def stream(cuda):
    s = cuda.create_stream()
    yield s
    cuda.destroy_stream(s)


def test_reports_device_memory(cuda) -> None:
    free, total = cuda.mem_get_info()
    assert 0 < free <= total


@pytest.mark.parametrize(
    "shape,dtype", [((1, 3, 8, 8), np.float32), ((17,), np.uint8), ((2, 5), np.float16), ((0,), np.float32)]
)
def test_round_trip_through_device_memory(cuda, stream, shape, dtype) -> None:
    src = cuda.pinned_empty(shape, dtype)
    dst = cuda.pinned_empty(shape, dtype)
    assert src.shape == shape and src.dtype == dtype and src.flags.c_contiguous and src.flags.writeable
    src[...] = (np.arange(src.size) % 251).reshape(shape).astype(dtype)
    dst[...] = 0
    buf = cuda.malloc(src.nbytes)
    assert buf.ptr and buf.nbytes == src.nbytes
    try:
        cuda.copy_htod_async(buf, src, stream)
        cuda.copy_dtoh_async(dst, buf, stream)
        cuda.synchronize(stream)
        np.testing.assert_array_equal(dst, src)
    finally:
        cuda.free(buf)
        cuda.free_pinned(src)
        cuda.free_pinned(dst)


def test_streams_have_raw_handles_for_tensorrt(cuda) -> None:
    a, b = cuda.create_stream(), cuda.create_stream()
    try:
        ha, hb = cuda.stream_handle(a), cuda.stream_handle(b)
        assert isinstance(ha, int) and ha != 0 and ha != hb  # 0 would be the legacy default stream
    finally:
        cuda.destroy_stream(a)
        cuda.destroy_stream(b)


def test_events_time_stream_work(cuda, stream) -> None:
    start, end = cuda.create_event(), cuda.create_event()
    host = cuda.pinned_empty((1 << 16,), np.float32)
    buf = cuda.malloc(host.nbytes)
    try:
        cuda.record_event(start, stream)
        cuda.copy_htod_async(buf, host, stream)
        cuda.record_event(end, stream)
        cuda.synchronize_event(end)
        assert cuda.elapsed_ms(start, end) >= 0.0
    finally:
        cuda.free(buf)
        cuda.free_pinned(host)
        cuda.destroy_event(start)
        cuda.destroy_event(end)


def test_an_impossible_allocation_is_a_cuda_error(cuda) -> None:
    with pytest.raises(CudaError):
        cuda.malloc(1 << 50)


def test_captured_graph_replays_with_current_inputs(cuda, stream, request: pytest.FixtureRequest) -> None:
    if not cuda.supports_graphs and request.node.callspec.params["cuda"] in PYCUDA_RELEASES:
        with pytest.raises(CudaError):  # no pycuda release has stream capture: refused, never half-done
            cuda.begin_capture(stream)
        return
    if not cuda.supports_graphs:
        pytest.skip(f"{cuda.name} has no stream capture")
    src, dst = cuda.pinned_empty((64,), np.float32), cuda.pinned_empty((64,), np.float32)
    buf = cuda.malloc(src.nbytes)
    src[:] = 1.0
    cuda.copy_htod_async(buf, src, stream)  # warm: first use outside capture
    cuda.synchronize(stream)
    cuda.begin_capture(stream)
    cuda.copy_htod_async(buf, src, stream)
    cuda.copy_dtoh_async(dst, buf, stream)
    graph = cuda.end_capture(stream)
    try:
        for value in (2.0, 3.0):
            src[:] = value
            dst[:] = 0
            cuda.launch_graph(graph, stream)
            cuda.synchronize(stream)
            np.testing.assert_array_equal(dst, np.full(64, value, np.float32))
    finally:
        cuda.destroy_graph(graph)
        cuda.free(buf)
        cuda.free_pinned(src)
        cuda.free_pinned(dst)


def test_availability_names_a_reason_for_every_missing_implementation() -> None:
    report = cuda_mem.availability()
    assert set(report) == set(cuda_mem.IMPLEMENTATIONS)
    assert all(reason is None or reason for reason in report.values())


# --- cuda-python releases: import paths and the names CudaPythonMemory calls ---------------------


@pytest.mark.parametrize("stem", cuda_api_tables())
def test_import_cudart_finds_each_releases_module(monkeypatch: pytest.MonkeyPatch, stem: str) -> None:
    rt = install_cuda_python(monkeypatch, stem)
    assert cuda_mem.import_cudart() is rt and cuda_mem.missing_bindings() is None


def test_the_tables_cover_the_import_path_change() -> None:
    """12.x before 12.6: only `cuda.cudart`; 12.6-12.9: both; 13.x: only `cuda.bindings.runtime`."""
    paths = {stem: load_cuda_api(stem)["import_paths"] for stem in cuda_api_tables()}
    assert any(p["cuda.cudart"] is True and p["cuda.bindings.runtime"] is not True for p in paths.values())
    assert any(p["cuda.cudart"] is not True and p["cuda.bindings.runtime"] is True for p in paths.values())


def _runtime_names_used() -> set[str]:
    """Every `self.rt.NAME` in engines/cuda/cuda_python.py (the product's use of cuda-python)."""
    tree = ast.parse(Path(cuda_mem.__file__).with_name("cuda_python.py").read_text())
    return {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Attribute)
            and n.value.attr == "rt"}


@pytest.mark.parametrize("stem", cuda_api_tables())
def test_cuda_mem_calls_only_what_each_release_has_or_feature_detects(stem: str) -> None:
    api = load_cuda_api(stem)
    names = _runtime_names_used()
    assert {"cudaMalloc", "cudaMemcpyAsync", "cudaGraphLaunch"} <= names
    guarded = {n.value for n in ast.walk(ast.parse(Path(cuda_mem.__file__).with_name("cuda_python.py").read_text()))
               if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    known = set(api["functions"]) | set(api["enums"]) | set(api["constants"])
    missing = sorted(n for n in names - known if n not in guarded)
    assert not missing, f"cuda-python {api['version']} lacks {missing}, used without a hasattr/getattr check"


@pytest.mark.parametrize("stem", cuda_api_tables())
def test_the_stand_in_runtime_has_exactly_the_releases_names(stem: str) -> None:
    api, rt = load_cuda_api(stem), fake_cuda_runtime(stem)
    public = {n for n in vars(rt) if not n.startswith("_")}
    assert public == set(api["functions"]) | set(api["enums"]) | set(api["constants"])


# --- pycuda releases: no stream capture anywhere, and the names PyCudaMemory calls ----------------


@pytest.mark.parametrize("stem", pycuda_api_tables())
def test_no_pycuda_release_has_stream_capture(stem: str) -> None:
    table = PycudaTable(stem).data
    assert table["stream_capture"] is False
    assert "begin_capture" not in table["classes"]["Stream"] and "Graph" not in table["classes"]


def _pycuda_names_used() -> set[str]:
    """Every `cuda.NAME` in engines/cuda/pycuda_memory.py (`import pycuda.driver as cuda`)."""
    path = Path(cuda_mem.__file__).with_name("pycuda_memory.py")
    tree = ast.parse(path.read_text())
    return {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
            and n.value.id == "cuda"}


@pytest.mark.parametrize("stem", pycuda_api_tables())
def test_cuda_mem_pycuda_calls_only_what_each_release_has(stem: str) -> None:
    table = PycudaTable(stem).data
    known = set(table["functions"]) | set(table["classes"]) | set(table["enums"]) | set(table["exceptions"])
    used = _pycuda_names_used()
    assert {"mem_alloc", "memcpy_htod_async", "Stream"} <= used
    assert not used - known, f"pycuda {table['version']} lacks {sorted(used - known)}"


def test_what_cuda_mem_calls_has_one_signature_in_every_release() -> None:
    """The releases the pins resolve to (12.2.1 for JetPack 6.0, 12.6.2.post1 for 6.1/6.2, 12.9 and 13.4.4 for the
    x86-64 and JetPack 7 extras, plus 12.4 and 13.5) split in two implementations: up to 12.8 the runtime module is
    reimplemented on the driver API, from 12.9 it links a static cudart. For every name engines/cuda/base.py
    calls, the parameters and the documented return values are the same in all of them; the one difference
    it meets is the import path (test_the_tables_cover_the_import_path_change)."""
    stems = cuda_api_tables()
    assert {"cuda-python-12.2.1", "cuda-python-12.6.2.post1", "cuda-bindings-13.4.4"} <= set(stems)
    for name in sorted(_runtime_names_used()):
        seen = {}
        for stem in stems:
            api = load_cuda_api(stem)
            entry = api["functions"].get(name)
            kind = (
                "function"
                if entry
                else "enum"
                if name in api["enums"]
                else "constant"
                if name in api["constants"]
                else None
            )
            if kind is None:
                continue  # feature-detected where it is missing (the test above)
            seen[stem] = (
                kind,
                tuple(entry.get("params") or ()) if entry else (),
                tuple(entry.get("returns") or ()) if entry else (),
            )
        assert len(set(seen.values())) <= 1, f"{name} differs between releases: {seen}"
