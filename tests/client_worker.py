"""A few training steps through a training library on CPU, for tests/test_clients.py.

It never imports amp_bn_fix: only the environment (``AMP_BN_FIX=1``) can enable the shim. The
model is the ResNet of ``bn_probe``; every BatchNorm call is checked against float64
(``bn_probe.Watch``). Writes what it saw to OUT_JSON::

    python tests/client_worker.py CLIENT OUT_JSON

CLIENT is ``lightning-bf16-mixed``, ``lightning-bf16-true``, ``lightning-16-true`` or ``accelerate-bf16``.
"""

from __future__ import annotations

import json
import math
import pathlib
import sys
import warnings
from typing import Any, Callable, Dict, List

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from bn_probe import Watch, bn_modules, resnet, shim_state

STEPS = 3
BATCH = 8


def dataset() -> TensorDataset:
    data = torch.Generator().manual_seed(0)
    x = torch.randn(STEPS * BATCH, 3, 16, 16, generator=data) * 20 + 50
    y = torch.randint(0, 4, (STEPS * BATCH,), generator=data)
    return TensorDataset(x, y)


def lightning(precision: str) -> Callable[[], Dict[str, Any]]:
    def run() -> Dict[str, Any]:
        try:
            import lightning.pytorch as pl
        except ImportError:
            import pytorch_lightning as pl

        torch.manual_seed(0)
        net = resnet()
        watch = Watch(bn_modules(net))
        losses: List[float] = []

        class Module(pl.LightningModule):
            def __init__(self) -> None:
                super().__init__()
                self.net = net

            def training_step(self, batch, batch_idx):
                x, y = batch
                loss = F.cross_entropy(self.net(x), y)
                losses.append(loss.item())
                return loss

            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.05)

        trainer = pl.Trainer(
            accelerator="cpu", devices=1, precision=precision, max_steps=STEPS, max_epochs=1,
            logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        )
        trainer.fit(Module(), DataLoader(dataset(), batch_size=BATCH))
        return report(net, watch, losses, trainer.precision)

    return run


def accelerate_bf16() -> Dict[str, Any]:
    from accelerate import Accelerator

    accelerator = Accelerator(mixed_precision="bf16", cpu=True)
    torch.manual_seed(0)
    net = resnet()
    watch = Watch(bn_modules(net))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05)
    model, optimizer, loader = accelerator.prepare(net, optimizer, DataLoader(dataset(), batch_size=BATCH))
    losses: List[float] = []
    model.train()
    for x, y in loader:
        loss = F.cross_entropy(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return report(net, watch, losses, accelerator.mixed_precision)


def report(net: torch.nn.Module, watch: Watch, losses: List[float], precision: Any) -> Dict[str, Any]:
    bns = bn_modules(net)
    return {
        "shim": shim_state(),
        "precision": str(precision),
        "calls": watch.calls,
        "losses": losses,
        "losses_finite": bool(losses) and all(map(math.isfinite, losses)),
        "stats_dtypes": sorted({str(t.dtype) for m in bns for t in (m.running_mean, m.running_var)}),
        "stats_finite": all(bool(torch.isfinite(t).all()) for m in bns for t in (m.running_mean, m.running_var)),
        "param_dtypes": sorted({str(p.dtype) for p in net.parameters()}),
        "stats_moved": all(bool((m.running_var != 1).any()) for m in bns),
    }


CLIENTS = {
    "lightning-bf16-mixed": lightning("bf16-mixed"),
    "lightning-bf16-true": lightning("bf16-true"),
    "lightning-16-true": lightning("16-true"),
    "accelerate-bf16": accelerate_bf16,
}


if __name__ == "__main__":
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")  # the clients' advice (num_workers, ...) is not what is tested
    client, out = sys.argv[1], pathlib.Path(sys.argv[2])
    out.write_text(json.dumps(CLIENTS[client]()))
