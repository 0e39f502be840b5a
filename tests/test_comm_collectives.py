"""The collective entries on real ranks: two gloo processes run every CPU cell of every comm entry (each rank's
raw_call against the reference that gathers all ranks' inputs), the refusals of `is_valid`, and Helix's exchange
end to end (keys sharded over the ranks, all-to-all over heads, LSE merge = the unsharded attention)."""

from __future__ import annotations

import datetime
import json
import multiprocessing
import os
import traceback

import pytest
import torch

WORLD = 2


def _rank_main(rank: int, world: int, store_path: str, out_dir: str) -> None:
    import torch.distributed as dist

    from kestrel.catalog import all_entries
    from kestrel.catalog._op import Arch, CallLog, InvalidInput, run_cell, validating
    from kestrel.catalog.comm._group import running_on
    results: dict[str, str] = {}
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=90))
    try:
        group = dist.group.WORLD
        with running_on(group):
            for entry in all_entries():
                if not entry.__module__.startswith("kestrel.catalog.comm."):
                    continue
                for i, cell in enumerate(entry.CELLS):
                    if Arch.CPU not in cell.archs:
                        continue
                    name = f"{entry.name()}[{i}]"
                    log = CallLog()
                    try:
                        with log.watching(entry):
                            run_cell(entry, cell, "cpu", seed=17 + i)
                        results[name] = "ok" if not log.missing() else f"never ran {log.missing()}"
                    except Exception:
                        results[name] = traceback.format_exc(limit=3)
            for name, check in (("refusals", lambda: _refusals(group, validating, InvalidInput)),
                                ("helix exchange", lambda: _helix_exchange(group))):
                try:
                    results[name] = check()
                except Exception:
                    results[name] = traceback.format_exc(limit=4)
    except Exception:
        results["worker"] = traceback.format_exc()
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
        dist.destroy_process_group()


def _refusals(group, validating, InvalidInput) -> str:
    """Inputs the collectives would move silently wrong are refused before any rank sends a byte."""
    from kestrel.catalog.comm.all_gather import AllGather
    from kestrel.catalog.comm.all_to_all import AllToAll
    from kestrel.catalog.comm.reduce_scatter import ReduceScatter
    x = torch.randn(6, 8)
    cases = [(AllGather, dict(x=x.t(), group=group), "contiguous"),
             (AllGather, dict(x=x, group=group, out=torch.empty(6, 8)), "out must be"),
             (ReduceScatter, dict(x=torch.randn(5, 8), group=group), "multiple of"),
             (AllToAll, dict(x=x, group=group, in_splits=[1, 5]), "need out_splits"),
             (AllToAll, dict(x=x, group=group, in_splits=[2, 5], out_splits=[3, 3]), "sum to 7"),
             (AllGather, dict(x=x, group="tp"), "ProcessGroup")]
    for entry, kwargs, words in cases:
        try:
            with validating(entry):
                entry.raw_call(**kwargs)
        except InvalidInput as e:
            if words not in str(e):
                return f"{entry.__name__} refused for another reason: {e}"
            continue
        return f"{entry.__name__} accepted {sorted(kwargs)} ({words!r} expected)"
    return "ok"


def _helix_exchange(group) -> str:
    """Rank r holds keys shard r (the sequence cut in R pieces, one empty for some queries via a mask); it attends
    with every head, sends heads chunk j and their LSEs to rank j (AllToAll), merges what it got
    (MergeAttentionPartials) and gathers the heads back (AllGather): equal to attention over all keys."""
    from kestrel.catalog._op import assert_close
    from kestrel.catalog.attention.helix_merge import MergeAttentionPartials
    from kestrel.catalog.comm.all_gather import AllGather
    from kestrel.catalog.comm.all_to_all import AllToAll
    from kestrel.ops.attention import attention
    R, me = group.size(), group.rank()
    T, H, Dk, Dv, L = 5, 4, 24, 16, 13
    g = torch.Generator().manual_seed(5)                  # the same full problem on every rank
    q, k = torch.randn(T, H, Dk, generator=g), torch.randn(L, Dk, generator=g)
    v = torch.randn(L, Dv, generator=g)
    visible = torch.rand(T, L, generator=g) < 0.6
    visible[:, 0] = True
    visible[0, 1:] = False                                # query 0 sees only key 0: rank 0's shard alone
    full, _ = attention(q.transpose(0, 1), k, v, 0.3, visible)          # [H, T, Dv]
    bounds = [L * r // R for r in range(R + 1)]
    mine = slice(bounds[me], bounds[me + 1])
    part, lse = attention(q.transpose(0, 1), k[mine], v[mine], 0.3, visible[:, mine])
    part = torch.nan_to_num(part.transpose(0, 1), nan=0.0)                # [T, H, Dv]; empty rows: lse -inf
    lse = lse.transpose(0, 1)                                              # [T, H]
    hr = H // R
    send_o = part.reshape(T, R, hr * Dv).transpose(0, 1).contiguous().view(R * T, hr * Dv)
    send_l = lse.reshape(T, R, hr).transpose(0, 1).contiguous().view(R * T, hr)
    got_o = AllToAll.raw_call(send_o, group).view(R, T, hr, Dv)
    got_l = AllToAll.raw_call(send_l, group).view(R, T, hr)
    merged = MergeAttentionPartials.raw_call(got_o, got_l)                 # [T, hr, Dv]: my heads
    assert_close(merged, full.transpose(0, 1)[:, me * hr:(me + 1) * hr], rtol=1e-5, atol=1e-5, what="my heads")
    every = AllGather.raw_call(merged.transpose(0, 1).contiguous().view(hr, T * Dv), group)   # [H, T*Dv]
    assert_close(every.view(H, T, Dv), full, rtol=1e-5, atol=1e-5, what="all heads")
    return "ok"


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory):
    """Spawn WORLD gloo ranks once; each writes {check: 'ok' | what went wrong}."""
    d = tmp_path_factory.mktemp("comm")
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_rank_main, args=(r, WORLD, str(d / "store"), str(d))) for r in range(WORLD)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    out = []
    for r in range(WORLD):
        path = d / f"rank{r}.json"
        assert path.exists(), f"rank {r} wrote no results (exit code {procs[r].exitcode})"
        out.append(json.loads(path.read_text()))
    return out


def _cpu_cells():
    from kestrel.catalog import all_entries
    from kestrel.catalog._op import Arch
    return [f"{e.name()}[{i}]" for e in all_entries() if e.__module__.startswith("kestrel.catalog.comm.")
            for i, c in enumerate(e.CELLS) if Arch.CPU in c.archs]


def test_every_comm_entry_has_cpu_cells():
    names = {n.split("[")[0] for n in _cpu_cells()}
    assert names == {"comm.all_reduce.AllReduce", "comm.all_gather.AllGather", "comm.reduce_scatter.ReduceScatter",
                     "comm.all_to_all.AllToAll", "comm.all_reduce_add_rmsnorm.AllReduceAddRmsNorm"}


@pytest.mark.parametrize("name", _cpu_cells() + ["refusals", "helix exchange"])
def test_on_two_gloo_ranks(rank_results, name):
    for rank, res in enumerate(rank_results):
        assert "worker" not in res, res["worker"]
        assert res.get(name) == "ok", f"rank {rank}: {res.get(name)}"


def test_one_process_group_runs_a_collective_without_init_process_group():
    """A cell outside any spawned group runs on a world-size-1 group and leaves torch.distributed uninitialized."""
    import torch.distributed as dist

    from kestrel.catalog.comm._group import cell_group
    from kestrel.catalog.comm.all_reduce import AllReduce
    group = cell_group("cpu")
    x = torch.randn(3, 5)
    y = AllReduce.raw_call(x.clone(), group)
    assert group.size() == 1 and torch.equal(y, x) and not dist.is_initialized()
