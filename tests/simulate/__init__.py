"""Simulate mode of the device check: scripts/device_check.py run end to end against the stand-ins.

`bash scripts/device-check.sh --simulate 10.3.0` (tests/simulate/run.py) runs every check of the device check,
in a Python that has the device install, while every process it starts (pytest, `engines doctor`, build workers,
benchmarks, the shadow candidate's process) imports the same stand-ins at interpreter start
(tests/simulate/site/sitecustomize.py, switched on by DEVICE_CHECK_SIMULATE):

- `tensorrt`: tests/fake_nvidia.py's module of one release (its API table), with an ONNX-Runtime-backed builder,
  runtime, engine and context (tests/simulate/tensorrt_ort.py): the API and control flow are the stand-in's, the
  numbers come from ONNX Runtime running the ONNX file TensorRT was handed;
- `cuda.bindings.runtime` / `cuda.cudart` (and `pycuda.driver` where a release says so): tests/fake_cuda_releases.py's
  module of one cuda-python release, host memory posing as the GPU of a device profile (tests/simulate/cuda_sim.py);
- `pynvml`: NVML as the device profile has it (absent on a JetPack 6 Orin, recorded values of an H200);
- `trtexec`: tests/simulate/bin/trtexec, which prints a recorded performance summary;
- device files: the check's `--root` points at a recorded board tree (tests/data/boards) or tests/simulate/roots.

The report says `"simulated"` at its top and is named `simulated-...json`; it is never evidence about hardware.
tests/test_device_simulate.py runs each release (tests/simulate/releases.py) in a venv installed exactly as
docs/device-reports/README.md says (tests/simulate/venv.py), and one run with a fault in the stand-ins (a graph capture
that records nothing), which must fail. `make device-simulate` runs the releases by hand.
"""
