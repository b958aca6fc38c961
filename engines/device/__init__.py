"""This device as the engines see it: its fingerprint (what makes a built engine non-portable) and whether TensorRT
really runs here (`readiness`). Apart from the tools so that `auto` backend selection and `engines doctor` share
the same checks while the runtime never imports a tool."""
