"""A request whose step is cut into several segments (its prompt chunk split at prefix-snapshot boundaries) gives
the same logits as one segment, whatever the segment lengths: the reference runs one request's segments in order
(a one-token tail must not join the batched decode group ahead of the segment before it)."""

import pytest
import torch

from kestrel.config import ModelConfig
from kestrel.models.kimi import load_reference_model
from kestrel.models.kimi.checkpoint import make_checkpoint
from kestrel.models.kimi.step import CachePools, StepBatch


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("seg") / "k3")
    make_checkpoint("k3-tiny", path, seed=5, dtype=torch.float32, with_tokenizer=False)
    config = ModelConfig.from_dir(path)
    return config, load_reference_model(path, config, torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("cuts", [[16], [1], [16, 17], [5, 6, 16]])
def test_split_segments_equal_one_segment(model, cuts):
    config, m = model
    n = 18
    ids = torch.randint(0, config.vocab_size, (n,), generator=torch.Generator().manual_seed(1))

    def run(cu):
        pools = CachePools.allocate(config, 8, 16, 2, torch.float32, "cpu")
        segs = len(cu) - 1
        batch = StepBatch(ids, torch.arange(n), cu, cu[:-1], torch.zeros(segs, dtype=torch.long),
                          torch.arange(8, dtype=torch.int32).view(1, 8).expand(segs, 8).contiguous(),
                          torch.tensor([n - 1]))
        return m(batch, pools), pools

    whole, pools_a = run([0, n])
    split, pools_b = run([0] + cuts + [n])
    torch.testing.assert_close(split, whole, rtol=1e-5, atol=1e-5)
    for i in pools_a.recurrent:
        torch.testing.assert_close(pools_b.recurrent[i], pools_a.recurrent[i], rtol=1e-5, atol=1e-6)
