"""Speculative decoding: proposers (n-gram prompt lookup, the DSpark drafter), acceptance, and the policy that
decides per step whether speculation pays. `proposer.py` is the interface the runtime calls."""
