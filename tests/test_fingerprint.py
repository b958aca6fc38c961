"""Device fingerprint against recorded board trees (tests/data/boards/*/SOURCES.md says where each file is from)."""

from __future__ import annotations

import importlib.util
import json
import logging
from pathlib import Path

import onnxruntime
import pytest

from engines.device import fingerprint
from engines.device.fingerprint import (
    CudaInfo,
    DeviceFingerprint,
    _cuda_call,
    _cuda_version,
    backend_digest,
    fingerprint_for_backend,
    loaded_cudart_version,
    parse_cpuinfo,
    parse_l4t_release,
    query_cuda,
    read_cpu_isa,
    read_fingerprint,
    read_l4t_release,
    read_module,
    read_module_sku,
    read_soc,
)

BOARDS = Path(__file__).parent / "data" / "boards"

# board: (module, soc, l4t, cpu_arch, cpu_isa)
EXPECTED = {
    "orin-nano": ("NVIDIA Jetson Orin Nano Engineering Reference Developer Kit Super", "tegra234", "36.4.7",
                  None, None),
    "agx-orin": ("NVIDIA Jetson AGX Orin Developer Kit", "tegra234", "36.4.4", "aarch64",
                 ("asimd", "asimdhp", "asimddp")),
    "orin-nx": ("NVIDIA Orin NX Developer Kit", None, "35.3.1", None, None),
    "xavier-nx": ("NVIDIA Jetson Xavier NX Developer Kit", "tegra194", "35.3.1", "aarch64", ("asimd", "asimdhp")),
    "nano": ("NVIDIA Jetson Nano Developer Kit", None, "32.3.1", "aarch64", ("asimd",)),
    "thor": ("NVIDIA Jetson AGX Thor Developer Kit", "tegra264", "38.4.0", "aarch64",
             ("asimd", "asimdhp", "asimddp", "i8mm", "bf16", "sve", "sve2")),
    "x86-core-ultra-9-285": (None, None, None, "x86_64", ("avx2", "fma", "avx_vnni")),
    "x86-xeon-6972p": (None, None, None, "x86_64",
                       ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx512_fp16",
                        "avx_vnni", "amx_tile", "amx_int8", "amx_bf16")),
}


@pytest.mark.parametrize("board", sorted(EXPECTED))
def test_board_identity(board: str) -> None:
    module, soc, l4t, arch, isa = EXPECTED[board]
    root = BOARDS / board
    assert read_module(root) == module
    assert read_soc(root) == soc
    assert read_l4t_release(root) == l4t
    assert read_cpu_isa(root) == (arch, isa)


def test_every_board_tree_documents_its_sources() -> None:
    for tree in BOARDS.iterdir():
        assert (tree / "SOURCES.md").is_file(), tree.name
    assert set(EXPECTED) == {p.name for p in BOARDS.iterdir()}


def test_model_falls_back_to_sys_firmware_and_strips_nul(tmp_path: Path) -> None:
    # xavier-nx holds the model only under /sys/firmware/devicetree/base, as jtop --error-log recorded it
    assert (BOARDS / "xavier-nx/sys/firmware/devicetree/base/model").read_bytes().endswith(b"\0")
    assert not (BOARDS / "xavier-nx/proc/device-tree").exists()
    (tmp_path / "proc/device-tree").mkdir(parents=True)
    (tmp_path / "proc/device-tree/model").write_bytes(b"jetson-nano\0")
    (tmp_path / "sys/firmware/devicetree/base").mkdir(parents=True)
    (tmp_path / "sys/firmware/devicetree/base/model").write_bytes(b"other\0")
    assert read_module(tmp_path) == "jetson-nano"


@pytest.mark.parametrize(
    ("text", "version"),
    [
        ("# R32 (release), REVISION: 5.1, "
         "GCID: 26202423, BOARD: t210ref, EABI: aarch64, DATE: Fri Feb 19 16:45:52 UTC 2021",
         "32.5.1"),
        ("# R35 (release), REVISION: 3.1, "
         "GCID: 32827747, BOARD: t186ref, EABI: aarch64, DATE: Sun Mar 19 15:19:21 UTC 2023",
         "35.3.1"),
        ("# R39 (release), REVISION: 2.0, "
         "GCID: 45755727, BOARD: generic, EABI: aarch64, DATE: Mon Jun  1 09:28:48 PM UTC 2026",
         "39.2.0"),
        ("# R34 (release), REVISION: 1.2, "
         "GCID: 32090851, BOARD: t186ref, EABI: aarch64, DATE: Thu Dec  8 18:51:28 UTC 2022",
         "34.1.2"),
        ("not a release file", None),
        ("// R36 (release), REVISION: 4.4, GCID: 41062509", None),  # the Go-comment form is not the file
        ("", None),
    ],
)
def test_parse_l4t_release(text: str, version: str | None) -> None:
    assert parse_l4t_release(text) == version


def test_multiline_r36_release_takes_the_first_line() -> None:
    text = (BOARDS / "agx-orin/etc/nv_tegra_release").read_text()
    assert len(text.splitlines()) == 4 and "TARGET_USERSPACE_LIB_DIR=nvidia" in text
    assert parse_l4t_release(text) == "36.4.4"


def test_cpu_isa_is_what_every_core_has() -> None:
    # big.LITTLE: a kernel scheduled on the little core must not use the big core's i8mm
    text = "processor : 0\nFeatures : fp asimd asimddp i8mm\n\nprocessor : 1\nFeatures : fp asimd asimddp\n"
    assert parse_cpuinfo(text) == ("aarch64", ("asimd", "asimddp"))
    assert parse_cpuinfo("flags : sse avx2 avx512vnni\n") == ("x86_64", ("avx2", "avx512_vnni"))
    assert parse_cpuinfo("no cpu lines here") == (None, None)


def test_absent_parts_are_none(tmp_path: Path) -> None:
    fp = read_fingerprint(tmp_path)
    assert (fp.module, fp.soc, fp.l4t, fp.cpu_arch, fp.cpu_isa) == (None, None, None, None, None)


def test_read_fingerprint_on_a_board_tree_uses_this_interpreter_for_libraries() -> None:
    fp = read_fingerprint(BOARDS / "thor")
    assert (fp.module, fp.soc, fp.l4t) == ("NVIDIA Jetson AGX Thor Developer Kit", "tegra264", "38.4.0")
    assert fp.onnxruntime == onnxruntime.__version__
    assert fp.ort_providers is not None and "CPUExecutionProvider" in fp.ort_providers
    if importlib.util.find_spec("tensorrt") is None:
        assert fp.tensorrt is None
    if importlib.util.find_spec("cuda") is None:
        assert (fp.cuda_runtime, fp.cuda_driver, fp.gpu_name, fp.compute_capability) == (None, None, None, None)


def test_query_cuda_without_cuda_python_raises_import_error() -> None:
    if importlib.util.find_spec("cuda") is not None:
        pytest.skip("cuda-python is installed here; the device check covers it")
    with pytest.raises(ImportError):
        query_cuda()


def test_cuda_version_decoding() -> None:
    assert _cuda_version(12060) == "12.6"
    assert _cuda_version(13000) == "13.0"
    assert _cuda_version(11040) == "11.4"
    assert _cuda_version(0) is None  # cudaDriverGetVersion reports 0 when no driver is installed
    assert _cuda_version(None) is None


def test_failed_cuda_call_is_logged_and_gives_none(caplog: pytest.LogCaptureFixture) -> None:
    # cuda-python returns (error, value); these stand-ins return what a machine without a driver returns
    with caplog.at_level(logging.WARNING, logger="engines.device.fingerprint"):
        assert _cuda_call("cudaGetDeviceCount", 0, lambda: (35, 0)) is None
        assert _cuda_call("cudaGetDeviceCount", 0, lambda: (0, 1)) == 1
    assert "cudaGetDeviceCount failed: 35" in caplog.text


def _fp(**changes: object) -> DeviceFingerprint:
    base = dict(module="NVIDIA Jetson AGX Orin Developer Kit", soc="tegra234", l4t="36.4.4", tensorrt="10.3.0",
                cuda_runtime="12.6", cuda_driver="12.6", gpu_name="Orin", compute_capability="8.7",
                onnxruntime="1.20.1", ort_providers=("CPUExecutionProvider",), cpu_arch="aarch64",
                cpu_isa=("asimd", "asimdhp", "asimddp"), module_sku="p3701-0005", sm_count=16, gpu_memory_gib=61)
    base.update(changes)
    return DeviceFingerprint(**base)


def test_digest_is_stable_and_canonical() -> None:
    fp = _fp()
    canonical = json.dumps(fp.to_dict(), sort_keys=True, separators=(",", ":"))
    assert '"cpu_isa":["asimd","asimdhp","asimddp"]' in canonical
    assert fp.digest() == _fp().digest()
    # golden value: a change of the canonical form would silently invalidate every cached engine
    # (changed once, on purpose, when module_sku/sm_count/gpu_memory_gib joined: TensorRT plans rebuild once)
    assert fp.digest() == "0afb31c21f835fb9720f6f5051bbca2ec68d654ce36cb97d1eafcbdb1a49a2b3"
    assert _fp(l4t="36.4.7").digest() != fp.digest()


def test_backend_subsets() -> None:
    fp = _fp()
    assert fingerprint_for_backend(fp, "onnxruntime") == {
        "onnxruntime": "1.20.1", "ort_providers": ["CPUExecutionProvider"], "cpu_arch": "aarch64",
        "cpu_isa": ["asimd", "asimdhp", "asimddp"], "module": "NVIDIA Jetson AGX Orin Developer Kit"}
    assert fingerprint_for_backend(fp, "tensorrt") == {
        "tensorrt": "10.3.0", "cuda_runtime": "12.6", "compute_capability": "8.7", "gpu_name": "Orin",
        "module": "NVIDIA Jetson AGX Orin Developer Kit", "soc": "tegra234", "l4t": "36.4.4",
        "module_sku": "p3701-0005", "sm_count": 16, "gpu_memory_gib": 61}
    with pytest.raises(ValueError, match="unknown backend 'tflite'"):
        fingerprint_for_backend(fp, "tflite")


def test_backend_digest_changes_only_with_parts_that_matter() -> None:
    fp = _fp()
    new_trt = _fp(tensorrt="10.7.0")
    assert backend_digest(new_trt, "tensorrt") != backend_digest(fp, "tensorrt")
    assert backend_digest(new_trt, "onnxruntime") == backend_digest(fp, "onnxruntime")
    new_driver = _fp(cuda_driver="12.8")  # a newer driver runs the same plan
    assert backend_digest(new_driver, "tensorrt") == backend_digest(fp, "tensorrt")
    assert backend_digest(_fp(cpu_isa=("asimd",)), "onnxruntime") != backend_digest(fp, "onnxruntime")


# --- issue 9: module SKU, SM count, memory; the CUDA runtime TensorRT really loaded ----------------


@pytest.mark.parametrize(("board", "sku"), [("agx-orin", "p3701-0005"), ("orin-nano", "p3767-0005"),
                                            ("thor", "p3834-0008"), ("nano", None), ("x86-xeon-6972p", None)])
def test_module_sku_is_the_module_entry_of_compatible(board: str, sku: str | None) -> None:
    # orin-nano's first entry is carrier+module ("nvidia,p3768-0000+p3767-0005-super"): the module's own one wins
    assert read_module_sku(BOARDS / board) == sku


def test_two_skus_sharing_a_model_string_do_not_share_a_plan() -> None:
    nano_8gb, nano_4gb = _fp(module_sku="p3767-0005"), _fp(module_sku="p3767-0004", sm_count=8, gpu_memory_gib=3)
    assert nano_8gb.module == nano_4gb.module
    assert backend_digest(nano_8gb, "tensorrt") != backend_digest(nano_4gb, "tensorrt")
    assert backend_digest(_fp(sm_count=8), "tensorrt") != backend_digest(_fp(), "tensorrt")
    assert backend_digest(_fp(gpu_memory_gib=30), "tensorrt") != backend_digest(_fp(), "tensorrt")
    assert backend_digest(nano_8gb, "onnxruntime") == backend_digest(nano_4gb, "onnxruntime")


def _maps(tmp_path: Path, *libs: str) -> Path:
    path = tmp_path / "maps"
    path.write_text("".join(f"ffff{i:04x}000-ffff{i:04x}fff r-xp 00000000 b3:01 {i} {lib}\n"
                            for i, lib in enumerate(libs)))
    return path


def test_cuda_runtime_is_the_libcudart_tensorrt_loaded_not_cuda_pythons(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fingerprint, "_tensorrt_version", lambda: "10.3.0")
    # cuda-python 13 reports the CUDA it was compiled for; TensorRT runs on JetPack's libcudart 12.6
    monkeypatch.setattr(fingerprint, "query_cuda", lambda: CudaInfo("13.0", "12.6", "Orin", "8.7", 16, 64_339_000_000))
    maps = _maps(tmp_path, "/usr/lib/aarch64-linux-gnu/libnvinfer.so.10.3.0",
                 "/usr/local/cuda-12.6/targets/aarch64-linux/lib/libcudart.so.12.6.68")
    fp = read_fingerprint(BOARDS / "agx-orin", maps)
    assert (fp.tensorrt, fp.cuda_runtime, fp.cuda_driver) == ("10.3.0", "12.6", "12.6")
    assert (fp.module_sku, fp.sm_count, fp.gpu_memory_gib) == ("p3701-0005", 16, 60)


def test_loaded_cudart_version_is_none_when_unknown_or_ambiguous(tmp_path: Path) -> None:
    assert loaded_cudart_version(tmp_path / "absent") is None
    assert loaded_cudart_version(_maps(tmp_path, "/usr/lib/libc.so.6")) is None
    two = _maps(tmp_path, "/a/libcudart.so.12.6.68", "/b/libcudart.so.13.0.48")
    assert loaded_cudart_version(two) is None  # two runtimes in one process: say nothing rather than guess
    assert loaded_cudart_version(_maps(tmp_path, "/site-packages/nvidia/cuda_runtime/lib/libcudart.so.12")) is None
