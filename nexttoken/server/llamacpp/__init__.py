"""llama.cpp's server wire format, for the endpoints clients of llama.cpp call (/infill)."""
