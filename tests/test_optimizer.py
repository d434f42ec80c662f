"""Optimizer state checkpointing: exact resharding of Adam/AdamW/SGD state, ZeRO-1, mixed precision.

The distributed part runs ONE 4-rank gloo launch (module fixture) that trains a hand-written
tensor-parallel MLP (SwiGLU fc1 stored through a ShardedTensorFactory, row-parallel fc2) under
TP=2,DP=2, saves, resumes under TP=2,DP=2 / TP=1,DP=4 / TP=4,DP=1 (and in this process, without
torch.distributed), and continues; plus ZeRO-1 DP=4 -> DP=2 and bf16 + fp32 masters.

Tolerances: resuming in the same layout is bitwise identical to the uninterrupted run, and
the state right after a resharded load is bitwise identical to the saved state. Training
continued under another TP/DP size sums the same products in another order (TP all-reduce of
row-parallel partial sums, DP all-reduce of grads), so those runs agree to fp32 rounding
only: we check |diff| <= 1e-5 (observed ~1e-7).
"""

from __future__ import annotations

import os
import random

import pytest
import torch
import torch.distributed as dist

import ckpt_integration as ci
from ckpt_integration import ShardedTensor, ShardedTensorFactory
from ckpt_integration.optimizer import (
    MixedPrecisionOptimizer,
    OptimizerStateMismatchError,
    OptimizerStateNotFoundError,
    UnmatchedParameterError,
    ZeroShardedOptimizer,
    flat_range_to_boxes,
    get_param_id_to_sharded_param_map,
    has_optimizer_state,
    load_optimizer_state,
    optimizer_sharded_state_dict,
    sharding_state_to_optim_state,
)
from tests.dist_utils import run_distributed

D_IN, HID, D_OUT, GB = 6, 8, 5, 8  # input, hidden (per SwiGLU half), output, global batch
K, N = 3, 6  # save after K steps, train to N
LAYOUTS = {"tp2dp2": (2, 2), "tp1dp4": (1, 4), "tp4dp1": (4, 1)}
TOL = 1e-5


# ----------------------------------------------------------------------------------------------
# a hand-written tensor-parallel MLP
# ----------------------------------------------------------------------------------------------
class Layout:
    def __init__(self, rank, tp, dp, groups=None):
        self.tp, self.dp = tp, dp
        self.tp_rank, self.dp_rank = rank % tp, rank // tp
        self.tp_group, self.dp_group = groups if groups else (None, None)


def make_layouts(rank, world):
    """Create the TP/DP groups of every layout (all ranks call new_group in the same order)."""
    out = {}
    for name, (tp, dp) in LAYOUTS.items():
        tp_groups = [dist.new_group([d * tp + t for t in range(tp)]) for d in range(dp)]
        dp_groups = [dist.new_group([d * tp + t for d in range(dp)]) for t in range(tp)]
        lay = Layout(rank, tp, dp)
        lay.tp_group, lay.dp_group = tp_groups[lay.dp_rank], dp_groups[lay.tp_rank]
        out[name] = lay
    return out


class AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        y = x.clone()
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx, g):
        return g, None


def global_params(seed, swiglu):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g) * 0.4  # noqa: E731
    fc1 = 2 * HID if swiglu else HID
    return {"fc1.weight": r(fc1, D_IN), "fc1.bias": r(fc1), "fc2.weight": r(D_OUT, HID), "fc2.bias": r(D_OUT)}


def swiglu_factory(key, data, tp_rank, tp, replica_id):
    """fc1 = [gate; up]: each half is TP-split on its own, stored as key.gate / key.up."""

    def build(key, t, replica_id, _):
        gate, up = t.chunk(2)
        return {n: ShardedTensor.from_rank_offsets(f"{key}.{n}", x, (0, tp_rank, tp), replica_id=replica_id)
                for n, x in (("gate", gate), ("up", up))}

    return ShardedTensorFactory(key, data, build, lambda sd: torch.cat([sd["gate"], sd["up"]]), replica_id)


class TPMLP(torch.nn.Module):
    def __init__(self, full, lay, swiglu=True, dtype=torch.float32):
        super().__init__()
        self.lay, self.swiglu = lay, swiglu
        h = HID // lay.tp
        s = slice(lay.tp_rank * h, (lay.tp_rank + 1) * h)
        if swiglu:
            w, b = full["fc1.weight"].chunk(2), full["fc1.bias"].chunk(2)
            w1, b1 = torch.cat([w[0][s], w[1][s]]), torch.cat([b[0][s], b[1][s]])
        else:
            w1, b1 = full["fc1.weight"][s], full["fc1.bias"][s]
        P = lambda t: torch.nn.Parameter(t.clone().to(dtype))  # noqa: E731
        self.fc1_weight, self.fc1_bias = P(w1), P(b1)
        self.fc2_weight, self.fc2_bias = P(full["fc2.weight"][:, s]), P(full["fc2.bias"])

    def forward(self, x):
        a = x.to(self.fc1_weight.dtype) @ self.fc1_weight.t() + self.fc1_bias
        if self.swiglu:
            gate, up = a.chunk(2, dim=-1)
            h = torch.nn.functional.silu(gate) * up
        else:
            h = torch.relu(a)
        y = h @ self.fc2_weight.t()
        if self.lay.tp > 1:
            y = AllReduceSum.apply(y, self.lay.tp_group)
        return y + self.fc2_bias

    def sharded_state_dict(self):
        L = self.lay
        sharded, replicated = (0, L.dp_rank), (L.tp_rank, L.dp_rank)
        ST = ShardedTensor.from_rank_offsets
        if self.swiglu:
            fc1w = swiglu_factory("mlp.fc1.weight", self.fc1_weight.detach(), L.tp_rank, L.tp, sharded)
            fc1b = swiglu_factory("mlp.fc1.bias", self.fc1_bias.detach(), L.tp_rank, L.tp, sharded)
        else:
            fc1w = ST("mlp.fc1.weight", self.fc1_weight.detach(), (0, L.tp_rank, L.tp), replica_id=sharded)
            fc1b = ST("mlp.fc1.bias", self.fc1_bias.detach(), (0, L.tp_rank, L.tp), replica_id=sharded)
        return {
            "fc1.weight": fc1w,
            "fc1.bias": fc1b,
            "fc2.weight": ST("mlp.fc2.weight", self.fc2_weight.detach(), (1, L.tp_rank, L.tp), replica_id=sharded),
            "fc2.bias": ST("mlp.fc2.bias", self.fc2_bias.detach(), replica_id=replicated),
        }


def batch(step):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(GB, D_IN, generator=g), torch.randn(GB, D_OUT, generator=g)


def train_step(model, opt, sched, step):
    L = model.lay
    x, y = batch(step)
    b = GB // L.dp
    x, y = x[L.dp_rank * b:(L.dp_rank + 1) * b], y[L.dp_rank * b:(L.dp_rank + 1) * b]
    loss = ((model(x).float() - y) ** 2).sum() / (GB * D_OUT)
    loss.backward()
    if L.dp > 1:
        for p in model.parameters():
            dist.all_reduce(p.grad, group=L.dp_group)
        dist.all_reduce(loss := loss.detach().clone(), group=L.dp_group)
    opt.step()
    opt.zero_grad()
    if sched is not None:
        sched.step()
    return loss.item()


def make_opt(name, params):
    if name == "adam":
        opt = torch.optim.Adam(params, lr=0.05)
    elif name == "adamw":
        opt = torch.optim.AdamW(params, lr=0.05, weight_decay=0.1, amsgrad=True)
    else:
        opt = torch.optim.SGD(params, lr=0.1, momentum=0.9, nesterov=True)
    return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def save_all(model, opt, sched, path, iteration, zero=False):
    msd = model.sharded_state_dict()
    osd = opt.sharded_state_dict(msd) if zero or isinstance(opt, MixedPrecisionOptimizer) else optimizer_sharded_state_dict(opt, msd)
    sd = {"model": msd, "optimizer": osd, "iteration": iteration}
    if sched is not None:
        sd["lr_scheduler"] = sched.state_dict()  # plain common state
    ci.save(sd, path, durable=False, overwrite=True)


def resume(model, opt, sched, path, zero=False):
    """Model via ci.load, optimizer via load_optimizer_state / load_checkpoint, scheduler from common state."""
    msd = model.sharded_state_dict()
    loaded = ci.load({"model": msd}, path)
    with torch.no_grad():
        for name, p in zip(("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"), model.parameters()):
            p.copy_(loaded["model"][name])
    if zero or isinstance(opt, MixedPrecisionOptimizer):
        assert opt.load_checkpoint(msd, path)
    else:
        extracted = load_optimizer_state(opt, msd, path, module=model)
        # fp32 masters of a ZeRO / mixed-precision checkpoint are handed back, not put into torch state
        assert extracted is not None and all(set(v) == {"fp32_param"} for v in extracted.values())
    if sched is not None:
        sched.load_state_dict(loaded["lr_scheduler"])
    return loaded["iteration"]


# ----------------------------------------------------------------------------------------------
# the 4-rank run
# ----------------------------------------------------------------------------------------------
def _worker(rank, world, root):
    torch.manual_seed(0)
    layouts = make_layouts(rank, world)
    losses = {}
    L0 = layouts["tp2dp2"]
    for opt_name in ("adam", "adamw", "sgd"):
        d = os.path.join(root, opt_name)
        model = TPMLP(global_params(0, True), L0)
        opt, sched = make_opt(opt_name, model.parameters())
        first = [train_step(model, opt, sched, s) for s in range(K)]
        save_all(model, opt, sched, f"{d}/mid", K)
        losses[(opt_name, "ref")] = first + [train_step(model, opt, sched, s) for s in range(K, N)]
        save_all(model, opt, sched, f"{d}/ref", N)
        for lname, lay in layouts.items():
            model = TPMLP(global_params(1, True), lay)  # other init: everything must come from the checkpoint
            opt, sched = make_opt(opt_name, model.parameters())  # no state yet
            assert resume(model, opt, sched, f"{d}/mid") == K
            save_all(model, opt, sched, f"{d}/{lname}_reloaded", K)
            losses[(opt_name, lname)] = first + [train_step(model, opt, sched, s) for s in range(K, N)]
            save_all(model, opt, sched, f"{d}/{lname}_final", N)

    # ZeRO-1: DP=4 (TP=1) -> DP=2 (TP=2) with ZeRO, and -> TP=4 plain AdamW (model space)
    d = os.path.join(root, "zero")
    lay = layouts["tp1dp4"]
    model = TPMLP(global_params(2, False), lay, swiglu=False)
    zero = ZeroShardedOptimizer(model.parameters(), torch.optim.AdamW, dp_group=lay.dp_group, lr=0.05, weight_decay=0.1)
    first = [train_step(model, zero, None, s) for s in range(K)]
    save_all(model, zero, None, f"{d}/mid", K, zero=True)
    losses[("zero", "ref")] = first + [train_step(model, zero, None, s) for s in range(K, N)]
    save_all(model, zero, None, f"{d}/ref", N, zero=True)
    for lname, use_zero in (("tp2dp2", True), ("tp4dp1", False)):
        lay = layouts[lname]
        model = TPMLP(global_params(3, False), lay, swiglu=False)
        if use_zero:
            opt = ZeroShardedOptimizer(model.parameters(), torch.optim.AdamW, dp_group=lay.dp_group, lr=0.05, weight_decay=0.1)
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
        resume(model, opt, None, f"{d}/mid", zero=use_zero)
        save_all(model, opt, None, f"{d}/{lname}_reloaded", K, zero=use_zero)
        losses[("zero", lname)] = first + [train_step(model, opt, None, s) for s in range(K, N)]
        save_all(model, opt, None, f"{d}/{lname}_final", N, zero=use_zero)

    # mixed precision: bf16 model, fp32 masters; TP=2,DP=2 -> TP=1,DP=4
    d = os.path.join(root, "mp")
    model = TPMLP(global_params(4, True), L0, dtype=torch.bfloat16)
    mp = MixedPrecisionOptimizer(model.parameters(), torch.optim.AdamW, lr=0.01)
    for s in range(K):
        train_step(model, mp, None, s)
    save_all(model, mp, None, f"{d}/mid", K)
    model = TPMLP(global_params(5, True), layouts["tp1dp4"], dtype=torch.bfloat16)
    mp = MixedPrecisionOptimizer(model.parameters(), torch.optim.AdamW, lr=0.01)
    resume(model, mp, None, f"{d}/mid")
    save_all(model, mp, None, f"{d}/tp1dp4_reloaded", K)
    assert all(torch.isfinite(torch.tensor(train_step(model, mp, None, s))) for s in range(K, N))

    if rank == 0:
        torch.save(losses, os.path.join(root, "losses.pt"))


@pytest.fixture(scope="module")
def dist_run(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("optim"))
    run_distributed(_worker, 4, root, timeout=240)
    return root, torch.load(os.path.join(root, "losses.pt"))


def assert_same_tensors(dir_a, dir_b, tol=0.0, only_common=False):
    a, b = ci.load_plain_tensors(dir_a), ci.load_plain_tensors(dir_b)
    if only_common:
        keys = set(a) & set(b)
    else:
        assert set(a) == set(b), set(a) ^ set(b)
        keys = set(a)
    assert any(k.startswith("optimizer.state.") for k in keys)
    for k in sorted(keys):
        if tol == 0.0:
            assert torch.equal(a[k], b[k]), (k, (a[k].float() - b[k].float()).abs().max())
        else:
            torch.testing.assert_close(a[k], b[k], rtol=0, atol=tol, msg=lambda m: f"{k}: {m}")


@pytest.mark.slow
@pytest.mark.parametrize("opt_name", ["adam", "adamw", "sgd"])
def test_tp_dp_resharding_resume(dist_run, opt_name):
    root, losses = dist_run
    d = os.path.join(root, opt_name)
    keys = set(ci.load_plain_tensors(f"{d}/mid"))
    expected_states = {"adam": {"exp_avg", "exp_avg_sq"}, "adamw": {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"},
                       "sgd": {"momentum_buffer"}}[opt_name]
    assert {k.split(".")[2] for k in keys if k.startswith("optimizer.state.")} == expected_states
    assert "optimizer.state.exp_avg.mlp.fc1.weight.gate" in keys or opt_name == "sgd"  # factory-built keys
    ref = losses[(opt_name, "ref")]
    for lname in LAYOUTS:
        # the state right after a resharded load is exactly the saved state
        assert_same_tensors(f"{d}/mid", f"{d}/{lname}_reloaded")
        common = ci.load_common_state_dict(f"{d}/{lname}_reloaded")
        assert common["lr_scheduler"]["last_epoch"] == K and common["iteration"] == K
        if lname == "tp2dp2":  # same layout: bitwise identical continuation
            assert losses[(opt_name, lname)] == ref
            assert_same_tensors(f"{d}/ref", f"{d}/{lname}_final")
        else:  # other reduction order: fp32 rounding
            assert losses[(opt_name, lname)] == pytest.approx(ref, rel=0, abs=TOL)
            assert_same_tensors(f"{d}/ref", f"{d}/{lname}_final", tol=TOL)
    assert ci.load_common_state_dict(f"{d}/ref")["optimizer"]["param_groups"][0]["lr"] == pytest.approx(
        make_opt(opt_name, [torch.zeros(1, requires_grad=True)])[0].defaults["lr"] * 0.5 ** (N // 2))


@pytest.mark.slow
def test_resume_in_single_process_without_dist(dist_run, tmp_path):
    root, losses = dist_run
    d = os.path.join(root, "adamw")
    lay = Layout(0, 1, 1)
    model = TPMLP(global_params(7, True), lay)
    opt, sched = make_opt("adamw", model.parameters())
    assert resume(model, opt, sched, f"{d}/mid") == K
    save_all(model, opt, sched, str(tmp_path / "reloaded"), K)
    assert_same_tensors(f"{d}/mid", str(tmp_path / "reloaded"))
    cont = [train_step(model, opt, sched, s) for s in range(K, N)]
    assert cont == pytest.approx(losses[("adamw", "ref")][K:], rel=0, abs=TOL)


@pytest.mark.slow
def test_zero1_dp4_to_dp2_and_to_plain(dist_run):
    root, losses = dist_run
    d = os.path.join(root, "zero")
    md = ci.load_tensors_metadata(f"{d}/mid")
    assert md["optimizer.state.fp32_param.mlp.fc1.weight"].global_shape == (HID, D_IN)
    assert md["optimizer.state.exp_avg.mlp.fc2.bias"].global_shape == (D_OUT,)
    # saved row-aligned (planning.flat_pieces): whole rows only, one chunk per rank and 2-D param
    # (the DP=4 slices of 26 elements cut fc1.weight's rows of 6), read by DCP's own reader
    from torch.distributed.checkpoint import FileSystemReader

    dcp_md = FileSystemReader(f"{d}/mid").read_metadata()
    for key in ("optimizer.state.exp_avg.mlp.fc1.weight", "optimizer.state.fp32_param.mlp.fc2.weight"):
        tmd = dcp_md.state_dict_metadata[key]
        assert all(c.sizes[-1] == tmd.size[-1] for c in tmd.chunks), (key, tmd.chunks)
        assert len(tmd.chunks) <= 4
    assert_same_tensors(f"{d}/mid", f"{d}/tp2dp2_reloaded")  # ZeRO DP=4 -> ZeRO DP=2 (TP=2): exact
    assert_same_tensors(f"{d}/mid", f"{d}/tp4dp1_reloaded", only_common=True)  # -> plain AdamW, no masters
    for lname in ("tp2dp2", "tp4dp1"):
        assert losses[("zero", lname)] == pytest.approx(losses[("zero", "ref")], rel=0, abs=TOL)
        assert_same_tensors(f"{d}/ref", f"{d}/{lname}_final", tol=TOL, only_common=True)


def _zero_peers_worker(rank, world, ckpt, out):
    """PyTorch DCP and Megatron-Core read the row-aligned ZeRO checkpoint with their own loaders."""
    import torch.distributed.checkpoint as dcp

    from tests.test_interop import _import_megatron, _patch_cuda_for_megatron

    _import_megatron()
    _patch_cuda_for_megatron()
    from megatron.core import dist_checkpointing as mdc

    md = ci.load_tensors_metadata(ckpt)
    keys = sorted(k for k in md if k.startswith("optimizer.state."))
    sd = {k: torch.full(md[k].global_shape, -1.0) for k in keys}
    dcp.load(sd, checkpoint_id=ckpt)
    # Megatron-Core's torch_dist loader, whole tensors
    req = {}
    for k in keys:
        shape = md[k].global_shape
        req[k] = mdc.ShardedTensor.from_rank_offsets(k, torch.full(shape, -2.0))
    got = mdc.load(req, ckpt)
    torch.save({"dcp": sd, "mcore": {k: got[k] for k in keys}}, out)


@pytest.mark.slow
def test_zero1_checkpoint_read_by_dcp_and_megatron(dist_run, tmp_path):
    from tests.megatron_import import import_megatron

    import_megatron()  # skips where Megatron-Core is missing, keeps torch's safe globals as they were
    root, _ = dist_run
    ckpt = os.path.join(root, "zero", "mid")
    run_distributed(_zero_peers_worker, 1, ckpt, str(tmp_path / "out.pt"), timeout=180)
    got = torch.load(tmp_path / "out.pt")
    plain = {k: v for k, v in ci.load_plain_tensors(ckpt).items() if k.startswith("optimizer.state.")}
    assert set(got["dcp"]) == set(plain) == set(got["mcore"]) and plain
    for k, v in plain.items():
        assert torch.equal(got["dcp"][k], v), k
        assert torch.equal(got["mcore"][k], v), k


@pytest.mark.slow
def test_mixed_precision_masters_reshard(dist_run):
    root, _ = dist_run
    d = os.path.join(root, "mp")
    assert_same_tensors(f"{d}/mid", f"{d}/tp1dp4_reloaded")
    t = ci.load_plain_tensors(f"{d}/mid")
    master, model = t["optimizer.state.fp32_param.mlp.fc2.weight"], t["mlp.fc2.weight"]
    assert master.dtype == torch.float32 and model.dtype == torch.bfloat16
    assert t["optimizer.state.exp_avg.mlp.fc1.weight.up"].dtype == torch.float32
    assert torch.equal(master.bfloat16(), model) and not torch.equal(master, model.float())


# ----------------------------------------------------------------------------------------------
# single-process tests
# ----------------------------------------------------------------------------------------------
def test_flat_range_to_boxes_exact_cover():
    rnd = random.Random(0)
    for _ in range(200):
        shape = tuple(rnd.randint(1, 4) for _ in range(rnd.randint(1, 4)))
        n = torch.Size(shape).numel()
        a = rnd.randint(0, n)
        b = rnd.randint(a, n)
        idx = torch.arange(n).view(shape)
        boxes = flat_range_to_boxes(shape, a, b)
        assert len(boxes) <= 2 * len(shape) - 1
        got = torch.cat([idx[tuple(slice(o, o + s) for o, s in zip(off, size))].reshape(-1) for off, size in boxes]) if boxes else torch.zeros(0, dtype=torch.long)
        assert torch.equal(got, torch.arange(a, b))
    assert flat_range_to_boxes((4, 5), 3, 17) == [((0, 3), (1, 2)), ((1, 0), (2, 5)), ((3, 0), (1, 2))]


class Net(torch.nn.Module):
    def __init__(self, hidden=4, name="lin"):
        super().__init__()
        self.name = name
        self.lin = torch.nn.Linear(3, hidden)
        self.out = torch.nn.Linear(hidden, 2)

    def forward(self, x):
        return self.out(torch.tanh(self.lin(x)))

    def sharded_state_dict(self):
        return {k: ShardedTensor.from_rank_offsets(f"{self.name if k.startswith('lin') else 'out'}.{k.split('.')[1]}", v)
                for k, v in self.state_dict().items() if "." in k}


def _steps(model, opt, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        model(torch.randn(5, 3, generator=g)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()


def test_keys_shapes_and_identity_mapping():
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    _steps(model, opt, 1)
    msd = model.sharded_state_dict()
    id_map = get_param_id_to_sharded_param_map(msd, [p for g in opt.param_groups for p in g["params"]])
    assert [id_map[i].key for i in range(4)] == ["lin.weight", "lin.bias", "out.weight", "out.bias"]
    osd = optimizer_sharded_state_dict(opt, msd)
    ea = osd["state"][0]["exp_avg"]
    assert ea.key == "optimizer.state.exp_avg.lin.weight" and ea.global_shape == (4, 3)
    assert ea.data is opt.state[model.lin.weight]["exp_avg"]
    # scalars are ShardedObjects in their place (Megatron-Core's key scheme), no other entries
    step = osd["state"][0]["step"]
    assert isinstance(step, ci.ShardedObject) and step.key == "optimizer.state.step.lin.weight"
    assert step.data == 1 and set(osd["state"][0]) == {"exp_avg", "exp_avg_sq", "step"}
    assert isinstance(osd["param_groups"][0]["params"], ci.LocalNonpersistentObject)


def test_roundtrip_fresh_optimizer_and_megatron_style_flow(tmp_path):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD([{"params": [model.lin.weight, model.lin.bias], "lr": 0.1},
                           {"params": [model.out.weight, model.out.bias], "lr": 0.2}], momentum=0.9)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, 0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    _steps(model, opt, 2)
    sched.step()
    msd = model.sharded_state_dict()
    ci.save({"model": msd, "optimizer": optimizer_sharded_state_dict(opt, msd),
             "lr_scheduler": sched.state_dict(), "grad_scaler": scaler.state_dict()}, tmp_path / "c")
    assert has_optimizer_state(tmp_path / "c")

    # (a) high-level: fresh optimizer, no step taken
    model2 = Net()
    model2.load_state_dict(model.state_dict())
    opt2 = torch.optim.SGD([{"params": [model2.lin.weight, model2.lin.bias]}, {"params": [model2.out.weight, model2.out.bias]}], lr=1.0, momentum=0.9)
    assert load_optimizer_state(opt2, model2.sharded_state_dict(), tmp_path / "c") == {}
    assert [g["lr"] for g in opt2.param_groups] == [0.05, 0.1]
    for p, p2 in zip(model.parameters(), model2.parameters()):
        assert torch.equal(opt.state[p]["momentum_buffer"], opt2.state[p2]["momentum_buffer"])
    _steps(model, opt, 2, seed=1)
    _steps(model2, opt2, 2, seed=1)
    for p, p2 in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, p2)

    # (b) Megatron-style: one ci.load of model + optimizer, explicit state init
    model3 = Net()
    opt3 = torch.optim.SGD(model3.parameters(), lr=1.0, momentum=0.9)
    opt3.param_groups[0]["params"] = [model3.lin.weight, model3.lin.bias]
    opt3.add_param_group({"params": [model3.out.weight, model3.out.bias]})
    msd3 = model3.sharded_state_dict()
    loaded = ci.load({"model": msd3, "optimizer": optimizer_sharded_state_dict(opt3, msd3, init_state=True)}, tmp_path / "c")
    opt3.load_state_dict(sharding_state_to_optim_state(loaded["optimizer"]))
    sched3 = torch.optim.lr_scheduler.ExponentialLR(opt3, 0.5)
    sched3.load_state_dict(loaded["lr_scheduler"])
    scaler3 = torch.amp.GradScaler("cpu")
    scaler3.load_state_dict(loaded["grad_scaler"])
    assert scaler3.get_scale() == 1024.0 and sched3.last_epoch == 1
    assert torch.equal(opt3.state[model3.out.bias]["momentum_buffer"], loaded["optimizer"]["state"][3]["momentum_buffer"])


def test_adam_step_scalar_restored_lazily(tmp_path):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    _steps(model, opt, 3)
    msd = model.sharded_state_dict()
    ci.save({"model": msd, "optimizer": optimizer_sharded_state_dict(opt, msd)}, tmp_path / "c")
    model2 = Net()
    model2.load_state_dict(model.state_dict())
    opt2 = torch.optim.AdamW(model2.parameters(), lr=0.1)
    assert not opt2.state
    load_optimizer_state(opt2, model2.sharded_state_dict(), tmp_path / "c")
    assert opt2.state[model2.lin.weight]["step"] == 3
    _steps(model, opt, 1, seed=5)
    _steps(model2, opt2, 1, seed=5)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))


def _earlier_version_state(model, opt):
    """The optimizer sharded state dict as versions before in-place scalars wrote it: tensors
    under the same keys, scalars and tensor names in one ``param_state`` object per param."""
    from ckpt_integration.optimizer.sharding import PARAM_META_KEY, param_object, make_sharded_optimizer_tensor

    msd = model.sharded_state_dict()
    id_map = get_param_id_to_sharded_param_map(msd, list(model.parameters()))
    sd = opt.state_dict()
    state = {}
    for pid, st in sd["state"].items():
        tensors = {n: v for n, v in st.items() if v.dim() > 0}
        entry = {n: make_sharded_optimizer_tensor(id_map[pid], v, f"optimizer.state.{n}") for n, v in tensors.items()}
        entry[PARAM_META_KEY] = param_object(f"optimizer.param_state.{id_map[pid].key}", id_map[pid], {
            "tensors": {n: str(v.dtype).replace("torch.", "") for n, v in tensors.items()},
            "scalars": {n: v.clone() for n, v in st.items() if v.dim() == 0}})
        state[pid] = entry
    sd["state"] = state
    for g in sd["param_groups"]:
        g["params"] = ci.LocalNonpersistentObject(g["params"])
    return {"model": msd, "optimizer": sd}


def test_checkpoint_of_an_earlier_version_still_loads(tmp_path):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    _steps(model, opt, 2)
    ci.save(_earlier_version_state(model, opt), tmp_path / "c")
    model2 = Net()
    model2.load_state_dict(model.state_dict())
    opt2 = torch.optim.AdamW(model2.parameters(), lr=0.7)
    load_optimizer_state(opt2, model2.sharded_state_dict(), tmp_path / "c")
    for p, q in zip(model.parameters(), model2.parameters()):
        assert all(torch.equal(opt.state[p][k], opt2.state[q][k]) for k in ("step", "exp_avg", "exp_avg_sq"))
    assert opt2.param_groups[0]["lr"] == 0.1


def test_unmatched_parameter_is_named():
    model = Net()
    extra = torch.nn.Parameter(torch.zeros(7))
    model.register_parameter("stray", extra)
    opt = torch.optim.Adam(model.parameters())
    with pytest.raises(UnmatchedParameterError, match=r"'stray'.*shape \(7,\)"):
        optimizer_sharded_state_dict(opt, model.sharded_state_dict(), module=model)


def test_changed_shapes_and_names_are_reported(tmp_path):
    model = Net()
    opt = torch.optim.Adam(model.parameters())
    _steps(model, opt, 1)
    msd = model.sharded_state_dict()
    ci.save({"model": msd, "optimizer": optimizer_sharded_state_dict(opt, msd)}, tmp_path / "c")
    wider = Net(hidden=6)  # lin.* and out.weight change shape
    opt_w = torch.optim.Adam(wider.parameters())
    with pytest.raises(OptimizerStateMismatchError) as e:
        load_optimizer_state(opt_w, wider.sharded_state_dict(), tmp_path / "c")
    msg = str(e.value)
    assert "'lin.weight'" in msg and "'out.weight'" in msg and "(6, 3)" in msg and "'out.bias'" not in msg
    renamed = Net(name="proj")
    opt_r = torch.optim.Adam(renamed.parameters())
    with pytest.raises(OptimizerStateMismatchError, match=r"proj\.weight.*no optimizer state"):
        load_optimizer_state(opt_r, renamed.sharded_state_dict(), tmp_path / "c")


def test_checkpoint_without_optimizer_state(tmp_path):
    model = Net()
    ci.save({"model": model.sharded_state_dict()}, tmp_path / "c")
    assert not has_optimizer_state(tmp_path / "c")
    opt = torch.optim.Adam(model.parameters(), lr=0.3)
    with pytest.raises(OptimizerStateNotFoundError, match="saved without optimizer state.*missing_ok=True") as e:
        load_optimizer_state(opt, model.sharded_state_dict(), tmp_path / "c")
    assert isinstance(e.value, ci.CheckpointingException)
    assert load_optimizer_state(opt, model.sharded_state_dict(), tmp_path / "c", missing_ok=True) is None
    assert not opt.state and opt.param_groups[0]["lr"] == 0.3
    zero = ZeroShardedOptimizer(model.parameters(), torch.optim.Adam)
    with pytest.raises(OptimizerStateNotFoundError):
        zero.load_checkpoint(model.sharded_state_dict(), tmp_path / "c")
    assert zero.load_checkpoint(model.sharded_state_dict(), tmp_path / "c", missing_ok=True) is False


def test_zero_single_rank_matches_plain_adam_and_loads_into_it(tmp_path):
    torch.manual_seed(0)
    a, b = Net(), Net()
    b.load_state_dict(a.state_dict())
    opt_a = torch.optim.Adam(a.parameters(), lr=0.1)
    zero = ZeroShardedOptimizer(b.parameters(), torch.optim.Adam, lr=0.1)
    _steps(a, opt_a, 2)
    _steps(b, zero, 2)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    msd = b.sharded_state_dict()
    ci.save({"model": msd, "optimizer": zero.sharded_state_dict(msd)}, tmp_path / "z")
    c = Net()
    c.load_state_dict(b.state_dict())
    opt_c = torch.optim.Adam(c.parameters(), lr=0.5)
    assert set(load_optimizer_state(opt_c, c.sharded_state_dict(), tmp_path / "z")[0]) == {"fp32_param"}
    for p, q in zip(a.parameters(), c.parameters()):
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt_a.state[p][name], opt_c.state[q][name])
    assert opt_c.param_groups[0]["lr"] == 0.1


def test_optimizer_state_of_a_parameter_saved_as_a_transposed_view_is_transposed_too(tmp_path):
    """A weight kept as [in, out] (GPT-2's Conv1D) and checkpointed as the view ``w.t()`` ([out, in], so the
    load fills it in place): its Adam state was filed by a reshape, not the transpose, so every resharded
    load, ``load_plain_tensors``, export and convert returned state that belongs to other weights
    (``verify_state`` agreed: the fingerprints were of that same wrong layout)."""
    from ckpt_integration.optimizer import ZeroShardedOptimizer, optimizer_sharded_state_dict

    w = torch.nn.Parameter(torch.arange(12.0).reshape(3, 4))
    opt = torch.optim.Adam([w])
    opt.state[w] = {"step": torch.tensor(2.0), "exp_avg": 100 + torch.arange(12.0).reshape(3, 4),
                    "exp_avg_sq": 200 + torch.arange(12.0).reshape(3, 4)}
    msd = {"fc.weight": ShardedTensor.from_rank_offsets("fc.weight", w.detach().t())}
    ci.save({"model": msd, "optimizer": optimizer_sharded_state_dict(opt, msd)}, tmp_path / "c")
    plain = ci.load_plain_tensors(tmp_path / "c")
    assert torch.equal(plain["fc.weight"], w.detach().t())
    for name in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(plain[f"optimizer.state.{name}.fc.weight"], opt.state[w][name].t()), name
    # back into a fresh optimizer of the same view (both ways of loading), and resharded by rows of the view
    for how in ("load_optimizer_state", "request"):
        v = torch.nn.Parameter(torch.zeros(3, 4))
        fresh = torch.optim.Adam([v])
        vsd = {"fc.weight": ShardedTensor.from_rank_offsets("fc.weight", v.detach().t())}
        if how == "load_optimizer_state":
            load_optimizer_state(fresh, vsd, tmp_path / "c")
        else:
            loaded = ci.load({"optimizer": optimizer_sharded_state_dict(fresh, vsd, init_state=True)}, tmp_path / "c")
            fresh.load_state_dict(loaded["optimizer"])
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(fresh.state[v][name], opt.state[w][name]), (how, name)
    rows = ci.load({"r": ShardedTensor.from_rank_offsets("optimizer.state.exp_avg.fc.weight", torch.zeros(2, 3), (0, 1, 2))},
                   tmp_path / "c", validate_access_integrity=False)["r"]
    assert torch.equal(rows, opt.state[w]["exp_avg"].t()[2:])
    # ZeRO keeps a flat buffer in the parameter's order: refused, naming the key
    zero = ZeroShardedOptimizer([w], torch.optim.Adam)
    with pytest.raises(ci.CheckpointingException, match="'fc.weight' is saved as a transposed or permuted view"):
        zero.sharded_state_dict(msd)


def test_a_plain_checkpoint_whose_params_stepped_differently_is_refused_by_zero(tmp_path):
    """ZeRO steps all its params as one (one ``step``); a plain Adam checkpoint where one param got its
    first gradient a step later holds two. The load took the first param's ``step`` for all, which
    changes the other's bias correction without a word."""
    from ckpt_integration.optimizer import OptimizerStateMismatchError, ZeroShardedOptimizer, optimizer_sharded_state_dict

    a, b = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.Adam([a, b])
    for step in range(3):
        a.grad = torch.full((4,), 0.5)
        b.grad = torch.full((2,), 0.25) if step else None  # b's first gradient at the second step
        opt.step()
    assert opt.state[a]["step"] == 3 and opt.state[b]["step"] == 2
    msd = {"a": ShardedTensor.from_rank_offsets("a", a.detach()), "b": ShardedTensor.from_rank_offsets("b", b.detach())}
    ci.save({"model": msd, "optimizer": optimizer_sharded_state_dict(opt, msd)}, tmp_path / "c")
    zero = ZeroShardedOptimizer([a, b], torch.optim.Adam)
    with pytest.raises(OptimizerStateMismatchError, match=r"one 'step' for all .*'a': step=3\.0; 'b': step=2\.0"):
        zero.load_checkpoint(msd, tmp_path / "c")
    fresh = torch.optim.Adam([a, b])  # (what the message suggests: exact)
    load_optimizer_state(fresh, msd, tmp_path / "c")
    assert fresh.state[a]["step"] == 3 and fresh.state[b]["step"] == 2


def test_stacked_layers_with_a_layer_the_optimizer_has_no_state_for(tmp_path):
    """Layers stacked under one key (``prepend_axis_num=1``) where one layer has no Adam state (frozen, or
    an expert that got no tokens yet): the stacked state had a hole, so every save was refused (a
    generic "main replicas cover 18 of 24 elements"), i.e. no checkpoint at all. Now such a layer is
    saved with the state Adam creates at its first step (zeros, step 0: that step does the same from it),
    and the resumed run goes on exactly as the uninterrupted one."""
    from ckpt_integration.optimizer import optimizer_sharded_state_dict

    def run(ws, opt, steps):
        for _ in range(steps):
            for i, w in enumerate(ws):
                w.grad = None if i == 1 else torch.full_like(w, 0.1 * (i + 1))  # layer 1 never gets a gradient
            opt.step()

    def msd(ws):
        return {f"l{i}": ShardedTensor.from_rank_offsets("layers.w", w.detach(), (0, i, 4), prepend_axis_num=1)
                for i, w in enumerate(ws)}

    ws = [torch.nn.Parameter(torch.full((3, 2), float(i))) for i in range(4)]
    opt = torch.optim.Adam(ws, lr=0.1)
    run(ws, opt, 2)
    assert ws[1] not in opt.state
    ci.save({"model": msd(ws), "optimizer": optimizer_sharded_state_dict(opt, msd(ws))}, tmp_path / "c")
    vs = [torch.nn.Parameter(torch.zeros(3, 2)) for _ in range(4)]
    ci.load(msd(vs), tmp_path / "c")
    fresh = torch.optim.Adam(vs, lr=0.1)
    load_optimizer_state(fresh, msd(vs), tmp_path / "c")
    for i in (0, 2, 3):
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(fresh.state[vs[i]][name], opt.state[ws[i]][name]), (i, name)
    ws[1].requires_grad_(True)  # (layer 1 gets its first gradient after the resume too)
    for a, b in ((ws, opt), (vs, fresh)):
        run(a, b, 1)
        a[1].grad = torch.full_like(a[1], 0.3)
        b.step()
    assert all(torch.equal(a, b) for a, b in zip(ws, vs))
    # an optimizer with no state at all stays as it was: its sharded state dict holds none (saved: none;
    # as a request: loads none), not placeholders for its stacked layers only
    cold = [torch.nn.Parameter(torch.zeros(3, 2)) for _ in range(4)]
    assert optimizer_sharded_state_dict(torch.optim.Adam(cold), msd(cold))["state"] == {}
    # a frozen layer left out of the optimizer leaves a gap no placeholder can fill: the error says so
    frozen = torch.optim.Adam([ws[0], ws[2], ws[3]])
    run([ws[0], ws[2], ws[3]], frozen, 1)
    with pytest.raises(ci.errors.ShardingIntegrityError, match=r"optimizer state is sharded like its parameter.*frozen"):
        ci.save({"optimizer": optimizer_sharded_state_dict(frozen, msd(ws))}, tmp_path / "d")


class _Tied(torch.nn.Module):
    """An embedding tied to the output layer; ``head_first`` declares the two in the other order."""

    def __init__(self, head_first: bool):
        super().__init__()
        for name in (("head", "emb") if head_first else ("emb", "head")):
            setattr(self, name, torch.nn.Linear(4, 10, bias=False) if name == "head" else torch.nn.Embedding(10, 4))
        self.head.weight = self.emb.weight
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.head(self.fc(self.emb(x))).pow(2).sum()


@pytest.mark.parametrize("zero", [False, True])
def test_a_tied_weight_declared_in_another_order_loads_its_optimizer_state(tmp_path, zero):
    """The optimizer state of a tied weight is keyed by the name the model's state dict lists first
    (``emb.weight``). A module declaring ``head`` first asked for ``head.weight``'s state, found the
    weight itself in the checkpoint, took it for a parameter without state and loaded none: Adam restarted
    for the embedding without a word; under ZeRO its fp32 master stayed zero and the next step wiped it."""
    from ckpt_integration.modules import default_sharded_state_dict

    def optimizer(m):
        return ZeroShardedOptimizer(list(m.parameters()), torch.optim.Adam, lr=0.01) if zero else \
            torch.optim.Adam(m.parameters(), lr=0.01)

    torch.manual_seed(0)
    a = _Tied(head_first=False)
    opt_a = optimizer(a)
    for _ in range(3):
        a(torch.arange(10)).backward()
        opt_a.step()
        opt_a.zero_grad()
    msd = default_sharded_state_dict(a)
    sd = opt_a.sharded_state_dict(msd) if zero else optimizer_sharded_state_dict(opt_a, msd)
    ci.save({"model": msd, "optimizer": sd}, tmp_path / "c")
    b = _Tied(head_first=True)
    msd_b = default_sharded_state_dict(b)
    ci.load({"model": msd_b}, tmp_path / "c")
    opt_b = optimizer(b)
    if zero:
        opt_b.load_checkpoint(msd_b, tmp_path / "c")
        assert torch.equal(opt_b.main_param, opt_a.main_param)
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt_b.optimizer.state[opt_b.main_param][name], opt_a.optimizer.state[opt_a.main_param][name])
    else:
        load_optimizer_state(opt_b, msd_b, tmp_path / "c")
        for p, q in zip(a.parameters(), b.parameters()):
            assert p.shape == q.shape and sorted(opt_b.state[q]) == ["exp_avg", "exp_avg_sq", "step"]
            for name in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(opt_a.state[p][name], opt_b.state[q][name]), name
    for m, o in ((a, opt_a), (b, opt_b)):  # and they go on alike
        m(torch.arange(10)).backward()
        o.step()
    assert torch.equal(a.emb.weight, b.emb.weight) and torch.equal(a.fc.weight, b.fc.weight)


def test_zero_masters_of_a_param_the_checkpoint_holds_no_state_for_are_its_weights(tmp_path):
    """A layer frozen (left out of the ZeRO optimizer) at the save and trained after the resume: its masters
    stayed zero (the checkpoint's masters were copied over the whole slice), and the next step wrote about
    zero into its weights."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    m[0].requires_grad_(False)
    z = ZeroShardedOptimizer([p for p in m.parameters() if p.requires_grad], torch.optim.Adam, lr=0.01)
    m(torch.randn(3, 4)).sum().backward()
    z.step()
    from ckpt_integration.modules import default_sharded_state_dict

    msd = default_sharded_state_dict(m)
    ci.save({"model": msd, "optimizer": z.sharded_state_dict(msd)}, tmp_path / "c")
    m2 = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    msd2 = default_sharded_state_dict(m2)
    ci.load({"model": msd2}, tmp_path / "c")
    z2 = ZeroShardedOptimizer(list(m2.parameters()), torch.optim.Adam, lr=0.01)
    z2.load_checkpoint(msd2, tmp_path / "c")
    assert torch.equal(z2.main_param, torch.cat([p.detach().reshape(-1) for p in m2.parameters()]))
    assert torch.equal(z2.main_param[20:], z.main_param)  # (layer 0: 16 weights and 4 biases)


@pytest.mark.parametrize("scalar_first", [False, True])
def test_a_zero_dim_parameter_between_a_plain_and_a_zero_optimizer(tmp_path, scalar_first):
    """A learned scalar (``nn.Parameter(torch.tensor(1.5))``): a plain optimizer saves its ``exp_avg`` as an
    object (one element). Loaded by ZeRO it was taken for an optimizer-wide scalar such as ``step``: its
    elements of the flat buffers stayed 0.0 (last param) or a 0-dim tensor replaced a whole buffer and the
    next step failed (first param)."""
    from ckpt_integration.modules import default_sharded_state_dict

    def model():
        m = torch.nn.Module()
        names = ("s", "fc") if scalar_first else ("fc", "s")
        for n in names:
            setattr(m, n, torch.nn.Parameter(torch.tensor(1.5)) if n == "s" else torch.nn.Linear(3, 2))
        return m

    def train(m, opt):
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            (m.fc(torch.randn(4, 3, generator=g)) * m.s).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()

    torch.manual_seed(0)
    ref = model()
    opt = torch.optim.Adam(ref.parameters(), lr=0.1)
    train(ref, opt)
    msd = default_sharded_state_dict(ref)
    ci.save({"model": msd, "optimizer": optimizer_sharded_state_dict(opt, msd)}, tmp_path / "plain")
    m = model()
    msd = default_sharded_state_dict(m)
    ci.load({"model": msd}, tmp_path / "plain")
    z = ZeroShardedOptimizer(list(m.parameters()), torch.optim.Adam, lr=0.1)
    z.load_checkpoint(msd, tmp_path / "plain")
    st = z.optimizer.state[z.main_param]
    for name in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(st[name], torch.cat([opt.state[p][name].reshape(-1) for p in ref.parameters()])), name
    assert torch.equal(st["step"], torch.tensor(3.0))
    g = torch.Generator().manual_seed(9)
    for mm, o in ((ref, opt), (m, z)):
        (mm.fc(torch.randn(4, 3, generator=g.manual_seed(9))) * mm.s).pow(2).sum().backward()
        o.step()
    assert all(torch.equal(p, q) for p, q in zip(ref.parameters(), m.parameters()))


@pytest.mark.parametrize("saved,loaded,lacking", [("RMSprop", "Adagrad", "sum"), ("Adam", "NAdam", "mu_product"),
                                                  ("Adam", "Adamax", "exp_inf"), ("Adagrad", "Adadelta", "square_avg")])
def test_a_checkpoint_of_another_optimizer_kind_is_refused_by_name(tmp_path, saved, loaded, lacking):
    """Adagrad, NAdam, Adamax, Adadelta, ASGD, Rprop, RAdam were not known to the check: a checkpoint of another
    kind loaded, and torch failed later with a bare ``KeyError`` (at the next step, or inside the load); the
    same kind loads exactly."""
    from ckpt_integration.modules import default_sharded_state_dict

    def trained(kind):
        torch.manual_seed(0)
        m = torch.nn.Linear(3, 2)
        o = getattr(torch.optim, kind)(m.parameters(), lr=0.01)
        m(torch.randn(4, 3)).sum().backward()
        o.step()
        return m, o

    m, o = trained(saved)
    msd = default_sharded_state_dict(m)
    ci.save({"model": msd, "optimizer": optimizer_sharded_state_dict(o, msd)}, tmp_path / "c")
    m2 = torch.nn.Linear(3, 2)
    with pytest.raises(OptimizerStateMismatchError, match=rf"(?s)does not fit {loaded}.*parameter 'weight'[^\n]*: no {lacking}"):
        load_optimizer_state(getattr(torch.optim, loaded)(m2.parameters()), default_sharded_state_dict(m2),
                             tmp_path / "c", module=m2)
    for kind in ("Adagrad", "NAdam", "Adamax", "Adadelta", "ASGD", "Rprop", "RAdam"):
        m, o = trained(kind)
        msd = default_sharded_state_dict(m)
        ci.save({"model": msd, "optimizer": optimizer_sharded_state_dict(o, msd)}, tmp_path / kind)
        fresh = getattr(torch.optim, kind)(m.parameters(), lr=0.01)
        load_optimizer_state(fresh, msd, tmp_path / kind)
        for p in m.parameters():
            assert sorted(fresh.state[p]) == sorted(o.state[p]), kind
            assert all(torch.equal(fresh.state[p][n], o.state[p][n]) for n in o.state[p]), kind
