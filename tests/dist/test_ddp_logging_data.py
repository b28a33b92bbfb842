"""``_get_ddp_logging_data()``, ``_set_ddp_runtime_logging_sample_rate()`` and ``_set_static_graph()``
(issue 34), torch's DDP as the oracle in the same ranks (world 2, Gloo): every key phalanx gives
holds torch's value where the fact is the same (settings, parameter stats, iteration counts,
unused-parameter bytes, comm hook names, bucket sizes where the plans are the same), phalanx
gives no key torch does not have, and ``_set_static_graph()`` behaves as torch's (its warnings,
its refusal after the first synchronising forward, the gradients of a model with an unused
parameter afterwards)."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import phalanx
from tests.harness import run_ranks

WORLD = 2
# The keys phalanx gives (docs/ddp.md lists them; the others of torch's are left out).
PROVIDED = {"module_name", "device_ids", "output_device", "world_size", "rank", "backend_name",
            "broadcast_buffers", "bucket_cap_bytes", "find_unused_parameters", "gradient_as_bucket_view",
            "has_sync_bn", "is_multi_device_module", "num_parameter_tensors", "total_parameter_size_bytes",
            "dtypes", "iteration", "static_graph", "bucket_sizes", "unused_parameter_size",
            "num_buckets_reduced", "comm_hook", "has_error", "error"}
DOCS = Path(__file__).resolve().parents[2] / "docs" / "ddp.md"
TOO_LATE = "should be called before training loop starts"


class Net(nn.Module):
    """Two layers used, one never (48 bytes of unused parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.b = nn.Linear(8, 2, bias=False)
        self.unused = nn.Linear(3, 3)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


class Big(nn.Module):
    """Three layers of 12 KB, 361 KB and 361 KB: several buckets at a cap under 1 MiB."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(300, 300), nn.Linear(300, 300), nn.Linear(300, 10)

    def forward(self, x):
        return self.c(self.b(self.a(x)))


def _pair(make, **kwargs):
    """torch's DDP and phalanx's of the same model (same seed, same arguments)."""
    models = {}
    kwargs.setdefault("gradient_as_bucket_view", False)  # torch's default (phalanx's is True)
    for name, cls in (("torch", TorchDDP), ("phalanx", phalanx.DistributedDataParallel)):
        torch.manual_seed(0)
        models[name] = cls(make(), **kwargs)
    return models


def _step(models, x, backward=True):
    for m in models.values():
        out = m(x)
        if backward:
            out.sum().backward()


def _differences(what, models, skip=()):
    """Every key phalanx gives that torch lacks or holds another value for."""
    theirs, ours = (m._get_ddp_logging_data() for m in models.values())
    found = [f"{what}: key {k!r} phalanx gives is not torch's" for k in sorted(set(ours) - PROVIDED)]
    return found + [f"{what}: {k} is {ours[k]!r}, torch's {theirs.get(k, 'absent')!r}"
                    for k in sorted(set(ours) & PROVIDED) if k not in skip and theirs.get(k) != ours[k]]


def training(rank):
    """Construction, synchronising steps, a no_sync step, a no_grad forward, a forward alone."""
    models = _pair(Net, find_unused_parameters=True, gradient_as_bucket_view=False)
    found = _differences("constructed", models)
    for i in range(3):
        _step(models, torch.randn(2, 4) + rank)
        found += _differences(f"after step {i}", models)
    with models["torch"].no_sync(), models["phalanx"].no_sync():
        _step(models, torch.randn(2, 4))
    found += _differences("after a no_sync step", models)
    with torch.no_grad():
        _step(models, torch.randn(2, 4), backward=False)
    _step(models, torch.randn(2, 4), backward=False)
    found += _differences("after a forward alone", models)
    ours = models["phalanx"]._get_ddp_logging_data()
    if (ours["iteration"], ours["unused_parameter_size"]) != (3, 48):
        found.append(f"iteration, unused bytes: {ours['iteration']}, {ours['unused_parameter_size']}")
    return found


def sampling(rank):
    """``iteration`` under torch's sampling: every one of the first 10, then every rate-th,
    with the rate changed midway."""
    models = _pair(lambda: nn.Linear(2, 2), gradient_as_bucket_view=True)
    found = []
    for m in models.values():
        m._set_ddp_runtime_logging_sample_rate(3)
    for i in range(30):
        if i == 17:
            for m in models.values():
                m._set_ddp_runtime_logging_sample_rate(4)
        _step(models, torch.randn(1, 2))
        found += _differences(f"step {i}", models)
    return found


def bucket_plans(rank):
    """phalanx plans once what torch rebuilds after its first iteration: its bucket_sizes are
    torch's rebuilt_bucket_sizes; torch's first buckets, one per dtype, where they are the same."""
    found = []
    for kwargs in ({"bucket_cap_mb": 0.5}, {"bucket_cap_mb_list": [0.3, 1]}, {"bucket_cap_mb": 0.2}):
        models = _pair(Big, **kwargs)
        for _ in range(3):  # torch rebuilds in the second forward, after logging it
            _step(models, torch.randn(2, 300))
        theirs, ours = (m._get_ddp_logging_data() for m in models.values())
        found += _differences(str(kwargs), models, skip={"bucket_sizes"})
        if theirs.get("rebuilt_bucket_sizes") != ours["bucket_sizes"]:
            found.append(f"{kwargs}: bucket_sizes {ours['bucket_sizes']}, torch's rebuilt "
                         f"{theirs.get('rebuilt_bucket_sizes')}")

    def two_dtypes():  # torch's test_ddp_logging_data_cpu's LargeNet, scaled down
        net = nn.Sequential(nn.Linear(100, 200, bias=False), nn.Linear(200, 50, bias=False))
        net[0].double()
        return net

    return found + _differences("two dtypes", _pair(two_dtypes, bucket_cap_mb=0.01))


def static_graph(rank):
    """``_set_static_graph()`` as torch's: before training it makes an unused parameter fine
    (the same gradients); again, it warns; with find_unused_parameters, it warns; after a
    synchronising forward it raises and logs the error; no_sync and no_grad forwards do not count."""
    found = []
    models = _pair(Net)
    for name, m in models.items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            m._set_static_graph()
            m._set_static_graph()
        found += [f"{name} warned {[str(w.message) for w in caught]}"] if len(caught) != 1 else []
        models[name] = (m, str(caught[0].message) if caught else None)
    texts = {text for _, text in models.values()}
    found += [f"the second calls' warnings differ: {texts}"] if len(texts) != 1 else []
    models = {name: m for name, (m, _) in models.items()}
    for i in range(3):
        _step(models, torch.randn(2, 4) + rank)
        grads = [[p.grad for p in m.parameters() if p.grad is not None] for m in models.values()]
        if len(grads[0]) != len(grads[1]) or not all(torch.equal(a, b) for a, b in zip(*grads)):
            found.append(f"step {i}: the gradients differ from torch's")
        # torch's first static iteration all-reduces outside its buckets: it counts none
        found += _differences(f"static, step {i}", models, skip={"num_buckets_reduced"})
        for m in models.values():
            m.zero_grad()
    found += _late(rank) + _idle_forwards_allowed()
    texts = set()
    for m in _pair(Net, find_unused_parameters=True).values():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            m._set_static_graph()
        texts.add(tuple(str(w.message) for w in caught))
    return found + ([f"with find_unused_parameters: warnings {texts}"] if len(texts) != 1 or () in texts else [])


def _late(rank):
    found = []
    models = _pair(Net, find_unused_parameters=True)
    _step(models, torch.randn(2, 4))
    for name, m in models.items():
        try:
            m._set_static_graph()
            found.append(f"{name}: no error after a step")
        except RuntimeError as e:
            if not str(e).startswith("set_static_graph() " + TOO_LATE):
                found.append(f"{name}: {e}")
        data = m._get_ddp_logging_data()
        if data.get("has_error") != 1 or TOO_LATE not in data.get("error", ""):
            found.append(f"{name}: the error is not logged: {data.get('error')!r}")
    return found + _differences("after the refusal", models, skip={"error"})


def _idle_forwards_allowed():
    found = []
    for name, m in _pair(Net, find_unused_parameters=True).items():
        with m.no_sync():
            m(torch.randn(2, 4)).sum().backward()
        with torch.no_grad():
            m(torch.randn(2, 4))
        try:
            m._set_static_graph()
        except RuntimeError as e:
            found.append(f"{name} refuses after no_sync and no_grad forwards: {e}")
    return found


def hooks_and_errors(rank):
    """comm_hook after register_comm_hook and _register_builtin_comm_hook; the errors torch logs."""
    found = []
    models = _pair(Net, find_unused_parameters=True)
    for m in models.values():
        m.register_comm_hook(None, default_hooks.allreduce_hook)
    _step(models, torch.randn(2, 4))
    _step(models, torch.randn(2, 4))
    found += _differences("allreduce_hook", models)
    models = _pair(Net)
    for m in models.values():
        m._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)
    found += _differences("built-in hook", models)
    for what, call, kind, words in (
            ("a hook that is not callable", lambda m: m.register_comm_hook(None, 1), TypeError,
             "Communication hook must be callable."),
            ("sample rate 0", lambda m: m._set_ddp_runtime_logging_sample_rate(0), ValueError,
             "DDP runtime logging sample rate should be equal or greater than 1")):
        for name, m in _pair(Net).items():
            try:
                call(m)
                found.append(f"{name}, {what}: nothing raised")
            except kind as e:
                if not str(e).startswith(words):
                    found.append(f"{name}, {what}: {e}")
            if words not in m._get_ddp_logging_data().get("error", ""):
                found.append(f"{name}, {what}: not logged")
    return found


CASES = {f.__name__: f for f in (training, sampling, bucket_plans, static_graph, hooks_and_errors)}


def every_case(rank, world_size):
    dist.init_process_group("gloo")  # a group made by torch, as torch's tests make it
    out = {}
    for name, case in CASES.items():
        try:
            out[name] = case(rank)
        except Exception as e:  # noqa: BLE001 - one case failing leaves the others' verdicts
            out[name] = [f"{type(e).__name__}: {e}"]
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(every_case, WORLD, init=False, timeout=180)


@pytest.mark.slow  # one group of 2 ranks, ~12 s on 2 cores
@pytest.mark.parametrize("case", CASES)
def test_logging_data_holds_torchs_values(results, case):
    problems = [f"rank {r}: {p}" for r, out in enumerate(results) for p in out[case]]
    assert not problems, "\n".join(problems)


def test_the_documented_keys_are_the_keys_given():
    text = DOCS.read_text()
    section = text[text.index("## Logging data"):]
    section = section[:section.find("\n## ", 3)]
    listed = set(re.findall(r"`(\w+)`", section.split("Left out")[0]))
    assert PROVIDED <= listed, sorted(PROVIDED - listed)
