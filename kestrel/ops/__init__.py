"""Plain-torch maths of the model's ops, written once: the spec that both the reference model
(`models/kimi/reference.py`) and the catalog entries' `reference` call. Any device, fp32 math, no kestrel imports
(a leaf: torch only), no Triton."""
