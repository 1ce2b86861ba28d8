"""The bug report (pytorch#88929) verbatim on CUDA; skipped without a CUDA device."""

import pytest
import torch
from torch import nn

import amp_bn_fix

pytestmark = pytest.mark.cuda


def run_report(autocast):
    net = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 5)).cuda()
    o = torch.randn(2, 4).cuda()
    dtypes = []
    with autocast():
        for layer in net:
            o = layer(o)
            dtypes.append(o.dtype)
    return net, dtypes


@pytest.mark.parametrize(
    "autocast",
    [lambda: torch.cuda.amp.autocast(), lambda: torch.autocast("cuda")],
    ids=["torch.cuda.amp.autocast", "torch.autocast"],
)
def test_bug_report_on_cuda(autocast):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.cuda.amp.autocast is deprecated, still used
        net, dtypes = run_report(autocast)
        assert dtypes == [torch.float16, torch.float32, torch.float16]
        assert net[1].running_mean.dtype is torch.float32 and net[1].running_var.dtype is torch.float32
        amp_bn_fix.disable()
        assert run_report(autocast)[1] == [torch.float16] * 3


def test_bn_first_layer_on_cuda_stays_fp32():
    net = nn.Sequential(nn.BatchNorm1d(4)).cuda()
    with torch.autocast("cuda"):
        assert net(torch.randn(2, 4).cuda()).dtype is torch.float32


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_cuda_numerics_match_fp64(dtype):
    import copy

    torch.manual_seed(0)
    bn = nn.BatchNorm2d(8).cuda()
    x = (torch.randn(16, 8, 7, 7, device="cuda") * 3 + 1).to(dtype)
    ref = copy.deepcopy(bn).double()
    expected = ref(x.double())
    with torch.autocast("cuda", dtype=dtype):
        out = bn(x)
    assert out.dtype is torch.float32
    assert (out.double() - expected).abs().max().item() < 2e-5
    torch.testing.assert_close(bn.running_var.double(), ref.running_var, rtol=1e-6, atol=1e-6)


# --- what tools/gpu_check.sh runs as sections of its own (by these names: sync_debug, cuda_graph,
# reduce_overhead) -------------------------------------------------------------------------------

POLICIES = ["fp32", "input", "autocast"]


def small_net() -> nn.Module:
    """Conv + BN, a residual conv + BN block and a classifier, on CUDA."""

    class Residual(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv, self.bn = nn.Conv2d(16, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(x + self.bn(self.conv(x)))

    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(), Residual(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10)).cuda()


def loss_of(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    # No cross-entropy: its target checks are not this package's to vouch for; autocast's weight
    # cache stays off, as CUDA graphs require.
    with torch.autocast("cuda", dtype=torch.float16, cache_enabled=False):
        out = model(x)
    return out.float().square().mean()


def batch_norms(model: nn.Module):
    return [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]


@pytest.mark.parametrize("policy", POLICIES)
def test_a_training_step_and_an_eval_forward_make_no_host_sync_debug(policy):
    # The shim decides the guard on the device and counts there: nothing it adds may wait for the GPU.
    torch.manual_seed(0)
    model = small_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(8, 3, 16, 16, device="cuda")

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss_of(model, x).backward()
        opt.step()
        model.eval()
        with torch.no_grad():
            loss_of(model, x)
        model.train()

    with amp_bn_fix.configure(policy=policy):
        step()  # lazy initialisation (cuDNN, the allocator) may synchronise once
        torch.cuda.synchronize()
        before = sum(amp_bn_fix.report()["handled"].values())
        torch.cuda.set_sync_debug_mode("error")
        try:
            step()
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert sum(amp_bn_fix.report()["handled"].values()) - before == 2 * 2 * len(batch_norms(model))


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")], ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("policy", POLICIES)
def test_the_guard_keeps_the_stats_through_a_non_finite_fp16_batch_with_no_host_sync_debug(policy, bad):
    # A 16-bit input, as a conv's output under fp16 autocast: a call the shim handles, so what keeps
    # the stats is its guard, decided on the device. (An FP32 input would be left to torch, whose
    # own update takes the inf.)
    torch.manual_seed(0)
    model = nn.Sequential(nn.BatchNorm1d(8)).cuda()
    bn = model[0]
    with torch.no_grad():
        bn.running_mean.copy_(torch.randn(8, device="cuda"))
        bn.running_var.uniform_(0.5, 2.0)
    x = (torch.randn(32, 8, device="cuda") * 3 + 2).half()
    with amp_bn_fix.configure(policy=policy):
        with torch.autocast("cuda", dtype=torch.float16):
            model(x)  # lazy initialisation may synchronise once; a finite batch, so the stats update
        x[5, 3] = bad
        before = (bn.running_mean.clone(), bn.running_var.clone())
        handled = sum(amp_bn_fix.report()["handled"].values())
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            with torch.autocast("cuda", dtype=torch.float16):
                model(x)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert sum(amp_bn_fix.report()["handled"].values()) - handled == 1  # the shim's call, not torch's
    assert amp_bn_fix.report(model)["guard_skips"].get("0") == 1
    # The guard's promise: the running stats as they were before the call, bit for bit.
    for after, was in zip((bn.running_mean, bn.running_var), before):
        assert after.dtype is torch.float32
        assert torch.equal(after.view(torch.int32), was.view(torch.int32))


def test_guard_decisions_made_on_a_side_stream_are_counted_on_the_default_one():
    # Warm-up steps on a side stream (as before a graph capture), one with a non-finite batch, then
    # report() on the default stream: the side stream's flags are summed after it, not before.
    model = nn.Sequential(nn.BatchNorm1d(8)).cuda()
    batches = [(torch.randn(32, 8, device="cuda") * 3 + 2).half() for _ in range(70)]  # past one fold
    batches[40][5, 3] = float("inf")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.autocast("cuda", dtype=torch.float16):
        for x in batches:
            model(x)
    assert amp_bn_fix.report(model)["guard_skips"] == {"0": 1}


def _warm_up(step, graphed: nn.Module, eager: nn.Module, batches) -> None:
    """The steps before a capture, on a side stream as torch's documentation asks; the eager twin
    takes the same steps."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for x in batches:
            step(graphed, x)
    torch.cuda.current_stream().wait_stream(side)
    for x in batches:
        step(eager, x)


@pytest.mark.parametrize("policy", POLICIES)
def test_a_training_step_captured_in_a_cuda_graph_replays_as_eager_runs_it(policy):
    import copy

    torch.manual_seed(0)
    eager = small_net()
    graphed = copy.deepcopy(eager)
    optimizers = {id(m): torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (eager, graphed)}
    data = [torch.randn(8, 3, 16, 16, device="cuda") for _ in range(6)]

    def step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        optimizers[id(model)].zero_grad(set_to_none=True)
        loss = loss_of(model, x)
        loss.backward()
        optimizers[id(model)].step()
        return loss

    with amp_bn_fix.configure(policy=policy):
        _warm_up(step, graphed, eager, data[:3])
        static_x = data[0].clone()
        graph = torch.cuda.CUDAGraph()
        optimizers[id(graphed)].zero_grad(set_to_none=True)
        with torch.cuda.graph(graph):
            static_loss = loss_of(graphed, static_x)
            static_loss.backward()
            optimizers[id(graphed)].step()
        for x in data[3:]:
            static_x.copy_(x)
            graph.replay()
            expected = step(eager, x)
            torch.testing.assert_close(static_loss, expected, rtol=1e-3, atol=1e-5)
    torch.cuda.synchronize()
    for got, want in zip(batch_norms(graphed), batch_norms(eager)):
        assert got.running_mean.dtype is torch.float32
        torch.testing.assert_close(got.running_mean, want.running_mean, rtol=1e-3, atol=1e-5)
        torch.testing.assert_close(got.running_var, want.running_var, rtol=1e-3, atol=1e-5)
        assert got.num_batches_tracked.item() == want.num_batches_tracked.item() == 6
    for got, want in zip(graphed.parameters(), eager.parameters()):
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-5)


def _int_bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().view(torch.int32 if t.element_size() == 4 else torch.int16)


@pytest.mark.parametrize("policy", POLICIES)
def test_a_captured_training_step_replays_a_non_finite_batch_with_the_guard_and_counts_only_the_capture(policy):
    # Forward and backward (no optimizer step: a non-finite batch would put NaN into the weights, and
    # GradScaler's skip reads the device, which a capture does not allow). The eager twin takes the
    # same steps, the non-finite batch included.
    import copy

    torch.manual_seed(0)
    eager = small_net()
    graphed = copy.deepcopy(eager)
    data = [torch.randn(8, 3, 16, 16, device="cuda") for _ in range(6)]
    bad = 4  # the second replay's batch
    data[bad][0, 0, 0, 0] = float("inf")

    def step(model: nn.Module, x: torch.Tensor) -> None:
        model.zero_grad(set_to_none=True)
        loss_of(model, x).backward()

    names = [name for name, m in graphed.named_modules() if isinstance(m, nn.BatchNorm2d)]
    with amp_bn_fix.configure(policy=policy):
        _warm_up(step, graphed, eager, data[:3])
        torch.cuda.synchronize()
        before = amp_bn_fix.report()
        static_x = data[0].clone()
        graph = torch.cuda.CUDAGraph()
        graphed.zero_grad(set_to_none=True)
        with torch.cuda.graph(graph):
            loss_of(graphed, static_x).backward()
            with pytest.raises(RuntimeError, match="CUDA graph is captured"):
                amp_bn_fix.report()  # it would read the device: refused, and the capture goes on
        for i in range(3, len(data)):
            static_x.copy_(data[i])
            kept = [(bn.running_mean.clone(), bn.running_var.clone()) for bn in batch_norms(graphed)]
            graph.replay()
            step(eager, data[i])
            if i == bad:  # the guard held every BatchNorm's stats, bit for bit
                for bn, (mean, var) in zip(batch_norms(graphed), kept):
                    assert torch.equal(_int_bits(bn.running_mean), _int_bits(mean))
                    assert torch.equal(_int_bits(bn.running_var), _int_bits(var))
    torch.cuda.synchronize()
    for got, want in zip(batch_norms(graphed), batch_norms(eager)):
        torch.testing.assert_close(got.running_mean, want.running_mean, rtol=1e-3, atol=1e-5)
        torch.testing.assert_close(got.running_var, want.running_var, rtol=1e-3, atol=1e-5)
        assert got.num_batches_tracked.item() == want.num_batches_tracked.item() == 6
    after = amp_bn_fix.report(graphed)
    # The capture is counted once, as handled and as captured; the replays nowhere; the eager
    # twin's calls as always.
    handled = sum(after["handled"].values()) - sum(before["handled"].values())
    assert handled == len(names) + len(data[3:]) * len(names)
    captured = after["captured"].get(policy, 0) - before.get("captured", {}).get(policy, 0)
    assert captured == len(names)
    # The guard's decisions in the replays are not counted (the eager twin's are).
    assert not set(after["guard_skips"]) & set(names)
    eager_skips = amp_bn_fix.report(eager)["guard_skips"]
    assert {name: eager_skips.get(name) for name in names} == {name: 1 for name in names}


@pytest.mark.parametrize("autocast, start", [(True, "cast"), (False, "cast"), (True, "fresh copy")],
                         ids=["autocast", "no-autocast", "autocast-no-master-before-the-capture"])
def test_a_half_models_master_captured_in_a_cuda_graph_stays_fp32_accurate(autocast, start):
    # A model cast with .half() keeps each BatchNorm's FP32 master beside its 16-bit buffers. The
    # replays update the master (not the rounded buffers), a checkpoint loaded between replays is
    # what the next replay goes on from, and a master the capture had to make is started from the
    # buffers once, not at every replay. Reference: the same updates in float64.
    import copy

    from _bounds import assert_near
    from _shared import ORIGINAL
    from amp_bn_fix import _master

    torch.manual_seed(0)
    fp32 = nn.BatchNorm2d(8)
    with torch.no_grad():
        fp32.running_mean.uniform_(-1, 1)
        fp32.running_var.uniform_(0.5, 2)
    mean64, var64 = fp32.running_mean.double().cuda(), fp32.running_var.double().cuda()
    model = nn.Sequential(fp32).cuda().half()  # the cast starts the master from the FP32 stats

    def batch(step: int) -> torch.Tensor:
        generator = torch.Generator(device="cuda").manual_seed(step)
        # Small updates (a few thousandths a step, near 2) that 16-bit stats lose.
        return (torch.randn(16, 8, 8, 8, device="cuda", generator=generator) * 0.05 + 2).half()

    def forward(x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.float16, enabled=autocast, cache_enabled=False):
            return model(x)

    def reference(x: torch.Tensor) -> None:
        ORIGINAL(x.double(), mean64, var64, None, None, True, 0.1, 1e-5)
        # What a master started again from the 16-bit buffers at every replay would hold.
        ORIGINAL(x.double(), rounded[0], rounded[1], None, None, True, 0.1, 1e-5)
        for stat in rounded:
            stat.copy_(stat.half().double())

    rounded = [mean64.clone(), var64.clone()]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for step in range(3):
            x = batch(step)
            forward(x)
            reference(x)
    torch.cuda.current_stream().wait_stream(side)
    if start == "fresh copy":  # no master: the capture makes one, which holds nothing yet
        model = copy.deepcopy(model)
        assert _master.peek(model[0].running_mean, model[0].running_var) is None
        mean64, var64 = model[0].running_mean.double(), model[0].running_var.double()
        rounded = [mean64.clone(), var64.clone()]
    bn = model[0]
    before = amp_bn_fix.report().get("captured", {})
    static_x = batch(0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward(static_x)
    for step in range(3, 203):
        if step == 103:  # a checkpoint loaded between replays: the next replay goes on from it
            state = {k: v.clone() for k, v in model.state_dict().items()}
            state["0.running_mean"] += 0.25
            model.load_state_dict(state)
            mean64, var64 = bn.running_mean.double(), bn.running_var.double()
            rounded = [mean64.clone(), var64.clone()]
        x = batch(step)
        static_x.copy_(x)
        graph.replay()
        reference(x)
    torch.cuda.synchronize()
    assert sum(amp_bn_fix.report()["captured"].values()) - sum(before.values()) == 1
    master = _master.peek(bn.running_mean, bn.running_var)
    assert master is not None and master.dtype is torch.float32
    assert bn.running_mean.dtype is torch.float16
    # FP32 accuracy, as in test_half_models: about ten updates' errors (the momentum forgets older ones).
    n = 16 * 8 * 8
    assert_near(master[0], mean64, n, ops=30, scale=mean64.abs().max().item() + 1, what="mean")
    assert_near(master[1], var64, n, ops=30, scale=var64.abs().max().item(), what="var")
    assert torch.equal(bn.running_mean, master[0].half()) and torch.equal(bn.running_var, master[1].half())
    ours = (master[1].double() - var64).abs().max()
    theirs = (rounded[1] - var64).abs().max()
    assert ours < theirs / 10


@pytest.mark.slow
def test_compile_with_reduce_overhead_matches_eager():
    import copy

    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    eager = small_net()
    compiled_model = copy.deepcopy(eager)
    counters.clear()
    compiled = torch.compile(lambda x: loss_of(compiled_model, x), mode="reduce-overhead")
    for i in range(4):  # the first calls compile and record the graphs, the later ones replay them
        x = torch.randn(8, 3, 16, 16, device="cuda")
        torch.compiler.cudagraph_mark_step_begin()
        got = compiled(x)
        got.backward()
        want = loss_of(eager, x)
        want.backward()
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-5, msg=lambda m: f"call {i}: {m}")
    for got, want in zip(compiled_model.parameters(), eager.parameters()):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-2, atol=1e-4)
    for got, want in zip(batch_norms(compiled_model), batch_norms(eager)):
        torch.testing.assert_close(got.running_var, want.running_var, rtol=1e-3, atol=1e-5)
    # What the shim adds to the graph (its in-place running-stat update, the guard) keeps it graphable.
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])


@pytest.mark.parametrize("channels_last", [False, True], ids=["NCHW", "channels_last"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_torch_cuda_batch_norm_takes_a_16bit_input_with_fp32_parameters(dtype, training, channels_last):
    # The mixed call the input and autocast policies make on CUDA: torch's own kernel, no shim.
    amp_bn_fix.disable()
    torch.manual_seed(0)
    x = (torch.randn(16, 8, 7, 7, device="cuda") * 3 + 1).to(dtype)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    weight, bias = torch.rand(8, device="cuda") + 0.5, torch.randn(8, device="cuda")
    mean, var = torch.randn(8, device="cuda"), torch.rand(8, device="cuda") + 0.5
    stats = (mean.clone(), var.clone())
    out = torch.nn.functional.batch_norm(x, *stats, weight, bias, training, 0.1, 1e-5)
    expected = torch.nn.functional.batch_norm(x.double(), mean.double(), var.double(), weight.double(),
                                              bias.double(), training, 0.1, 1e-5)
    assert out.dtype is dtype and stats[0].dtype is torch.float32
    # One rounding of the output to 16 bits, relative to its largest value (eps: 2**-10 / 2**-7).
    eps = torch.finfo(dtype).eps
    assert (out.double() - expected).abs().max().item() <= eps * expected.abs().max().item()


# --- the fp32 policy's route without an FP32 copy of the input (conftest lowers its size threshold
# to 0, so every shape here takes it) --------------------------------------------------------------


@pytest.mark.parametrize("channels_last", [False, True], ids=["NCHW", "channels_last"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_the_fp32_route_matches_fp64_forward_and_backward(dtype, training, channels_last):
    from _bounds import assert_near

    torch.manual_seed(0)
    bn = nn.BatchNorm2d(8).cuda().train(training)
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5), bn.bias.normal_(), bn.running_mean.normal_(), bn.running_var.uniform_(0.5, 2)
    reference = nn.BatchNorm2d(8).double().cuda().train(training)
    reference.load_state_dict(bn.state_dict())
    x = (torch.randn(16, 8, 14, 14, device="cuda") * 3 + 1).to(dtype)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    x64 = x.double().requires_grad_()
    x.requires_grad_()
    grad = torch.randn(x.shape, device="cuda")
    with torch.autocast("cuda", dtype=dtype):
        out = bn(x)
    out.backward(grad)
    expected = reference(x64)
    expected.backward(grad.double())
    n = x.numel() // 8
    assert out.dtype is torch.float32 and x.grad.dtype is dtype
    assert_near(out, expected, n, what="output")
    assert_near(x.grad, x64.grad, n, what="input gradient")
    assert_near(bn.weight.grad, reference.weight.grad, n, what="weight gradient")
    assert_near(bn.running_var, reference.running_var, n, what="running var")


@pytest.mark.parametrize("running", [True, False], ids=["running-stats", "none"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_cudas_statistics_op_follows_the_rules_of_its_cpu_stand_in(dtype, running):
    # The route a CUDA call takes runs amp_bn_fix::batch_norm_stats on CPU in place of this op:
    # FP32 statistics (with or without running stats), the running stats updated alike.
    from amp_bn_fix import _kernels

    x = (torch.randn(8, 4, 16, 16, device="cuda") * 2 + 3).to(dtype)
    stats = (torch.zeros(4, device="cuda"), torch.ones(4, device="cuda")) if running else (None, None)
    cpu_stats = tuple(None if s is None else s.cpu() for s in stats)
    mean, var = torch.batch_norm_update_stats(x, *stats, 0.1)
    cpu_mean, cpu_var = _kernels._stand_in()(x.cpu(), *cpu_stats, 0.1)
    assert mean.dtype is var.dtype is cpu_mean.dtype is cpu_var.dtype is torch.float32
    torch.testing.assert_close(mean.cpu(), cpu_mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(var.cpu(), cpu_var, rtol=1e-5, atol=1e-6)
    for on_cuda, on_cpu in zip(stats, cpu_stats):
        if on_cuda is not None:
            torch.testing.assert_close(on_cuda.cpu(), on_cpu, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["train", "fwdbwd", "eval"])
def test_the_count_on_cuda_is_the_count_on_the_device_route(mode):
    # What tests/test_cost.py holds on CPU is what CUDA runs: the same kernels, bytes and launches.
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from _traffic import count_call

    shape = (16, 64, 32, 32)
    on_cuda = count_call(shape, torch.bfloat16, "fp32", mode, device="cuda")
    on_cpu = count_call(shape, torch.bfloat16, "fp32", mode, device="cpu")
    stand_in = {"batch_norm_stats": "batch_norm_update_stats"}
    assert [stand_in.get(name, name) for name in on_cpu.names()] == on_cuda.names()
    assert on_cuda.launches == on_cpu.launches
    assert abs(on_cuda.moved - on_cpu.moved) < 0.01 and abs(on_cuda.kept - on_cpu.kept) < 0.01
