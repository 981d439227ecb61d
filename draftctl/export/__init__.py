"""Export trained controllers (ONNX)."""
