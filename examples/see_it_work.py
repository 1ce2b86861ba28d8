"""See amp_bn_fix work in a training run: the three checks of docs/see-it-work.md in one script.

A small BatchNorm CNN trains for three epochs on synthetic data under CPU autocast (bfloat16), with
the shim enabled by its import. The script shows:

1. a forward hook on every BatchNorm that records its output dtype (float32 with the default
   policy ``fp32``; the input's 16-bit dtype natively or with ``input``);
2. ``amp_bn_fix.report(model)`` after each epoch: calls handled, passed through, and the guard's
   skips per module. Epoch 2 has one batch with an ``inf`` pixel, so the guard skips that batch's
   running-stat update in every BatchNorm it reaches;
3. with ``AMP_BN_FIX_REPORT=1`` in the environment, the one line the shim writes to stderr at exit.

``--route device`` runs the route a CUDA call takes (``amp_bn_fix.testing.device_route()``):
there the first skip does not warn, as on a GPU, where reading the decision would stall the host;
``report()`` finds it. ``--compile BACKEND`` compiles the model (``inductor``, or ``aot_eager``,
which compiles faster): the counters then count the calls traced, not the calls run.

    AMP_BN_FIX_REPORT=1 python examples/see_it_work.py
    python examples/see_it_work.py --route device
    python examples/see_it_work.py --compile aot_eager
"""

from __future__ import annotations

import argparse
import contextlib
from typing import Dict, Iterator, List, Optional

import torch
from torch import nn

import amp_bn_fix  # enables the shim; a linter that flags it as unused: amp_bn_fix.enable() below
from amp_bn_fix.testing import device_route

EPOCHS = 3
STEPS_PER_EPOCH = 4
INF_EPOCH = 2  # the epoch with one non-finite batch


def make_model() -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 4),
    )


@contextlib.contextmanager
def bn_output_dtypes(model: nn.Module) -> Iterator[Dict[str, torch.dtype]]:
    """{BatchNorm's path in model: its output dtype}, filled by forward hooks while the block runs.

    The hooks come off when the block ends: one step tells, and hooks left on would make a compiled
    model recompile."""
    seen: Dict[str, torch.dtype] = {}
    handles = [module.register_forward_hook(lambda m, args, out, name=name: seen.__setitem__(name, out.dtype))
               for name, module in model.named_modules() if isinstance(module, nn.modules.batchnorm._BatchNorm)]
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()


def skips_since(before: Dict[str, int], now: Dict[str, int]) -> Dict[str, int]:
    return {name: count - before.get(name, 0) for name, count in now.items() if count != before.get(name, 0)}


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--route", choices=("host", "device"), default="host",
                        help="host: the CPU's own route (default); device: the route a CUDA call takes")
    parser.add_argument("--compile", metavar="BACKEND", default="", help="torch.compile the model with this backend")
    args = parser.parse_args(argv)

    amp_bn_fix.enable()  # already on after the import; also what keeps the import "used"
    torch.manual_seed(0)
    model = make_model()
    run = torch.compile(model, backend=args.compile) if args.compile else model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu")
    data = torch.Generator().manual_seed(1)
    route = device_route() if args.route == "device" else contextlib.nullcontext()
    print(f"amp_bn_fix {amp_bn_fix.__version__}, policy {amp_bn_fix.get_policy()}, route {args.route}, "
          f"compile {args.compile or 'no'}")

    before = amp_bn_fix.report(model)
    with route:
        for epoch in range(1, EPOCHS + 1):
            for step in range(STEPS_PER_EPOCH):
                x = torch.randn(8, 3, 16, 16, generator=data)
                y = torch.randint(0, 4, (8,), generator=data)
                if epoch == INF_EPOCH and step == 1:
                    x[0, 0, 0, 0] = float("inf")  # GradScaler skips this step; the guard keeps the stats
                first = epoch == 1 and step == 0
                with bn_output_dtypes(model) if first else contextlib.nullcontext() as dtypes:
                    with torch.autocast("cpu", dtype=torch.bfloat16):
                        loss = nn.functional.cross_entropy(run(x).float(), y)
                if first:
                    print("BatchNorm output dtypes:", {name: str(d).replace("torch.", "") for name, d in dtypes.items()})
                optimizer.zero_grad(set_to_none=True)
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
            now = amp_bn_fix.report(model)
            handled = sum(now["handled"].values()) - sum(before["handled"].values())
            skips = skips_since(before["guard_skips"], now["guard_skips"])
            print(f"epoch {epoch}: BatchNorm calls handled {handled}, guard skips {skips or 'none'}")
            before = now
    finite = all(torch.isfinite(b).all().item() for m in model.modules()
                 if isinstance(m, nn.BatchNorm2d) for b in (m.running_mean, m.running_var))
    print(f"running stats finite: {'yes' if finite else 'NO'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
