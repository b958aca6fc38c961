"""What a model is before anything runs it: the artifact manifest and the verified files on disk (`source`), the
input side's spec and transform (`preprocess`), tensor specs, an ONNX model's declared inputs, a built engine's
sidecar, the shadow policy a manifest may carry. The floor of the engines: the backends, the postprocessors, the
runtime and the build all read these descriptions, so they import only the kernel."""
