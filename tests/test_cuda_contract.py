"""One contract for every CUDA memory implementation (cuda-python, pycuda), run wherever each one works.

Implementations that do not import or reach a GPU here are skipped with the reason. The recording
stand-in from tests/fake_nvidia.py runs the same contract on every machine, which keeps this suite
itself exercised where no GPU is available.
"""

from __future__ import annotations

import numpy as np
import pytest

from engines import cuda_mem
from engines.cuda_mem import CudaError
from tests.fake_nvidia import FakeCudaMemory

IMPLEMENTATIONS = (*cuda_mem.IMPLEMENTATIONS, "fake")


@pytest.fixture(scope="module", params=IMPLEMENTATIONS)
def cuda(request: pytest.FixtureRequest):
    if request.param == "fake":
        impl = FakeCudaMemory()
    else:
        try:
            impl = cuda_mem.open_cuda_memory(request.param)
        except CudaError as exc:
            pytest.skip(f"{request.param} unavailable here: {exc}")
    yield impl
    impl.close()


@pytest.fixture
def stream(cuda):
    s = cuda.create_stream()
    yield s
    cuda.destroy_stream(s)


def test_reports_device_memory(cuda) -> None:
    free, total = cuda.mem_get_info()
    assert 0 < free <= total


@pytest.mark.parametrize("shape,dtype", [((1, 3, 8, 8), np.float32), ((17,), np.uint8), ((2, 5), np.float16), ((0,), np.float32)])
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


def test_captured_graph_replays_with_current_inputs(cuda, stream) -> None:
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
