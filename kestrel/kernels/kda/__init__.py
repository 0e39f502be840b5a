"""KDA (Kimi Delta Attention) kernels: short causal conv, gates, recurrent decode / verify, chunked prefill.

Triton kernels and their launch helpers; the plain-torch forms they are checked against (the token recurrence,
the gates, the conv, and the chunked torch path) are in `kestrel/ops/kda.py`, shared with the reference model."""
