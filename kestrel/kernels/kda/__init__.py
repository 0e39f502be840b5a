"""KDA (Kimi Delta Attention) kernels: short causal conv, gates, recurrent decode / verify, chunked prefill.

Triton kernels and their launch helpers; `reference.py` holds the plain-torch forms (the naive token recurrence
and the chunked torch path the CPU reference model uses)."""
