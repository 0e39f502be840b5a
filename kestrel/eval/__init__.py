"""Evaluation harnesses that talk to a running server over its OpenAI API (`gsm8k.py`; `kestrel eval`)."""
