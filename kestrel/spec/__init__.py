"""Speculative decoding: proposers (n-gram prompt lookup, the DSpark drafter), acceptance, and the policy that
decides per step whether speculation pays. `proposer.py` is the interface the runtime calls."""

from __future__ import annotations


def make_proposer(spec, target_config, device, dtype):
    """The proposer a SpeculativeConfig names: n-gram lookup, or the DSpark drafter loaded from `spec.model`."""
    if spec.method == "ngram":
        from kestrel.spec.ngram import NgramProposer
        return NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_max, spec.prompt_lookup_min)
    from kestrel.spec.dspark import load_dspark_proposer       # imported only when asked for
    return load_dspark_proposer(spec.model, target_config, device, dtype, spec.num_speculative_tokens)
