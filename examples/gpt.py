"""A tiny GPT-style character LM with hand-written tensor parallelism (Megatron style).

Attention QKV and MLP fc1 are column-parallel (QKV fused, stored as reshardable q/k/v
parts), attention output and MLP fc2 are row-parallel; embeddings, norms and the LM
head are replicated. Weights are initialised from the *global* tensors with a fixed
seed, so every TP size starts from the same model. Works with gloo (CPU) and NCCL.
"""

from __future__ import annotations

import random
from typing import Any, List, Optional

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from ckpt_integration.modules import ParallelLayout, ShardedModuleMixin

# ------------------------------------------------------------------------------------------------
# data: a generated, deterministic character-level corpus
# ------------------------------------------------------------------------------------------------
_WORDS = ("the a one small quick lazy brown red old new model layer tensor shard rank saves loads "
          "checkpoint resumes trains runs over under with from into fox dog cat bird tree river "
          "and but so then while because").split()


def make_corpus(n_chars: int = 16000, seed: int = 0) -> str:
    """Pseudo-English sentences from a fixed word list (same text for every seed value)."""
    rnd = random.Random(seed)
    out: List[str] = []
    size = 0
    while size < n_chars:
        s = " ".join(rnd.choice(_WORDS) for _ in range(rnd.randint(4, 9))).capitalize() + ". "
        out.append(s)
        size += len(s)
    return "".join(out)[:n_chars]


class CharDataset(Dataset):
    """Non-overlapping windows of ``block_size + 1`` characters as (input, target) pairs."""

    def __init__(self, text: str, block_size: int):
        self.chars = sorted(set(text))
        self.stoi = {c: i for i, c in enumerate(self.chars)}
        self.data = torch.tensor([self.stoi[c] for c in text], dtype=torch.long)
        self.block = block_size
        self.n = (len(self.data) - 1) // block_size

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        chunk = self.data[i * self.block: i * self.block + self.block + 1]
        return chunk[:-1], chunk[1:]


# ------------------------------------------------------------------------------------------------
# tensor-parallel building blocks
# ------------------------------------------------------------------------------------------------
class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
        dist.all_reduce(g, group=ctx.group)
        return g, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, g):
        return g, None


def copy_to_tp(x: torch.Tensor, lay: ParallelLayout) -> torch.Tensor:
    return _CopyToTP.apply(x, lay.tp_group) if lay.tp_size > 1 else x


def reduce_from_tp(x: torch.Tensor, lay: ParallelLayout) -> torch.Tensor:
    return _ReduceFromTP.apply(x, lay.tp_group) if lay.tp_size > 1 else x


def _global_init(gen: torch.Generator, *shape: int, std: float = 0.02) -> torch.Tensor:
    # drawn on the CPU generator whatever the default device is (Lightning's configure_model runs
    # under the accelerator's device context), so every layout and device sees the same weights
    return torch.randn(*shape, generator=gen, device="cpu") * std


class ColumnParallelLinear(ShardedModuleMixin, nn.Module):
    """``y = x W_r^T + b_r`` with the output features split over TP ranks (``num_parts`` fused blocks)."""

    def __init__(self, w: torch.Tensor, lay: ParallelLayout, num_parts: int = 1):
        super().__init__()
        self.parallel_layout = lay
        self.tp_axes = {"weight": 0, "bias": 0} if num_parts == 1 else {"weight": f"fused:{num_parts}", "bias": f"fused:{num_parts}"}
        parts = w.chunk(num_parts, dim=0)
        local = torch.cat([p.chunk(lay.tp_size, dim=0)[lay.tp_rank] for p in parts], dim=0)
        self.weight = nn.Parameter(local.clone())
        self.bias = nn.Parameter(torch.zeros(local.shape[0]))

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(ShardedModuleMixin, nn.Module):
    """``y = sum_r x_r W_r^T + b`` with the input features split over TP ranks; bias replicated."""

    tp_axes = {"weight": 1}

    def __init__(self, w: torch.Tensor, lay: ParallelLayout):
        super().__init__()
        self.parallel_layout = lay
        self.weight = nn.Parameter(w.chunk(lay.tp_size, dim=1)[lay.tp_rank].clone())
        self.bias = nn.Parameter(torch.zeros(w.shape[0]))

    def forward(self, x):
        return reduce_from_tp(F.linear(x, self.weight), self.parallel_layout) + self.bias


class Block(nn.Module):
    def __init__(self, d: int, n_heads: int, lay: ParallelLayout, gen: torch.Generator):
        super().__init__()
        assert n_heads % lay.tp_size == 0, "n_heads must be divisible by the TP size"
        self.lay, self.heads, self.d = lay, n_heads // lay.tp_size, d
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv = ColumnParallelLinear(_global_init(gen, 3 * d, d), lay, num_parts=3)
        self.proj = RowParallelLinear(_global_init(gen, d, d), lay)
        self.fc1 = ColumnParallelLinear(_global_init(gen, 4 * d, d), lay)
        self.fc2 = RowParallelLinear(_global_init(gen, d, 4 * d), lay)

    def forward(self, x):
        B, T, _ = x.shape
        h = copy_to_tp(self.ln1(x), self.lay)
        q, k, v = self.qkv(h).split(self.d // self.lay.tp_size, dim=-1)
        q, k, v = (t.view(B, T, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, -1)
        x = x + self.proj(y)
        h = copy_to_tp(self.ln2(x), self.lay)
        return x + self.fc2(F.gelu(self.fc1(h)))


class DTensorBlock(nn.Module):
    """:class:`Block` with plain ``nn.Linear`` layers, for ``ModelParallelStrategy``: tensor parallelism
    comes from ``parallelize_module`` (DTensor), FSDP2 from ``fully_shard`` (see :func:`parallelize`).

    Same global weights as :class:`Block` (drawn in the same order), and the same weight keys:
    :meth:`sharded_state_dict` stores ``q``, ``k``, ``v`` under the names the fused, hand-written
    ``qkv`` uses (``qkv.weight.part0/1/2``), so the weights of either block load into the other
    (``load_from_checkpoint`` builds :class:`Block`). The optimizer state follows too: the fused QKV is
    one optimizer parameter in :class:`Block` and three here, and its moments and ``step`` are stored
    per part like the weights, so a run resumes under either block with the optimizer exactly.
    """

    def __init__(self, d: int, n_heads: int, gen: torch.Generator):
        super().__init__()
        self.head_dim = d // n_heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q, self.k, self.v = (nn.Linear(d, d) for _ in range(3))
        self.proj, self.fc1, self.fc2 = nn.Linear(d, d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        with torch.no_grad():
            for lin, w in zip((self.q, self.k, self.v), _global_init(gen, 3 * d, d).chunk(3)):
                lin.weight.copy_(w)
            for lin, shape in ((self.proj, (d, d)), (self.fc1, (4 * d, d)), (self.fc2, (d, 4 * d))):
                lin.weight.copy_(_global_init(gen, *shape))
            for lin in (self.q, self.k, self.v, self.proj, self.fc1, self.fc2):
                lin.bias.zero_()

    def forward(self, x):
        B, T, _ = x.shape
        h = self.ln1(x)
        # under tensor parallelism q/k/v hold this rank's heads only (column-parallel outputs)
        q, k, v = (lin(h).view(B, T, -1, self.head_dim).transpose(1, 2) for lin in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, -1)
        x = x + self.proj(y)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))

    def sharded_state_dict(self, prefix: str = "", metadata: Optional[dict] = None) -> dict:
        """The default (DTensor shards), with q/k/v keyed like the fused ``qkv`` parts of :class:`Block`."""
        from dataclasses import replace

        from ckpt_integration.modules import default_sharded_state_dict

        sd = default_sharded_state_dict(self, prefix, metadata)
        for i, name in enumerate("qkv"):
            for p in ("weight", "bias"):
                path = f"{prefix}{name}.{p}"
                if path in sd:  # absent where this rank's shard is empty
                    sd[path] = replace(sd[path], key=f"{prefix}qkv.{p}.part{i}")
        return sd


def parallelize(model: "GPT", mesh: Any) -> None:
    """DTensor tensor parallelism over ``mesh["tensor_parallel"]`` and FSDP2 over ``mesh["data_parallel"]``."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tp, dp = mesh["tensor_parallel"], mesh["data_parallel"]
    if tp.size() > 1:
        plan = {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(), "proj": RowwiseParallel(),
                "fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
        for b in model.blocks:
            parallelize_module(b, tp, plan)
    if dp.size() > 1:
        for b in model.blocks:
            fully_shard(b, mesh=dp)
        fully_shard(model, mesh=dp)


class GPT(nn.Module):
    """Token + position embeddings, ``n_layers`` TP blocks, final norm, replicated LM head."""

    def __init__(self, vocab: int, d: int, n_heads: int, n_layers: int, block: int, lay: ParallelLayout, seed: int = 0,
                 dtensor: bool = False):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(block, d)
        with torch.no_grad():
            self.tok.weight.copy_(_global_init(gen, vocab, d))
            self.pos.weight.copy_(_global_init(gen, block, d))
        self.blocks = nn.ModuleList(DTensorBlock(d, n_heads, gen) if dtensor else Block(d, n_heads, lay, gen)
                                    for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)
        with torch.no_grad():
            self.head.weight.copy_(_global_init(gen, vocab, d))
            self.head.bias.zero_()

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln_f(x))


class GPTModule(L.LightningModule):
    """LightningModule around :class:`GPT`; builds the model in ``configure_model``: hand-written TP
    from ``trainer.strategy.parallel_layout`` (``DistCkptDDPStrategy``), or DTensor TP + FSDP2 on
    ``self.device_mesh`` (``DistCkptModelParallelStrategy``). ``step_losses`` records the DP-averaged
    loss per step."""

    def __init__(self, vocab_size: int = 0, d_model: int = 32, n_heads: int = 4, n_layers: int = 2,
                 block_size: int = 32, lr: float = 3e-3, seed: int = 0, corpus_chars: int = 16000):
        super().__init__()
        self.save_hyperparameters()
        self.model: Optional[GPT] = None
        self.step_losses: List[Any] = []

    def configure_model(self) -> None:
        if self.model is not None:
            return
        h = self.hparams
        mesh = getattr(self, "_device_mesh", None)
        if mesh is not None:  # ModelParallelStrategy: plain layers, then DTensor TP and FSDP2
            self.model = GPT(h.vocab_size, h.d_model, h.n_heads, h.n_layers, h.block_size, ParallelLayout(), h.seed,
                             dtensor=True)
            parallelize(self.model, mesh)
            return
        # hand-written TP from DistCkptDDPStrategy's layout; without a Trainer (``load_from_checkpoint``)
        # or with another strategy: the whole model
        strategy = self._trainer.strategy if self._trainer is not None else None
        lay = getattr(strategy, "parallel_layout", None) or ParallelLayout()
        self.model = GPT(h.vocab_size, h.d_model, h.n_heads, h.n_layers, h.block_size, lay, h.seed)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        mean = self.trainer.strategy.reduce(loss.detach().clone(), reduce_op="mean")
        self.step_losses.append((int(self.global_step), float(mean)))
        self.log("train_loss", mean, prog_bar=True, rank_zero_only=True)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.8)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def make_dataloader(block_size: int, global_batch_size: int, dp_size: int, corpus_chars: int = 16000,
                    seed: int = 0) -> DataLoader:
    """Shuffled loader whose per-rank batch is ``global_batch_size / dp_size``. Under Lightning a
    ``DistributedSampler`` splits the windows over the DP ranks (padding with repeated windows when they do
    not divide), so the order of the windows, and by one the steps of an epoch, depend on the DP size."""
    if global_batch_size % dp_size:
        raise ValueError(f"global_batch_size {global_batch_size} must be divisible by the DP size {dp_size}")
    ds = CharDataset(make_corpus(corpus_chars, seed), block_size)
    return DataLoader(ds, batch_size=global_batch_size // dp_size, shuffle=True, drop_last=True)


def vocab_size(corpus_chars: int = 16000, seed: int = 0) -> int:
    return len(set(make_corpus(corpus_chars, seed)))
