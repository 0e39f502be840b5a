"""Teacher-forced logits error of the targets and the reference against the fp32 reference on the GPU, per dtype.

Run on the H200: PYTHONPATH=$PWD python3 benchmarks/target_precision.py (numbers in benchmarks/results/)."""
import torch, importlib, sys, tempfile
sys.path.insert(0, "tests")
from test_targets import _forced_logits, TARGETS
from kestrel.config import ModelConfig
from kestrel.models.kimi import load_reference_model
from kestrel.models.kimi.checkpoint import make_checkpoint
dev = torch.device("cuda")
for preset in ("k3-tiny", "kimi-linear-tiny"):
    path = tempfile.mkdtemp()
    make_checkpoint(preset, path, seed=3, dtype=torch.bfloat16, with_tokenizer=False)
    c = ModelConfig.from_dir(path)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, c.vocab_size, (70,), generator=g).tolist()
    toks = torch.randint(0, c.vocab_size, (24,), generator=g).tolist()
    for dt in (torch.float32, torch.bfloat16):
        ref = load_reference_model(path, c, dt, dev)
        tgt = importlib.import_module(f"kestrel.models.kimi.targets.{TARGETS[preset]}.modeling").build(ref, c)
        oracle = load_reference_model(path, c, torch.float32, dev)
        ex = _forced_logits(oracle, c, prompt, toks, torch.float32)
        for name, m in (("ref", ref), ("tgt", tgt)):
            lg = _forced_logits(m, c, prompt, toks, dt)
            err = (lg - ex).norm(dim=-1) / ex.norm(dim=-1)
            print(preset, dt, name, "median", round(err.median().item(), 5), "max", round(err.max().item(), 4), "first", [round(x, 4) for x in err[:6].tolist()])
