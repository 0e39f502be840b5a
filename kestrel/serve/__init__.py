"""Serving: the OpenAI-compatible HTTP API (`api.py`), its wire format (`protocol.py`), Prometheus metrics
(`metrics.py`) and the `kestrel serve` command (`cli.py`)."""
