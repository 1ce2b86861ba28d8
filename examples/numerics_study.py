"""Training numerics study: BatchNorm running statistics under mixed precision, without and with amp_bn_fix.

A small residual CNN with three BatchNorm2d layers learns to tell the orientation of noisy gratings
(synthetic, seeded, nothing downloaded). The images are raw 12-bit sensor counts (0-4095), not
normalized: the first BatchNorm is what normalizes them, and its per-channel variance is about 1e6,
far beyond float16's largest value (65504). The same model, data and batch order are trained:

- ``fp32 reference``: no autocast;
- ``autocast, native``: CPU autocast (bfloat16 by default) with the shim disabled;
- ``autocast + shim (P)``: the same with amp_bn_fix, for each policy P (fp32, input, autocast);
- ``.half(), native``: the model cast with ``.half()`` without the shim (float16 running stats);
- ``.half() + shim``: the same cast with the shim enabled and ``keep_fp32="all"`` (BatchNorm kept
  FP32 inside the model). The default, ``master``, leaves the model's buffers float16 as torch
  makes them and keeps the FP32 accuracy beside them; this study's running variance (~1e6) is
  beyond float16's range, so those buffers would show inf as plain torch's do, while the shim's own
  computation stays FP32: a model whose BatchNorm sees unnormalized features needs ``all``.

Per run it reports the relative error of running_mean/running_var against the FP32 reference at
every step, and against an fp64 running average of the batch statistics the run's own BatchNorms
received (which separates the arithmetic of the stats from differences in the training itself);
the final training loss, accuracy on held-out data (eval mode, so running stats) and the median
time per step. It prints a table and, when matplotlib is installed (the ``examples`` extra), plots
the errors.

A second scenario feeds one extra batch containing an ``inf`` pixel in the middle of autocast
training with ``torch.amp.GradScaler`` (which skips that optimizer step): without the guard the
running statistics become NaN for good; with ``AMP_BN_FIX_GUARD=1`` (the default) they are left as
they were, identical to a run that never saw the batch. The guard-off run is a child process
started with ``AMP_BN_FIX_GUARD=0``.

The default run takes about a minute on a 2-core AMD EPYC, most of it in the float16 model, whose
speed depends on the CPU's float16 support; every figure it prints depends on the CPU too. The time grows
with ``--steps``::

    python examples/numerics_study.py                 # writes numerics_study.png here
    python examples/numerics_study.py --steps 40 --out study.png --json study.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import subprocess
import sys
import time
from typing import Dict, Iterator, List, NamedTuple, Optional, Tuple

import torch
from torch import nn

import amp_bn_fix

FP16_MAX = torch.finfo(torch.float16).max
# A float16 model needs its loss scaled or the gradients reaching the first conv underflow; a
# static scale, because GradScaler refuses to unscale float16 gradients.
HALF_LOSS_SCALE = 1024.0
# The .half() + shim run keeps BatchNorm FP32 inside the model: the default, master, leaves its
# float16 buffers holding inf at this variance (see the module docstring).
HALF_KEEP_FP32 = "all"


# --------------------------------------------------------------------------------------- data, model


def make_data(n: int, generator: torch.Generator) -> Tuple[torch.Tensor, torch.Tensor]:
    """``n`` 3x16x16 images of gratings in one of four orientations, as 12-bit counts, and labels."""
    label = torch.randint(0, 4, (n,), generator=generator)
    angle = label.float() * math.pi / 4
    v, u = torch.meshgrid(torch.arange(16.0), torch.arange(16.0), indexing="ij")
    freq = (0.15 + 0.15 * torch.rand(n, generator=generator)) * 2 * math.pi
    phase = torch.rand(n, generator=generator) * 2 * math.pi
    along = u * torch.cos(angle)[:, None, None] + v * torch.sin(angle)[:, None, None]
    wave = torch.sin(freq[:, None, None] * along + phase[:, None, None])
    colour = 0.5 + 0.5 * torch.rand(n, 3, generator=generator)
    noise = 400 * torch.randn(n, 3, 16, 16, generator=generator)
    image = 2048 + 1000 * wave[:, None] * colour[:, :, None, None] + noise
    return image.clamp(0, 4095).round(), label


class Net(nn.Module):
    """Conv-BN-ReLU stem, one residual block (two BatchNorms), global pooling, linear head."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU(), nn.MaxPool2d(2)
        )
        self.conv1 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        # The residual add runs in the BatchNorm output's dtype: that is where the policy shows.
        x = torch.relu(x + self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))))
        return self.head(x.mean((2, 3)))


def batch_norms(model: nn.Module) -> List[nn.modules.batchnorm._BatchNorm]:
    return [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


def stats_snapshot(model: nn.Module) -> Tuple[List[float], List[float]]:
    """All running means and all running variances, concatenated over the BatchNorm layers."""
    bns = batch_norms(model)
    mean = torch.cat([bn.running_mean.double() for bn in bns])
    var = torch.cat([bn.running_var.double() for bn in bns])
    return mean.tolist(), var.tolist()


def relative_error(values, reference) -> float:
    """``|values - reference| / |reference|`` (2-norms); inf when ``values`` is not finite."""
    a, b = torch.as_tensor(values, dtype=torch.float64), torch.as_tensor(reference, dtype=torch.float64)
    if not torch.isfinite(a).all():
        return math.inf
    return float((a - b).norm() / b.norm())


class ExactStats:
    """What each BatchNorm's running stats should be: an fp64 running average of the batch
    statistics of the inputs it actually received. The gap to the real buffers is the error of
    the buffers' own arithmetic, apart from any difference in the weights' training.
    """

    def __init__(self, model: nn.Module) -> None:
        self.bns = batch_norms(model)
        self.inputs: Dict[int, torch.Tensor] = {}
        self.mean = [bn.running_mean.double().clone() for bn in self.bns]
        self.var = [bn.running_var.double().clone() for bn in self.bns]
        self.hooks = [bn.register_forward_pre_hook(self._keep(i)) for i, bn in enumerate(self.bns)]

    def _keep(self, index: int):
        def hook(module: nn.Module, args: tuple) -> None:
            self.inputs[index] = args[0].detach()

        return hook

    def update(self) -> float:
        """Fold in the batch just trained on; return the buffers' relative error (worse of mean, var)."""
        for i, bn in enumerate(self.bns):
            x = self.inputs[i].double()
            self.mean[i] = (1 - bn.momentum) * self.mean[i] + bn.momentum * x.mean((0, 2, 3))
            self.var[i] = (1 - bn.momentum) * self.var[i] + bn.momentum * x.var((0, 2, 3), unbiased=True)
        mean = torch.cat([bn.running_mean for bn in self.bns])
        var = torch.cat([bn.running_var for bn in self.bns])
        return max(relative_error(mean, torch.cat(self.mean)), relative_error(var, torch.cat(self.var)))

    def remove(self) -> None:
        for hook in self.hooks:
            hook.remove()


# --------------------------------------------------------------------------------------------- runs


class Run(NamedTuple):
    name: str
    mode: str  # "fp32", "autocast" or "half"
    shim: bool
    policy: Optional[str] = None  # the amp_bn_fix.policy(...) scope for autocast runs


RUNS = (
    Run("fp32 reference", "fp32", shim=False),
    Run("autocast, native", "autocast", shim=False),
    Run("autocast + shim (fp32)", "autocast", shim=True, policy="fp32"),
    Run("autocast + shim (input)", "autocast", shim=True, policy="input"),
    Run("autocast + shim (autocast)", "autocast", shim=True, policy="autocast"),
    Run(".half(), native", "half", shim=False),
    Run(".half() + shim", "half", shim=True),
)


class Result(NamedTuple):
    run: str
    bn_out_dtype: str
    stats_dtype: str
    means: List[List[float]]  # running means after each step
    variances: List[List[float]]
    final_loss: float
    eval_accuracy: float
    ms_per_step: float
    tracking: List[float]  # buffers' error vs ExactStats after each step


class Progress:
    """tqdm when installed, else one line on stderr rewritten in place."""

    def __init__(self, total: int, desc: str) -> None:
        self.total, self.desc, self.count = total, desc, 0
        try:
            from tqdm import tqdm
        except ImportError:
            self.bar = None
        else:
            self.bar = tqdm(total=total, desc=f"{desc:<34}", file=sys.stderr, leave=False)

    def update(self) -> None:
        self.count += 1
        if self.bar is not None:
            self.bar.update()
        elif self.count % 10 == 0 or self.count == self.total:
            sys.stderr.write(f"\r{self.desc:<34} step {self.count}/{self.total}")
            sys.stderr.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        else:
            sys.stderr.write("\r" + " " * 60 + "\r")
            sys.stderr.flush()


@contextlib.contextmanager
def precision(run: Run, dtype: torch.dtype) -> Iterator[None]:
    """The autocast context of a run, with its amp_bn_fix policy scope."""
    with torch.autocast("cpu", dtype=dtype, enabled=run.mode == "autocast"):
        if run.policy is None:
            yield
        else:
            with amp_bn_fix.policy(run.policy):
                yield


def train(run: Run, data: Dict[str, torch.Tensor], args: argparse.Namespace, inf_batch_at: Optional[int] = None) -> Result:
    """Train one run from the same initial weights and batch order; evaluate on held-out data.

    With ``inf_batch_at``, one extra batch whose first pixel is ``inf`` is trained on just before
    that step; the GradScaler skips its optimizer step, so only BatchNorm statistics can change.
    """
    if run.shim:
        amp_bn_fix.enable()
    else:
        amp_bn_fix.disable()
    torch.manual_seed(0)
    model = Net(args.width)
    input_dtype = torch.float32
    if run.mode == "half":
        with amp_bn_fix.configure(keep_fp32=HALF_KEEP_FP32):
            model.half()
        input_dtype = torch.float16
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4)
    # Cosine decay lets the weights settle, so the running stats can catch up with them.
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5 * (1 + math.cos(math.pi * s / args.steps)))
    scaler = torch.amp.GradScaler("cpu", enabled=run.mode == "autocast")
    out_dtypes: List[torch.dtype] = []
    hook = model.stem[1].register_forward_hook(lambda m, i, o: out_dtypes.append(o.dtype))
    exact = ExactStats(model)
    autocast_dtype = getattr(torch, args.autocast_dtype)

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        with precision(run, autocast_dtype):
            loss = nn.functional.cross_entropy(model(x.to(input_dtype)).float(), y)
        optimizer.zero_grad(set_to_none=True)
        if run.mode == "half":
            (loss * HALF_LOSS_SCALE).backward()
            for p in model.parameters():
                p.grad.div_(HALF_LOSS_SCALE)
        else:
            scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        return loss.item()

    order = torch.Generator().manual_seed(1)
    means, variances, losses, times, tracking = [], [], [], [], []
    progress = Progress(args.steps, run.name + (" + inf batch" if inf_batch_at is not None else ""))
    for i in range(args.steps):
        index = torch.randint(0, len(data["y"]), (args.batch,), generator=order)
        x, y = data["x"][index], data["y"][index]
        if i == inf_batch_at:
            bad = x.clone()
            bad[0, 0, 0, 0] = math.inf
            step(bad, y)
        start = time.perf_counter()
        losses.append(step(x, y))
        times.append(time.perf_counter() - start)
        schedule.step()
        tracking.append(exact.update())  # the inf batch above is left out: the guard promises that
        mean, var = stats_snapshot(model)
        means.append(mean)
        variances.append(var)
        progress.update()
    progress.close()
    hook.remove()
    exact.remove()

    model.eval()
    correct = 0
    with torch.no_grad(), precision(run, autocast_dtype):
        for x, y in zip(data["x_eval"].split(256), data["y_eval"].split(256)):
            correct += int((model(x.to(input_dtype)).argmax(1) == y).sum())
    amp_bn_fix.enable()
    tail = max(1, args.steps // 10)
    return Result(
        run=run.name + (" + inf batch" if inf_batch_at is not None else ""),
        bn_out_dtype=short(out_dtypes[0]),
        stats_dtype=short(model.stem[1].running_var.dtype),
        means=means,
        variances=variances,
        final_loss=sum(losses[-tail:]) / tail,
        eval_accuracy=correct / len(data["y_eval"]),
        ms_per_step=1000 * statistics.median(times),
        tracking=tracking,
    )


def short(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


# ------------------------------------------------------------------------------- the guard scenario


def guard_child(args: argparse.Namespace, data: Dict[str, torch.Tensor]) -> None:
    """In a child process started with AMP_BN_FIX_GUARD set: one guarded/unguarded run, as JSON."""
    result = train(Run("autocast + shim (fp32)", "autocast", shim=True, policy="fp32"), data, args, args.inf_batch_at)
    json.dump(result._asdict(), sys.stdout)


def guard_run_in_child(args: argparse.Namespace, guard: bool) -> Result:
    """Run the shim with the guard set by the environment variable, as the documented way to set it."""
    env = dict(os.environ, AMP_BN_FIX_GUARD="1" if guard else "0")
    command = [sys.executable, os.path.abspath(__file__), "--guard-child", "--steps", str(args.steps),
               "--batch", str(args.batch), "--width", str(args.width), "--lr", str(args.lr),
               "--threads", str(args.threads), "--train-size", str(args.train_size), "--eval-size", str(args.eval_size),
               "--autocast-dtype", args.autocast_dtype]
    done = subprocess.run(command, env=env, stdout=subprocess.PIPE, check=True)
    return Result(**json.loads(done.stdout))


def max_difference(result: Result, clean: Result) -> float:
    """Largest absolute difference of the final running stats between two runs (nan if non-finite)."""
    a = torch.tensor(result.means[-1] + result.variances[-1], dtype=torch.float64)
    b = torch.tensor(clean.means[-1] + clean.variances[-1], dtype=torch.float64)
    return float((a - b).abs().max())


# ---------------------------------------------------------------------------------- table and plot


def first_nonfinite(errors: List[float]) -> Optional[int]:
    return next((i + 1 for i, e in enumerate(errors) if not math.isfinite(e)), None)


def format_error(errors: List[float]) -> str:
    step = first_nonfinite(errors)
    return f"non-finite @{step}" if step is not None else f"{errors[-1]:.2e}"


def print_table(header: List[str], rows: List[List[str]]) -> None:
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows)]
    for line in (header, ["-" * w for w in widths], *rows):
        print("  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(line, widths))))


class Style(NamedTuple):
    """How a run is drawn, the same in every panel."""

    colour: str
    line: str = "-"
    width: float = 1.8
    marker: Optional[str] = None  # drawn every few steps, so that a line on top of another shows


STYLES = {
    "fp32 reference": Style("C0", width=2.2),
    # Native autocast and the input/autocast policies give the same statistics: native is drawn
    # wide underneath, the two policies over it dashed and dotted, with markers.
    "autocast, native": Style("C1", width=4.0),
    "autocast + shim (fp32)": Style("C2", width=2.0),
    "autocast + shim (input)": Style("C3", "--", 1.6, "s"),
    "autocast + shim (autocast)": Style("C4", ":", 2.2, "^"),
    ".half(), native": Style("C5", "--", 1.8),
    ".half() + shim": Style("C6", width=1.6),
}


def coinciding(series: Dict[str, List[float]]) -> Dict[str, str]:
    """{run: the earlier run it equals at every step} for runs whose values are identical."""
    same: Dict[str, str] = {}
    names = list(series)
    for i, name in enumerate(names):
        for earlier in names[:i]:
            if earlier not in same and series[name] == series[earlier]:
                same[name] = earlier
                break
    return same


def plot(path: str, panels: List[Tuple[str, str, Dict[str, List[float]]]], styles: Dict[str, Style],
         marks: Dict[int, int], title: str, headline: str, shared_legend: int = 3) -> bool:
    """One log-scale panel per (title, y label, {run: error per step}); False without matplotlib.

    Non-finite values are drawn in a labelled band above the finite ones, from the step where
    they start. The first ``shared_legend`` panels show the same runs and share one legend above
    them; the others have their own, below. ``marks`` maps a panel index to a step to mark with a
    vertical line (the inf batch).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False

    fig, axes = plt.subplot_mosaic([["head", "head"], [0, 1], [2, 3]], figsize=(14, 11.5),
                                   height_ratios=[0.5, 3, 3], layout="constrained")
    shared: Dict[str, object] = {}
    for index, (subtitle, ylabel, series) in enumerate(panels):
        ax = axes[index]
        finite = [e for errs in series.values() for e in errs if math.isfinite(e) and e > 0]
        low = 10 ** math.floor(math.log10(min(finite, default=1e-8)))
        high = 10 ** math.ceil(math.log10(max(finite, default=1.0)) + 0.3)
        # Non-finite values go in a band one decade above the finite ones: lines in its lower
        # part, one height per run so that none hides another, its label in the upper part.
        band_low, band_high = high * 2, high * 20
        broken = [name for name, errs in series.items() if first_nonfinite(errs) is not None]
        same = coinciding(series)
        top: Dict[int, Tuple[float, str]] = {}  # step where runs turn non-finite -> highest marker there
        for order, (name, errs) in enumerate(series.items()):
            style = styles[name]
            steps = range(1, len(errs) + 1)
            shown = [e if math.isfinite(e) and e > 0 else math.nan for e in errs]
            bad = first_nonfinite(errs)
            label = name + (f" (same values as {same[name]})" if name in same else "")
            marker = dict(marker=style.marker, markevery=(7 * order % 30, 30), ms=6) if style.marker else {}
            (line,) = ax.plot(steps, shown, style.line, lw=style.width, color=style.colour, label=label, **marker)
            if bad is not None:
                height = band_low * (band_high / band_low) ** (0.6 * (broken.index(name) + 1) / (len(broken) + 1))
                ax.plot(steps, [height if not math.isfinite(e) else math.nan for e in errs], style.line,
                        lw=max(style.width, 2.5), color=style.colour)
                ax.plot([bad], [height], marker="X", ms=11, color=style.colour, ls="none")
                top.setdefault(bad, (height, style.colour))
                top[bad] = max(top[bad], (height, style.colour))
            if index < shared_legend:
                shared.setdefault(name, line)
        for step, (height, colour) in top.items():
            ax.annotate(f"step {step}", (step, height), xytext=(0, 7), textcoords="offset points",
                        ha="center", va="bottom", fontsize=8, color="0.25")
        if broken:
            ax.axhspan(band_low, band_high, color="0.92", zorder=0)
            ax.text(0.01, band_low * (band_high / band_low) ** 0.8, "non-finite (inf/NaN)",
                    transform=ax.get_yaxis_transform(), va="center", ha="left", fontsize=8.5, color="0.35")
        if index in marks:
            ax.axvline(marks[index], color="grey", lw=0.8, ls=":")
        ax.set_yscale("log")
        ax.set_ylim(low / 2, band_high if broken else high)
        ax.set_xlabel("training step")
        ax.set_ylabel(ylabel)
        ax.set_title(subtitle, fontsize=10)
        ax.grid(True, which="major", alpha=0.3)
        if index >= shared_legend:
            ax.legend(fontsize=8.5, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=1, frameon=False)
    head = axes["head"]
    head.axis("off")
    head.set_title(f"{title}\n{headline}", fontsize=10.5)
    head.legend(list(shared.values()), [line.get_label() for line in shared.values()], loc="center", ncol=3,
                fontsize=8.5, frameon=False)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def headline(results: List[Result], guard_labels: List[str], guarded: List[Result]) -> str:
    """What the study shows, in three lines, from its own results."""
    run = {r.run: r for r in results}
    native, shim = run["autocast, native"], run["autocast + shim (fp32)"]
    half, half_shim = run[".half(), native"], run[".half() + shim"]

    def stats(result: Result) -> str:
        step = first_nonfinite(result.tracking)
        return f"non-finite from step {step}" if step is not None else f"within {result.tracking[-1]:.1e} of exact"

    def accuracy(result: Result) -> str:
        return f"eval acc {100 * result.eval_accuracy:.1f}%"

    def after(result: Result, base: Result) -> str:
        if not all(math.isfinite(v) for v in result.means[-1] + result.variances[-1]):
            return "NaN"
        return "as without that batch" if max_difference(result, base) == 0 else "finite"

    states = [f"{after(guarded[0], native)} natively"]
    states += [f"{after(r, shim)} with the guard {l.rsplit(' ', 1)[-1]}" for l, r in zip(guard_labels[1:], guarded[1:])]
    accuracies = ", ".join(f"{100 * r.eval_accuracy:.1f}%" for r in guarded)
    return (
        f"BatchNorm output under autocast: {native.bn_out_dtype} natively, {shim.bn_out_dtype} with the shim (fp32 policy).\n"
        f".half() model: running stats {half.stats_dtype}, {stats(half)} natively ({accuracy(half)}); "
        f"{half_shim.stats_dtype}, {stats(half_shim)} with the shim ({accuracy(half_shim)}).\n"
        f"One inf batch (GradScaler skips its step): running stats {', '.join(states)} (eval acc {accuracies})."
    )


def draw(path: str, args: argparse.Namespace, results: List[Result], guard_labels: List[str],
         guarded: List[Result]) -> bool:
    """The study's figure: running-stat errors per step, four panels; False without matplotlib."""
    reference = results[0]
    errs = {r.run: run_errors(r, reference) for r in results[1:]}
    panels = [
        ("running_mean vs the FP32 run", "relative error", {k: v[0] for k, v in errs.items()}),
        ("running_var vs the FP32 run", "relative error", {k: v[1] for k, v in errs.items()}),
        ("running stats vs fp64 running average of each run's own batch statistics",
         "relative error (worse of mean, var)", {r.run: r.tracking for r in results}),
        (f"one batch with an inf pixel before step {args.inf_batch_at + 1}, GradScaler on",
         "relative error vs fp64 average of the other batches", {l: r.tracking for l, r in zip(guard_labels, guarded)}),
    ]
    title = (f"BatchNorm running statistics: CPU autocast {args.autocast_dtype}, .half() = float16, "
             f"12-bit inputs (running_var ~ {max(reference.variances[-1]):.0e}), {args.steps} steps")
    styles = dict(STYLES)
    styles[guard_labels[0]] = STYLES["autocast, native"]
    for label in guard_labels[1:]:
        styles[label] = STYLES["autocast + shim (fp32)"] if label.endswith("guard on") else Style("C7", "--", 2.0)
    return plot(path, panels, styles, {3: args.inf_batch_at + 1}, title, headline(results, guard_labels, guarded))


def run_errors(result: Result, reference: Result) -> Tuple[List[float], List[float]]:
    """Per step, the relative error of the running means and of the running variances against ``reference``'s."""
    return ([relative_error(m, r) for m, r in zip(result.means, reference.means)],
            [relative_error(v, r) for v, r in zip(result.variances, reference.variances)])


# --------------------------------------------------------------------------------------------- main


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300, help="training steps per run (default 300)")
    parser.add_argument("--batch", type=int, default=32, help="batch size (default 32)")
    parser.add_argument("--width", type=int, default=8, help="channels of the CNN (default 8)")
    parser.add_argument("--lr", type=float, default=0.02, help="peak SGD learning rate (default 0.02)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1: this small model gains little from more, and the "
                             "times per step stay comparable on a busy machine)")
    parser.add_argument("--train-size", type=int, default=4096)
    parser.add_argument("--eval-size", type=int, default=1024)
    parser.add_argument("--autocast-dtype", choices=("bfloat16", "float16"), default="bfloat16",
                        help="CPU autocast dtype (default bfloat16; float16 is much slower on most CPUs)")
    parser.add_argument("--out", default="numerics_study.png",
                        help="the plot to write (default: numerics_study.png in the current directory; '' for none)")
    parser.add_argument("--json", default="", help="also write the results as JSON to this file")
    parser.add_argument("--guard-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steps < 3:
        parser.error(f"--steps must be at least 3, got {args.steps}")
    args.inf_batch_at = args.steps // 2
    return args


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    generator = torch.Generator().manual_seed(0)
    x, y = make_data(args.train_size, generator)
    x_eval, y_eval = make_data(args.eval_size, generator)
    data = {"x": x, "y": y, "x_eval": x_eval, "y_eval": y_eval}
    if args.guard_child:
        guard_child(args, data)
        return 0

    guard = amp_bn_fix.get_config().guard
    print(f"amp_bn_fix {amp_bn_fix.__version__}, torch {torch.__version__}, {torch.get_num_threads()} thread(s); "
          f"autocast dtype {args.autocast_dtype}; {args.steps} steps of batch {args.batch}; "
          f"policy={amp_bn_fix.get_policy()}, keep_fp32={amp_bn_fix.get_config().keep_fp32} "
          f"(the .half() + shim run: {HALF_KEEP_FP32}), guard={int(guard)}")
    results = [train(run, data, args) for run in RUNS]
    reference = results[0]
    clean = {r.run: r for r in results}
    guarded = [
        train(Run("autocast, native", "autocast", shim=False), data, args, args.inf_batch_at),
        train(Run("autocast + shim (fp32)", "autocast", shim=True, policy="fp32"), data, args, args.inf_batch_at),
        guard_run_in_child(args, not guard),
    ]
    guard_labels = ["autocast, native", f"autocast + shim, guard {'on' if guard else 'off'}",
                    f"autocast + shim, guard {'off' if guard else 'on'}"]

    errs = {r.run: run_errors(r, reference) for r in results[1:]}
    print(f"\nLargest running_var in the FP32 reference: {max(reference.variances[-1]):.3g} "
          f"(float16 max: {FP16_MAX:.0f})")
    print("err vs FP32: relative error of the running stats against the FP32 run's at the same step;")
    print("err vs exact: against an fp64 running average of the batch statistics each run's BNs received.\n")
    rows = []
    for r in results:
        vs_fp32 = ["-", "-"] if r is reference else [format_error(e) for e in errs[r.run]]
        rows.append([r.run, r.bn_out_dtype, r.stats_dtype, *vs_fp32, format_error(r.tracking),
                     f"{r.final_loss:.4f}", f"{100 * r.eval_accuracy:.1f}%", f"{r.ms_per_step:.1f}"])
    print_table(["run", "BN out", "stats", "mean err vs FP32", "var err vs FP32", "err vs exact",
                 "final loss", "eval acc", "ms/step"], rows)

    print(f"\nOne extra batch with an inf pixel before step {args.inf_batch_at + 1} (GradScaler skips its step):\n")
    bases = [clean["autocast, native"], clean["autocast + shim (fp32)"], clean["autocast + shim (fp32)"]]
    rows = []
    for label, result, base in zip(guard_labels, guarded, bases):
        finite = all(math.isfinite(v) for v in result.means[-1] + result.variances[-1])
        rows.append([label, "yes" if finite else "NO", format_error(result.tracking),
                     f"{max_difference(result, base):.3g}", f"{100 * result.eval_accuracy:.1f}%"])
    print_table(["run", "stats finite", "err vs exact", "max |diff| vs run without that batch", "eval acc"], rows)

    if args.out:
        if draw(args.out, args, results, guard_labels, guarded):
            print(f"\nplot written to {args.out}")
        else:
            print("\n(no plot: pip install matplotlib, or the examples extra: pip install -e '.[examples]')")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": [r._asdict() for r in results],
                       "errors": {k: {"mean": v[0], "var": v[1]} for k, v in errs.items()},
                       "guard": {label: r._asdict() for label, r in zip(guard_labels, guarded)}}, f)
    print(f"\ndone in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
